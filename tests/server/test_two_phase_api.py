"""Two-phase recycles over HTTP (DESIGN's API table): `POST /v1/recycle` with
`"prepare": true` (and `"txid"` to join another part of the statement), then
`POST /v1/transactions/{txid}/commit|abort|renew`; the daemon rolls back a prepared
transaction whose lease passes, even across a kill -9."""

from __future__ import annotations

import time
from pathlib import Path

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, MakeDaemon


def _table(d: Daemon) -> dict[str, bytes]:
    files = {}
    for p in range(3):
        for i in range(2):
            path = d.warehouse / "db.db" / "t" / f"p={p}" / f"f{i}"
            path.parent.mkdir(parents=True, exist_ok=True)
            data = f"{p}-{i}".encode() * 50
            path.write_bytes(data)
            files[str(path)] = data
    return files


def _part(d: Daemon, p: int, **extra: object) -> dict[str, object]:
    return {"paths": [str(d.warehouse / "db.db" / "t" / f"p={p}")], "op": "DROP_PARTITION",
            "db": "db", "table": "t", "partitions": [{"p": str(p)}], "prepare": True, **extra}


def _statuses(d: Daemon, files: dict[str, bytes], paths: list[str]) -> list[str]:
    r = d.request("POST", "/v1/resolve", {"files": [
        {"path": p, "checksum": cks.of_bytes(files[p])} for p in paths]}, scope="read")
    assert r.status == 200, r
    return [f["status"] for f in r.json()["files"]]


def _events(d: Daemon) -> list[dict[str, object]]:
    r = d.request("GET", "/v1/events?from=0&limit=100")
    assert r.status == 200, r
    return list(r.json()["events"])


def test_prepare_join_commit_is_one_unseen_then_visible_event(daemon: Daemon) -> None:
    d = daemon
    files = _table(d)
    r = d.request("POST", "/v1/recycle", _part(d, 0), scope="write")
    assert r.status == 200, r
    txid = r.json()["txid"]
    assert r.json()["expires"] > time.time()
    first = [f["path"] for f in r.json()["files"]]
    r = d.request("POST", "/v1/recycle", _part(d, 1, txid=txid), scope="write")
    assert r.status == 200, r
    # A joined part is answered with its own files and the count the whole holds.
    assert sorted(f["path"] for f in r.json()["files"]) == sorted(p for p in files if "/p=1/" in p)
    assert r.json()["staged"] == 4
    moved = sorted(first + [f["path"] for f in r.json()["files"]])
    assert moved == sorted(p for p in files if "/p=0/" in p or "/p=1/" in p)
    assert _statuses(d, files, moved) == ["missing"] * 4
    assert _events(d) == []
    r = d.request("POST", f"/v1/transactions/{txid}/renew", {"lease": 120}, scope="write")
    assert r.status == 200 and r.json()["expires"] > time.time() + 100, r

    r = d.request("POST", f"/v1/transactions/{txid}/commit", scope="write")
    assert r.status == 200, r
    [event] = _events(d)
    assert event["id"] == r.json()["event_id"]
    assert _statuses(d, files, moved) == ["cmroot"] * 4
    assert 'cmroot_recycled_files_total{op="DROP_PARTITION"} 4.0' in d.metrics()
    # A commit sent again (its answer was lost) gets the same answer, nothing moves and
    # nothing is counted twice; an abort, renew or join now is a conflict, not a rollback.
    again = d.request("POST", f"/v1/transactions/{txid}/commit", scope="write")
    assert again.status == 200 and again.json() == r.json(), again
    assert len(_events(d)) == 1
    assert 'cmroot_recycled_files_total{op="DROP_PARTITION"} 4.0' in d.metrics()
    for path, body in [
        (f"/v1/transactions/{txid}/abort", None),
        (f"/v1/transactions/{txid}/renew", None),
        ("/v1/recycle", _part(d, 2, txid=txid)),
    ]:
        late = d.request("POST", path, body, scope="write")
        assert late.status == 409 and "already committed" in late.json()["error"], late
    assert all(Path(p).exists() for p in files if "/p=2/" in p)
    assert not d.errors(), d.log()


def test_abort_puts_every_part_back(daemon: Daemon) -> None:
    d = daemon
    files = _table(d)
    txid = d.request("POST", "/v1/recycle", _part(d, 0), scope="write").json()["txid"]
    assert d.request("POST", "/v1/recycle", _part(d, 1, txid=txid), scope="write").status == 200
    r = d.request("POST", f"/v1/transactions/{txid}/abort", scope="write")
    assert r.status == 200 and r.json()["displaced"] == [], r
    assert {p: Path(p).read_bytes() for p in files} == files
    assert _events(d) == []
    assert d.index_counts()["txs"] == 0


def test_a_refused_part_leaves_every_part_where_it_was(daemon: Daemon) -> None:
    """A multi-partition drop whose second part names a path outside the roots: 403, and
    the first part (already staged) is back."""
    d = daemon
    files = _table(d)
    txid = d.request("POST", "/v1/recycle", _part(d, 0), scope="write").json()["txid"]
    bad = {**_part(d, 1, txid=txid), "paths": [str(d.outside)]}
    r = d.request("POST", "/v1/recycle", bad, scope="write")
    assert r.status == 403, r
    assert {p: Path(p).read_bytes() for p in files} == files
    assert d.request("POST", f"/v1/transactions/{txid}/commit", scope="write").status == 404
    assert _events(d) == []


def test_the_daemon_rolls_back_an_expired_lease(daemon: Daemon) -> None:
    d = daemon
    files = _table(d)
    r = d.request("POST", "/v1/recycle", _part(d, 0, lease=1), scope="write")
    assert r.status == 200, r
    txid = r.json()["txid"]
    p0 = [p for p in files if "/p=0/" in p]
    assert not any(Path(p).exists() for p in p0)
    deadline = time.monotonic() + 30
    while not all(Path(p).exists() for p in p0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {p: Path(p).read_bytes() for p in files} == files
    assert d.request("POST", f"/v1/transactions/{txid}/commit", scope="write").status == 404
    assert _events(d) == []


def test_kill_9_between_prepare_and_commit(make_daemon: MakeDaemon) -> None:
    """The statement's commit after the daemon came back still publishes (within the
    lease); nothing was visible before it."""
    d = make_daemon()
    files = _table(d)
    txid = d.request("POST", "/v1/recycle", _part(d, 0, lease=600), scope="write").json()["txid"]
    d.kill()
    d.start()
    p0 = sorted(p for p in files if "/p=0/" in p)
    assert _statuses(d, files, p0) == ["missing"] * 2
    r = d.request("POST", f"/v1/transactions/{txid}/commit", scope="write")
    assert r.status == 200, r
    assert _statuses(d, files, p0) == ["cmroot"] * 2
    assert len(_events(d)) == 1


def test_bad_two_phase_requests_are_refused_and_change_nothing(daemon: Daemon) -> None:
    d = daemon
    files = _table(d)
    cases = [
        ("/v1/recycle", {**_part(d, 0), "prepare": False, "txid": "0" * 32}, 400),
        ("/v1/recycle", _part(d, 0, lease=0), 400),
        ("/v1/recycle", _part(d, 0, lease=10**9), 400),
        ("/v1/recycle", _part(d, 0, lease=True), 400),
        ("/v1/recycle", _part(d, 0, txid="../x"), 400),
        ("/v1/recycle", _part(d, 0, txid="0" * 32), 404),
        (f"/v1/transactions/{'0' * 32}/commit", None, 404),
        (f"/v1/transactions/{'0' * 32}/abort", None, 404),
        (f"/v1/transactions/{'0' * 32}/renew", None, 404),
        ("/v1/transactions/nope/commit", None, 404),
        ("/v1/transactions/0/explode", None, 404),
    ]
    for path, body, status in cases:
        r = d.request("POST", path, body, scope="write")
        assert r.status == status, (path, body, r)
    assert d.request("POST", "/v1/recycle", _part(d, 0), scope="read").status == 403
    assert {p: Path(p).read_bytes() for p in files} == files
    assert d.index_counts()["txs"] == 0
    assert not d.errors(), d.log()


def test_client_two_phase(daemon: Daemon) -> None:
    d = daemon
    files = _table(d)
    c = d.client("write")
    part = {k: v for k, v in _part(d, 0).items() if k not in ("paths", "prepare")}
    p = c.prepare([str(d.warehouse / "db.db" / "t" / "p=0")], **part)
    p = c.prepare([str(d.warehouse / "db.db" / "t" / "p=1")], txid=p.txid, lease=60,
                  **{**part, "partitions": [{"p": "1"}]})
    assert len(p.files) == 2 and p.staged == 4 and c.renew(p.txid, 120) > time.time() + 100
    done = c.commit(p.txid)
    assert len(done.files) == 4 and c.commit(p.txid) == done
    p = c.prepare([str(d.warehouse / "db.db" / "t" / "p=2")], **part)
    assert c.abort(p.txid) == []
    assert all(Path(k).read_bytes() == v for k, v in files.items() if "/p=2/" in k)

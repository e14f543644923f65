"""Review 11: renames followed by POST /v1/resolve (1edffe0) and the event log identity
(8480275), attacked through the real daemon over loopback HTTP with real files.

The findings (all fixed with this file: Store.open_verified follows renames as resolve does,
so a remote loader fetches a followed pair by its asked path; Renames reads each rename once
as the log grows, canonicalises locations, looks them up by directory, offers the newest
first and dedupes chains by (path, event); followed pairs are hashed in one batch, under the
request's hashing bound) are the tests with a sequence in their docstring; the others are
guards (confinement, malformed events, the v4 -> v5 migration)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cmroot import checksum as cks
from cmroot.repl import transfer
from tests.server.cmroot_daemon import Daemon, MakeDaemon

pytestmark = pytest.mark.timeout(120)


# -- helpers --------------------------------------------------------------------------------
def _event(d: Daemon, old: str, new: Any, db: str = "db", table: str = "t",
           name: str = "t2") -> dict[str, Any]:
    r = d.request("POST", "/v1/events", {
        "eventType": "ALTER_TABLE", "db": db, "table": table, "location": old,
        "tableObj": {"db": db, "table": name, "location": new},
    }, scope="write")
    assert r.status == 200, r
    return dict(r.json())


def _rename(d: Daemon, old: Path, new: Path, new_spelling: str | None = None) -> None:
    """ALTER TABLE old RENAME TO new as the hook records it, after the directory moved."""
    new.parent.mkdir(parents=True, exist_ok=True)
    os.rename(old, new)
    _event(d, str(old), new_spelling if new_spelling is not None else str(new),
           table=old.name, name=new.name)


def _resolve_many(d: Daemon, pairs: list[tuple[str, str]], timeout: float = 60.0) -> Any:
    return d.request("POST", "/v1/resolve",
                     {"files": [{"path": p, "checksum": c} for p, c in pairs]},
                     scope="read", timeout=timeout)


def _resolve(d: Daemon, path: Path | str, data: bytes) -> dict[str, Any]:
    r = _resolve_many(d, [(str(path), cks.of_bytes(data))])
    assert r.status == 200, r
    [answer] = r.json()["files"]
    return dict(answer)


def _recycle(d: Daemon, path: Path, db: str, table: str) -> None:
    r = d.request("POST", "/v1/recycle", {"paths": [str(path)], "op": "DROP_TABLE",
                                          "db": db, "table": table}, scope="write")
    assert r.status == 200, r


# -- wrong answers: bytes that are there, reported missing / unfetchable ---------------------
def test_followed_cmroot_answer_cannot_be_fetched_by_a_remote_loader(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t_new/part-0 (an INSERT's file) -> RENAME t_new TO t -> RENAME t TO arch.t_old ->
    DROP arch.t_old. Resolve says 'cmroot' for (t_new/part-0, c), but the only way an
    executor without the store mounted can get it, GET /v1/files with the asked path, is a
    404 (open_verified does not follow renames), and `location` is the store object, which
    GET /v1/files refuses: the loader reports the file lost."""
    d = daemon
    wdb = d.warehouse / "db.db"
    t, t_new = wdb / "t", wdb / "t_new"
    t_new.mkdir(parents=True)
    data = b"swapped in" * 100
    (t_new / "part-0").write_bytes(data)
    c = cks.of_bytes(data)
    _rename(d, t_new, t)
    _rename(d, t, d.warehouse / "arch.db" / "t_old")
    _recycle(d, d.warehouse / "arch.db" / "t_old", "arch", "t_old")
    answer = _resolve(d, t_new / "part-0", data)
    assert answer["status"] == "cmroot", answer

    # A loader on another host: the store object is not a file there.
    store = str(d.store)
    real_isfile = os.path.isfile
    monkeypatch.setattr(transfer.os.path, "isfile",
                        lambda p: False if str(p).startswith(store) else real_isfile(p))
    dst = d.base / "replica" / "part-0"
    (got,) = transfer.copy_all([transfer.Copy(str(t_new / "part-0"), str(dst), c, len(data))],
                               d.url, d.tokens["read"])
    monkeypatch.undo()
    fetched = d.request("GET", d.files_url(str(t_new / "part-0"), c), scope="read")
    assert (got.source, fetched.status) == ("cmroot", 200), (got, fetched)


def test_tenth_date_stamped_backup_is_not_followed(daemon: Daemon) -> None:
    """Nightly: RENAME t TO t_<night>; CREATE t; INSERT. After 9 nights, night 9's file
    (asked by its INSERT's path t/f9) is at t_9/f9, but moved_paths stops after 8
    candidates, oldest renames first (t_1 .. t_8): 'missing'."""
    d = daemon
    wdb = d.warehouse / "db.db"
    t = wdb / "t"
    for night in range(1, 10):
        t.mkdir(parents=True)
        (t / f"f{night}").write_bytes(b"night %d " % night * 50)
        _rename(d, t, wdb / f"t_{night}")
    data = b"night 9 " * 50
    assert (wdb / "t_9" / "f9").read_bytes() == data
    answer = _resolve(d, t / "f9", data)
    assert (answer["status"], answer["location"]) == ("original", str(wdb / "t_9" / "f9"))


def test_a_chain_through_a_name_reached_again_later_is_cut(daemon: Daemon) -> None:
    """RENAME t TO a; RENAME a TO q; RENAME q TO r; CREATE t; RENAME t TO q. The bytes of
    the first t's f are at r/f. moved_paths first meets q directly (the last rename, from
    t) and then skips it when the chain t -> a -> q reaches it (`q not in out`), so the
    chain's next step q -> r is never tried: 'missing'."""
    d = daemon
    wdb = d.warehouse / "db.db"
    t, a, q, r = (wdb / n for n in ("t", "a", "q", "r"))
    t.mkdir(parents=True)
    data = b"first t" * 100
    (t / "f").write_bytes(data)
    _rename(d, t, a)
    _rename(d, a, q)
    _rename(d, q, r)
    t.mkdir()
    (t / "f").write_bytes(b"second t" * 100)
    _rename(d, t, q)
    answer = _resolve(d, t / "f", data)
    assert (answer["status"], answer["location"]) == ("original", str(r / "f"))


def test_a_chain_through_a_url_spelled_location_is_cut(daemon: Daemon) -> None:
    """RENAME t TO t2 recorded with tableObj.location 'file:///wh/db.db/t2' (the daemon takes
    file:// URLs as the same file everywhere, and canonicalises the event's `location`),
    then RENAME t2 TO t3. relocations() keeps tableObj.location as spelled, so the chain
    t -> t2 -> t3 never matches the second rename's canonical '/wh/db.db/t2': 'missing'."""
    d = daemon
    wdb = d.warehouse / "db.db"
    t, t2, t3 = wdb / "t", wdb / "t2", wdb / "t3"
    t.mkdir(parents=True)
    data = b"moved twice" * 100
    (t / "f").write_bytes(data)
    _rename(d, t, t2, new_spelling="file://" + str(t2))
    # The first hop alone is followed (locate() reads the URL):
    assert _resolve(d, t / "f", data)["location"] == str(t2 / "f")
    _rename(d, t2, t3)
    answer = _resolve(d, t / "f", data)
    assert (answer["status"], answer["location"]) == ("original", str(t3 / "f"))


# -- scale: the log's renames are read once, looked up by directory ---------------------------
def test_renames_are_read_once_and_looked_up_by_directory(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found as a slowdown: every resolve with a missing pair json-parsed the whole
    ALTER_TABLE history (150 statistics-only alters of a 2000-column table made a one-pair
    resolve take about a second), and every pair scanned every rename. Now the renames
    are read as the log grows (each event once: Index.relocations(after=...)) and looked
    up by the pair's directories. Checked by what is read, not by the clock: after 150
    wide non-rename alters and 1000 renames of other tables, two resolves of 2000 missing
    pairs read each ALTER_TABLE event once in all, and still follow the one rename that
    matters."""
    from cmroot.index.events import EventLog

    d = daemon
    w = d.warehouse / "db.db"
    cols = [{"name": f"c{i:05d}", "type": "string", "comment": "x" * 40} for i in range(2000)]
    c = d.client("write")
    try:
        for i in range(150):
            c.add_event("ALTER_TABLE", db="db", table="wide", location=f"{w}/wide",
                        tableObj={"db": "db", "table": "wide", "location": f"{w}/wide",
                                  "columns": cols, "parameters": {"numRows": str(i)}})
        for i in range(1000):
            c.add_event("ALTER_TABLE", db="db", table=f"x{i}", location=f"{w}/x{i}",
                        tableObj={"db": "db", "table": f"y{i}", "location": f"{w}/y{i}"})
    finally:
        c.close()
    (w / "moved").mkdir(parents=True)
    data = b"the one that matters" * 10
    (w / "moved" / "f").write_bytes(data)
    _event(d, f"{w}/t", f"{w}/moved", table="t", name="moved")
    pairs = [(f"{w}/t/f{i}", "0" * 32) for i in range(2000)] + [(f"{w}/t/f", cks.of_bytes(data))]
    for _ in range(2):
        r = _resolve_many(d, pairs, timeout=120)
        assert r.status == 200, r
        files = r.json()["files"]
        assert [f["status"] for f in files[:-1]] == ["missing"] * 2000
        assert (files[-1]["status"], files[-1]["location"]) == ("original", f"{w}/moved/f")
    # The same log read by Renames as the daemon's store reads it: each event once.
    from cmroot.index import Index
    from cmroot.store.resolve import Renames
    from cmroot.store.warehouse import Warehouse

    calls: list[int] = []
    real = EventLog.relocations

    def counted(self: Any, after: int = 0) -> Any:
        rows = real(self, after)
        calls.append(len(rows))
        return rows

    monkeypatch.setattr(EventLog, "relocations", counted)
    index = Index(str(d.store / "index.sqlite"))
    try:
        renames = Renames(index, Warehouse([str(d.warehouse)]))
        for _ in range(3):
            renames.refresh()
            assert renames.candidates(f"{w}/t/f") == [f"{w}/moved/f"]
    finally:
        index.close()
    assert calls[0] == 1001 and sum(calls[1:]) == 0, calls


def test_rename_cycles_stay_bounded(daemon: Daemon) -> None:
    """Guard: t -> u -> t -> u ... 300 times (cycles), then u -> v. A pair of t resolves
    to v quickly, and the asked path itself is never offered as its own move."""
    d = daemon
    wdb = d.warehouse / "db.db"
    t, u, v = wdb / "t", wdb / "u", wdb / "v"
    t.mkdir(parents=True)
    data = b"cycled" * 100
    (t / "f").write_bytes(data)
    c = d.client("write")
    try:
        for i in range(300):
            a, b = (t, u) if i % 2 == 0 else (u, t)
            c.add_event("ALTER_TABLE", db="db", table=a.name, location=str(a),
                        tableObj={"db": "db", "table": b.name, "location": str(b)})
    finally:
        c.close()
    os.rename(t, v)
    _event(d, str(t), str(v), table="t", name="v")
    answer = _resolve(d, t / "f", data)
    assert (answer["status"], answer["location"]) == ("original", str(v / "f"))


# -- confinement and malformed events (guards) -----------------------------------------------
def test_moves_out_of_the_roots_are_never_read(daemon: Daemon) -> None:
    """Renames of db.db/t recorded to places outside the roots, in every spelling, each
    holding a file with the asked bytes: resolve stays 'missing' (200, no 5xx), GET
    /v1/files of those places is refused, and malformed tableObj.location values are
    ignored."""
    d = daemon
    wdb = d.warehouse / "db.db"
    wdb.mkdir(parents=True)
    t = wdb / "t"
    data = b"secret outside" * 100
    c = cks.of_bytes(data)
    evil = d.base / "warehouse_evil" / "x"  # shares the root's name as a prefix
    for where in (d.outside / "x", evil, d.base / "outside" / "rel"):
        where.mkdir(parents=True, exist_ok=True)
        (where / "f").write_bytes(data)
    (wdb / "link").symlink_to(d.outside / "x")
    (d.base / "f").write_bytes(data)  # for a move to "/" relative to the daemon's cwd
    spellings: list[Any] = [
        str(d.outside / "x"),
        f"{wdb}/../../outside/x",
        f"{d.warehouse}/../outside/x",
        "outside/rel",  # relative to the daemon's working directory
        "./outside/rel",
        str(wdb / "link"),  # a symlinked directory inside the root
        "file://" + str(d.outside / "x"),
        "file://localhost" + str(d.outside / "x"),
        str(evil),
        str(d.base),
        "/",
        "",
        "s3://bucket/x",
        "http://127.0.0.1:1/x",
        "x\u0000y",
        str(wdb / "ok") + "\x00",
        "\ud800",
        "/" + "a" * 5000,
        "/" + "b" * 300 + "/x",
        7, 1.5, None, True, ["/x"], {"path": str(d.outside / "x")},
    ]
    recorded = 0
    for new in spellings:
        r = d.request("POST", "/v1/events", {
            "eventType": "ALTER_TABLE", "db": "db", "table": "t", "location": str(t),
            "tableObj": {"db": "db", "table": "x", "location": new},
        }, scope="write")
        assert r.status in (200, 400), (new, r)  # a refusal at recording is fine too
        recorded += r.status == 200
    assert recorded >= len(spellings) - 3
    # The root itself and the database directory renamed out as well.
    _event(d, str(d.warehouse), str(d.outside / "x"), table="t", name="x")
    _event(d, str(wdb), str(d.outside), table="t", name="x")
    # An older hook's rename (location already the new one) moves nothing.
    _event(d, str(wdb / "t9"), str(wdb / "t9"), table="t8", name="t9")
    r = _resolve_many(d, [(str(t / "f"), c), (str(wdb / "f"), c), (str(d.warehouse / "x" / "f"), c),
                          (str(t), c), (str(wdb), c)])
    assert r.status == 200, r
    assert {a["status"] for a in r.json()["files"]} == {"missing"}, r.json()
    for outside in (d.outside / "x" / "f", evil / "f", wdb / "link" / "f"):
        got = d.request("GET", d.files_url(str(outside), c), scope="read")
        assert got.status in (400, 403, 404), got
    assert d.errors() == [], d.log()


def test_prefix_of_another_table_is_not_moved(daemon: Daemon) -> None:
    """Guard: RENAME t TO u moves db.db/t/..., never db.db/t2/... or db.db/t.bak/..."""
    d = daemon
    wdb = d.warehouse / "db.db"
    t, u = wdb / "t", wdb / "u"
    t.mkdir(parents=True)
    data = b"in t" * 100
    (t / "f").write_bytes(data)
    _rename(d, t, u)
    assert _resolve(d, t / "f", data)["location"] == str(u / "f")
    for other in (wdb / "t2" / "f", wdb / "t.bak" / "f", Path(str(t) + "_x") / "f"):
        assert _resolve(d, other, data)["status"] == "missing"


def test_a_v4_index_gains_a_stable_log_identity(make_daemon: MakeDaemon) -> None:
    """Guard: an index left at schema 4 (no settings table) is migrated at start; GET
    /v1/events/current names a 32-hex log, the same after a restart, another daemon's is
    different, and the events are kept."""
    d = make_daemon()
    _event(d, str(d.warehouse / "db.db" / "a"), str(d.warehouse / "db.db" / "b"))
    assert d.stop() == 0, d.log()
    index = d.store / "index.sqlite"
    con = sqlite3.connect(index)
    try:
        con.execute("DROP TABLE settings")
        con.execute("PRAGMA user_version = 4")
        con.commit()
    finally:
        con.close()
    d.start()
    first = d.request("GET", "/v1/events/current").json()
    assert first["id"] == 1 and len(first["log"]) == 32, first
    int(first["log"], 16)
    d.restart()
    assert d.request("GET", "/v1/events/current").json() == first
    other = make_daemon("other")
    assert other.request("GET", "/v1/events/current").json()["log"] != first["log"]

"""Recycle integrity through the daemon (invariants 1 and 2): a recycle killed mid-way
leaves no phantom event, a re-created source is never clobbered, a stuck transaction is
quarantined without keeping the daemon down, a corrupt object is healed.

Crashes are real: the daemon runs with CMROOT_FAULTS=NAME, which SIGKILLs it the moment
execution reaches that fault point (deterministic, no sleeps)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cmroot_testlib import object_file

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError
from tests.server.cmroot_daemon import Daemon, MakeDaemon, write_files

STAGED = {"CMROOT_FAULTS": "recycle.staged"}  # die after every file is staged


def _table(d: Daemon, name: str, n: int = 6) -> dict[str, bytes]:
    return write_files(
        d.warehouse / "db.db" / name,
        {f"p={i % 2}/part-{i}.parquet": f"{name} row {i} ".encode() * (i + 3) for i in range(n)},
    )


def _recycle_and_die(d: Daemon, table: str) -> None:
    with pytest.raises(CmrootError):
        d.client("write").recycle(
            [str(d.warehouse / "db.db" / table)], op="DROP_TABLE", db="db", table=table
        )
    assert d.proc is not None and d.proc.wait(30) == -9


def test_a_recycle_killed_after_staging_records_no_drop_and_keeps_a_displaced_file(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon(env=STAGED)
    files = _table(d, "t")
    _recycle_and_die(d, "t")
    assert not any(Path(p).exists() for p in files)  # all away in staging
    victim = sorted(files)[0]
    Path(victim).write_bytes(b"a writer re-created this path")  # while it was away
    d.env.clear()
    d.start()

    c = d.client("admin")
    assert c.events(0, 100) == [], "a rolled-back recycle left an event a replica would replay"
    assert Path(victim).read_bytes() == b"a writer re-created this path"
    for p, data in files.items():
        if p != victim:
            assert Path(p).read_bytes() == data
    # The displaced old bytes: retrievable by (path, old checksum), recorded with no event.
    old = cks.of_bytes(files[victim])
    reply = d.request("GET", d.files_url(victim, old), scope="read")
    assert reply.status == 200 and reply.body == files[victim]
    assert reply.headers["X-Cmroot-Status"] == "cmroot"
    [entry] = c.entries()["entries"]
    assert entry["path"] == victim and entry["event_id"] is None
    new = cks.of_bytes(b"a writer re-created this path")
    assert d.request("GET", d.files_url(victim, new), scope="read").body.startswith(b"a writer")


def test_a_stuck_transaction_is_quarantined_and_the_daemon_still_starts(
    make_daemon: MakeDaemon,
) -> None:
    """One transaction that cannot be settled (here: its root was taken out of the
    configuration while it was pending) is quarantined and reported; the daemon starts,
    other transactions still roll back, and it is settled once the cause is gone."""
    d = make_daemon(env=STAGED, start=False)
    second = d.base / "warehouse2"
    t1 = write_files(second / "db.db" / "t1", {"f1": b"one" * 50, "p=1/f2": b"two" * 50})
    both = [str(d.warehouse), str(second)]
    d.env["CMROOT_STORE_WAREHOUSE_ROOTS"] = ",".join(both)
    d.start()
    with pytest.raises(CmrootError):
        d.client("write").recycle([str(second / "db.db" / "t1")], op="DROP_TABLE")
    assert d.proc is not None and d.proc.wait(30) == -9
    d.env["CMROOT_STORE_WAREHOUSE_ROOTS"] = str(d.warehouse)  # the root is gone from config

    d.start()  # still with the fault: recovery quarantines t1, then t2 crashes
    assert d.request("GET", "/readyz").status == 200
    t2 = _table(d, "t2")
    _recycle_and_die(d, "t2")
    del d.env["CMROOT_FAULTS"]
    d.start()
    assert d.request("GET", "/readyz").status == 200
    assert all(Path(p).read_bytes() == b for p, b in t2.items()), "t2 was not rolled back"
    assert "cmroot_quarantined_transactions 1.0" in d.metrics()
    assert any("quarantined" in r.get("msg", "") for r in d.log_records())
    assert d.client("admin").events(0, 100) == []

    # Once the root is configured again, the next start rolls t1 back too.
    d.env["CMROOT_STORE_WAREHOUSE_ROOTS"] = ",".join(both)
    d.restart()
    assert all(Path(p).read_bytes() == b for p, b in t1.items())
    assert "cmroot_quarantined_transactions 0.0" in d.metrics()
    assert d.index_counts()["txs"] == 0


def test_a_corrupt_object_is_healed_by_the_next_recycle_of_the_same_bytes(
    daemon: Daemon,
) -> None:
    data = b"same bytes in two tables " * 40
    a = write_files(daemon.warehouse / "db.db" / "a", {"f": data})
    c = daemon.client("write")
    c.recycle(list(a), op="DROP_TABLE", db="db", table="a")
    checksum = cks.of_bytes(data)
    obj = object_file(daemon.store, checksum)
    obj.write_bytes(b"bit rot" * 10)
    b = write_files(daemon.warehouse / "db.db" / "b", {"f": data})
    c.recycle(list(b), op="DROP_TABLE", db="db", table="b")  # used to be a 409 forever
    for path in (*a, *b):
        reply = daemon.request("GET", daemon.files_url(path, checksum), scope="read")
        assert reply.status == 200 and reply.body == data


@pytest.fixture
def small_store(make_daemon: MakeDaemon):  # type: ignore[no-untyped-def]
    """A daemon whose store lives on a 1 MiB tmpfs (a real full disk); needs root."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; run the suite as root to cover a full disk")
    d = make_daemon(start=False)
    d.store.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d.store)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {r.stderr.strip()}")
    try:
        yield d.start()
    finally:
        d.close()
        subprocess.run(["umount", "-l", str(d.store)], check=False)


def test_a_full_store_answers_507_and_changes_nothing(small_store: Daemon) -> None:
    d = small_store
    big = _table(d, "big", 1)
    for i in range(4):  # 4 x 400 KiB: more than the tmpfs holds (copies: other filesystem)
        big.update(write_files(d.warehouse / "db.db" / "big", {f"f{i}": bytes([i]) * 400_000}))
    before = d.snapshot()
    reply = d.request("POST", "/v1/recycle", scope="write",
                      body={"paths": [str(d.warehouse / "db.db" / "big")], "op": "DROP_TABLE"})
    assert reply.status == 507, reply.body
    assert b"out of space" in reply.body
    after = d.snapshot()
    assert after["warehouse"] == before["warehouse"]
    assert d.index_counts()["events"] == 0 and d.index_counts()["txs"] == 0
    assert d.request("GET", "/readyz").status == 200
    small = _table(d, "small", 2)
    d.client("write").recycle(list(small), op="DROP_TABLE", db="db", table="small")
    for p, data in small.items():
        assert d.request("GET", d.files_url(p, cks.of_bytes(data)), scope="read").body == data

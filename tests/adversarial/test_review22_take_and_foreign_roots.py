"""Hostile review 22: Method.TAKE on remote warehouse roots (b1af785) and the JVM hooks
on warehouse roots on another Hadoop file system (e2c1528, since turned from a refusal
into protection by the metastore plugin). Findings, all fixed: a glob character in a
name made the take delete other files (fsspec's `rm` expands globs); a failed take put
back a file a writer had deleted; a copy a crash cut short was taken for whole (uploaded
back, or kept as displaced); a location naming a root's files through a viewfs mount was
compared as spelt and dropped unkept (now resolved through Hadoop; another scheme's name
for them is refused).

Part 1 is a conformance class run on fsspec's memory filesystem and on a real S3 server
on loopback (moto, s3fs), as tests/store/test_remote_warehouse.py is. A writer racing the
store is the test's own client of the filesystem, run at a fault point of the store
(deterministic, no sleeps). Part 2 runs a standalone Hive metastore with the plugin and
the test scheme disk:// (tests/jvm), as tests/metastore/test_foreign_roots.py does.

Every test states its sequence; a failing one is a finding, a passing one a guard that
held."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from remote_backends import RemoteWarehouse, reopen

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError, NotFound
from cmroot.store import RecycleRequest
from tests.adversarial.fsspeclib import attempt

# -- part 1: Method.TAKE ----------------------------------------------------------------


def _race_at(
    monkeypatch: pytest.MonkeyPatch, at: str, act: Callable[[], None], nth: int = 1
) -> dict[str, int]:
    """Run `act` (a writer's action) the `nth` time the store reaches fault point `at`."""
    state = {"seen": 0, "raced": 0}
    real_point = faults.point

    def point(name: str) -> None:
        if name == at:
            state["seen"] += 1
            if state["seen"] == nth:
                state["raced"] += 1
                act()
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    return state


def _retrievable(wh: RemoteWarehouse, rel: str, data: bytes) -> bool:
    [r] = wh.store.resolve([{"path": wh.url(rel), "checksum": cks.of_bytes(data)}])
    return str(r.status) in ("cmroot", "original")


def _exists(wh: RemoteWarehouse, rel: str) -> bool:
    wh.fs.invalidate_cache()
    return bool(wh.fs.exists(wh.path(rel)))


def _in_place_or_kept(wh: RemoteWarehouse, files: dict[str, bytes]) -> list[str]:
    """Invariant 1: files neither at their path with their bytes nor in the store."""
    out = []
    for rel, data in files.items():
        here = _exists(wh, rel) and wh.read(rel) == data
        if not here and not _retrievable(wh, rel, data):
            out.append(rel)
    return out


@pytest.fixture(autouse=True)
def _disarm() -> Iterator[None]:
    yield
    faults.disarm()


def _die_mid_copy(wh: RemoteWarehouse, data: bytes) -> None:
    """db/t/part-0 holds `data`; a prepare of DROP_TABLE db/t dies while copying it: the
    transaction is open, nothing journaled as copied, and its staged file holds the first
    1000 bytes (what a death mid-copy leaves)."""
    wh.write("db/t/part-0", data)
    faults.arm("recycle.file_staged", 1, crash=True)
    with pytest.raises(faults.Crash):
        wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
    faults.disarm()
    [txid] = wh.store.index.pending_txids()
    staged = wh.store.layout.staged_path(txid, 0)
    os.makedirs(os.path.dirname(staged), exist_ok=True)
    with open(staged, "wb") as f:
        f.write(data[:1000])


class TakeAttacks:
    """A binding subclass provides `wh`."""

    # ---- findings ---------------------------------------------------------------------

    def test_a_take_of_a_name_with_glob_characters_removes_only_that_file(
        self, wh: RemoteWarehouse
    ) -> None:
        """Sequence: two tables, db/t[1] (a name fsspec reads as a glob) and db/t1, each
        with a part-0. DROP_TABLE db/t[1] (move). The take copies db/t[1]/part-0, checks
        its identity by its literal name, then RemoteSession.remove_if_unchanged calls
        `fs.rm(path)`, and fsspec's rm (memory and s3fs alike) *expands globs*: it deletes
        db/t1/part-0, a file of another table that was never copied, and leaves the
        recycled one in place. Lost: db/t1/part-0 (in no store). Cause:
        cmroot/store/source/remote.py remove_if_unchanged (fs.rm on an unescaped path;
        use fs.rm_file, which takes one literal path)."""
        wh.write("db/t[1]/part-0", b"the dropped table's bytes")
        wh.write("db/t1/part-0", b"another table's bytes")
        res = wh.store.recycle(RecycleRequest([wh.url("db/t[1]")], op="DROP_TABLE"))
        assert [f.path for f in res.files] == [wh.url("db/t[1]/part-0")]
        assert _in_place_or_kept(wh, {"db/t1/part-0": b"another table's bytes"}) == []

    def test_a_take_of_a_file_named_with_a_star_removes_no_sibling(
        self, wh: RemoteWarehouse
    ) -> None:
        """Sequence: db/t holds `part*` and `part-0`; DELETE of the one file db/t/part*
        (move). remove_if_unchanged's `fs.rm("…/db/t/part*")` globs: part-0, never named
        by the request nor copied, goes too. Lost: db/t/part-0. Cause: as above."""
        wh.write("db/t/part*", b"the file deleted")
        wh.write("db/t/part-0", b"a file nobody deleted")
        wh.store.recycle(RecycleRequest([wh.url("db/t/part*")], op="DELETE"))
        assert _in_place_or_kept(wh, {"db/t/part-0": b"a file nobody deleted"}) == []
        assert _exists(wh, "db/t/part-0")

    def test_a_file_a_writer_deleted_between_copy_and_take_is_not_brought_back(
        self, wh: RemoteWarehouse, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Sequence: DROP_TABLE db/t (move, two files). Once part-0's copy is journaled
        (recycle.copy_journaled), a writer (a compaction, a concurrent DELETE) removes
        part-0 itself. The take finds it gone and fails the recycle (Conflict): right.
        The rollback then treats part-0 as taken (its checksum is journaled) and uploads
        it back: a file cmroot never removed, that a writer deleted, re-appears in the
        table (its rows counted twice next to the compacted file). Locally a writer's
        delete is never undone (the rename either took the file or failed). Cause:
        cmroot/store/recycle.py _take raises without recording that the source was not
        taken, and cmroot/store/journal.py _undo puts back every take whose checksum is
        journaled."""
        wh.write("db/t/part-0", b"bytes a compaction deleted")
        wh.write("db/t/part-1", b"bytes left alone")
        wh.store.recycler.workers = 1
        state = _race_at(monkeypatch, "recycle.copy_journaled",
                         lambda: wh.fs.rm(wh.path("db/t/part-0")))
        err = attempt(lambda: wh.store.recycle(
            RecycleRequest([wh.url("db/t")], op="DROP_TABLE")))
        assert state["raced"] == 1
        assert isinstance(err, CmrootError)
        assert wh.store.index.current_event_id() == 0
        assert wh.read("db/t/part-1") == b"bytes left alone"
        assert not _exists(wh, "db/t/part-0"), "a file a writer deleted was put back"

    def test_a_crash_mid_copy_never_uploads_the_partial_copy(
        self, wh: RemoteWarehouse
    ) -> None:
        """Sequence: prepare DROP_TABLE db/t (move); the process dies while copying
        part-0 (crash at recycle.file_staged, then the truncated staged file a death
        mid-copy leaves: half of its bytes). No checksum is journaled, so the source
        never left. The writer's job then removes part-0 (the daemon is down). Recovery
        at Store.open: Journal.observe fills `it.checksum` from the staged file when the
        journal has none, so _undo's `it.method == TAKE and it.checksum is None` (the
        copy was never whole: drop it) never holds, and put_back uploads the *truncated*
        copy to db/t/part-0: a corrupt file served at the table's path. Cause:
        cmroot/store/journal.py observe (sets it.checksum) + _undo (tests it after)."""
        data = os.urandom(4096)
        _die_mid_copy(wh, data)
        wh.fs.rm(wh.path("db/t/part-0"))
        with reopen(wh) as store:
            assert store.index.current_event_id() == 0
        assert not _exists(wh, "db/t/part-0") or wh.read("db/t/part-0") == data, (
            "a truncated copy was uploaded to the table's path")

    def test_a_crash_mid_copy_records_no_displaced_entry_of_bytes_never_at_the_path(
        self, wh: RemoteWarehouse
    ) -> None:
        """Sequence: as above, but the source stays. Recovery puts the partial copy back
        with an exclusive create, finds the path taken by bytes other than the partial
        copy's, and keeps the partial copy as a *displaced* entry: an entry for
        (db/t/part-0, checksum of half a file), bytes that were never at that path, and
        Recovery.displaced reports a writer re-creation that never happened. Expected:
        the incomplete copy is dropped (the source never left). Cause: as above."""
        data = os.urandom(4096)
        _die_mid_copy(wh, data)
        with reopen(wh) as store:
            assert wh.read("db/t/part-0") == data
            assert store.recovery.displaced == []
            [r] = store.resolve([{"path": wh.url("db/t/part-0"),
                                  "checksum": cks.of_bytes(data[:1000])}])
            assert str(r.status) != "cmroot", "half a file is kept as a displaced entry"

    # ---- guards -----------------------------------------------------------------------

    def test_guard_copy_mode_never_removes_sources(self, wh: RemoteWarehouse) -> None:
        """prepare (copy) then abort, then prepare (copy) and commit: the source stays."""
        wh.write("db/t/f", b"kept")
        p = wh.store.prepare(RecycleRequest([wh.url("db/t")], mode="copy",
                                            op="INSERT_OVERWRITE"))
        assert wh.read("db/t/f") == b"kept"
        wh.store.abort(p.txid)
        assert wh.read("db/t/f") == b"kept"
        p = wh.store.prepare(RecycleRequest([wh.url("db/t")], mode="copy",
                                            op="INSERT_OVERWRITE"))
        wh.store.commit(p.txid)
        assert wh.read("db/t/f") == b"kept"
        assert _retrievable(wh, "db/t/f", b"kept")

    def test_guard_a_second_prepare_of_a_taken_file_fails_and_loses_nothing(
        self, wh: RemoteWarehouse
    ) -> None:
        """prepare A takes db/t; prepare B of the same table finds nothing (NotFound)
        and records nothing; A then aborts: every file back."""
        files = {"db/t/a": b"A", "db/t/b": b""}  # a zero-byte object too
        for rel, data in files.items():
            wh.write(rel, data)
        a = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        with pytest.raises(NotFound):
            wh.store.prepare(RecycleRequest([wh.url("db/t/a")], op="DELETE"))
        assert wh.store.abort(a.txid) == []
        assert {r: wh.read(r) for r in files} == files
        assert wh.store.index.current_event_id() == 0

    def test_guard_a_joined_part_then_abort_puts_both_parts_back(
        self, wh: RemoteWarehouse
    ) -> None:
        files = {"db/t/p=1/f": b"one", "db/t/p=2/f": b"two"}
        for rel, data in files.items():
            wh.write(rel, data)
        a = wh.store.prepare(RecycleRequest([wh.url("db/t/p=1")], op="DROP_PARTITION",
                                            db="db", table="t"))
        wh.store.prepare(RecycleRequest([wh.url("db/t/p=2")], op="DROP_PARTITION",
                                        db="db", table="t"), txid=a.txid)
        assert not _exists(wh, "db/t/p=1/f") and not _exists(wh, "db/t/p=2/f")
        assert wh.store.abort(a.txid) == []
        assert {r: wh.read(r) for r in files} == files
        assert wh.store.index.current_event_id() == 0

    def test_guard_a_lease_expiry_puts_taken_files_back_and_a_late_commit_fails(
        self, wh: RemoteWarehouse
    ) -> None:
        wh.write("db/t/f", b"leased")
        p = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"), lease=5)
        later = wh.store.clock() + 3600
        wh.store.recycler.clock = lambda: later
        assert wh.store.expire_prepared() == 1
        assert wh.read("db/t/f") == b"leased"
        assert isinstance(attempt(lambda: wh.store.commit(p.txid)), CmrootError)
        assert wh.store.index.current_event_id() == 0

    def test_guard_a_crash_in_the_rollback_is_finished_by_recovery_twice(
        self, wh: RemoteWarehouse
    ) -> None:
        """abort dies after putting back the first file (journal.rolled_back_file);
        recovery at the next open finishes it, and a second recovery changes nothing."""
        files = {f"db/t/f{i}": f"bytes {i}".encode() for i in range(3)}
        for rel, data in files.items():
            wh.write(rel, data)
        wh.store.recycler.workers = 1
        p = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        faults.arm("journal.rolled_back_file", 1, crash=True)
        with pytest.raises(faults.Crash):
            wh.store.abort(p.txid)
        faults.disarm()
        with reopen(wh) as store:
            assert {r: wh.read(r) for r in files} == files
            assert store.recovery.quarantined == [] and store.recovery.displaced == []
        with reopen(wh) as store:
            assert store.recovery.rolled_back == 0
            assert {r: wh.read(r) for r in files} == files
            assert store.index.current_event_id() == 0
            assert not os.listdir(store.layout.staging)

    def test_guard_a_crash_after_the_commit_loses_nothing(self, wh: RemoteWarehouse) -> None:
        wh.write("db/t/f", b"committed")
        p = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        faults.arm("journal.committed", 1, crash=True)
        with pytest.raises(faults.Crash):
            wh.store.commit(p.txid)
        faults.disarm()
        with reopen(wh) as store:
            assert store.index.current_event_id() == 1
            assert not _exists(wh, "db/t/f")
            [r] = store.resolve([{"path": wh.url("db/t/f"),
                                  "checksum": cks.of_bytes(b"committed")}])
            assert str(r.status) == "cmroot"


class TestMemoryTake(TakeAttacks):
    @pytest.fixture
    def wh(self, memory_wh: RemoteWarehouse) -> RemoteWarehouse:
        return memory_wh


class TestS3Take(TakeAttacks):
    @pytest.fixture
    def wh(self, s3_wh: RemoteWarehouse) -> RemoteWarehouse:
        return s3_wh



# -- part 2: foreign roots in the metastore plugin ---------------------------------------


def _start_hms(base: Path) -> object:
    """The daemon and a metastore running the plugin, with a local root and a disk://
    root (`base/lake`), as tests/metastore/test_foreign_roots.py starts them; the
    metastore's Hadoop configuration also mounts that lake under viewfs://cl/alias (a
    second name of the same directory: what viewfs federation, s3:// beside s3a://, or a
    NameNode named by host and by nameservice are in production)."""
    from tests.jvm import DISK_FS
    from tests.metastore.conftest import start_disk_hms

    lake = base / "lake"
    return start_disk_hms(base, lake, site={
        "fs.disk2.impl": DISK_FS, "fs.viewfs.mounttable.cl.link./alias": f"disk://{lake}"})


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("pyspark")
    h = _start_hms(tmp_path_factory.mktemp("review22"))
    try:
        yield h
    finally:
        h.metastore.stop()  # type: ignore[attr-defined]
        h.daemon.stop()  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_a_drop_under_a_foreign_root_named_by_another_scheme_is_kept(foreign: object) -> None:
    """Sequence: the disk:// root's directory `lake` is also reachable as
    viewfs://cl/alias (a mount of it). A managed table is created at
    viewfs://cl/alias/al.db/t, its data file lands in lake/al.db/t. DROP TABLE al.t was let
    through unkept: the location was compared with the root as spelt. Now it is resolved
    through Hadoop (FileSystem.resolvePath) to where its files are: kept, with its event."""
    from tests.metastore.test_metastore_plugin import COLUMNS, files_of

    h = foreign
    lake = h.base / "lake"  # type: ignore[attr-defined]
    with h.client() as c:  # type: ignore[attr-defined]
        c.create_database("al", "viewfs://cl/alias/al.db")
        c.create_table("al", "t", "viewfs://cl/alias/al.db/t", COLUMNS, file_format="text")
        top = lake / "al.db" / "t"
        top.mkdir(parents=True, exist_ok=True)
        (top / "data.txt").write_text("a row under the foreign root\n")
        before = files_of(top)
        since = h.current()  # type: ignore[attr-defined]
        c.drop_table("al", "t")
    (event,) = h.events(since)  # type: ignore[attr-defined]
    assert event["eventType"] == "DROP_TABLE"
    kept = {f["path"]: f["checksum"] for f in event["files"]}
    assert sorted(kept) == sorted(f"disk://{p}" for p in before)
    for path, data in before.items():
        assert h.served(f"disk://{path}", kept[f"disk://{path}"]) == data  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_a_drop_under_a_foreign_root_by_another_scheme_name_is_refused(
    foreign: object,
) -> None:
    """The same directory named with another scheme that Hadoop cannot map to the root
    (s3:// beside s3a://; here `disk2://`, the disk file system under a second name): the
    roots do not cover it, so the drop is refused and nothing changes."""
    from tests.metastore.test_metastore_plugin import COLUMNS, files_of
    from tests.metastore.thrift_client import MetaException

    h = foreign
    lake = h.base / "lake"  # type: ignore[attr-defined]
    with h.client() as c:  # type: ignore[attr-defined]
        c.create_table("default", "twin", f"disk2://{lake}/twin", COLUMNS, file_format="text")
        top = lake / "twin"
        top.mkdir(parents=True, exist_ok=True)
        (top / "data.txt").write_text("a row\n")
        before = files_of(top)
        since = h.current()  # type: ignore[attr-defined]
        with pytest.raises(MetaException, match="by another file system scheme"):
            c.drop_table("default", "twin")
        assert c.get_table("default", "twin").tableName == "twin"
    assert files_of(top) == before
    assert h.events(since) == []  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_a_local_tables_partition_under_a_foreign_root_is_kept(foreign: object) -> None:
    """A managed table under the local root with one partition located under the disk://
    root: dropping that partition, then the table, keeps every file of both roots."""
    from tests.metastore.test_metastore_plugin import COLUMNS, files_of

    h = foreign
    lake = h.base / "lake"  # type: ignore[attr-defined]
    wh = h.warehouse  # type: ignore[attr-defined]
    with h.client() as c:  # type: ignore[attr-defined]
        c.create_database("mix", wh / "mix.db")
        c.create_table("mix", "t", wh / "mix.db" / "t", COLUMNS,
                       partition_keys=[("p", "string")], file_format="text")
        c.add_partition("mix", "t", ["1"])
        (wh / "mix.db" / "t" / "p=1" / "data.txt").write_text("local row\n")
        far = lake / "elsewhere" / "p=2"
        c.add_partition("mix", "t", ["2"], location=f"disk://{far}/")
        far.mkdir(parents=True, exist_ok=True)
        (far / "data.txt").write_text("far row\n")
        local_before = files_of(wh / "mix.db" / "t")
        far_before = files_of(far)
        since = h.current()  # type: ignore[attr-defined]
        c.drop_partition("mix", "t", ["2"])
        c.drop_table("mix", "t")
    events = h.events(since)  # type: ignore[attr-defined]
    assert [e["eventType"] for e in events] == ["DROP_PARTITION", "DROP_TABLE"]
    kept = {f["path"]: f["checksum"] for e in events for f in e["files"]}
    want = {f"disk://{p}": d for p, d in far_before.items()} | local_before
    assert sorted(kept) == sorted(want)
    for path, data in want.items():
        assert h.served(path, kept[path]) == data  # type: ignore[attr-defined]
    assert files_of(far) == {} and files_of(wh / "mix.db" / "t") == {}

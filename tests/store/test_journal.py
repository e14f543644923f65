"""The recycle journal's state machine (cmroot/store/journal.py).

* Property: any crash point of a recycle, optionally a second crash during the recovery
  that follows, and a writer re-creating source paths while they are away, end in
  "all at source, no event" or "all in the store, one event" — with re-created paths
  untouched and their old bytes retrievable (displaced, no event).
* Recovery decides rename-or-copy from the journal, never from st_dev: a bind mount
  (equal st_dev, rename refused with EXDEV) is the case that tells them apart.
* A rollback never leaves a warehouse file sharing an inode with a store object.

Crashes are injected with faults.arm(..., crash=True): the recycle stops where it stands,
as process death would (the SIGKILL versions are in test_crash.py)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest
from cmroot_testlib import (
    Env,
    assert_retrievable,
    bind_mount,
    index_counts,
    make_table,
    object_files,
    table_dir,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot import faults
from cmroot.store import RecycleRequest, Store

FILES = 8
POINTS = [
    "journal.begun",
    "recycle.file_staged",
    "recycle.file_published",
    "recycle.staged",
    "recycle.flushed",
    "journal.committed",
    "journal.unstaged",
]
RECOVERY_POINTS = ["journal.rolled_back_file", "journal.unstaged", None]


def _fresh(tmp: Path, clock) -> Env:  # type: ignore[no-untyped-def]
    e = Env(base=tmp, warehouse=tmp / "wh", store_root=tmp / "store", outside=tmp / "out",
            clock=clock)
    e.warehouse.mkdir(parents=True)
    return e


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    point=st.sampled_from(POINTS),
    k=st.integers(1, FILES),
    mode=st.sampled_from(["move", "copy"]),
    recovery_crash=st.sampled_from(RECOVERY_POINTS),
    rk=st.integers(1, FILES),
    recreate=st.sets(st.integers(0, FILES - 1), max_size=3),
)
def test_any_crash_ends_all_at_source_or_all_in_the_store(
    tmp_path_factory: pytest.TempPathFactory, clock, point, k, mode, recovery_crash, rk, recreate
) -> None:
    e = _fresh(tmp_path_factory.mktemp("j"), clock)
    files = make_table(e.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}],
                       files_per_partition=FILES // 2)
    paths = sorted(files)
    store = Store.open(e.config(), clock=e.clock)
    store.recycler.workers = 1
    per_file = point.startswith("recycle.file_")
    faults.arm(point, k if per_file else 1, crash=True)
    try:
        store.recycle(RecycleRequest(paths=[str(table_dir(e.warehouse, "db", "t"))],
                                     mode=mode, op="DROP_TABLE", db="db", table="t"))
        crashed = False
    except faults.Crash:
        crashed = True
    finally:
        faults.disarm()
        store.close()
    assert crashed

    # A writer re-creates some source paths that are away (move mode only moves them).
    rewritten = {}
    for i in recreate:
        p = paths[i]
        if not os.path.lexists(p):
            Path(p).parent.mkdir(parents=True, exist_ok=True)
            Path(p).write_bytes(b"new writer " + p.encode())
            rewritten[p] = Path(p).read_bytes()

    if recovery_crash is not None:
        faults.arm(recovery_crash, rk, crash=True)
        try:
            Store.open(e.config(), clock=e.clock).close()
        except faults.Crash:
            from cmroot.store.layout.local import _HELD

            for fd in _HELD.values():  # the crashed open's lock dies with its "process"
                os.close(fd)
            _HELD.clear()
        finally:
            faults.disarm()
    store = Store.open(e.config(), clock=e.clock)
    try:
        counts = index_counts(e)
        assert counts["txs"] == 0 and counts["journal"] == 0
        assert os.listdir(e.staging_dir) == []
        for p, data in rewritten.items():
            assert Path(p).read_bytes() == data, "a re-created source was clobbered"
        events = store.events(0, 10)
        if events:  # committed: every file in the store, one event
            assert [ev.type for ev in events] == ["DROP_TABLE"]
            assert len(events[0].files) == FILES
            originals = {p: b for p, b in files.items() if p not in rewritten}
            assert_retrievable(store, originals, status="cmroot" if mode == "move" else None)
        else:  # rolled back: every file at its source, or displaced with its old bytes
            for p, data in files.items():
                if p not in rewritten:
                    assert Path(p).read_bytes() == data
            displaced = {e_.path for e_ in store.entries(limit=100)}
            assert displaced <= set(rewritten)
            assert all(e_.event_id == 0 for e_ in store.entries(limit=100))
            assert_retrievable(store, {p: files[p] for p in displaced}, status="cmroot")
            if not displaced:
                assert object_files(e) == []
        for obj in object_files(e):
            assert cks.of_local_file(str(obj)) == obj.name
        report = store.fsck()
        assert report.clean, report.to_json()
    finally:
        store.close()


def _same_inode(a: str | Path, b: str | Path) -> bool:
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def test_a_rollback_never_leaves_a_warehouse_file_sharing_an_inode_with_an_object(
    env: Env, store: Store
) -> None:
    """Recycle A publishes, recycle B deduplicates against A's object and commits, then A
    rolls back: A's file must come back with bytes of its own, so writing it in place
    cannot corrupt B's object."""
    data = b"shared content" * 100
    a = env.warehouse / "db.db" / "a" / "f"
    b = env.warehouse / "db.db" / "b" / "f"
    for p in (a, b):
        p.parent.mkdir(parents=True)
        p.write_bytes(data)
    faults.arm("recycle.staged", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[str(a)], op="DROP_TABLE", db="db", table="a"))
    store.recycle(RecycleRequest(paths=[str(b)], op="DROP_TABLE", db="db", table="b"))
    store.close()
    reopened = env.open()  # rolls A back
    c = cks.of_bytes(data)
    obj = env.object_path(c)
    assert a.read_bytes() == data
    assert not _same_inode(a, obj)
    with open(a, "r+b") as f:  # an in-place write to the warehouse file
        f.write(b"X" * 100)
    assert cks.of_local_file(str(obj)) == c
    assert_retrievable(reopened, {str(b): data}, status="cmroot")


def test_recovery_on_a_bind_mount_takes_the_method_from_the_journal(
    bind_mounted_warehouse: Env,
) -> None:
    """st_dev says "same filesystem", rename says EXDEV: the files were taken (copied,
    then removed, as a rename removes them). A crash after every take, then a writer
    re-creates one path: recovery puts the others back, leaves the new file as it is and
    keeps the old bytes it replaced in the store with no event (the journal, not st_dev,
    says how each file left)."""
    env = bind_mounted_warehouse
    assert os.stat(env.warehouse).st_dev == os.stat(env.base).st_dev
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=4)
    store = env.open()
    faults.arm("recycle.staged", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))],
                                     op="DROP_TABLE", db="db", table="t"))
    store.close()
    assert not any(os.path.exists(p) for p in files)  # taken, as renames take them
    changed = sorted(files)[0]
    Path(changed).write_bytes(b"re-created after it was taken")
    reopened = env.open()
    assert reopened.events(0, 10) == []
    assert Path(changed).read_bytes() == b"re-created after it was taken"
    for p, data in files.items():
        if p != changed:
            assert Path(p).read_bytes() == data
    assert [e.path for e in reopened.entries(limit=10)] == [changed]
    assert_retrievable(reopened, {changed: files[changed]}, status="cmroot")


def test_an_abort_on_a_bind_mount_brings_back_bytes_the_statement_overwrote(
    bind_mounted_warehouse: Env,
) -> None:
    """A prepared delete is a delete on a bind mount too (EXDEV: taken, not copied): a
    statement that writes a file at a prepared path and is then aborted leaves its new
    file, and the old bytes stay retrievable (a copy left the source in place, and the
    abort dropped the only copy of the old bytes once the statement had replaced them)."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    store = env.open()
    p = store.prepare(RecycleRequest(paths=sorted(files), op="INSERT_OVERWRITE", db="db",
                                     table="t"), lease=600)
    assert not any(os.path.exists(f) for f in files)
    first = sorted(files)[0]
    Path(first).write_bytes(b"the statement's new file")
    store.abort(p.txid)
    assert Path(first).read_bytes() == b"the statement's new file"
    assert store.events(0, 10) == []
    assert_retrievable(store, {f: d for f, d in files.items() if f != first}, status="original")
    assert_retrievable(store, {first: files[first]}, status="cmroot")


def test_a_committed_move_on_a_bind_mount_finishes_its_clean_up_after_a_crash(
    bind_mounted_warehouse: Env,
) -> None:
    """Clean-up after commit is journaled: killed right after the commit (the sources
    were taken before it), the next open removes the emptied directories."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=3)
    store = env.open()
    faults.arm("journal.committed", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))],
                                     op="DROP_TABLE", db="db", table="t"))
    store.close()
    assert not any(os.path.exists(p) for p in files)  # taken before the commit
    assert table_dir(env.warehouse, "db", "t").exists()  # its clean-up not yet done
    reopened = env.open()
    assert not any(os.path.exists(p) for p in files)
    assert not table_dir(env.warehouse, "db", "t").exists()
    assert_retrievable(reopened, files, status="cmroot")
    assert index_counts(env)["txs"] == 0


def _refuse_renames_into(monkeypatch: pytest.MonkeyPatch, staging: Path) -> None:
    """Renames into the store fail with EXDEV (another filesystem): files are taken."""
    import errno

    real = os.rename

    def rename(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
        if str(dst).startswith(str(staging)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)


def test_a_take_never_removes_a_file_renamed_over_its_source_after_the_check(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No loss (1): a take checks the source's identity, then removes it. A writer that
    renames a new file over the path between the two (as Hadoop committers publish
    files) keeps it: the take moves whatever is there aside, sees it is not the file
    copied, and puts it back; the recycle fails as a conflict and records nothing."""
    from cmroot_testlib import on_point

    from cmroot.exceptions import Conflict

    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=2)
    _refuse_renames_into(monkeypatch, env.staging_dir)
    victim = sorted(files)[0]
    new = b"a writer's new file, renamed into place"

    def writer() -> None:
        tmp = Path(victim).with_name("_tmp")
        tmp.write_bytes(new)
        os.replace(tmp, victim)

    on_point(monkeypatch, "source.take_checked", writer)
    with pytest.raises(Conflict):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    assert Path(victim).read_bytes() == new
    for p, data in files.items():
        if p != victim:
            assert Path(p).read_bytes() == data  # put back by the rollback
    assert store.events(0, 10) == [] and index_counts(env)["entries"] == 0
    assert sorted(os.listdir(Path(victim).parent)) == sorted(Path(p).name for p in files)


def _aside(env: Env) -> list[str]:
    """Hidden names a take left in the warehouse."""
    return [n for _, _, names in os.walk(env.warehouse) for n in names
            if n.startswith(".cmroot-take-")]


@pytest.mark.parametrize("k", [1, 3])
def test_a_take_killed_with_its_source_aside_puts_that_file_back(
    bind_mounted_warehouse: Env, k: int
) -> None:
    """A take renames its source aside, checks it there, then removes it. Killed between
    the rename and the removal, the next open finds the file under the take's name (the
    transaction's and the file's) and returns it to its path: every file back with its
    bytes, nothing hidden left in the table, no event."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=4)
    names = sorted(os.listdir(Path(sorted(files)[0]).parent))
    store = env.open()
    faults.arm("source.taken_aside", k, crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    store.close()
    assert len(_aside(env)) == 1  # the crash left it there
    reopened = env.open()
    assert {p: Path(p).read_bytes() for p in files} == files
    assert _aside(env) == [] and sorted(os.listdir(Path(sorted(files)[0]).parent)) == names
    assert reopened.events(0, 10) == [] and index_counts(env)["entries"] == 0
    assert reopened.fsck().clean


def _crash_at_a_take(env: Env, files: dict[str, bytes]) -> list[str]:
    """A DROP_TABLE of `files` killed (in-process) with its first take's source aside;
    returns the directories holding an aside."""
    store = env.open()
    faults.arm("source.taken_aside", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    store.close()
    return [d for d, _, names in os.walk(env.warehouse) for n in names
            if n.startswith(".cmroot-take-")]


def test_a_take_sets_its_source_aside_at_the_top_of_the_root(
    bind_mounted_warehouse: Env,
) -> None:
    """The aside is at the top of the root, which no writer can rename away between the
    crash and the recovery (a partition directory they can: see review 37)."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    assert _crash_at_a_take(env, files) == [str(env.warehouse)]
    env.open()
    assert {p: Path(p).read_bytes() for p in files} == files and _aside(env) == []


@pytest.mark.parametrize("why", ["sticky root", "partition on another mount"])
def test_a_take_sets_its_source_aside_in_its_own_directory_where_the_top_cannot_hold_it(
    bind_mounted_warehouse: Env, tmp_path: Path, why: str
) -> None:
    """A sticky root (a file moved there may not be movable out again) or a database
    directory that is a mount of its own (rename to the top says EXDEV): the aside stays
    beside the file, and the recovery finds it there."""
    env = bind_mounted_warehouse
    with contextlib.ExitStack() as stack:
        if why == "sticky root":
            os.chmod(env.warehouse, 0o1777)
            stack.callback(os.chmod, env.warehouse, 0o755)
        else:
            dbdir = table_dir(env.warehouse, "db", "t").parent
            dbdir.mkdir()
            stack.enter_context(bind_mount(tmp_path / "real-db", dbdir))
        files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
        part = str(Path(sorted(files)[0]).parent)
        assert _crash_at_a_take(env, files) == [part]
        reopened = env.open()
        assert {p: Path(p).read_bytes() for p in files} == files and _aside(env) == []
        assert reopened.events(0, 10) == [] and index_counts(env)["entries"] == 0
        env.close_all()


def test_a_put_back_across_filesystems_without_o_tmpfile_leaves_nothing_hidden(
    bind_mounted_warehouse: Env, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Taken files put back by the rollback are copied across filesystems, into an
    unnamed file (O_TMPFILE) then linked. On a filesystem without O_TMPFILE (NFS; none
    can be mounted here, so its refusal is simulated) they go through a hidden name,
    removed after: every file back, nothing hidden."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    store = env.open()
    faults.arm("recycle.staged", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    store.close()
    assert not any(os.path.exists(p) for p in files)
    real_open = os.open

    def no_tmpfile(path, flags, *args, **kw):  # type: ignore[no-untyped-def]
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_tmpfile)
    env.open()
    monkeypatch.undo()
    assert {p: Path(p).read_bytes() for p in files} == files
    assert [n for _, _, ns in os.walk(env.warehouse) for n in ns if n.startswith(".")] == []


def test_a_take_killed_with_a_writers_file_aside_puts_the_writers_file_back(
    bind_mounted_warehouse: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer renames a new file over the source between the take's check and its
    rename; the take moves that file aside and dies there. The next open puts the
    writer's file back at the path (never the old bytes over it, never hidden) and keeps
    the copy of the old ones in the store, with no event (as for a path re-created)."""
    from cmroot_testlib import on_point

    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=2)
    victim = sorted(files)[0]
    new = b"a writer's new file, renamed into place"

    def writer() -> None:
        tmp = Path(victim).with_name("_tmp")
        tmp.write_bytes(new)
        os.replace(tmp, victim)

    store = env.open()
    on_point(monkeypatch, "source.take_checked", writer)
    faults.arm("source.taken_aside", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    store.close()
    monkeypatch.undo()
    reopened = env.open()
    assert Path(victim).read_bytes() == new
    assert {p: Path(p).read_bytes() for p in files if p != victim} == {
        p: d for p, d in files.items() if p != victim}
    assert _aside(env) == [] and sorted(os.listdir(Path(victim).parent)) == sorted(
        Path(p).name for p in files)
    assert reopened.events(0, 10) == []
    assert_retrievable(reopened, {victim: files[victim]}, status="cmroot")


def test_a_take_killed_aside_whose_path_is_re_created_keeps_the_old_bytes(
    bind_mounted_warehouse: Env,
) -> None:
    """Killed with its source aside; a writer then creates a new file at the path. The
    next open leaves the new file, keeps the old bytes in the store (retrievable, no
    event: no replica may replay a drop that did not happen) and nothing hidden."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=2)
    store = env.open()
    faults.arm("source.taken_aside", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    store.close()
    [taken] = [p for p in files if not os.path.exists(p)]
    Path(taken).write_bytes(b"re-created after the crash")
    reopened = env.open()
    assert Path(taken).read_bytes() == b"re-created after the crash"
    assert _aside(env) == []
    assert reopened.events(0, 10) == []
    assert [e.path for e in reopened.entries(limit=10)] == [taken]
    assert_retrievable(reopened, {taken: files[taken]}, status="cmroot")

def test_a_take_leaves_nothing_aside(env: Env, store: Store,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    _refuse_renames_into(monkeypatch, env.staging_dir)
    store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    assert not any(os.path.exists(p) for p in files)
    assert_retrievable(store, files, status="cmroot")
    part = Path(sorted(files)[0]).parent
    assert not part.exists() or os.listdir(part) == []

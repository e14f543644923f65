"""Crash safety and all-or-nothing recycles (invariants 1 and 2).

* In-process faults: an os-level call (rename, link, hashing read, syncfs, the index
  commit, a disk-full write, fsync) fails on the k-th file of n; the recycle is refused
  whole, every file is back at its source with identical bytes, the index holds nothing,
  no object is left behind, and the store still works.
* SIGKILL: a subprocess recycling 2,000 small files is killed at a moment chosen within
  each phase of a measured uninterrupted run (journal, stage/publish, flush, commit,
  clean-up); reopening the store recovers. Every file is at its source with its bytes or
  retrievable by (path, checksum), all 2,000 one way or the other.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cmroot_testlib import (
    Clock,
    Env,
    assert_objects_match_names,
    assert_retrievable,
    bind_mount,
    index_counts,
    make_table,
    object_files,
    snapshot,
    table_dir,
    tree,
)

import cmroot.store.layout.local as local_layout
import cmroot.store.source.local as local_source
from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError, RecycleFailed, StoreLocked
from cmroot.index import Index
from cmroot.store import RecycleRequest, Store

N = 40


class FailOnKth:
    """Wrap a callable so its k-th call matching `when` raises `error` (thread-safe)."""

    def __init__(self, real, k: int, error: BaseException, when=lambda *a, **kw: True) -> None:
        self.real, self.k, self.error, self.when = real, k, error, when
        self.calls = 0
        self.fired = False
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        if self.when(*args, **kwargs):
            with self._lock:
                self.calls += 1
                fire = self.calls == self.k
                self.fired |= fire
            if fire:
                raise self.error
        return self.real(*args, **kwargs)


def in_staging(env: Env):
    staging = str(env.staging_dir)
    return lambda src, dst, *a, **kw: str(dst).startswith(staging)


def in_objects(env: Env):
    objects = str(env.objects_dir)
    return lambda src, dst, *a, **kw: str(dst).startswith(objects)


def assert_nothing_happened(env: Env, before: dict) -> None:
    after = snapshot(env)
    assert after["warehouse"] == before["warehouse"], "the warehouse changed"
    assert after["index"] == dict.fromkeys(before["index"], 0), after["index"]
    assert object_files(env) == [], "an object was left behind"
    assert os.listdir(env.staging_dir) == [], "a staging directory was left behind"


def build(env: Env, n: int = N) -> tuple[str, dict[str, bytes]]:
    files = make_table(
        env.warehouse,
        "db",
        "t",
        [{"p": str(i)} for i in range(4)],
        files_per_partition=n // 4,
        size=(0, 3000),
    )
    return str(table_dir(env.warehouse, "db", "t")), files


def recycle_and_check_rolled_back(env: Env, store: Store, mode: str = "move") -> None:
    tdir, files = build(env)
    before = snapshot(env)
    with pytest.raises(CmrootError) as ei:
        store.recycle(RecycleRequest(paths=[tdir], mode=mode, op="DROP_TABLE", db="db", table="t"))
    assert "rolled back" in str(ei.value) or "collision" in str(ei.value) or ei.value.status < 500
    assert_nothing_happened(env, before)
    assert {p: Path(p).read_bytes() for p in files} == files


def retry_succeeds(env: Env, store: Store, mode: str = "move") -> None:
    files = {p: Path(p).read_bytes() for p in tree(env.warehouse) if os.path.isfile(p)}
    store.recycle(
        RecycleRequest(
            paths=[str(table_dir(env.warehouse, "db", "t"))],
            mode=mode,
            op="DROP_TABLE",
            db="db",
            table="t",
        )
    )
    assert_retrievable(store, files)
    assert store.fsck().clean


K = [1, N // 2, N]


@pytest.mark.parametrize("k", K)
def test_rename_into_staging_fails_on_kth_file(env, store, monkeypatch, k) -> None:
    fault = FailOnKth(os.rename, k, OSError(errno.EIO, "injected rename failure"), in_staging(env))
    monkeypatch.setattr(os, "rename", fault)
    recycle_and_check_rolled_back(env, store)
    assert fault.fired
    monkeypatch.undo()
    retry_succeeds(env, store)


@pytest.mark.parametrize("k", K)
def test_publish_link_fails_on_kth_file(env, store, monkeypatch, k) -> None:
    fault = FailOnKth(os.link, k, OSError(errno.EIO, "injected link failure"), in_objects(env))
    monkeypatch.setattr(os, "link", fault)
    recycle_and_check_rolled_back(env, store)
    assert fault.fired
    monkeypatch.undo()
    retry_succeeds(env, store)


@pytest.mark.parametrize("k", K)
def test_hashing_the_staged_file_fails_on_kth_file(env, store, monkeypatch, k) -> None:
    fault = FailOnKth(cks.of_regular_file, k, OSError(errno.EIO, "injected read failure"))
    monkeypatch.setattr(cks, "of_regular_file", fault)
    recycle_and_check_rolled_back(env, store)
    assert fault.fired


def test_flush_before_commit_fails(env, store, monkeypatch) -> None:
    fault = FailOnKth(
        local_layout.sync_filesystem, 1, OSError(errno.EIO, "injected syncfs failure")
    )
    monkeypatch.setattr(local_layout, "sync_filesystem", fault)
    recycle_and_check_rolled_back(env, store)
    assert fault.fired


def test_index_commit_fails(env, store, monkeypatch) -> None:
    fault = FailOnKth(Index.commit_recycle, 1, sqlite3.OperationalError("disk I/O error"))
    monkeypatch.setattr(Index, "commit_recycle", fault)
    recycle_and_check_rolled_back(env, store)
    assert fault.fired
    monkeypatch.undo()
    retry_succeeds(env, store)


@pytest.mark.parametrize("mode", ["copy", "move-cross-device"])
@pytest.mark.parametrize("k", [1, N])
def test_disk_full_mid_copy(env, store, monkeypatch, mode, k) -> None:
    """A copy into staging (copy mode, or a move across filesystems) that runs out of space
    half-way leaves a partial staged file; it must never be recorded or published."""
    staging = str(env.staging_dir)
    if mode == "move-cross-device":
        real_rename = os.rename

        def exdev(src, dst, *a, **kw):
            if str(dst).startswith(staging):
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return real_rename(src, dst, *a, **kw)

        monkeypatch.setattr(os, "rename", exdev)

    class DiskFull:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, data) -> int:
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    calls = {"n": 0}
    lock = threading.Lock()

    def fake_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)  # noqa: SIM115 - handed to the caller
        if ("w" in mode or "x" in mode) and str(file).startswith(staging):
            with lock:
                calls["n"] += 1
                hit = calls["n"] == k
            if hit:
                return DiskFull(f)
        return f

    monkeypatch.setattr(local_source, "open", fake_open, raising=False)
    real_mode = "copy" if mode == "copy" else "move"
    recycle_and_check_rolled_back(env, store, mode=real_mode)
    assert calls["n"] >= k
    monkeypatch.undo()
    retry_succeeds(env, store, mode=real_mode)


@pytest.mark.parametrize("k", [1, N])
def test_fsync_of_a_copy_fails(env, store, monkeypatch, k) -> None:
    fault = FailOnKth(os.fsync, k, OSError(errno.EIO, "injected fsync failure"))
    monkeypatch.setattr(os, "fsync", fault)
    recycle_and_check_rolled_back(env, store, mode="copy")
    assert fault.fired


def test_cross_device_move_copies_then_removes_the_source(env, store, monkeypatch) -> None:
    tdir, files = build(env)
    real_rename = os.rename
    staging = str(env.staging_dir)

    def exdev(src, dst, *a, **kw):
        if str(dst).startswith(staging):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", exdev)
    store.recycle(RecycleRequest(paths=[tdir], mode="move", op="DROP_TABLE"))
    assert not Path(tdir).exists()
    assert_retrievable(store, files, status="cmroot")


def test_a_failed_recycle_is_a_recycle_failed_error(env, store, monkeypatch) -> None:
    tdir, _ = build(env)
    monkeypatch.setattr(
        os, "link", FailOnKth(os.link, 3, OSError(errno.EIO, "boom"), in_objects(env))
    )
    with pytest.raises(RecycleFailed) as ei:
        store.recycle(RecycleRequest(paths=[tdir], op="DROP_TABLE"))
    assert "every file is back at its source" in str(ei.value)


def test_rollback_keeps_a_re_created_source(env, store, monkeypatch) -> None:
    """If a writer re-creates a source path while its file is away and the recycle then
    fails, putting the old file back would clobber the new one: the old bytes are kept in
    the store instead (recorded), and the new file is untouched."""
    tdir, files = build(env, 8)
    victim = sorted(files)[0]
    real_link = os.link
    objects = str(env.objects_dir)
    state = {"n": 0}

    def link(src, dst, *a, **kw):
        if str(dst).startswith(objects):
            state["n"] += 1
            if state["n"] == len(files):  # every file is staged by now: a writer comes back
                Path(victim).parent.mkdir(parents=True, exist_ok=True)
                Path(victim).write_bytes(b"new writer")
                raise OSError(errno.EIO, "injected")
        return real_link(src, dst, *a, **kw)

    store.recycler.workers = 1
    monkeypatch.setattr(os, "link", link)
    with pytest.raises(RecycleFailed):
        store.recycle(RecycleRequest(paths=[tdir], op="DROP_TABLE"))
    monkeypatch.undo()
    assert Path(victim).read_bytes() == b"new writer"
    others = {p: b for p, b in files.items() if p != victim}
    assert {p: Path(p).read_bytes() for p in others} == others
    assert_retrievable(store, {victim: files[victim]}, status="cmroot")
    assert os.listdir(env.staging_dir) == []
    assert store.fsck().clean


def test_second_writer_is_locked_out_but_readers_are_not(env, store) -> None:
    with pytest.raises(StoreLocked) as ei:
        Store.open(env.config(), clock=env.clock)
    # Refused as what it is, not as "in use by pid <this very process>".
    assert "already open for writing in this process" in str(ei.value)
    assert f"pid {os.getpid()}" not in str(ei.value)
    ro = env.open(readonly=True)
    assert ro.resolve([]) == []
    ro.close()


def test_a_second_open_in_one_process_never_rolls_back_the_first_ones_recycle(
    env, store
) -> None:
    """Recovery belongs to the one writer: a second open in the same process is refused
    before it could roll back a recycle the first one has in flight."""
    tdir, files = build(env, 8)
    faults.arm("recycle.staged", crash=True)  # leaves the transaction open, files staged
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[tdir], op="DROP_TABLE"))
    with pytest.raises(StoreLocked):
        Store.open(env.config(), clock=env.clock)
    assert index_counts(env)["txs"] == 1
    assert not any(os.path.exists(p) for p in files)  # still staged, untouched


# -- SIGKILL ------------------------------------------------------------------------------------

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))  # recovery runs here too
if args["path"]:
    store.recycle(RecycleRequest(paths=[args["path"]], mode=args["mode"], op="DROP_TABLE",
                                 db="db", table="t", partitions=args["partitions"]))
store.close()
print("done", flush=True)
"""

CRASH_FILES = 200
REPO = str(Path(__file__).resolve().parents[2])
# Every place a recycle can die, in order (CMROOT_FAULTS=NAME@K kills the process with
# SIGKILL the K-th time execution passes NAME).
KILL_POINTS = (
    "journal.begun",
    "recycle.file_staged@1",
    f"recycle.file_staged@{CRASH_FILES // 2}",
    f"recycle.file_published@{CRASH_FILES // 2}",
    f"recycle.file_published@{CRASH_FILES}",
    "recycle.staged",
    "recycle.flushed",
    "journal.committed",
    "journal.unstaged",
)


def _crash_env(base: Path, name: str) -> Env:
    d = base / name
    e = Env(
        base=d, warehouse=d / "wh", store_root=d / "cmroot", outside=d / "outside", clock=Clock()
    )
    e.warehouse.mkdir(parents=True)
    return e


def _crash_table(e: Env, seed: int) -> tuple[str, dict[str, bytes], list[dict[str, str]]]:
    parts = [{"p": f"{i:02d}"} for i in range(10)]
    files = make_table(
        e.warehouse,
        "db",
        "t",
        parts,
        files_per_partition=CRASH_FILES // 10,
        size=(1, 1024),
        rng=random.Random(seed),
    )
    return str(table_dir(e.warehouse, "db", "t")), files, parts


def _run_child(e: Env, path: str | None, mode: str, parts, fault: str | None) -> int:
    """Run a recycle (or, with no path, just an open: recovery) in a fresh process that
    dies by SIGKILL at `fault`. Returns the exit code."""
    env = e.env()
    args = {"env": env, "path": path, "mode": mode, "partitions": parts}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, REPO, json.dumps(args)],
        env={**os.environ, "CMROOT_FAULTS": fault or ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if fault is None:
        assert proc.returncode == 0, proc.stderr
    return proc.returncode


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["move", "copy"])
def test_sigkill_at_every_journal_phase_is_all_or_nothing(tmp_path: Path, mode: str) -> None:
    """kill -9 at each fault point of the forward path, then recovery at the next open:
    every file at its source and no event, or every file in the store and one event."""
    outcomes: dict[str, str] = {}
    for i, point in enumerate(KILL_POINTS):
        e = _crash_env(tmp_path, f"{mode}-{i}")
        path, files, parts = _crash_table(e, i)
        rc = _run_child(e, path, mode, parts, point)
        assert rc == -signal.SIGKILL, f"{point}: the fault point was never reached (rc {rc})"
        try:
            outcomes[point] = _check_after_crash(e, files, mode)
        except AssertionError as err:
            raise AssertionError(f"killed at {point} ({mode}): {err}") from err
    print("crash outcomes:", outcomes)
    committed = {p for p, o in outcomes.items() if o == "committed"}
    assert committed == {"journal.committed", "journal.unstaged"}, outcomes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [1, CRASH_FILES // 2])
def test_sigkill_during_recovery_then_recovery_again(tmp_path: Path, k: int) -> None:
    """A crash while rolling back (at the k-th file put back) is itself recovered."""
    e = _crash_env(tmp_path, f"r{k}")
    path, files, parts = _crash_table(e, k)
    assert _run_child(e, path, "move", parts, "recycle.staged") == -signal.SIGKILL
    assert _run_child(e, None, "move", parts, f"journal.rolled_back_file@{k}") == -signal.SIGKILL
    assert _check_after_crash(e, files, "move") == "rolled back"


@pytest.mark.timeout(300)
def test_sigkill_with_a_taken_source_aside_is_rolled_back(tmp_path: Path) -> None:
    """A move onto a warehouse that is a bind mount (rename says EXDEV: every file is
    taken, copied then removed), killed with -9 between a take's move of its source aside
    and its removal: the next open puts every file back, the hidden one included."""
    e = _crash_env(tmp_path, "take")
    with bind_mount(tmp_path / "real-warehouse", e.warehouse):
        path, files, parts = _crash_table(e, 7)
        point = f"source.taken_aside@{CRASH_FILES // 2}"
        assert _run_child(e, path, "move", parts, point) == -signal.SIGKILL
        hidden = [n for _, _, ns in os.walk(e.warehouse) for n in ns
                  if n.startswith(".cmroot-take-")]
        assert len(hidden) == 1, hidden
        assert _check_after_crash(e, files, "move") == "rolled back"
        assert not [n for _, _, ns in os.walk(e.warehouse) for n in ns if n.startswith(".")]

@pytest.mark.timeout(300)
def test_sigkill_while_a_take_is_put_back_leaves_nothing_hidden(tmp_path: Path) -> None:
    """A move onto a bind-mounted warehouse (every file taken) killed once all are taken;
    the recovery, putting the copies back across filesystems (a copy, then a link), is
    killed -9 half way between a copy and its link. The next open puts every file back
    and leaves no temporary name in the warehouse."""
    e = _crash_env(tmp_path, "put-back")
    with bind_mount(tmp_path / "real-warehouse", e.warehouse):
        path, files, parts = _crash_table(e, 8)
        assert _run_child(e, path, "move", parts, "recycle.staged") == -signal.SIGKILL
        point = f"source.put_back_copied@{CRASH_FILES // 2}"
        assert _run_child(e, None, "move", parts, point) == -signal.SIGKILL
        assert _check_after_crash(e, files, "move") == "rolled back"
        assert not [n for _, _, ns in os.walk(e.warehouse) for n in ns if n.startswith(".")]


def _check_after_crash(e: Env, files: dict[str, bytes], mode: str) -> str:
    store = Store.open(e.config(), clock=e.clock)  # recovery runs here
    try:
        assert os.listdir(e.staging_dir) == [], "staging leftovers after recovery"
        counts = index_counts(e)
        assert counts["txs"] == 0 and counts["journal"] == 0
        at_source = 0
        for p, data in files.items():
            if os.path.lexists(p):
                assert Path(p).read_bytes() == data, f"{p} has other bytes at its source"
                at_source += 1
        committed = counts["entries"]
        if committed == 0:
            outcome = "rolled back"
            assert at_source == CRASH_FILES, f"only {at_source} files back at their source"
            assert counts["events"] == 0 and counts["objects"] == 0
            assert object_files(e) == [], "objects left behind by a rolled-back recycle"
        else:
            outcome = "committed"
            assert committed == CRASH_FILES, f"{committed} entries: not all or nothing"
            assert counts["events"] == 1
            if mode == "move":
                assert at_source == 0, f"{at_source} files both committed and at source"
                left = [d for d in {os.path.dirname(p) for p in files} if os.path.exists(d)]
                assert not left, f"emptied directories left behind: {left[:3]}"
            assert_retrievable(store, files, status=None)
            assert all(
                r.status == ("cmroot" if mode == "move" else "original")
                for r in store.resolve(
                    [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
                )
            )
        assert_objects_match_names(e)
        report = store.fsck()
        assert report.clean, report.to_json()
    finally:
        store.close()
    # recovery is idempotent: a second open finds nothing to do and changes nothing
    snap = snapshot(e)
    Store.open(e.config(), clock=e.clock).close()
    assert snapshot(e) == snap
    return outcome


# -- recovery, deterministically ------------------------------------------------------------------


def crash_mid_recycle(env: Env, store: Store, monkeypatch, k: int, mode: str = "move") -> None:
    """Leave the store as a crash right after the k-th publish: journal open, files staged
    (and some published), nothing committed. An injected crash (faults.Crash) stops the
    recycle where it stands, as process death would; the store is then closed."""
    faults.arm("recycle.file_published", k, crash=True)
    store.recycler.workers = 1
    with pytest.raises(faults.Crash):
        store.recycle(
            RecycleRequest(
                paths=[str(table_dir(env.warehouse, "db", "t"))], mode=mode, op="DROP_TABLE"
            )
        )
    store.close()
    assert index_counts(env)["txs"] == 1
    assert os.listdir(env.staging_dir) != []


@pytest.mark.parametrize("mode", ["move", "copy"])
def test_recovery_puts_every_file_back(env, store, monkeypatch, mode) -> None:
    _, files = build(env)
    before = snapshot(env)
    crash_mid_recycle(env, store, monkeypatch, N // 2, mode)
    if mode == "move":
        assert any(not os.path.exists(p) for p in files)  # the crash left files away
    reopened = env.open()
    assert_nothing_happened(env, before)
    assert {p: Path(p).read_bytes() for p in files} == files
    assert reopened.fsck().clean


def test_recovery_keeps_a_file_whose_source_was_re_created(env, store, monkeypatch) -> None:
    _, files = build(env)
    crash_mid_recycle(env, store, monkeypatch, N)
    away = sorted(p for p in files if not os.path.exists(p))
    assert away
    Path(away[0]).write_bytes(b"a writer re-created this path")
    reopened = env.open()
    assert Path(away[0]).read_bytes() == b"a writer re-created this path"
    assert_retrievable(reopened, {away[0]: files[away[0]]}, status="cmroot")
    others = {p: b for p, b in files.items() if p != away[0]}
    assert {p: Path(p).read_bytes() for p in others} == others
    assert [e.path for e in reopened.entries()] == [away[0]]
    assert index_counts(env)["txs"] == 0
    assert os.listdir(env.staging_dir) == []
    assert reopened.fsck().clean


def test_recovery_finishes_a_committed_recycle_whose_clean_up_was_cut_short(
    env, store, monkeypatch
) -> None:
    tdir, files = build(env)
    faults.arm("journal.committed", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[tdir], op="DROP_TABLE"))
    store.close()
    assert os.listdir(env.staging_dir) != []  # staged names left behind
    reopened = env.open()
    assert os.listdir(env.staging_dir) == []
    assert_retrievable(reopened, files, status="cmroot")
    assert reopened.fsck().clean

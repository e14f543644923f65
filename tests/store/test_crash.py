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
import time
from pathlib import Path

import pytest
from cmroot_testlib import (
    Clock,
    Env,
    assert_objects_match_names,
    assert_retrievable,
    index_counts,
    make_table,
    object_files,
    snapshot,
    table_dir,
    tree,
)

import cmroot.store.recycle as recycle_mod
from cmroot import checksum as cks
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
    fault = FailOnKth(cks.of_local_file, k, OSError(errno.EIO, "injected read failure"))
    monkeypatch.setattr(cks, "of_local_file", fault)
    recycle_and_check_rolled_back(env, store)
    assert fault.fired


def test_flush_before_commit_fails(env, store, monkeypatch) -> None:
    fault = FailOnKth(recycle_mod.sync_filesystem, 1, OSError(errno.EIO, "injected syncfs failure"))
    monkeypatch.setattr(recycle_mod, "sync_filesystem", fault)
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
        if "w" in mode and str(file).startswith(staging):
            with lock:
                calls["n"] += 1
                hit = calls["n"] == k
            if hit:
                return DiskFull(f)
        return f

    monkeypatch.setattr(recycle_mod, "open", fake_open, raising=False)
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
    assert str(os.getpid()) in str(ei.value)
    ro = env.open(readonly=True)
    assert ro.resolve([]) == []
    ro.close()


# -- SIGKILL ------------------------------------------------------------------------------------

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
import cmroot.store.recycle as R
from cmroot.index import Index
from cmroot.store import RecycleRequest, Store

marks = {}
def mark(name, f):
    def wrapped(*a, **kw):
        marks[name + "_start"] = time.monotonic() - t0
        try:
            return f(*a, **kw)
        finally:
            marks[name + "_end"] = time.monotonic() - t0
    return wrapped

# timestamps only: the code under test runs unchanged
Index.journal_begin = mark("journal", Index.journal_begin)
R.Recycler._stage_all = mark("stage", R.Recycler._stage_all)
R.sync_filesystem = mark("flush", R.sync_filesystem)
R.Recycler._commit = mark("commit", R.Recycler._commit)
R.Recycler._finish = mark("finish", R.Recycler._finish)

store = Store.open(config.load(None, env=args["env"]))
req = RecycleRequest(paths=[args["path"]], mode=args["mode"], op="DROP_TABLE", db="db",
                     table="t", partitions=args["partitions"])
print("ready", flush=True)
t0 = time.monotonic()
res = store.recycle(req)
marks["total"] = time.monotonic() - t0
print(json.dumps(marks), flush=True)
"""

CRASH_FILES = 2000
CRASH_RUNS = 20
PHASES = ("journal", "stage", "flush", "commit", "finish")
REPO = str(Path(__file__).resolve().parents[2])


def _crash_env(base: Path, name: str) -> Env:
    d = base / name
    e = Env(
        base=d, warehouse=d / "wh", store_root=d / "cmroot", outside=d / "outside", clock=Clock()
    )
    e.warehouse.mkdir(parents=True)
    return e


def _crash_table(e: Env, seed: int) -> tuple[str, dict[str, bytes], list[dict[str, str]]]:
    parts = [{"p": f"{i:02d}"} for i in range(20)]
    files = make_table(
        e.warehouse,
        "db",
        "t",
        parts,
        files_per_partition=CRASH_FILES // 20,
        size=(1, 1024),
        rng=random.Random(seed),
    )
    return str(table_dir(e.warehouse, "db", "t")), files, parts


def _spawn(e: Env, path: str, mode: str, parts) -> subprocess.Popen:
    args = {"env": e.env(), "path": path, "mode": mode, "partitions": parts}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, REPO, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read()}")
    return proc


def _measure(base: Path, mode: str) -> dict[str, float]:
    e = _crash_env(base, f"measure-{mode}")
    path, files, parts = _crash_table(e, 99)
    proc = _spawn(e, path, mode, parts)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    marks = json.loads(out.strip().splitlines()[-1])
    s = Store.open(e.config())
    try:
        assert_retrievable(s, files, status="cmroot" if mode == "move" else "original")
    finally:
        s.close()
    return marks


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


@pytest.mark.timeout(240)
def test_sigkill_at_a_random_moment_is_all_or_nothing(tmp_path: Path) -> None:
    rng = random.Random(20240601)
    windows = {mode: _measure(tmp_path, mode) for mode in ("move", "copy")}
    # every 4th run copies instead of moving; the kill lands in each phase in turn
    plan = []
    for run in range(CRASH_RUNS):
        mode = "copy" if run % 4 == 3 else "move"
        phase = PHASES[run % len(PHASES)]
        m = windows[mode]
        lo, hi = m[f"{phase}_start"], m[f"{phase}_end"]
        plan.append((run, mode, phase, rng.uniform(lo, hi)))

    outcomes: dict[str, int] = {}
    for run, mode, phase, delay in plan:
        e = _crash_env(tmp_path, f"run{run}")
        path, files, parts = _crash_table(e, run)
        proc = _spawn(e, path, mode, parts)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        try:
            outcome = _check_after_crash(e, files, mode)
        except AssertionError as err:
            raise AssertionError(
                f"run {run} ({mode}, killed in {phase} at {delay:.3f}s): {err}"
            ) from err
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print("crash outcomes:", outcomes, [(r, m, p, round(d, 3)) for r, m, p, d in plan], windows)
    assert sum(outcomes.values()) == CRASH_RUNS
    # the kills landed on both sides of the commit
    assert outcomes.get("rolled back", 0) >= 1, outcomes


# -- recovery, deterministically ------------------------------------------------------------------


def crash_mid_recycle(env: Env, store: Store, monkeypatch, k: int, mode: str = "move") -> None:
    """Leave the store as a crash after the k-th publish would: journal open, files staged
    (and some published), nothing committed. The rollback a live process would do is
    disabled, then the store is closed without clean-up."""
    monkeypatch.setattr(recycle_mod.Recycler, "_undo", lambda self, txid, items, mode: None)
    fault = FailOnKth(os.link, k, OSError(errno.EIO, "the machine died"), in_objects(env))
    monkeypatch.setattr(os, "link", fault)
    with pytest.raises(CmrootError):
        store.recycle(
            RecycleRequest(
                paths=[str(table_dir(env.warehouse, "db", "t"))], mode=mode, op="DROP_TABLE"
            )
        )
    monkeypatch.undo()
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
    monkeypatch.setattr(recycle_mod.Recycler, "_finish", lambda self, *a: None)
    store.recycle(RecycleRequest(paths=[tdir], op="DROP_TABLE"))
    monkeypatch.undo()
    store.close()
    assert os.listdir(env.staging_dir) != []  # staged names left behind
    reopened = env.open()
    assert os.listdir(env.staging_dir) == []
    assert_retrievable(reopened, files, status="cmroot")
    assert reopened.fsck().clean

"""Hostile review 16: a prepare of >= 256 files is staged by several threads (b3729b1).

Attacks all-or-nothing, exactly-once publication, private objects of hard-linked files,
fd hygiene and deadlocks of threaded prepares. Races are driven from fault points and
os-level wrappers, never with sleeps. One failed on b3729b1 (intermittently: the late
rename had to land on a reused descriptor): an interrupt of the waiting thread rolled the
prepare back while staging threads still moved files, and the clean-up of the staging
directory then deleted a warehouse file a thread had just staged. Fixed in
`Recycler._stage_all` (the threads are stopped and waited for, through further
interrupts, before any rollback: now `_Batches.close_and_wait`, since an interrupt during
a thread's start escaped the pool's own wait; see the last test). The rest are guards
that held."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cmroot_testlib import Clock, Env, make_table, object_files, on_point, snapshot, table_dir

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest, Store

REPO = str(Path(__file__).resolve().parents[2])
ODD = ["a b", "é%20ü", "x=1,y", "-dash", "q'uote", "tab\tname"]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _deep(env: Env, n_parts: int = 6, per: int = 60) -> tuple[Path, dict[str, bytes]]:
    """A table of n_parts*per small files in nested, oddly named partitions."""
    parts = [{"k": ODD[i % len(ODD)], "k2": f"v{i}", "k3": "deep"} for i in range(n_parts)]
    files = make_table(env.warehouse, "db", "t", parts, files_per_partition=per, size=(5, 200))
    return table_dir(env.warehouse, "db", "t"), files


def _drop(tdir: Path | str, **kw: object) -> RecycleRequest:
    return RecycleRequest(paths=[str(tdir)], op="DROP_TABLE", db="db", table="t", **kw)  # type: ignore[arg-type]


def _untouched(env: Env, before: dict[str, object], files: dict[str, bytes]) -> None:
    after = snapshot(env)
    assert after["warehouse"] == before["warehouse"], "the warehouse changed"
    assert after["index"] == before["index"], "the index changed"
    assert {p: Path(p).read_bytes() for p in files} == files
    assert object_files(env) == []
    assert os.listdir(env.staging_dir) == []


def _threads_seen(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    names: set[str] = set()
    real = faults.point

    def point(n: str) -> None:
        if n == "recycle.file_staged":
            names.add(threading.current_thread().name)
        real(n)

    monkeypatch.setattr(faults, "point", point)
    return names


def _committed_ok(env: Env, store: Store, files: dict[str, bytes], res: object) -> None:
    assert sorted(f.path for f in res.files) == sorted(files)  # type: ignore[attr-defined]
    assert len(res.files) == len(files)  # type: ignore[attr-defined]
    [event] = store.events()
    assert sorted(f["path"] for f in event.files) == sorted(files)
    for path, data in files.items():
        assert not os.path.lexists(path), path
        with store.open_verified(path, cks.of_bytes(data)) as v:
            assert os.pread(v.fd, len(data) + 1, 0) == data, path
    assert os.listdir(env.staging_dir) == []


# -- guards: a threaded prepare that succeeds ---------------------------------------------


def test_threaded_prepare_of_deep_odd_partitions_commits_every_file_once(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tdir, files = _deep(env)
    seen = _threads_seen(monkeypatch)
    fds = _fds()
    p = store.prepare(_drop(tdir))
    assert len(seen) > 1, seen
    assert sorted(f.path for f in p.files) == sorted(files)
    assert store.events() == []
    res = store.commit(p.txid)
    _committed_ok(env, store, files, res)
    assert _fds() <= fds, "descriptors leaked by a threaded prepare"


def test_many_threaded_prepares_leak_no_descriptor_or_thread(env: Env, store: Store) -> None:
    tdir, files = _deep(env, n_parts=3, per=100)
    p = store.prepare(_drop(tdir))
    store.abort(p.txid)
    fds, nthreads = _fds(), threading.active_count()
    for _ in range(4):
        p = store.prepare(_drop(tdir))
        assert store.abort(p.txid) == []
    assert _fds() <= fds
    assert threading.active_count() <= nthreads
    assert {q: Path(q).read_bytes() for q in files} == files


def test_hard_links_inside_and_outside_a_threaded_part_get_private_objects(
    env: Env, store: Store
) -> None:
    tdir, files = _deep(env)
    keys = sorted(files)
    # Two names of one inode, both in the part (different partitions); and one with a
    # name in another table.
    a, b, c = keys[3], keys[-3], keys[len(keys) // 2]
    os.unlink(b)
    os.link(a, b)
    files[b] = files[a]
    other = env.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    os.link(c, other)
    wh_inodes = {(os.stat(x).st_dev, os.stat(x).st_ino) for x in (a, c)}
    p = store.prepare(_drop(tdir))
    res = store.commit(p.txid)
    _committed_ok(env, store, files, res)
    with open(other, "r+b") as fh:
        fh.write(b"u's own later write")
    inodes = {(os.stat(o).st_dev, os.stat(o).st_ino) for o in object_files(env)}
    assert not (wh_inodes & inodes)
    assert (os.stat(other).st_dev, os.stat(other).st_ino) not in inodes
    with store.open_verified(c, cks.of_bytes(files[c])) as v:
        assert os.pread(v.fd, len(files[c]) + 1, 0) == files[c]


# -- failures inside a threaded prepare -----------------------------------------------------


@pytest.mark.parametrize("k", [1, 130, 359])
def test_enospc_at_any_file_of_a_deep_threaded_prepare_puts_every_file_back(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    tdir, files = _deep(env)
    before = snapshot(env)
    fds = _fds()

    def fail() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    on_point(monkeypatch, "recycle.file_staged", fail, k=k)
    with pytest.raises(CmrootError):
        store.prepare(_drop(tdir))
    monkeypatch.undo()
    _untouched(env, before, files)
    assert store.events() == []
    assert _fds() <= fds


def test_a_failed_join_of_a_threaded_part_rolls_back_the_earlier_threaded_part(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, files = _deep(env)
    before = snapshot(env)
    parts = sorted({str(Path(f).parent) for f in files})
    half = len(parts) // 2
    first = store.prepare(RecycleRequest(paths=parts[:half], op="DROP_TABLE", db="db", table="t"))

    def fail() -> None:
        raise OSError(errno.EIO, "injected I/O error")

    on_point(monkeypatch, "recycle.file_staged", fail, k=100)
    with pytest.raises(CmrootError):
        store.prepare(RecycleRequest(paths=parts[half:], op="DROP_TABLE", db="db", table="t"),
                      txid=first.txid)
    monkeypatch.undo()
    _untouched(env, before, files)
    assert store.events() == []


def _swap_on_rename(monkeypatch: pytest.MonkeyPatch, victim: str, how: str) -> None:
    """When staging renames `victim` (by name below its parent's descriptor), a writer
    first swaps it (after rename_out's own lstat check) for a symlink or a directory."""
    real = os.rename
    base = os.path.basename(victim)
    done = {"n": 0}

    def rename(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
        if src == base and kw.get("src_dir_fd") is not None and not done["n"]:
            done["n"] = 1
            os.rename(victim, victim + ".writer-moved")  # absolute: not our hook's branch
            if how == "symlink":
                os.symlink("/etc/passwd", victim)
            else:
                os.mkdir(victim)
                Path(victim, "inner").write_bytes(b"inner")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)


@pytest.mark.parametrize("how", ["symlink", "directory"])
def test_a_file_swapped_mid_threaded_prepare_refuses_and_puts_everything_back(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    tdir, files = _deep(env)
    victim = sorted(files)[200]
    _swap_on_rename(monkeypatch, victim, how)
    with pytest.raises(CmrootError):
        store.prepare(_drop(tdir))
    monkeypatch.undo()
    # Every other file back with its bytes; the swapped-in thing back at the victim's path
    # as it was; the writer's moved file untouched.
    for path, data in files.items():
        if path != victim:
            assert Path(path).read_bytes() == data, path
    assert Path(victim + ".writer-moved").read_bytes() == files[victim]
    if how == "symlink":
        assert os.readlink(victim) == "/etc/passwd"
    else:
        assert Path(victim, "inner").read_bytes() == b"inner"
    assert object_files(env) == []
    assert os.listdir(env.staging_dir) == []
    assert store.events() == []


def test_exdev_fallback_in_a_threaded_prepare_commits_and_removes_sources(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tdir, files = _deep(env)
    real = os.rename
    refused = {os.path.basename(k) for k in sorted(files)[::7]}

    def rename(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
        if kw.get("src_dir_fd") is not None and src in refused and "staging" in str(dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    p = store.prepare(_drop(tdir))
    res = store.commit(p.txid)
    monkeypatch.undo()
    _committed_ok(env, store, files, res)


def test_exdev_fallback_then_failure_in_a_threaded_prepare_puts_every_file_back(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tdir, files = _deep(env)
    before = snapshot(env)
    real = os.rename
    refused = {os.path.basename(k) for k in sorted(files)[::5]}

    def rename(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
        if kw.get("src_dir_fd") is not None and src in refused and "staging" in str(dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)

    def fail() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    on_point(monkeypatch, "recycle.file_staged", fail, k=250)
    with pytest.raises(CmrootError):
        store.prepare(_drop(tdir))
    monkeypatch.undo()
    _untouched(env, before, files)
    assert store.events() == []


def test_an_injected_crash_inside_a_threaded_prepare_is_rolled_back_at_reopen(env: Env) -> None:
    tdir, files = _deep(env)
    before = snapshot(env)
    store = env.open()
    faults.arm("recycle.file_staged", 170, crash=True)
    with pytest.raises(faults.Crash):
        store.prepare(_drop(tdir))
    faults.disarm()
    store.close()
    env._open.clear()
    store = env.open()
    try:
        _untouched(env, before, files)
        assert store.events() == []
    finally:
        store.close()


def test_a_hard_linked_file_written_through_its_other_name_mid_prepare_fails_whole(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer writes through a hard-linked file's other name between its rename and
    its hash; the prepare either succeeds hashing consistent bytes or rolls back all."""
    tdir, files = _deep(env)
    c = sorted(files)[150]
    other = env.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    os.link(c, other)
    p = store.prepare(_drop(tdir))
    res = store.commit(p.txid)
    _committed_ok(env, store, files, res)
    with open(other, "r+b") as fh:
        fh.write(b"ZZZZ")
    with store.open_verified(c, cks.of_bytes(files[c])) as v:
        assert os.pread(v.fd, len(files[c]) + 1, 0) == files[c]


CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))
parts = args["parts"]
h = len(parts) // 2
p = store.prepare(RecycleRequest(paths=parts[:h], op="DROP_TABLE", db="db", table="t"), lease=600)
print(p.txid, flush=True)
store.prepare(RecycleRequest(paths=parts[h:], op="DROP_TABLE", db="db", table="t"), txid=p.txid)
store.commit(p.txid)
store.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["recycle.file_staged@300", "recycle.file_staged@10"])
def test_sigkill_inside_a_threaded_join_rolls_back_both_parts(tmp_path: Path, point: str) -> None:
    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir(parents=True)
    e.outside.mkdir()
    _, files = _deep(e, n_parts=4, per=140)
    parts = sorted({str(Path(f).parent) for f in files})
    before = snapshot(e)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, REPO, json.dumps({"env": e.env(), "parts": parts})],
        env={**os.environ, "CMROOT_FAULTS": point}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    import time

    e.clock.set(time.time())
    store = e.open()
    try:
        if point.endswith("@300"):  # inside the join: the first part still leased
            e.clock.advance(601)
            store.expire_prepared()
        _untouched(e, before, files)
        assert store.events() == []
    finally:
        store.close()


def test_files_vanishing_mid_threaded_prepare_put_every_other_file_back(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tdir, files = _deep(env)
    keys = sorted(files)
    gone = [k for k in keys[::37]]

    def vanish() -> None:
        for k in gone:
            if os.path.lexists(k):
                os.rename(k, k + ".away")

    on_point(monkeypatch, "recycle.file_staged", vanish, k=20)
    with pytest.raises(CmrootError):
        store.prepare(_drop(tdir))
    monkeypatch.undo()
    for path, data in files.items():
        at = path if os.path.lexists(path) else path + ".away"
        assert Path(at).read_bytes() == data, path
        assert not (os.path.lexists(path) and os.path.lexists(path + ".away")), path
    assert object_files(env) == []
    assert os.listdir(env.staging_dir) == []
    assert store.events() == []


def test_two_threaded_prepares_of_one_table_racing_lose_no_file(
    env: Env, store: Store
) -> None:
    tdir, files = _deep(env)
    out: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str) -> None:
        barrier.wait()
        try:
            out[name] = store.prepare(_drop(tdir))
        except CmrootError as e:
            out[name] = e

    ts = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "deadlock"
    ok = [v for v in out.values() if not isinstance(v, Exception)]
    assert len(ok) <= 1
    if ok:
        res = store.commit(ok[0].txid)  # type: ignore[attr-defined]
        _committed_ok(env, store, files, res)
    else:
        assert {p: Path(p).read_bytes() for p in files} == files
        assert object_files(env) == []
        assert os.listdir(env.staging_dir) == []


def test_a_threaded_join_naming_earlier_files_again_publishes_each_once(
    env: Env, store: Store
) -> None:
    _, files = _deep(env)
    parts = sorted({str(Path(f).parent) for f in files})
    p = store.prepare(RecycleRequest(paths=parts[:4], op="DROP_TABLE", db="db", table="t",
                                     mode="copy"))
    store.prepare(RecycleRequest(paths=parts, op="DROP_TABLE", db="db", table="t", mode="copy"),
                  txid=p.txid)
    res = store.commit(p.txid)
    assert sorted(f.path for f in res.files) == sorted(files)
    [event] = store.events()
    assert sorted(f["path"] for f in event.files) == sorted(files)
    for path, data in files.items():
        with store.open_verified(path, cks.of_bytes(data)) as v:
            assert os.pread(v.fd, len(data) + 1, 0) == data


class _Interrupted(BaseException):
    """What a SIGINT/SIGTERM handler raises in the main thread (KeyboardInterrupt,
    SystemExit)."""


@pytest.mark.timeout(90)
def test_ctrl_c_during_a_threaded_prepare_loses_no_file(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed intermittently on b3729b1 (about 1 run in 4: it depended on descriptor-number
    reuse); since the rollback waits for the staging batches, all is put back.
    Sequence: an in-process (library/CLI) caller runs a 360-file prepare on its main
    thread; a staging thread is about to rename its next file (its directory descriptor
    in hand) when SIGINT arrives and KeyboardInterrupt is raised in the main thread,
    waiting in the pool's shutdown. `_stage_prepared` catches it and `_abort` rolls
    back (closing the staging session, reopening descriptors for the put-backs) while
    the staging threads are still running (`failed` is never set, they are not waited
    for); the late rename goes ahead through a descriptor number the rollback's session
    reuses, into staging/<txid>/, which the rollback then rmtree()s. Lost: a warehouse
    file, deleted (or stranded in staging with no journal row). Invariant: all or nothing.
    Before b3729b1 small files were staged on the calling thread, so the interrupt
    stopped staging itself. Responsible: Recycler._stage_all (`with ThreadPoolExecutor`:
    an exception in the waiting thread neither sets `failed` nor waits for the workers)
    and Recycler._stage_prepared (rolls back before the workers have stopped).
    Observed when it fails: the late rename succeeded (staging/<txid>/66) after the
    rollback had passed that file; the rollback's rmtree then deleted it: part-00047 gone
    from the warehouse, not in staging, no object. When it passes, the late rename hit
    EBADF/ENOENT (descriptor closed, or reused for another directory)."""
    import signal

    tdir, files = _deep(env)
    main = threading.main_thread().ident
    assert threading.get_ident() == main
    go, done = threading.Event(), threading.Event()
    late: dict[str, object] = {}
    real = os.rename
    calls = {"n": 0}
    lock = threading.Lock()

    def rename(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
        if kw.get("src_dir_fd") is None or threading.get_ident() == main:
            return real(src, dst, *a, **kw)
        with lock:
            calls["n"] += 1
            mine = calls["n"] == 5
        if not mine:
            return real(src, dst, *a, **kw)
        signal.pthread_kill(main, signal.SIGINT)
        late["waited"] = go.wait(5)
        try:
            late["result"] = real(src, dst, *a, **kw)
            late["renamed"] = (src, dst)
        except OSError as e:
            late["error"] = e
            raise
        finally:
            done.set()

    def last_put_back() -> None:
        go.set()
        done.wait(5)

    def handler(signum, frame):  # type: ignore[no-untyped-def]
        raise _Interrupted()

    monkeypatch.setattr(os, "rename", rename)
    on_point(monkeypatch, "journal.rolled_back_file", last_put_back, k=len(files))
    old = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(_Interrupted):
            store.prepare(_drop(tdir))
        done.wait(5)
        for t in threading.enumerate():
            if t is not threading.current_thread() and t.name.startswith("ThreadPoolExecutor"):
                t.join(20)
    finally:
        signal.signal(signal.SIGINT, old)
    monkeypatch.undo()
    left = sorted(p for p in files if not os.path.lexists(p))
    stranded = [os.path.join(d, n) for d, _, ns in os.walk(env.staging_dir) for n in ns]
    assert left == [], f"gone from the warehouse: {left}; in staging: {stranded}; {late}"
    assert {p: Path(p).read_bytes() for p in files} == files
    assert stranded == []
    assert store.events() == []


def test_an_interrupt_while_a_staging_thread_starts_loses_no_file(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed in CI on f1ba27a..c67943a, about 1 run in 10 under load: the Ctrl-C of an
    in-process caller landed while the pool started its second staging thread (inside
    `submit`, in `Thread.start`). That thread was running, taking batches, but was never
    added to the pool's threads, so `shutdown(wait=True)` did not wait for it and the
    rollback ran while it still moved files: a warehouse file renamed into staging after
    its put-back, then deleted with the staging directory. Deterministic here: the
    interrupt is raised right after the second thread started, and that thread's first
    rename waits (up to 5 s) for the rollback's last put-back. Expected: every file back
    in place, nothing staged, no event."""
    tdir, files = _deep(env)
    # Whether the second thread takes a batch before the first has taken them all is up
    # to the scheduler (under load it may not): the sequence is tried until it does, and
    # every try must lose nothing.
    for _ in range(20):
        late = _interrupt_while_the_second_thread_starts(env, store, monkeypatch, tdir, files)
        if "waited" in late:
            break
    assert late.get("waited") is False, late  # the rollback waited for the thread


def _interrupt_while_the_second_thread_starts(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch, tdir: Path, files: dict[str, bytes]
) -> dict[str, object]:
    go, done = threading.Event(), threading.Event()
    late: dict[str, object] = {}
    real_rename, real_start = os.rename, threading.Thread.start
    started = {"n": 0}

    def start(self: threading.Thread) -> None:
        real_start(self)
        if self.name.startswith("ThreadPoolExecutor"):
            started["n"] += 1
            if started["n"] == 2:
                raise _Interrupted()

    def rename(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
        second = threading.current_thread().name.endswith("_1")
        if kw.get("src_dir_fd") is None or not second or "waited" in late:
            return real_rename(src, dst, *a, **kw)
        late["waited"] = go.wait(5)
        try:
            return real_rename(src, dst, *a, **kw)
        finally:
            done.set()

    def last_put_back() -> None:
        go.set()
        done.wait(5)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(os, "rename", rename)
    on_point(monkeypatch, "journal.rolled_back_file", last_put_back, k=len(files))
    with pytest.raises(_Interrupted):
        store.prepare(_drop(tdir))
    done.wait(5)
    monkeypatch.undo()
    left = sorted(p for p in files if not os.path.lexists(p))
    stranded = [os.path.join(d, n) for d, _, ns in os.walk(env.staging_dir) for n in ns]
    assert left == [], f"gone from the warehouse: {left}; in staging: {stranded}; {late}"
    assert {p: Path(p).read_bytes() for p in files} == files
    assert stranded == []
    assert store.events() == []
    return late

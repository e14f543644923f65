"""Adversarial review of nested roots (LocalSource.open_root through the outer root's
descriptor), read.locate's fallback, the single-descriptor check of staged files
(checksum.of_regular_file) and inline staging. Each test is a reproducer that fails on the
code it was written against."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable

import pytest
from cmroot_testlib import Env, on_point

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest


def _race_before_rename(monkeypatch: pytest.MonkeyPatch, name: str, fn: Callable[[], None]) -> None:
    """Run `fn` (a racing writer) once, in the instant between LocalSession.rename_out's
    pre-rename lstat of `name` and its rename (the rename is the only os.rename call made
    with src_dir_fd and a bare file name)."""
    real = os.rename
    done = {"n": 0}

    def rename(src: object, dst: object, *a: object, **kw: object) -> None:
        if not done["n"] and src == name and kw.get("src_dir_fd") is not None:
            done["n"] = 1
            fn()
        real(src, dst, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _inner_store(env: Env, inner_first: bool = True):  # type: ignore[no-untyped-def]
    inner = env.warehouse / "t" / "inner"
    roots = [str(inner), str(env.warehouse)] if inner_first else [str(env.warehouse), str(inner)]
    return inner, roots


# -- nested roots -------------------------------------------------------------------------


def test_recycle_under_a_missing_nested_root_answers_not_found(env: Env) -> None:
    """Roots /wh/t/inner (listed first) and /wh; /wh/t/inner does not exist (not yet
    created at start-up, or renamed away by a writer of /wh).
    Sequence: recycle {"paths": ["/wh/t/inner/f"]}.
    Observed: a raw FileNotFoundError escapes Store.recycle (the daemon answers 500
    "internal error"): LocalSource.expand calls self.root() -> open_root() ->
    confined.open_dir_beneath(outer, "t/inner") outside its try, so ENOENT is not
    turned into NotFound. Same with the nested root replaced by a regular file, or by a
    symlink to another directory of /wh (both NotADirectoryError: for a symlink as the
    final component openat2 says ENOTDIR, not ELOOP, so it never becomes SymlinkRefused).
    Breaks: "never an internal error" for a request naming a missing path.
    Expected: a CmrootError (404 NotFound), nothing moved."""
    inner, roots = _inner_store(env)
    (env.warehouse / "t").mkdir()
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=",".join(roots))
    raw: list[str] = []

    def attempt(case: str) -> None:
        try:
            store.recycle(RecycleRequest(paths=[str(inner / "f")], op="DELETE"))
        except CmrootError:
            pass
        except Exception as e:
            raw.append(f"{case}: {type(e).__name__}: {e}")

    attempt("missing")
    # a plain file where the nested root should be: ENOTDIR from the same place
    inner.write_bytes(b"not a dir")
    attempt("a file")
    assert inner.read_bytes() == b"not a dir"
    # the nested root swapped for a symlink to another directory of /wh: open_root's
    # openat2(O_DIRECTORY|O_NOFOLLOW) says ENOTDIR for a final symlink, not ELOOP, so
    # this is not SymlinkRefused either
    inner.unlink()
    (env.warehouse / "other").mkdir()
    (env.warehouse / "other" / "f").write_bytes(b"other")
    inner.symlink_to(env.warehouse / "other")
    attempt("a symlink")
    assert (env.warehouse / "other" / "f").read_bytes() == b"other"
    assert not raw, f"internal errors: {raw}"


def test_nested_root_swapped_for_a_symlink_before_a_restart_serves_and_moves_nothing_outside(
    env: Env,
) -> None:
    """Roots /wh/t/inner and /wh (nested; the inner one listed first, as in
    test_roots.py). A writer of /wh (who controls /wh/t) renames
    /wh/t/inner away and puts a symlink to /outside in its place; then the daemon
    restarts (upgrade, SIGHUP-less restart, crash).
    Observed: Warehouse.__init__ computes each root's real path with realpath() at
    start-up, following the writer's symlink: the nested root's `real` is now /outside,
    which _enclosing() no longer finds under /wh, so it becomes a *top-level* root
    opened by that real path. GET (path=/wh/t/inner/secret, checksum of
    /outside/secret) serves /outside/secret as "original", and recycle
    /wh/t/inner/secret moves /outside/secret into the store.
    Breaks invariants 3 and 5 (bytes served, and a file moved, from outside the roots).
    Expected: a root whose configured path lies under another root is reached through
    that root's descriptor whatever its path resolves to at start-up (nesting decided by
    the configured path as well as the real one), so after the swap every request under
    it is refused."""
    inner = env.warehouse / "t" / "inner"
    inner.mkdir(parents=True)
    (inner / "f").write_bytes(b"inside")
    roots = f"{inner},{env.warehouse}"
    env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots).close()
    secret = b"SECRET outside the roots"
    (env.outside / "secret").write_bytes(secret)
    inner.rename(env.warehouse / "t" / "inner.old")
    inner.symlink_to(env.outside)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)  # the restart
    leaked = None
    try:
        with store.open_verified(str(inner / "secret"), cks.of_bytes(secret)) as v:
            leaked = os.pread(v.fd, 100, 0)
    except CmrootError:
        pass
    try:
        store.recycle(RecycleRequest(paths=[str(inner / "secret")], op="DELETE"))
    except CmrootError:
        pass
    assert leaked is None and (env.outside / "secret").exists(), (
        f"served bytes from outside the roots: {leaked!r};"
        f" /outside/secret moved into the store: {not (env.outside / 'secret').exists()}"
    )


def test_rollback_keeps_a_file_whose_nested_root_is_now_behind_a_symlink(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roots /wh/t/inner (listed first) and /wh. Sequence: recycle /wh/t/inner/f; after
    f is staged and published, a writer of /wh renames /wh/t away and puts a symlink
    to /outside in its place (/outside/inner exists), and the recycle then fails (an
    I/O error).
    Observed: the rollback opens a fresh session of the nested root; open_root meets
    the symlink in the middle of "t/inner" (ELOOP) and raises SymlinkRefused -- a
    BadRequest, not an OSError -- which Journal.rollback's `except OSError` ("its way
    back is gone (... a symlink out of the root): keep it in the store") does not catch.
    The whole rollback aborts and the transaction is quarantined with f in staging and
    no entry: (path, checksum) answers 404. Worse, at the next start the nested root's
    real path is re-resolved through the symlink (see the test above), and recovery's
    rollback puts f back *into /outside/inner/f*.
    (With the symlink as the *last* component the kernel says ENOTDIR, an OSError, and
    f is correctly kept as a displaced entry.)
    Breaks invariants 1/2 (a failed recycle leaves f neither at its source nor
    retrievable) and 5 after the restart (a file moved outside the roots).
    Expected: f kept as a displaced entry, retrievable, no event, nothing written
    outside the roots."""
    inner, roots = _inner_store(env)
    inner.mkdir(parents=True)
    (inner / "f").write_bytes(b"inner bytes")
    (env.outside / "inner").mkdir()
    c = cks.of_bytes(b"inner bytes")
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=",".join(roots))

    def swap_then_fail() -> None:
        (env.warehouse / "t").rename(env.warehouse / "t.old")
        (env.warehouse / "t").symlink_to(env.outside)
        raise OSError(errno.EIO, "injected I/O error")

    on_point(monkeypatch, "recycle.file_published", swap_then_fail)
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(inner / "f")], op="DELETE"))
    assert store.index.events(0, 10) == [], "phantom event"
    try:
        with store.open_verified(str(inner / "f"), c) as v:
            kept = os.pread(v.fd, 100, 0)
    except CmrootError as e:
        kept = e
    store.close()
    env.open(CMROOT_STORE_WAREHOUSE_ROOTS=",".join(roots))  # restart: recovery runs
    outside = (env.outside / "inner" / "f").exists()
    assert kept == b"inner bytes" and not outside, (
        f"after the failed recycle f is not retrievable: {kept!r};"
        f" after the restart recovery put it in /outside/inner/f: {outside}"
    )


# -- the staged file checked from one descriptor ------------------------------------------


def test_directory_swapped_in_before_the_rename_leaks_no_descriptor(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: recycle /wh/t/f; between rename_out's lstat (a regular file) and its
    rename, a writer replaces f with a directory.
    Observed: the directory is renamed into staging and checksum.of_regular_file opens it
    (O_RDONLY|O_NOFOLLOW|O_NONBLOCK succeeds on a directory), then `open(fd, "rb")`
    raises IsADirectoryError; FileIO does not close a descriptor it was given when its
    own constructor fails, and of_regular_file has no try/close around it: one directory
    descriptor leaks per attempt (a writer can repeat it until the daemon hits EMFILE and
    every request fails with 5xx).
    Expected: the recycle refused and rolled back with no descriptor left open."""
    store = env.open()
    t = env.warehouse / "t"
    t.mkdir()
    (t / "f").write_bytes(b"data")

    def swap() -> None:
        (t / "f").unlink()
        (t / "f").mkdir()
        (t / "f" / "g").write_bytes(b"writer's")

    # warm up (sessions, index statements, shards) so only the race's descriptors count
    (t / "warm").write_bytes(b"warm")
    store.recycle(RecycleRequest(paths=[str(t / "warm")], op="DELETE"))
    before = _open_fds()
    _race_before_rename(monkeypatch, "f", swap)
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(t / "f")], op="DELETE"))
    assert (t / "f" / "g").read_bytes() == b"writer's"
    leaked = _open_fds() - before
    names = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in leaked if os.path.exists(
        f"/proc/self/fd/{fd}")}
    assert not leaked, f"descriptors leaked: {names}"


def test_nested_root_swapped_in_before_the_rename_is_not_left_in_staging(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roots /wh and /wh/inner (nested). Sequence: recycle /wh/t/f; between rename_out's
    lstat and its rename, a writer of /wh removes f and renames the nested root
    /wh/inner to /wh/t/f; right after the rename (fault point recycle.file_staged) it
    writes a new file at /wh/t/f.
    Observed: the nested root's directory is renamed into the store's staging area (no
    lstat after the rename any more; of_regular_file refuses it with EISDIR only later).
    The rollback cannot put it back (the path is taken), so it is "displaced", and
    Journal._keep_displaced asserts `it.checksum is not None` (a directory has none):
    AssertionError, the transaction is quarantined, and the nested root and its files
    stay inside staging/<txid>/ -- retrievable by no path, and again after a restart.
    Breaks invariant 5 (a root moved by a verb) and 1 (its files are neither in the
    warehouse nor retrievable). Expected: a non-regular file arriving in staging is
    moved back at once (or never moved: check the staged name before acting on it), and
    a rollback never leaves a warehouse directory in staging."""
    inner = env.warehouse / "inner"
    inner.mkdir()
    (inner / "x").write_bytes(b"nested root data")
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{env.warehouse},{inner}")
    t = env.warehouse / "t"
    t.mkdir()
    (t / "f").write_bytes(b"table data")

    def swap() -> None:
        (t / "f").unlink()
        inner.rename(t / "f")

    def recreate() -> None:
        (t / "f").write_bytes(b"writer's new file")

    _race_before_rename(monkeypatch, "f", swap)
    on_point(monkeypatch, "recycle.file_staged", recreate)
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(t / "f")], op="DELETE"))
    staged = [str(p) for p in env.staging_dir.rglob("x")]
    store.close()
    env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{env.warehouse},{inner}")  # restart: recovery
    after = [str(p) for p in env.staging_dir.rglob("x")]
    assert not staged and not after, (
        f"the nested root's files are inside the store's staging: {staged};"
        f" still there after recovery: {after}"
    )


def test_socket_swapped_in_before_the_rename_is_not_a_server_error(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: recycle /wh/t/f; between rename_out's lstat and its rename, a writer
    replaces f with a Unix socket (any user can bind one).
    Observed: the socket is renamed into staging; of_regular_file's os.open fails with
    ENXIO, which is neither a BadRequest nor in recycle._CHANGED, so the client gets
    RecycleFailed (status 500) -- the removed lstat after the rename used to answer 400
    "not a regular file".
    Expected: a 4xx (the path changed into a non-file), rolled back."""
    store = env.open()
    t = env.warehouse / "t"
    t.mkdir()
    (t / "f").write_bytes(b"data")
    socks: list[socket.socket] = []

    def swap() -> None:
        (t / "f").unlink()
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(t / "f"))
        socks.append(s)

    _race_before_rename(monkeypatch, "f", swap)
    try:
        with pytest.raises(CmrootError) as ei:
            store.recycle(RecycleRequest(paths=[str(t / "f")], op="DELETE"))
        assert (t / "f").is_socket(), "the socket was not put back"
        assert ei.value.status < 500, f"{ei.value.status}: {ei.value}"
    finally:
        for s in socks:
            s.close()


def test_recorded_size_is_the_size_of_the_recycled_bytes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: recycle /wh/t/f (10 bytes) while a straggler writer holding f open
    appends to it; the append lands after of_regular_file's fstat, before its read.
    Observed: the checksum is of the 20 bytes read, but the size recorded on the entry,
    in the event (which replicas replay) and in resolve's answer is fstat's 10 taken
    before the hash (the lstat after hashing was removed): a record (path, checksum,
    size) that no bytes match; a client reading `size` bytes from `location` gets a
    truncated file that does not hash to the checksum.
    Expected: the size recorded is the number of bytes hashed."""
    store = env.open()
    t = env.warehouse / "t"
    t.mkdir()
    f = t / "f"
    f.write_bytes(b"0123456789")
    writer = open(f, "ab")  # noqa: SIM115 - the straggler's descriptor
    real_fstat = os.fstat
    state = {"done": False}

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if not state["done"]:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(str(env.staging_dir)):
                state["done"] = True
                writer.write(b"APPENDED!!")
                writer.flush()
        return st

    monkeypatch.setattr(os, "fstat", fstat)
    try:
        res = store.recycle(RecycleRequest(paths=[str(f)], op="DELETE"))
    finally:
        writer.close()
        monkeypatch.undo()
    assert state["done"]
    rec = res.files[0]
    with store.open_verified(str(f), rec.checksum) as v:
        served = os.pread(v.fd, 1000, 0)
    assert rec.size == len(served), (
        f"recorded size {rec.size}, but the bytes under checksum {rec.checksum} are"
        f" {len(served)} long"
    )
    [r] = store.resolve([{"path": str(f), "checksum": rec.checksum}])
    assert r.size == len(served)


# -- read.locate ---------------------------------------------------------------------------


def test_symlink_chain_in_a_resolve_batch_is_not_an_internal_error(env: Env) -> None:
    """Sequence: a writer of /wh makes a chain of 1,200 symlinks s0 -> s1 -> ... -> file
    inside the warehouse; a reader resolves [{"path": "/wh/s0", ...}] (or GETs it).
    Observed: Warehouse.locate's os.path.realpath recurses once per link and raises
    RecursionError, which read.locate (documented "never an internal error, never a
    refused batch") does not catch: Store.resolve raises, the daemon answers 500 for
    the whole batch, and any batch containing that path fails.
    Expected: the pair answered (missing, or OutsideRoots/BadRequest for that pair), or
    at worst a 4xx naming it."""
    store = env.open()
    n = 1200
    for i in range(n):
        (env.warehouse / f"s{i}").symlink_to(f"s{i + 1}" if i < n - 1 else "target")
    (env.warehouse / "target").write_bytes(b"x")
    c = cks.of_bytes(b"x")
    try:
        store.resolve([{"path": str(env.warehouse / "s0"), "checksum": c}])
    except CmrootError:
        pass
    try:
        store.open_verified(str(env.warehouse / "s0"), c).close()
    except CmrootError:
        pass

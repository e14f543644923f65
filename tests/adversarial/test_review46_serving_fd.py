"""Review 46 (serving): 2132fc0, the event loop's read of GET /v1/files.

Reviewed: Reader.open_cached / _cached_object / _open_object_cached (the objects directory
kept open as a descriptor for the life of the Store, closed in Store.close; an object
opened at once with one openat2 and fstat, no O_PATH look first) and
cmroot.checksum.read_fd(nowait=True), which stopped at the first short preadv2
(RWF_NOWAIT) read.

Tests named test_break_* failed on 2132fc0: each shows a sequence under which the
event-loop read answered otherwise than the thread's full read (Store.open_verified) or
than DESIGN.md promises. Fixed since: a short read stops the read only once fstat's size
is read, and the objects directory is opened by its path on every read again.
test_held_* are attacks that held."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from pathlib import Path

import pytest
from cmroot_testlib import object_file, write_file

from cmroot import checksum as cks
from cmroot.exceptions import NotFound
from cmroot.store import Quarantined, RecycleRequest, Store
from cmroot.store.read import WouldBlock
from tests.server.cmroot_daemon import Daemon

INLINE = 1 << 20
PAGE = mmap.PAGESIZE


# -- helpers ------------------------------------------------------------------------------
def _answer(store: Store, path: str, c: str, cached: bool) -> tuple[str, bytes] | str:
    """(status, bytes) served, or the name of what was raised."""
    try:
        opened = (store.open_cached if cached else store.open_verified)(path, c, INLINE)
    except (WouldBlock, NotFound, Quarantined) as e:
        return type(e).__name__
    with opened as v:
        data = os.pread(v.fd, v.size + 1, 0) if v.data is None else v.data
        return str(v.status), data


def _recycle(store: Store, p: Path) -> None:
    store.recycle(RecycleRequest(paths=[str(p)], mode="move", op="DROP_TABLE"))
    assert not os.path.lexists(p)  # the lookup the loop answers from the dentry cache


def _append_uncached(path: Path, n: int) -> None:
    """Append `n` (a multiple of the page size) random bytes with O_DIRECT, as a database or
    a copy tool writing around the page cache does: the file's head stays in the page
    cache, its new tail is not there."""
    buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(n))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip("no O_DIRECT on this filesystem")
        raise
    try:
        assert os.write(fd, buf) == n
    finally:
        os.close(fd)
        buf.close()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _resident(path: Path) -> list[bool]:
    """Which pages of the file are in the page cache (mincore; reads nothing, so no
    readahead is started)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size
        addr = _libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip("mmap failed")
        try:
            vec = (ctypes.c_ubyte * ((n + PAGE - 1) // PAGE))()
            if _libc.mincore(addr, n, vec) != 0:
                pytest.skip("no mincore here")
            return [bool(b & 1) for b in vec]
        finally:
            _libc.munmap(addr, n)
    finally:
        os.close(fd)


def _head_cached_tail_not(path: Path, head: int) -> bool:
    """True when the first `head` bytes are in the page cache and the rest not."""
    with open(path, "rb") as f:
        f.read(head)
    pages = _resident(path)
    k = head // PAGE
    return all(pages[:k]) and not any(pages[k:])


def _grown_original(warehouse: Path) -> tuple[Path, bytes, str]:
    """A warehouse file that held X (8 KiB, cached; its path, X and X's checksum) and has
    8 KiB more appended past the page cache; skips where the tail cannot be kept out."""
    x = os.urandom(2 * PAGE)
    p = write_file(warehouse / "db.db" / "t" / "f", x)
    _append_uncached(p, 2 * PAGE)
    if not _head_cached_tail_not(p, len(x)):
        pytest.skip("could not leave the tail out of the page cache here")
    return p, x, cks.of_bytes(x)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# == breaks ================================================================================
def test_break_the_cached_head_of_a_grown_original_is_served_as_the_original(
    env, store: Store
) -> None:
    """Sequence: a warehouse file f holds X (8 KiB, checksum c, in the page cache); a writer
    appends 8 KiB with O_DIRECT (the tail is not in the page cache). No entry records
    (f, c). Then open_cached(f, c).
    Seen: ("original", X): read_fd's first preadv2(RWF_NOWAIT) returns the cached 8 KiB
    (short of the 16 KiB fstat gave), the loop stops there, _check hashes those bytes only
    (len(data) <= inline_max and hash == c) and serves them as f's bytes. Before 2132fc0
    the next read refused (EAGAIN) and the thread decided.
    Expected: what open_verified says (NotFound: f no longer has checksum c and nothing
    was recycled), or WouldBlock. DESIGN: GET serves "the original if it still has
    checksum C ... 404 JSON when neither exists"."""
    p, _, c = _grown_original(env.warehouse)
    fast = _answer(store, str(p), c, cached=True)
    full = _answer(store, str(p), c, cached=False)
    assert full == "NotFound"
    assert fast in ("WouldBlock", full), (fast[0], len(fast[1])) if fast != "WouldBlock" else fast


def test_break_daemon_get_serves_a_grown_file_it_should_404(make_daemon) -> None:
    """Sequence: a running daemon; a warehouse file f holds X (8 KiB, checksum c, cached);
    8 KiB are appended to f with O_DIRECT; GET /v1/files?path=f&checksum=c, then
    POST /v1/resolve for (f, c).
    Seen: GET 200, X-Cmroot-Status: original, body X, while resolve says "missing".
    Expected: 404 (f does not have checksum c and no recycle recorded it), as resolve and
    the thread's read say."""
    d: Daemon = make_daemon()
    p, x, c = _grown_original(d.warehouse)
    r = d.request("GET", d.files_url(str(p), c))
    res = d.request("POST", "/v1/resolve", {"files": [{"path": str(p), "checksum": c}]})
    assert res.status == 200
    assert res.json()["files"][0]["status"] == "missing"
    assert r.status == 404, (r.status, r.headers.get("X-Cmroot-Status"), len(r.body),
                             r.body == x)


def test_break_a_corrupt_object_grown_at_its_end_is_served_from_the_loop(
    env, store: Store
) -> None:
    """Sequence: a file X (8 KiB, checksum c) recycled (its object is X, cached); a writer
    that kept the inode appends 8 KiB to the object with O_DIRECT (the object no longer
    hashes to its name); open_cached(f, c), then open_verified(f, c).
    Seen: open_cached serves ("cmroot", X) from the object's cached head (a short read
    ends read_fd; the head hashes to c); open_verified hashes the whole object, finds the
    mismatch, quarantines it and raises Quarantined (the GET answers 404, the mismatch is
    counted). As long as the tail stays out of the page cache the loop keeps serving a
    corrupt object, never reporting it.
    Expected (tests/store/test_cached_read.py: open_cached "never answers differently from
    open_verified ... it never serves ... a corrupt object"): WouldBlock, or Quarantined."""
    x = os.urandom(2 * PAGE)
    c = cks.of_bytes(x)
    p = write_file(env.warehouse / "db.db" / "t" / "f", x)
    _recycle(store, p)
    obj = object_file(env.store_root, c)
    os.chmod(obj, 0o644)
    _append_uncached(obj, 2 * PAGE)
    if not _head_cached_tail_not(obj, len(x)):
        pytest.skip("could not leave the tail out of the page cache here")
    fast = _answer(store, str(p), c, cached=True)
    full = _answer(store, str(p), c, cached=False)
    assert full == "Quarantined"
    assert fast in ("WouldBlock", full), fast if isinstance(fast, str) else fast[0]


def test_break_objects_moved_out_of_the_store_are_still_served_by_the_loop(
    env, store: Store
) -> None:
    """Sequence: an object served once by open_cached (the objects dir is now kept open);
    an administrator moves <store>/objects out of the store (to <outside>/objects, e.g. to
    restore it from a backup) and makes an empty <store>/objects; open_cached(f, c) and
    open_verified(f, c).
    Seen: open_cached serves ("cmroot", bytes) read from <outside>/objects (the descriptor
    opened before the move), open_verified says NotFound (nothing in the store's objects).
    Expected: the same answer as the thread (or WouldBlock): DESIGN invariant 5 "the daemon
    ... serves only files under its configured warehouse roots and its own store". Before
    2132fc0 the loop opened <store>/objects per read, and agreed."""
    data = os.urandom(3000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    _recycle(store, p)
    assert _answer(store, str(p), c, cached=True) == ("cmroot", data)
    objs = env.store_root / "objects"
    os.rename(objs, env.outside / "objects")
    objs.mkdir()
    fast = _answer(store, str(p), c, cached=True)
    full = _answer(store, str(p), c, cached=False)
    assert full == "NotFound"
    assert fast in ("WouldBlock", full), fast if isinstance(fast, str) else fast[0]


# == attacks that held =====================================================================
def test_held_many_stores_opened_and_closed_leak_no_descriptor(env) -> None:
    """Open a store, serve an object from the loop (the objects dir is kept open), close
    it; 40 times. Store.close closes the kept descriptor: /proc/self/fd is as before."""
    data = os.urandom(5000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    s = env.open()
    _recycle(s, p)
    s.close()
    before = _fds()
    for _ in range(40):
        s = Store.open(env.config(), clock=env.clock)
        try:
            assert _answer(s, str(p), c, cached=True) == ("cmroot", data)
        finally:
            s.close()
        s.close()  # twice: harmless
    assert _fds() == before


def test_held_objects_dir_replaced_or_shard_symlinked_never_serves_other_bytes(
    env, store: Store
) -> None:
    """The kept objects descriptor against a store changed under it: the objects dir
    removed and made again (a publish makes it again), a shard swapped for a symlink to a
    copy, an object swapped for a FIFO, for a symlink, for other bytes. The loop serves
    only bytes hashing to the checksum, never hangs, and otherwise defers."""
    data, other = os.urandom(4000), os.urandom(4000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    _recycle(store, p)
    assert _answer(store, str(p), c, cached=True) == ("cmroot", data)
    obj = object_file(env.store_root, c)

    def ok() -> None:
        t0 = time.monotonic()
        fast = _answer(store, str(p), c, cached=True)
        assert time.monotonic() - t0 < 1.0
        assert fast in ("WouldBlock", ("cmroot", data)), fast

    # the object swapped for other bytes, a FIFO, a symlink to a good copy
    moved = obj.with_name("moved")
    obj.rename(moved)
    write_file(obj, other)
    ok()
    obj.unlink()
    os.mkfifo(obj)
    ok()
    obj.unlink()
    good = write_file(env.outside / "good", data)
    obj.symlink_to(good)
    ok()
    obj.unlink()
    moved.rename(obj)
    assert _answer(store, str(p), c, cached=True) == ("cmroot", data)
    # its shard swapped for a symlink to a copy of it
    shard = obj.parent
    twin = env.outside / "shard"
    os.rename(shard, twin)
    shard.symlink_to(twin)
    ok()
    shard.unlink()
    os.rename(twin, shard)
    # the objects dir removed; a recycle of the same bytes publishes into a new one
    objs = env.store_root / "objects"
    os.rename(objs, env.store_root / "objects.gone")
    p2 = write_file(env.warehouse / "db.db" / "t2" / "f", data)
    _recycle(store, p2)
    assert _answer(store, str(p2), c, cached=False) == ("cmroot", data)
    for path in (p, p2):
        fast = _answer(store, str(path), c, cached=True)
        assert fast in ("WouldBlock", ("cmroot", data)), fast


def test_held_a_file_read_while_it_shrinks_and_grows_in_memory(env, store: Store) -> None:
    """A cached file rewritten in place (truncate, write other bytes, write the checksum's
    bytes back) while the loop reads it: every answer is WouldBlock, NotFound-free, or
    the checksum's very bytes."""
    data = os.urandom(3 * PAGE + 17)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    stop = threading.Event()

    def flip() -> None:
        fd = os.open(p, os.O_WRONLY)
        try:
            while not stop.is_set():
                os.ftruncate(fd, PAGE)
                os.pwrite(fd, os.urandom(5 * PAGE), 0)
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    served = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            fast = _answer(store, str(p), c, cached=True)
            if fast != "WouldBlock":
                assert fast == ("original", data), (fast[0], len(fast[1]))
                served += 1
    finally:
        stop.set()
        t.join(5)


def test_held_two_serving_processes_serve_the_same_object(make_daemon) -> None:
    """server.processes = 2: GETs on fresh connections (both processes, each with its own
    kept objects descriptor) of a recycled object and of an object then quarantined by the
    primary: the right bytes while it is good, 404 once it is corrupt, on every process."""
    d: Daemon = make_daemon(env={"CMROOT_SERVER_PROCESSES": "2"})
    data = os.urandom(9000)
    c = cks.of_bytes(data)
    p = write_file(d.warehouse / "db.db" / "t" / "f", data)
    r = d.request("POST", "/v1/recycle", {"paths": [str(p)], "op": "DROP_TABLE"})
    assert r.status == 200, r
    for _ in range(16):
        g = d.request("GET", d.files_url(str(p), c))
        assert (g.status, g.headers["X-Cmroot-Status"], g.body) == (200, "cmroot", data)
    obj = object_file(d.store, c)
    os.chmod(obj, 0o644)
    with open(obj, "r+b") as f:
        f.write(b"X")
    got = [d.request("GET", d.files_url(str(p), c)) for _ in range(16)]
    assert {g.status for g in got} == {404}, [g.status for g in got]
    assert not obj.exists()

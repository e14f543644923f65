"""Review 32: the event-loop read path (Store.open_cached, GET /v1/files), the parallel
unlinks of the retention sweep, the cached query type info.

Tests named test_break_* failed on the change under review and pass on the fixes (one is
an xfail: a trade-off kept on purpose); the others are regressions that held."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from cmroot_testlib import (  # noqa: E402
    index_counts,
    make_table,
    object_file,
    object_files,
    table_dir,
    write_file,
)

from cmroot import checksum as cks  # noqa: E402
from cmroot.exceptions import BadRequest, NotFound, OutsideRoots  # noqa: E402
from cmroot.store import RecycleRequest, Store  # noqa: E402
from cmroot.store import read as read_mod  # noqa: E402
from cmroot.store.read import Verified, WouldBlock  # noqa: E402

INLINE = 1 << 20
HOUR = 3600.0
DAY = 24 * HOUR
FUSE_SERVER = r'''
"""A minimal FUSE server on /dev/fuse (no libfuse): one regular file `f` in the mount's
root whose OPEN is answered only after DELAY seconds (a stuck network filesystem).
Lookups and attributes are answered at once and cached for an hour by the kernel."""
import ctypes, errno, os, struct, sys, time

mnt, delay, content_file = sys.argv[1], float(sys.argv[2]), sys.argv[3]
with open(content_file, "rb") as fh:
    CONTENT = fh.read()
fd = os.open("/dev/fuse", os.O_RDWR)
libc = ctypes.CDLL(None, use_errno=True)
opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
if libc.mount(b"cmroot-review-fuse", mnt.encode(), b"fuse", 0, opts) != 0:
    sys.stderr.write("mount failed: " + os.strerror(ctypes.get_errno()) + "\n")
    sys.exit(3)
print("mounted", flush=True)
HOUR, NOW = 3600, int(time.time())

def attr(node):
    mode, size, nlink = (0o40755, 0, 2) if node == 1 else (0o100644, len(CONTENT), 1)
    return struct.pack("<QQQQQQIIIIIIIIII", node, size, (size + 511) // 512, NOW, NOW, NOW,
                       0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)

def reply(unique, payload=b"", err=0):
    os.write(fd, struct.pack("<IiQ", 16 + len(payload), -err, unique) + payload)

while True:
    try:
        buf = os.read(fd, (1 << 17) + 4096)
    except OSError as e:
        if e.errno == errno.ENODEV:
            break
        if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
            continue
        raise
    length, opcode, unique, nodeid = struct.unpack_from("<IIQQ", buf)
    body = buf[40:length]
    if opcode == 26:  # INIT
        max_ra = struct.unpack_from("<III", body)[2]
        reply(unique, struct.pack("<IIIIHHIIHHII6I", 7, 31, max_ra, 0, 16, 12, 65536, 1,
                                  0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    elif opcode == 1:  # LOOKUP
        if nodeid == 1 and body.split(b"\0", 1)[0] == b"f":
            reply(unique, struct.pack("<QQQQII", 2, 0, HOUR, HOUR, 0, 0) + attr(2))
        else:
            reply(unique, err=errno.ENOENT)
    elif opcode == 3:  # GETATTR
        reply(unique, struct.pack("<QII", HOUR, 0, 0) + attr(nodeid))
    elif opcode == 14:  # OPEN: the stuck server
        time.sleep(delay)
        reply(unique, struct.pack("<QIi", 1, 0, 0))
    elif opcode == 15:  # READ
        _fh, offset, size = struct.unpack_from("<QQI", body)
        reply(unique, CONTENT[offset:offset + size])
    elif opcode in (18, 25, 29):  # RELEASE, FLUSH, RELEASEDIR
        reply(unique)
    elif opcode == 27:  # OPENDIR
        reply(unique, struct.pack("<QIi", 1, 0, 0))
    elif opcode in (2, 36, 42):  # FORGET, INTERRUPT, BATCH_FORGET
        pass
    elif opcode == 38:  # DESTROY
        reply(unique)
        break
    else:
        reply(unique, err=errno.ENOSYS)
'''


# -- helpers ------------------------------------------------------------------------------
def _content(v: Verified) -> bytes:
    return os.pread(v.fd, v.size + 1, 0) if v.data is None else v.data


def _answer(store: Store, path: object, c: object, cached: bool) -> tuple[str, bytes] | str:
    try:
        opened = (store.open_cached if cached else store.open_verified)(path, c, INLINE)
    except (WouldBlock, NotFound, BadRequest, OutsideRoots) as e:
        return type(e).__name__
    with opened as v:
        return str(v.status), _content(v)


def _recycle(store: Store, p: Path, mode: str = "move") -> None:
    store.recycle(RecycleRequest(paths=[str(p)], mode=mode, op="DROP_TABLE"))


def _object(env, c: str) -> Path:
    return env.object_path(c)


def _evict(path: Path | str) -> bool:
    """Drop a file's pages from the page cache; True if RWF_NOWAIT then refuses."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


@contextlib.contextmanager
def _slow_fuse(mountpoint: Path, content: bytes, delay: float, work: Path) -> Iterator[Path]:
    """A FUSE filesystem at `mountpoint` holding `f` (= content) whose open takes `delay` s."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root to mount")
    work.mkdir(parents=True, exist_ok=True)
    (work / "fuse_server.py").write_text(FUSE_SERVER)
    (work / "content").write_bytes(content)
    mountpoint.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(work / "fuse_server.py"), str(mountpoint), str(delay),
         str(work / "content")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else b""
        if line.strip() != b"mounted":
            proc.wait(5)
            pytest.skip(f"cannot mount FUSE here: {proc.stderr.read() if proc.stderr else ''}")
        os.stat(mountpoint / "f")  # the lookup (answered at once): now in the dcache
        yield mountpoint / "f"
    finally:
        _libc.umount2(os.fsencode(str(mountpoint)), _MNT_DETACH)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# == the event-loop read: never a wait ===================================================
def test_break_open_cached_waits_on_a_stuck_fuse_open(env, store: Store, tmp_path) -> None:
    """A table directory on a FUSE mount (sshfs, s3fs-fuse, gcsfuse: common under a data
    lake) whose server is slow or hung. Every lookup is in the dcache, so RESOLVE_CACHED
    lets openat2 through, and then the open itself goes to the server: open_cached, run on
    the event loop, waits as long as the server takes, where it must raise WouldBlock at
    once (RESOLVE_CACHED covers the lookup, never the filesystem's ->open)."""
    data = os.urandom(4096)
    c = cks.of_bytes(data)
    with _slow_fuse(env.warehouse / "db.db" / "t", data, 3.0, tmp_path / "fuse") as f:
        t0 = time.monotonic()
        try:
            got = _answer(store, str(f), c, cached=True)
        finally:
            took = time.monotonic() - t0
        assert took < 1.0, (
            f"open_cached blocked {took:.1f}s in the FUSE server's OPEN (answer {got!r}):"
            " the event loop is frozen for that long"
        )


def test_break_a_stuck_fuse_open_freezes_the_daemon(make_daemon, tmp_path) -> None:
    """The same, end to end: while one GET of a file on a stuck FUSE mount is in flight,
    the daemon answers nothing else, not even /healthz (which runs on the event loop
    alone) or a GET of a plain small file: the whole event loop waits on the server."""
    d = make_daemon()
    data = os.urandom(4096)
    c = cks.of_bytes(data)
    plain = write_file(d.warehouse / "db.db" / "plain" / "f", b"plain bytes")
    r = d.request("GET", d.files_url(str(plain), cks.of_bytes(b"plain bytes")))
    assert r.status == 200, r
    with _slow_fuse(d.warehouse / "db.db" / "t", data, 4.0, tmp_path / "fuse") as f:
        slow: dict[str, object] = {}

        def get_slow() -> None:
            slow["reply"] = d.request("GET", d.files_url(str(f), c), timeout=60)

        t = threading.Thread(target=get_slow)
        t.start()
        time.sleep(0.5)  # the slow GET is now inside OPEN
        t0 = time.monotonic()
        h = d.request("GET", "/healthz", scope=None, timeout=60)
        health_took = time.monotonic() - t0
        t0 = time.monotonic()
        p = d.request("GET", d.files_url(str(plain), cks.of_bytes(b"plain bytes")), timeout=60)
        plain_took = time.monotonic() - t0
        t.join(60)
    assert h.status == 200 and p.status == 200
    assert health_took < 1.0 and plain_took < 1.0, (
        f"/healthz took {health_took:.1f}s and a GET of a cached 11-byte file"
        f" {plain_took:.1f}s while another GET waited on a FUSE open"
    )


def test_break_a_file_grown_past_inline_max_is_hashed_on_the_loop(
    env, store: Store, monkeypatch
) -> None:
    """_cached_verified checks the size with one fstat, then _check fstats again: a file a
    writer extends in between (an append) is taken by _check's large-file branch, which
    hashes the whole file with blocking preads (cks.of_fd, no RWF_NOWAIT), from the disk,
    on the event loop, however large it has grown, and returns it as answered 'from
    memory'. Here the writer's append is placed exactly in that window."""
    big = os.urandom(8 << 20)
    c = cks.of_bytes(big)
    p = write_file(env.warehouse / "db.db" / "t" / "f", big[:100])
    os.stat(p)
    blocking_hashes: list[int] = []
    real_of_fd = cks.of_fd
    real_check = read_mod.Reader._check

    def of_fd(fd: int, *a, **kw):
        blocking_hashes.append(os.fstat(fd).st_size)
        return real_of_fd(fd, *a, **kw)

    def check(self, fd, c_, inline_max, cache_key, nowait=False):
        if nowait:  # the writer appends right after _cached_verified's fstat
            with open(p, "ab") as w:
                w.write(big[100:])
            assert _evict(p) or True  # its pages go to the disk (and out of memory)
        return real_check(self, fd, c_, inline_max, cache_key, nowait)

    monkeypatch.setattr(cks, "of_fd", of_fd)
    monkeypatch.setattr(read_mod.Reader, "_check", check)
    try:
        got = store.open_cached(str(p), c, INLINE)
    except WouldBlock:
        got = None
    else:
        got.close()
    assert not blocking_hashes, (
        f"open_cached hashed {blocking_hashes} bytes with blocking reads on the event loop"
        f" and answered {got!r} (a {len(big)}-byte original, over inline_max)"
    )


def test_break_a_file_grown_past_inline_max_is_hashed_on_the_loop_real_race(
    env, store: Store, monkeypatch, tmp_path
) -> None:
    """The same race with a real writer (another process flipping the file between its
    small and a 64 MiB size): open_cached, called in a loop as the event loop would, ends
    up in cks.of_fd (a blocking hash of up to 64 MiB) instead of deferring."""
    small = os.urandom(1000)
    c = cks.of_bytes(small)
    p = write_file(env.warehouse / "db.db" / "t" / "f", small)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
        "end = time.monotonic() + 20\n"
        "while time.monotonic() < end:\n"
        "    os.ftruncate(fd, 64 << 20)\n"
        "    os.ftruncate(fd, 1000)\n"
    ), str(p)])
    hashed: list[float] = []
    real_of_fd = cks.of_fd

    def of_fd(fd: int, *a, **kw):
        t0 = time.monotonic()
        try:
            return real_of_fd(fd, *a, **kw)
        finally:
            hashed.append(time.monotonic() - t0)

    monkeypatch.setattr(cks, "of_fd", of_fd)
    try:
        end = time.monotonic() + 8
        worst = 0.0
        while time.monotonic() < end and not hashed:
            t0 = time.monotonic()
            with contextlib.suppress(WouldBlock):
                store.open_cached(str(p), c, INLINE).close()
            worst = max(worst, time.monotonic() - t0)
    finally:
        writer.kill()
        writer.wait()
    assert not hashed, (
        f"open_cached ran {len(hashed)} blocking whole-file hash(es) on the loop"
        f" ({max(hashed):.3f}s); the slowest call took {worst:.3f}s"
    )


def test_break_the_loop_opens_a_fifo_the_thread_never_opens(env, store: Store) -> None:
    """A FIFO at the requested path (a producer waiting in open(O_WRONLY) for its
    consumer). The thread's read never opens it (its lstat while confining the path says
    "no regular file": Reader._original returns before any open), so a GET changes
    nothing. open_cached opens it (O_NONBLOCK read end) before fstat refuses it: the
    producer is released with a reader that is gone at once, and its first write fails
    with EPIPE. A GET, a read, broke a writer in the warehouse."""
    fifo = env.warehouse / "db.db" / "t" / "f"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    os.stat(fifo)
    c = cks.of_bytes(b"x")
    released = threading.Event()
    write_error: list[BaseException] = []

    def producer() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # waits for a reader
        released.set()
        try:
            time.sleep(0.2)
            os.write(fd, b"row\n")
        except OSError as e:
            write_error.append(e)
        finally:
            os.close(fd)

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    try:
        assert _answer(store, str(fifo), c, cached=False) == "NotFound"
        assert not released.wait(0.3), "the thread's read opened the FIFO"
        assert _answer(store, str(fifo), c, cached=True) == "WouldBlock"
        assert not released.wait(0.5), (
            "open_cached opened the FIFO on the event loop: the producer was released"
        )
    finally:
        if not released.is_set():  # let the producer go
            rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            released.wait(2)
            time.sleep(0.3)
            os.close(rfd)
        t.join(5)


# == the event-loop read: same answers (these held) ======================================
def _agree(store: Store, path: object, c: object) -> object:
    fast = _answer(store, path, c, cached=True)
    full = _answer(store, path, c, cached=False)
    assert fast == "WouldBlock" or fast == full, (path, fast, full)
    return full


def test_odd_spellings_and_bad_input_agree(env, store: Store) -> None:
    data = os.urandom(2000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    w = str(env.warehouse)
    spellings = [
        f"{w}//db.db/t/f", f"{w}/./db.db/t/f", f"{w}/db.db/t/f/", f"file://{w}/db.db/t/f",
        f"file://localhost{w}/db.db/t/f", f"{w}/db.db/t/../t/f", f"{w}/db.db/t/f\0",
        f"{w}/db.db/t/\udcff", f"{w}/db.db/t/" + "x" * 300, f"{w}/" + "a/" * 2100 + "f",
        w, w + "/", f"{w}/db.db/t", f"{w}/db.db", "db.db/t/f", str(env.outside / "f"),
        f"{w}x/db.db/t/f", f"{w}/db.db/t/F", "file:///", "/", "", None, 3,
    ]
    for path in spellings:
        _agree(store, path, c)
    for bad_c in ["", "zz", c.upper(), c + "0", None, 5, "0" * 31]:
        _agree(store, str(p), bad_c)
    assert _agree(store, f"{w}//db.db/./t/f/", c) == ("original", data)


@pytest.mark.parametrize("size", [0, 1, INLINE - 1, INLINE, INLINE + 1])
def test_sizes_around_inline_max_agree(env, store: Store, size: int) -> None:
    data = os.urandom(size)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    os.stat(p)
    assert _agree(store, str(p), c) == ("original", data)
    if size <= INLINE:
        with store.open_cached(str(p), c, INLINE) as v:
            assert v.data == data
    _recycle(store, p)
    assert _agree(store, str(p), c) == ("cmroot", data)


def test_special_files_and_swapped_objects_agree(env, store: Store) -> None:
    data = os.urandom(3000)
    c = cks.of_bytes(data)
    base = env.warehouse / "db.db" / "t"
    p = write_file(base / "f", data)
    _recycle(store, p)
    obj = _object(env, c)
    # a directory, a FIFO and a socket at the path: the recycled copy answers
    for make in ("dir", "fifo", "sock"):
        if make == "dir":
            p.mkdir()
        elif make == "fifo":
            os.mkfifo(p)
        else:
            import socket

            s = socket.socket(socket.AF_UNIX)
            s.bind(str(p))
            s.close()
        assert _agree(store, str(p), c) == ("cmroot", data)
        p.rmdir() if make == "dir" else p.unlink()
    # the object a symlink to the same bytes outside the store, then a directory
    outside = write_file(env.outside / "copy", data)
    moved = obj.with_name("moved")
    obj.rename(moved)
    obj.symlink_to(outside)
    assert _answer(store, str(p), c, cached=True) == "WouldBlock"
    obj.unlink()
    obj.mkdir()
    assert _answer(store, str(p), c, cached=True) == "WouldBlock"
    obj.rmdir()
    moved.rename(obj)
    assert _agree(store, str(p), c) == ("cmroot", data)
    # the objects directory swapped for a symlink to a copy of it
    objs = Path(env.store_root) / "objects"
    twin = env.outside / "objects"
    os.rename(objs, twin)
    objs.symlink_to(twin)
    try:
        fast = _answer(store, str(p), c, cached=True)
        full = _answer(store, str(p), c, cached=False)
        assert fast == "WouldBlock" or fast == full
    finally:
        objs.unlink()
        os.rename(twin, objs)


def test_a_corrupt_object_is_quarantined_once_and_counted(make_daemon) -> None:
    d = make_daemon()
    data = os.urandom(20_000)
    c = cks.of_bytes(data)
    p = write_file(d.warehouse / "db.db" / "t" / "f", data)
    r = d.request("POST", "/v1/recycle", {"paths": [str(p)], "op": "DROP_TABLE"})
    assert r.status == 200, r
    obj = object_file(d.store, c)
    with open(obj, "r+b") as f:
        f.write(b"X")
    got = [d.request("GET", d.files_url(str(p), c)) for _ in range(5)]
    assert [g.status for g in got] == [404] * 5
    assert all(not g.body.startswith(data[:10]) for g in got)
    assert not obj.exists()
    assert len(list((d.store / "quarantine").iterdir())) == 1
    line = [m for m in d.metrics().splitlines()
            if m.startswith("cmroot_checksum_mismatches_total")]
    assert line and float(line[0].split()[-1]) == 1.0, line


def test_evicted_pages_fall_back_to_the_thread(make_daemon) -> None:
    d = make_daemon()
    data = os.urandom(300_000)
    c = cks.of_bytes(data)
    p = write_file(d.warehouse / "db.db" / "t" / "f", data)
    if not _evict(p):
        pytest.skip("pages not evictable here")
    r = d.request("GET", d.files_url(str(p), c))
    assert (r.status, r.headers["X-Cmroot-Status"], r.body) == (200, "original", data)
    r = d.request("POST", "/v1/recycle", {"paths": [str(p)], "op": "DROP_TABLE"})
    assert r.status == 200
    assert _evict(object_file(d.store, c))
    r = d.request("GET", d.files_url(str(p), c), headers={"Range": "bytes=5-9"})
    assert (r.status, r.headers["X-Cmroot-Status"], r.body) == (206, "cmroot", data[5:10])


# == the event-loop read under races (these held) ========================================
def _race(store: Store, path: str, c: str, flip, seconds: float = 2.0) -> list[object]:
    """open_cached in a loop while `flip()` runs in a loop on another thread; the
    (status, ident, bytes) of each answer."""
    stop = threading.Event()

    def flipper() -> None:
        while not stop.is_set():
            flip()

    t = threading.Thread(target=flipper, daemon=True)
    t.start()
    out: list[object] = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                v = store.open_cached(path, c, INLINE)
            except WouldBlock:
                out.append("WouldBlock")
                continue
            with v:
                out.append((str(v.status), v.ident, _content(v)))
    finally:
        stop.set()
        t.join(5)
    return out


def test_race_file_and_symlink_to_outside_copy(env, store: Store) -> None:
    data = os.urandom(5000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    inside = write_file(env.warehouse / "db.db" / "t" / ".keep", data)
    secret = write_file(env.outside / "secret", data)
    tmp_link = p.with_name(".link")
    bad_ino = os.stat(secret).st_ino

    def flip() -> None:
        with contextlib.suppress(OSError):
            os.symlink(secret, tmp_link)
            os.rename(tmp_link, p)  # p is now a symlink to the outside copy
        with contextlib.suppress(OSError):
            os.link(inside, tmp_link)
            os.rename(tmp_link, p)  # and a hard link of the inside copy again

    out = _race(store, str(p), c, flip)
    served = [o for o in out if o != "WouldBlock"]
    assert served, "never answered"
    assert all(o[1][1] != bad_ino and o[2] == data and o[0] == "original" for o in served)


def test_race_parent_directory_swapped_for_a_symlink(env, store: Store) -> None:
    data = os.urandom(5000)
    c = cks.of_bytes(data)
    t = env.warehouse / "db.db" / "t"
    write_file(t / "f", data)
    away = env.warehouse / "db.db" / ".t-away"
    outside_dir = env.outside / "t"
    write_file(outside_dir / "f", data)
    bad_ino = os.stat(outside_dir / "f").st_ino
    link = env.warehouse / "db.db" / ".t-link"
    link.symlink_to(outside_dir)
    state = {"swapped": False}

    def flip() -> None:
        if not state["swapped"]:
            os.rename(t, away)
            os.rename(link, t)
        else:
            os.rename(t, link)
            os.rename(away, t)
        state["swapped"] = not state["swapped"]

    out = _race(store, str(t / "f"), c, flip)
    served = [o for o in out if o != "WouldBlock"]
    assert all(o[1][1] != bad_ino and o[2] == data for o in served)


def test_race_other_bytes_renamed_over_and_truncation(env, store: Store) -> None:
    data = os.urandom(50_000)
    other = os.urandom(50_000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    _recycle(store, p, "copy")
    a = write_file(p.with_name(".a"), data)
    b = write_file(p.with_name(".b"), other)
    n = [0]

    def flip() -> None:
        n[0] += 1
        src = a if n[0] % 2 else b
        tmp = p.with_name(".tmp")
        with contextlib.suppress(OSError):
            os.link(src, tmp)
            os.rename(tmp, p)
        if n[0] % 3 == 0:  # and a writer rewriting in place
            with contextlib.suppress(OSError), open(p, "r+b") as f:
                f.truncate(10)
                f.write(data[10:])

    out = _race(store, str(p), c, flip)
    served = [o for o in out if o != "WouldBlock"]
    assert served
    assert all(o[2] == data for o in served), "served bytes other than the checksum's"
    assert {o[0] for o in served} <= {"original", "cmroot"}


def test_break_a_file_growing_while_read_is_read_whole_on_the_loop(
    env, store: Store, monkeypatch
) -> None:
    """read_fd reads until EOF, "plus whatever it grew by meanwhile", with no bound: a
    writer appending to a small file right after _check's fstat (the pages it writes are
    in the page cache, so RWF_NOWAIT never refuses) makes open_cached read the whole
    grown file into memory on the event loop (here 256 MiB) before finding it is over
    inline_max. Reading past inline_max + 1 bytes cannot change the answer."""
    small = os.urandom(1000)
    c = cks.of_bytes(small)
    p = write_file(env.warehouse / "db.db" / "t" / "f", small)
    chunk = os.urandom(1 << 20)
    real_read_fd = cks.read_fd
    read_sizes: list[int] = []
    took: list[float] = []

    def read_fd(fd: int, size: int, nowait: bool = False, **kw: Any) -> bytes:
        if nowait:  # a writer appends 256 MiB just after the fstat
            with open(p, "ab") as w:
                for _ in range(256):
                    w.write(chunk)
        t0 = time.monotonic()
        out = real_read_fd(fd, size, nowait, **kw)
        took.append(time.monotonic() - t0)
        read_sizes.append(len(out))
        return out

    monkeypatch.setattr(cks, "read_fd", read_fd)
    got = _answer(store, str(p), c, cached=True)
    assert max(read_sizes) <= INLINE + (1 << 16), (
        f"open_cached read {max(read_sizes)} bytes into memory on the loop ({max(took):.2f}s,"
        f" answer {got if isinstance(got, str) else got[0]!r}) for a {len(small)}-byte file"
    )


# == the sweep's parallel unlinks ==========================================================
def _drop(env, store: Store, table: str, n: int, seed: str = "s") -> dict[str, bytes]:
    files = make_table(env.warehouse, "db", table, [{"p": "1"}], files_per_partition=n,
                       size=(10, 200), rng=random.Random(seed + table))
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", table))],
                                 op="DROP_TABLE", db="db", table=table))
    return files


def _rows(env) -> set[str]:
    import sqlite3

    with contextlib.closing(sqlite3.connect(env.index_path)) as db:
        return {r[0] for r in db.execute("SELECT checksum FROM objects")}


def _on_disk(env) -> set[str]:
    return {p.name for p in object_files(env)}


def test_break_a_thread_that_cannot_start_loses_index_rows(
    env, store: Store, clock, monkeypatch
) -> None:
    """Objects.remove now starts up to 4 threads per page. Where the process cannot start
    another thread (a container's pids.max, RLIMIT_NPROC reached under load: RuntimeError
    "can't start new thread"), pool.map raises after the first threads have already
    unlinked what was submitted to them, and `forget` never runs: the sweep fails with
    an internal error, objects are gone from the disk while the index keeps their rows
    (every read of them answers the index's "present" with no bytes), and the rest of the
    sweep is abandoned, where the one-by-one loop needed no thread at all."""
    files = _drop(env, store, "t", 40)
    everything = {cks.of_bytes(b) for b in files.values()}
    clock.advance(DAY)
    real_start = threading.Thread.start
    started = [0]

    def start(self, *a, **kw):
        if self.name.startswith("ThreadPoolExecutor"):
            started[0] += 1
            if started[0] > 1:
                raise RuntimeError("can't start new thread")
        return real_start(self, *a, **kw)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        report = store.gc()
    except RuntimeError as e:
        report = e
    monkeypatch.undo()
    gone = everything - _on_disk(env)
    kept_rows = _rows(env) & gone
    assert not kept_rows, (
        f"sweep ended with {report!r}; {len(gone)} objects unlinked, {len(kept_rows)} of"
        " them still rows of the index"
    )
    assert not isinstance(report, BaseException), report


def _chattr(path: Path, flag: str) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_sweep_failures_are_reported_and_the_rest_go(env, store: Store, clock) -> None:
    files = _drop(env, store, "t", 60)
    everything = {cks.of_bytes(b) for b in files.values()}
    by_shard: dict[str, list[str]] = {}
    for c in sorted(everything):
        by_shard.setdefault(str(env.object_path(c).parent.relative_to(env.objects_dir)),
                            []).append(c)
    objs = Path(env.store_root) / "objects"
    frozen_shard = next(s for s, cs in by_shard.items() if len(cs) >= 1)
    frozen = set(by_shard[frozen_shard])
    others = sorted(everything - frozen)
    as_dir = others[0]  # an object replaced by a non-empty directory
    obj = env.object_path(as_dir)
    saved = obj.read_bytes()
    obj.unlink()
    (obj / "x").mkdir(parents=True)
    if not _chattr(objs / frozen_shard, "+i"):
        pytest.skip("chattr +i not possible here")
    try:
        clock.advance(DAY)
        r = store.gc()
    finally:
        _chattr(objs / frozen_shard, "-i")
    failed = {f["checksum"] for f in r.failures}
    assert failed == frozen | {as_dir}, (failed, frozen, as_dir)
    assert r.failed == len(failed)
    removed = {x["checksum"] for x in r.removed}
    assert removed == everything - failed
    assert r.removed_objects == len(removed)
    assert r.removed_bytes == sum(len(b) for b in files.values()
                                  if cks.of_bytes(b) in removed)
    assert _rows(env) == failed and _on_disk(env) == frozen
    # put things right: the next sweep takes the rest, exactly
    import shutil

    shutil.rmtree(obj)
    obj.write_bytes(saved)
    r = store.gc()
    assert {x["checksum"] for x in r.removed} == failed and r.failed == 0
    assert _rows(env) == set() and _on_disk(env) == set()


def test_sweep_in_trash_mode_with_many_objects(env, clock) -> None:
    store = env.open(CMROOT_STORE_ON_EXPIRE="trash")
    files = _drop(env, store, "t", 300)
    everything = {cks.of_bytes(b) for b in files.values()}
    clock.advance(DAY)
    r = store.gc()
    assert r.failed == 0 and {x["checksum"] for x in r.removed} == everything
    assert all(x["action"] == "trashed" for x in r.removed)
    trashed = {p.name for p in (Path(env.store_root) / "trash").rglob("*") if p.is_file()}
    assert trashed == everything and _rows(env) == set() and _on_disk(env) == set()
    assert index_counts(env)["entries"] == 0


def test_sweep_never_loses_an_object_a_concurrent_recycle_deduplicates(
    env, store: Store, clock
) -> None:
    """Recycles of the same bytes again and again while sweeps run: every pair the index
    records still has its object, whatever the interleaving."""
    data = [os.urandom(100 + i) for i in range(30)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def recycler() -> None:
        k = 0
        try:
            while not stop.is_set():
                k += 1
                d = env.warehouse / "db" / f"r{k}"
                for i, b in enumerate(data):
                    write_file(d / f"f{i}", b)
                store.recycle(RecycleRequest(paths=[str(d)], op="DROP_TABLE"))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=recycler)
    t.start()
    try:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            clock.advance(DAY)
            store.gc()
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    rows = _rows(env)
    assert rows <= _on_disk(env), rows - _on_disk(env)


def _read_bytes() -> int:
    """Bytes this process made the storage layer fetch (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return -1


@pytest.mark.xfail(
    strict=False,  # an index whose pages the kernel keeps anyway passes: no flake either way
    reason="kept as designed (Reader.open_cached, README): the index lookup is one SQLite "
    "point query on the loop, read from the store's local disk when the page cache lost "
    "its pages; a hop to a thread for it would cost more than the whole read",
)
def test_break_open_cached_reads_the_index_from_disk(env, store: Store) -> None:
    """open_cached answers a recycled copy after looking the pair up in the SQLite index,
    on the event loop: nothing asks whether the index's pages are in memory. After a
    recycle wrote to the index (the loop's reader connection must read again) and the
    kernel dropped the index's pages, one open_cached makes the process read the index
    from the disk, synchronously, on the event loop (/proc/self/io read_bytes grows),
    while the file bytes themselves were all in the page cache."""
    data = os.urandom(4096)
    c = cks.of_bytes(data)
    files = {}
    for i in range(2000):  # an index of some size
        files[i] = write_file(env.warehouse / "db.db" / "t" / f"p={i % 50}" / f"f{i}",
                              os.urandom(64) if i else data)
    store.recycle(RecycleRequest(paths=[str(env.warehouse / "db.db" / "t")],
                                 op="DROP_TABLE", db="db", table="t"))
    p = files[0]
    obj = _object(env, c)
    obj.read_bytes()  # the object's bytes in the page cache
    with contextlib.suppress(WouldBlock):
        store.open_cached(str(p), c, INLINE).close()  # warm: dentries, negative ones too
    write_file(env.warehouse / "db.db" / "u" / "g", b"more")
    store.recycle(RecycleRequest(paths=[str(env.warehouse / "db.db" / "u")], op="DROP_TABLE"))
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        f = Path(env.store_root) / name
        if f.exists():
            _evict(f)
    before = _read_bytes()
    try:
        v = store.open_cached(str(p), c, INLINE)
    except WouldBlock:
        pytest.skip("deferred: nothing answered on the loop")
    read = _read_bytes() - before
    with v:
        assert (v.status, v.data) == ("cmroot", data)
    assert read == 0, f"open_cached read {read} bytes of the index from the disk on the loop"


def test_roots_nested_aliased_and_symlinked_agree(tmp_path, clock) -> None:
    from cmroot_testlib import Env

    wh = tmp_path / "wh"
    real = tmp_path / "real"
    for d in (wh / "t" / "inner", wh / "u" / "inner2", real, tmp_path / "outside"):
        d.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(wh / "u" / "inner2")
    (tmp_path / "link").symlink_to(real)
    roots = [wh / "t" / "inner", wh, tmp_path / "alias", tmp_path / "link"]
    env = Env(base=tmp_path, warehouse=wh, store_root=tmp_path / "store",
              outside=tmp_path / "outside", clock=clock)
    try:
        store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=",".join(map(str, roots)))
        data = os.urandom(3000)
        c = cks.of_bytes(data)
        paths = [wh / "t" / "inner" / "f", wh / "u" / "inner2" / "f", tmp_path / "alias" / "g",
                 tmp_path / "link" / "f", wh / "x" / "f"]
        for p in paths:
            write_file(p, data)
            os.stat(p)
            assert _agree(store, str(p), c) == ("original", data)
        secret = write_file(tmp_path / "outside" / "inner" / "f", data)
        os.rename(wh / "t" / "inner", wh / "t" / "inner.away")
        (wh / "t" / "inner").symlink_to(secret.parent)
        for p in paths:
            _agree(store, str(p), c)
        fast = _answer(store, str(paths[0]), c, cached=True)
        assert fast == "WouldBlock"
    finally:
        env.close_all()


def test_bind_mount_of_an_outside_directory(env, store: Store) -> None:
    """Reported as pre-existing, not of this change: a directory outside the roots
    bind-mounted inside one is read by both paths alike (neither uses RESOLVE_NO_XDEV).
    Here only their agreement is checked."""
    secret = write_file(env.outside / "t" / "f", os.urandom(1000))
    data = secret.read_bytes()
    c = cks.of_bytes(data)
    mnt = env.warehouse / "db.db" / "t"
    mnt.mkdir(parents=True)
    if subprocess.run(["mount", "--bind", str(secret.parent), str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot bind mount here")
    try:
        os.stat(mnt / "f")
        full = _agree(store, str(mnt / "f"), c)
        print("bind mount answered:", full if isinstance(full, str) else full[0])
    finally:
        _libc.umount2(os.fsencode(str(mnt)), _MNT_DETACH)


def test_decode_query_cache_is_per_class() -> None:
    from cmroot.server import schemas

    q = schemas.decode_query([("path", "/x"), ("checksum", "0" * 32)], schemas.FilesQuery)
    assert q.path == "/x"
    e = schemas.decode_query([("limit", "7")], schemas.EntriesQuery)
    assert e.limit == 7
    for bad in ([("limit", "1e3")], [("limit", "7"), ("limit", "8")], [("nope", "1")]):
        with pytest.raises(BadRequest):
            schemas.decode_query(bad, schemas.EntriesQuery)
    with pytest.raises(BadRequest):
        schemas.decode_query([("path", "/x"), ("checksum", "0" * 32), ("limit", "1")],
                             schemas.FilesQuery)


def test_daemon_odd_spellings_answer_as_the_thread(make_daemon) -> None:
    d = make_daemon()
    data = os.urandom(3000)
    c = cks.of_bytes(data)
    p = write_file(d.warehouse / "db.db" / "t" / "f", data)
    w = str(d.warehouse)
    from urllib.parse import quote

    for path in (f"{w}//db.db/t/f", f"{w}/./db.db/t/f", f"{w}/db.db/t/f/", f"file://{w}/db.db/t/f"):
        r = d.request("GET", d.files_url(path, c))
        assert (r.status, r.headers["X-Cmroot-Status"], r.body) == (200, "original", data)
    for raw, status in ((f"{w}/db.db/t/%00f", 400), (f"{w}/db.db/t/%FFf", None),
                        (f"{w}/db.db/../x", 400), (str(d.outside / "f"), 403)):
        r = d.request("GET", f"/v1/files?path={quote(raw, safe='/%')}&checksum={c}")
        assert r.status < 500 and (status is None or r.status == status), (raw, r)
    p.unlink()
    os.mkfifo(p)
    r = d.request("GET", d.files_url(str(p), c))
    assert r.status == 404
    assert not d.errors()

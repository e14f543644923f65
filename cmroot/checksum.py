"""xxHash3-128 checksums of files, streamed, in parallel.

xxhash releases the GIL while hashing, so a thread pool hashes several files at once."""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import xxhash

from cmroot.exceptions import BadRequest

CHUNK = 1 << 20
_HEX32 = re.compile(r"[0-9a-f]{32}")


def validate(checksum: object) -> str:
    """Return `checksum` if it is 32 lowercase hex characters, else raise BadRequest."""
    if not isinstance(checksum, str) or not _HEX32.fullmatch(checksum):
        raise BadRequest(
            "bad checksum", f"{checksum!r} is not an xxh3-128 checksum (32 lowercase hex chars)"
        )
    return checksum


def of_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def of_stream(f: IO[bytes]) -> str:
    """Hash a binary stream from its current position to its end."""
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    if readinto is None:
        while chunk := f.read(CHUNK):
            h.update(chunk)
        return h.hexdigest()
    while n := readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def of_local_file(path: str) -> str:
    """Hash a local file by reading it. Never mmap: objects and staged files share their
    inode with warehouse files, and a writer truncating a mapped file would kill the
    process with SIGBUS."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _of_sized(fd, os.fstat(fd).st_size)[0]
    finally:
        os.close(fd)


def of_regular_file(path: str) -> tuple[str, int, os.stat_result]:
    """Hash the regular file at `path` without following a symlink or blocking on a FIFO
    (BadRequest for anything else). Returns the checksum, the number of bytes it covers
    (what was read, even if a writer changed the size meanwhile) and the descriptor's
    fstat, so the caller needs no second look at the path."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest("not a regular file", f"{path} is a directory, pipe or device")
        checksum, size = _of_sized(fd, st.st_size)
        return checksum, size, st
    finally:
        os.close(fd)


def _of_sized(fd: int, size: int) -> tuple[str, int]:
    """of_fd, for a file whose fstat said `size`: a small one is read in one pread of
    that size, where of_fd's 1 MiB buffer would cost 3x more per 64 KiB file."""
    if size < CHUNK:
        head = os.pread(fd, size + 1, 0)
        if len(head) <= size:
            return xxhash.xxh3_128_hexdigest(head), len(head)
    return of_fd(fd)  # large, or it grew while we looked


def of_file(fs: Any, path: str) -> str:
    """Hash a file on any fsspec filesystem."""
    if is_local(fs):
        return of_local_file(path)
    with fs.open(path, "rb") as f:
        return of_stream(f)


def is_local(fs: Any) -> bool:
    """Whether an fsspec filesystem (None meaning the local one) is the local disk."""
    return fs is None or "file" in _protocols(fs)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def default_workers() -> int:
    return min(8, (os.cpu_count() or 1) * 2)


def many(
    hash_one: Callable[[str], str],
    paths: Iterable[str],
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[str, str]]:
    """Yield (path, checksum) for every path, in order, hashing `workers` files at once."""
    todo = list(paths)
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        for i, (path, digest) in enumerate(zip(todo, pool.map(hash_one, todo), strict=True), 1):
            if progress:
                progress(i)
            yield path, digest


def read_fd(fd: int, size: int, nowait: bool = False, limit: int | None = None) -> bytes:
    """Read a whole file from an open descriptor by pread, from offset 0: `size` bytes as
    fstat said, plus whatever it grew by meanwhile (the caller compares the length), but
    no more than `limit` bytes when given. With `nowait`, only from the page cache:
    BlockingIOError when a byte would have to come from the disk (preadv2 RWF_NOWAIT),
    so the event loop never waits on a read."""
    parts: list[bytes] = []
    offset = 0
    read = _pread_nowait if nowait else os.pread
    end = sys.maxsize if limit is None else limit
    while offset < end and (chunk := read(fd, want := min(max(size + 1 - offset, 1 << 16),
                                                          end - offset), offset)):
        parts.append(chunk)
        offset += len(chunk)
        if nowait and len(chunk) < want and offset >= size:
            # Short from the page cache once fstat's size is read: the end (or bytes the
            # file grew by since, not cached), without one more read. Short before it,
            # the next read says whether the rest is cached.
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _pread_nowait(fd: int, n: int, offset: int) -> bytes:
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        raise BlockingIOError(errno.EAGAIN, "no RWF_NOWAIT on this platform")
    buf = bytearray(n)
    try:
        got = os.preadv(fd, [buf], offset, flag)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:  # a filesystem that cannot promise it
            raise BlockingIOError(errno.EAGAIN, "RWF_NOWAIT not supported here") from None
        raise
    return bytes(memoryview(buf)[:got])


def of_fd(fd: int) -> tuple[str, int]:
    """Hash an open file from offset 0 to its end by pread (the descriptor's position is
    left alone); returns (checksum, bytes hashed). Never mmap: a warehouse file (or an
    object, a hard link of one) truncated under a mapping would kill us with SIGBUS."""
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    offset = 0
    while n := os.preadv(fd, [buf], offset):
        h.update(view[:n])
        offset += n
    return h.hexdigest(), offset

"""Review 47 (serving): c7bb913, cmroot.checksum.read_fd(nowait=True).

Reviewed: a short preadv2(RWF_NOWAIT) read ends the event loop's read only once fstat's size
has been read (before it, the next read says whether the rest is cached: EAGAIN sends the
request to a thread), as Reader._check / open_cached use it for GET /v1/files.

Attacks on files that shrink below fstat's size, and on files whose middle or tail pages
are out of the page cache (their own bytes written back with O_DIRECT). All held:
what the loop serves is what it hashed, or it hands the request to a thread; the daemon
answers 200 with the checksum's bytes, never a 5xx."""

from __future__ import annotations

import errno
import mmap
import os

import pytest
from cmroot_testlib import object_file, write_file

from cmroot import checksum as cks
from cmroot.store import Store
from tests.adversarial.test_review46_serving_fd import (
    PAGE,
    _answer,
    _append_uncached,
    _recycle,
    _resident,
)
from tests.server.cmroot_daemon import Daemon


def _drop_pages(path: os.PathLike[str], offset: int, length: int) -> None:
    """Take [offset, offset+length) (page-aligned) of the file out of the page cache: its
    own bytes written back there with O_DIRECT, which invalidates the cached pages."""
    with open(path, "rb") as f:
        f.seek(offset)
        same = f.read(length)
    buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
    buf.write(same)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip("no O_DIRECT on this filesystem")
        raise
    try:
        assert os.pwrite(fd, buf, offset) == length
    finally:
        os.close(fd)
        buf.close()


def _middle_out(path: os.PathLike[str], pages: int) -> None:
    """Every page cached but the middle one (skips the test when that cannot be had)."""
    with open(path, "rb") as f:
        f.read()
    _drop_pages(path, (pages // 2) * PAGE, PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:  # the other pages back in, one by one, no readahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for i in range(pages):
            if i != pages // 2:
                os.pread(fd, PAGE, i * PAGE)
    finally:
        os.close(fd)
    got = _resident(path)  # type: ignore[arg-type]
    want = [i != pages // 2 for i in range(pages)]
    if got != want:
        pytest.skip(f"page cache not as wanted here: {got}")


def test_held_read_fd_with_a_stale_larger_size_returns_the_file_as_it_is(env) -> None:
    """fstat said 3 pages, the file has since been cut to 1 page + 5 bytes: the first short
    read (before fstat's size) does not end the read, the next returns 0 and the read ends
    with exactly the file's bytes (the caller's hash then decides)."""
    data = os.urandom(PAGE + 5)
    p = write_file(env.warehouse / "f", data)
    fd = os.open(p, os.O_RDONLY)
    try:
        with open(p, "rb") as f:
            f.read()
        assert cks.read_fd(fd, 3 * PAGE, nowait=True, limit=1 << 20) == data
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["original", "object"])
def test_held_a_file_with_its_middle_page_out_of_the_cache_is_never_served_short(
    env, store: Store, kind: str
) -> None:
    """An original (resp. a recycled object) of 5 pages, every page cached but the middle
    one: open_cached never serves a prefix; it hands the request to a thread (WouldBlock)
    or answers exactly as open_verified does."""
    data = os.urandom(5 * PAGE)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    if kind == "object":
        _recycle(store, p)
        target = object_file(env.store_root, c)
    else:
        target = p
    _middle_out(target, 5)
    fast = _answer(store, str(p), c, cached=True)
    full = _answer(store, str(p), c, cached=False)
    assert full == (kind if kind == "original" else "cmroot", data)
    assert fast in ("WouldBlock", full), fast if isinstance(fast, str) else (fast[0], len(fast[1]))


def test_held_daemon_get_of_a_file_with_pages_out_of_the_cache(make_daemon) -> None:
    """GET /v1/files of an original whose middle page, then whose tail page, is out of the
    page cache, and after 2 pages were appended to it (its old checksum no longer its):
    200 with exactly the bytes (then 404), never a 5xx and never a prefix."""
    d: Daemon = make_daemon()
    data = os.urandom(5 * PAGE)
    c = cks.of_bytes(data)
    p = write_file(d.warehouse / "db.db" / "t" / "f", data)
    _middle_out(p, 5)
    r = d.request("GET", d.files_url(str(p), c))
    assert (r.status, r.body == data) == (200, True), (r.status, len(r.body))
    _drop_pages(p, 4 * PAGE, PAGE)
    r = d.request("GET", d.files_url(str(p), c))
    assert (r.status, r.body == data) == (200, True), (r.status, len(r.body))
    _append_uncached(p, 2 * PAGE)
    r = d.request("GET", d.files_url(str(p), c))
    assert r.status == 404, (r.status, r.headers.get("X-Cmroot-Status"), len(r.body))

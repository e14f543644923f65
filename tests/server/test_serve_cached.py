"""GET /v1/files through the real daemon when the event loop cannot answer from memory:
an object whose pages were dropped from the page cache (preadv2 RWF_NOWAIT refuses) is
served by a `serve` thread, byte for byte, and answered from memory once read."""

from __future__ import annotations

import os

import pytest
from cmroot_testlib import object_file

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, write_files


def _evicted(path: str) -> bool:
    """Drop a file's clean pages; False where the filesystem keeps them (tmpfs)."""
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


def test_an_object_not_in_the_page_cache_is_served_from_a_thread(daemon: Daemon) -> None:
    data = os.urandom(300_000)
    c = cks.of_bytes(data)
    [p] = write_files(daemon.warehouse, {"db.db/t/p=1/f": data})
    r = daemon.request("POST", "/v1/recycle", {"paths": [p], "op": "DROP_TABLE", "db": "db",
                                               "table": "t"}, scope="write")
    assert r.status == 200, r
    if not _evicted(str(object_file(daemon.store, c))):
        pytest.skip("this filesystem keeps the pages (tmpfs?): RWF_NOWAIT cannot refuse")
    for _ in range(2):  # the thread's read, then (its pages cached) the event loop's
        r = daemon.request("GET", daemon.files_url(p, c), scope="read")
        assert (r.status, r.headers["X-Cmroot-Status"], r.body) == (200, "cmroot", data)
    r = daemon.request("GET", daemon.files_url(p, c), headers={"Range": "bytes=10-19"},
                       scope="read")
    assert (r.status, r.body) == (206, data[10:20])
    assert not daemon.errors()

"""Store.open_cached, the daemon's event-loop read: it answers only from what the kernel
already holds (dentries, page cache) and must never answer differently from
Store.open_verified. Whatever it cannot settle that way (a symlink on the path, a file
over the inline size, bytes not in memory, a missing or corrupt file) raises WouldBlock,
so the thread's full read decides; in particular it never serves, and never quarantines,
a corrupt object."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cmroot_testlib import write_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, NotFound, OutsideRoots
from cmroot.store import Quarantined, RecycleRequest, Store
from cmroot.store.read import Verified, WouldBlock

INLINE = 1 << 20


def _content(v: Verified) -> bytes:
    return os.pread(v.fd, v.size + 1, 0) if v.data is None else v.data


def _answer(store: Store, path: str, c: str, cached: bool) -> tuple[str, bytes] | str:
    """(status, bytes) served, or the name of what was raised."""
    try:
        opened = (store.open_cached if cached else store.open_verified)(path, c, INLINE)
    except (WouldBlock, NotFound, BadRequest, OutsideRoots) as e:
        return type(e).__name__
    with opened as v:
        return str(v.status), _content(v)


def _agrees(store: Store, path: str, c: str) -> str | tuple[str, bytes]:
    """open_cached either defers or gives open_verified's very answer; returns the latter."""
    fast = _answer(store, path, c, cached=True)
    full = _answer(store, path, c, cached=False)
    assert fast == "WouldBlock" or fast == full, (fast, full)
    return full


def _recycle(store: Store, p: Path, mode: str = "move") -> None:
    store.recycle(RecycleRequest(paths=[str(p)], mode=mode, op="DROP_TABLE"))


def _object(env, c: str) -> Path:
    return env.object_path(c)


def test_an_original_and_a_recycled_copy_are_answered_from_memory(env, store: Store) -> None:
    old, new = os.urandom(70_000), os.urandom(5_000)
    c_old, c_new = cks.of_bytes(old), cks.of_bytes(new)
    p = write_file(env.warehouse / "db.db" / "t" / "f", old)
    assert _agrees(store, str(p), c_old) == ("original", old)
    with store.open_cached(str(p), c_old, INLINE) as v:
        assert (v.status, v.data) == ("original", old)
    _recycle(store, p, "copy")
    p.write_bytes(new)  # INSERT OVERWRITE: other bytes at the path now
    with store.open_cached(str(p), c_old, INLINE) as v:
        assert (v.status, v.data) == ("cmroot", old)
    with store.open_cached(str(p), c_new, INLINE) as v:
        assert (v.status, v.data) == ("original", new)
    p.unlink()
    assert _agrees(store, str(p), c_old) == ("cmroot", old)


def test_a_corrupt_object_is_never_served_nor_quarantined_from_the_loop(env, store) -> None:
    data = os.urandom(10_000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    _recycle(store, p)
    obj = _object(env, c)
    with open(obj, "r+b") as f:  # a writer that kept the inode across its recycle
        f.write(b"X")
    with pytest.raises(WouldBlock):
        store.open_cached(str(p), c, INLINE)
    assert obj.exists()  # left for the thread, which quarantines it and counts it
    with pytest.raises(Quarantined):
        store.open_verified(str(p), c, INLINE)
    assert not obj.exists()


def test_a_symlink_on_the_path_defers_to_the_full_read(env, store: Store) -> None:
    data = os.urandom(3_000)
    c = cks.of_bytes(data)
    twin = write_file(env.warehouse / "db.db" / "twin" / "f", data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    _recycle(store, p, "copy")
    p.unlink()
    p.symlink_to(twin)  # same bytes, inside the root: still never read through
    with pytest.raises(WouldBlock):
        store.open_cached(str(p), c, INLINE)
    assert _agrees(store, str(p), c) == ("cmroot", data)
    secret = write_file(env.outside / "secret", data)
    p.unlink()
    p.symlink_to(secret)  # out of the roots: refused as the full read refuses it
    assert _agrees(store, str(p), c) == "OutsideRoots"


def test_a_file_over_the_inline_size_or_missing_defers(env, store: Store) -> None:
    big = os.urandom(INLINE + 1)
    p = write_file(env.warehouse / "db.db" / "t" / "big", big)
    with pytest.raises(WouldBlock):
        store.open_cached(str(p), cks.of_bytes(big), INLINE)
    gone = str(env.warehouse / "db.db" / "t" / "nothing")
    assert _agrees(store, gone, cks.of_bytes(b"x")) == "NotFound"


def test_bad_input_is_refused_as_the_full_read_refuses_it(env, store: Store) -> None:
    ok = cks.of_bytes(b"")
    for path, c in [("relative/f", ok), (str(env.outside / "f"), ok),
                    (str(env.warehouse / "f"), "zz"), ("", ok), (None, ok)]:
        assert _answer(store, path, c, cached=True) == _answer(store, path, c, cached=False)


def _evict(path: Path) -> bool:
    """Drop a file's clean pages from the page cache; False where that does not happen
    (tmpfs keeps them: its pages are the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(1)
        try:
            os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


def test_bytes_not_in_the_page_cache_are_read_on_a_thread(env, store: Store) -> None:
    data = os.urandom(200_000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    _recycle(store, p)
    if not _evict(_object(env, c)):
        pytest.skip("this filesystem keeps the pages (tmpfs?): RWF_NOWAIT cannot be refused")
    with pytest.raises(WouldBlock):
        store.open_cached(str(p), c, INLINE)
    assert _answer(store, str(p), c, cached=False) == ("cmroot", data)
    with store.open_cached(str(p), c, INLINE) as v:  # the thread's read cached the pages
        assert v.data == data


_STATES = st.sampled_from(
    ["original", "moved", "overwritten", "object-corrupt", "symlink", "gone", "never"]
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_STATES, size=st.sampled_from([0, 1, 17, 4096, 65_536, 300_000]),
       salt=st.binary(min_size=8, max_size=8))
def test_the_loop_never_answers_otherwise_than_the_thread(env, store, state, size, salt):
    """Whatever the path and the store hold, open_cached defers or agrees, byte for byte
    and status for status, with open_verified."""
    data = (salt * (size // 8 + 1))[:size]
    c = cks.of_bytes(data)
    p = env.warehouse / "db.db" / "t" / salt.hex() / "f"
    if p.is_symlink():  # an earlier example's, with this salt: it would be written through
        p.unlink()
    if state != "never":
        write_file(p, data)
    if state in ("moved", "object-corrupt", "symlink", "gone"):
        _recycle(store, p)
    elif state == "overwritten":
        _recycle(store, p, "copy")
        p.write_bytes(data + b"!")
    if state == "object-corrupt":
        with open(_object(env, c), "ab") as f:
            f.write(b"!")
    elif state == "symlink":
        p.symlink_to(write_file(env.outside / salt.hex(), data))
    elif state == "gone":
        _object(env, c).unlink()
    _agrees(store, str(p), c)

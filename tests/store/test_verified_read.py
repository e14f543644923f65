"""Store.open_verified (invariant 3): the bytes of (path, checksum) come from one descriptor,
opened below the root with no symlink followed and checked from that descriptor; a file
replaced with the same size and mtime is re-hashed; an object changed by a writer that kept
its descriptor across the recycle is quarantined and never served; a file vanishing between
two steps falls back to the store copy (or NotFound), never an unexpected error."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from cmroot_testlib import write_file

from cmroot import checksum as cks
from cmroot.exceptions import NotFound
from cmroot.store import Quarantined, RecycleRequest, Store, read

BIG = (1 << 20) + 12345  # over the daemon's inline size: hashed from the descriptor


def _bytes(tag: bytes, size: int) -> bytes:
    return (tag * (size // len(tag) + 1))[:size]


def _content(v: read.Verified) -> bytes:
    return os.pread(v.fd, v.size + 1, 0) if v.data is None else v.data


@pytest.mark.parametrize("inline", [0, 1 << 20])
def test_a_symlink_on_the_way_is_no_original(env, store: Store, inline: int) -> None:
    """A path whose last component, or a parent, is a symlink (even one staying inside
    the roots) is not served through: the store's copy answers instead."""
    data = _bytes(b"real bytes ", 5000)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    store.recycle(RecycleRequest(paths=[str(p)], mode="copy", op="INSERT_OVERWRITE"))
    with store.open_verified(str(p), c, inline) as v:
        assert v.status == "original" and _content(v) == data

    # the file itself replaced by a symlink to an identical file elsewhere in the root
    twin = write_file(env.warehouse / "db.db" / "twin" / "f", data)
    p.unlink()
    p.symlink_to(twin)
    with store.open_verified(str(p), c, inline) as v:
        assert v.status == "cmroot" and _content(v) == data
    # a parent directory replaced by a symlink to a directory holding the same bytes
    p.unlink()
    (env.warehouse / "db.db" / "t").rmdir()
    (env.warehouse / "db.db" / "t").symlink_to(env.warehouse / "db.db" / "twin")
    with store.open_verified(str(p), c, inline) as v:
        assert v.status == "cmroot" and _content(v) == data
    assert [r.status for r in store.resolve([{"path": str(p), "checksum": c}])] == ["cmroot"]


def test_a_fifo_in_the_warehouse_neither_blocks_nor_serves(env, store: Store) -> None:
    p = env.warehouse / "db.db" / "t" / "pipe"
    p.parent.mkdir(parents=True)
    os.mkfifo(p)
    c = cks.of_bytes(b"")
    t0 = time.monotonic()
    with pytest.raises(NotFound):
        store.open_verified(str(p), c)
    assert store.resolve([{"path": str(p), "checksum": c}])[0].status == "missing"
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("how", ["in-place", "renamed-over"])
@pytest.mark.parametrize("size", [100, BIG])
def test_same_size_same_mtime_replacement_is_rehashed(env, store: Store, how, size) -> None:
    """`cp -p` of other bytes over a file a resolve cached: same size, mtime restored. Only
    ctime (and, renamed over, the inode) moved; the file must not resolve `original`."""
    old = _bytes(b"old", size)
    new = _bytes(b"NEW", size)
    c = cks.of_bytes(old)
    p = write_file(env.warehouse / "db.db" / "t" / "f", old)
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))  # written 10 s "ago"
    st = os.stat(p)
    read_racy = read.RACY_NS
    try:
        read.RACY_NS = 0  # let the first resolve cache it, as it would a settled file
        assert store.resolve([{"path": str(p), "checksum": c}])[0].status == "original"
        with store.open_verified(str(p), c) as v:
            assert v.status == "original"
        time.sleep(0.02)  # past a coarse timestamp tick
        store.recycle(RecycleRequest(paths=[str(p)], mode="copy", op="INSERT_OVERWRITE"))
        if how == "in-place":
            with open(p, "r+b") as f:
                f.write(new)
        else:
            tmp = write_file(p.with_name("tmp"), new)
            os.replace(tmp, p)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (os.stat(p).st_size, os.stat(p).st_mtime_ns) == (st.st_size, st.st_mtime_ns)

        [r] = store.resolve([{"path": str(p), "checksum": c}])
        assert r.status == "cmroot"
        with store.open_verified(str(p), c) as v:
            assert v.status == "cmroot" and _content(v) == old
        with store.open_verified(str(p), cks.of_bytes(new)) as v:
            assert v.status == "original" and _content(v) == new
    finally:
        read.RACY_NS = read_racy


def test_a_recently_changed_file_is_never_trusted_by_identity(env, store: Store) -> None:
    """Racy identities: a file whose ctime is within RACY_NS is hashed every time."""
    data = b"z" * 1000
    p = write_file(env.warehouse / "t" / "f", data)
    pair = [{"path": str(p), "checksum": cks.of_bytes(data)}]
    hashed = []
    real = cks.of_fd

    def of_fd(fd: int):
        hashed.append(fd)
        return real(fd)

    cks_of_fd, cks.of_fd = cks.of_fd, of_fd
    try:
        for _ in range(3):
            assert store.resolve(pair)[0].status == "original"
    finally:
        cks.of_fd = cks_of_fd
    assert len(hashed) == 3


@pytest.mark.parametrize("size", [4000, BIG])
def test_a_straggler_writer_changes_the_object_it_is_quarantined(env, store, size) -> None:
    """A writer opened the file before it was recycled (moved: the object is a hard link of
    that inode) and writes afterwards. The changed bytes are never served; the object is
    moved to <store>/quarantine/<checksum>.<unix time> and the mismatch reported once."""
    data = _bytes(b"good bytes ", size)
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "db.db" / "t" / "f", data)
    counted = []
    store.reader.on_mismatch = lambda: counted.append(1)
    with open(p, "r+b") as straggler:
        store.recycle(RecycleRequest(paths=[str(p)], op="DROP_TABLE", db="db", table="t"))
        with store.open_verified(str(p), c, 0) as v:  # verified (and trusted) once
            assert v.status == "cmroot" and _content(v) == data
        straggler.seek(size // 2)
        straggler.write(b"EVIL")
    obj = Path(store.layout.object_path(c))
    for inline in (0, 1 << 20, 0):
        with pytest.raises(NotFound) as ei:
            store.open_verified(str(p), c, inline)
        assert isinstance(ei.value, Quarantined)
        assert "quarantined" in str(ei.value) and "fsck" in str(ei.value)
    assert not obj.exists()
    [q] = list(Path(store.layout.quarantine).iterdir())
    assert q.name == f"{c}.{int(env.clock())}"
    assert b"EVIL" in q.read_bytes()
    assert counted == [1]
    assert store.resolve([{"path": str(p), "checksum": c}])[0].status == "missing"


def test_a_readonly_store_refuses_a_corrupt_object_without_moving_it(env, store) -> None:
    data = b"q" * 3000
    c = cks.of_bytes(data)
    p = write_file(env.warehouse / "t" / "f", data)
    store.recycle(RecycleRequest(paths=[str(p)], op="DELETE"))
    obj = Path(store.layout.object_path(c))
    obj.chmod(0o644)
    obj.write_bytes(b"r" * 3000)
    ro = env.open(readonly=True)
    with pytest.raises(NotFound, match="corrupt"):
        ro.open_verified(str(p), c)
    assert obj.exists()


@pytest.mark.parametrize("errno_", [errno.ENOENT, errno.ESTALE])
@pytest.mark.parametrize("step", ["open", "fstat", "hash"])
def test_a_file_vanishing_between_steps_falls_back(env, store, monkeypatch, errno_, step):
    """The original goes away between the open and the fstat, or while it is hashed: the
    store copy answers, or NotFound when there is none; resolve answers for every pair."""
    kept = _bytes(b"kept", BIG)
    lone = _bytes(b"lone", BIG)
    pk = write_file(env.warehouse / "t" / "kept", kept)
    pl = write_file(env.warehouse / "t" / "lone", lone)
    store.recycle(RecycleRequest(paths=[str(pk)], mode="copy", op="INSERT_OVERWRITE"))
    gone = OSError(errno_, os.strerror(errno_))

    if step == "open":
        real_open = read.confined.open_beneath

        def fail_open(dir_fd, rel, flags=os.O_RDONLY, mode=0o644):
            if rel.startswith("t/"):
                raise gone
            return real_open(dir_fd, rel, flags, mode)

        monkeypatch.setattr(read.confined, "open_beneath", fail_open)
    elif step == "fstat":
        real_fstat = os.fstat

        def fail_fstat(fd):
            st = real_fstat(fd)
            if st.st_size == BIG and os.readlink(f"/proc/self/fd/{fd}").startswith(
                str(env.warehouse)
            ):
                raise gone
            return st

        monkeypatch.setattr(os, "fstat", fail_fstat)
    else:
        real_hash = cks.of_fd

        def fail_hash(fd):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(env.warehouse)):
                raise gone
            return real_hash(fd)

        monkeypatch.setattr(cks, "of_fd", fail_hash)

    with store.open_verified(str(pk), cks.of_bytes(kept)) as v:
        assert v.status == "cmroot" and _content(v) == kept
    with pytest.raises(NotFound):
        store.open_verified(str(pl), cks.of_bytes(lone))
    res = store.resolve(
        [
            {"path": str(pk), "checksum": cks.of_bytes(kept)},
            {"path": str(pl), "checksum": cks.of_bytes(lone)},
        ]
    )
    assert [r.status for r in res] == ["cmroot", "missing"]


def test_descriptors_are_not_leaked(env, store: Store) -> None:
    data = _bytes(b"fd", BIG)
    p = write_file(env.warehouse / "t" / "f", data)
    c = cks.of_bytes(data)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with store.open_verified(str(p), c) as v:
            assert v.size == BIG
        with pytest.raises(NotFound):
            store.open_verified(str(p), cks.of_bytes(b"other"))
    assert len(os.listdir("/proc/self/fd")) <= before + 1

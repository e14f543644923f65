"""A warehouse on another filesystem (fsspec's in-memory one): recycle copies into the
store with verification, deletes the source only after the commit, and resolves and
serves through fsspec."""

from __future__ import annotations

import os

import pytest

from cmroot import checksum as cks
from cmroot.exceptions import NotFound, OutsideRoots
from cmroot.store import RecycleRequest


def _write(fs, path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)


def test_move_from_remote_copies_then_deletes(remote):
    store, fs, bucket = remote
    files = {
        f"/{bucket}/db/t/p={p}/part-{i}": os.urandom(3000 + i) for p in (1, 2) for i in range(3)
    }
    for path, data in files.items():
        _write(fs, path, data)
    res = store.recycle(
        RecycleRequest([f"memory://{bucket}/db/t"], op="DROP_TABLE", db="db", table="t")
    )
    assert sorted(f.path for f in res.files) == sorted(f"memory:/{p}" for p in files)
    assert not fs.find(f"/{bucket}/db/t")
    for f in res.files:
        with store.open_verified(f.path, f.checksum) as v:
            assert v.status == "cmroot"
            assert os.pread(v.fd, 1 << 20, 0) == files[f.path[len("memory:/") :]]
    assert not os.listdir(store.layout.staging)


def test_copy_from_remote_keeps_source_and_resolves_original(remote):
    store, fs, bucket = remote
    data = os.urandom(5000)
    _write(fs, f"/{bucket}/db/t/f", data)
    url = f"memory://{bucket}/db/t/f"
    [f] = store.recycle(RecycleRequest([url], mode="copy", op="INSERT_OVERWRITE")).files
    assert f.checksum == cks.of_bytes(data)
    assert fs.cat(f"/{bucket}/db/t/f") == data
    [r] = store.resolve([{"path": url, "checksum": f.checksum}])
    assert r.status == "original"
    _write(fs, f"/{bucket}/db/t/f", b"new bytes")
    [r] = store.resolve([{"path": url, "checksum": f.checksum}])
    assert r.status == "cmroot"


def test_remote_refusals(remote):
    store, _, bucket = remote
    with pytest.raises(NotFound):
        store.recycle(RecycleRequest([f"memory://{bucket}/nope"], op="DELETE"))
    with pytest.raises(OutsideRoots):
        store.recycle(RecycleRequest(["memory://elsewhere/x"], op="DELETE"))
    assert store.index.current_event_id() == 0

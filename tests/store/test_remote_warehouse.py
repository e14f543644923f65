"""A warehouse on another filesystem: recycle copies into the store with verification,
deletes the source only after the commit, and resolves and serves through fsspec.

The tests are a conformance class run against every backend: fsspec's in-memory
filesystem and a real S3 server on loopback (moto's server mode, through s3fs)."""

from __future__ import annotations

import os

import pytest
from remote_backends import RemoteWarehouse

from cmroot import checksum as cks
from cmroot.exceptions import NotFound, OutsideRoots
from cmroot.store import RecycleRequest


class RemoteWarehouseTests:
    """The invariants of a remote warehouse root, whatever the filesystem: a binding
    subclass provides the `wh` fixture."""

    def test_move_from_remote_copies_then_deletes(self, wh: RemoteWarehouse) -> None:
        store = wh.store
        files = {f"db/t/p={p}/part-{i}": os.urandom(3000 + i) for p in (1, 2) for i in range(3)}
        for rel, data in files.items():
            wh.write(rel, data)
        res = store.recycle(
            RecycleRequest([wh.url("db/t")], op="DROP_TABLE", db="db", table="t")
        )
        assert sorted(f.path for f in res.files) == sorted(wh.url(rel) for rel in files)
        assert not wh.fs.find(wh.path("db/t"))
        for f in res.files:
            with store.open_verified(f.path, f.checksum) as v:
                assert v.status == "cmroot"
                assert os.pread(v.fd, 1 << 20, 0) == files[f.path[len(wh.url()) + 1 :]]
        assert not os.listdir(store.layout.staging)

    def test_copy_from_remote_keeps_source_and_resolves_original(
        self, wh: RemoteWarehouse
    ) -> None:
        store = wh.store
        data = os.urandom(5000)
        wh.write("db/t/f", data)
        url = wh.url("db/t/f")
        [f] = store.recycle(RecycleRequest([url], mode="copy", op="INSERT_OVERWRITE")).files
        assert f.checksum == cks.of_bytes(data)
        assert wh.read("db/t/f") == data
        [r] = store.resolve([{"path": url, "checksum": f.checksum}])
        assert r.status == "original"
        wh.write("db/t/f", b"new bytes")
        [r] = store.resolve([{"path": url, "checksum": f.checksum}])
        assert r.status == "cmroot"

    def test_remote_refusals(self, wh: RemoteWarehouse) -> None:
        store = wh.store
        with pytest.raises(NotFound):
            store.recycle(RecycleRequest([wh.url("nope")], op="DELETE"))
        with pytest.raises(OutsideRoots):
            store.recycle(RecycleRequest([f"{wh.protocol}://elsewhere/x"], op="DELETE"))
        assert store.index.current_event_id() == 0


class TestMemory(RemoteWarehouseTests):
    @pytest.fixture
    def wh(self, memory_wh: RemoteWarehouse) -> RemoteWarehouse:
        return memory_wh


class TestS3(RemoteWarehouseTests):
    @pytest.fixture
    def wh(self, s3_wh: RemoteWarehouse) -> RemoteWarehouse:
        return s3_wh

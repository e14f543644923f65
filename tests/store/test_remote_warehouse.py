"""A warehouse on another filesystem: recycle copies into the store with verification,
then takes the source away (a prepared delete is a delete, as a rename makes it locally);
a rollback, or recovery after a crash, uploads it back, never over an object written there
meanwhile; the store resolves and serves through fsspec.

The tests are a conformance class run against every backend: fsspec's in-memory
filesystem and a real S3 server on loopback (moto's server mode, through s3fs)."""

from __future__ import annotations

import os

import pytest
from remote_backends import RemoteWarehouse, reopen

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import Conflict, NotFound, OutsideRoots, RecycleFailed
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


    def table(self, wh: RemoteWarehouse) -> dict[str, bytes]:
        files = {f"db/t/p={p}/part-{i}": os.urandom(2000 + i) for p in (1, 2) for i in range(2)}
        for rel, data in files.items():
            wh.write(rel, data)
        return files

    def drop(self) -> RecycleRequest:
        return RecycleRequest([], op="DROP_TABLE", db="db", table="t")

    def test_a_prepare_takes_the_files_and_a_commit_records_them(
        self, wh: RemoteWarehouse
    ) -> None:
        files = self.table(wh)
        prepared = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE", db="db",
                                                   table="t"))
        assert not wh.fs.find(wh.path("db/t"))  # gone at prepare, as a rename takes them
        assert wh.store.index.current_event_id() == 0
        wh.write("db/t/p=1/part-new", b"the statement's new file")  # never touched
        res = wh.store.commit(prepared.txid)
        assert sorted(f.path for f in res.files) == sorted(wh.url(r) for r in files)
        for f in res.files:
            with wh.store.open_verified(f.path, f.checksum) as v:
                assert os.pread(v.fd, 1 << 20, 0) == files[f.path[len(wh.url()) + 1:]]
        assert wh.read("db/t/p=1/part-new") == b"the statement's new file"
        assert not os.listdir(wh.store.layout.staging)

    def test_an_abort_puts_every_file_back(self, wh: RemoteWarehouse) -> None:
        files = self.table(wh)
        prepared = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        assert wh.store.abort(prepared.txid) == []
        assert {r: wh.read(r) for r in files} == files
        assert wh.store.index.current_event_id() == 0
        assert not os.listdir(wh.store.layout.staging)

    def test_an_abort_never_overwrites_a_file_written_meanwhile(
        self, wh: RemoteWarehouse
    ) -> None:
        files = self.table(wh)
        prepared = wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        wh.write("db/t/p=1/part-0", b"a writer's new bytes")
        assert wh.store.abort(prepared.txid) == [wh.url("db/t/p=1/part-0")]
        assert wh.read("db/t/p=1/part-0") == b"a writer's new bytes"
        assert {r: wh.read(r) for r in files if r != "db/t/p=1/part-0"} == {
            r: d for r, d in files.items() if r != "db/t/p=1/part-0"}
        old = files["db/t/p=1/part-0"]
        with wh.store.open_verified(wh.url("db/t/p=1/part-0"), cks.of_bytes(old)) as v:
            assert os.pread(v.fd, 1 << 20, 0) == old  # displaced: kept, with no event
        assert wh.store.index.current_event_id() == 0

    def test_a_file_rewritten_between_copy_and_take_fails_the_recycle(
        self, wh: RemoteWarehouse, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        files = self.table(wh)
        real = faults.point
        copied: list[str] = []

        def rewrite(name: str) -> None:
            # The last file (they go in order, one thread), once its copy is journaled.
            if name == "recycle.copy_journaled":
                copied.append(name)
                if len(copied) == len(files):
                    wh.write("db/t/p=2/part-1", b"rewritten after its copy")
            real(name)

        monkeypatch.setattr(faults, "point", rewrite)
        wh.store.recycler.workers = 1
        with pytest.raises((Conflict, RecycleFailed), match="changed while it was recycled"):
            wh.store.recycle(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        now = {r: wh.read(r) for r in files}
        assert now.pop("db/t/p=2/part-1") == b"rewritten after its copy"
        assert now == {r: d for r, d in files.items() if r != "db/t/p=2/part-1"}
        assert wh.store.index.current_event_id() == 0

    @pytest.mark.parametrize("point", ["recycle.copy_journaled", "recycle.source_taken"])
    def test_a_crash_after_a_take_puts_the_files_back_at_recovery(
        self, wh: RemoteWarehouse, point: str
    ) -> None:
        files = self.table(wh)
        wh.store.recycler.workers = 1
        faults.arm(point, 3, crash=True)
        try:
            with pytest.raises(faults.Crash):
                wh.store.prepare(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        finally:
            faults.disarm()
        assert len(wh.fs.find(wh.path("db/t"))) < len(files)  # some were taken
        with reopen(wh) as reopened:  # recovery rolls the open transaction back
            assert {r: wh.read(r) for r in files} == files
            assert reopened.index.current_event_id() == 0
            assert not os.listdir(reopened.layout.staging)


class TestMemory(RemoteWarehouseTests):
    @pytest.fixture
    def wh(self, memory_wh: RemoteWarehouse) -> RemoteWarehouse:
        return memory_wh


class TestS3(RemoteWarehouseTests):
    @pytest.fixture
    def wh(self, s3_wh: RemoteWarehouse) -> RemoteWarehouse:
        return s3_wh

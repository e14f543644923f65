"""The store's invariants (DESIGN.md 1-5), written once and run on every store backend:
a local store with a local warehouse, a store on S3 with its warehouse in another bucket
of the same server (staging by server-side copy), and a store on S3 with a local
warehouse (staging by upload). A binding is a few lines: a `backend` fixture giving a
`store_backends.StoreBackend`, and the tests it is known to fail with the defect named
(`defects`: each runs as a strict xfail there).

Everything is real: local directories, a moto S3 server on loopback reached through s3fs,
a SQLite index. Crashes are injected at the store's fault points (`cmroot.faults`, which
stop the recycle as death would), then the store is reopened so that recovery runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cmroot_testlib import Clock, on_point
from store_backends import COPY_ONLY, TAKE_ONLY, StoreBackend, local_backend, s3_store_backend

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import Conflict, Forbidden, NotFound, RecycleFailed
from cmroot.store import Quarantined, RecycleRequest
from cmroot.store.journal import Journal

HOUR = 3600.0
DAY = 24 * HOUR
TABLE = "db.db/t"
OUTSIDE = b"outside the roots"

# Where a move recycle can die, and whether the index commit was made by then.
CRASH_POINTS = [
    ("journal.begun", 1),  # journaled, nothing moved
    ("recycle.file_staged", 3),  # the third file staged (renamed) or about to be copied
    ("recycle.copy_journaled", 3),  # a take: the third copy journaled, its source still there
    ("recycle.source_taken", 3),  # a take: the third source removed
    ("recycle.file_published", 3),  # the third object published
    ("recycle.flushed", 1),  # every file staged, published, durable: just before the commit
    ("journal.committed", 1),  # the commit point: entries and event recorded
    ("journal.source_removed", 2),  # a copy of a move: clean-up removed two sources
    ("journal.unstaged", 1),  # clean-up removed the staging names
]
COMMITTED = frozenset({"journal.committed", "journal.source_removed", "journal.unstaged"})


def table(b: StoreBackend, big: bool = False) -> dict[str, bytes]:
    """Table db.t, partitioned: {path below the root: bytes}. Two files hold the same bytes
    (one object), one is empty; with `big`, two more, one of them 3 MiB."""
    same = os.urandom(1500)
    files = {
        f"{TABLE}/p=1/part-0": os.urandom(2000),
        f"{TABLE}/p=1/part-1": same,
        f"{TABLE}/p=2/part-0": same,
        f"{TABLE}/p=2/part-1": b"",
    }
    if big:
        files[f"{TABLE}/p=2/part-2"] = os.urandom(3 << 20)
        files[f"{TABLE}/p=3/part-0"] = os.urandom(777)
    for rel, data in files.items():
        b.write(rel, data)
    return files


def drop(b: StoreBackend, mode: str = "move", *extra: str) -> RecycleRequest:
    return RecycleRequest([b.url(TABLE), *extra], mode=mode, op="DROP_TABLE", db="db",
                          table="t")


def served(b: StoreBackend, rel: str, data: bytes) -> tuple[str, bytes]:
    """(status, bytes) `open_verified` serves for (rel, checksum of `data`)."""
    with b.store.open_verified(b.url(rel), cks.of_bytes(data)) as v:
        return str(v.status), os.pread(v.fd, len(data) + 1, 0)


def statuses(b: StoreBackend, files: dict[str, bytes]) -> list[str]:
    pairs = [{"path": b.url(r), "checksum": cks.of_bytes(d)} for r, d in files.items()]
    return [str(r.status) for r in b.store.resolve(pairs)]


def assert_in_store(b: StoreBackend, files: dict[str, bytes]) -> None:
    """Every (path, checksum) resolves `cmroot` and is served with exactly its bytes."""
    assert statuses(b, files) == ["cmroot"] * len(files)
    for rel, data in files.items():
        assert served(b, rel, data) == ("cmroot", data), f"wrong bytes served for {rel}"
    assert {cks.of_bytes(d) for d in files.values()} <= b.objects()


def assert_one_event(b: StoreBackend, files: dict[str, bytes]) -> None:
    [event] = b.store.events()
    assert event.type == "DROP_TABLE"
    assert sorted((f["path"], f["checksum"], f["size"]) for f in event.files) == sorted(
        (b.url(r), cks.of_bytes(d), len(d)) for r, d in files.items()
    )


def assert_recycled(b: StoreBackend, files: dict[str, bytes]) -> None:
    """A committed move: sources (and the table's directory) gone, every file in the
    store, one event naming them all, staging empty."""
    assert b.files(TABLE) == {}
    assert not b.exists(TABLE), "a move of a directory leaves no directory behind"
    assert_in_store(b, files)
    assert_one_event(b, files)
    assert b.staging() == []
    assert b.store.index.pending_txids() == []


def assert_untouched(b: StoreBackend, files: dict[str, bytes]) -> None:
    """Nothing happened: every file at its source with its bytes, no event, staging empty,
    no transaction left open and no object left behind."""
    assert b.files(TABLE) == files
    assert b.store.events() == []
    assert b.store.index.current_event_id() == 0
    assert b.staging() == []
    assert b.store.index.pending_txids() == []
    assert b.objects() == set()


class StoreInvariantTests:
    """The store's invariants, whatever it is on: a binding provides `backend`."""

    # Tests this binding fails because of a known defect in cmroot: {name: the defect}.
    defects: ClassVar[dict[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _known_defects(self, request: pytest.FixtureRequest) -> None:
        reason = self.defects.get(request.node.originalname)
        if reason is not None:
            request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))

    # -- 1. no loss -------------------------------------------------------------------------
    def test_a_moved_table_is_retrievable_byte_for_byte(self, backend: StoreBackend) -> None:
        b = backend
        files = table(b, big=True)
        res = b.store.recycle(drop(b))
        assert sorted(f.path for f in res.files) == sorted(b.url(r) for r in files)
        assert {f.path: f.checksum for f in res.files} == {
            b.url(r): cks.of_bytes(d) for r, d in files.items()}
        assert res.event_id == 1
        assert_recycled(b, files)
        # The two identical files are one object; every object hashes to its name.
        assert len(b.objects()) == len(files) - 1
        for c in b.objects():
            assert cks.of_bytes(b.object_bytes(c) or b"") == c, f"object {c} is not its bytes"

    # -- 2. copy mode -----------------------------------------------------------------------
    def test_a_copy_leaves_the_sources_and_resolves_original(self, backend: StoreBackend) -> None:
        b = backend
        files = table(b)
        b.store.recycle(drop(b, "copy"))
        assert b.files(TABLE) == files
        assert statuses(b, files) == ["original"] * len(files)
        for rel, data in files.items():
            assert served(b, rel, data) == ("original", data)
        assert_one_event(b, files)
        assert len(b.objects()) == len(files) - 1
        # Overwritten at the source afterwards: the old bytes come from the store.
        rel = f"{TABLE}/p=1/part-0"
        b.write(rel, b"new bytes")
        assert statuses(b, {rel: files[rel]}) == ["cmroot"]
        assert served(b, rel, files[rel]) == ("cmroot", files[rel])

    # -- 3. no phantom ----------------------------------------------------------------------
    def test_a_request_naming_a_missing_path_is_refused_whole(self, backend: StoreBackend) -> None:
        b = backend
        files = table(b)
        with pytest.raises(NotFound):
            b.store.recycle(drop(b, "move", b.url("db.db/t/p=3/nope")))
        assert_untouched(b, files)

    def test_a_request_naming_a_path_outside_the_roots_is_refused_whole(
        self, backend: StoreBackend
    ) -> None:
        b = backend
        files = table(b)
        with pytest.raises(Forbidden):
            b.store.recycle(RecycleRequest([b.url(TABLE), b.outside.url_of("x")], op="DELETE"))
        assert_untouched(b, files)
        assert b.outside.read("x") == OUTSIDE

    @pytest.mark.parametrize(("point", "k"), CRASH_POINTS, ids=[p for p, _ in CRASH_POINTS])
    def test_a_crash_during_a_move_is_all_or_nothing_after_recovery(
        self, backend: StoreBackend, point: str, k: int
    ) -> None:
        b = backend
        if (point in TAKE_ONLY and b.method != "take") or (
            point in COPY_ONLY and b.method != "copy"
        ):
            pytest.skip(f"a move staged by {b.method} never passes {point}")
        files = table(b)
        b.store.recycler.workers = 1  # files in order: the k-th is the k-th
        faults.arm(point, k, crash=True)
        try:
            with pytest.raises(faults.Crash):
                b.store.recycle(drop(b))
        finally:
            faults.disarm()
        b.reopen()
        if point in COMMITTED:
            assert_recycled(b, files)
            return
        assert_untouched(b, files)

    # -- 4. two-phase -----------------------------------------------------------------------
    def test_a_prepare_takes_the_files_and_an_abort_puts_every_one_back(
        self, backend: StoreBackend
    ) -> None:
        b = backend
        files = table(b)
        prepared = b.store.prepare(drop(b))
        assert sorted(f.path for f in prepared.files) == sorted(b.url(r) for r in files)
        assert b.files(TABLE) == {}, "a prepare moves the files into staging"
        assert b.store.events() == []
        assert b.store.abort(prepared.txid) == []
        assert_untouched(b, files)

    def test_a_prepare_then_a_commit_records_one_event(self, backend: StoreBackend) -> None:
        b = backend
        files = table(b)
        prepared = b.store.prepare(drop(b))
        assert b.store.events() == []
        assert "cmroot" not in statuses(b, files)  # unseen until the commit
        res = b.store.commit(prepared.txid)
        assert sorted(f.path for f in res.files) == sorted(b.url(r) for r in files)
        assert_recycled(b, files)

    def test_an_abort_never_overwrites_a_file_re_created_meanwhile(
        self, backend: StoreBackend
    ) -> None:
        b = backend
        files = table(b)
        victim = f"{TABLE}/p=1/part-0"
        prepared = b.store.prepare(drop(b))
        b.write(victim, b"a writer's new bytes")
        assert b.store.abort(prepared.txid) == [b.url(victim)]
        assert b.read(victim) == b"a writer's new bytes"
        others = {r: d for r, d in files.items() if r != victim}
        assert {r: d for r, d in b.files(TABLE).items() if r != victim} == others
        # Displaced: the old bytes are kept, retrievable, with no event.
        assert served(b, victim, files[victim]) == ("cmroot", files[victim])
        assert b.store.events() == []
        assert b.staging() == []

    # -- 5. right bytes ---------------------------------------------------------------------
    def test_a_corrupt_object_is_never_served_and_a_recycle_of_its_bytes_heals_it(
        self, backend: StoreBackend
    ) -> None:
        b = backend
        rel, data = f"{TABLE}/p=1/part-0", os.urandom(4000)
        b.write(rel, data)
        b.store.recycle(drop(b))
        c = cks.of_bytes(data)
        b.write_object(c, bytes(reversed(data)))  # same size, other bytes
        with pytest.raises(NotFound) as caught:  # Quarantined is a NotFound
            served(b, rel, data)
        assert isinstance(caught.value, Quarantined)
        assert c not in b.objects(), "a corrupt object stays in place"
        assert [n.split(".")[0] for n in b.quarantine()] == [c]
        with pytest.raises(NotFound):
            served(b, rel, data)  # still nothing wrong served
        b.write(rel, data)
        b.store.recycle(drop(b))
        assert served(b, rel, data) == ("cmroot", data)
        assert b.object_bytes(c) == data

    def test_a_recycle_of_a_corrupt_objects_bytes_replaces_it(self, backend: StoreBackend) -> None:
        b = backend
        rel, data = f"{TABLE}/p=1/part-0", os.urandom(4000)
        b.write(rel, data)
        b.store.recycle(drop(b))
        c = cks.of_bytes(data)
        b.write_object(c, bytes(reversed(data)))
        b.write(rel, data)  # recycled again before anyone read the corrupt object
        b.store.recycle(drop(b))
        assert served(b, rel, data) == ("cmroot", data)
        assert b.object_bytes(c) == data
        assert [n.split(".")[0] for n in b.quarantine()] == [c]  # the bad bytes, kept aside

    # -- 6. retention -----------------------------------------------------------------------
    def test_objects_go_after_retain_and_not_before(
        self, backend: StoreBackend, clock: Clock
    ) -> None:
        b = backend
        files = table(b)
        b.store.recycle(drop(b))
        n = len(b.objects())
        clock.advance(DAY - 1)
        report = b.store.gc()
        assert report.removed == [] and report.failed == 0
        assert len(b.objects()) == n
        assert_in_store(b, files)
        clock.advance(1)
        report = b.store.gc()
        assert {r["checksum"] for r in report.removed} == {cks.of_bytes(d) for d in files.values()}
        assert report.failed == 0
        assert b.objects() == set()
        assert statuses(b, files) == ["missing"] * len(files)
        with pytest.raises(NotFound):
            served(b, f"{TABLE}/p=1/part-0", files[f"{TABLE}/p=1/part-0"])
        assert b.store.gc().removed == []

    # -- 7. confinement ---------------------------------------------------------------------
    def test_the_root_the_store_and_paths_outside_are_refused(self, backend: StoreBackend) -> None:
        b = backend
        files = table(b)
        b.store.recycle(drop(b, "copy"))  # objects in the store to aim at
        objects = b.objects()
        c = cks.of_bytes(files[f"{TABLE}/p=1/part-0"])
        for path in (
            b.url(),  # a warehouse root itself
            b.url() + "/",
            b.outside.url_of("x"),
            b.outside.url_of(),
            b.store_at.url,  # the store's own files are under no root
            b.store_at.url_of(b.object_rel(c)),
        ):
            for mode in ("move", "copy"):
                with pytest.raises(Forbidden):
                    b.store.recycle(RecycleRequest([path], mode=mode, op="DELETE"))
            with pytest.raises(Forbidden):
                b.store.prepare(RecycleRequest([path], op="DELETE"))
        assert b.files() == files
        assert b.outside.read("x") == OUTSIDE
        assert b.objects() == objects
        assert len(b.store.events()) == 1

    # -- 8. a writer racing the recycle -------------------------------------------------------
    def test_a_source_rewritten_before_it_is_staged_is_never_lost_or_misrecorded(
        self, backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Rewritten after the listing, before anything moved: the recycle either fails
        (the new bytes at the path, no event) or takes and records the new bytes; the old
        checksum is never recorded for bytes the store does not hold."""
        b = backend
        files = table(b)
        rel = f"{TABLE}/p=1/part-0"
        new = b"rewritten between listing and staging"
        on_point(monkeypatch, "journal.begun", lambda: b.write(rel, new))
        try:
            res = b.store.recycle(drop(b))
        except (Conflict, RecycleFailed):
            assert b.files(TABLE) == {**files, rel: new}
            assert b.store.events() == []
            return
        now = {**files, rel: new}
        assert {f.path: f.checksum for f in res.files} == {
            b.url(r): cks.of_bytes(d) for r, d in now.items()}
        assert_recycled(b, now)

    def test_a_source_rewritten_after_its_copy_fails_the_recycle(
        self, backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Rewritten once the store holds its copy but before the source is taken: the
        recycle fails, the new bytes stay at the path, every other file is back, no
        event."""
        b = backend
        if b.method != "take":
            pytest.skip("a rename copies and takes a file in one step: nothing between")
        files = table(b)
        new = b"rewritten after its copy"
        real = Journal.copied
        hit: list[str] = []

        def copied(journal: Journal, txid: str, it: Any) -> None:
            real(journal, txid, it)  # its copy is journaled: now a writer rewrites it
            if not hit:
                hit.append(it.key[len(b.url()) :].lstrip("/"))
                b.write(hit[0], new)

        monkeypatch.setattr(Journal, "copied", copied)
        with pytest.raises((Conflict, RecycleFailed), match="changed while it was recycled"):
            b.store.recycle(drop(b))
        rel = hit[0]
        assert b.files(TABLE) == {**files, rel: new}
        assert b.store.events() == []
        assert b.staging() == []


# -- bindings -------------------------------------------------------------------------------


class TestLocalStore(StoreInvariantTests):
    @pytest.fixture
    def backend(self, tmp_path: Path, clock: Clock) -> Iterator[StoreBackend]:
        with local_backend(tmp_path, clock) as b:
            yield b


class TestLocalTwoLevelStore(StoreInvariantTests):
    @pytest.fixture
    def backend(self, tmp_path: Path, clock: Clock) -> Iterator[StoreBackend]:
        with local_backend(tmp_path, clock, two_level=True) as b:
            yield b


class TestS3StoreS3Warehouse(StoreInvariantTests):
    @pytest.fixture
    def backend(self, tmp_path: Path, clock: Clock, s3_client: Any) -> Iterator[StoreBackend]:
        with s3_store_backend(tmp_path, clock, s3_client, warehouse_on_s3=True) as b:
            yield b


class TestS3StoreLocalWarehouse(StoreInvariantTests):
    @pytest.fixture
    def backend(self, tmp_path: Path, clock: Clock, s3_client: Any) -> Iterator[StoreBackend]:
        with s3_store_backend(tmp_path, clock, s3_client, warehouse_on_s3=False) as b:
            yield b

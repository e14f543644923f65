"""Adversarial reproducers against a remote (fsspec) warehouse root, as a conformance class
run on fsspec's in-memory filesystem and on a real S3 server on loopback (moto, s3fs).

The writer that races the store is the test's own client of the filesystem: on S3 a
separate s3fs instance, as a job on another host would be, never the store's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from remote_backends import RemoteWarehouse

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest


def _race_at(
    monkeypatch: pytest.MonkeyPatch, at: str, write: Callable[[], None]
) -> dict[str, bool]:
    """Run `write` when the store reaches fault point `at`; the answer says it did."""
    state = {"raced": False}
    real_point = faults.point

    def point(name: str) -> None:
        if name == at and not state["raced"]:
            state["raced"] = True
            write()
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    return state


class RemoteAttacks:
    """Races against a remote root; a binding subclass provides the `wh` fixture."""

    def test_clean_up_does_not_delete_a_file_written_after_the_emptiness_check(
        self, wh: RemoteWarehouse, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Sequence: DROP_TABLE <root>/db/t (move). After the commit, clean-up runs
        RemoteSession.remove_empty_dirs: `if not fs.find(path): fs.rm(path, recursive=True)`.
        A writer that puts a new file under db/t between that find and that rm (a job
        re-creating the table right after the drop) loses it: a *recursive* delete of a
        directory checked empty a moment before removes a file that was never recycled,
        never recorded, and is in no store.
        Breaks invariant 1 (a file removed with no copy anywhere). Expected: the new file
        survives (remove only what was checked, non-recursively; object stores need no
        directory clean-up at all)."""
        wh.write("db/t/old", b"old bytes")
        state = _race_at(  # clean-up is next: a job re-creates the table
            monkeypatch, "journal.unstaged", lambda: wh.write("db/t/new", b"new bytes")
        )
        wh.store.recycle(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        assert state["raced"]
        assert wh.read("db/t/new") == b"new bytes"

    def test_a_source_rewritten_after_its_copy_is_not_deleted(
        self, wh: RemoteWarehouse, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Sequence: DROP_TABLE <root>/db/t (move: each file is staged by copy, its identity
        recorded). Between the commit and the removal of the copied sources, a job
        rewrites db/t/f with other bytes. The store must compare the identity it recorded
        with the object as it is now, and leave the new bytes in place: they were never
        recycled. Breaks invariant 1 if they go. Expected: db/t/f holds the new bytes;
        db/t/g (unchanged) is removed."""
        wh.write("db/t/f", b"old bytes")
        wh.write("db/t/g", b"other file")
        state = _race_at(
            monkeypatch, "journal.committed", lambda: wh.write("db/t/f", b"new, longer bytes")
        )
        res = wh.store.recycle(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        assert state["raced"] and len(res.files) == 2
        assert wh.read("db/t/f") == b"new, longer bytes"
        assert not wh.fs.exists(wh.path("db/t/g"))

    def test_a_source_rewritten_before_its_copy_is_copied_whole(
        self, wh: RemoteWarehouse, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Sequence: DROP_TABLE <root>/db/t (move). The table is listed, then a job
        rewrites db/t/f with longer bytes before the store copies it. Whatever the store
        copies, it must be the object's bytes at one moment (old or new), recorded under
        their own checksum, and the source removed only if those are the bytes it holds.
        Breaks invariants 1 and 3 otherwise. Expected: either the new bytes stay at the
        source, or the store serves them whole by path and checksum."""
        old, new = b"old bytes", b"new bytes, written after the listing"
        wh.write("db/t/f", old)
        state = _race_at(monkeypatch, "journal.begun", lambda: wh.write("db/t/f", new))
        try:
            res = wh.store.recycle(RecycleRequest([wh.url("db/t")], op="DROP_TABLE"))
        except CmrootError:  # refusing the changed source is a fine answer too
            res = None
        assert state["raced"]
        if wh.fs.exists(wh.path("db/t/f")):
            assert wh.read("db/t/f") == new
            return
        assert res is not None
        [f] = res.files
        assert f.checksum == cks.of_bytes(new), "the source went, but not its bytes"


class TestMemoryAttacks(RemoteAttacks):
    @pytest.fixture
    def wh(self, memory_wh: RemoteWarehouse) -> RemoteWarehouse:
        return memory_wh


class TestS3Attacks(RemoteAttacks):
    @pytest.fixture
    def wh(self, s3_wh: RemoteWarehouse) -> RemoteWarehouse:
        return s3_wh

"""fsck of a store in use (`online=True`, as the daemon runs it), with a recycle held at a
deterministic point between publishing its object and committing it to the index: the
moment a repair that decided on an earlier look would do harm."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import Env, held_at, object_file, write_file

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest
from cmroot.store import RecycleRequest, Store


def recycle(store: Store, path: Path) -> Callable[[], object]:
    return lambda: store.recycle(RecycleRequest(paths=[str(path)], op="DELETE"))


def object_path(env: Env, c: str) -> Path:
    return object_file(env.store_root, c)


def test_an_object_between_publish_and_commit_is_not_unindexed(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"in flight" * 100
    f = write_file(env.warehouse / "a" / "f", data)
    with held_at(monkeypatch, "recycle.file_published", recycle(store, f)):
        assert object_path(env, cks.of_bytes(data)).exists()  # published, not indexed
        report = store.fsck(repair=True, online=True)
        assert report.clean, report.to_json()
    assert store.index.get_object(cks.of_bytes(data)).expires > env.clock()  # its commit's
    assert store.fsck().clean


def test_a_row_whose_object_is_published_again_mid_walk_is_not_missing(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recycled file's object is lost from disk (the walk sees its row with no file);
    before fsck settles the rows, the same bytes are recycled again from elsewhere and
    published. Neither path's entry goes, nothing is reported missing."""
    data = b"recycled twice" * 100
    c = cks.of_bytes(data)
    first = write_file(env.warehouse / "a" / "f", data)
    store.recycle(RecycleRequest(paths=[str(first)], op="DELETE"))
    object_path(env, c).unlink()
    second = write_file(env.warehouse / "b" / "f", data)
    held: list[Any] = []

    def after_walk(done: int, total: int) -> None:
        if done == total and not held:
            held.append(held_at(monkeypatch, "recycle.file_published", recycle(store, second)))
            held[0].__enter__()

    report = store.fsck(repair=True, progress=after_walk, online=True)
    held[0].__exit__(None, None, None)
    assert report.counts["missing"] == 0, report.to_json()
    res = store.resolve([{"path": str(first), "checksum": c}, {"path": str(second), "checksum": c}])
    assert [r.status for r in res] == ["cmroot", "cmroot"]


def test_a_read_only_store_checks_and_refuses_to_repair(env: Env, store: Store) -> None:
    data = b"x" * 10
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "f", data))],
                                 op="DELETE"))
    beside = env.open(readonly=True)
    assert beside.fsck().clean
    with pytest.raises(BadRequest):
        beside.fsck(repair=True)


def test_an_object_healed_after_fsck_hashed_it_is_not_quarantined(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object's bytes rot; fsck hashes it (corrupt); before fsck acts, a recycle of the
    same bytes heals it (Objects.publish) and commits. Quarantining on the earlier look
    would take the healed object away, and its rows with it: its paths would be lost."""
    data = b"rotting bytes" * 100
    c = cks.of_bytes(data)
    first = write_file(env.warehouse / "a" / "f", data)
    store.recycle(RecycleRequest(paths=[str(first)], op="DELETE"))
    object_path(env, c).write_bytes(b"X" * len(data))  # bit rot (a new inode: as a restore)
    second = write_file(env.warehouse / "b" / "f", data)
    reports: list[object] = []

    def check() -> None:
        reports.append(store.fsck(repair=True, online=True))

    with held_at(monkeypatch, "fsck.object_hashed", check):
        store.recycle(RecycleRequest(paths=[str(second)], op="DELETE"))  # heals it
    res = store.resolve([{"path": str(first), "checksum": c}, {"path": str(second), "checksum": c}])
    assert [r.status for r in res] == ["cmroot", "cmroot"]
    assert object_path(env, c).read_bytes() == data
    assert store.fsck().clean

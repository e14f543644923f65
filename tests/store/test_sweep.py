"""Retention (invariant 4) with the daemon's clock injected: nothing goes before `retain`
after the last recycle, everything expired goes in one sweep, per-table overrides, dry
runs, trash mode (and purge), and a sweep that fails on one object."""

from __future__ import annotations

import errno
import importlib
import os
from pathlib import Path

from cmroot_testlib import assert_retrievable, index_counts, make_table, object_files, table_dir

from cmroot import checksum as cks
from cmroot.store import RecycleRequest, Store

sweep_mod = importlib.import_module("cmroot.store.sweep")  # the package re-exports `sweep`

HOUR = 3600.0
DAY = 24 * HOUR


def drop(
    env, store: Store, db: str, table: str, n: int = 3, purge: bool = False, seed: str | None = None
) -> dict[str, bytes]:
    import random

    files = make_table(
        env.warehouse,
        db,
        table,
        [{"p": "1"}],
        files_per_partition=n,
        rng=random.Random(seed or f"{db}.{table}"),
    )
    store.recycle(
        RecycleRequest(
            paths=[str(table_dir(env.warehouse, db, table))],
            op="DROP_TABLE",
            db=db,
            table=table,
            purge=purge,
        )
    )
    return files


def checksums(files: dict[str, bytes]) -> set[str]:
    return {cks.of_bytes(b) for b in files.values()}


def removed(report) -> set[str]:
    return {r["checksum"] for r in report.removed}


def test_nothing_before_retain_everything_expired_in_one_sweep(env, store: Store, clock) -> None:
    first = drop(env, store, "db", "a", n=5)
    clock.advance(HOUR)
    second = drop(env, store, "db", "b", n=5)

    clock.advance(DAY - HOUR - 1)  # one second before `first` expires
    r = store.gc()
    assert r.removed == [] and r.failed == 0 and not r.dry_run
    assert_retrievable(store, {**first, **second}, status="cmroot")

    clock.advance(1)  # exactly retain after the first recycle
    r = store.gc()
    assert removed(r) == checksums(first)
    assert all(x["action"] == "deleted" for x in r.removed)
    assert r.removed_bytes == sum(len(b) for b in first.values())
    assert len(object_files(env)) == len(second)
    assert all(
        x.status == "missing"
        for x in store.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in first.items()])
    )
    assert_retrievable(store, second, status="cmroot")
    assert index_counts(env)["entries"] == len(second)

    clock.advance(10 * DAY)
    r = store.gc()
    assert removed(r) == checksums(second)
    assert object_files(env) == []
    counts = index_counts(env)
    assert counts["objects"] == 0 and counts["entries"] == 0
    assert counts["events"] == 2  # the event log is history, not retention's business
    assert store.gc().removed == []  # a second sweep has nothing left
    assert store.fsck().clean


def test_many_expired_objects_go_in_one_sweep(env, store: Store, clock) -> None:
    files = drop(env, store, "db", "big", n=2500)  # more than one page of the sweep
    assert len(object_files(env)) == 2500
    clock.advance(DAY)
    seen: list[int] = []
    r = store.gc(progress=seen.append)
    # Counted in full; listed only up to the report's bound (the first in expiry order).
    assert r.removed_objects == 2500 and r.removed_truncated
    assert len(r.removed) == sweep_mod.REPORT_ROWS and removed(r) < checksums(files)
    assert r.removed_bytes == sum(len(b) for b in files.values())
    assert object_files(env) == []
    assert seen and seen[-1] == 2500


def test_a_later_recycle_of_the_same_bytes_extends_retention(env, store: Store, clock) -> None:
    data = b"same bytes" * 100
    a = env.warehouse / "db.db" / "a" / "f"
    b = env.warehouse / "db.db" / "b" / "f"
    for p in (a, b):
        p.parent.mkdir(parents=True)
        p.write_bytes(data)
    store.recycle(RecycleRequest(paths=[str(a)], op="DELETE"))
    clock.advance(12 * HOUR)
    store.recycle(RecycleRequest(paths=[str(b)], op="DELETE"))
    clock.advance(12 * HOUR)  # a's entry alone would have expired now
    assert store.gc().removed == []
    assert_retrievable(store, {str(a): data, str(b): data}, status="cmroot")
    clock.advance(12 * HOUR)
    assert removed(store.gc()) == {cks.of_bytes(data)}


def test_per_table_override_glob_on_db_table(env, clock) -> None:
    store = env.open(
        CMROOT_STORE_RETAIN="1d", CMROOT_STORE_RETAIN_OVERRIDES="sales.*=7d,tmp.scratch_*=1h"
    )
    sales = drop(env, store, "sales", "orders")
    tmp = drop(env, store, "tmp", "scratch_1")
    tmp_other = drop(env, store, "tmp", "keep")
    plain = drop(env, store, "default", "t")
    e = {x.db + "." + x.table: x.expires - x.recycled for x in store.entries(limit=100)}
    assert e == {"sales.orders": 7 * DAY, "tmp.scratch_1": HOUR, "tmp.keep": DAY, "default.t": DAY}

    clock.advance(HOUR)
    assert removed(store.gc()) == checksums(tmp)
    clock.advance(DAY - HOUR)
    assert removed(store.gc()) == checksums(tmp_other) | checksums(plain)
    clock.advance(5 * DAY)
    assert store.gc().removed == []
    assert_retrievable(store, sales, status="cmroot")
    clock.advance(DAY)
    assert removed(store.gc()) == checksums(sales)


def test_dry_run_removes_nothing_and_reports_what_it_would(env, store: Store, clock) -> None:
    files = drop(env, store, "db", "t", n=6)
    clock.advance(12 * HOUR)
    keep = drop(env, store, "db", "later", n=2)  # not expired yet: not reported
    clock.advance(12 * HOUR)
    before_objects = object_files(env)
    before_counts = index_counts(env)
    r = store.gc(dry_run=True)
    assert r.dry_run
    assert removed(r) == checksums(files)
    assert {x["action"] for x in r.removed} == {"deleted"}
    assert r.removed_bytes == sum(len(b) for b in files.values())
    assert object_files(env) == before_objects
    assert index_counts(env) == before_counts
    assert_retrievable(store, {**files, **keep}, status="cmroot")
    # the real sweep then removes exactly what the dry run announced
    assert removed(store.gc()) == removed(r)
    assert r.to_json()["removed_objects"] == 6


def test_trash_mode_moves_expired_objects_and_deletes_purged_ones(env, clock) -> None:
    store = env.open(CMROOT_STORE_ON_EXPIRE="trash")
    kept = drop(env, store, "db", "kept", n=3)
    purged = drop(env, store, "db", "purged", n=3, purge=True)
    clock.advance(DAY)
    r = store.gc(dry_run=True)
    assert {x["checksum"]: x["action"] for x in r.removed} == {
        **dict.fromkeys(checksums(kept), "trashed"),
        **dict.fromkeys(checksums(purged), "deleted"),
    }
    r = store.gc()
    actions = {x["checksum"]: x["action"] for x in r.removed}
    assert actions == {
        **dict.fromkeys(checksums(kept), "trashed"),
        **dict.fromkeys(checksums(purged), "deleted"),
    }
    assert object_files(env) == []
    trash = env.store_root / "trash"
    trashed = {p.name: p for p in trash.rglob("*") if p.is_file()}
    assert set(trashed) == checksums(kept)  # purged content is deleted, not trashed
    for data in kept.values():
        assert trashed[cks.of_bytes(data)].read_bytes() == data
    assert index_counts(env)["objects"] == 0


def test_purged_and_unpurged_entries_of_one_object_keep_it_for_trash(env, clock) -> None:
    store = env.open(CMROOT_STORE_ON_EXPIRE="trash")
    data = b"shared" * 10
    for name, purge in (("a", True), ("b", False)):
        p = env.warehouse / name / "f"
        p.parent.mkdir()
        p.write_bytes(data)
        store.recycle(RecycleRequest(paths=[str(p)], op="DELETE", purge=purge))
    clock.advance(DAY)
    assert [x["action"] for x in store.gc().removed] == ["trashed"]


def test_a_failure_on_one_object_is_reported_and_the_rest_go(
    env, store: Store, clock, monkeypatch
) -> None:
    files = drop(env, store, "db", "t", n=8)
    victim = sorted(checksums(files))[3]
    victim_path = str(env.object_path(victim))
    real_unlink = os.unlink

    def unlink(path, *a, **kw):
        if str(path) == victim_path:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    clock.advance(DAY)
    r = store.gc()
    assert r.failed == 1 and [f["checksum"] for f in r.failures] == [victim]
    assert "Permission denied" in r.failures[0]["error"] and victim in r.failures[0]["error"]
    assert removed(r) == checksums(files) - {victim}
    assert [p.name for p in object_files(env)] == [victim]
    assert index_counts(env)["objects"] == 1  # still indexed, so the next sweep retries
    monkeypatch.undo()
    r = store.gc()
    assert removed(r) == {victim} and r.failed == 0 and r.failures == []
    assert object_files(env) == [] and index_counts(env)["objects"] == 0


def test_sweep_skips_an_object_a_recycle_has_claimed(env, store: Store, clock) -> None:
    files = drop(env, store, "db", "t", n=2)
    c1, c2 = sorted(checksums(files))
    clock.advance(DAY)
    store.objects._claims.setdefault(c1, set()).add("in-flight-tx")  # a recycle mid-publish
    dry = store.gc(dry_run=True)
    assert dry.skipped == 1 and removed(dry) == {c2}
    r = store.gc()
    assert r.skipped == 1 and removed(r) == {c2}
    assert [p.name for p in object_files(env)] == [c1]
    store.objects.release("in-flight-tx", {c1})
    assert removed(store.gc()) == {c1}


def test_an_object_file_already_gone_is_still_forgotten(env, store: Store, clock) -> None:
    files = drop(env, store, "db", "t", n=1)
    [c] = checksums(files)
    os.unlink(env.object_path(c))
    clock.advance(DAY)
    assert removed(store.gc()) == {c}
    assert index_counts(env)["objects"] == 0


def test_reconfigure_applies_to_later_recycles(env, store: Store, clock) -> None:
    from cmroot import config

    store.reconfigure(config.load(None, env=env.env(CMROOT_STORE_RETAIN="1h")).store)
    files = drop(env, store, "db", "t", n=2)
    clock.advance(HOUR)
    assert removed(store.gc()) == checksums(files)
    assert Path(env.store_root).is_dir()

"""A retention sweep reports counts and a bounded sample: `removed_objects`,
`removed_bytes`, `failed`, `skipped`, `duration`, at most REPORT_ROWS removed objects and
failures listed, with `removed_truncated` / `failures_truncated` when there were more. A
sweep of millions of objects holds no list that grows with it, and its API answer and
`cmroot gc --json` (the same shape) stay small.

The store's contents are made through the index and the layout directly (objects with
their entries), so these tests depend on the sweep alone."""

from __future__ import annotations

import errno
import importlib
import json
import os
import tracemalloc
from typing import Any

import pytest
from cmroot_testlib import index_counts, object_files

from cmroot import checksum as cks
from cmroot.cli import _gc_text
from cmroot.client import Client
from cmroot.index import Entry
from cmroot.store import Store

sweep_mod = importlib.import_module("cmroot.store.sweep")  # the package re-exports `sweep`

DAY = 86400.0


def populate(store: Store, n: int, files: bool = True, tag: str = "") -> dict[str, int]:
    """n objects (checksum -> size) recycled now, expiring in a day; with `files`, their
    bytes in the store, else index rows alone (a sweep forgets an object already gone)."""
    now = store.clock()
    out: dict[str, int] = {}
    entries = []
    for i in range(n):
        data = f"{tag}object {i}".encode() * (1 + i % 3)
        c = cks.of_bytes(data) if files else f"{tag}{i}".encode().hex().ljust(32, "0")[:32]
        if files:
            path = store.layout.object_path(c)
            if not os.path.isdir(os.path.dirname(path)):
                store.layout.make_shard(c)
            with open(path, "wb") as f:
                f.write(data)
        out[c] = len(data)
        entries.append(
            Entry(
                f"/wh/t/{tag}f{i}",
                c,
                len(data),
                now,
                now + DAY,
                "DROP_TABLE",
                "db",
                "t",
                None,
                False,
            )
        )
    for i in range(0, n, 5000):
        store.index.commit_recycle(None, None, entries[i : i + 5000])
    return out


@pytest.fixture
def rows(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sweep_mod, "REPORT_ROWS", 25)
    return 25


def test_counts_are_whole_and_the_list_is_bounded(env, store: Store, clock, rows: int) -> None:
    objs = populate(store, 2600)  # more than one page of the sweep (BATCH 2000)
    clock.advance(2 * DAY)
    dry = store.gc(dry_run=True)
    assert (dry.removed_objects, dry.removed_bytes) == (len(objs), sum(objs.values()))
    assert len(dry.removed) == rows and dry.removed_truncated and dry.dry_run
    assert len(object_files(env)) == len(objs)  # a dry run removes nothing
    seen: list[int] = []
    r = store.gc(progress=seen.append)
    assert (r.removed_objects, r.removed_bytes, r.failed, r.skipped) == (
        len(objs),
        sum(objs.values()),
        0,
        0,
    )
    assert len(r.removed) == rows and r.removed_truncated and not r.failures_truncated
    assert {x["checksum"] for x in r.removed} <= set(objs)
    assert all(x["action"] == "deleted" and x["size"] == objs[x["checksum"]] for x in r.removed)
    assert seen[-1] == len(objs)
    assert object_files(env) == [] and index_counts(env)["objects"] == 0
    j = r.to_json()
    assert set(j) == {
        "dry_run",
        "now",
        "removed_objects",
        "removed_bytes",
        "removed",
        "removed_truncated",
        "failed",
        "failures",
        "failures_truncated",
        "skipped",
        "duration",
        "evicted_objects",
        "evicted_bytes",
        "held_objects",
        "held_bytes",
        "budget_bytes",
        "over_budget_bytes",
    }
    assert j["removed_objects"] == len(objs) and len(j["removed"]) == rows
    again = store.gc()
    assert again.removed_objects == 0 and again.removed == [] and not again.removed_truncated


def test_failures_are_counted_and_capped(
    env, store: Store, clock, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = populate(store, 60)
    long_dir = "d" * 2000

    def unlink(path: Any, *a: Any, **kw: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", f"{path}/{long_dir}")

    monkeypatch.setattr(os, "unlink", unlink)
    clock.advance(2 * DAY)
    r = store.gc()
    assert r.failed == len(objs) and r.removed_objects == 0
    assert len(r.failures) == rows and r.failures_truncated
    assert all(len(f["error"]) <= sweep_mod.ERROR_CHARS for f in r.failures)
    assert "Permission denied" in r.failures[0]["error"]
    assert index_counts(env)["objects"] == len(objs)  # still indexed: the next sweep retries
    text = _gc_text(r.to_json())
    assert text.startswith(f"removed 0 objects (0 bytes); {len(objs)} failed, 0 skipped")
    assert text.count("\nfailed ") == 20 and f"{len(objs) - 20} more failures" in text
    monkeypatch.undo()
    r = store.gc()
    assert r.removed_objects == len(objs) and r.failed == 0 and r.failures == []


def test_the_cli_text_of_a_small_sweep(store: Store, clock) -> None:
    populate(store, 3)
    clock.advance(2 * DAY)
    text = _gc_text(store.gc(dry_run=True).to_json())
    assert text.startswith("would remove 3 objects (") and "0 failed, 0 skipped" in text
    assert text.splitlines()[1:] == ["  db.t: 3 files, 48 B"]  # a dry run names its tables
    # A daemon from before counted reports sent `failed` as a list.
    old = {
        "dry_run": False,
        "removed_objects": 1,
        "removed_bytes": 9,
        "skipped": 0,
        "failed": [{"checksum": "a" * 32, "error": "EIO"}],
    }
    assert _gc_text(old).endswith(f"1 failed, 0 skipped (in use)\nfailed {'a' * 32}: EIO")


def test_a_large_sweep_holds_no_growing_list(store: Store, clock) -> None:
    """50,000 objects (index rows only: the files are already gone) with the default bound:
    the report lists 1,000 and the sweep's memory does not grow with the object count."""
    populate(store, 50_000, files=False)
    clock.advance(2 * DAY)
    tracemalloc.start()
    try:
        r = store.gc()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.removed_objects == 50_000 and len(r.removed) == sweep_mod.REPORT_ROWS == 1000
    assert r.removed_truncated
    # A page of 2,000 objects and the 1,000-row sample, not 50,000 rows (~20 MB).
    assert peak < 8 << 20, f"peak {peak} bytes"
    assert len(json.dumps(r.to_json())) < 200_000


def test_the_api_answers_the_same_shape(env, store: Store, clock, rows: int) -> None:
    from tests.server.test_events_paging import serve

    objs = populate(store, 40)
    clock.advance(2 * DAY)
    with serve(store) as url:
        c = Client(url)
        dry = c.gc(dry_run=True)
        assert dry["dry_run"] is True and dry["removed_objects"] == len(objs)
        assert len(dry["removed"]) == rows and dry["removed_truncated"] is True
        real = c.gc()
        assert real["removed_objects"] == len(objs) and real["failed"] == 0
        assert real["removed_bytes"] == sum(objs.values())
        assert set(real) == set(store.gc().to_json())
    assert object_files(env) == []

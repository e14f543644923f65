"""fsck: the objects on disk and the index agree, and every object's bytes hash to its name.
Unindexed objects are re-registered (never deleted); index rows whose object vanished are
forgotten; corrupt objects are quarantined; a valid object in the wrong shard goes to its
place (never quarantined, its rows never dropped); troubled recycle transactions are
reported. It streams shard by shard. Without --repair nothing changes.
(Unreadable files and directories: test_fsck_faults.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from cmroot_testlib import (
    Env,
    assert_objects_match_names,
    assert_retrievable,
    index_counts,
    make_table,
    object_files,
    snapshot,
    table_dir,
    write_file,
)

from cmroot import checksum as cks
from cmroot.exceptions import NotFound
from cmroot.store import RecycleRequest, Store
from cmroot.store.layout.local import shard_levels


def recycled(env, store: Store, n: int = 4) -> dict[str, bytes]:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=n)
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))], op="DROP_TABLE"))
    return files


@pytest.fixture(params=[1, 2], ids=["one-level", "two-level"])
def env(request: pytest.FixtureRequest, env: Env) -> Env:
    """Every check on both layouts: a store made now (`objects/ab/<checksum>`), and one
    made before LAYOUT files (`objects/ab/cd/<checksum>`), which is kept so."""
    if request.param == 2:
        (env.store_root / "objects").mkdir(parents=True)
    return env


def obj(env, c: str) -> Path:
    return env.object_path(c)


def quarantined(env, c: str) -> list[Path]:
    """What fsck quarantined of object c: <store>/quarantine/<c>.<unix time>[.n]."""
    q = env.store_root / "quarantine"
    return sorted(q.glob(f"{c}.*")) if q.exists() else []


def stray_dir(env, c: str, before: bool) -> tuple[str, ...]:
    """A shard directory that is not c's, sorting before (or after) c's own."""
    if shard_levels(str(env.store_root)) == 1:
        if before:
            return ("00",) if c[:2] != "00" else ("01",)
        return ("ff",) if c[:2] != "ff" else ("fe",)
    if before:
        return ("00", "00") if c[:4] != "0000" else ("00", "01")
    return ("ff", "ff") if c[:4] != "ffff" else ("ff", "fe")


def test_a_healthy_store_is_clean(env, store: Store) -> None:
    files = recycled(env, store, n=6)
    seen: list[tuple[int, int]] = []
    r = store.fsck(progress=lambda i, n: seen.append((i, n)))
    assert r.clean and r.checked == 6
    assert r.to_json()["clean"] is True
    # progress once per shard visited, in order
    shards = {env.object_path(c).parent for c in map(cks.of_bytes, files.values())}
    assert seen == [(i, len(shards)) for i in range(1, len(shards) + 1)]
    assert r.shards == len(shards)
    assert store.fsck(repair=True).clean
    assert_retrievable(store, files, status="cmroot")


def test_an_unindexed_object_is_reported_and_re_registered_never_deleted(env, store, clock) -> None:
    files = recycled(env, store)
    data = b"an object the index lost" * 10
    c = cks.of_bytes(data)
    write_file(obj(env, c), data)

    before = snapshot(env)
    r = store.fsck()
    assert r.unindexed == [c] and not r.clean
    assert r.missing == [] and r.corrupt == []
    assert snapshot(env) == before  # report only

    r = store.fsck(repair=True)
    assert r.unindexed == [c]
    assert obj(env, c).read_bytes() == data  # never deleted
    o = store.index.get_object(c)
    assert o is not None and o.size == len(data)
    assert o.expires >= clock() + store.config.retain  # a full retention to sort it out
    assert store.fsck().clean
    assert_retrievable(store, files, status="cmroot")
    # re-registered, it is swept like any other object once its retention runs out
    clock.advance(store.config.retain)
    assert c in {x["checksum"] for x in store.gc().removed}


def test_an_index_row_whose_object_vanished_is_reported_and_forgotten(env, store) -> None:
    files = recycled(env, store)
    gone_path, gone_data = sorted(files.items())[0]
    c = cks.of_bytes(gone_data)
    os.unlink(obj(env, c))

    r = store.fsck()
    assert r.missing == [c] and not r.clean
    assert store.index.get_object(c) is not None  # report only
    assert store.resolve([{"path": gone_path, "checksum": c}])[0].status == "missing"

    r = store.fsck(repair=True)
    assert r.missing == [c]
    assert store.index.get_object(c) is None
    assert store.index.entries(checksum=c) == []
    assert index_counts(env)["entries"] == len(files) - 1
    assert store.fsck().clean
    with pytest.raises(NotFound):
        store.open_verified(gone_path, c)
    rest = {p: b for p, b in files.items() if p != gone_path}
    assert_retrievable(store, rest, status="cmroot")


def test_a_corrupt_object_is_reported_and_quarantined(env, store) -> None:
    files = recycled(env, store)
    bad_path, bad_data = sorted(files.items())[1]
    c = cks.of_bytes(bad_data)
    corrupted = bytes([bad_data[0] ^ 0xFF]) + bad_data[1:]
    # same size, bytes changed in place (bit rot, a stray writer)
    with open(obj(env, c), "r+b") as f:
        f.write(corrupted[:1])

    r = store.fsck()
    assert r.corrupt == [c] and not r.clean
    assert obj(env, c).exists()  # report only
    # what the daemon checks before serving an object; a read-only store refuses it
    # without moving it (a writable one quarantines it: tests/store/test_verified_read.py)
    with pytest.raises(NotFound) as ei:
        env.open(readonly=True).open_verified(bad_path, c)
    assert c in str(ei.value) and "corrupt" in str(ei.value)
    assert obj(env, c).exists()

    r = store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []
    assert not obj(env, c).exists()
    (q,) = quarantined(env, c)
    assert q.read_bytes() == corrupted  # kept for inspection, out of the serving path
    assert store.index.get_object(c) is None
    assert store.resolve([{"path": bad_path, "checksum": c}])[0].status == "missing"
    assert store.fsck().clean
    assert_objects_match_names(env)
    rest = {p: b for p, b in files.items() if p != bad_path}
    assert_retrievable(store, rest, status="cmroot")


def test_a_truncated_object_is_corrupt(env, store) -> None:
    files = recycled(env, store, n=2)
    c = cks.of_bytes(sorted(files.values(), key=len)[-1])
    with open(obj(env, c), "r+b") as f:
        f.truncate(1)
    assert store.fsck().corrupt == [c]


def test_stray_files_are_reported_not_deleted(env, store) -> None:
    recycled(env, store, n=2)
    stray = write_file(env.objects_dir / "ab" / "notes.txt", b"hello")
    r = store.fsck(repair=True)
    assert r.stray == [str(stray)] and not r.clean
    assert stray.read_bytes() == b"hello"


def test_all_three_at_once(env, store) -> None:
    files = recycled(env, store, n=5)
    sums = sorted(cks.of_bytes(b) for b in files.values())
    os.unlink(obj(env, sums[0]))
    obj(env, sums[1]).write_bytes(b"garbage")
    extra = b"extra"
    write_file(obj(env, cks.of_bytes(extra)), extra)
    r = store.fsck(repair=True)
    assert (r.missing, r.corrupt, r.unindexed) == ([sums[0]], [sums[1]], [cks.of_bytes(extra)])
    assert r.checked == 5
    r2 = store.fsck()
    assert r2.clean, r2.to_json()
    assert index_counts(env)["objects"] == 4
    assert len(object_files(env)) == 4


# -- an object in the wrong shard ------------------------------------------------------------


@pytest.mark.parametrize("before", [True, False], ids=["stray-shard-first", "home-first"])
def test_a_valid_object_in_the_wrong_shard_is_moved_home_with_its_rows(env, store, before) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    wrong = env.objects_dir.joinpath(*stray_dir(env, c, before), c)
    wrong.parent.mkdir(parents=True, exist_ok=True)
    os.rename(obj(env, c), wrong)

    before_snap = snapshot(env)
    r = store.fsck()
    assert r.misplaced == [{"path": str(wrong), "checksum": c, "action": "move to its place"}]
    # not corrupt, and not missing: a valid copy exists, only in the wrong place
    assert (r.corrupt, r.missing, r.unindexed) == ([], [], []) and not r.clean
    assert snapshot(env) == before_snap  # report only

    r = store.fsck(repair=True)
    assert r.misplaced[0]["action"] == "moved to its place"
    assert (r.corrupt, r.missing) == ([], [])
    assert obj(env, c).read_bytes() == data and not wrong.exists()
    assert quarantined(env, c) == []
    assert [e.path for e in store.index.entries(checksum=c)] == [path]  # rows kept
    assert store.fsck().clean
    assert_objects_match_names(env)
    assert_retrievable(store, files, status="cmroot")


@pytest.mark.parametrize("before", [True, False], ids=["stray-shard-first", "home-first"])
def test_a_stray_duplicate_of_a_placed_object_is_removed_rows_kept(env, store, before) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    dup = write_file(env.objects_dir.joinpath(*stray_dir(env, c, before), c), data)

    r = store.fsck()
    assert r.misplaced == [
        {"path": str(dup), "checksum": c, "action": "remove: a duplicate of its place"}
    ]
    assert dup.exists() and r.corrupt == []

    r = store.fsck(repair=True)
    assert (r.corrupt, r.missing) == ([], [])
    assert not dup.exists() and obj(env, c).read_bytes() == data
    assert quarantined(env, c) == []
    assert [e.path for e in store.index.entries(checksum=c)] == [path]
    assert store.fsck().clean
    assert_retrievable(store, files, status="cmroot")


@pytest.mark.parametrize("before", [True, False], ids=["stray-shard-first", "home-first"])
def test_a_valid_stray_copy_replaces_a_corrupt_one_at_its_place(env, store, before) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    good = write_file(env.objects_dir.joinpath(*stray_dir(env, c, before), c), data)
    obj(env, c).write_bytes(b"rotten " + data)  # a new inode: the stray copy is unaffected

    r = store.fsck()
    assert r.corrupt == [c] and len(r.misplaced) == 1 and r.missing == []

    r = store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []
    # the corrupt copy is quarantined by whichever of the two directories is walked first
    assert r.misplaced[0]["action"] in (
        "replaced the corrupt copy at its place (quarantined)",
        "moved to its place",
    )
    (q,) = quarantined(env, c)
    assert q.read_bytes() == b"rotten " + data
    assert obj(env, c).read_bytes() == data and not good.exists()
    assert [e.path for e in store.index.entries(checksum=c)] == [path]  # never dropped
    assert store.fsck().clean
    assert_retrievable(store, files, status="cmroot")


def test_an_unindexed_object_in_the_wrong_shard_is_moved_and_registered(env, store) -> None:
    recycled(env, store, n=1)
    data = b"misfiled and unknown"
    c = cks.of_bytes(data)
    wrong = write_file(env.objects_dir.joinpath(*stray_dir(env, c, True), c), data)
    r = store.fsck(repair=True)
    assert r.unindexed == [c] and r.corrupt == []
    assert obj(env, c).read_bytes() == data and not wrong.exists()
    assert store.index.get_object(c) is not None
    assert store.fsck().clean


def test_bytes_not_hashing_to_their_name_in_the_wrong_shard_are_quarantined(env, store) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    bogus = write_file(env.objects_dir.joinpath(*stray_dir(env, c, True), c), b"not it")

    r = store.fsck()
    assert r.corrupt == [c] and r.misplaced == [] and bogus.exists()
    r = store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []
    assert not bogus.exists()
    (q,) = quarantined(env, c)
    assert q.read_bytes() == b"not it"
    # the valid copy at its place, and its rows, are untouched
    assert obj(env, c).read_bytes() == data
    assert [e.path for e in store.index.entries(checksum=c)] == [path]
    assert store.fsck().clean
    assert_retrievable(store, files, status="cmroot")


def test_a_corrupt_object_with_no_valid_copy_loses_its_rows_only_on_repair(env, store) -> None:
    files = recycled(env, store, n=2)
    c = cks.of_bytes(sorted(files.values())[0])
    obj(env, c).write_bytes(b"rotten")
    store.fsck()
    assert store.index.entries(checksum=c) != []  # report only
    r = store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []
    assert store.index.entries(checksum=c) == [] and store.index.get_object(c) is None


# -- streaming -----------------------------------------------------------------------------


def _spy_ranges(monkeypatch, store: Store) -> list[tuple[str, str]]:
    asked: list[tuple[str, str]] = []
    real = store.index.objects_between

    def spy(low: str, high: str):
        asked.append((low, high))
        return real(low, high)

    monkeypatch.setattr(store.index, "objects_between", spy)
    return asked


@pytest.mark.parametrize("small", [True, False], ids=["small-index", "large-index"])
def test_it_streams_shard_by_shard_and_finds_rows_of_a_vanished_shard(
    env, store, monkeypatch, small
) -> None:
    files = recycled(env, store, n=8)
    sums = sorted(cks.of_bytes(b) for b in files.values())
    gone = sums[0]
    # the whole top-level directory of one object vanishes (and any sibling in it)
    lost = sorted(c for c in sums if c[:2] == gone[:2])
    for c in lost:
        obj(env, c).unlink()
    os.rmdir(obj(env, gone).parent)
    if not os.listdir(obj(env, gone).parent.parent):
        os.rmdir(obj(env, gone).parent.parent)
    if not small:
        monkeypatch.setattr(sys.modules["cmroot.store.fsck"], "SMALL_INDEX", 0)
    asked = _spy_ranges(monkeypatch, store)

    r = store.fsck()
    assert r.missing == lost and r.checked == len(sums) - len(lost)
    # never the whole index: one query per top-level prefix at most, and per shard
    assert asked and all(len(low) in (2, 4) and len(high) in (len(low), 1) for low, high in asked)
    assert not any(low == "" for low, _ in asked)
    levels = shard_levels(str(env.store_root))
    width = 2 * levels
    per_shard = [low for low, _ in asked if len(low) == width]
    if levels == 1 and small:
        # the plan asks each top-level prefix first, which is each shard of this layout
        assert per_shard[:256] == [f"{i:02x}" for i in range(256)]
        per_shard = per_shard[256:]
    settled = sorted({c[:width] for c in lost})  # the shards of missing rows, rechecked last
    walk = per_shard[: len(per_shard) - len(settled)]
    assert walk == sorted(walk)  # one shard at a time, in order
    assert per_shard[len(walk) :] == settled
    if not small:
        assert len(walk) == 256**levels  # every possible shard, one at a time
    asked.clear()
    r = store.fsck(repair=True)
    assert r.missing == lost
    assert all(store.index.get_object(c) is None for c in lost)
    assert store.fsck().clean


def test_report_lists_are_capped_counts_are_not(env, store) -> None:
    recycled(env, store, n=1)
    extra = [f"extra {i}".encode() for i in range(5)]
    for data in extra:
        write_file(obj(env, cks.of_bytes(data)), data)
    r = store.fsck(limit=2)
    assert len(r.unindexed) == 2 and r.counts["unindexed"] == 5 and r.truncated
    j = r.to_json()
    assert j["counts"]["unindexed"] == 5 and j["truncated"] is True
    assert set(j) >= {
        "checked", "clean", "unindexed", "missing", "corrupt", "stray",
        "unreadable", "misplaced", "quarantined_transactions",
    }
    r = store.fsck(repair=True, limit=2)
    assert r.counts["unindexed"] == 5  # all repaired, not only those listed
    assert store.fsck().clean


# -- recycle transactions recovery could not finish ------------------------------------------


def _troubled_tx(env, store: Store, state: str) -> tuple[str, Path]:
    """A recycle transaction left in the journal as `state` (quarantined, or committed with
    an error), with one file in its staging directory. Its source lies outside the roots, so
    every recovery of it fails the same way (and quarantines it again)."""
    txid = f"tx{state[:4]}0123456789abcdef0123456789"
    staged = write_file(env.staging_dir / txid / "0", b"a file waiting for its rollback")
    source = str(env.outside / "gone.parquet")
    store.index.journal_begin(
        txid, store.clock(), "move", {"op": "DROP_TABLE", "paths": [source]}, [],
        [(0, source, str(staged), "rename")],
    )
    if state == "committed":
        store.index.commit_recycle(txid, None, [])
    store.index.quarantine_tx(txid, "PermissionDenied: could not put it back")
    return txid, staged


@pytest.mark.parametrize("state", ["quarantined", "committed"])
def test_troubled_recycle_transactions_are_reported_and_not_clean(env, store, state) -> None:
    recycled(env, store, n=2)
    txid, staged = _troubled_tx(env, store, state)
    leftover = write_file(env.staging_dir / "not-a-transaction" / "0", b"?")

    r = store.fsck(repair=True)
    assert not r.clean
    (tx,) = r.quarantined_transactions
    assert (tx["txid"], tx["state"], tx["files"]) == (txid, state, 1)
    assert "could not put it back" in tx["error"]
    # its staged file belongs to it: not stray, and left alone even by --repair
    assert r.stray == [str(leftover.parent)]
    assert staged.exists() and leftover.exists()
    assert r.to_json()["quarantined_transactions"][0]["txid"] == txid


def test_the_quarantined_transactions_gauge(env, store) -> None:
    from prometheus_client import CollectorRegistry

    from cmroot.metrics import StoreCollector

    def gauge() -> float | None:
        reg = CollectorRegistry()
        reg.register(StoreCollector(store))
        return reg.get_sample_value("cmroot_quarantined_transactions")

    assert gauge() == 0
    _troubled_tx(env, store, "quarantined")
    _troubled_tx(env, store, "committed")
    assert gauge() == 2

"""fsck: the objects on disk and the index agree, and every object's bytes hash to its name.
Unindexed objects are re-registered (never deleted); index rows whose object vanished are
forgotten; corrupt objects are quarantined. Without --repair nothing changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cmroot_testlib import (
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
from cmroot.exceptions import ChecksumMismatch, NotFound
from cmroot.store import RecycleRequest, Store


def recycled(env, store: Store, n: int = 4) -> dict[str, bytes]:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=n)
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))], op="DROP_TABLE"))
    return files


def obj(env, c: str) -> Path:
    return env.objects_dir / c[:2] / c[2:4] / c


def test_a_healthy_store_is_clean(env, store: Store) -> None:
    files = recycled(env, store, n=6)
    seen: list[tuple[int, int]] = []
    r = store.fsck(progress=lambda i, n: seen.append((i, n)))
    assert r.clean and r.checked == 6
    assert r.to_json()["clean"] is True
    assert seen[-1] == (6, 6)
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
        store.locate(gone_path, c)
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
    with pytest.raises(ChecksumMismatch) as ei:
        store.verify_object(c)  # what the daemon checks before serving an object
    assert c in str(ei.value)

    r = store.fsck(repair=True)
    assert r.corrupt == [c]
    assert not obj(env, c).exists()
    q = env.store_root / "quarantine" / c
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


def test_an_object_in_the_wrong_shard_is_reported(env, store) -> None:
    data = b"misfiled"
    c = cks.of_bytes(data)
    wrong = env.objects_dir / "00" / "00" / c
    write_file(wrong, data)
    r = store.fsck()
    assert r.corrupt == [c]
    store.fsck(repair=True)
    assert not wrong.exists()
    assert (env.store_root / "quarantine" / c).read_bytes() == data


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

"""Recycle: files leave the warehouse and come back, byte for byte, by (path, checksum).

Round trip of a partitioned table, rubber-banding (a partition dropped and re-added with new
bytes at the same paths), copy mode, deduplication and expiry extension, confinement of
`cmroot` status to the recorded path, the collision guard, event and entry contents, and
several threads recycling overlapping content while a sweep runs."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
from cmroot_testlib import (
    assert_objects_match_names,
    assert_retrievable,
    index_counts,
    make_table,
    object_files,
    pairs_of,
    snapshot,
    table_dir,
    write_file,
)

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, Conflict, NotFound, OutsideRoots
from cmroot.store import RecycleRequest, Store

PARTS = (
    {"dt": "2024-01-01", "region": "eu"},
    {"dt": "2024-01-01", "region": "us"},
    {"dt": "2024-01-02", "region": "eu"},
)


def test_round_trip_of_a_partitioned_table(env, store: Store, clock) -> None:
    files = make_table(env.warehouse, "sales", "orders", PARTS, files_per_partition=4)
    tdir = table_dir(env.warehouse, "sales", "orders")
    res = store.recycle(
        RecycleRequest(
            paths=[str(tdir)],
            mode="move",
            op="DROP_TABLE",
            db="sales",
            table="orders",
            partitions=[dict(p) for p in PARTS],
        )
    )

    # the result names every file with its checksum and size
    assert res.event_id > 0
    assert {f.path: (f.checksum, f.size) for f in res.files} == {
        p: (cks.of_bytes(b), len(b)) for p, b in files.items()
    }
    # move: nothing left at the source, no directory behind; the warehouse root stays
    assert all(not os.path.lexists(p) for p in files)
    assert not tdir.exists()
    assert env.warehouse.is_dir()
    # every file comes back with identical bytes; resolve says cmroot
    assert_retrievable(store, files, status="cmroot")
    for r in store.resolve(pairs_of(files)):
        assert r.location == str(env.object_path(r.checksum))
        assert r.size == len(files[r.path])
    # the event: op, db, table, partitions, files
    [ev] = store.events()
    assert ev.id == res.event_id
    assert (ev.type, ev.db, ev.table) == ("DROP_TABLE", "sales", "orders")
    assert ev.partitions == [dict(p) for p in PARTS]
    assert ev.timestamp == clock()
    assert {f["path"]: f["checksum"] for f in ev.files} == {
        p: cks.of_bytes(b) for p, b in files.items()
    }
    # entries carry each file's own partition values
    entries = store.entries(limit=1000)
    assert len(entries) == len(files)
    for e in entries:
        part = dict(seg.split("=", 1) for seg in Path(e.path).parent.relative_to(tdir).parts)
        assert e.partition == part
        assert (e.op, e.db, e.table, e.purge, e.event_id) == (
            "DROP_TABLE",
            "sales",
            "orders",
            False,
            res.event_id,
        )
        assert e.recycled == clock() and e.expires == clock() + 24 * 3600
        assert e.size == len(files[e.path]) and e.checksum == cks.of_bytes(files[e.path])
    # one sharded object per distinct content, nothing left in staging, fsck clean
    assert len(object_files(env)) == len({cks.of_bytes(b) for b in files.values()})
    assert_objects_match_names(env)
    assert os.listdir(env.staging_dir) == []
    assert store.fsck().clean


def test_dropping_one_partition_leaves_the_table(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", PARTS[:2], files_per_partition=3)
    tdir = table_dir(env.warehouse, "db", "t")
    pdir = tdir / "dt=2024-01-01" / "region=eu"
    dropped = {p: b for p, b in files.items() if p.startswith(str(pdir) + "/")}
    kept = {p: b for p, b in files.items() if p not in dropped}
    store.recycle(
        RecycleRequest(
            paths=[str(pdir)],
            op="DROP_PARTITION",
            db="db",
            table="t",
            partitions=[{"dt": "2024-01-01", "region": "eu"}],
        )
    )
    assert not pdir.exists()
    assert (tdir / "dt=2024-01-01").is_dir()  # only the named directory goes
    assert_retrievable(store, dropped, status="cmroot")
    assert_retrievable(store, kept, status="original")
    assert {e.partition["region"] for e in store.entries()} == {"eu"}


def test_recycling_the_warehouse_root_is_refused_whole(env, store: Store) -> None:
    """Invariant 5: a root (and any directory containing one) is never recycled."""
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=3)
    before = snapshot(env)
    with pytest.raises(OutsideRoots.__mro__[1]) as ei:  # Forbidden: 403
        store.recycle(RecycleRequest(paths=[str(env.warehouse)], op="DROP_TABLE"))
    assert ei.value.status == 403 and "root" in str(ei.value)
    assert snapshot(env) == before
    assert {p: Path(p).read_bytes() for p in files} == files


def test_single_files_file_urls_and_overlapping_paths(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    one, *_ = files
    pdir = Path(one).parent
    # a file named twice (once as a URL) and its directory: each file is recycled once
    res = store.recycle(RecycleRequest(paths=[f"file://{one}", one, str(pdir)], op="DELETE"))
    assert sorted(f.path for f in res.files) == sorted(files)
    assert len(store.entries()) == 3
    assert_retrievable(store, files, status="cmroot")
    # the recorded spelling is the canonical one, so either spelling resolves
    assert (
        store.resolve([{"path": f"file://{one}", "checksum": cks.of_bytes(files[one])}])[0].status
        == "cmroot"
    )


def test_empty_subdirectories_go_too(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    tdir = table_dir(env.warehouse, "db", "t")
    (tdir / "_tmp" / "nested").mkdir(parents=True)
    store.recycle(RecycleRequest(paths=[str(tdir)], op="DROP_TABLE"))
    assert not tdir.exists()
    assert_retrievable(store, files, status="cmroot")


def test_rubber_banding_partition_dropped_and_re_added(env, store: Store, clock) -> None:
    """Event 1 adds p=1, event 2 drops it, event 3 re-adds p=1 with new bytes at the same
    paths. Replaying event 1 later must still get the *old* bytes."""
    old = make_table(
        env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=5, rng=random.Random(1)
    )
    store.add_event(
        "ADD_PARTITION",
        "db",
        "t",
        [{"p": "1"}],
        [{"path": p, "checksum": cks.of_bytes(b), "size": len(b)} for p, b in old.items()],
    )
    pdir = table_dir(env.warehouse, "db", "t") / "p=1"
    clock.advance(60)
    store.recycle(
        RecycleRequest(
            paths=[str(pdir)], op="DROP_PARTITION", db="db", table="t", partitions=[{"p": "1"}]
        )
    )
    clock.advance(60)
    new = make_table(
        env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=5, rng=random.Random(2)
    )
    assert set(new) == set(old)  # the same paths ...
    assert all(new[p] != old[p] for p in old)  # ... with different bytes

    res = {(r.path, r.checksum): r for r in store.resolve(pairs_of(old) + pairs_of(new))}
    for p in old:
        r_old = res[(p, cks.of_bytes(old[p]))]
        r_new = res[(p, cks.of_bytes(new[p]))]
        assert r_old.status == "cmroot"
        assert r_new.status == "original" and r_new.location == p
        with open(r_old.location, "rb") as f:
            assert f.read() == old[p]
    assert_retrievable(store, old, status="cmroot")
    assert_retrievable(store, new, status="original")

    # dropping p=1 again keeps both generations apart
    store.recycle(RecycleRequest(paths=[str(pdir)], op="DROP_PARTITION", db="db", table="t"))
    assert_retrievable(store, old, status="cmroot")
    assert_retrievable(store, new, status="cmroot")
    assert [e.type for e in store.events()] == ["ADD_PARTITION", "DROP_PARTITION", "DROP_PARTITION"]


def test_copy_mode_dedupe_expiry_extension_and_path_confinement(env, store: Store, clock) -> None:
    data = os.urandom(10_000)
    a = str(write_file(env.warehouse / "db.db" / "a" / "f1", data))
    b = str(write_file(env.warehouse / "db.db" / "b" / "f1", data))
    c = cks.of_bytes(data)

    store.recycle(RecycleRequest(paths=[a], mode="copy", op="INSERT_OVERWRITE", db="db", table="a"))
    assert Path(a).read_bytes() == data  # copy leaves the source intact
    first_expiry = store.index.get_object(c).expires
    assert first_expiry == clock() + 24 * 3600

    clock.advance(3600)
    store.recycle(RecycleRequest(paths=[b], mode="move", op="DROP_TABLE", db="db", table="b"))
    assert not os.path.exists(b)
    # one object, two entries, the later recycle pushed the expiry
    assert len(object_files(env)) == 1
    assert sorted(e.path for e in store.entries()) == sorted([a, b])
    assert store.index.get_object(c).expires == first_expiry + 3600
    assert Path(object_files(env)[0]).read_bytes() == data

    # the original of a still holds the bytes; b comes from the store
    assert store.resolve([{"path": a, "checksum": c}])[0].status == "original"
    assert store.resolve([{"path": b, "checksum": c}])[0].status == "cmroot"
    os.unlink(a)
    assert store.resolve([{"path": a, "checksum": c}])[0].status == "cmroot"

    # an unrelated path with the same bytes is not "cmroot": no entry records that path
    other = str(env.warehouse / "db.db" / "other" / "f1")
    assert store.resolve([{"path": other, "checksum": c}])[0].status == "missing"
    with pytest.raises(NotFound):
        store.open_verified(other, c)
    # nor is the recorded path with another checksum
    wrong = cks.of_bytes(b"something else")
    assert store.resolve([{"path": b, "checksum": wrong}])[0].status == "missing"


def test_copy_mode_of_a_directory_keeps_everything(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", PARTS[:2], files_per_partition=3)
    before = {p: Path(p).read_bytes() for p in files}
    store.recycle(
        RecycleRequest(
            paths=[str(table_dir(env.warehouse, "db", "t"))],
            mode="copy",
            op="ALTER_LOCATION",
            db="db",
            table="t",
        )
    )
    assert {p: Path(p).read_bytes() for p in files} == before
    assert len(store.entries(limit=100)) == len(files)
    for p in files:
        os.unlink(p)
    assert_retrievable(store, files, status="cmroot")


def test_same_bytes_twice_in_one_request(env, store: Store) -> None:
    data = b"duplicate content" * 100
    files = make_table(
        env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=3, contents=[data]
    )
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))], op="TRUNCATE"))
    assert len(object_files(env)) == 1
    assert index_counts(env)["entries"] == 6 and index_counts(env)["objects"] == 1
    assert_retrievable(store, files, status="cmroot")


def test_purge_is_recorded_and_never_skips_the_store(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=2)
    store.recycle(RecycleRequest(paths=list(files), op="DROP_TABLE", purge=True))
    assert all(e.purge for e in store.entries())
    assert store.events()[0].purge is True
    assert_retrievable(store, files, status="cmroot")


def test_partition_attribution(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=1)
    f1 = next(p for p in files if "/p=1/" in p)
    f2 = next(p for p in files if "/p=2/" in p)
    # one partition given: every file is attributed to it
    store.recycle(RecycleRequest(paths=[f1], op="DROP_PARTITION", partitions=[{"p": "1"}]))
    # several given, none matching the path: no attribution rather than a wrong one
    store.recycle(
        RecycleRequest(paths=[f2], op="DROP_PARTITION", partitions=[{"p": "7"}, {"p": "8"}])
    )
    by_path = {e.path: e.partition for e in store.entries()}
    assert by_path == {f1: {"p": "1"}, f2: None}


def test_collision_guard_never_merges_different_bytes(env, store: Store, monkeypatch) -> None:
    """Different bytes that really hash to a checksum already filed (a hash collision) make
    the recycle fail whole; nothing is merged and the source stays. No collision of xxh3-128
    is known, so the squatter is made to hash right by replacing the hash of stored files."""
    import cmroot.store.layout.local as local_layout

    data = b"the real bytes" * 50
    src = str(write_file(env.warehouse / "db.db" / "t" / "f", data))
    other = str(write_file(env.warehouse / "db.db" / "t" / "g", b"other file"))
    c = cks.of_bytes(data)
    squatter = env.object_path(c)
    write_file(squatter, b"not the real bytes")
    real = cks.of_local_file
    monkeypatch.setattr(
        local_layout.cks, "of_local_file",
        lambda p, *a, **kw: c if str(p) == str(squatter) else real(p, *a, **kw),
    )
    with pytest.raises(Conflict) as ei:
        store.recycle(RecycleRequest(paths=[src, other], op="DELETE"))
    assert "collision" in str(ei.value)
    assert Path(src).read_bytes() == data and Path(other).read_bytes() == b"other file"
    assert squatter.read_bytes() == b"not the real bytes"
    assert index_counts(env)["entries"] == 0 and index_counts(env)["events"] == 0
    assert os.listdir(env.staging_dir) == []


def test_a_corrupt_object_is_healed_by_the_next_recycle_of_its_content(env, store) -> None:
    """An object whose bytes no longer hash to its name (rot, a straggler writer) used to
    make every later recycle of that content fail with 409: the staged bytes are good, so
    they replace it; the bad bytes go to quarantine."""
    data = b"the real bytes" * 50
    first = str(write_file(env.warehouse / "db.db" / "t" / "f", data))
    store.recycle(RecycleRequest(paths=[first], op="DELETE"))
    c = cks.of_bytes(data)
    obj = env.object_path(c)
    obj.write_bytes(b"rotten" * 100)
    again = str(write_file(env.warehouse / "db.db" / "u" / "f", data))
    store.recycle(RecycleRequest(paths=[again], op="DELETE"))
    assert cks.of_local_file(str(obj)) == c
    assert_retrievable(store, {first: data, again: data}, status="cmroot")
    [bad] = (env.store_root / "quarantine").iterdir()
    assert bad.read_bytes() == b"rotten" * 100
    # Named by the store's clock (the one retention runs on), not the host's.
    assert bad.name == f"{c}.{int(env.clock())}"


def test_recycle_progress_reports_every_file(env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=7)
    seen: list[tuple[int, int]] = []
    store.recycle(
        RecycleRequest(paths=list(files), op="DELETE"), progress=lambda d, n: seen.append((d, n))
    )
    assert sorted(seen) == [(i, 7) for i in range(1, 8)]


# -- non-destructive events ---------------------------------------------------------------------


def test_add_event_records_files_and_validates(env, store: Store) -> None:
    p = str(env.warehouse / "db.db" / "t" / "f")
    c = cks.of_bytes(b"x")
    eid = store.add_event(
        "INSERT", "db", "t", [{"p": "1"}], [{"path": f"file://{p}", "checksum": c, "size": 1}]
    )
    [ev] = store.events(eid)
    assert ev.type == "INSERT" and ev.files == [{"path": p, "checksum": c, "size": 1}]
    assert ev.to_json()["eventType"] == "INSERT"
    with pytest.raises(BadRequest, match="eventType"):
        store.add_event("TRUNCATE", "db", "t")  # destructive ops go through recycle
    with pytest.raises(BadRequest, match="/v1/recycle"):
        store.add_event("DROP_TABLE", "db", "t", files=[{"path": p, "checksum": c, "size": 1}])
    with pytest.raises(BadRequest, match="checksum"):
        store.add_event("INSERT", files=[{"path": p, "checksum": "XYZ", "size": 1}])
    with pytest.raises(OutsideRoots):
        store.add_event(
            "INSERT", files=[{"path": str(env.outside / "f"), "checksum": c, "size": 1}]
        )
    with pytest.raises(BadRequest, match="partitions"):
        store.add_event("ADD_PARTITION", "db", "t", partitions=[{"p": 1}])  # type: ignore[dict-item]
    assert [e.id for e in store.events()] == [eid]


# -- concurrency --------------------------------------------------------------------------------


def test_concurrent_recycles_with_a_sweep_lose_nothing_and_dedupe(env, clock) -> None:
    """Four threads recycle tables made of the same 24 blobs at different paths into one
    store while another thread sweeps. The blobs were already in the store from a table
    whose short retention has run out, so the sweep races every deduplication."""
    store = env.open(CMROOT_STORE_RETAIN_OVERRIDES="tmp.*=1h")
    rng = random.Random(7)
    blobs = [rng.randbytes(rng.randint(1, 3000)) for _ in range(24)]
    old = make_table(env.warehouse, "tmp", "old", [{}], files_per_partition=24, contents=blobs)
    store.recycle(
        RecycleRequest(
            paths=[str(table_dir(env.warehouse, "tmp", "old"))],
            op="DROP_TABLE",
            db="tmp",
            table="old",
        )
    )
    assert len(object_files(env)) == 24
    clock.advance(2 * 3600)  # every old object has expired; a sweep would remove it

    tables: dict[int, list[tuple[str, dict[str, bytes]]]] = {}
    for k in range(4):
        tables[k] = []
        for j in range(5):
            shuffled = blobs[:]
            random.Random(k * 100 + j).shuffle(shuffled)
            files = make_table(
                env.warehouse,
                f"db{k}",
                f"t{j}",
                [{"p": "a"}, {"p": "b"}],
                files_per_partition=6,
                contents=shuffled,
            )
            tables[k].append((str(table_dir(env.warehouse, f"db{k}", f"t{j}")), files))

    errors: list[BaseException] = []
    done = threading.Event()
    sweeps = []

    def recycler(k: int) -> None:
        try:
            for j, (tdir, _) in enumerate(tables[k]):
                store.recycle(
                    RecycleRequest(paths=[tdir], op="DROP_TABLE", db=f"db{k}", table=f"t{j}")
                )
        except BaseException as e:
            errors.append(e)

    def sweeper() -> None:
        try:
            while not done.is_set():
                sweeps.append(store.gc())
            sweeps.append(store.gc())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=recycler, args=(k,)) for k in range(4)]
    gc_thread = threading.Thread(target=sweeper)
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    gc_thread.join(120)
    assert errors == []
    assert all(not s.failed for s in sweeps)

    # no loss: every file of every table comes back with its bytes
    recycled = {p: b for k in tables for _, files in tables[k] for p, b in files.items()}
    assert len(recycled) == 4 * 5 * 12
    assert_retrievable(store, recycled, status="cmroot")
    # dedupe: one object per distinct content, on disk and in the index
    assert len(object_files(env)) == 24
    assert index_counts(env)["objects"] == 24
    assert index_counts(env)["entries"] >= len(recycled)
    assert_objects_match_names(env)
    assert store.fsck().clean
    assert os.listdir(env.staging_dir) == []
    # the old table's entries are gone with the sweep or still backed by an object
    for r in store.resolve(pairs_of(old)):
        assert r.status in ("cmroot", "missing")

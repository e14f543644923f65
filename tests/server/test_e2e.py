"""End to end against the real daemon: record a CREATE_TABLE, drop the table through the
API, resolve a 10,000-pair batch, download whole, by Range and by HEAD, page the entries,
read the event log in order, and sweep (dry run, then for real) what has expired."""

from __future__ import annotations

import io
import os
import random
import time
from pathlib import Path

import pytest
from cmroot_testlib import object_file

from cmroot import checksum as cks
from cmroot.exceptions import NotFound
from tests.server.cmroot_daemon import Daemon, MakeDaemon, assert_error, tree, write_files

pytestmark = pytest.mark.timeout(120)

BIG = 3 * (1 << 20) + 12345  # several sendfile chunks, not a multiple of anything


def _table(
    d: Daemon, db: str, table: str, parts: int, per_part: int, rng: random.Random
) -> dict[str, bytes]:
    rel = {
        f"{db}.db/{table}/p={p}/part-{i:05d}.parquet": rng.randbytes(rng.randint(1, 2000))
        for p in range(parts)
        for i in range(per_part)
    }
    return write_files(d.warehouse, rel)


def _object_path(d: Daemon, checksum: str) -> str:
    return str(object_file(d.store, checksum))


@pytest.fixture
def lake(make_daemon: MakeDaemon) -> Daemon:
    # Everything of db "tmp" expires after 2s; the rest keeps the 24h default.
    return make_daemon(env={"CMROOT_STORE_RETAIN_OVERRIDES": "tmp.*=2s"})


def test_end_to_end(lake: Daemon) -> None:
    d = lake
    rng = random.Random(20240601)
    c = d.client("admin")
    orders = _table(d, "sales", "orders", parts=2, per_part=300, rng=rng)
    big_path = str(d.warehouse / "sales.db/orders/p=0/part-big.parquet")
    orders.update(
        write_files(d.warehouse, {"sales.db/orders/p=0/part-big.parquet": rng.randbytes(BIG)})
    )
    kept = _table(d, "sales", "kept", parts=2, per_part=300, rng=rng)
    scratch = _table(d, "tmp", "scratch", parts=1, per_part=5, rng=rng)
    sums = {p: cks.of_bytes(b) for p, b in {**orders, **kept, **scratch}.items()}
    assert len(set(sums.values())) == len(sums), "the test wants distinct contents"

    # -- a non-destructive event: recorded, nothing moves ---------------------------------
    before = tree(d.warehouse)
    create_id = c.add_event(
        "CREATE_TABLE",
        db="sales",
        table="orders",
        partitions=[{"p": "0"}, {"p": "1"}],
        files=[{"path": p, "checksum": sums[p], "size": len(b)} for p, b in orders.items()],
    )
    assert create_id >= 1
    assert tree(d.warehouse) == before

    # -- drop the table through the API ---------------------------------------------------
    table_dir = d.warehouse / "sales.db" / "orders"
    res = c.recycle(
        [str(table_dir)],
        op="DROP_TABLE",
        db="sales",
        table="orders",
        partitions=[{"p": "0"}, {"p": "1"}],
    )
    drop_id = res["event_id"]
    assert drop_id > create_id
    assert {f["path"]: (f["checksum"], f["size"]) for f in res["files"]} == {
        p: (sums[p], len(b)) for p, b in orders.items()
    }
    assert not table_dir.exists(), "a moved directory leaves nothing behind"
    assert d.warehouse.is_dir() and (d.warehouse / "sales.db" / "kept").is_dir()
    for p in orders:
        assert Path(_object_path(d, sums[p])).read_bytes() == orders[p]

    res = c.recycle([str(d.warehouse / "tmp.db/scratch")], op="TRUNCATE", db="tmp", table="scratch")
    scratch_id = res["event_id"]
    scratch_recycled = time.monotonic()
    assert scratch_id > drop_id
    assert len(res["files"]) == len(scratch)

    # -- resolve 10,000 pairs: original, cmroot, missing ----------------------------------
    recycled_paths, kept_paths = list(orders), list(kept)
    pairs: list[tuple[dict[str, str], str]] = []
    pairs += [({"path": p, "checksum": sums[p]}, "cmroot") for p in recycled_paths]
    pairs += [({"path": p, "checksum": sums[p]}, "original") for p in kept_paths]
    while len(pairs) < 10_000:
        kind = rng.randrange(5)
        if kind == 0:  # a recycled path, other bytes
            pairs.append(
                (
                    {"path": rng.choice(recycled_paths), "checksum": rng.randbytes(16).hex()},
                    "missing",
                )
            )
        elif kind == 1:  # an original path, someone else's checksum
            pairs.append(
                (
                    {"path": rng.choice(kept_paths), "checksum": sums[rng.choice(recycled_paths)]},
                    "missing",
                )
            )
        elif kind == 2:  # never existed
            pairs.append(
                (
                    {
                        "path": str(d.warehouse / f"ghost.db/t/f{rng.random()}"),
                        "checksum": rng.randbytes(16).hex(),
                    },
                    "missing",
                )
            )
        elif kind == 3:  # an object's bytes asked for under an unrelated path
            pairs.append(
                (
                    {
                        "path": str(d.warehouse / "sales.db/other/part-0.parquet"),
                        "checksum": sums[rng.choice(recycled_paths)],
                    },
                    "missing",
                )
            )
        else:  # repeats are answered like the first time
            pairs.append(rng.choice(pairs[: len(recycled_paths) + len(kept_paths)]))
    rng.shuffle(pairs)
    out = c.resolve([p for p, _ in pairs])["files"]
    assert len(out) == 10_000
    for (pair, status), got in zip(pairs, out, strict=True):
        assert (got["path"], got["checksum"]) == (pair["path"], pair["checksum"])
        assert got["status"] == status, (pair, got)
        if status == "cmroot":
            assert got["location"] == _object_path(d, pair["checksum"])
            assert got["size"] == len(orders[pair["path"]])
        elif status == "original":
            assert got["location"] == pair["path"] and got["size"] == len(kept[pair["path"]])
        else:
            assert got["location"] is None

    # -- download: whole, by Range, HEAD --------------------------------------------------
    for p in [big_path, *rng.sample(recycled_paths, 40)]:
        buf = io.BytesIO()
        assert c.get(p, sums[p], buf) == len(orders[p])
        assert buf.getvalue() == orders[p]
    for p in rng.sample(kept_paths, 10):
        r = d.request("GET", d.files_url(p, sums[p]), scope="read")
        assert r.status == 200 and r.body == kept[p]
        assert r.headers["X-Cmroot-Status"] == "original"

    data, size, url = orders[big_path], len(orders[big_path]), d.files_url(big_path, sums[big_path])
    r = d.request("GET", url, scope="read")
    assert r.status == 200 and r.body == data
    assert r.headers["ETag"] == f'"{sums[big_path]}"'
    assert r.headers["X-Cmroot-Status"] == "cmroot"
    assert int(r.headers["Content-Length"]) == size
    for header, first, last in [
        ("bytes=0-0", 0, 0),
        ("bytes=0-99", 0, 99),
        ("bytes=1048570-2097160", 1048570, 2097160),
        (f"bytes={size - 10}-", size - 10, size - 1),
        ("bytes=-4096", size - 4096, size - 1),
        (f"bytes=5-{size + 1000}", 5, size - 1),
    ]:
        r = d.request("GET", url, headers={"Range": header}, scope="read")
        assert r.status == 206, (header, r)
        assert r.headers["Content-Range"] == f"bytes {first}-{last}/{size}", header
        assert r.body == data[first : last + 1], header
        assert int(r.headers["Content-Length"]) == last - first + 1
    with c.open(big_path, sums[big_path], byte_range=(10, 20)) as resp:
        assert resp.status == 206 and resp.read() == data[10:21]
    r = d.request("HEAD", url, scope="read")
    assert r.status == 200 and r.body == b""
    assert int(r.headers["Content-Length"]) == size
    assert r.headers["ETag"] == f'"{sums[big_path]}"'
    small = recycled_paths[0]
    r = d.request("HEAD", d.files_url(small, sums[small]), scope="read")
    assert (
        r.status == 200 and r.body == b"" and int(r.headers["Content-Length"]) == len(orders[small])
    )

    # -- neither here nor in the store: 404 JSON ------------------------------------------
    for path, checksum in [
        (str(d.warehouse / "sales.db/orders/p=0/part-00000.parquet"), rng.randbytes(16).hex()),
        (kept_paths[0], sums[kept_paths[1]]),
        (str(d.warehouse / "nowhere/f"), sums[recycled_paths[0]]),
    ]:
        assert_error(d.request("GET", d.files_url(path, checksum), scope="read"), 404, checksum)
        with pytest.raises(NotFound):
            c.get(path, checksum, io.BytesIO())

    # -- entries, newest first, paged -----------------------------------------------------
    seen: list[dict[str, object]] = []
    cursor = None
    while True:
        page = c.entries(db="sales", table="orders", limit=250, cursor=cursor)
        seen += page["entries"]
        cursor = page["cursor"]
        if cursor is None:
            break
    assert len(seen) == len(orders)
    ids = [e["id"] for e in seen]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == len(ids)
    assert {e["path"] for e in seen} == set(orders)
    for e in seen:
        assert e["op"] == "DROP_TABLE" and e["event_id"] == drop_id
        assert e["partition"] == {"p": e["path"].split("/p=")[1][0]}

    # -- the event log, in order ----------------------------------------------------------
    events = c.events(0, 1000)
    assert [e["id"] for e in events] == [create_id, drop_id, scratch_id]
    assert [e["eventType"] for e in events] == ["CREATE_TABLE", "DROP_TABLE", "TRUNCATE"]
    assert [e["timestamp"] for e in events] == sorted(e["timestamp"] for e in events)
    assert {f["path"]: f["checksum"] for f in events[0]["files"]} == {p: sums[p] for p in orders}
    assert {f["path"]: f["checksum"] for f in events[1]["files"]} == {p: sums[p] for p in orders}
    assert (events[1]["db"], events[1]["table"]) == ("sales", "orders")
    assert events[1]["partitions"] == [{"p": "0"}, {"p": "1"}]
    assert c.current_event() == scratch_id
    assert [e["id"] for e in c.events(drop_id, 1)] == [drop_id]
    assert c.events(scratch_id + 1) == []

    # -- retention: only tmp.* has expired; dry run first, then for real ------------------
    time.sleep(max(0.0, 2.2 - (time.monotonic() - scratch_recycled)))
    objects_before = tree(d.store / "objects")
    dry = c.gc(dry_run=True)
    assert dry["dry_run"] is True
    assert {o["checksum"] for o in dry["removed"]} == {sums[p] for p in scratch}
    assert tree(d.store / "objects") == objects_before, "a dry run removes nothing"
    assert {
        f["status"] for f in c.resolve([{"path": p, "checksum": sums[p]} for p in scratch])["files"]
    } == {"cmroot"}

    real = c.gc()
    assert real["dry_run"] is False and not real["failed"]
    assert {o["checksum"] for o in real["removed"]} == {sums[p] for p in scratch}
    assert real["removed_bytes"] == sum(len(b) for b in scratch.values())
    for p in scratch:
        assert not os.path.exists(_object_path(d, sums[p]))
        assert_error(d.request("GET", d.files_url(p, sums[p]), scope="read"), 404)
    assert {
        f["status"] for f in c.resolve([{"path": p, "checksum": sums[p]} for p in scratch])["files"]
    } == {"missing"}
    still = c.resolve([{"path": p, "checksum": sums[p]} for p in orders])["files"]
    assert {f["status"] for f in still} == {"cmroot"}
    assert c.gc()["removed"] == [], "a second sweep finds nothing more"

    assert d.errors() == [], d.log()


def test_copy_mode_keeps_source_and_purge_is_recorded(lake: Daemon) -> None:
    d = lake
    files = write_files(d.warehouse, {"db.db/t/a": b"alpha" * 100, "db.db/t/b": b"beta" * 100})
    c = d.client("write")
    res = c.recycle(list(files), mode="copy", purge=True, op="INSERT_OVERWRITE", db="db", table="t")
    assert all(Path(p).read_bytes() == b for p, b in files.items()), "copy leaves the source"
    assert len(res["files"]) == 2
    out = c.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])["files"]
    assert [f["status"] for f in out] == ["original", "original"]
    for p, b in files.items():  # overwrite the originals: the recycled bytes stay served
        Path(p).write_bytes(b"new " + b)
    out = c.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])["files"]
    assert [f["status"] for f in out] == ["cmroot", "cmroot"]
    for p, b in files.items():
        buf = io.BytesIO()
        c.get(p, cks.of_bytes(b), buf)
        assert buf.getvalue() == b
    entries = c.entries(db="db", table="t")["entries"]
    assert {e["purge"] for e in entries} == {True}
    assert {e["op"] for e in entries} == {"INSERT_OVERWRITE"}


def test_corrupt_object_is_never_served(lake: Daemon) -> None:
    """Invariant 3: an object whose bytes changed on disk is refused and counted, even
    after it was served (and verified) before."""
    d = lake
    files = write_files(d.warehouse, {"db.db/t/f": b"x" * 5000})
    [(path, data)] = files.items()
    c = d.client("admin")
    c.recycle([path], op="DELETE")
    checksum = cks.of_bytes(data)
    url = d.files_url(path, checksum)
    for _ in range(3):
        assert d.request("GET", url, scope="read").body == data
        r = d.request("GET", url, headers={"Range": "bytes=10-19"}, scope="read")
        assert r.status == 206 and r.body == data[10:20]
    obj = Path(_object_path(d, checksum))
    obj.chmod(0o644)
    obj.write_bytes(b"y" * 5000)  # same size, other bytes
    for headers in ({}, {"Range": "bytes=10-19"}):
        r = d.request("GET", url, headers=headers, scope="read")
        assert r.status == 404 and b"y" * 10 not in r.body, r  # never a 5xx
        assert "corrupt" in r.json()["error"] and "fsck" in r.json()["detail"]
    # found once, then quarantined out of the serving path: counted once
    assert "cmroot_checksum_mismatches_total 1.0" in d.metrics()
    assert not obj.exists()
    assert [q.name.split(".")[0] for q in (d.store / "quarantine").iterdir()] == [checksum]

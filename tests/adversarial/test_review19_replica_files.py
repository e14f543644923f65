"""Review 19: the replica's files after b70ca31 (a drop removes what the source's drop
removed, a move makes only its new place exact and leaves the old one) and the hook's
reading of partition locations spelt as Hadoop paths or URIs (`existingLocalPath`).

Invariants: after every load the replica equals the source as of the dump's last event
(rows, partitions, and the data files of the places it reads); a stale file the replica
keeps must never become visible; a drop on the source never leaves the replica showing
rows the source no longer shows; the hook's events name the directories that exist, and
every file a drop removed is recycled."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cmroot.repl import dumpdir
from tests.repl.conftest import Destination, Source, files_below, load_ok

pytestmark = pytest.mark.timeout(900)


def _events(src: Source, start: int, db: str) -> list[dict[str, Any]]:
    return [e for e in src.daemon.client.events(start, 1000)
            if str(e.get("db") or "").lower() == db]


def _lit(v: str) -> str:
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


# -- drops -----------------------------------------------------------------------------------


def test_dropping_a_managed_table_takes_another_tables_partition_nested_in_it(
    source: Source, destination: Destination
) -> None:
    """Source: managed r19a.t (default place, a row); managed r19a.m whose p=1 lies at
    t's directory's `zz` (inside t's directory), a row. Load. The source drops t
    (managed: Hive deletes t's directory recursively, m's p=1 files with it, recycled in
    the drop). Load. Expected: the replica's m shows what the source's m shows (no row
    left): a drop on the source never leaves the replica showing rows the source no
    longer shows (`_drop_table` only drops the replica's catalog entry; m's p=1 lives
    at `_external/...` on the replica, not inside t's replica directory)."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE r19a")
    source.sql("CREATE TABLE r19a.t (a INT) USING parquet")
    source.sql("INSERT INTO r19a.t VALUES (1)")
    tdir = source.table_dir("t", "r19a")
    source.sql("CREATE TABLE r19a.m (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql(f"ALTER TABLE r19a.m ADD PARTITION (p=1) LOCATION '{tdir}/zz'")
    source.sql("INSERT INTO r19a.m PARTITION (p=1) VALUES (2)")
    then = source.rows("SELECT * FROM r19a.m")
    inc1, h1 = source.dump("r19a", from_id=start)
    source.sql("DROP TABLE r19a.t")
    source.sql("REFRESH TABLE r19a.m")
    now = source.rows("SELECT * FROM r19a.m")
    inc2, _ = source.dump("r19a", from_id=h1.last_event_id)
    q = {"m": "SELECT * FROM r19a.m"}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r19a.m"], "queries": q},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"]["m"] == then == [[2, 1]]
    assert not (tdir / "zz").exists() or not files_below(tdir / "zz")
    assert after["rows"]["m"] == now, (after["rows"]["m"], now)


def test_an_external_partition_readded_after_its_table_moved_shows_no_stale_rows(
    source: Source, destination: Destination
) -> None:
    """Source: external r19b.t at own/t, p=1 (row 1). Load. The source moves the table to
    own/t2 (partitions keep their places), drops p=1 (external: own/t/p=1 keeps its
    file) and writes p=1 again (now at own/t2/p=1, row 2 only). Load. Expected: the
    replica shows [2, 1] only, as the source. (The replica kept its table at its old
    mapped place, so the new p=1's default place there is the old one, which still holds
    the row-1 file the external drop left: re-added at a place holding stale files.)"""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r19b"
    source.sql("CREATE DATABASE r19b")
    source.sql("CREATE TABLE r19b.t (a INT, p INT) USING parquet PARTITIONED BY (p)"
               f" LOCATION '{own}/t'")
    source.sql("INSERT INTO r19b.t PARTITION (p=1) VALUES (1)")
    then = source.rows("SELECT * FROM r19b.t")
    inc1, h1 = source.dump("r19b", from_id=start)
    source.sql(f"ALTER TABLE r19b.t SET LOCATION '{own}/t2'")
    source.sql("ALTER TABLE r19b.t DROP PARTITION (p=1)")
    source.sql("INSERT INTO r19b.t PARTITION (p=1) VALUES (2)")
    source.sql("REFRESH TABLE r19b.t")
    now = source.rows("SELECT * FROM r19b.t")
    parts = source.partitions("r19b.t")
    inc2, _ = source.dump("r19b", from_id=h1.last_event_id)
    q = {"t": "SELECT * FROM r19b.t"}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r19b.t"], "queries": q, "partitions": ["r19b.t"]},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"]["t"] == then
    assert now == [[2, 1]], now
    assert after["partitions"]["r19b.t"] == parts
    assert after["rows"]["t"] == now, (after["rows"]["t"], now)


def test_an_external_table_moved_away_and_a_table_created_at_its_old_place(
    source: Source, destination: Destination
) -> None:
    """Source: external r19c.e at own/e (row 1); external r19c.x at own/e2 (row 2), then
    x dropped (its file stays). Load. The source moves e to own/e2 (e now shows 2), then
    creates external r19c.g at own/e, which still holds e's old file (g shows 1), and
    then drops e and creates it again at own/e2 (shows 2). Load. Expected: replica e
    shows [2], g shows [1], as the source. (The replica keeps a moved table at its old
    mapped place: a table later created at the source's old place maps to that same
    replica directory.)"""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r19c"
    source.sql("CREATE DATABASE r19c")
    source.sql(f"CREATE TABLE r19c.e (a INT) USING parquet LOCATION '{own}/e'")
    source.sql("INSERT INTO r19c.e VALUES (1)")
    source.sql(f"CREATE TABLE r19c.x (a INT) USING parquet LOCATION '{own}/e2'")
    source.sql("INSERT INTO r19c.x VALUES (2)")
    source.sql("DROP TABLE r19c.x")
    inc1, h1 = source.dump("r19c", from_id=start)
    source.sql(f"ALTER TABLE r19c.e SET LOCATION '{own}/e2'")
    source.sql("REFRESH TABLE r19c.e")
    mid = source.rows("SELECT * FROM r19c.e")
    source.sql(f"CREATE TABLE r19c.g (a INT) USING parquet LOCATION '{own}/e'")
    source.sql("DROP TABLE r19c.e")
    source.sql(f"CREATE TABLE r19c.e (a INT) USING parquet LOCATION '{own}/e2'")
    now = {n: source.rows(f"SELECT * FROM r19c.{n}") for n in ("e", "g")}
    inc2, _ = source.dump("r19c", from_id=h1.last_event_id)
    q = {n: f"SELECT * FROM r19c.{n}" for n in ("e", "g")}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": {"e": q["e"]}},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r19c.e", "REFRESH TABLE r19c.g"], "queries": q},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"]["e"] == [[1]]
    assert mid == [[2]]
    assert now == {"e": [[2]], "g": [[1]]}, now
    assert after["rows"] == now, (after["rows"], now)


def test_an_external_partitioned_table_recreated_over_its_directory(
    source: Source, destination: Destination
) -> None:
    """Source: external r19d.e at own/e partitioned by p, p=1 (row 1); external r19d.f
    (not partitioned) at own/f (row 5). Load. The source drops e (files stay) and
    creates it again over own/e (a data source table created over existing data
    registers no partition until MSCK REPAIR), then drops database r19d CASCADE, creates
    it again and creates f again over own/f. Load. Expected: the replica's rows and
    partitions of e and f equal the source's after each load."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r19d"
    ddl_e = (f"CREATE TABLE r19d.e (a INT, p INT) USING parquet PARTITIONED BY (p)"
             f" LOCATION '{own}/e'")
    ddl_f = f"CREATE TABLE r19d.f (a INT) USING parquet LOCATION '{own}/f'"
    source.sql("CREATE DATABASE r19d")
    source.sql(ddl_e)
    source.sql("INSERT INTO r19d.e PARTITION (p=1) VALUES (1)")
    source.sql(ddl_f)
    source.sql("INSERT INTO r19d.f VALUES (5)")
    inc1, h1 = source.dump("r19d", from_id=start)
    source.sql("DROP TABLE r19d.e")
    source.sql(ddl_e)
    mid = source.rows("SELECT * FROM r19d.e")
    mid_parts = source.partitions("r19d.e")
    inc2, h2 = source.dump("r19d", from_id=h1.last_event_id)
    source.sql("DROP DATABASE r19d CASCADE")
    source.sql("CREATE DATABASE r19d")
    source.sql(ddl_f)
    now = source.rows("SELECT * FROM r19d.f")
    inc3, _ = source.dump("r19d", from_id=h2.last_event_id)
    first, second, third = destination.run(
        {"load": {"dump": inc1}, "queries": {"e": "SELECT * FROM r19d.e"}},
        {"load": {"dump": inc2}, "queries": {"e": "SELECT * FROM r19d.e"},
         "partitions": ["r19d.e"]},
        {"load": {"dump": inc3}, "queries": {"f": "SELECT * FROM r19d.f",
                                              "tables": "SHOW TABLES IN r19d"}},
    )
    for step in (first, second, third):
        load_ok(step)
    assert first["rows"]["e"] == [[1, 1]]
    assert second["partitions"]["r19d.e"] == mid_parts, (second["partitions"], mid_parts)
    assert second["rows"]["e"] == mid, (second["rows"]["e"], mid)
    assert now == [[5]]
    assert third["rows"]["f"] == now
    assert [r[1] for r in third["rows"]["tables"]] == ["f"]


# -- moves -----------------------------------------------------------------------------------


def test_overwrite_truncate_and_a_move_back_keep_the_replica_equal(
    source: Source, destination: Destination
) -> None:
    """Source: managed r19o.t (not partitioned, row 1 at its default place D); managed
    r19o.h partitioned, p=1 at D' default (row 1). Load. The source moves t to own/n and
    inserts row 2; INSERT OVERWRITE t (row 3); moves t back to D (D still holds the row-1
    file); then moves h's p=1 to own/h1, TRUNCATEs h, writes p=1 (row 4) and moves p=1
    back to its default place (which still holds row 1). Load. Expected: the replica's
    rows of t and h equal the source's."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r19o"
    source.sql("CREATE DATABASE r19o")
    source.sql("CREATE TABLE r19o.t (a INT) USING parquet")
    source.sql("INSERT INTO r19o.t VALUES (1)")
    source.sql("CREATE TABLE r19o.h (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r19o.h PARTITION (p=1) VALUES (1)")
    tdir = source.table_dir("t", "r19o")
    hdir = source.table_dir("h", "r19o")
    inc1, h1 = source.dump("r19o", from_id=start)
    source.sql(f"ALTER TABLE r19o.t SET LOCATION '{own}/n'")
    source.sql("INSERT INTO r19o.t VALUES (2)")
    source.sql("INSERT OVERWRITE TABLE r19o.t VALUES (3)")
    source.sql(f"ALTER TABLE r19o.t SET LOCATION '{tdir}'")
    source.sql(f"ALTER TABLE r19o.h PARTITION (p=1) SET LOCATION '{own}/h1'")
    source.sql("TRUNCATE TABLE r19o.h")
    source.sql("INSERT INTO r19o.h PARTITION (p=1) VALUES (4)")
    source.sql(f"ALTER TABLE r19o.h PARTITION (p=1) SET LOCATION '{hdir}/p=1'")
    for n in ("t", "h"):
        source.sql(f"REFRESH TABLE r19o.{n}")
    now = {n: source.rows(f"SELECT * FROM r19o.{n}") for n in ("t", "h")}
    inc2, _ = source.dump("r19o", from_id=h1.last_event_id)
    q = {n: f"SELECT * FROM r19o.{n}" for n in ("t", "h")}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r19o.t", "REFRESH TABLE r19o.h"], "queries": q},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"] == {"t": [[1]], "h": [[1, 1]]}
    assert after["rows"] == now, (after["rows"], now)


# -- the hook: partition values with special characters -------------------------------------


def test_a_partition_directory_named_as_another_values_decoded_name(
    source: Source, destination: Destination
) -> None:
    """Source: managed r19h.t partitioned by string s: s='q' added at LOCATION
    `<t>/s=x=y` (a directory named as value 'x=y''s escaped name `s=x%3Dy` reads once
    decoded), row 1; then s='x=y' added at its default place `<t>/s=x%3Dy` and written
    (row 2). Expected: the hook's ADD_PARTITION of s='x=y' names `<t>/s=x%3Dy` (the
    directory the metastore means), not `<t>/s=x=y` (q's); the replica's rows and
    partitions equal the source's."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE r19h")
    source.sql("CREATE TABLE r19h.t (a INT, s STRING) USING parquet PARTITIONED BY (s)")
    tdir = source.table_dir("t", "r19h")
    source.sql(f"ALTER TABLE r19h.t ADD PARTITION (s='q') LOCATION {_lit(str(tdir / 's=x=y'))}")
    source.sql("INSERT INTO r19h.t PARTITION (s='q') VALUES (1)")
    source.sql("ALTER TABLE r19h.t ADD PARTITION (s='x=y')")
    source.sql("INSERT INTO r19h.t PARTITION (s='x=y') VALUES (2)")
    source.sql("REFRESH TABLE r19h.t")
    now = source.rows("SELECT * FROM r19h.t")
    parts = source.partitions("r19h.t")
    adds = [(p, loc) for e in _events(source, start, "r19h")
            if e.get("eventType") == "ADD_PARTITION"
            for p, loc in zip(e.get("partitions") or [], e.get("partitionLocations") or [],
                              strict=False)]
    inc, _ = source.dump("r19h", from_id=start)
    q = {"t": "SELECT * FROM r19h.t"}
    first, after = destination.run(
        {"load": {"dump": inc}},
        {"sql": ["REFRESH TABLE r19h.t"], "queries": q, "partitions": ["r19h.t"]},
    )
    load_ok(first)
    assert now == [[1, "q"], [2, "x=y"]], now
    named = {p.get("s"): loc for p, loc in adds}
    assert named.get("x=y") == str(tdir / "s=x%3Dy"), adds
    assert after["partitions"]["r19h.t"] == parts
    assert after["rows"]["t"] == now, (after["rows"]["t"], now)


def test_special_values_through_msck_dynamic_inserts_renames_and_moves(
    source: Source, destination: Destination
) -> None:
    """Source: external r19j.e at own/e and managed r19j.m, both partitioned by string s.
    Dynamic inserts write values 'x=y', 'a/b', '50%', 'c:d', 'sp ace', 'ünï' into both;
    e's partitions are dropped (files stay) and found again by MSCK REPAIR; m's '50%' is
    renamed to '60%:' and its 'c:d' moved to own/'q=r %', then written. Load (the
    inserts loaded on their own first, before the rename). Expected:
    every partitionLocation of the r19j events that adds or moves a partition still
    present names an existing directory holding that partition's files; the replica's
    rows and partitions equal the source's. Then the source drops every partition of m
    (managed): each file m held is in a DROP_PARTITION event or, belonging to no partition
    any more, still on disk, and each dropped (path, checksum) resolves to `cmroot`; a
    load leaves the replica's m empty."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r19j"
    values = ["x=y", "a/b", "50%", "c:d", "sp ace", "ünï"]
    rows = ", ".join(f"({i}, {_lit(v)})" for i, v in enumerate(values))
    source.sql("CREATE DATABASE r19j")
    source.sql("CREATE TABLE r19j.e (a INT, s STRING) USING parquet PARTITIONED BY (s)"
               f" LOCATION '{own}/e'")
    source.sql("CREATE TABLE r19j.m (a INT, s STRING) USING parquet PARTITIONED BY (s)")
    for t in ("e", "m"):
        source.sql(f"INSERT INTO r19j.{t} SELECT * FROM VALUES {rows} AS v(a, s)")
    # Loaded before the rename moves the files: a load after a partition rename cannot
    # find the files an earlier INSERT named in the renamed partition (resolve follows
    # table renames only; partition renames need an ALTER_PARTITION event: issue 12).
    inc0, h0 = source.dump("r19j", from_id=start)
    (zero,) = destination.run({"load": {"dump": inc0}})
    source.sql("ALTER TABLE r19j.e DROP " + ", ".join(f"PARTITION (s={_lit(v)})"
                                                    for v in values))
    source.sql("MSCK REPAIR TABLE r19j.e")
    source.sql("ALTER TABLE r19j.m PARTITION (s='50%') RENAME TO PARTITION (s='60%:')")
    source.sql(f"ALTER TABLE r19j.m PARTITION (s='c:d') SET LOCATION {_lit(str(own / 'q=r %'))}")
    source.sql("INSERT INTO r19j.m PARTITION (s='c:d') VALUES (30)")
    source.sql("INSERT INTO r19j.m PARTITION (s='60%:') VALUES (20)")
    for t in ("e", "m"):
        source.sql(f"REFRESH TABLE r19j.{t}")
    now = {t: source.rows(f"SELECT * FROM r19j.{t}") for t in ("e", "m")}
    parts = {f"r19j.{t}": source.partitions(f"r19j.{t}") for t in ("e", "m")}
    events = _events(source, start, "r19j")
    last: dict[tuple[str, str], str | None] = {}
    for e in events:
        if e.get("eventType") in ("ADD_PARTITION", "ALTER_LOCATION", "DROP_PARTITION"):
            for i, p in enumerate(e.get("partitions") or []):
                locs = e.get("partitionLocations") or []
                key = (str(e.get("table")).lower(), p.get("s"))
                last[key] = None if e["eventType"] == "DROP_PARTITION" else (
                    locs[i] if i < len(locs) else "?")
    present = {(t, r[1]) for t in ("e", "m") for r in now[t]}
    bad = {k: v for k, v in last.items() if k in present
           and (v is None or not os.path.isdir(str(v)) or not files_below(Path(str(v))))}
    inc1, h1 = source.dump("r19j", from_id=h0.last_event_id)
    # Every file m holds now must be recycled by its drop.
    mdir = source.table_dir("m", "r19j")
    held = {os.path.join(d, f) for top in (mdir, own / "q=r %") for d, _, fs in os.walk(top)
            for f in fs if not f.startswith((".", "_"))}
    source.sql("ALTER TABLE r19j.m DROP " + ", ".join(
        f"PARTITION (s={_lit(r[1])})" for r in now["m"]))
    drops = [e for e in _events(source, h1.last_event_id + 1, "r19j")
             if e.get("eventType") == "DROP_PARTITION"]
    dropped = [(f["path"], f["checksum"]) for e in drops for f in e.get("files") or []]
    status = source.daemon.client.resolve(
        [{"path": p, "checksum": c} for p, c in dropped]).files if dropped else []
    inc2, _ = source.dump("r19j", from_id=h1.last_event_id)
    q = {t: f"SELECT * FROM r19j.{t}" for t in ("e", "m")}
    first, after, second, emptied = destination.run(
        {"load": {"dump": inc1}},
        {"sql": ["REFRESH TABLE r19j.e", "REFRESH TABLE r19j.m"], "queries": q,
         "partitions": list(parts)},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r19j.m"], "queries": {"m": q["m"]}},
    )
    for step in (zero, first, second):
        load_ok(step)
    assert not bad, (bad, events[-1].keys() if events else None)
    assert after["partitions"] == parts, (after["partitions"], parts)
    assert after["rows"] == now, (after["rows"], now)
    # No loss: each file m held is recycled by the drop, or was no partition's (the place
    # 'c:d' moved away from) and is still where it was.
    lost = {p for p in held - {p for p, _ in dropped} if not os.path.exists(p)}
    assert not lost, sorted(lost)
    assert {r.status for r in status} <= {"cmroot"}, [(r.path, r.status) for r in status]
    assert emptied["rows"]["m"] == []


# -- a killed load ---------------------------------------------------------------------------


def test_a_load_killed_after_moving_an_external_table_ends_equal_to_the_source(
    source: Source, fresh_destination: Destination
) -> None:
    """Source: external r19k.e at own/e (row 1), external r19k.x at own/e2 (row 2), x
    dropped. Then e is moved to own/e2, written (row 3) and dropped (external: own/e2
    keeps rows 2 and 3), and r19k.e4 is created over own/e2. One load, killed (SIGKILL at
    `load.applied`) right after the ALTER_LOCATION, then rerun. Expected: the rerun
    finishes, r19k holds e4 only, with rows 2 and 3 as at the source."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r19k"
    source.sql("CREATE DATABASE r19k")
    source.sql(f"CREATE TABLE r19k.e (a INT) USING parquet LOCATION '{own}/e'")
    source.sql("INSERT INTO r19k.e VALUES (1)")
    source.sql(f"CREATE TABLE r19k.x (a INT) USING parquet LOCATION '{own}/e2'")
    source.sql("INSERT INTO r19k.x VALUES (2)")
    source.sql("DROP TABLE r19k.x")
    source.sql(f"ALTER TABLE r19k.e SET LOCATION '{own}/e2'")
    source.sql("INSERT INTO r19k.e VALUES (3)")
    source.sql("DROP TABLE r19k.e")
    source.sql(f"CREATE TABLE r19k.e4 (a INT) USING parquet LOCATION '{own}/e2'")
    now = source.rows("SELECT * FROM r19k.e4")
    inc, h = source.dump("r19k", from_id=start)
    kinds = [e.type for e in dumpdir.read(inc).events]
    at = kinds.index("ALTER_LOCATION") + 1
    d = fresh_destination
    d.run({"load": {"dump": inc}}, faults=f"load.applied@{at}")
    last, = d.run({"load": {"dump": inc}, "status": ["r19k"],
                   "queries": {"e4": "SELECT * FROM r19k.e4",
                               "tables": "SHOW TABLES IN r19k"}})
    load_ok(last)
    assert last["status"]["r19k"] == h.last_event_id
    assert [r[1] for r in last["rows"]["tables"]] == ["e4"]
    assert now == [[2], [3]], now
    assert last["rows"]["e4"] == now, (last["rows"]["e4"], now)

"""Review 18: replication of partitions with their own locations (08cb4b0..d1e9bc8),
attacked where review 17 did not: a dropped or re-located directory that holds another
partition (of another table, or of the same one), partition renames, crash and rerun in
the middle of partition moves and drops, DROP DATABASE beside another replica, table
renames, overwrites, special characters, moves back to the default place, MSCK REPAIR and
dynamic-partition inserts.

Invariants: after every load the destination equals the source as of the dump's last
event (rows, partitions); a load never deletes data outside its own replica; a crash and
rerun at any point ends where an uninterrupted load would."""

from __future__ import annotations

import pytest

from cmroot.repl import dumpdir
from tests.repl.conftest import Destination, Source, files_below, load_ok

pytestmark = pytest.mark.timeout(900)


# -- directories holding other partitions ----------------------------------------------------


def test_dropping_an_external_table_keeps_another_tables_partition_inside_it(
    source: Source, destination: Destination
) -> None:
    """Source: external table r18x.e (partitioned, LOCATION own/e) with a row in p=1;
    managed table r18x.m whose p=1 lies at own/e/zz (inside e's directory, in none of
    e's partitions); a row each. Load. The source drops e (external: its files and m's
    stay). Load. Expected: r18x.m keeps its row on the replica, as at the source:
    dropping e's replica must not remove the directory of m's partition nested in it
    (`_drop_table` rmtree's the external table's `_external/...` directory whole)."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18x"
    source.sql("CREATE DATABASE r18x")
    source.sql("CREATE TABLE r18x.e (a INT, p INT) USING parquet PARTITIONED BY (p)"
               f" LOCATION '{own}/e'")
    source.sql("INSERT INTO r18x.e PARTITION (p=1) VALUES (1)")
    source.sql("CREATE TABLE r18x.m (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql(f"ALTER TABLE r18x.m ADD PARTITION (p=1) LOCATION '{own}/e/zz'")
    source.sql("INSERT INTO r18x.m PARTITION (p=1) VALUES (2)")
    inc1, h1 = source.dump("r18x", from_id=start)
    source.sql("DROP TABLE r18x.e")
    now = source.rows("SELECT * FROM r18x.m")
    inc2, _ = source.dump("r18x", from_id=h1.last_event_id)
    q = {"m": "SELECT * FROM r18x.m"}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": {**q, "e": "SELECT * FROM r18x.e"}},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18x.m"], "queries": q},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"] == {"m": [[2, 1]], "e": [[1, 1]]}
    assert now == [[2, 1]]
    m1 = destination.warehouse / "_external" / "r18x" / str(own / "e" / "zz").lstrip("/")
    assert after["rows"]["m"] == now, (after["rows"], files_below(m1))


def test_dropping_a_partition_of_an_external_table_keeps_its_partition_nested_in_it(
    source: Source, destination: Destination
) -> None:
    """Source: external table r18y.t at own/t; p=1 at its default place own/t/p=1 (row
    1), p=2 at own/t/p=1/inner (inside p=1's directory, row 2). Load. The source drops
    p=1 (external: the files stay, p=2 keeps its row). Load. Expected: the replica's rows
    equal the source's after each load; the drop of p=1 on the replica keeps p=2's
    directory (`_remove_dirs` takes the 'default places only' shortcut and clears
    nothing it should keep)."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18y"
    source.sql("CREATE DATABASE r18y")
    source.sql("CREATE TABLE r18y.t (a INT, p INT) USING parquet PARTITIONED BY (p)"
               f" LOCATION '{own}/t'")
    source.sql("INSERT INTO r18y.t PARTITION (p=1) VALUES (1)")
    source.sql(f"ALTER TABLE r18y.t ADD PARTITION (p=2) LOCATION '{own}/t/p=1/inner'")
    source.sql("INSERT INTO r18y.t PARTITION (p=2) VALUES (2)")
    then = source.rows("SELECT * FROM r18y.t")
    inc1, h1 = source.dump("r18y", from_id=start)
    source.sql("ALTER TABLE r18y.t DROP PARTITION (p=1)")
    source.sql("REFRESH TABLE r18y.t")
    now = source.rows("SELECT * FROM r18y.t")
    inc2, _ = source.dump("r18y", from_id=h1.last_event_id)
    q = {"t": "SELECT * FROM r18y.t"}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18y.t"], "queries": q, "partitions": ["r18y.t"]},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"]["t"] == then
    assert [2, 2] in now, now
    assert after["partitions"]["r18y.t"] == ["p=2"]
    assert after["rows"]["t"] == now, (after["rows"], now)


def test_renaming_a_partition_of_an_external_table_keeps_its_files(
    source: Source, destination: Destination
) -> None:
    """Source: external table r18r.t at own/t; p=1 at its own location own/c1 (outside the
    table), one row. Load. The source renames p=1 to p=5 (an external table's partition
    keeps its directory: the hook records ADD_PARTITION p=5 at own/c1, then DROP_PARTITION
    p=1) and writes another row into p=5. Load. Expected: the replica holds p=5 with both
    rows, as the source: dropping p=1 must not clear the directory p=5 now occupies."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18r"
    source.sql("CREATE DATABASE r18r")
    source.sql("CREATE TABLE r18r.t (a INT, p INT) USING parquet PARTITIONED BY (p)"
               f" LOCATION '{own}/t'")
    source.sql(f"ALTER TABLE r18r.t ADD PARTITION (p=1) LOCATION '{own}/c1'")
    source.sql("INSERT INTO r18r.t PARTITION (p=1) VALUES (1)")
    inc1, h1 = source.dump("r18r", from_id=start)
    source.sql("ALTER TABLE r18r.t PARTITION (p=1) RENAME TO PARTITION (p=5)")
    source.sql("INSERT INTO r18r.t PARTITION (p=5) VALUES (5)")
    source.sql("REFRESH TABLE r18r.t")
    now = source.rows("SELECT * FROM r18r.t")
    parts = source.partitions("r18r.t")
    inc2, _ = source.dump("r18r", from_id=h1.last_event_id)
    q = {"t": "SELECT * FROM r18r.t"}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18r.t"], "queries": q, "partitions": ["r18r.t"]},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"]["t"] == [[1, 1]]
    assert after["partitions"]["r18r.t"] == parts
    assert after["rows"]["t"] == now, (after["rows"], now)


# -- crash and rerun -------------------------------------------------------------------------


def test_a_load_killed_among_partition_moves_and_drops_ends_equal_to_the_source(
    source: Source, fresh_destination: Destination
) -> None:
    """Source r18k.t (managed): p=1 at its default place, p=2 at own/a, p=3 at own/b, a
    row each. Load (incremental from the database's creation). Then the source moves p=2
    to own/a2 and writes it, drops p=3 and adds it again at own/b2 with a row, moves p=1
    to own/c1, writes it, and moves it back to its default place. The second load is
    killed (SIGKILL at `load.applied`) right after the first partition move, rerun and
    killed again right after the drop of p=3, then rerun to the end. Expected: the
    replica's rows and partitions equal the source's, and each of the replica's old places
    (own/a, own/b, own/c1 below `_external/r18k`) holds what the source's does."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18k"
    source.sql("CREATE DATABASE r18k")
    source.sql("CREATE TABLE r18k.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r18k.t PARTITION (p=1) VALUES (1)")
    source.sql(f"ALTER TABLE r18k.t ADD PARTITION (p=2) LOCATION '{own}/a'")
    source.sql("INSERT INTO r18k.t PARTITION (p=2) VALUES (2)")
    source.sql(f"ALTER TABLE r18k.t ADD PARTITION (p=3) LOCATION '{own}/b'")
    source.sql("INSERT INTO r18k.t PARTITION (p=3) VALUES (3)")
    inc1, h1 = source.dump("r18k", from_id=start)
    source.sql(f"ALTER TABLE r18k.t PARTITION (p=2) SET LOCATION '{own}/a2'")
    source.sql("INSERT INTO r18k.t PARTITION (p=2) VALUES (20)")
    source.sql("ALTER TABLE r18k.t DROP PARTITION (p=3)")
    source.sql(f"ALTER TABLE r18k.t ADD PARTITION (p=3) LOCATION '{own}/b2'")
    source.sql("INSERT INTO r18k.t PARTITION (p=3) VALUES (30)")
    default1 = source.table_dir("t", "r18k") / "p=1"
    source.sql(f"ALTER TABLE r18k.t PARTITION (p=1) SET LOCATION '{own}/c1'")
    source.sql("INSERT INTO r18k.t PARTITION (p=1) VALUES (10)")
    source.sql(f"ALTER TABLE r18k.t PARTITION (p=1) SET LOCATION '{default1}'")
    source.sql("REFRESH TABLE r18k.t")
    now = source.rows("SELECT * FROM r18k.t")
    parts = source.partitions("r18k.t")
    inc2, _ = source.dump("r18k", from_id=h1.last_event_id)
    events = dumpdir.read(inc2).events
    kinds = [e.type for e in events]
    move = kinds.index("ALTER_LOCATION") + 1
    drop = kinds.index("DROP_PARTITION") + 1
    n1 = len(dumpdir.read(inc1).events)
    d = fresh_destination
    d.run({"load": {"dump": inc1}}, {"load": {"dump": inc2}},
          faults=f"load.applied@{n1 + move}")
    # The rerun starts at the status the killed run recorded: count from there.
    status, = d.run({"status": ["r18k"]})
    done = status["status"]["r18k"]
    left = [e for e in events if e.id > (done or 0)]
    at = next(i for i, e in enumerate(left, 1) if e.type == "DROP_PARTITION")
    assert drop  # the drop is in the dump
    d.run({"load": {"dump": inc2}}, faults=f"load.applied@{at}")
    q = {"t": "SELECT * FROM r18k.t"}
    last, after = d.run(
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18k.t"], "queries": q, "partitions": ["r18k.t"]},
    )
    load_ok(last)
    ext = d.warehouse / "_external" / "r18k" / str(own).lstrip("/")
    # Each place the partitions left holds what the source's does (a managed drop's
    # files went, a moved-away-from place keeps its files, as at the source).
    differ = {n: (files_below(ext / n), files_below(own / n)) for n in ("a", "b", "c1")
              if files_below(ext / n) != files_below(own / n)}
    assert after["partitions"]["r18k.t"] == parts
    assert after["rows"]["t"] == now, (after["rows"], now)
    assert not differ, differ


# -- databases and tables --------------------------------------------------------------------


def test_drop_database_cascade_leaves_another_replica_of_the_same_source(
    source: Source, destination: Destination
) -> None:
    """Source r18d: table t with p=1 at its default place and p=2 at its own location, an
    external table e. Its incremental dump (from before CREATE DATABASE) is loaded as
    r18d, its bootstrap as r18e (a second replica of the same source database in the same
    warehouse). The source then drops r18d CASCADE; that dump is loaded into r18d.
    Expected: r18d is gone; r18e keeps its rows and its `_external/r18e` files."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18d"
    source.sql("CREATE DATABASE r18d")
    source.sql("CREATE TABLE r18d.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r18d.t VALUES (1, 1)")
    source.sql(f"ALTER TABLE r18d.t ADD PARTITION (p=2) LOCATION '{own}/t2'")
    source.sql("INSERT INTO r18d.t PARTITION (p=2) VALUES (2)")
    source.sql(f"CREATE TABLE r18d.e (a INT) USING parquet LOCATION '{own}/e'")
    source.sql("INSERT INTO r18d.e VALUES (7)")
    inc1, h1 = source.dump("r18d", from_id=start)
    boot, _ = source.dump("r18d")
    source.sql("DROP DATABASE r18d CASCADE")
    inc2, _ = source.dump("r18d", from_id=h1.last_event_id)
    q = {"t": "SELECT * FROM r18e.t", "e": "SELECT * FROM r18e.e"}
    one, two, three = destination.run(
        {"load": {"dump": inc1}},
        {"load": {"dump": boot, "target": "r18e"}, "queries": q},
        {"load": {"dump": inc2}, "queries": {**q, "dbs": "SHOW DATABASES LIKE 'r18d'"}},
    )
    for step in (one, two, three):
        load_ok(step)
    assert two["rows"] == {"t": [[1, 1], [2, 2]], "e": [[7]]}
    assert three["rows"] == {**two["rows"], "dbs": []}
    assert files_below(destination.warehouse / "_external" / "r18e")
    assert not files_below(destination.warehouse / "_external" / "r18d")


def test_a_renamed_table_keeps_following_its_own_partitions(
    source: Source, destination: Destination
) -> None:
    """Source r18n.t (managed): p=1 at its default place, p=2 at own/t2 (outside), p=3 at
    t's directory's `custom3` (inside, not its default place); a row each. Load. The
    source renames t to u, then writes p=1, p=2 and p=3, drops p=2, adds it again at
    own/t2b with a row, and drops p=3. Load (also as a bootstrap into r18nb). Expected:
    after each load the replica's rows and partitions of u equal the source's, t is gone,
    and the replica's old place of p=2 holds nothing."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18n"
    source.sql("CREATE DATABASE r18n")
    source.sql("CREATE TABLE r18n.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r18n.t PARTITION (p=1) VALUES (1)")
    source.sql(f"ALTER TABLE r18n.t ADD PARTITION (p=2) LOCATION '{own}/t2'")
    source.sql("INSERT INTO r18n.t PARTITION (p=2) VALUES (2)")
    custom = source.table_dir("t", "r18n") / "custom3"
    source.sql(f"ALTER TABLE r18n.t ADD PARTITION (p=3) LOCATION '{custom}'")
    source.sql("INSERT INTO r18n.t PARTITION (p=3) VALUES (3)")
    then = source.rows("SELECT * FROM r18n.t")
    inc1, h1 = source.dump("r18n", from_id=start)
    source.sql("ALTER TABLE r18n.t RENAME TO r18n.u")
    mid = source.rows("SELECT * FROM r18n.u")
    inc2, h2 = source.dump("r18n", from_id=h1.last_event_id)
    for p in (1, 2, 3):
        source.sql(f"INSERT INTO r18n.u PARTITION (p={p}) VALUES ({p * 10})")
    source.sql("ALTER TABLE r18n.u DROP PARTITION (p=2)")
    source.sql(f"ALTER TABLE r18n.u ADD PARTITION (p=2) LOCATION '{own}/t2b'")
    source.sql("INSERT INTO r18n.u PARTITION (p=2) VALUES (200)")
    source.sql("ALTER TABLE r18n.u DROP PARTITION (p=3)")
    now = source.rows("SELECT * FROM r18n.u")
    parts = source.partitions("r18n.u")
    inc3, _ = source.dump("r18n", from_id=h2.last_event_id)
    boot, _ = source.dump("r18n")
    q = {"u": "SELECT * FROM r18n.u"}
    tables = {"tables": "SHOW TABLES IN r18n"}
    answers = destination.run(
        {"load": {"dump": inc1}, "queries": {"t": "SELECT * FROM r18n.t"}},
        {"load": {"dump": inc2}, "queries": {**q, **tables}},
        {"load": {"dump": inc3}},
        {"sql": ["REFRESH TABLE r18n.u"], "queries": {**q, **tables},
         "partitions": ["r18n.u"]},
        {"load": {"dump": boot, "target": "r18nb"}, "queries": {"u": "SELECT * FROM r18nb.u"},
         "partitions": ["r18nb.u"]},
    )
    first, second, third, after, booted = answers
    for step in (first, second, third, booted):
        load_ok(step)
    assert first["rows"]["t"] == then
    assert second["rows"]["u"] == mid
    assert [r[1] for r in second["rows"]["tables"]] == ["u"]
    assert after["partitions"]["r18n.u"] == parts
    assert after["rows"]["u"] == now, (after["rows"]["u"], now)
    assert booted["rows"]["u"] == now and booted["partitions"]["r18nb.u"] == parts
    old = destination.warehouse / "_external" / "r18n" / str(own / "t2").lstrip("/")
    assert not files_below(old), files_below(old)


# -- writes ----------------------------------------------------------------------------------


def test_overwrites_and_dynamic_inserts_into_partitions_at_their_own_locations(
    source: Source, destination: Destination
) -> None:
    """Source r18w: data source table d and Hive table h (STORED AS PARQUET), each with
    p=1 at its default place and p=2 at its own location (outside the table), a row each.
    Load. Then: INSERT OVERWRITE of p=2 (static) in both; a dynamic-partition INSERT INTO
    d writing p=1, p=2 and a new p=3; a dynamic INSERT OVERWRITE of h (partition
    overwrite mode dynamic) writing p=2 and p=4. Load. Expected: after each load the
    replica's rows and partitions equal the source's, and the replica's copy of each
    own-location partition holds as many data files as the source's directory."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18w"
    source.sql("CREATE DATABASE r18w")
    source.sql("CREATE TABLE r18w.d (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("CREATE TABLE r18w.h (a INT) PARTITIONED BY (p INT) STORED AS PARQUET")
    for t in ("d", "h"):
        source.sql(f"INSERT INTO r18w.{t} PARTITION (p=1) VALUES (1)")
        source.sql(f"ALTER TABLE r18w.{t} ADD PARTITION (p=2) LOCATION '{own}/{t}2'")
        source.sql(f"INSERT INTO r18w.{t} PARTITION (p=2) VALUES (2)")
    then = {t: source.rows(f"SELECT * FROM r18w.{t}") for t in ("d", "h")}
    inc1, h1 = source.dump("r18w", from_id=start)
    for t in ("d", "h"):
        source.sql(f"INSERT OVERWRITE TABLE r18w.{t} PARTITION (p=2) VALUES (22)")
    source.sql("INSERT INTO r18w.d SELECT * FROM VALUES (11, 1), (23, 2), (33, 3) AS v(a, p)")
    old = source.spark.conf.get("spark.sql.sources.partitionOverwriteMode")
    source.spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    try:
        source.sql("INSERT OVERWRITE TABLE r18w.h PARTITION (p)"
                   " SELECT * FROM VALUES (24, 2), (44, 4) AS v(a, p)")
    finally:
        source.spark.conf.set("spark.sql.sources.partitionOverwriteMode", old)
    for t in ("d", "h"):
        source.sql(f"REFRESH TABLE r18w.{t}")
    now = {t: source.rows(f"SELECT * FROM r18w.{t}") for t in ("d", "h")}
    parts = {f"r18w.{t}": source.partitions(f"r18w.{t}") for t in ("d", "h")}
    inc2, _ = source.dump("r18w", from_id=h1.last_event_id)
    q = {t: f"SELECT * FROM r18w.{t}" for t in ("d", "h")}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18w.d", "REFRESH TABLE r18w.h"], "queries": q,
         "partitions": list(parts)},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"] == then
    assert after["partitions"] == parts
    assert after["rows"] == now, (after["rows"], now)
    ext = destination.warehouse / "_external" / "r18w" / str(own).lstrip("/")
    for t in ("d", "h"):
        assert len(files_below(ext / f"{t}2")) == len(files_below(own / f"{t}2")), t


def test_special_characters_in_partition_values_and_own_locations(
    source: Source, destination: Destination
) -> None:
    """Source r18c.t partitioned by a string s: values 'a b', 'x=y', 'a/b', '50%' and
    'ünï' at their default places, and values 'o p', 'q=r', 's/t', '7%', 'ü2' at their
    own locations outside the table whose directory names hold the same characters
    (space, '=', '%', unicode, '%2F'); a row each. Load. Then the source overwrites 'o p'
    and 'a b', drops 'q=r' and 'x=y', and adds '7%' again elsewhere. Load; and a
    bootstrap into r18cb. Expected: after each load the replica's rows and partitions
    equal the source's. (The hook's ADD_PARTITION gives partitionLocations decoded from
    the metastore URI, `t/s=x=y`, where the directory is `t/s=x%3Dy` as its INSERT says:
    the load then registers the partition at the decoded, empty directory.)"""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18c"
    source.sql("CREATE DATABASE r18c")
    source.sql("CREATE TABLE r18c.t (a INT, s STRING) USING parquet PARTITIONED BY (s)")
    default = ["a b", "x=y", "a/b", "50%", "ünï"]
    placed = {"o p": "dir o p", "q=r": "q=r", "s/t": "s%2Ft", "7%": "7%25 x", "ü2": "ü dir"}

    def lit(v: str) -> str:
        return "'" + v.replace("'", "\\'") + "'"

    for i, v in enumerate(default):
        source.sql(f"INSERT INTO r18c.t PARTITION (s={lit(v)}) VALUES ({i})")
    for i, (v, where) in enumerate(placed.items(), 10):
        source.sql(f"ALTER TABLE r18c.t ADD PARTITION (s={lit(v)})"
                   f" LOCATION {lit(str(own / where))}")
        source.sql(f"INSERT INTO r18c.t PARTITION (s={lit(v)}) VALUES ({i})")
    then = source.rows("SELECT * FROM r18c.t")
    inc1, h1 = source.dump("r18c", from_id=start)
    source.sql("INSERT OVERWRITE TABLE r18c.t PARTITION (s='o p') VALUES (100)")
    source.sql("INSERT OVERWRITE TABLE r18c.t PARTITION (s='a b') VALUES (101)")
    source.sql("ALTER TABLE r18c.t DROP PARTITION (s='q=r'), PARTITION (s='x=y')")
    source.sql("ALTER TABLE r18c.t DROP PARTITION (s='7%')")
    source.sql(f"ALTER TABLE r18c.t ADD PARTITION (s='7%') LOCATION {lit(str(own / '7 %again'))}")
    source.sql("INSERT INTO r18c.t PARTITION (s='7%') VALUES (102)")
    source.sql("REFRESH TABLE r18c.t")
    now = source.rows("SELECT * FROM r18c.t")
    parts = source.partitions("r18c.t")
    inc2, _ = source.dump("r18c", from_id=h1.last_event_id)
    boot, _ = source.dump("r18c")
    q = {"t": "SELECT * FROM r18c.t"}
    first, second, after, booted = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18c.t"], "queries": q, "partitions": ["r18c.t"]},
        {"load": {"dump": boot, "target": "r18cb"}, "queries": {"t": "SELECT * FROM r18cb.t"},
         "partitions": ["r18cb.t"]},
    )
    load_ok(first)
    assert first["rows"]["t"] == then, (first["rows"], then)
    load_ok(second)
    assert after["partitions"]["r18c.t"] == parts
    assert after["rows"]["t"] == now, (after["rows"], now)
    load_ok(booted)
    assert booted["rows"]["t"] == now and booted["partitions"]["r18cb.t"] == parts


def test_msck_repair_of_a_table_with_partitions_at_their_own_locations(
    source: Source, destination: Destination
) -> None:
    """Source r18m.t (external at own/t): p=1 at its default place, p=2 at own/x2
    (outside the table), a row each. Load. The source drops both partitions (external:
    the files stay), runs MSCK REPAIR TABLE (which finds p=1 again at its default place;
    p=2's directory is not below the table, so it stays dropped), and writes p=2 anew
    (at its default place now). Load. Expected: the replica's rows and partitions equal
    the source's; the replica's old copy of own/x2 holds what the source's does."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r18m"
    source.sql("CREATE DATABASE r18m")
    source.sql("CREATE TABLE r18m.t (a INT, p INT) USING parquet PARTITIONED BY (p)"
               f" LOCATION '{own}/t'")
    source.sql("INSERT INTO r18m.t PARTITION (p=1) VALUES (1)")
    source.sql(f"ALTER TABLE r18m.t ADD PARTITION (p=2) LOCATION '{own}/x2'")
    source.sql("INSERT INTO r18m.t PARTITION (p=2) VALUES (2)")
    then = source.rows("SELECT * FROM r18m.t")
    inc1, h1 = source.dump("r18m", from_id=start)
    source.sql("ALTER TABLE r18m.t DROP PARTITION (p=1), PARTITION (p=2)")
    source.sql("MSCK REPAIR TABLE r18m.t")
    source.sql("INSERT INTO r18m.t PARTITION (p=2) VALUES (20)")
    source.sql("REFRESH TABLE r18m.t")
    now = source.rows("SELECT * FROM r18m.t")
    parts = source.partitions("r18m.t")
    inc2, _ = source.dump("r18m", from_id=h1.last_event_id)
    q = {"t": "SELECT * FROM r18m.t"}
    first, second, after = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r18m.t"], "queries": q, "partitions": ["r18m.t"]},
    )
    load_ok(first)
    load_ok(second)
    assert first["rows"]["t"] == then
    assert after["partitions"]["r18m.t"] == parts
    assert after["rows"]["t"] == now, (after["rows"], now)
    old = destination.warehouse / "_external" / "r18m" / str(own / "x2").lstrip("/")
    # An external drop leaves the files, there too.
    assert files_below(old) == files_below(own / "x2")

"""Sixth hostile review of the Spark hook: 7f4dc36 (DROP PARTITION / TRUNCATE match a spec
normalized by Spark's PartitioningUtils.normalizePartitionSpec through
catalog.listPartitions), d66f8d0 (Cmroot.protectedPath(path, s, ctx) / Ctx.catalogData: a
catalog location of the statement's table is data whatever its name), 440d8a3 (LOAD DATA
INPATH keeps every file of another table it will move, before anything moves). Real PySpark
local[2] with its embedded metastore, a real daemon, real files; one session for the whole
module (tests/spark/conftest.py's `lake`).

Each test asserts what DESIGN.md's invariants promise and fails while the bug its docstring
describes is present. "Probe" tests pass and pin a sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from tests.adversarial.test_review4_spark import (
    attempt,
    brief,
    data_only,
    kept,
    replica_diff,
    rows,
    staging,
    unrecoverable,
)
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake, app_conf

pytestmark = pytest.mark.timeout(600)

DB = "rev6"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


def parts(lake: Lake, table: str) -> list[str]:  # noqa: F811
    return sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.{table}"))



def hook_off(lake: Lake) -> Any:  # noqa: F811
    return app_conf(lake.spark, "spark.cmroot.enabled", "false")


# -- 1. DROP PARTITION: the hook's listPartitions vs the metastore's own drop match ---------

@pytest.mark.parametrize(("name", "values", "spec"), [
    ("dot_s", ["a.c", "abc"], "p='a.c'"),
    ("und_s", ["a_c", "abc"], "p='a_c'"),
])
def test_drop_partition_with_a_wildcard_character_drops_what_spark_drops(
    lake: Lake, db: str, name: str, values: list[str], spec: str  # noqa: F811
) -> None:
    """A Hive table partitioned by a STRING holds p='a.c' and p='abc' (each one data file).
    `ALTER TABLE t DROP PARTITION (p='a.c')`. The metastore matches a partial spec with a
    pattern in which '.' is a wildcard; Spark's HiveExternalCatalog.listPartitions (the
    hook's CmrootDropPartitions.matching) filters those extra matches out, the drop
    (HiveClientImpl.dropPartitions) may not. Compared with a twin table where the hook is
    off. Expected: the same partitions remain as on the twin; every file of a partition
    that went is retrievable by (path, checksum) (invariant 1); files of a partition that
    stays are untouched (invariant 2)."""
    def make(t: str) -> None:
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (p STRING) STORED AS TEXTFILE")
        for i, v in enumerate(values):
            lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p='{v}') VALUES ({i})")

    make(name + "_twin")
    with hook_off(lake):
        lake.sql(f"ALTER TABLE {DB}.{name}_twin DROP PARTITION ({spec})")
    twin_left = parts(lake, name + "_twin")
    make(name)
    before = kept(tdir(lake, name))
    err, events = attempt(lake, f"ALTER TABLE {DB}.{name} DROP PARTITION ({spec})")
    assert err is None, err
    assert parts(lake, name) == twin_left
    after = kept(tdir(lake, name))
    gone = {p: b for p, b in before.items() if p not in after}
    assert unrecoverable(lake, gone) == [], brief(events)
    assert {p: b for p, b in before.items() if p in after} == after
    assert replica_diff(set(before), set(after), events) == ([], []), brief(events)


# -- 2. a table located at a temporary-shaped place: the job's own output -----------------

@pytest.mark.parametrize(("fmt", "v2"), [
    ("USING parquet", False), ("USING parquet", True),
    ("STORED AS TEXTFILE", False), ("STORED AS TEXTFILE", True),
])
def test_overwrite_of_a_table_located_at_a_temporary_shaped_place(
    lake: Lake, db: str, fmt: str, v2: bool  # noqa: F811
) -> None:
    """A managed table created with LOCATION '<wh>/rev6.db/tmpt_x/_temporary/7'. INSERT
    INTO t VALUES (1); INSERT OVERWRITE TABLE t SELECT 2 (FileOutputCommitter v1 / v2).
    Expected: the table holds exactly (2) (its new files are never taken for old ones), and
    the old file is retrievable by (path, checksum) (invariant 1)."""
    name = "tmpt_" + fmt.split()[-1].lower() + ("_v2" if v2 else "")
    loc = lake.warehouse / f"{DB}.db" / name / "_temporary" / "7"
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) {fmt} LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1)")
    old = kept(loc)
    assert old and rows(lake, f"SELECT a FROM {DB}.{name}") == [(1,)]
    with app_conf(lake.spark, "spark.hadoop.mapreduce.fileoutputcommitter.algorithm.version",
                  "2" if v2 else "1"):
        err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{name} SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{name}") == [(2,)], brief(events)
    assert unrecoverable(lake, old) == [], brief(events)
    assert replica_diff(set(old), set(kept(loc)), events) == ([], []), brief(events)


@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_dynamic_overwrite_of_a_partitioned_table_at_a_temporary_shaped_place(
    lake: Lake, db: str, fmt: str  # noqa: F811
) -> None:
    """A partitioned managed table at LOCATION '<wh>/rev6.db/tmpd_x/_temporary/7' holding
    p=1 and p=2. With partitionOverwriteMode=dynamic, INSERT OVERWRITE TABLE t
    SELECT 9, 1. Expected: p=1 holds (9), p=2 still (2) with its file untouched, p=1's old
    file retrievable by (path, checksum)."""
    name = "tmpd_" + fmt.split()[-1].lower()
    loc = lake.warehouse / f"{DB}.db" / name / "_temporary" / "7"
    cols = "(a INT, p INT) USING parquet PARTITIONED BY (p)" if fmt.startswith("USING") \
        else "(a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE"
    lake.sql(f"CREATE TABLE {DB}.{name} {cols} LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p=1) VALUES (1)")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p=2) VALUES (2)")
    old1, old2 = kept(loc / "p=1"), kept(loc / "p=2")
    with app_conf(lake.spark, "spark.sql.sources.partitionOverwriteMode", "dynamic"):
        lake.sql("SET spark.sql.sources.partitionOverwriteMode=dynamic")
        lake.sql("SET hive.exec.dynamic.partition.mode=nonstrict")
        try:
            err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{name} "
                                        "PARTITION (p) SELECT 9, 1")
        finally:
            lake.sql("SET spark.sql.sources.partitionOverwriteMode=static")
    assert err is None, err
    assert rows(lake, f"SELECT a, p FROM {DB}.{name}") == [(2, 2), (9, 1)], brief(events)
    assert kept(loc / "p=2") == old2
    assert unrecoverable(lake, old1) == [], brief(events)


def test_hive_overwrite_of_a_table_whose_location_contains_hive_staging(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """A Hive table at LOCATION '<wh>/rev6.db/x.hive-staging/t' (the name contains
    hive.exec.stagingdir's default: Spark's HiveTempPath then puts its staging output beside
    it, at '<wh>/rev6.db/x.hive-staging_hive_<date>...'). INSERT INTO t VALUES (1); INSERT
    OVERWRITE TABLE t SELECT 2; compared with a twin with the hook off. Expected: the
    table holds (2), the old file is retrievable, the events replay to the table's files."""
    for t in ("hstg_twin", "hstg"):
        loc = lake.warehouse / f"{DB}.db" / f"{t}.hive-staging" / "t"
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) STORED AS TEXTFILE LOCATION '{loc}'")
        lake.sql(f"INSERT INTO {DB}.{t} VALUES (1)")
    with hook_off(lake):
        lake.sql(f"INSERT OVERWRITE TABLE {DB}.hstg_twin SELECT 2")
    assert rows(lake, f"SELECT a FROM {DB}.hstg_twin") == [(2,)]
    loc = lake.warehouse / f"{DB}.db" / "hstg.hive-staging" / "t"
    old = kept(loc)
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.hstg SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.hstg") == [(2,)], brief(events)
    assert unrecoverable(lake, old) == [], brief(events)
    assert replica_diff(set(old), set(kept(loc)), events) == ([], []), brief(events)


# -- 3. LOAD DATA INPATH keeps what it takes from another table ---------------------------

def test_load_data_from_a_table_located_at_a_temporary_shaped_place_keeps_its_files(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Table `src` is a managed table at LOCATION '<wh>/rev6.db/ldtsrc/_temporary/7' (a
    catalog location, data "whatever its name", as d66f8d0 says), holding one file.
    `LOAD DATA INPATH '<src location>' INTO TABLE dst`: Hive moves src's file into dst.
    prepareLoad skips it (Cmroot.protectedPath(local, s) is false for a temporary-shaped
    name) and CmrootLocalFileSystem.rename passes it straight to the raw rename
    (Cmroot.isTemporary(from)): nothing is kept at its old path and dst's INSERT does not
    list it. The same load from a table at an ordinary place keeps the file and records
    the INSERT. Expected: src's file resolvable by (its old path, checksum) (invariant 1:
    the file left src, a hooked operation removed it), and the events replay dst to its
    files."""
    lake.sql(f"CREATE TABLE {DB}.ldtdst (a INT) STORED AS TEXTFILE")
    src = lake.warehouse / f"{DB}.db" / "ldtsrc" / "_temporary" / "7"
    lake.sql(f"CREATE TABLE {DB}.ldtsrc (a INT) STORED AS TEXTFILE LOCATION '{src}'")
    lake.sql(f"INSERT INTO {DB}.ldtsrc VALUES (5)")
    old = kept(src)
    assert old
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldtdst")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.ldtdst") == [(5,)]
    assert unrecoverable(lake, old) == [], brief(events)
    assert replica_diff(set(old), data_only(tdir(lake, "ldtdst")), events) == ([], []), \
        brief(events)


def test_load_data_into_a_datasource_table_is_refused_and_records_nothing(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe. `src` (a Hive table) holds a file; `dst` is USING parquet. LOAD DATA INPATH
    '<src dir>' INTO TABLE dst: Spark refuses (LOAD DATA is not supported for datasource
    tables) after prepareLoad has kept src's file. Expected: the error; src as it was;
    nothing recorded; nothing left staged."""
    lake.sql(f"CREATE TABLE {DB}.ldsdst (a INT) USING parquet")
    lake.sql(f"CREATE TABLE {DB}.ldssrc (a INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.ldssrc VALUES (5)")
    src = tdir(lake, "ldssrc")
    before = kept(src)
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldsdst")
    assert err is not None
    assert kept(src) == before
    assert events == [] and staging(lake) == [], brief(events)


def test_load_data_of_a_directory_holding_a_staging_shaped_subdirectory(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Another table `src` holds a file and a sub-directory (data of its own, listed by
    Spark's recursive file lookup) named like Hive's staging output but not hidden:
    `run_hive_2024-01-05_10-00-00_000_123-1/b.txt`. `LOAD DATA INPATH '<src dir>' INTO
    TABLE dst`: Hive moves a.txt and the sub-directory whole. prepareLoad keeps both
    files; rename passes the sub-directory to the raw rename (Cmroot.isTemporary(from)),
    so movedIn never lists b.txt. Expected: the events replay dst to its files (the INSERT
    lists b.txt), and nothing kept is missing from what moved."""
    lake.sql(f"CREATE TABLE {DB}.ldhdst (a INT) STORED AS TEXTFILE")
    lake.sql(f"CREATE TABLE {DB}.ldhsrc (a INT) STORED AS TEXTFILE")
    src = tdir(lake, "ldhsrc")
    src.mkdir(parents=True, exist_ok=True)
    (src / "a.txt").write_text("1\n")
    sub = src / "run_hive_2024-01-05_10-00-00_000_123-1"
    sub.mkdir()
    (sub / "b.txt").write_text("2\n")
    before = kept(src)
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldhdst")
    assert err is None, err
    after = data_only(tdir(lake, "ldhdst"))
    assert unrecoverable(lake, before) == [], brief(events)
    assert replica_diff(set(before), after, events) == ([], []), brief(events)


def test_load_data_from_another_tables_directory_baseline(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe (passes). The ordinary case of the two tests above: `src` an ordinary managed
    table holding one file; LOAD DATA INPATH '<src dir>' INTO TABLE dst. Its file is kept
    at its old path and the events replay (src's file leaves, dst's arrives)."""
    lake.sql(f"CREATE TABLE {DB}.ldbdst (a INT) STORED AS TEXTFILE")
    lake.sql(f"CREATE TABLE {DB}.ldbsrc (a INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.ldbsrc VALUES (5)")
    src = tdir(lake, "ldbsrc")
    before = kept(src)
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldbdst")
    assert err is None, err
    assert unrecoverable(lake, before) == [], brief(events)
    assert replica_diff(set(before), data_only(tdir(lake, "ldbdst")), events) == ([], []), \
        brief(events)

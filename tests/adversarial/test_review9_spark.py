"""Ninth hostile review of the Spark hook: 765ad79, ae71362 and 1fa3dba (Ctx.partitionDirs holds
every partition not at exactly its k=v path below the table, Cmroot.isDefaultPartitionDir;
Ctx.partitionOf takes the deepest custom location; Ctx.temporary / Cmroot.temporaryBelow judge
only the names below the table or a partition's own location; jobFiles lists every catalog
directory; stageReplaced locates the replaced partitions by the catalog; isHiddenName /
dataFiles with `_k=v` directories; filesUnder(dir, false) for LOAD DATA). Real PySpark
local[2] with its embedded metastore, a real daemon, real files; one session for the whole
module (tests/spark/conftest.py's `lake`).

Each test asserts what DESIGN.md's invariants promise. A test whose docstring starts with
"FAILS:" failed on the reviewed code with the symptom it describes (all fixed with this file:
Ctx.temporary reads a temporary name from the deepest catalog directory down, a job's
clean-up leaves partitions below its _temporary in place, Ctx.partitionOf prefers a deeper
default place, `.k=v` directories are partitions, PARTITION (p=NULL) is the default
partition, and a recycle declares only the partition locations it reaches); "Probe" tests
pass and pin a sequence."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from tests.adversarial.test_review4_spark import (
    attempt,
    brief,
    kept,
    replica_diff,
    rows,
    staging,
    unrecoverable,
)
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake, app_conf

pytestmark = pytest.mark.timeout(600)

DB = "rev9"
COMMITTER = "spark.hadoop.mapreduce.fileoutputcommitter.algorithm.version"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


def hook_off(lake: Lake) -> Any:  # noqa: F811
    return app_conf(lake.spark, "spark.cmroot.enabled", "false")


def inserts(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["partitions"], sorted(f["path"] for f in e["files"]))
            for e in events if e["eventType"] == "INSERT"]


def data_all(root: Path) -> set[str]:
    """Every regular data file under `root`, hidden DIRECTORIES walked (a `.p=1` partition):
    no checksum or _SUCCESS files."""
    out = set()
    for d, _, names in os.walk(root):
        for n in names:
            if not n.startswith((".", "_")):
                out.add(os.path.join(d, n))
    return out


# -- 1. a partition at <t>/_temporary/N: the next write's job clean-up takes it -------------

# Both committers and both targets, paired: each pair of the four showed the loss.
@pytest.mark.parametrize(("into", "committer"), [("same", "1"), ("other", "2")])
def test_a_later_insert_keeps_a_partition_located_at_temporary_n_of_its_table(
    lake: Lake, db: str, committer: str, into: str  # noqa: F811
) -> None:
    """FAILS: a parquet table t partitioned by p; ALTER TABLE t ADD PARTITION (p=7) LOCATION
    '<t>/_temporary/7' (README: "a table or partition the catalog places at x/_temporary/7
    ... is always data"); INSERT INTO t PARTITION (p=7) VALUES (1). Then a plain append,
    INSERT INTO t PARTITION (p=7 | p=1) VALUES (2). Its FileOutputCommitter works in
    <t>/_temporary/0 and at job commit deletes <t>/_temporary whole (cleanupJob), p=7's
    directory with it (Spark alone loses row 1 too). That delete is judged by Ctx.temporary:
    <t>/_temporary lies under the table's location only (not under p=7's own location, which
    lies under IT), and below <t> `_temporary` holds only attempt-like directories (0 and 7),
    so it is a job's temporary output: deleted raw, nothing kept, no event.
    Expected: the file of row 1 resolves by (path, checksum) (invariant 1: nothing under a
    warehouse root is deleted raw)."""
    name = f"tn_{into}_v{committer}"
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    loc = tdir(lake, name) / "_temporary" / "7"
    lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=7) LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p=7) VALUES (1)")
    old = kept(loc)
    assert old and rows(lake, f"SELECT a, p FROM {DB}.{name}") == [(1, 7)]
    p = 7 if into == "same" else 1
    with app_conf(lake.spark, COMMITTER, committer):
        err, events = attempt(lake, f"INSERT INTO {DB}.{name} PARTITION (p={p}) VALUES (2)")
    assert err is None, err
    assert unrecoverable(lake, old) == [], (sorted(os.listdir(tdir(lake, name))), brief(events))


# -- 2. a custom location that holds other partitions' default directories ----------------

@pytest.mark.parametrize("case", ["table_root", "parent_of_default"])
def test_insert_into_a_default_partition_inside_a_custom_location_names_its_partition(
    lake: Lake, db: str, case: str  # noqa: F811
) -> None:
    """FAILS: a parquet table holding a partition at its default place, (p=1) at <t>/p=1
    (resp. (p=1, q=1) at <t>/p=1/q=1), and another partition whose custom location holds
    that directory: (p=9) at the table's own root <t> (resp. (p=1, q=2) at <t>/p=1). The
    default partition is not in Ctx.partitionDirs (Cmroot.isDefaultPartitionDir), and
    Ctx.partitionOf returns the spec of the deepest custom location holding a path BEFORE
    looking at the k=v path below the table: every file of the default partition is
    labelled as the custom one's. Sequence: INSERT INTO t PARTITION (<default spec>)
    VALUES (5). Seen: the INSERT event names partition [{p: 9}] (resp. [{p: 1, q: 2}]) for
    the new file in <t>/p=1 (<t>/p=1/q=1). Expected: the INSERT event names the partition
    the statement wrote, [{p: 1}] (resp. [{p: 1, q: 1}]): a replica replaying it files the
    rows under the partition they belong to (invariant 2: no event for a partition the
    statement did not touch)."""
    name = "cr_" + case[:4]
    if case == "table_root":
        lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
        lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1)")
        lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=9) LOCATION '{tdir(lake, name)}'")
        spec, want = "p=1", [{"p": "1"}]
    else:
        lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT, q INT) USING parquet "
                 "PARTITIONED BY (p, q)")
        lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1, 1)")
        lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=1, q=2) "
                 f"LOCATION '{tdir(lake, name) / 'p=1'}'")
        spec, want = "p=1, q=1", [{"p": "1", "q": "1"}]
    err, events = attempt(lake, f"INSERT INTO {DB}.{name} PARTITION ({spec}) VALUES (5)")
    assert err is None, err
    got = inserts(events)
    assert len(got) == 1 and got[0][1], brief(events)
    assert got[0][0] == want, brief(events)


# -- 3. a custom partition location beside the table, in its database directory -----------

@pytest.mark.parametrize("statement", [
    "ALTER TABLE {t} DROP PARTITION (p=1)",
    "INSERT OVERWRITE TABLE {t} PARTITION (p=1) SELECT 5",
    "TRUNCATE TABLE {t} PARTITION (p=1)",
])
def test_a_partition_located_beside_its_table_does_not_block_its_statements(
    lake: Lake, db: str, statement: str  # noqa: F811
) -> None:
    """FAILS: a parquet table t (p=1 at its default place) with partition p=9 at a custom
    location right in its database directory, '<wh>/rev9.db/<t>_p9' (a natural place for
    it, next to the table). Every recycle of a statement on t declares the table's custom
    partition locations outside it (Ctx.partitionLocations -> `partitionLocations`), and the
    daemon refuses a declared location of the shape `<db>.db/<name>` as "another table's
    directory" (400 one table per recycle): the statement fails though it touches only p=1.
    Compared with a twin with the hook off, which succeeds. Expected: the statement
    succeeds as on the twin and p=1's old file resolves by (path, checksum) (the hook keeps
    what goes, it never refuses what Spark does to one table's own files)."""
    verb = statement.split()[0].lower()
    for t in (f"bs_{verb}_twin", f"bs_{verb}"):
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT, p INT) USING parquet PARTITIONED BY (p)")
        lake.sql(f"INSERT INTO {DB}.{t} VALUES (1, 1)")
        lake.sql(f"ALTER TABLE {DB}.{t} ADD PARTITION (p=9) "
                 f"LOCATION '{lake.warehouse / f'{DB}.db' / (t + '_p9')}'")
        lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p=9) VALUES (9)")
    with hook_off(lake):
        lake.sql(statement.format(t=f"{DB}.bs_{verb}_twin"))
    twin = rows(lake, f"SELECT a, p FROM {DB}.bs_{verb}_twin")
    t = f"bs_{verb}"
    old = kept(tdir(lake, t))
    err, events = attempt(lake, statement.format(t=f"{DB}.{t}"))
    assert err is None, err
    assert rows(lake, f"SELECT a, p FROM {DB}.{t}") == twin, brief(events)
    assert unrecoverable(lake, old) == [], brief(events)


# -- 4. a partition column whose name starts with '.' --------------------------------------

@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_events_of_a_table_partitioned_by_a_dot_column_replay(
    lake: Lake, db: str, mode: str  # noqa: F811
) -> None:
    """FAILS: a parquet table PARTITIONED BY (`.p`): Spark writes `.p=1/` directories and
    reads them through the catalog's partition locations. Cmroot.dataFiles (recordInsert ->
    jobFiles) skips every '.' name on the way down (only a `_k=v` directory is read as a
    partition), and `.p=1` is a default place, so not in Ctx.partitionDirs either: no INSERT
    event names the new files. Sequence: INSERT INTO t VALUES (1, 1); then INSERT INTO /
    INSERT OVERWRITE TABLE t PARTITION (`.p`=1) SELECT 9. Expected: the recorded events
    replay to exactly the table's files (invariant 2/3)."""
    name = "dot_" + mode
    since = lake.daemon.current()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, `.p` INT) USING parquet PARTITIONED BY (`.p`)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1)")
    verb = "INTO" if mode == "append" else "OVERWRITE TABLE"
    err, _ = attempt(lake, f"INSERT {verb} {DB}.{name} PARTITION (`.p`=1) SELECT 9")
    assert err is None, err
    want = [(1, 1), (9, 1)] if mode == "append" else [(9, 1)]
    assert rows(lake, f"SELECT a, `.p` FROM {DB}.{name}") == want
    events = lake.daemon.events_after(since)
    now = data_all(tdir(lake, name))
    assert replica_diff(set(), now, events) == ([], []), brief(events)


# -- 5. a partition located at <t>/_temporary itself: the job's own output taken for data ---

def test_an_append_next_to_a_partition_at_temporary_records_only_its_new_file(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """FAILS: a parquet table t partitioned by p with p=1 at its default place and p=7 at
    '<t>/_temporary' (a custom location named like FileOutputCommitter's directory). An
    append INSERT INTO t PARTITION (p=1) VALUES (2): its job writes into
    <t>/_temporary/0/_temporary/attempt_.../p=1 and moves the files to <t>/p=1 at commit.
    Ctx.temporary judges a path in one of the table's directories by the names below EACH
    directory holding it, and returns "data" as soon as one says so: below p=7's location
    <t>/_temporary the job's path reads `0/_temporary/attempt_...` (no attempt number after
    `_temporary`), so the job's own temporary files are taken for p=7's data. The commit's
    renames are then handled as moves of data out of partition p=7 (CmrootLocalFileSystem
    .rename: prepareCopy + movedIn). Seen: a copy-mode DELETE event labelled p=7 naming the
    job's temporary file <t>/_temporary/0/.../part-..., and a second INSERT of the same new
    file. Expected: the statement's events are exactly one INSERT naming exactly its new
    file(s) in <t>/p=1; no event names a path of the job's temporary output (invariant 2:
    no phantom events)."""
    name = "tmpx"
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1)")
    loc = tdir(lake, name) / "_temporary"
    lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=7) LOCATION '{loc}'")
    before = set(kept(tdir(lake, name) / "p=1"))
    err, events = attempt(lake, f"INSERT INTO {DB}.{name} PARTITION (p=1) VALUES (2)")
    assert err is None, err
    new = sorted(set(kept(tdir(lake, name) / "p=1")) - before)
    assert len(new) == 1
    temp = [f["path"] for e in events for f in e["files"] if "/_temporary/0/" in f["path"]]
    assert temp == [], brief(events)
    assert inserts(events) == [([{"p": "1"}], new)], brief(events)


# -- 6. the null partition: one spelling in every event ------------------------------------

def test_insert_into_the_null_partition_is_labelled_as_its_truncate(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe. A parquet table with partitions p=4 and p=NULL (<t>/p=__HIVE_DEFAULT_PARTITION__,
    its default place though the catalog's spec may hold null). INSERT INTO t VALUES (3,
    NULL) records an INSERT labelled as the TRUNCATE of that partition is (review 4:
    [{p: __HIVE_DEFAULT_PARTITION__}]), not [{p: null}] (Cmroot.isDefaultPartitionDir
    comparing the directory's text with a null value would make it a custom location)."""
    lake.sql(f"CREATE TABLE {DB}.nulp (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.nulp VALUES (1, 4), (2, NULL)")
    err, events = attempt(lake, f"INSERT INTO {DB}.nulp VALUES (3, NULL)")
    assert err is None, err
    got = inserts(events)
    assert [g[0] for g in got] == [[{"p": "__HIVE_DEFAULT_PARTITION__"}]], brief(events)


# -- 7. a static NULL partition value of a Hive-format insert ------------------------------

@pytest.mark.parametrize("stmt", [
    "INSERT INTO {t} PARTITION (p=NULL, q) SELECT 9, 5",
    "INSERT OVERWRITE TABLE {t} PARTITION (p=NULL, q) SELECT 9, 5",
    "INSERT OVERWRITE TABLE {t} PARTITION (p=NULL, q=5) SELECT 9",
])
def test_hive_insert_with_a_static_null_partition_value_runs_as_without_the_hook(
    lake: Lake, db: str, stmt: str  # noqa: F811
) -> None:
    """FAILS: a Hive-format table (TEXTFILE) PARTITIONED BY (p STRING, q INT) holding
    (p=NULL, q=5) and (p='a', q=5). A Hive insert naming a static NULL value, `PARTITION
    (p=NULL, q)`: Spark's InsertIntoHiveTable maps Some(null) to __HIVE_DEFAULT_PARTITION__
    and runs (a twin with the hook off shows it). CmrootCommands.contextOf builds the
    statement's static spec from c.partition() with the null value, and Ctx.withStaticSpec
    copies it with Map.copyOf, which refuses null values: the statement dies with a
    NullPointerException before it starts. Expected: the same rows as the twin, every old
    file of the overwritten partition resolves by (path, checksum), nothing left staged."""
    n = "snl_" + ("app" if stmt.startswith("INSERT INTO") else
                  "dyn" if "q)" in stmt else "sta")
    for t in (n + "_twin", n):
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (p STRING, q INT) "
                 "STORED AS TEXTFILE")
        lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p, q) VALUES (1, NULL, 5), (2, 'a', 5)")
    with hook_off(lake):
        lake.sql(stmt.format(t=f"{DB}.{n}_twin"))
    twin = rows(lake, f"SELECT a, p, q FROM {DB}.{n}_twin")
    before = kept(tdir(lake, n))
    err, events = attempt(lake, stmt.format(t=f"{DB}.{n}"))
    assert err is None, err
    assert rows(lake, f"SELECT a, p, q FROM {DB}.{n}") == twin, brief(events)
    assert unrecoverable(lake, before) == [], brief(events)
    assert staging(lake) == []

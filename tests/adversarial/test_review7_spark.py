"""Seventh hostile review of the Spark hook: 6e765c4 (Ctx.temporary / Cmroot.temporaryBelow:
only the names below a statement table's own location, or a partition's own, can make a path a
job's temporary output; filesUnder judges below the directory it lists; LOAD DATA INPATH moves
data whatever it is called), 1af5b78 (CmrootCommitProtocol.stageReplaced: a Hive overwrite
stages the old files of every partition directory found in the job's staging output at job
commit), 440d8a3 (prepareLoad), 7f4dc36 (DROP PARTITION / TRUNCATE specs normalized). Real
PySpark local[2] with its embedded metastore, a real daemon, real files; one session for the
whole module (tests/spark/conftest.py's `lake`).

Each test asserts what DESIGN.md's invariants promise. A test whose docstring starts with
"FAILS:" failed on the reviewed code with the symptom it describes; "Probe" tests pass and pin
a sequence."""

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
    outer_and_inner,
    replica_diff,
    rows,
    staging,
    unrecoverable,
)
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake, app_conf

pytestmark = pytest.mark.timeout(600)

DB = "rev7"
UUID = "0123abcd-4567-89ab-cdef-0123456789ab"
# Hive's staging shape under a name Hive-format reads accept (FileInputFormat refuses an input
# path whose own name is hidden, so a Hive table cannot be read at ".hive-staging_...").
HIVE_STG = "stg_hive_2024-01-01_00-00-00_000_1-1"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table



def hook_off(lake: Lake) -> Any:  # noqa: F811
    return app_conf(lake.spark, "spark.cmroot.enabled", "false")


def with_conf(lake: Lake, key: str, value: str) -> Any:  # noqa: F811
    """A session SQL conf for the duration (SET ... then back to what it was)."""
    class _C:
        def __enter__(self) -> None:
            self.old = lake.spark.conf.get(key, None)
            lake.spark.conf.set(key, value)

        def __exit__(self, *a: Any) -> None:
            if self.old is None:
                lake.spark.conf.unset(key)
            else:
                lake.spark.conf.set(key, self.old)
    return _C()


# -- 1. LOAD DATA INPATH: a staging-shaped directory one level down ------------------------

@pytest.mark.parametrize("inner", ["run_hive_2024-01-05_10-00-00_000_123-1", "_temporary/7"])
def test_load_data_moves_a_nested_staging_shaped_directory_it_never_kept(
    lake: Lake, db: str, inner: str  # noqa: F811
) -> None:
    """FAILS: another table `src` holds a.txt and a sub-directory `sub/` whose own
    sub-directory is named like a job's staging output (`sub/<inner>/b.txt`).
    `LOAD DATA INPATH '<src dir>' INTO TABLE dst`: Hive moves a.txt and `sub` (whole, one
    rename) into dst. Review 6 fixed the case where the staging-shaped directory is a direct
    entry of the load path; one level down, prepareLoad keeps Cmroot.filesUnder(sub), and
    filesUnder skips what is staging-shaped BELOW `sub`, and so does the rename's own list:
    b.txt leaves src with nothing kept at its path and no INSERT naming its new one.
    Seen: b.txt 'missing' at its old path (it sits in dst/sub/<inner>/b.txt); events: DELETE
    (copy) of a.txt, INSERT of dst/a.txt, and an INSERT with NO files for the move of `sub`.
    Expected: every file that left src resolves by (old path, checksum) (invariant 1) and the
    events replay dst to its files (invariant 3)."""
    name = "ldn" + str(len(inner))
    lake.sql(f"CREATE TABLE {DB}.{name}dst (a INT) STORED AS TEXTFILE")
    lake.sql(f"CREATE TABLE {DB}.{name}src (a INT) STORED AS TEXTFILE")
    src = tdir(lake, name + "src")
    src.mkdir(parents=True, exist_ok=True)
    (src / "a.txt").write_text("1\n")
    deep = src / "sub" / inner
    deep.mkdir(parents=True)
    (deep / "b.txt").write_text("2\n")
    before = kept(src)
    assert len(before) == 2
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.{name}dst")
    assert err is None, err
    after = set(kept(tdir(lake, name + "dst")))
    assert unrecoverable(lake, before) == [], brief(events)
    assert replica_diff(set(before), after, events) == ([], []), brief(events)



def overwrite_partition_at(lake: Lake, table: str, tloc: Path, fmt: str, where: str) -> None:  # noqa: F811
    """CREATE `table` (`fmt`, partitioned by p); ADD PARTITION (p=7) LOCATION
    '<tloc>/<where>'; INSERT a row into it; INSERT OVERWRITE it. Asserts the table then
    holds only the new row and the old file resolves by (path, checksum) (invariant 1)."""
    cols = "(a INT, p INT) USING parquet PARTITIONED BY (p)" if fmt.startswith("USING") \
        else "(a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE"
    lake.sql(f"CREATE TABLE {table} {cols}")
    loc = tloc / where
    lake.sql(f"ALTER TABLE {table} ADD PARTITION (p=7) LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {table} PARTITION (p=7) VALUES (1)")
    old = kept(loc)
    assert old and rows(lake, f"SELECT a, p FROM {table}") == [(1, 7)]
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {table} PARTITION (p=7) SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a, p FROM {table}") == [(2, 7)], brief(events)
    assert unrecoverable(lake, old) == [], brief(events)

# -- 2. a partition located INSIDE its table at a temporary-shaped place -------------------

@pytest.mark.parametrize(("fmt", "where"), [
    ("USING parquet", "_temporary/7"),
    ("USING parquet", f".spark-staging-{UUID}"),
    ("STORED AS TEXTFILE", "_temporary/7"),
    ("STORED AS TEXTFILE", HIVE_STG),
])
def test_overwrite_of_a_partition_located_inside_its_table_at_a_temporary_shaped_place(
    lake: Lake, db: str, fmt: str, where: str  # noqa: F811
) -> None:
    """FAILS: review 5/6 protect a partition registered at a temporary-shaped place
    OUTSIDE its table (`<t>_parts/_temporary/7`). Inside the table's own location it is
    not: Ctx.partitionDirs (CmrootCommands.customPartitions) holds only locations outside
    the table, so Ctx.temporary judges the partition's files by the names below the TABLE
    location, finds `_temporary/7` (or a Hive / Spark staging name) and calls them a job's
    temporary output. Sequence: ALTER TABLE t ADD PARTITION (p=7) LOCATION
    '<t>/<where>'; INSERT INTO t PARTITION (p=7) VALUES (1); INSERT OVERWRITE TABLE t
    PARTITION (p=7) SELECT 2. Seen: the table holds (2, 7) but the old file is 'missing'
    (deleted raw: CommitProtocol.deleteWithJob / CmrootLocalFileSystem.delete judge it
    temporary), and no INSERT_OVERWRITE event is recorded (for parquet no event at all:
    recordInsert's Cmroot.dataFiles skips `_temporary` / `.spark-staging-...` too).
    Expected: t holds (2, 7) and the old file resolves by (path, checksum) (invariant 1)."""
    name = "pin_" + fmt.split()[-1].lower()[:4] + "_" + where[:3].strip("./_")
    overwrite_partition_at(lake, f"{DB}.{name}", tdir(lake, name), fmt, where)


# -- 3. a table located inside another one at `_temporary/7` -------------------------------

def test_overwrite_of_a_table_that_holds_another_table_at_temporary_7(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Held since the job's clean-up leaves what numbered directories hold that no committer
    writes (Cmroot.dataInAttempts); it failed before. Table `inner` is located at
    '<outer dir>/_temporary/7' (6e765c4: "a table
    located at x/_temporary/7 is overwritten ... and recorded like any other"); here x is
    another table, `outer` (USING parquet). `INSERT OVERWRITE TABLE outer SELECT 2`: its
    FileOutputCommitter writes in <outer>/_temporary/0 and, at job commit, deletes
    <outer>/_temporary whole. That delete is judged with outer's context: below outer's
    location `_temporary` holds only attempt-like directories (0 and 7), so it is a job's
    temporary output and is deleted raw: inner's data file is gone, not kept. Expected:
    inner's file is still at its path or resolves from the cmroot (invariant 1)."""
    lake.sql(f"CREATE TABLE {DB}.nsto (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.nsto VALUES (1)")
    inner = tdir(lake, "nsto") / "_temporary" / "7"
    lake.sql(f"CREATE TABLE {DB}.nsti (a INT) USING parquet LOCATION '{inner}'")
    lake.sql(f"INSERT INTO {DB}.nsti VALUES (5)")
    old_inner = kept(inner)
    old_outer = {p: b for p, b in kept(tdir(lake, "nsto")).items() if p not in old_inner}
    assert old_inner and rows(lake, f"SELECT a FROM {DB}.nsti") == [(5,)]
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.nsto SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.nsto") == [(2,)]
    assert unrecoverable(lake, old_outer) == [], brief(events)
    assert unrecoverable(lake, old_inner) == [], (sorted(os.listdir(tdir(lake, "nsto"))),
                                                   brief(events))


def test_drop_of_a_table_that_holds_another_table_at_temporary_7(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe: DROP TABLE of a managed table `outer` whose directory holds another table
    `inner` at <outer>/_temporary/7. Spark deletes outer's directory whole; inner's data
    file goes with the drop's recycle, recorded with it, and resolves from the cmroot
    (invariant 1), whatever the clean-up rules for attempt directories say."""
    inner = outer_and_inner(lake, DB, "ndro", "ndri", "_temporary/7")
    old = kept(tdir(lake, "ndro"))
    assert any(p.startswith(str(inner)) for p in old), old
    err, events = attempt(lake, f"DROP TABLE {DB}.ndro")
    assert err is None, err
    assert not tdir(lake, "ndro").exists()
    assert unrecoverable(lake, old) == [], brief(events)
    [drop] = [e for e in events if e["eventType"] == "DROP_TABLE"]
    assert set(old) <= {f["path"] for f in drop["files"]}


# -- 4. stageReplaced: the partition directory is guessed from the staging layout ----------

@pytest.mark.parametrize("case", ["static_and_dynamic", "custom_location_inside"])
def test_hive_overwrite_stages_only_the_partitions_it_replaces(
    lake: Lake, db: str, case: str  # noqa: F811
) -> None:
    """FAILS: CmrootCommitProtocol.stageReplaced stages, at job commit, the older entries of
    `<table location>/<directory found in the job's staging output>` (a custom location is
    looked up only among Ctx.partitionDirs, the partitions OUTSIDE the table). That is not
    the directory Hive replaces:
    - static_and_dynamic: `INSERT OVERWRITE TABLE t PARTITION (p=1, q) SELECT 9, 5` writes
      its output as `q=5/` (only the dynamic column is in the staging path: Spark's
      writtenParts); Hive replaces <t>/p=1/q=5, stageReplaced stages <t>/q=5.
    - custom_location_inside: partition p=1 is located at <t>/custom1 (ALTER TABLE ADD
      PARTITION ... LOCATION inside the table); a dynamic `INSERT OVERWRITE TABLE t
      PARTITION (p) SELECT 9, 1` has Hive replace <t>/custom1, stageReplaced stages <t>/p=1.
    Here the guessed directory is the location of another table `b` (one data file). Seen:
    b's file leaves b, committed with t's INSERT_OVERWRITE event (partitions [{q: 5}, ...]);
    b is empty. With the hook off (a twin) b keeps its row. Expected: b keeps its rows and
    no event records one of b's files as leaving (invariant 2/3: a statement removes what it
    replaces, and only that)."""
    n = "srm" if case == "static_and_dynamic" else "srci"
    for t in (n + "_twin", n):
        if case == "static_and_dynamic":
            lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (p INT, q INT) "
                     "STORED AS TEXTFILE")
            lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p=1, q=5) VALUES (1)")
            bloc = tdir(lake, t) / "q=5"
        else:
            lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
            lake.sql(f"ALTER TABLE {DB}.{t} ADD PARTITION (p=1) "
                     f"LOCATION '{tdir(lake, t) / 'custom1'}'")
            lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p=1) VALUES (1)")
            bloc = tdir(lake, t) / "p=1"
        lake.sql(f"CREATE TABLE {DB}.{t}b (a INT) STORED AS TEXTFILE LOCATION '{bloc}'")
        lake.sql(f"INSERT INTO {DB}.{t}b VALUES (7)")
    stmt = ("INSERT OVERWRITE TABLE {} PARTITION (p=1, q) SELECT 9, 5"
            if case == "static_and_dynamic" else
            "INSERT OVERWRITE TABLE {} PARTITION (p) SELECT 9, 1")
    with hook_off(lake):
        lake.sql(stmt.format(f"{DB}.{n}_twin"))
    assert rows(lake, f"SELECT a FROM {DB}.{n}_twinb") == [(7,)]  # Spark alone: b untouched
    assert rows(lake, f"SELECT a FROM {DB}.{n}_twin") == [(9,)]
    b_before = kept(tdir(lake, n) / bloc.name)
    err, events = attempt(lake, stmt.format(f"{DB}.{n}"))
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{n}") == [(9,)], brief(events)
    assert rows(lake, f"SELECT a FROM {DB}.{n}b") == [(7,)], brief(events)
    assert kept(tdir(lake, n) / bloc.name) == b_before, brief(events)
    leaving = [f["path"] for e in events if e["eventType"] != "INSERT"
               for f in e["files"] if f["path"] in b_before]
    assert leaving == [], brief(events)


# -- 5. INSERT OVERWRITE DIRECTORY over a directory holding a table at a staging name -------

@pytest.mark.parametrize("where", [
    "_temporary/7",
    pytest.param(HIVE_STG, marks=pytest.mark.xfail(strict=True, reason=(
        "open: a table located at a Hive-staging-shaped place (<dir>/stg_hive_...) inside"
        " another statement's output is taken for that statement's own staging output and"
        " the directory overwrite deletes it raw; telling them apart needs the catalog"
        " (which table owns a path) or the directory's birth time"))),
])
def test_hive_insert_overwrite_directory_keeps_a_table_located_below_it(
    lake: Lake, db: str, where: str  # noqa: F811
) -> None:
    """FAILS for a Hive-staging-shaped name (the `_temporary/7` case holds: an attempt
    directory's data is left in place by the job's clean-up, see Cmroot.dataInAttempts):
    `INSERT OVERWRITE DIRECTORY '<wh>/rev7.db/exp' STORED AS TEXTFILE SELECT 1`
    (InsertIntoHiveDirCommand) deletes every entry of the directory (fs.listStatus, no
    hidden filter) before it moves its output in. A table `t` is located at
    '<wh>/rev7.db/exp/<where>' (a `_temporary/7`, or a Hive-staging-shaped name: data, as
    6e765c4 says of a table located there). The statement's context is the directory's;
    Ctx.temporary judges names below it and finds a job's temporary output, so the delete of
    exp/_temporary (exp/stg_hive_...) goes to the raw file system: t's data file is
    gone. Seen: t's file 'missing', the directory holds only the statement's output, no
    event recorded. Expected: t's file resolves by (path, checksum) (invariant 1: a file
    under a warehouse root removed by a hooked INSERT OVERWRITE)."""
    name = "iod" + str(len(where))
    exp = tdir(lake, name)
    loc = exp / where
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) STORED AS TEXTFILE LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (5)")
    old = kept(loc)
    assert old and rows(lake, f"SELECT a FROM {DB}.{name}") == [(5,)]
    err, events = attempt(lake, f"INSERT OVERWRITE DIRECTORY '{exp}' STORED AS TEXTFILE "
                                "SELECT 1")
    assert err is None, err
    assert unrecoverable(lake, old) == [], (sorted(os.listdir(exp)), brief(events))


# -- 6. hidden-looking partition directories: Spark reads `_p=1`, the hook never lists it ---

@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_events_of_a_table_partitioned_by_an_underscore_column_replay(
    lake: Lake, db: str, mode: str  # noqa: F811
) -> None:
    """FAILS: a parquet table PARTITIONED BY (_src) (a column name starting with '_':
    Spark writes `_src=1/` directories and reads them: InMemoryFileIndex drops a '_' name
    only when it has no '='). INSERT INTO t VALUES (1, 1), (2, 2) (recorded by the
    metastore's ADD_PARTITION); then INSERT OVERWRITE of _src=1 (static, or dynamic
    partition overwrite). The overwrite's recycle lists _src=1's old file (Cmroot.filesUnder:
    INSERT_OVERWRITE event), but recordInsert lists the job's new files with
    Cmroot.dataFiles, which skips every '_' / '.' name on the way down: no INSERT event
    names the new file. Seen: events CREATE_TABLE, ADD_PARTITION, INSERT_OVERWRITE and
    nothing else; a replica ends with _src=1 empty while the table holds (9, 1). Expected:
    the recorded events replay to exactly the table's files (invariant 3)."""
    name = "usc_" + mode
    since = lake.daemon.current()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, _src INT) USING parquet PARTITIONED BY (_src)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1), (2, 2)")
    old = kept(tdir(lake, name) / "_src=1")
    assert old
    if mode == "static":
        err, _ = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{name} PARTITION (_src=1) "
                               "SELECT 9")
    else:
        with with_conf(lake, "spark.sql.sources.partitionOverwriteMode", "dynamic"):
            err, _ = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{name} "
                                   "PARTITION (_src) SELECT 9, 1")
    assert err is None, err
    assert rows(lake, f"SELECT a, _src FROM {DB}.{name}") == [(2, 2), (9, 1)]
    events = lake.daemon.events_after(since)
    assert unrecoverable(lake, old) == [], brief(events)
    assert replica_diff(set(), set(kept(tdir(lake, name))), events) == ([], []), brief(events)


# -- 7. LOAD DATA ... OVERWRITE of a directory inside the destination table ---------------

def test_load_overwrite_from_a_directory_inside_the_table(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe (passes: Hive fails with "Unable to move source ... landing", and the hook puts
    old.txt and landing/new.txt back, records nothing, leaves nothing staged). dst (Hive,
    TEXTFILE) holds old.txt and a landing directory `landing/new.txt` in its own location.
    `LOAD DATA INPATH '<dst>/landing' OVERWRITE INTO TABLE dst`: Hive's replaceFiles
    deletes every (non-hidden) entry of dst first -- the landing directory itself among
    them -- then moves the load path's files in. prepareLoad keeps nothing (the path is in
    the statement's own table). Expected either way (invariant 1/2): if the statement
    succeeds, every file that left (old.txt, landing/new.txt) resolves by (path, checksum)
    and the events replay dst to its files; if it fails, every file is where it was,
    nothing is recorded, nothing is left staged."""
    lake.sql(f"CREATE TABLE {DB}.lio (a INT) STORED AS TEXTFILE")
    d = tdir(lake, "lio")
    d.mkdir(parents=True, exist_ok=True)
    (d / "old.txt").write_text("1\n")
    (d / "landing").mkdir()
    (d / "landing" / "new.txt").write_text("2\n")
    before = kept(d)
    err, events = attempt(lake, f"LOAD DATA INPATH '{d / 'landing'}' OVERWRITE "
                                f"INTO TABLE {DB}.lio")
    after = kept(d)
    if err is None:
        assert unrecoverable(lake, before) == [], brief(events)
        assert replica_diff(set(before), set(after), events) == ([], []), brief(events)
    else:
        assert (after, brief(events), staging(lake)) == (before, [], []), err


# -- 8. DROP PARTITION with specs naming one partition twice ------------------------------

def test_drop_partition_with_overlapping_specs(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe (passes). `ALTER TABLE t DROP PARTITION (p=1), PARTITION (p=1, q=2)` on a
    table partitioned by (p, q) holding (1,2), (1,3), (2,2): Spark drops (1,2) and (1,3)
    once each (a twin with the hook off). CmrootDropPartitions.stage lists the partitions
    of each spec and sends them all in one prepare: (1,2)'s directory twice. Expected: the
    same partitions remain as on the twin, every dropped file resolves by (path, checksum),
    the events replay the table to its files, nothing is left staged."""
    def make(t: str) -> None:
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT, p INT, q INT) USING parquet "
                 "PARTITIONED BY (p, q)")
        lake.sql(f"INSERT INTO {DB}.{t} VALUES (1, 1, 2), (2, 1, 3), (3, 2, 2)")

    spec = "PARTITION (p=1), PARTITION (p=1, q=2)"
    make("dov_twin")
    with hook_off(lake):
        lake.sql(f"ALTER TABLE {DB}.dov_twin DROP {spec}")
    twin = sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.dov_twin"))
    make("dov")
    before = kept(tdir(lake, "dov"))
    err, events = attempt(lake, f"ALTER TABLE {DB}.dov DROP {spec}")
    assert err is None, err
    assert sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.dov")) == twin
    after = kept(tdir(lake, "dov"))
    assert unrecoverable(lake, before) == [], brief(events)
    assert replica_diff(set(before), set(after), events) == ([], []), brief(events)
    assert staging(lake) == []

"""Eighth hostile review of the Spark hook: 765ad79 (Ctx.partitionDirs holds every partition
not at its default k=v path below the table, CmrootCommands.customPartitions;
CmrootCommitProtocol.stageReplaced stages the partition Hive replaces by the statement's
static values plus the output's dynamic ones, located by the session catalog; jobFiles lists
every catalog directory of the table; Cmroot.isHiddenName: a '_' name with '=' is data;
Cmroot.filesUnder(dir, false) for LOAD DATA). Real PySpark local[2] with its embedded
metastore, a real daemon, real files; one session for the whole module (tests/spark/
conftest.py's `lake`).

Each test asserts what DESIGN.md's invariants promise (and, with a twin table run with the
hook off, that the hook never changes what Spark does to the data, only keeps what goes). A
test whose docstring starts with "FAILS:" failed on the reviewed code with the symptom it
describes; "Probe" tests pass and pin a sequence."""

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
    rows,
    staging,
    unrecoverable,
)
from tests.adversarial.test_review7_spark import overwrite_partition_at
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake, app_conf

pytestmark = pytest.mark.timeout(600)

DB = "rev8"
UUID = "0123abcd-4567-89ab-cdef-0123456789ab"
# Hive's staging shape under a name Hive-format reads accept (see test_review7_spark).
HIVE_STG = "stg_hive_2024-01-01_00-00-00_000_1-1"
ADDING = ("INSERT", "ADD_PARTITION", "CREATE_TABLE", "ALTER_LOCATION")


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table



def contents(d: Path) -> list[bytes]:
    """The bytes of every regular file directly in `d` but checksum files and _SUCCESS,
    sorted: what two twin tables can be compared by (their file names carry job ids)."""
    if not d.is_dir():
        return []
    return sorted(p.read_bytes() for p in d.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name != "_SUCCESS")


def hook_off(lake: Lake) -> Any:  # noqa: F811
    return app_conf(lake.spark, "spark.cmroot.enabled", "false")


def left_but_present(events: list[dict[str, Any]]) -> list[str]:
    """Files an event records as leaving (any non-adding event) that are still at their
    path with the recorded checksum: a replica replaying the log would delete them."""
    from cmroot import checksum as cks

    out = []
    for e in events:
        if e["eventType"] in ADDING:
            continue
        for f in e["files"]:
            p = Path(f["path"])
            if p.is_file() and cks.of_bytes(p.read_bytes()) == f.get("checksum"):
                out.append(f["path"])
    return out


# -- 1. a partition at a temporary-shaped place inside its table, with a k=v tail ----------

@pytest.mark.parametrize(("fmt", "where"), [
    ("USING parquet", "_temporary/7/p=7"),
    ("USING parquet", f".spark-staging-{UUID}/p=7"),
    ("STORED AS TEXTFILE", f"{HIVE_STG}/p=7"),
    ("STORED AS TEXTFILE", "_temporary/7/p=7"),
])
def test_overwrite_of_a_partition_at_a_temporary_shaped_place_ending_in_its_kv_path(
    lake: Lake, db: str, fmt: str, where: str  # noqa: F811
) -> None:
    """FAILS: 765ad79 puts in Ctx.partitionDirs every partition whose location is not "the
    k=v/... path below the table that its spec gives", but CmrootCommands.customPartitions
    tests that with Cmroot.partitionOf(dir, location, true), which (with a base) skips the
    segments without '=' instead of refusing them: a partition p=7 registered at
    '<t>/_temporary/7/p=7' (or '<t>/.spark-staging-<uuid>/p=7', '<t>/stg_hive_..._1-1/p=7')
    parses to {p: 7} == its spec and is taken for a partition at its default place. So
    it is left out of partitionDirs, and Ctx.temporary judges its files by the names below
    the TABLE: a job's temporary output (review 7's bug, with one more path segment).
    Sequence: ALTER TABLE t ADD PARTITION (p=7) LOCATION '<t>/<where>'; INSERT INTO t
    PARTITION (p=7) VALUES (1); INSERT OVERWRITE TABLE t PARTITION (p=7) SELECT 2.
    Seen (all four): t holds (2, 7) but the old file is 'missing' (deleted raw; no
    INSERT_OVERWRITE event). Expected: t holds (2, 7) and the old file resolves by (path,
    checksum) (invariant 1)."""
    name = "pkv_" + fmt.split()[-1].lower()[:4] + "_" + where[:3].strip("./_")
    overwrite_partition_at(lake, f"{DB}.{name}", tdir(lake, name), fmt, where)


# -- 2. `_x=1`: data to the hook now, hidden to Hive ---------------------------------------

@pytest.mark.parametrize("case", ["table", "load_overwrite"])
def test_hive_overwrite_leaves_a_file_hive_calls_hidden(
    lake: Lake, db: str, case: str  # noqa: F811
) -> None:
    """FAILS: a Hive-format (TEXTFILE) table's directory holds, next
    to its data file, a file named `_x=1`. Hive's replace (Hive.replaceFiles ->
    FileUtils.HIDDEN_FILES_PATH_FILTER: every name starting with '_' or '.') never deletes
    it, and Hive's reads never read it: with the hook off (a twin) it stays. 765ad79 made
    Cmroot.isHiddenName call a '_' name with '=' data (Spark's file index rule), and
    CmrootStatement.olderEntries uses it: stageReplaced (static + dynamic overwrite), and
    the first per-file delete of Hive's replace (replacedByHive -> olderSiblings), stage
    `_x=1` with the old data file and commit it as left with the INSERT_OVERWRITE.
    Sequences: INSERT OVERWRITE TABLE t SELECT 9; LOAD DATA INPATH '<file>' OVERWRITE INTO
    TABLE t. Seen: the table directory holds only the new file; `_x=1` is in the cmroot,
    listed by the INSERT_OVERWRITE event. (An overwrite of a PARTITION, static or dynamic,
    is not a case: Spark itself deletes the partition's directory whole first, `_x=1`
    included, as the twin shows.)
    Expected: the directory ends as the twin's (`_x=1` still there); the hook keeps what
    goes and changes nothing Spark does (invariant 2), and no event records `_x=1` as
    leaving while it is in place (invariant 3)."""
    n = {"table": "hxt", "load_overwrite": "hxl"}[case]
    dirs = {}
    for t in (n + "_twin", n):
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) STORED AS TEXTFILE")
        lake.sql(f"INSERT INTO {DB}.{t} VALUES (1)")
        d = tdir(lake, t)
        (d / "_x=1").write_text("hidden to Hive\n")
        dirs[t] = d
        if case == "load_overwrite":
            land = lake.warehouse / f"{DB}_landing_{t}"
            land.mkdir(parents=True, exist_ok=True)
            (land / "new.txt").write_text("9\n")
    stmt = {
        "table": "INSERT OVERWRITE TABLE {t} SELECT 9",
        "load_overwrite": "LOAD DATA INPATH '{land}' OVERWRITE INTO TABLE {t}",
    }[case]

    def sql(t: str) -> str:
        return stmt.format(t=f"{DB}.{t}",
                           land=lake.warehouse / f"{DB}_landing_{t}" / "new.txt")

    with hook_off(lake):
        lake.sql(sql(n + "_twin"))
    twin = contents(dirs[n + "_twin"])
    assert b"hidden to Hive\n" in twin  # Spark and Hive alone: `_x=1` stays
    assert rows(lake, f"SELECT a FROM {DB}.{n}_twin") == [(9,)]
    err, events = attempt(lake, sql(n))
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{n}") == [(9,)], brief(events)
    assert contents(dirs[n]) == twin, (sorted(os.listdir(dirs[n])), brief(events))
    assert left_but_present(events) == [], brief(events)


# -- 3. a Hive table partitioned by a '_' column: the hook replaces what Hive does not -----

@pytest.mark.parametrize("case", ["dynamic", "static_dynamic"])
def test_hive_dynamic_overwrite_of_an_underscore_partition_column_matches_spark(
    lake: Lake, db: str, case: str  # noqa: F811
) -> None:
    """FAILS: a Hive-format table PARTITIONED BY (_p INT) (or (p INT, _q INT)) STORED AS
    TEXTFILE holds partition _p=1 (a static INSERT). `INSERT OVERWRITE TABLE t PARTITION
    (_p) SELECT 9, 1`: Spark writes the job's output to Hive's staging directory as
    `_p=1/part-...`; Hive's loadDynamicPartitions lists the staging directory with its
    hidden-files filter, and `_p=1` is hidden to Hive. Whatever Hive does with it, the hook
    must do the same to the data: stageReplaced (765ad79) now finds `_p=1` in the staging
    output (Cmroot.isHiddenName: a '_' name with '=' is data), asks the catalog for
    partition {_p: 1}, and stages and commits its old file. Compared with a twin with the
    hook off. Seen: the twin's partition directory still holds its old file (b'1\n'; the
    statement succeeds); the hooked one is empty, its old file committed with an
    INSERT_OVERWRITE event [{_p: 1}] (resp. [{p: 1, _q: 1}]). Expected: the partition
    directory holds the same bytes as the twin's (invariant 2: the hook keeps what goes, it
    never removes what Spark keeps)."""
    n = "hup_" + case[:2]
    for t in (n + "_twin", n):
        if case == "dynamic":
            lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (_p INT) "
                     "STORED AS TEXTFILE")
            lake.sql(f"INSERT INTO {DB}.{t} PARTITION (_p=1) VALUES (1)")
        else:
            lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (p INT, _q INT) "
                     "STORED AS TEXTFILE")
            lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p=1, _q=1) VALUES (1)")
    stmt = ("INSERT OVERWRITE TABLE {} PARTITION (_p) SELECT 9, 1" if case == "dynamic"
            else "INSERT OVERWRITE TABLE {} PARTITION (p=1, _q) SELECT 9, 1")
    sub = "_p=1" if case == "dynamic" else "p=1/_q=1"
    twin_err = None
    with hook_off(lake):
        try:
            lake.sql(stmt.format(f"{DB}.{n}_twin"))
        except Exception as e:  # Spark alone may refuse it; then so must the hook
            twin_err = str(e).split("\n")[0]
    twin = contents(tdir(lake, n + "_twin") / sub)
    assert twin
    before = kept(tdir(lake, n))
    err, events = attempt(lake, stmt.format(f"{DB}.{n}"))
    assert (err is None) == (twin_err is None), (err, twin_err)
    assert contents(tdir(lake, n) / sub) == twin, (twin_err, brief(events))
    assert unrecoverable(lake, before) == [], brief(events)


# -- 4. LOAD DATA INPATH: a top-level `_x=1` Hive does not move ----------------------------

def test_load_data_records_no_departure_of_a_file_hive_leaves(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """FAILS: a directory under the warehouse root holds a.txt and a file `_x=1`.
    `LOAD DATA INPATH '<dir>' INTO TABLE dst` (Hive TEXTFILE): Hive's copyFiles lists the
    directory with FileUtils.HIDDEN_FILES_PATH_FILTER and moves a.txt only; `_x=1` stays
    (a twin with the hook off shows it). prepareLoad keeps every entry Cmroot.isHiddenName
    calls data, now `_x=1` too (765ad79), as a copy-mode part of the statement: the log
    records `_x=1` as having left (a DELETE event) while it is still in place with the same
    bytes. A replica replaying the log deletes it. Seen: a DELETE event (db/table none)
    listing <dir>/_x=1 and <dir>/a.txt, while `_x=1` is still at its path with that
    checksum. Expected: `_x=1` stays (as on the twin)
    and no event records a file leaving that is still at its path (invariant 3: the events
    replay to exactly the files)."""
    for t in ("ldh_twin", "ldh"):
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) STORED AS TEXTFILE")
        src = lake.warehouse / f"{DB}_src_{t}"
        src.mkdir(parents=True, exist_ok=True)
        (src / "a.txt").write_text("1\n")
        (src / "_x=1").write_text("2\n")
    with hook_off(lake):
        lake.sql(f"LOAD DATA INPATH '{lake.warehouse / f'{DB}_src_ldh_twin'}' "
                 f"INTO TABLE {DB}.ldh_twin")
    assert (lake.warehouse / f"{DB}_src_ldh_twin" / "_x=1").is_file()  # Hive leaves it
    src = lake.warehouse / f"{DB}_src_ldh"
    before = {str(src / "a.txt"): b"1\n"}
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldh")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.ldh") == [(1,)]
    assert (src / "_x=1").is_file()
    assert unrecoverable(lake, before) == [], brief(events)
    assert left_but_present(events) == [], brief(events)
    assert staging(lake) == []


# -- 5. nested custom partition locations: which partition a file is in --------------------

@pytest.mark.parametrize("case", ["chain", "kv_tail"])
def test_insert_into_nested_custom_partitions_records_the_partition_written(
    lake: Lake, db: str, case: str  # noqa: F811
) -> None:
    """FAILS: a parquet table whose partitions are located inside the table, each in the
    previous one's directory (ALTER TABLE ADD PARTITION ... LOCATION):
    - chain: p=1..5 at <t>/c, <t>/c/c, ... 765ad79 puts them all in Ctx.partitionDirs;
      Ctx.partitionOf returns the spec of the FIRST directory of partitionDirs that holds
      the path, in the iteration order of Map.copyOf (unspecified, salted per JVM), not the
      deepest. Seen: INSERT INTO t PARTITION (p=2) recorded as [{p: 1}] (3 of 5 wrong).
    - kv_tail (deterministic): p=1 at <t>/c, p=2 at <t>/c/p=2. customPartitions takes
      p=2 for a partition at its default place (its path ends in p=2, the non-k=v `c` is
      skipped) and leaves it out of partitionDirs; its new file is inside p=1's directory,
      so it is recorded as p=1's. Seen: the INSERT into p=2 recorded as [{p: 1}].
    `INSERT INTO t PARTITION (p=k) VALUES (k)` for each k. Expected: each INSERT event
    records the partition the statement wrote, [{p: k}] (invariant 3: the events replay to
    the table's files under the right partition spec)."""
    name = "nest_" + case
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    loc = tdir(lake, name)
    n = 5 if case == "chain" else 2
    for k in range(1, n + 1):
        loc = loc / ("c" if case == "chain" or k == 1 else f"p={k}")
        lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p={k}) LOCATION '{loc}'")
    wrong = []
    for k in range(1, n + 1):
        err, events = attempt(lake, f"INSERT INTO {DB}.{name} PARTITION (p={k}) VALUES ({k})")
        assert err is None, err
        ins = [e for e in events if e["eventType"] == "INSERT"]
        got = [e["partitions"] for e in ins]
        if got != [[{"p": str(k)}]]:
            wrong.append((k, got, brief(ins)))
    assert wrong == []


# -- 6. probe: dynamic values that need escaping, stageReplaced by the catalog -------------

def test_hive_static_dynamic_overwrite_with_escaped_values(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe. A Hive TEXTFILE table PARTITIONED BY (p STRING, q STRING) holds (p='a b/c',
    q='x=y%z') and (p='a b/c', q=NULL) and (p='a b/c', q='é'). `INSERT OVERWRITE TABLE t
    PARTITION (P='a b/c', q) SELECT ...` replaces all three (the static column named in
    another case, the dynamic values escaped in the staging output and in the table).
    Compared with a twin with the hook off. Expected: the same files' bytes in each
    partition as the twin, every old file resolves by (path, checksum), nothing staged."""
    vals = ["'x=y%z'", "NULL", "'é'"]
    for t in ("esc_twin", "esc"):
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) PARTITIONED BY (p STRING, q STRING) "
                 "STORED AS TEXTFILE")
        lake.sql(f"INSERT INTO {DB}.{t} PARTITION (p, q) VALUES "
                 + ", ".join(f"({i}, 'a b/c', {v})" for i, v in enumerate(vals)))
    stmt = ("INSERT OVERWRITE TABLE {} PARTITION (P='a b/c', q) VALUES "
            + ", ".join(f"({10 + i}, {v})" for i, v in enumerate(vals)))
    with hook_off(lake):
        lake.sql(stmt.format(f"{DB}.esc_twin"))
    twin = rows(lake, f"SELECT a, p, q FROM {DB}.esc_twin")
    before = kept(tdir(lake, "esc"))
    err, events = attempt(lake, stmt.format(f"{DB}.esc"))
    assert err is None, err
    assert rows(lake, f"SELECT a, p, q FROM {DB}.esc") == twin, brief(events)
    assert unrecoverable(lake, before) == [], brief(events)
    assert staging(lake) == []

"""Third hostile review of the Spark hook: TRUNCATE staged ahead (CmrootTruncate), the
overwrite's sibling batch (CmrootLocalFileSystem.replacedByHive, CmrootStatement.olderSiblings),
catalog DDL run as statements, LOAD DATA INPATH keeping moved bytes. Real PySpark local[2]
with its embedded metastore, a real daemon, real files.

Each test asserts what the README's Spark section or DESIGN.md promises and fails on the
current shim unless marked "probe"."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake
from tests.spark.test_spark_events import data_files
from tests.spark.test_spark_failure import error_chain

pytestmark = pytest.mark.timeout(600)

DB = "rev3"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


def run(lake: Lake, statement: str) -> list[dict[str, Any]]:  # noqa: F811
    since = lake.daemon.current()
    lake.sql(statement)
    return lake.daemon.events_after(since)


def brief(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["eventType"], e["table"], e["partitions"], sorted(f["path"] for f in e["files"]))
            for e in events]


def rows(lake: Lake, q: str) -> list[tuple[Any, ...]]:  # noqa: F811
    return sorted(tuple(r) for r in lake.sql(q))


def three_files(lake: Lake, name: str, fmt: str = "USING parquet") -> list[str]:  # noqa: F811
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) {fmt}")
    for i in range(3):
        lake.sql(f"INSERT INTO {DB}.{name} VALUES ({i})")
    files = sorted(data_files(tdir(lake, name)))
    assert len(files) == 3
    return files


# -- findings: TRUNCATE / DROP PARTITION staged by a looser match than Spark's ---------------

@pytest.mark.parametrize("statement", [
    "TRUNCATE TABLE {t} PARTITION (p=3)",
    "ALTER TABLE {t} DROP IF EXISTS PARTITION (p=3)",
])
def test_a_partial_spec_spark_matches_to_nothing_removes_nothing(
    lake: Lake, db: str, statement: str  # noqa: F811
) -> None:
    """A partition whose stored value is spelled '03' (a directory p=03 found by MSCK
    REPAIR): Spark's own lookup of the partial spec p=3 finds no partition, so the statement
    succeeds having truncated (dropped) nothing. The hook's looser match must not take the
    files of p=03 away behind a statement that did nothing."""
    name = "lspec_" + statement.split()[0].lower()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT, q INT) USING parquet PARTITIONED BY (p, q)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 4, 1)")
    [seed] = data_files(tdir(lake, name))
    odd = tdir(lake, name) / "p=03" / "q=1"
    odd.mkdir(parents=True)
    (odd / "x.parquet").write_bytes(Path(seed).read_bytes())
    lake.sql(f"MSCK REPAIR TABLE {DB}.{name}")
    parts = sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.{name}"))
    before = set(data_files(tdir(lake, name)))
    since = lake.daemon.current()
    err = None
    try:
        lake.sql(statement.format(t=f"{DB}.{name}"))
    except Exception as e:
        err = error_chain(e)[:600]
    events = lake.daemon.events_after(since)
    parts_after = sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.{name}"))
    # Without the hook (spark.cmroot.enabled=false) Spark matches nothing: no error, both
    # partitions and both files stay.
    assert err is None and parts_after == parts == ["p=03/q=1", "p=4/q=1"], (err, parts_after)
    assert set(data_files(tdir(lake, name))) == before, brief(events)
    assert [e for e in events if e["files"]] == [], brief(events)


# -- findings: LOAD DATA ---------------------------------------------------------------------

def _landing(tmp_path: Path, name: str, values: str = "41\n42\n") -> Path:
    f = tmp_path / name
    f.write_text(values)
    return f


def _replica_diff(before: set[str], after: set[str], events: list[dict[str, Any]]) -> Any:
    """What a replica replaying `events` over `before` would hold that the source does not,
    and the reverse (INSERT/ADD_PARTITION/ALTER_LOCATION add their files; every other event
    with files removes them)."""
    replica = set(before)
    for e in events:
        paths = {f["path"] for f in e["files"] if not os.path.basename(f["path"]).startswith(".")}
        if e["eventType"] in ("INSERT", "ADD_PARTITION", "CREATE_TABLE", "ALTER_LOCATION"):
            replica |= paths
        else:
            replica -= paths
    return sorted(replica - after), sorted(after - replica)


@pytest.mark.parametrize("verb", ["INTO", "OVERWRITE INTO"])
def test_load_data_local_inpath_records_an_insert(
    lake: Lake, db: str, tmp_path: Path, verb: str  # noqa: F811
) -> None:
    """README: LOAD DATA INPATH records INSERT {the files at the paths they were moved to}.
    LOCAL copies them (Hive copyFromLocalFile), but they land in the table all the same: a
    replica replaying the log must end with the same files."""
    name = "ldl_" + verb.split()[0].lower()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (7)")
    before = set(data_files(tdir(lake, name)))
    src = _landing(tmp_path, "local.txt")
    events = run(lake, f"LOAD DATA LOCAL INPATH '{src}' {verb} TABLE {DB}.{name}")
    after = set(data_files(tdir(lake, name)))
    want = [(7,), (41,), (42,)] if verb == "INTO" else [(41,), (42,)]
    assert rows(lake, f"SELECT a FROM {DB}.{name}") == want
    assert _replica_diff(before, after, events) == ([], []), brief(events)


def test_load_data_of_a_symlink_records_an_insert(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """README: LOAD DATA INPATH records INSERT. A landing path that is a symlink was moved
    into the table (the table reads its rows) with no event at all. cmroot never follows a
    symlink, so it could not record the new data: the load is refused before anything
    moves, wherever the link points."""
    lake.sql(f"CREATE TABLE {DB}.ldsym (a INT) STORED AS TEXTFILE")
    real = _landing(tmp_path, "real.txt")
    inside = lake.warehouse / "landing_rev3" / "real.txt"
    inside.parent.mkdir(parents=True, exist_ok=True)
    inside.write_bytes(real.read_bytes())
    for target in (real, inside):
        link = tmp_path / f"link-{target.parent.name}.txt"
        link.symlink_to(target)
        since = lake.daemon.current()
        with pytest.raises(Exception, match="cmroot refuses to move"):
            lake.sql(f"LOAD DATA INPATH '{link}' INTO TABLE {DB}.ldsym")
        assert link.is_symlink() and lake.daemon.events_after(since) == []
        assert rows(lake, f"SELECT a FROM {DB}.ldsym") == []


def test_load_data_of_a_file_of_the_same_table_into_another_partition(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """The file leaves p=1 for p=2: the log must say so (the INSERT into p=2 alone leaves a
    replica with the row in both partitions)."""
    lake.sql(f"CREATE TABLE {DB}.ldsame (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.ldsame PARTITION (p=1) VALUES (1)")
    lake.sql(f"INSERT INTO {DB}.ldsame PARTITION (p=2) VALUES (2)")
    before = set(data_files(tdir(lake, "ldsame")))
    [f] = data_files(tdir(lake, "ldsame") / "p=1")
    events = run(lake, f"LOAD DATA INPATH '{f}' INTO TABLE {DB}.ldsame PARTITION (p=2)")
    after = set(data_files(tdir(lake, "ldsame")))
    assert rows(lake, f"SELECT a, p FROM {DB}.ldsame") == [(1, 2), (2, 2)]
    assert _replica_diff(before, after, events) == ([], []), brief(events)


# -- findings: catalog DDL -------------------------------------------------------------------

def test_msck_repair_with_nothing_to_add_records_nothing(lake: Lake, db: str) -> None:  # noqa: F811
    """MSCK REPAIR that finds no new partition (so does SYNC PARTITIONS, after its
    DROP_PARTITION) records an ADD_PARTITION naming no partition."""
    lake.sql(f"CREATE TABLE {DB}.mnone (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.mnone VALUES (1, 1)")
    events = run(lake, f"MSCK REPAIR TABLE {DB}.mnone")
    assert brief(events) == []


# -- probes (pass; not covered elsewhere) ----------------------------------------------------

def test_truncate_of_two_partitions_sharing_a_directory(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe: Spark truncates such a table (it deletes the shared directory twice); the hook stages
    every file it empties: once each."""
    lake.sql(f"CREATE TABLE {DB}.trshare (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.trshare VALUES (1, 1)")
    shared = tdir(lake, "trshare") / "p=1"
    lake.sql(f"ALTER TABLE {DB}.trshare ADD PARTITION (p=9) LOCATION '{shared}'")
    before = set(data_files(tdir(lake, "trshare")))
    since = lake.daemon.current()
    err = None
    try:
        lake.sql(f"TRUNCATE TABLE {DB}.trshare")
    except Exception as e:
        err = error_chain(e)[:1500]
    events = lake.daemon.events_after(since)
    assert err is None, err
    assert set(data_files(tdir(lake, "trshare"))) == set(), brief(events)
    assert before <= {f["path"] for e in events for f in e["files"]}, brief(events)


def test_truncate_of_a_partition_nested_in_another(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe: the one prepare lists the nested partition's files under both directories."""
    lake.sql(f"CREATE TABLE {DB}.trnest (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.trnest VALUES (1, 1)")
    nested = tdir(lake, "trnest") / "p=1" / "sub"
    lake.sql(f"ALTER TABLE {DB}.trnest ADD PARTITION (p=9) LOCATION '{nested}'")
    lake.sql(f"INSERT INTO {DB}.trnest PARTITION (p=9) VALUES (9)")
    before = set(data_files(tdir(lake, "trnest")))
    since = lake.daemon.current()
    err = None
    try:
        lake.sql(f"TRUNCATE TABLE {DB}.trnest")
    except Exception as e:
        err = error_chain(e)[:1500]
    events = lake.daemon.events_after(since)
    assert err is None, err
    assert set(data_files(tdir(lake, "trnest"))) == set(), brief(events)
    assert before <= {f["path"] for e in events for f in e["files"]}, brief(events)


def test_truncate_with_a_file_written_after_its_staging(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """Probe: a writer adds a file to a partition between TRUNCATE's one prepare and Spark's
    delete of the directory: Spark deletes it, so it is recycled and listed (no loss)."""
    from tests.spark.sparklib import app_conf
    from tests.spark.test_spark_integrity import PAUSE, Paused

    lake.sql(f"CREATE TABLE {DB}.trlate (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.trlate VALUES (1, 1), (2, 2)")
    [seed] = data_files(tdir(lake, "trlate") / "p=1")
    seed_bytes = Path(seed).read_bytes()
    late = tdir(lake, "trlate") / "p=1" / "late.parquet"
    since = lake.daemon.current()
    with (
        app_conf(lake.spark, PAUSE, str(tmp_path / "fault")),
        Paused(lake, tmp_path, f"TRUNCATE TABLE {DB}.trlate") as paused,
    ):
        late.write_bytes(seed_bytes)
        paused.go()
    events = lake.daemon.events_after(since)
    assert paused.error is None, error_chain(paused.error)[:800]
    listed = {f["path"] for e in events for f in e["files"]}
    assert late.exists() or str(late) in listed, brief(events)


def test_load_data_into_a_custom_location_partition_names_it(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """Probe: LOAD DATA into a partition at a custom location names that partition."""
    lake.sql(f"CREATE TABLE {DB}.ldc (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    custom = lake.warehouse / "elsewhere3" / "ldc_p4"
    lake.sql(f"ALTER TABLE {DB}.ldc ADD PARTITION (p=4) LOCATION '{custom}'")
    src = _landing(tmp_path, "cpart.txt")
    events = run(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldc PARTITION (p=4)")
    ins = [e for e in events if e["eventType"] == "INSERT"]
    assert len(ins) == 1, brief(events)
    assert ins[0]["partitions"] == [{"p": "4"}], brief(events)
    assert {f["path"] for f in ins[0]["files"]} == set(data_files(custom)) != set()


def test_hive_ctas_failing_in_its_job_leaves_no_table_on_a_replica(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe: a Hive CTAS whose job fails (Spark drops the table it made)."""
    since = lake.daemon.current()
    with pytest.raises(Exception, match="boom"):
        lake.sql(f"CREATE TABLE {DB}.hctasf STORED AS TEXTFILE AS SELECT "
                 "IF(id > 0, CAST(raise_error('boom') AS INT), 1) AS a FROM range(4)")
    events = lake.daemon.events_after(since)
    assert not lake.spark.catalog.tableExists(f"{DB}.hctasf")
    kinds = [e["eventType"] for e in events if e["table"] == "hctasf"]
    assert kinds in ([], ["CREATE_TABLE", "DROP_TABLE"]), brief(events)


@pytest.mark.parametrize("statement", [
    "ALTER TABLE {t} ADD PARTITION (p=7)",
    "ALTER TABLE {t} PARTITION (p=1) RENAME TO PARTITION (p=8)",
    "MSCK REPAIR TABLE {t}",
])
def test_an_unrecorded_ddl_fails_saying_it_was_applied(
    lake: Lake, db: str, statement: str  # noqa: F811
) -> None:
    """Probe: DDL statements whose event cannot be recorded (daemon down) say so."""
    name = "dd_" + "".join(c for c in statement.split("{t}")[1][:12] if c.isalnum()).lower()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1)")
    if "MSCK" in statement:
        (tdir(lake, name) / "p=5").mkdir()
        (tdir(lake, name) / "p=5" / "x.parquet").write_bytes(
            Path(sorted(data_files(tdir(lake, name)))[0]).read_bytes())
    with lake.daemon.down(), pytest.raises(Exception) as info:
        lake.sql(statement.format(t=f"{DB}.{name}"))
    text = error_chain(info.value)
    assert "cmroot could not record" in text and "WAS applied" in text, text[:1500]

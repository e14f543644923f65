"""Fifth hostile review of the Spark hook: the review-4 fixes of 0b665a1 (typed partition
spec matching, catalog locations protected whatever their names, LOAD DATA's symlink
refusal / directory keeps / move-back on failure, the replace lock around a statement's
parts). Real PySpark local[2] with its embedded metastore, a real daemon, real files; one
session for the whole module (tests/spark/conftest.py's `lake`).

Each test asserts what DESIGN.md's invariants or the README's Spark section promise, and
fails while the bug its docstring describes is present. "Probe" tests pass and pin a
sequence."""

from __future__ import annotations

import os
from pathlib import Path

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

DB = "rev5"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


def parts(lake: Lake, table: str) -> list[str]:  # noqa: F811
    return sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.{table}"))



# -- 1. a full spec spelled differently from Spark's cast: the exact match wins -------------

@pytest.mark.parametrize(("name", "typ", "spark_dir", "spark_val", "odd_dir", "spec"), [
    ("ex_int", "INT", "p=3", "3", "p=03", "p='03'"),
    ("ex_date", "DATE", "p=2024-01-05", "DATE'2024-01-05'", "p=2024-1-5", "p='2024-1-5'"),
    ("ex_bool", "BOOLEAN", "p=true", "true", "p=TRUE", "p='TRUE'"),
    ("ex_ts", "TIMESTAMP", "p=2024-01-05 10%3A00%3A00", "TIMESTAMP'2024-01-05 10:00:00'",
     "p=2024-01-05 10%3A00", "p='2024-01-05 10:00'"),
])
def test_full_spec_spelled_as_another_stored_partition_drops_only_sparks_match(
    lake: Lake, db: str, name: str, typ: str, spark_dir: str, spark_val: str,  # noqa: F811
    odd_dir: str, spec: str,
) -> None:
    """A table partitioned by an INT (DATE) column holds p=3 (written by Spark) and p=03
    (a directory found by MSCK REPAIR: stored as the text '03'). `ALTER TABLE t DROP
    PARTITION (p='03')`: Spark casts '03' to the column type and drops p=3 (checked on a
    twin with the hook off: p=03 stays). CmrootDropPartitions.matching tries the spec AS
    WRITTEN first and, finding p=03 that way, never tries the typed spec: the hook stages
    p=03's files (the metastore listener then stages p=3's as well) and commits them with
    the DROP_PARTITION event. p=03 is still a partition of the table, but its data is gone
    from its path (invariant 2: a statement removes only what it drops; the event tells a
    replica to delete p=03's files, which the source still lists as live)."""
    def make(t: str) -> None:
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT, p {typ}) USING parquet PARTITIONED BY (p)")
        lake.sql(f"INSERT INTO {DB}.{t} VALUES (1, {spark_val})")
        seed = sorted(data_only(tdir(lake, t)))[0]
        odd = tdir(lake, t) / odd_dir
        odd.mkdir(parents=True)
        (odd / "x.parquet").write_bytes(Path(seed).read_bytes())
        lake.sql(f"MSCK REPAIR TABLE {DB}.{t}")

    make(name + "_twin")
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.sql(f"ALTER TABLE {DB}.{name}_twin DROP PARTITION ({spec})")
    assert parts(lake, name + "_twin") == [odd_dir]  # Spark alone: the typed match went
    make(name)
    odd_files = kept(tdir(lake, name) / odd_dir)
    err, events = attempt(lake, f"ALTER TABLE {DB}.{name} DROP PARTITION ({spec})")
    assert err is None, err
    assert parts(lake, name) == [odd_dir]
    assert kept(tdir(lake, name) / odd_dir) == odd_files, brief(events)
    dropped = {f["path"] for e in events for f in e["files"]}
    assert not dropped & set(odd_files), brief(events)


# -- 2. protectedLocation stopped at DROP/TRUNCATE: overwrites still use protectedPath ------

@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_overwrite_of_a_partition_at_a_temporary_shaped_location_recycles_it(
    lake: Lake, db: str, fmt: str  # noqa: F811
) -> None:
    """0b665a1 protects a catalog location "whatever its name" (a partition registered at
    `<wh>/rev5.db/tmpl_x/_temporary/7`) for DROP PARTITION, TRUNCATE and the metastore
    events. An INSERT OVERWRITE of that partition still decides with Cmroot.protectedPath
    (CmrootCommitProtocol.deleteWithJob for a datasource table, CmrootLocalFileSystem.delete
    for Hive's replaceFiles): the name looks like a committer attempt directory, so the old
    files are deleted for good. Sequence: ADD PARTITION (p=7) LOCATION '.../_temporary/7';
    INSERT INTO it; INSERT OVERWRITE TABLE t PARTITION (p=7) SELECT 2. Expected: the old
    files resolve by (path, checksum) (invariant 1) and the event lists them."""
    name = "tmpl_" + fmt.split()[-1].lower()
    cols = "(a INT, p INT) USING parquet PARTITIONED BY (p)" if fmt.startswith("USING") \
        else "(a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE"
    lake.sql(f"CREATE TABLE {DB}.{name} {cols}")
    loc = lake.warehouse / f"{DB}.db" / f"{name}_parts" / "_temporary" / "7"
    lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=7) LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p=7) VALUES (1)")
    old = kept(loc)
    assert old and rows(lake, f"SELECT a, p FROM {DB}.{name}") == [(1, 7)]
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{name} PARTITION (p=7) "
                                "SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a, p FROM {DB}.{name}") == [(2, 7)]
    assert unrecoverable(lake, old) == [], brief(events)


# -- 3. refuseSymlinks refuses loads Spark and the hook handled fine -------------------------

@pytest.mark.parametrize("local", [False, True])
def test_load_data_of_a_symlinked_landing_directory(
    lake: Lake, db: str, tmp_path: Path, local: bool  # noqa: F811
) -> None:
    """`/landing/current` is a symlink to `/landing/2024-01-05/` (the usual layout of a
    landing area). `LOAD DATA [LOCAL] INPATH '/landing/current' INTO TABLE t`: Hive lists
    the directory through the link and moves (LOCAL: copies) its regular files into t;
    before 0b665a1 the hook recorded them as an INSERT. CmrootStatementCommand.refuseSymlinks
    now refuses the statement because the path ITSELF is a symlink, though no file moved
    into the table is one (the files are regular; only their parent directory is reached
    through a link). Spark alone loads it (checked with the hook off). Expected: the load
    succeeds and its INSERT lists the table's new files (no regression)."""
    name = "ldcur_" + ("local" if local else "inpath")
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) STORED AS TEXTFILE")
    lake.sql(f"CREATE TABLE {DB}.{name}_twin (a INT) STORED AS TEXTFILE")
    for t in (name + "_twin", name):
        day = tmp_path / t / "2024-01-05"
        day.mkdir(parents=True)
        (day / "a.txt").write_text("1\n2\n")
        (tmp_path / t / "current").symlink_to(day, target_is_directory=True)
    kw = "LOCAL " if local else ""
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.sql(f"LOAD DATA {kw}INPATH '{tmp_path / (name + '_twin') / 'current'}' "
                 f"INTO TABLE {DB}.{name}_twin")
    assert rows(lake, f"SELECT a FROM {DB}.{name}_twin") == [(1,), (2,)]
    err, events = attempt(lake, f"LOAD DATA {kw}INPATH '{tmp_path / name / 'current'}' "
                                f"INTO TABLE {DB}.{name}")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{name}") == [(1,), (2,)]
    assert replica_diff(set(), data_only(tdir(lake, name)), events) == ([], []), brief(events)


def test_load_data_of_a_directory_with_a_hidden_symlink_hive_skips(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """`landing/` holds `a.txt` and `.latest` (a symlink: a marker a landing tool keeps,
    hidden by its dot name). Hive's copyFiles lists the directory with
    HIDDEN_FILES_PATH_FILTER: it moves a.txt and never touches `.latest`, so Spark alone
    succeeds (checked with the hook off on a twin). refuseSymlinks walks the whole tree
    (hidden names included) and refuses the statement. Expected: the load succeeds, a.txt
    is recorded, `.latest` stays where it is."""
    outside = tmp_path / "outside.txt"
    outside.write_text("x\n")
    for t in ("hidsym_twin", "hidsym"):
        lake.sql(f"CREATE TABLE {DB}.{t} (a INT) STORED AS TEXTFILE")
        d = tmp_path / t
        d.mkdir()
        (d / "a.txt").write_text("1\n")
        (d / ".latest").symlink_to(outside)
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.sql(f"LOAD DATA INPATH '{tmp_path / 'hidsym_twin'}' INTO TABLE {DB}.hidsym_twin")
    assert rows(lake, f"SELECT a FROM {DB}.hidsym_twin") == [(1,)]
    err, events = attempt(lake, f"LOAD DATA INPATH '{tmp_path / 'hidsym'}' "
                                f"INTO TABLE {DB}.hidsym")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.hidsym") == [(1,)]
    assert os.path.islink(tmp_path / "hidsym" / ".latest")
    assert replica_diff(set(), data_only(tdir(lake, "hidsym")), events) == ([], []), \
        brief(events)


# -- 4. LOAD DATA OVERWRITE failing after its move: move-back vs abort order ----------------

def test_failed_load_overwrite_of_a_same_named_file_puts_the_old_file_back(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """dst holds `000000_0` (its only data file). src, another table, holds a file named
    `000000_0` too (Hive's usual output name) and a sub-directory `sub/` holding a FIFO (the
    daemon keeps regular files only, so the keep of `sub` is refused: any refused later part
    does the same). `LOAD DATA INPATH '<src dir>/*' OVERWRITE INTO TABLE dst`: Hive deletes
    dst's old 000000_0 (staged in the statement's transaction), moves src/000000_0 to
    dst/000000_0 (kept by copy, recorded by movedIn), then the keep of `sub` is refused.
    The refusal rolls the daemon transaction back right there (CmrootStatement.prepareIn):
    the put-back of dst's old 000000_0 finds the NEW 000000_0 at its path and the daemon
    keeps the old bytes in the store as "displaced"; only afterwards (CmrootStatement.fail
    -> moveBack) is the new file moved back to src. Seen: the statement fails saying "the
    files of every earlier part of this statement are back where they were", yet dst is
    EMPTY (its old file only resolvable from the cmroot, no event says so). Expected of a
    failed statement (invariant 2): dst holds its old file with its old bytes, src holds
    its file, nothing recorded, nothing left staged (move back what the statement moved in
    BEFORE the rollback puts the old files back)."""
    lake.sql(f"CREATE TABLE {DB}.lovd (a INT) STORED AS TEXTFILE")
    lake.sql(f"CREATE TABLE {DB}.lovs (a INT) STORED AS TEXTFILE")
    dst, src = tdir(lake, "lovd"), tdir(lake, "lovs")
    dst.mkdir(parents=True, exist_ok=True)
    src.mkdir(parents=True, exist_ok=True)
    (dst / "000000_0").write_text("1\n")
    (src / "000000_0").write_text("2\n")
    (src / "sub").mkdir()
    os.mkfifo(src / "sub" / "pipe")
    before_dst = kept(dst)
    before_src = kept(src)
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}/*' OVERWRITE INTO TABLE {DB}.lovd")
    after = {"dst": kept(dst), "src": kept(src)}
    if err is None:  # a load that succeeds must have kept dst's old file
        assert unrecoverable(lake, before_dst) == [], brief(events)
        return
    assert after == {"dst": before_dst, "src": before_src}, (err, brief(events))
    assert events == [] and staging(lake) == []


# -- 5. the overwrite of a path that is a file, with a job that fails -----------------------

def test_failed_dataframe_overwrite_of_a_file_path_puts_the_file_back(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe (passes). `<wh>/exports5/report.csv` is a plain file.
    `df.write.mode("overwrite").csv(that path)`
    whose tasks fail (raise_error): CmrootCommitProtocol.deleteWithJob -> replaceFile
    prepares the file's recycle (outside a statement: the protocol's own `early`
    transaction) and the job starts writing the directory report.csv/_temporary; the tasks
    fail, abortJob aborts `early`. Expected (invariant 2: a failed write leaves the source
    as it was): report.csv is the old file again, with its bytes; no event; nothing left
    staged in the daemon."""
    ex = lake.warehouse / "exports5"
    ex.mkdir()
    f = ex / "report.csv"
    f.write_text("1\n")
    since = lake.daemon.current()
    err = None
    try:
        lake.spark.range(4).selectExpr("raise_error('boom') AS x") \
            .write.mode("overwrite").csv(str(f))
    except Exception as e:
        err = str(e)[:300]
    events = lake.daemon.events_after(since)
    assert err is not None
    state = {"is_file": f.is_file(), "listing": sorted(os.listdir(ex)),
             "under": sorted(os.listdir(f)) if f.is_dir() else None}
    assert state == {"is_file": True, "listing": ["report.csv"], "under": None}, (
        state, unrecoverable(lake, {str(f): b"1\n"}), brief(events))
    assert f.read_text() == "1\n"
    assert events == [] and staging(lake) == []

"""Fourth hostile review of the Spark hook: the review-3 fixes (50567a8: partition specs
matched as Spark matches them, MSCK with nothing, LOAD DATA LOCAL / same-table moves /
symlinks), daemon calls through interrupts and the replace lock (926ba22), and the
managedTable / partitionsOf refactor (c27944b). Real PySpark local[2] with its embedded
metastore, a real daemon, real files; one session for the whole module.

Each test asserts what DESIGN.md's invariants or the README's Spark section promise. Tests
marked "probe" pass on the reviewed code and pin a sequence; every other test failed on it
(see the report in each docstring)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from cmroot import checksum as cks
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake, app_conf
from tests.spark.test_spark_events import data_files
from tests.spark.test_spark_failure import error_chain

pytestmark = pytest.mark.timeout(600)

DB = "rev4"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


def brief(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["eventType"], e["table"], e["partitions"], sorted(f["path"] for f in e["files"]))
            for e in events]


def rows(lake: Lake, q: str) -> list[tuple[Any, ...]]:  # noqa: F811
    return sorted(tuple(r) for r in lake.sql(q))


def partitions(lake: Lake, table: str) -> list[str]:  # noqa: F811
    return sorted(str(r[0]) for r in lake.sql(f"SHOW PARTITIONS {DB}.{table}"))


def data_only(root: Path) -> set[str]:
    """Data files under `root`: no .crc / _SUCCESS (the events list those too, or not)."""
    return {p for p in data_files(root) if not os.path.basename(p).startswith((".", "_"))}


def attempt(lake: Lake, statement: str) -> tuple[str | None, list[dict[str, Any]]]:  # noqa: F811
    """Run `statement`: (its error chain or None, the events recorded meanwhile)."""
    since = lake.daemon.current()
    err = None
    try:
        lake.sql(statement)
    except Exception as e:
        # the first line of Spark's message, then every JVM cause (the root one names the bug)
        chain = error_chain(e).split("\n")
        err = "\n".join([chain[0], chain[1] if len(chain) > 1 else ""]
                        + [c for c in chain if c.startswith(("java.", "io.cmroot", "org."))])
        err = err[:2500]
    return err, lake.daemon.events_after(since)


def kept(root: Path) -> dict[str, bytes]:
    """The data files under `root` with their bytes: regular files only (no FIFO is opened),
    hidden file names skipped, every directory walked (a table may live in a directory of
    any name)."""
    out: dict[str, bytes] = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if not n.startswith((".", "_")) and os.path.isfile(p) and not os.path.islink(p):
                out[p] = Path(p).read_bytes()
    return out


def unrecoverable(lake: Lake, files: dict[str, bytes]) -> list[tuple[str, str]]:  # noqa: F811
    """The (path, status) of each file that is neither at its path with those bytes nor in
    the cmroot by (path, checksum): lost."""
    res = lake.daemon.client.resolve(
        [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])["files"]
    return [(r["path"], r["status"]) for r in res if r["status"] not in ("original", "cmroot")]


def outer_and_inner(lake: Lake, db: str, o: str, n: str, where: str,  # noqa: F811
                    inner_cols: str = "(a INT)", inner_rest: str = "USING parquet",
                    inner_row: str = "(5)") -> Path:
    """Table `db.o` (a INT) holding (1), and table `db.n` located at <o's dir>/<where>
    holding `inner_row`; the inner table's directory."""
    lake.sql(f"CREATE TABLE {db}.{o} (a INT) USING parquet")
    lake.sql(f"INSERT INTO {db}.{o} VALUES (1)")
    inner = lake.warehouse / f"{db}.db" / o / where
    lake.sql(f"CREATE TABLE {db}.{n} {inner_cols} {inner_rest} LOCATION '{inner}'")
    lake.sql(f"INSERT INTO {db}.{n} VALUES {inner_row}")
    return inner


def staging(lake: Lake) -> list[str]:  # noqa: F811
    d = lake.daemon.store / "staging"
    return sorted(os.listdir(d)) if d.exists() else []


def replica_diff(before: set[str], after: set[str], events: list[dict[str, Any]]) -> Any:
    """What a replica replaying `events` over `before` holds that the source does not, and
    the reverse (INSERT / ADD_PARTITION / CREATE_TABLE / ALTER_LOCATION add their files;
    every other event with files removes them). Hidden names are not compared."""
    replica = set(before)
    for e in events:
        paths = {f["path"] for f in e["files"]
                 if not os.path.basename(f["path"]).startswith((".", "_"))}
        if e["eventType"] in ("INSERT", "ADD_PARTITION", "CREATE_TABLE", "ALTER_LOCATION"):
            replica |= paths
        else:
            replica -= paths
    return sorted(replica - after), sorted(after - replica)


def odd_partition(lake: Lake, name: str, columns: str, typ: str, good: str,  # noqa: F811
                  odd_dir: str) -> Path:
    """A parquet table partitioned by `columns` (all of type `typ`) with one partition
    written by Spark (`good`: the VALUES tail) and one directory `odd_dir` found by MSCK
    REPAIR: its stored values are spelled as the directory spells them ('03', '1.50')."""
    cols = [c.strip() for c in columns.split(",")]
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, {', '.join(f'{c} {typ}' for c in cols)}) "
             f"USING parquet PARTITIONED BY ({columns})")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, {good})")
    seed = sorted(data_only(tdir(lake, name)))[0]
    odd = tdir(lake, name) / odd_dir
    odd.mkdir(parents=True)
    (odd / "x.parquet").write_bytes(Path(seed).read_bytes())
    lake.sql(f"MSCK REPAIR TABLE {DB}.{name}")
    return odd


# -- finding 1: a FULL partition spec is still matched looser than Spark matches it ---------

@pytest.mark.parametrize(("name", "columns", "typ", "good", "odd_dir", "spec"), [
    ("fs_int", "p", "INT", "4", "p=03", "p=3"),
    ("fs_int2", "p, q", "INT", "4, 1", "p=03/q=1", "p=3, q=1"),
    ("fs_dbl", "p", "DOUBLE", "4.0", "p=1.50", "p=1.5"),
    ("fs_big", "p", "BIGINT", "4", "p=+7", "p=7"),
])
def test_full_spec_drop_if_exists_that_spark_matches_to_nothing_removes_nothing(
    lake: Lake, db: str, name: str, columns: str, typ: str, good: str,  # noqa: F811
    odd_dir: str, spec: str,
) -> None:
    """FAILS. 50567a8 stopped the numeric fallback of CmrootDropPartitions.matching for
    partial specs only. With a FULL spec the fallback still runs: a partition stored as
    '03' (a directory p=03 found by MSCK REPAIR; likewise '1.50' of a DOUBLE, '+7' of a
    BIGINT) is matched by `ALTER TABLE t DROP IF EXISTS PARTITION (p=3)`. Spark casts 3 to
    the text '3', the metastore matches no partition, and the statement succeeds having
    dropped nothing: SHOW PARTITIONS still lists p=03. But the hook staged p=03's files
    before the command and committed them with a DROP_PARTITION event: the data of a live
    partition is gone from the table (invariant 2: no phantom; a statement that changed
    nothing records nothing and removes nothing)."""
    odd = odd_partition(lake, name, columns, typ, good, odd_dir)
    parts = partitions(lake, name)
    assert odd_dir in parts
    before = set(data_files(tdir(lake, name)))
    err, events = attempt(lake, f"ALTER TABLE {DB}.{name} DROP IF EXISTS PARTITION ({spec})")
    assert err is None, err
    assert partitions(lake, name) == parts  # Spark dropped nothing
    assert set(data_files(tdir(lake, name))) == before, (sorted(data_files(odd)), brief(events))
    assert [e for e in events if e["files"]] == [], brief(events)


def test_full_spec_truncate_that_spark_matches_to_nothing(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe (passes): the same looser match with TRUNCATE TABLE t PARTITION (p=3) of a
    partition stored '03': Spark raises PARTITIONS_NOT_FOUND after the hook staged p=03, and
    the abort puts it back (no loss, only a wasted prepare)."""
    odd_partition(lake, "tr_int", "p", "INT", "4", "p=03")
    before = set(data_files(tdir(lake, "tr_int")))
    err, events = attempt(lake, f"TRUNCATE TABLE {DB}.tr_int PARTITION (p=3)")
    assert err is not None and "PARTITIONS_NOT_FOUND" in err, err
    assert set(data_files(tdir(lake, "tr_int"))) == before
    assert events == [] and staging(lake) == []


# -- finding 2: a null partition value crashes the fallback ---------------------------------

@pytest.mark.parametrize("columns", ["p", "p, q"])
def test_drop_if_exists_of_a_missing_null_partition_is_a_no_op(
    lake: Lake, db: str, columns: str  # noqa: F811
) -> None:
    """FAILS. `ALTER TABLE t DROP IF EXISTS PARTITION (p=null)` on a numeric-partitioned
    table with no null (__HIVE_DEFAULT_PARTITION__) partition: Spark alone succeeds and drops
    nothing (checked here with spark.cmroot.enabled=false). With the hook the statement dies
    with Spark's INTERNAL_ERROR, caused by a NullPointerException in
    CmrootDropPartitions.sameValue (`a.trim()` of the null value), reached because the full
    spec matches nothing exactly and falls back to comparing numbers."""
    name = "nul_" + str(len(columns))
    cols = [c.strip() for c in columns.split(",")]
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, {', '.join(c + ' INT' for c in cols)}) "
             f"USING parquet PARTITIONED BY ({columns})")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, {', '.join('4' for _ in cols)})")
    spec = ", ".join(f"{c}=null" for c in cols)
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.sql(f"ALTER TABLE {DB}.{name} DROP IF EXISTS PARTITION ({spec})")  # Spark: fine
    parts = partitions(lake, name)
    before = set(data_files(tdir(lake, name)))
    err, events = attempt(lake, f"ALTER TABLE {DB}.{name} DROP IF EXISTS PARTITION ({spec})")
    assert err is None, err
    assert partitions(lake, name) == parts
    assert set(data_files(tdir(lake, name))) == before and events == []


def test_drop_and_truncate_of_an_existing_null_partition(lake: Lake, db: str) -> None:  # noqa: F811
    """Probe (passes): with the null partition present, PARTITION (p=null) is matched
    exactly (the catalog spells it __HIVE_DEFAULT_PARTITION__): TRUNCATE recycles its files,
    DROP records it, p=4 untouched."""
    lake.sql(f"CREATE TABLE {DB}.nulx (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.nulx VALUES (1, 4), (2, NULL)")
    keep = data_only(tdir(lake, "nulx") / "p=4")
    null_files = data_only(tdir(lake, "nulx") / "p=__HIVE_DEFAULT_PARTITION__")
    err, events = attempt(lake, f"TRUNCATE TABLE {DB}.nulx PARTITION (p=null)")
    assert err is None, err
    assert [(e["eventType"], e["partitions"]) for e in events] == [
        ("TRUNCATE", [{"p": "__HIVE_DEFAULT_PARTITION__"}])]
    assert null_files <= {f["path"] for f in events[0]["files"]}
    err, events = attempt(lake, f"ALTER TABLE {DB}.nulx DROP PARTITION (p=null)")
    assert err is None, err
    assert partitions(lake, "nulx") == ["p=4"] and data_only(tdir(lake, "nulx")) == keep


# -- finding 3: LOAD DATA of a directory holding a symlink moves the other files -------------

@pytest.mark.parametrize("source", ["landing", "other_table"])
def test_load_data_of_a_directory_holding_a_symlink_moves_nothing(
    lake: Lake, db: str, tmp_path: Path, source: str  # noqa: F811
) -> None:
    """FAILS. README/50567a8: "a symlink is refused before anything moves". That holds for
    a single file only. `LOAD DATA INPATH 'D' INTO TABLE t` where D holds a regular file
    and a symlink: Hive moves D's files one by one (Hive.copyFiles, a thread pool); the
    regular one is renamed into t, then the symlink's rename is refused and the statement
    fails saying "Nothing was moved". Yet the regular file now sits in t (t returns its rows),
    no INSERT is recorded (half-applied statement, missing event). When D is another table's
    directory (`other_table`), that table lost the file: its copy-mode keep was aborted with
    the statement, so (path, checksum) resolves to 'missing' (invariant 1)."""
    name = "ldsym_" + source
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) STORED AS TEXTFILE")
    target = tmp_path / "outside.txt"
    target.write_text("99\n")
    if source == "landing":
        d = tmp_path / "landing"
        d.mkdir()
        (d / "a.txt").write_text("1\n2\n")
    else:
        lake.sql(f"CREATE TABLE {DB}.ldsym_src (a INT) STORED AS TEXTFILE")
        lake.sql(f"INSERT INTO {DB}.ldsym_src VALUES (5)")
        d = tdir(lake, "ldsym_src")
    (d / "zz_link.txt").symlink_to(target)
    regular = {p: Path(p).read_bytes() for p in data_only(d) if not os.path.islink(p)}
    assert regular
    err, events = attempt(lake, f"LOAD DATA INPATH '{d}' INTO TABLE {DB}.{name}")
    assert err is not None and "symlink" in err, err
    if source == "other_table":  # (a landing path outside the roots cannot be resolved)
        assert unrecoverable(lake, regular) == [], brief(events)
    moved = sorted(data_only(tdir(lake, name)))
    assert moved == [] and rows(lake, f"SELECT a FROM {DB}.{name}") == [], (moved, brief(events))
    assert all(Path(p).is_file() for p in regular), sorted(os.listdir(d))
    assert events == [] and staging(lake) == []


# -- finding 4: LOAD DATA of a directory of directories moves them unkept, unrecorded ------

def test_load_data_of_another_tables_directory_of_partitions_keeps_its_files(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """FAILS. `LOAD DATA INPATH '<warehouse>/rev4.db/src' INTO TABLE dst` where src is a
    partitioned table (its directory holds p=1/, p=2/). Hive renames each child of the
    directory, here directories; CmrootLocalFileSystem.rename passes any rename of a
    non-regular file straight through ("a job's or Hive's staging output, or a directory"),
    so src's data files leave src with nothing kept under their paths (resolve: 'missing',
    invariant 1), src is left with partitions and no data, and no event at all is recorded
    (neither a DELETE for src nor an INSERT for dst: a replica of either diverges). The
    statement succeeds. A moved directory must be kept (copy mode, as a moved file is) and
    its files recorded, or the move refused."""
    lake.sql(f"CREATE TABLE {DB}.ldd_src (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.ldd_src PARTITION (p) VALUES (1, 1), (2, 2)")
    lake.sql(f"CREATE TABLE {DB}.ldd_dst (a INT) STORED AS TEXTFILE")
    src = tdir(lake, "ldd_src")
    files = {p: Path(p).read_bytes() for p in data_only(src)}
    assert len(files) == 2
    dst_before = data_only(tdir(lake, "ldd_dst"))
    err, events = attempt(lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.ldd_dst")
    if err is not None:  # refusing the move is fine, if nothing moved
        assert data_only(src) == set(files) and events == [], (err, brief(events))
        return
    assert unrecoverable(lake, files) == [], brief(events)
    src_events = [e for e in events if e["table"] != "ldd_dst"]
    assert replica_diff(set(files), data_only(src), src_events) == ([], []), brief(events)
    dst_events = [e for e in events if e["table"] == "ldd_dst"]
    assert replica_diff(dst_before, data_only(tdir(lake, "ldd_dst")), dst_events) == (
        [], []), brief(events)


# -- finding 5: LOAD DATA of a table's own file into its own place --------------------------

@pytest.mark.parametrize("partitioned", [True, False])
def test_load_data_of_a_tables_own_file_into_its_own_place(
    lake: Lake, db: str, partitioned: bool  # noqa: F811
) -> None:
    """FAILS. `LOAD DATA INPATH 't/p=1/f' INTO TABLE t PARTITION (p=1)` (or of a file of an
    unpartitioned t into t): Hive renames f onto itself, a no-op; without the hook
    (spark.cmroot.enabled=false, checked here) the statement succeeds and t is unchanged.
    With the hook, CmrootLocalFileSystem.rename first calls recycleReplaced(dst) with dst ==
    src: the file is staged away as 'replaced', the rename then finds no source and the
    statement fails with FileNotFoundException (the abort puts it back). A rename onto
    itself replaces nothing and must not be recycled."""
    name = "own_p" if partitioned else "own_u"
    spec = " PARTITION (p=1)" if partitioned else ""
    part = " PARTITIONED BY (p INT)" if partitioned else ""
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT){part} STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.{name}{spec} VALUES (1)")
    lake.sql(f"INSERT INTO {DB}.{name}{spec} VALUES (11)")
    d = tdir(lake, name) / ("p=1" if partitioned else "")
    f = sorted(data_only(d))[0]
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.sql(f"LOAD DATA INPATH '{f}' INTO TABLE {DB}.{name}{spec}")  # Spark: a no-op
    before = data_only(tdir(lake, name))
    want = rows(lake, f"SELECT a FROM {DB}.{name}")
    err, events = attempt(lake, f"LOAD DATA INPATH '{f}' INTO TABLE {DB}.{name}{spec}")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{name}") == want == [(1,), (11,)]
    assert replica_diff(before, data_only(tdir(lake, name)), events) == ([], []), brief(events)


def test_load_data_overwrite_of_a_file_into_its_own_partition_loses_nothing(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Probe (passes): `LOAD DATA INPATH 't/p=1/f' OVERWRITE INTO TABLE t PARTITION (p=1)`.
    Hive (without the hook) deletes p=1, f with it, then fails to move f: p=1 is emptied.
    With the hook the statement fails too, and the abort puts every file back."""
    lake.sql(f"CREATE TABLE {DB}.ownov (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.ownov PARTITION (p=1) VALUES (1)")
    lake.sql(f"INSERT INTO {DB}.ownov PARTITION (p=1) VALUES (11)")
    before = {p: Path(p).read_bytes() for p in data_files(tdir(lake, "ownov"))}
    f = sorted(data_only(tdir(lake, "ownov") / "p=1"))[0]
    err, events = attempt(
        lake, f"LOAD DATA INPATH '{f}' OVERWRITE INTO TABLE {DB}.ownov PARTITION (p=1)")
    assert err is not None
    assert {p: Path(p).read_bytes() for p in data_files(tdir(lake, "ownov"))} == before
    assert events == [] and staging(lake) == []


# -- finding 6: a partition at a location shaped like a committer's _temporary/<n> ----------

def test_partition_under_a_temporary_attempt_shaped_location_is_recycled(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """FAILS (older code, reached through DROP PARTITION's staging). A partition added at
    `<warehouse>/rev4.db/tmp_parts/_temporary/7` (a user's choice of location) holds the
    table's data: Spark reads and writes it. Cmroot.isTemporary takes any path with a
    segment `_temporary` followed by digits for FileOutputCommitter's attempt directory, so
    protectedPath is false: `ALTER TABLE t DROP PARTITION (p=7)` deletes its files with
    nothing recycled and records DROP_PARTITION with no files (invariant 1: resolve says
    'missing'). Only a directory the running job's committer made is temporary."""
    lake.sql(f"CREATE TABLE {DB}.tmpp (a INT, p INT) USING parquet PARTITIONED BY (p)")
    loc = lake.warehouse / f"{DB}.db" / "tmp_parts" / "_temporary" / "7"
    lake.sql(f"ALTER TABLE {DB}.tmpp ADD PARTITION (p=7) LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.tmpp PARTITION (p=7) VALUES (1)")
    files = {p: Path(p).read_bytes() for p in data_only(loc)}
    assert files and rows(lake, f"SELECT a, p FROM {DB}.tmpp") == [(1, 7)]
    err, events = attempt(lake, f"ALTER TABLE {DB}.tmpp DROP PARTITION (p=7)")
    assert err is None, err
    assert unrecoverable(lake, files) == [], brief(events)
    assert set(files) <= {f["path"] for e in events for f in e["files"]}, brief(events)


# -- probes: cancellation and Hive's interrupts (926ba22) ------------------------------------

SLOW = "CAST(reflect('java.lang.Thread', 'sleep', 4000L) IS NULL AS INT)"


@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_cancel_job_group_during_an_overwrite_leaves_the_table(
    lake: Lake, db: str, fmt: str  # noqa: F811
) -> None:
    """Probe (passes): INSERT OVERWRITE whose job sleeps, run with setJobGroup on another
    thread, cancelled with cancelJobGroup from this one: the statement fails, every old
    file is in place with its bytes, no event, nothing left in the daemon's staging."""
    name = "cx_" + fmt.split()[-1].lower()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) {fmt}")
    for i in range(3):
        lake.sql(f"INSERT INTO {DB}.{name} VALUES ({i})")
    before = {p: Path(p).read_bytes() for p in data_files(tdir(lake, name))}
    since = lake.daemon.current()
    errors: list[str] = []

    def run() -> None:
        lake.spark.sparkContext.setJobGroup("rev4-" + name, "cancelled overwrite", True)
        try:
            lake.sql(f"INSERT OVERWRITE TABLE {DB}.{name} "
                     f"SELECT CAST(id AS INT) + 100 + {SLOW} FROM range(4)")
        except Exception as e:
            errors.append(error_chain(e)[:600])

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2.5)
    lake.spark.sparkContext.cancelJobGroup("rev4-" + name)
    t.join(180)
    assert not t.is_alive()
    assert errors and "CANCELLED" in errors[0].upper(), errors
    assert {p: Path(p).read_bytes() for p in data_files(tdir(lake, name))} == before
    assert rows(lake, f"SELECT a FROM {DB}.{name}") == [(0,), (1,), (2,)]
    assert lake.daemon.events_after(since) == [] and staging(lake) == []


def test_hive_dynamic_overwrite_refused_partition_fails_before_hive_loads_any(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """A Hive-format dynamic INSERT OVERWRITE of p=1..3 where p=1 holds a symlink (the
    daemon refuses it). The old files of every partition the job wrote are staged at job
    commit, in one part, before Hive's load starts its pool of threads: the statement fails
    there (not with Hive's "Exception when loading" from one of its threads midway, whose
    fellows it then interrupts), and every partition is as it was."""
    outside = tmp_path / "outside.txt"
    outside.write_text("99\n")
    lake.sql(f"CREATE TABLE {DB}.hpre (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.hpre PARTITION (p) SELECT CAST(id AS INT), CAST(id AS INT) "
             "FROM range(1, 4)")
    (tdir(lake, "hpre") / "p=1" / "zlink").symlink_to(outside)
    before = {p: Path(p).read_bytes() for p in data_only(tdir(lake, "hpre"))}
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.hpre PARTITION (p) "
                                "SELECT CAST(id + 10 AS INT), CAST(id AS INT) FROM range(1, 4)")
    assert err is not None and "Exception when loading" not in err, err
    after = {p: Path(p).read_bytes() for p in data_only(tdir(lake, "hpre"))}
    assert (after, brief(events), staging(lake)) == (before, [], [])


def test_hive_dynamic_overwrite_with_one_refused_partition_is_all_or_nothing(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """A Hive-format dynamic INSERT OVERWRITE of p=1..10 where p=1 holds a symlink escaping
    the root (the daemon refuses it), three times. Once a race: Hive's load threads each staged
    their partition's old files, a refusal rolled the others back while one thread's
    recursive delete of its directory went on and deleted a file just put back. Now every
    written partition's old files are staged in one part at job commit, before Hive's load
    starts a thread (CmrootCommitProtocol.stageReplaced), so the refusal fails the statement
    there. Expected: after every attempt, every partition as it was, nothing recorded,
    nothing left staged (invariants 1 and 2)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("99\n")

    def snapshot(name: str) -> dict[str, Any]:
        return {p: (os.readlink(p) if os.path.islink(p) else Path(p).read_bytes())
                for p in data_files(tdir(lake, name))}

    for k in range(3):
        name = f"hdyn{k}"
        lake.sql(f"CREATE TABLE {DB}.{name} (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
        lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p) SELECT CAST(id AS INT), "
                 "CAST(id AS INT) FROM range(1, 11)")
        (tdir(lake, name) / "p=1" / "zlink").symlink_to(outside)
        before = snapshot(name)
        since = lake.daemon.current()
        err, _ = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{name} PARTITION (p) "
                               "SELECT CAST(id + 10 AS INT), CAST(id AS INT) FROM range(1, 11)")
        assert err is not None
        time.sleep(1)  # what the statement's pool threads still do after it returned
        after = snapshot(name)
        found = {
            "missing": sorted(set(before) - set(after)),
            "added": sorted(set(after) - set(before)),
            "lost": unrecoverable(lake, {p: b for p, b in before.items()
                                         if isinstance(b, bytes) and p not in after}),
            "events": brief(lake.daemon.events_after(since)),
            "staging": staging(lake),
        }
        assert found == {"missing": [], "added": [], "lost": [], "events": [], "staging": []}, (
            f"attempt {k}", found)


# -- probes: partition values with special characters ---------------------------------------

@pytest.mark.parametrize("value", ["a/b", "x=y", "sp ace", "p%41", "u+v", "q'r"])
def test_load_and_truncate_of_a_partition_with_special_characters(
    lake: Lake, db: str, tmp_path: Path, value: str  # noqa: F811
) -> None:
    """Probe (passes): LOAD DATA into PARTITION (s='<value>') records its INSERT under that
    value (derived from the escaped directory name), TRUNCATE of it records TRUNCATE of that
    value, and the other partition is untouched."""
    name = "spc_" + "".join(c if c.isalnum() else "_" for c in value)
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) PARTITIONED BY (s STRING) STORED AS TEXTFILE")
    quoted = value.replace("'", "\\'")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (s='{quoted}') VALUES (1)")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (s='other') VALUES (2)")
    keep = data_only(tdir(lake, name) / "s=other")
    src = tmp_path / "l.txt"
    src.write_text("3\n")
    err, events = attempt(
        lake, f"LOAD DATA INPATH '{src}' INTO TABLE {DB}.{name} PARTITION (s='{quoted}')")
    assert err is None, err
    assert [(e["eventType"], e["partitions"]) for e in events] == [("INSERT", [{"s": value}])]
    err, events = attempt(lake, f"TRUNCATE TABLE {DB}.{name} PARTITION (s='{quoted}')")
    assert err is None, err
    assert [(e["eventType"], e["partitions"]) for e in events] == [("TRUNCATE", [{"s": value}])]
    assert rows(lake, f"SELECT a, s FROM {DB}.{name}") == [(2, "other")]
    assert data_only(tdir(lake, name) / "s=other") == keep


# -- finding 7 (older code): an overwrite of a path that is a file -------------------------

def test_dataframe_overwrite_of_a_path_that_is_a_file(lake: Lake, db: str) -> None:  # noqa: F811
    """FAILS (CmrootCommitProtocol, not the reviewed commits). `<warehouse>/exports4/
    report.csv` is a plain file; `df.write.mode("overwrite").csv(that path)` succeeds in
    Spark alone (checked here with spark.cmroot.enabled=false on a twin: the file is replaced
    by a directory of part files, its sibling untouched). With the hook, deleteWithJob only
    snapshots the file and keeps it until job commit, so the tasks cannot create
    report.csv/_temporary under a file: the statement fails with ParentNotDirectoryException.
    Expected: it succeeds, the old file is recycled (INSERT_OVERWRITE, retrievable by
    (path, checksum)), the sibling stays."""
    twin = lake.warehouse / "exports4_twin"
    twin.mkdir()
    (twin / "report.csv").write_text("1\n")
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.spark.range(2).write.mode("overwrite").csv(str(twin / "report.csv"))
    assert (twin / "report.csv").is_dir()
    ex = lake.warehouse / "exports4"
    ex.mkdir()
    (ex / "report.csv").write_text("1\n")
    (ex / "other.csv").write_text("2\n")
    since = lake.daemon.current()
    err = None
    try:
        lake.spark.range(2).write.mode("overwrite").csv(str(ex / "report.csv"))
    except Exception as e:
        err = error_chain(e)[:600]
    events = lake.daemon.events_after(since)
    assert err is None, err
    assert (ex / "report.csv").is_dir() and (ex / "other.csv").read_text() == "2\n"
    assert unrecoverable(lake, {str(ex / "report.csv"): b"1\n"}) == [], brief(events)

"""Hostile review of the Spark hook (issue 11; DESIGN invariants 1, 2, 5): sequences of Spark
SQL, DataFrame and Hadoop FileSystem calls, on real PySpark local[2], a real daemon and real
files, that lose a warehouse file, leave a statement half applied, record a phantom (or miss
a real) destructive event, delete a warehouse root, or let a session switch the hook off.

Each test asserts what must hold and fails on the current shim. One daemon and one hooked
session for the module (a JVM start is the slow part). Anything that needs a second warehouse
root uses a temporary hierarchy (`spark.cmroot.warehouseRoots` in the application's static
conf, as tests/spark/test_spark_integrity.py does): no real `/` is ever at risk.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from cmroot import checksum as cks
from cmroot.vocab import DESTRUCTIVE
from tests.spark.sparklib import Lake, app_conf, data_files, hooked_lake

pytestmark = pytest.mark.timeout(600)

FAIL_PAUSE = "spark.cmroot.test.pauseAfterPrepare"


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lake]:
    with hooked_lake(tmp_path_factory.mktemp("review-lake"), Lake) as lk:
        yield lk


# -- helpers ------------------------------------------------------------------------------

def error_chain(e: BaseException | None) -> str:
    if e is None:
        return "<no error>"
    parts = [str(e)[:3000]]
    jvm_error = getattr(e, "_origin", None) or getattr(e, "java_exception", None)
    while jvm_error is not None:
        parts.append(str(jvm_error.toString())[:2000])
        jvm_error = jvm_error.getCause()
    return "\n".join(parts)


def rows(lake: Lake, q: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in lake.sql(q))


def make(lake: Lake, name: str, fmt: str = "USING parquet") -> dict[str, bytes]:
    lake.sql(f"DROP TABLE IF EXISTS {name}")
    lake.sql(f"CREATE TABLE {name} (a INT, p INT) {fmt} PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, 1), (2, 2), (3, 3)")
    return data_files(lake.table_dir(name))


def data_only(files: dict[str, bytes]) -> dict[str, bytes]:
    """The data files (part-*), not Spark's _SUCCESS or .crc companions."""
    return {p: b for p, b in files.items()
            if ("/part-" in p and not p.endswith(".crc")) or p.endswith(".txt")}


def statuses(lake: Lake, files: dict[str, bytes]) -> dict[str, str]:
    """(path, checksum) of each file resolved at the daemon: original / cmroot / missing."""
    pairs = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    return {r.path: r.status for r in lake.daemon.client.resolve(pairs).files}


def lost(lake: Lake, files: dict[str, bytes]) -> list[str]:
    """The files of `files` retrievable neither from their place nor from the cmroot."""
    return sorted(p for p, s in statuses(lake, files).items() if s == "missing")


def events(lake: Lake, since: int) -> list[tuple[Any, ...]]:
    return [(e["eventType"], e.get("db"), e.get("table"), len(e.get("files") or []))
            for e in lake.daemon.events_after(since)]


def destructive(lake: Lake, since: int) -> list[dict[str, Any]]:
    return [e for e in lake.daemon.events_after(since) if e["eventType"] in DESTRUCTIVE]


def hadoop(lake: Lake) -> tuple[Any, Any, Any]:
    jvm = lake.spark.sparkContext._jvm
    conf = lake.spark.sparkContext._jsc.hadoopConfiguration()
    fs = jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI("file:///"), conf)
    return jvm, conf, fs


def escaping_symlink(where: Path, tmp_path: Path, name: str = "escape") -> Path:
    """A symlink to a file outside the roots: the daemon refuses to recycle it."""
    secret = tmp_path / "outside-secret"
    secret.write_bytes(b"not the warehouse's")
    link = where / name
    os.symlink(secret, link)
    return link


class Paused:
    """`statement` run on another thread that stops right after its first recycle was
    prepared (the shim's pauseAfterPrepare test fault point), until `go()`."""

    def __init__(self, lake: Lake, fault_dir: Path, statement: str) -> None:
        self.dir = fault_dir
        self.dir.mkdir(parents=True)
        self.error: BaseException | None = None

        def run() -> None:
            try:
                lake.sql(statement)
            except BaseException as e:  # handed to the test
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)

    def __enter__(self) -> Paused:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not (self.dir / "reached").exists():
            assert self.thread.is_alive() and time.monotonic() < deadline, error_chain(self.error)
            time.sleep(0.05)
        return self

    def go(self) -> None:
        (self.dir / "go").touch()

    def __exit__(self, *exc: object) -> None:
        self.go()
        self.thread.join(300)


@contextlib.contextmanager
def session_conf(lake: Lake, **kv: str) -> Iterator[None]:
    for k, v in kv.items():
        lake.sql(f"SET {k}={v}")
    try:
        yield
    finally:
        for k in kv:
            lake.spark.conf.unset(k)


# -- 1. a SQL user switches the hook off --------------------------------------------------

@pytest.mark.parametrize(
    "statement", ["TRUNCATE TABLE {t}", "INSERT OVERWRITE TABLE {t} SELECT 9, 9"])
def test_session_set_of_fs_file_impl_switches_the_hook_off(lake: Lake, statement: str) -> None:
    """Invariants 1 and issue 11 item 5 (the protecting settings are not session switches).

    Two plain `SET`s from any SQL user (no spark.cmroot.* key, so nothing is refused):
    `SET fs.file.impl.disable.cache=true` and `SET fs.file.impl=org.apache.hadoop.fs.
    LocalFileSystem`. The session's Hadoop conf then builds an uncached, unhooked file system
    for TRUNCATE (TruncateTableCommand) and INSERT OVERWRITE (deleteWithJob sees a plain
    LocalFileSystem and just deletes): the table's files are deleted, nothing reaches the
    cmroot, and the overwrite even records its new data and metadata-only partition drops, so
    a replica is told nothing was recycled."""
    t = "sw_trunc" if statement.startswith("TRUNCATE") else "sw_ovw"
    before = data_only(make(lake, t))
    since = lake.daemon.current()
    unhooked = {"fs.file.impl.disable.cache": "true",
                "fs.file.impl": "org.apache.hadoop.fs.LocalFileSystem"}
    # (refusing the SET, or the statement, would be fine too)
    try:
        with session_conf(lake, **unhooked), contextlib.suppress(Exception):
            lake.sql(statement.format(t=t))
    except Exception as e:  # the SET was refused: it must say why
        assert "cannot be changed by SET" in str(e), error_chain(e)
        lake.sql(statement.format(t=t))  # still hooked: the old files are recycled
    assert lost(lake, before) == [], (
        f"files deleted by `{statement}` with no copy in the cmroot; events: {events(lake, since)}")


# -- 2. paths the hook takes for Spark's own temporary files ------------------------------

def test_a_table_named_like_a_spark_temporary_dir_is_dropped_unrecycled(lake: Lake) -> None:
    """Invariant 1. `Cmroot.isTemporary` skips any path with a segment `_temporary` or
    `_temporary_*` (also `.spark-staging-*`, `.hive-staging*`) anywhere, not just Spark's
    own staging layout. A managed table called `_temporary_orders` (its directory
    `<warehouse>/_temporary_orders`) is therefore unprotected: DROP TABLE deletes its data
    with nothing recycled and no event at all (not even a metadata-only DROP_TABLE)."""
    t = "_temporary_orders"
    lake.sql(f"DROP TABLE IF EXISTS {t}")
    lake.sql(f"CREATE TABLE {t} (a INT) USING parquet")
    lake.sql(f"INSERT INTO {t} VALUES (1), (2)")
    before = data_only(data_files(lake.warehouse / t))
    assert before
    since = lake.daemon.current()
    lake.sql(f"DROP TABLE {t}")
    assert lost(lake, before) == [], f"dropped with no copy; events {events(lake, since)}"
    assert [e[0] for e in events(lake, since)] == ["DROP_TABLE"]


# -- 3. a path through a symlink --------------------------------------------------------------

@pytest.fixture
def second_root(lake: Lake, tmp_path: Path) -> Iterator[Path]:
    """A second warehouse root, <tmp>/outer/inner/root, holding a table file, and a symlink
    <tmp>/alias -> <tmp>/outer (so <tmp>/alias/inner/root is that root)."""
    root = tmp_path / "outer" / "inner" / "root"
    (root / "t").mkdir(parents=True)
    (root / "t" / "data").write_bytes(b"must stay")
    os.symlink(tmp_path / "outer", tmp_path / "alias")
    with app_conf(lake.spark, "spark.cmroot.warehouseRoots", f"{lake.warehouse},{root}"):
        yield root


def test_overwrite_of_the_root_spelled_through_a_symlink_replaces_it(
        lake: Lake, second_root: Path, tmp_path: Path) -> None:
    """Invariant 5. The hook compares paths lexically (Cmroot.localPath / rootWithin), never
    by real path (the fsspec hook does both). `df.write.mode("overwrite").parquet(
    "<tmp>/alias/inner/root")` names the root through a symlinked ancestor: no refusal, the
    root directory is deleted (its table file with it, nothing recycled) and rewritten."""
    df = lake.spark.createDataFrame([(1,)], "a INT")
    with contextlib.suppress(Exception):  # a refusal naming the root is what must happen
        df.write.mode("overwrite").parquet(str(tmp_path / "alias" / "inner" / "root"))
    assert (second_root / "t" / "data").exists(), sorted(
        str(p) for p in second_root.rglob("*"))


def test_drop_database_located_through_a_symlink_deletes_the_root(
        lake: Lake, second_root: Path, tmp_path: Path) -> None:
    """Invariant 5. `CREATE DATABASE d LOCATION '<tmp>/alias/inner'` (a directory holding the
    root, spelled through a symlink), then `DROP DATABASE d CASCADE`: RefuseRootDatabaseDrops
    and the metastore listener compare lexically, so nothing is refused and the metastore's
    recursive delete of the database directory takes the warehouse root with it."""
    lake.sql(f"CREATE DATABASE alias_db LOCATION '{tmp_path / 'alias' / 'inner'}'")
    lake.sql("CREATE TABLE alias_db.t USING parquet AS SELECT 1 AS a")
    with contextlib.suppress(Exception):
        lake.sql("DROP DATABASE alias_db CASCADE")
    assert (second_root / "t" / "data").exists(), (
        f"root {second_root} deleted: exists={second_root.exists()}")


def test_overwrite_of_a_warehouse_path_spelled_through_a_symlink_is_not_recycled(
        lake: Lake, tmp_path: Path) -> None:
    """Invariant 1, with the daemon's own root. `<tmp>/lake-alias -> <lake base>`; a
    DataFrame overwrite of `<tmp>/lake-alias/warehouse/raw/x` replaces the files of
    `<warehouse>/raw/x`: the hook sees a path outside the roots and deletes them plainly;
    (original path, checksum) of the old files resolves `missing`."""
    target = lake.warehouse / "raw" / "alias_x"
    lake.spark.createDataFrame([(1,), (2,)], "a INT").write.mode("overwrite").parquet(str(target))
    before = data_only(data_files(target))
    alias = tmp_path / "lake-alias"
    os.symlink(lake.warehouse.parent, alias)
    lake.spark.createDataFrame([(3,)], "a INT").write.mode("overwrite").parquet(
        str(alias / "warehouse" / "raw" / "alias_x"))
    assert lost(lake, before) == []


# -- 4. Hadoop FileSystem calls that replace or remove a file without a delete -------------

@pytest.mark.parametrize("how", ["create-overwrite", "rename-onto", "filecontext-delete"])
def test_hadoop_calls_that_replace_a_warehouse_file_bypass_the_hook(lake: Lake, how: str) -> None:
    """Invariant 1; issue 11 item 4 ("every way ... goes through the hook: delete, rename
    onto an existing file, create(overwrite=true) of an existing file ..."). The shim only
    overrides `delete`: `fs.create(p, true)` of an existing table file, `fs.rename(src, p)`
    onto one (RawLocalFileSystem renames over it), and the other Hadoop API,
    `FileContext.delete` (LocalFs, never the hooked FileSystem), replace or remove the file
    with nothing recycled and no event."""
    t = "hfs_" + how.replace("-", "_")
    files = data_only(make(lake, t))
    victim = sorted(files)[0]
    old = {victim: files[victim]}
    jvm, conf, fs = hadoop(lake)
    path = jvm.org.apache.hadoop.fs.Path(f"file://{victim}")
    since = lake.daemon.current()
    if how == "create-overwrite":
        out = fs.create(path, True)
        out.write(bytearray(b"new bytes"))
        out.close()
    elif how == "rename-onto":
        src = Path(victim).parent / "incoming"
        src.write_bytes(b"new bytes")
        fs.rename(jvm.org.apache.hadoop.fs.Path(f"file://{src}"), path)
    else:
        jvm.org.apache.hadoop.fs.FileContext.getFileContext(conf).delete(path, False)
    assert lost(lake, old) == [], f"{how}: old bytes gone; events {events(lake, since)}"


# -- 5. Hive's move-to-trash ----------------------------------------------------------------

def test_hive_format_overwrite_with_trash_enabled_moves_old_files_past_the_hook(
        lake: Lake, tmp_path: Path) -> None:
    """Invariant 1; issue 11 item 4 ("Hive's move-to-trash when fs.trash.interval > 0:
    recycled, not renamed into .Trash behind cmroot's back"). With fs.trash.interval > 0 in
    the Hive client's conf (what `--conf spark.hadoop.fs.trash.interval=1440` gives an
    application; simulated here on the live HiveConf, and user.home pointed at a temporary
    directory so the trash stays in it), a Hive-format INSERT OVERWRITE has Hive's
    replaceFiles rename every old file into ~/.Trash: nothing recycled, and no
    INSERT_OVERWRITE event at all (a replica never learns the old rows went)."""
    t = "trash_ow"
    lake.sql(f"DROP TABLE IF EXISTS {t}")
    lake.sql(f"CREATE TABLE {t} (a INT) STORED AS TEXTFILE")
    for i in range(2):
        lake.sql(f"INSERT INTO {t} VALUES ({i})")
    before = data_only(data_files(lake.table_dir(t)))
    jvm = lake.spark.sparkContext._jvm
    client = lake.spark._jsparkSession.sharedState().externalCatalog().unwrapped().client()
    hive_conf = client.conf()
    home = tmp_path / "home"
    home.mkdir()
    old_home = jvm.java.lang.System.getProperty("user.home")
    since = lake.daemon.current()
    jvm.java.lang.System.setProperty("user.home", str(home))
    hive_conf.set("fs.trash.interval", "1440")
    try:
        lake.sql(f"INSERT OVERWRITE TABLE {t} SELECT 9")
    finally:
        hive_conf.unset("fs.trash.interval")
        jvm.java.lang.System.setProperty("user.home", old_home)
    assert rows(lake, f"SELECT a FROM {t}") == [(9,)]
    trashed = sorted(str(p) for p in home.rglob("part-*"))
    assert lost(lake, before) == [], f"moved to the trash, not recycled: {trashed}"
    assert [e["eventType"] for e in destructive(lake, since)] == ["INSERT_OVERWRITE"]


# -- 6. a statement is one unit -------------------------------------------------------------

def test_overwrite_failing_after_its_job_commit_still_recycles_and_records(lake: Lake) -> None:
    """Invariant 2 (no phantom; a statement is one unit). CmrootCommitProtocol commits its own
    transaction right after the job commit, not the statement's: whatever fails afterwards
    inside the same INSERT OVERWRITE cannot undo it. Here the metastore refuses the new
    partition (its PART_NAME is longer than Derby's 767 characters; each directory name is a
    legal 243). The statement fails, yet INSERT_OVERWRITE (and INSERT) are in the event log,
    the old files are gone from the table and it reads as empty."""
    t = "post_commit_fail"
    lake.sql(f"DROP TABLE IF EXISTS {t}")
    lake.sql(f"CREATE TABLE {t} (a INT, p1 STRING, p2 STRING, p3 STRING, p4 STRING) "
             "USING parquet PARTITIONED BY (p1, p2, p3, p4)")
    lake.sql(f"INSERT INTO {t} VALUES (1, 'x', 'x', 'x', 'x'), (2, 'y', 'y', 'y', 'y')")
    before = data_files(lake.table_dir(t))
    since = lake.daemon.current()
    with pytest.raises(Exception) as info:
        lake.sql(f"INSERT OVERWRITE TABLE {t} SELECT 7, repeat('a', 240), repeat('b', 240), "
                 "repeat('c', 240), repeat('d', 240)")
    assert "PART_NAME" in error_chain(info.value) or "persistent" in error_chain(info.value)
    assert events(lake, since) == [], "the failed statement's recycle was committed"
    assert rows(lake, f"SELECT a FROM {t}") == [(1,), (2,)]
    assert all(os.path.exists(p) for p in before)


@pytest.fixture
def multi(lake: Lake) -> dict[str, bytes]:
    lake.sql("DROP TABLE IF EXISTS mi_src")
    lake.sql("CREATE TABLE mi_src (a INT) USING parquet")
    lake.sql("INSERT INTO mi_src VALUES (1), (2), (3)")
    old: dict[str, bytes] = {}
    for n in ("mi_a", "mi_b"):
        lake.sql(f"DROP TABLE IF EXISTS {n}")
        lake.sql(f"CREATE TABLE {n} (a INT) USING parquet")
        lake.sql(f"INSERT INTO {n} VALUES (100), (200)")
        old.update(data_files(lake.table_dir(n)))
    return old


def test_a_failing_multi_insert_is_half_applied(lake: Lake, multi: dict[str, bytes]) -> None:
    """Invariant 2. `FROM src INSERT OVERWRITE TABLE a ... INSERT OVERWRITE TABLE b ...` is
    one statement, but its analyzed plan is a Union of two InsertIntoHadoopFsRelationCommand:
    WrapStatements only looks at the plan's root, so neither insert runs in a statement. The
    first commits its own recycle at its job commit; the second fails in a task. Result: the
    statement failed, table a is overwritten (INSERT_OVERWRITE committed, with no db/table),
    table b is not."""
    since = lake.daemon.current()
    with pytest.raises(Exception, match="boom"):
        lake.sql("FROM mi_src INSERT OVERWRITE TABLE mi_a SELECT a "
                 "INSERT OVERWRITE TABLE mi_b "
                 "SELECT IF(a > 0, CAST(raise_error('boom') AS INT), a)")
    assert events(lake, since) == []
    assert rows(lake, "SELECT a FROM mi_a") == [(100,), (200,)]


def test_a_multi_insert_records_no_table_and_no_insert(lake: Lake, multi: dict[str, bytes]) -> None:
    """Issue 11 item 7 (events complete) and the context rule (item 6). A successful
    multi-insert overwrite records each overwrite as INSERT_OVERWRITE with db and table null
    and no INSERT for the new files (the commit protocol sees no statement context): a
    replica replaying the log removes the old files and never receives the new rows.
    (A Hive-format target is worse: one DELETE event per old file.)"""
    since = lake.daemon.current()
    lake.sql("FROM mi_src INSERT OVERWRITE TABLE mi_a SELECT a + 10 "
             "INSERT OVERWRITE TABLE mi_b SELECT a + 20")
    assert rows(lake, "SELECT a FROM mi_a") == [(11,), (12,), (13,)]
    got = events(lake, since)
    tables = {(e[1], e[2]) for e in got}
    assert ("default", "mi_a") in tables and ("default", "mi_b") in tables, got
    assert [e for e in got if e[0] == "INSERT"], got


def test_insert_overwrite_hive_directory_is_half_applied_when_refused(
        lake: Lake, tmp_path: Path) -> None:
    """Invariant 2. `INSERT OVERWRITE DIRECTORY '<warehouse>/exports/d' STORED AS TEXTFILE`
    (InsertIntoHiveDirCommand) is not wrapped: it deletes the directory's old entries one
    `fs.delete` at a time, each its own one-phase recycle committed at once (one DELETE event
    per file). One entry the daemon refuses (a symlink leading out of the roots) fails the
    statement after the entries listed before it were deleted and their events published."""
    d = lake.warehouse / "exports" / "hive_dir"
    d.mkdir(parents=True)
    jvm = lake.spark.sparkContext._jvm
    for i in range(6):
        (d / f"f{i}.txt").write_text(f"{i}\n")
    link = escaping_symlink(d, tmp_path, "zz-link")
    order = list(jvm.java.io.File(str(d)).list())  # the order Hadoop's listStatus returns
    if order[0] == link.name:  # make sure some data file is deleted before the refusal
        link.rename(d / "a-link")
    before = {str(p): p.read_bytes() for p in d.glob("f*.txt")}
    since = lake.daemon.current()
    with pytest.raises(Exception) as info:
        lake.sql(f"INSERT OVERWRITE DIRECTORY '{d}' STORED AS TEXTFILE SELECT 42")
    assert "cmroot could not recycle" in error_chain(info.value)
    gone = sorted(p for p in before if not os.path.exists(p))
    assert gone == [] and destructive(lake, since) == [], (
        f"failed statement, yet {gone} deleted and events {events(lake, since)}")


def test_multi_partition_drop_with_a_spec_spelled_otherwise_is_half_applied(
        lake: Lake, tmp_path: Path) -> None:
    """Invariant 2; issue 11 ("a multi-partition DROP PARTITION where one partition holds a
    symlink escaping the root: the statement fails and every partition is intact").
    CmrootDropPartitions stages every named partition up front by listing the catalog with
    the spec as typed; Spark drops `PARTITION (p='03')` of an INT column as p=3, but the
    listing finds nothing for '03', so p=3 is staged only by the metastore's per-partition
    pre-event, after p=1 was dropped. p=3 is refused (a symlink out of the roots): the
    statement fails, p=1's files are put back, but p=1 is gone from the catalog."""
    t = "dp_spelled"
    make(lake, t)
    link = escaping_symlink(lake.table_dir(t) / "p=3", tmp_path)
    before = data_files(lake.table_dir(t))
    since = lake.daemon.current()
    with pytest.raises(Exception) as info:
        lake.sql(f"ALTER TABLE {t} DROP PARTITION (p=1), PARTITION (p='03')")
    assert "cmroot could not recycle" in error_chain(info.value)
    link.unlink()
    del before[str(link)]
    assert data_files(lake.table_dir(t)) == before
    assert destructive(lake, since) == []
    assert sorted(r[0] for r in lake.sql(f"SHOW PARTITIONS {t}")) == ["p=1", "p=2", "p=3"]


def test_a_refused_later_part_turns_a_drop_into_success_with_every_file_back(
        lake: Lake, tmp_path: Path) -> None:
    """Invariant 2 (a statement's recycles commit together or not at all, and a statement
    that succeeds records its event). DROP TABLE: the pre-event stages the table's files;
    then a file the daemon refuses (a symlink out of the roots) is in the directory when the
    metastore deletes it: that later part of the same transaction is refused, the daemon
    rolls the whole transaction back, the metastore swallows the delete error, and
    CmrootTransaction.commit() is a silent no-op for a finished transaction. So DROP TABLE
    succeeds, the table is gone from the catalog, every file is back in its directory and
    no DROP_TABLE event exists (a replica keeps the table for ever)."""
    t = "late_part"
    before = data_only(make(lake, t))
    since = lake.daemon.current()
    with app_conf(lake.spark, FAIL_PAUSE, str(tmp_path / "fault")), \
            Paused(lake, tmp_path / "fault", f"DROP TABLE {t}") as paused:
        escaping_symlink(lake.table_dir(t), tmp_path)
        paused.go()
        paused.thread.join(300)
    if paused.error is None:  # the drop stood: its data must be recycled, with its event
        assert [e["eventType"] for e in destructive(lake, since)] == ["DROP_TABLE"], (
            f"DROP TABLE succeeded with no DROP_TABLE event; files still in place: "
            f"{statuses(lake, before)}")
        assert set(statuses(lake, before).values()) == {"cmroot"}
    else:  # or it failed as a whole
        assert lake.spark.catalog.tableExists(t)


def test_overwrite_whose_recycle_commit_fails_after_the_job_commit_mixes_old_and_new(
        lake: Lake, tmp_path: Path) -> None:
    """Invariant 2 ("files put back after the statement's own commit -> duplicated rows").
    INSERT OVERWRITE prepares the old files, then the job commits the new ones, then the
    recycle commits. If that commit cannot be made (the daemon restarting for longer than the
    lease: compressed here to a 2 s lease and a 5 s outage; with the default 10 m lease any
    outage over the ~30 s of retries ends the same way once the lease passes), the daemon
    puts the old files back next to the job's committed output: the statement fails and the
    table holds the old rows AND the new ones."""
    t = "dup_rows"
    lake.sql(f"DROP TABLE IF EXISTS {t}")
    lake.sql(f"CREATE TABLE {t} (a INT) USING parquet")
    lake.sql(f"INSERT INTO {t} VALUES (1), (2)")
    with app_conf(lake.spark, "spark.cmroot.lease", "2s"), \
            app_conf(lake.spark, FAIL_PAUSE, str(tmp_path / "fault")), \
            Paused(lake, tmp_path / "fault", f"INSERT OVERWRITE TABLE {t} SELECT 100") as p:
        lake.daemon.stop()
        p.go()
        time.sleep(5)  # longer than the lease: the daemon rolls the prepare back
        lake.daemon.start()
        p.thread.join(300)
    lake.sql(f"REFRESH TABLE {t}")
    got = rows(lake, f"SELECT a FROM {t}")
    expected = [(1,), (2,)] if p.error is not None else [(100,)]
    assert got == expected, f"statement error: {error_chain(p.error)[:300]}"


# -- 7. removals that are moves ---------------------------------------------------------------

def test_load_data_inpath_moves_a_warehouse_file_out_of_its_table_unrecorded(lake: Lake) -> None:
    """Invariant 1 (retrievable by original path and checksum) and issue 11 item 7. `LOAD
    DATA INPATH '<another table's file>' [OVERWRITE] INTO TABLE dst` is a Hive move (rename):
    the file leaves the source table with no recycle and no event; (its original path,
    checksum) resolves `missing` and a replica of the source table keeps the row."""
    for n in ("ld_src", "ld_dst"):
        lake.sql(f"DROP TABLE IF EXISTS {n}")
        lake.sql(f"CREATE TABLE {n} (a INT) STORED AS TEXTFILE")
    lake.sql("INSERT INTO ld_src VALUES (1)")
    lake.sql("INSERT INTO ld_src VALUES (2)")
    src = data_only(data_files(lake.table_dir("ld_src")))
    moved = sorted(src)[0]
    since = lake.daemon.current()
    lake.sql(f"LOAD DATA INPATH '{moved}' INTO TABLE ld_dst")
    assert lost(lake, {moved: src[moved]}) == [], f"events {events(lake, since)}"
    kept, insert = lake.daemon.events_after(since)
    assert (kept["eventType"], [f["path"] for f in kept["files"]]) == ("DELETE", [moved])
    landed = str(lake.table_dir("ld_dst") / os.path.basename(moved))
    assert (insert["eventType"], insert["table"]) == ("INSERT", "ld_dst")
    assert [f["path"] for f in insert["files"]] == [landed]
    rows = [r[0] for t in ("ld_src", "ld_dst") for r in lake.sql(f"SELECT a FROM {t}")]
    assert sorted(rows) == [1, 2] and len(lake.sql("SELECT a FROM ld_dst")) == 1


# -- 8. partitions with custom locations -------------------------------------------------------

@pytest.fixture
def custom(lake: Lake) -> Path:
    """Table `cl` with p=1, p=2 in its directory and p=9 at <warehouse>/custom_parts/cl9."""
    make(lake, "cl")
    loc = lake.warehouse / "custom_parts" / "cl9"
    lake.sql(f"ALTER TABLE cl ADD PARTITION (p=9) LOCATION '{loc}'")
    lake.sql("INSERT INTO cl PARTITION (p=9) VALUES (99)")
    return loc


def test_overwrite_of_a_custom_location_partition_records_no_insert(
        lake: Lake, custom: Path) -> None:
    """Issue 11 item 7 (events complete). `INSERT OVERWRITE TABLE cl PARTITION (p=9)` where
    p=9 lives at a custom location under the root: the recycle is recorded with no
    partition, and there is no INSERT event for the new file (recordInsert walks only the
    table directory): a replica drops p=9's old file and never gets the new row."""
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE cl PARTITION (p=9) SELECT 7")
    evs = lake.daemon.events_after(since)
    new = {p for p in data_only(data_files(custom))}
    inserted = {f["path"] for e in evs if e["eventType"] == "INSERT" for f in e["files"]}
    assert new <= inserted, [(e["eventType"], e["partitions"], len(e["files"])) for e in evs]
    [ow] = [e for e in evs if e["eventType"] == "INSERT_OVERWRITE"]
    assert ow["partitions"] == [{"p": "9"}]


def test_truncate_records_a_custom_location_partition_as_an_anonymous_delete(
        lake: Lake, custom: Path) -> None:
    """Invariant 2 (one statement, one unit) and issue 11 item 7. TRUNCATE TABLE cl: the
    partitions in the table directory are one TRUNCATE event; p=9's files (custom location)
    are a second recycle, op DELETE with db and table null, committed separately: a replica
    cannot tie it to the table, and truncates only p=1 and p=2."""
    since = lake.daemon.current()
    lake.sql("TRUNCATE TABLE cl")
    got = [(e["eventType"], e.get("table"), e["partitions"]) for e in destructive(lake, since)]
    assert len(got) == 1 and got[0][:2] == ("TRUNCATE", "cl"), got
    assert {"p": "9"} in got[0][2], got

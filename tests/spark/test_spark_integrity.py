"""Integrity of the Spark hook (issue 11), through Spark SQL, the DataFrame API and the
Hadoop FileSystem on real PySpark local[2], a real daemon and real files.

1. An overwrite recycles exactly the files that were there when Spark asked for the delete,
   under committer v1 and v2: never the job's own output, never a concurrent writer's file.
2. A warehouse root, and any directory containing one, is never removed: refused with an
   error naming the root, nothing deleted.
3. A statement is one unit: its deletes are prepared at the daemon and committed only once
   the statement's own commit succeeded; a failure anywhere (a refused partition, a failed
   job or metastore commit) leaves every file and catalog entry as it was, with no event.
   Failures between prepare and commit are made with the shim's test fault points
   (spark.cmroot.test.failAfterPrepare / pauseAfterPrepare, see CmrootFaults.java).
4. The cmroot settings are the application's: a session cannot change them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cmroot.vocab import DESTRUCTIVE
from tests.spark.conftest import Lake
from tests.spark.sparklib import (
    app_conf,
    assert_retrievable,
    data_files,
    recycled_paths,
    shim_log,
)
from tests.spark.test_spark_failure import error_chain

pytestmark = pytest.mark.timeout(600)

COMMITTER = "mapreduce.fileoutputcommitter.algorithm.version"


@pytest.fixture(params=["1", "2"], ids=["committer-v1", "committer-v2"])
def committer(lake: Lake, request: pytest.FixtureRequest) -> Iterator[str]:
    """FileOutputCommitter v1 (tasks commit into _temporary, the job moves them) or v2
    (tasks commit straight into the table directory). A session conf reaches the Hadoop
    conf of every write of that session."""
    lake.spark.conf.set(COMMITTER, request.param)
    try:
        yield str(request.param)
    finally:
        lake.spark.conf.unset(COMMITTER)


def rows(lake: Lake, q: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in lake.sql(q))


def recycles(lake: Lake, since: int) -> list[dict[str, Any]]:
    return [e for e in lake.daemon.events_after(since)
            if e["eventType"] in DESTRUCTIVE and e["files"]]


def make_partitioned(lake: Lake, name: str) -> dict[str, bytes]:
    lake.sql(f"DROP TABLE IF EXISTS {name}")
    lake.sql(f"CREATE TABLE {name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, 1), (2, 1), (3, 2), (4, 3)")
    return data_files(lake.table_dir(name))


def parts(files: dict[str, bytes] | set[str]) -> set[str]:
    """The data files (part-*) among `files`: not Spark's _SUCCESS or .crc companions,
    whose names a new job writes again."""
    return {p for p in files if "/part-" in p}


def check_recycled_exactly(lake: Lake, since: int, old: dict[str, bytes]) -> None:
    """The statement's recycles hold exactly the data files of `old` (the files there before
    it), each retrievable; none of the data files on disk now was recycled."""
    events = recycles(lake, since)
    recycled = recycled_paths(events)
    assert parts(recycled) == parts(old), events
    assert_retrievable(lake.daemon.client, {p: old[p] for p in parts(old)})


# -- 1. an overwrite never recycles its own output ----------------------------------------

def test_static_partition_overwrite(lake: Lake, committer: str) -> None:
    t = f"ov_static_{committer}"
    before = make_partitioned(lake, t)
    old = {p: b for p, b in before.items() if "/p=1/" in p}
    since = lake.daemon.current()
    lake.sql(f"INSERT OVERWRITE TABLE {t} PARTITION (p=1) SELECT 10")
    assert rows(lake, f"SELECT a, p FROM {t}") == [(3, 2), (4, 3), (10, 1)]
    check_recycled_exactly(lake, since, old)


def test_whole_table_overwrite(lake: Lake, committer: str) -> None:
    t = f"ov_whole_{committer}"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    lake.sql(f"INSERT OVERWRITE TABLE {t} SELECT 7, 9")
    assert rows(lake, f"SELECT a, p FROM {t}") == [(7, 9)]
    check_recycled_exactly(lake, since, before)


def test_dynamic_partition_overwrite(lake: Lake, committer: str) -> None:
    t = f"ov_dyn_{committer}"
    before = make_partitioned(lake, t)
    old = {p: b for p, b in before.items() if "/p=2/" not in p}
    since = lake.daemon.current()
    lake.spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    try:
        lake.sql(f"INSERT OVERWRITE TABLE {t} SELECT a * 10, p FROM {t} WHERE p <> 2")
    finally:
        lake.spark.conf.unset("spark.sql.sources.partitionOverwriteMode")
    assert rows(lake, f"SELECT a, p FROM {t}") == [(3, 2), (10, 1), (20, 1), (40, 3)]
    check_recycled_exactly(lake, since, old)


def test_insert_into_overwrite(lake: Lake, committer: str) -> None:
    t = f"ov_insert_into_{committer}"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    df = lake.spark.createDataFrame([(42, 3), (43, 5)], "a INT, p INT")
    df.write.insertInto(t, overwrite=True)
    assert rows(lake, f"SELECT a, p FROM {t}") == [(42, 3), (43, 5)]
    check_recycled_exactly(lake, since, before)


def test_save_as_table_overwrite(lake: Lake, committer: str) -> None:
    t = f"ov_sat_{committer}"
    lake.sql(f"DROP TABLE IF EXISTS {t}")
    lake.spark.createDataFrame([(1, "x"), (2, "y")], "a INT, b STRING").write.saveAsTable(t)
    before = data_files(lake.table_dir(t))
    since = lake.daemon.current()
    df = lake.spark.createDataFrame([(3, "z")], "a INT, b STRING")
    df.write.mode("overwrite").saveAsTable(t)
    assert rows(lake, f"SELECT a, b FROM {t}") == [(3, "z")]
    check_recycled_exactly(lake, since, before)


def test_path_overwrite_under_the_root(lake: Lake, committer: str) -> None:
    target = lake.warehouse / "raw" / f"ov_path_{committer}"
    df = lake.spark.createDataFrame([(1, "a"), (2, "b")], "id INT, day STRING")
    df.write.mode("overwrite").partitionBy("day").parquet(str(target))
    before = data_files(target)
    since = lake.daemon.current()
    df2 = lake.spark.createDataFrame([(9, "c")], "id INT, day STRING")
    df2.write.mode("overwrite").partitionBy("day").save(str(target), format="parquet")
    got = sorted(tuple(r) for r in lake.spark.read.parquet(str(target)).collect())
    assert got == [(9, "c")]
    check_recycled_exactly(lake, since, before)


def test_a_file_added_while_the_overwrite_runs_stays(lake: Lake, tmp_path: Path) -> None:
    """A writer that adds a file to the partition after Spark asked for the delete (here a
    task of the statement itself plays that writer): the file is not recycled, it stays."""
    t = "ov_concurrent"
    before = make_partitioned(lake, t)
    old = {p: b for p, b in before.items() if "/p=1/" in p}
    intruder = lake.table_dir(t) / "p=1" / "part-concurrent-writer.parquet"
    sample = next(p for p in before if "/p=3/" in p and p.endswith(".parquet"))

    def add_file(a: int) -> int:
        if not intruder.exists():
            intruder.write_bytes(Path(sample).read_bytes())
        return a

    lake.spark.udf.register("add_file", add_file, "int")
    since = lake.daemon.current()
    lake.spark.conf.set(COMMITTER, "2")
    try:
        lake.sql(f"INSERT OVERWRITE TABLE {t} PARTITION (p=1) SELECT add_file(10)")
    finally:
        lake.spark.conf.unset(COMMITTER)
    assert intruder.exists()
    check_recycled_exactly(lake, since, old)
    assert rows(lake, f"SELECT a, p FROM {t}") == [(3, 2), (4, 1), (4, 3), (10, 1)]


# -- 2. ancestors of a warehouse root -----------------------------------------------------

@pytest.fixture
def nested_root(lake: Lake, tmp_path: Path) -> Iterator[Path]:
    """A second warehouse root, <tmp>/outer/inner/root, for the hook (the daemon never hears
    of it: every refusal here happens before a request), holding a file, with files in its
    ancestors too."""
    root = tmp_path / "outer" / "inner" / "root"
    (root / "t").mkdir(parents=True)
    for f in (root / "t" / "data", tmp_path / "outer" / "keep", root.parent / "keep"):
        f.write_bytes(b"must stay")
    roots = f"{lake.warehouse},{root}"
    with app_conf(lake.spark, "spark.cmroot.warehouseRoots", roots):
        yield root


def everything_under(p: Path) -> dict[str, bytes]:
    return {str(f): f.read_bytes() for f in p.rglob("*") if f.is_file()}


def refused(e: BaseException, root: Path) -> None:
    text = error_chain(e)
    assert "cmroot refuses" in text and f"the warehouse root {root}" in text, text[:3000]


def hadoop_delete(lake: Lake, p: Path) -> Callable[[], Any]:
    jvm = lake.spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(f"file://{p}")
    fs = path.getFileSystem(lake.spark.sparkContext._jsc.hadoopConfiguration())
    return lambda: fs.delete(path, True)


@pytest.mark.parametrize("target", ["root", "parent", "grandparent"])
def test_hadoop_delete_of_a_root_or_an_ancestor_is_refused(
        lake: Lake, nested_root: Path, tmp_path: Path, target: str) -> None:
    p = {"root": nested_root, "parent": nested_root.parent,
         "grandparent": nested_root.parent.parent}[target]
    before = everything_under(tmp_path)
    with pytest.raises(Exception) as info:
        hadoop_delete(lake, p)()
    refused(info.value, nested_root)
    assert everything_under(tmp_path) == before


@pytest.mark.parametrize("target", ["root", "parent"])
def test_overwrite_of_a_root_or_an_ancestor_is_refused(
        lake: Lake, nested_root: Path, tmp_path: Path, target: str) -> None:
    p = nested_root if target == "root" else nested_root.parent
    before = everything_under(tmp_path)
    df = lake.spark.createDataFrame([(1,)], "a INT")
    with pytest.raises(Exception) as info:
        df.write.mode("overwrite").parquet(str(p))
    refused(info.value, nested_root)
    assert everything_under(tmp_path) == before


def test_drop_database_located_at_an_ancestor_is_refused(
        lake: Lake, nested_root: Path, tmp_path: Path) -> None:
    lake.sql(f"CREATE DATABASE anc LOCATION '{nested_root.parent}'")
    lake.sql("CREATE TABLE anc.t USING parquet AS SELECT 1 AS a")
    before = everything_under(tmp_path)
    since = lake.daemon.current()
    with pytest.raises(Exception) as info:
        lake.sql("DROP DATABASE anc CASCADE")
    refused(info.value, nested_root)
    assert everything_under(tmp_path) == before
    assert rows(lake, "SELECT a FROM anc.t") == [(1,)]
    assert recycles(lake, since) == []


# -- 3. one statement, one transaction ----------------------------------------------------

def escaping_symlink(lake: Lake, table: str, part: str, tmp_path: Path) -> Path:
    """A symlink in a partition directory pointing outside the roots: the daemon refuses to
    recycle that partition. (Remove it before reading the table: it is no data file.)"""
    secret = tmp_path / "outside-secret"
    secret.write_bytes(b"not the warehouse's")
    link = lake.table_dir(table) / part / "escape"
    os.symlink(secret, link)
    return link


def partitions(lake: Lake, table: str) -> list[str]:
    return sorted(r[0] for r in lake.sql(f"SHOW PARTITIONS {table}"))


ALL_ROWS = [(1, 1), (2, 1), (3, 2), (4, 3)]


def test_multi_partition_drop_refused_in_part_changes_nothing(
        lake: Lake, tmp_path: Path) -> None:
    t = "mdp_refused"
    make_partitioned(lake, t)
    link = escaping_symlink(lake, t, "p=3", tmp_path)
    before = data_files(lake.table_dir(t))
    since = lake.daemon.current()
    with pytest.raises(Exception) as info:
        lake.sql(f"ALTER TABLE {t} DROP PARTITION (p=1), PARTITION (p=2), PARTITION (p=3)")
    assert "symlink" in error_chain(info.value)
    assert data_files(lake.table_dir(t)) == before
    link.unlink()
    assert partitions(lake, t) == ["p=1", "p=2", "p=3"]
    assert rows(lake, f"SELECT a, p FROM {t}") == ALL_ROWS
    assert lake.daemon.events_after(since) == []


def test_multi_partition_drop_is_one_event(lake: Lake) -> None:
    t = "mdp_ok"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    lake.sql(f"ALTER TABLE {t} DROP PARTITION (p=1), PARTITION (p=3)")
    [ev] = recycles(lake, since)
    assert (ev["eventType"], ev["table"]) == ("DROP_PARTITION", t)
    assert sorted(ev["partitions"], key=str) == [{"p": "1"}, {"p": "3"}]
    gone = {p: b for p, b in before.items() if "/p=2/" not in p}
    assert parts(recycled_paths([ev])) == parts(gone)
    assert [e["eventType"] for e in lake.daemon.events_after(since)] == ["DROP_PARTITION"]
    assert rows(lake, f"SELECT a, p FROM {t}") == [(3, 2)]


def test_partitioned_truncate_refused_in_part_changes_nothing(
        lake: Lake, tmp_path: Path) -> None:
    t = "tr_refused"
    make_partitioned(lake, t)
    link = escaping_symlink(lake, t, "p=3", tmp_path)
    before = data_files(lake.table_dir(t))
    since = lake.daemon.current()
    with pytest.raises(Exception) as info:
        lake.sql(f"TRUNCATE TABLE {t}")
    assert "symlink" in error_chain(info.value)
    assert data_files(lake.table_dir(t)) == before
    link.unlink()
    assert rows(lake, f"SELECT a, p FROM {t}") == ALL_ROWS
    assert lake.daemon.events_after(since) == []


def test_partitioned_truncate_is_one_event(lake: Lake) -> None:
    t = "tr_one"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    lake.sql(f"TRUNCATE TABLE {t}")
    [ev] = recycles(lake, since)
    assert (ev["eventType"], ev["table"]) == ("TRUNCATE", t)
    assert sorted(ev["partitions"], key=str) == [{"p": "1"}, {"p": "2"}, {"p": "3"}]
    assert parts(recycled_paths([ev])) == parts(before)
    assert rows(lake, f"SELECT a, p FROM {t}") == []


def test_hive_format_overwrite_is_one_event(lake: Lake) -> None:
    t = "hive_ow"
    lake.sql(f"CREATE TABLE {t} (a INT) STORED AS TEXTFILE")
    for i in range(3):  # three files
        lake.sql(f"INSERT INTO {t} VALUES ({i})")
    before = data_files(lake.table_dir(t))
    assert len(parts(before)) == 3
    since = lake.daemon.current()
    lake.sql(f"INSERT OVERWRITE TABLE {t} SELECT 9")
    [ev] = recycles(lake, since)
    assert (ev["eventType"], ev["table"]) == ("INSERT_OVERWRITE", t)
    assert parts(recycled_paths([ev])) == parts(before)
    assert rows(lake, f"SELECT a FROM {t}") == [(9,)]


def test_load_data_overwrite_is_one_event(lake: Lake, tmp_path: Path) -> None:
    t = "load_ow"
    lake.sql(f"CREATE TABLE {t} (a INT) STORED AS TEXTFILE")
    for i in range(2):
        lake.sql(f"INSERT INTO {t} VALUES ({i})")
    before = data_files(lake.table_dir(t))
    src = tmp_path / "load.txt"
    src.write_text("7\n8\n")
    since = lake.daemon.current()
    lake.sql(f"LOAD DATA LOCAL INPATH '{src}' OVERWRITE INTO TABLE {t}")
    [ev] = recycles(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"]) == ("INSERT_OVERWRITE", "default", t)
    assert parts(recycled_paths([ev])) == parts(before)
    assert rows(lake, f"SELECT a FROM {t}") == [(7,), (8,)]


FAIL = "spark.cmroot.test.failAfterPrepare"
PAUSE = "spark.cmroot.test.pauseAfterPrepare"


def test_failed_job_commit_after_prepare_puts_the_old_files_back(lake: Lake) -> None:
    t = "fault_job"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    with app_conf(lake.spark, FAIL, "true"), pytest.raises(Exception) as info:
        lake.sql(f"INSERT OVERWRITE TABLE {t} PARTITION (p=1) SELECT 10")
    assert "failAfterPrepare" in error_chain(info.value)
    assert parts(data_files(lake.table_dir(t))) == parts(before)
    assert rows(lake, f"SELECT a, p FROM {t}") == ALL_ROWS
    assert lake.daemon.events_after(since) == []


@pytest.mark.parametrize("how", ["sql", "saveAsTable"])
def test_failed_metastore_drop_after_prepare_puts_the_files_back(lake: Lake, how: str) -> None:
    """DROP TABLE runs as a statement; saveAsTable(overwrite) drops the old table through
    the catalog outside any command: the post-event listener aborts its recycle."""
    t = f"fault_drop_{how.lower()}"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    with app_conf(lake.spark, FAIL, "true"), pytest.raises(Exception) as info:
        if how == "sql":
            lake.sql(f"DROP TABLE {t}")
        else:
            lake.spark.createDataFrame([(5, 5)], "a INT, p INT").write.mode(
                "overwrite").saveAsTable(t)
    assert "failAfterPrepare" in error_chain(info.value)
    assert data_files(lake.table_dir(t)) == before
    assert rows(lake, f"SELECT a, p FROM {t}") == ALL_ROWS
    assert lake.daemon.events_after(since) == []


class Paused:
    """A statement run on another thread that stops right after its recycle was prepared
    (the pauseAfterPrepare fault point), until `go()`."""

    def __init__(self, lake: Lake, tmp_path: Path, statement: str) -> None:
        self.dir = tmp_path / "fault"
        self.dir.mkdir()
        self.error: BaseException | None = None
        self.lake = lake

        def run() -> None:
            try:
                lake.sql(statement)
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=run)

    def __enter__(self) -> Paused:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not (self.dir / "reached").exists():
            assert self.thread.is_alive() and time.monotonic() < deadline, self.error
            time.sleep(0.05)
        return self

    def go(self) -> None:
        (self.dir / "go").touch()

    def __exit__(self, *exc: object) -> None:
        self.go()
        self.thread.join(300)


def test_daemon_restarted_between_prepare_and_commit(lake: Lake, tmp_path: Path) -> None:
    """The commit meets no daemon, retries, and publishes once it is back (within the
    lease, the daemon kept the prepared recycle across its restart)."""
    t = "restart_drop"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    with app_conf(lake.spark, PAUSE, str(tmp_path / "fault")):
        with Paused(lake, tmp_path, f"DROP TABLE {t}") as paused:
            lake.daemon.stop()
            paused.go()  # the statement goes on: its commit finds no daemon
            lake.daemon.start()
        assert paused.error is None, error_chain(paused.error)
    [ev] = recycles(lake, since)
    assert (ev["eventType"], ev["table"]) == ("DROP_TABLE", t)
    assert_retrievable(lake.daemon.client, before)
    assert not lake.table_dir(t).exists()


def test_the_lease_is_renewed_while_the_statement_runs(lake: Lake, tmp_path: Path) -> None:
    """A statement that stays between prepare and commit longer than its lease (a long job
    commit or metastore transaction): the shim renews the lease, the commit publishes."""
    t = "renewed_drop"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    with app_conf(lake.spark, "spark.cmroot.lease", "3s"), \
            app_conf(lake.spark, PAUSE, str(tmp_path / "fault")):
        with Paused(lake, tmp_path, f"DROP TABLE {t}") as paused:
            # The time under test, not a synchronization: longer than the lease plus a run of
            # the daemon's 5 s expiry job, which would have rolled back an unrenewed drop.
            time.sleep(12)
        assert paused.error is None, error_chain(paused.error)
    [ev] = recycles(lake, since)
    assert (ev["eventType"], ev["table"]) == ("DROP_TABLE", t)
    assert_retrievable(lake.daemon.client, before)


def test_unreachable_abort_is_rolled_back_by_the_lease(lake: Lake, tmp_path: Path) -> None:
    t = "lease_drop"
    before = make_partitioned(lake, t)
    since = lake.daemon.current()
    with app_conf(lake.spark, "spark.cmroot.lease", "2s"), \
            app_conf(lake.spark, PAUSE, str(tmp_path / "fault")), \
            app_conf(lake.spark, FAIL, "true"), shim_log(lake.spark) as shim:
        with Paused(lake, tmp_path, f"DROP TABLE {t}") as paused, lake.daemon.down():
            paused.go()
            paused.thread.join(300)  # failed; its abort found no daemon
        assert paused.error is not None and "failAfterPrepare" in error_chain(paused.error)
        log = shim()
    assert "could not abort" in log and "when the transaction's lease passes" in log, log[-3000:]
    deadline = time.monotonic() + 120  # the daemon's lease job runs every 5 s
    while data_files(lake.table_dir(t)) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert data_files(lake.table_dir(t)) == before
    assert rows(lake, f"SELECT a, p FROM {t}") == ALL_ROWS
    assert lake.daemon.events_after(since) == []


# -- 4. the settings are the application's ------------------------------------------------

def test_a_session_cannot_switch_the_hook_off(lake: Lake) -> None:
    for key in ("spark.cmroot.enabled", "spark.cmroot.failOpen", "spark.cmroot.url"):
        with pytest.raises(Exception) as info:
            lake.sql(f"SET {key}=false")
        assert f"{key} is a setting of the Spark application" in str(info.value)
        with pytest.raises(Exception, match="static"):
            lake.spark.conf.set(key, "false")
    # Nor through the Hadoop conf a query's file systems see.
    lake.sql("SET spark.hadoop.spark.cmroot.enabled=false")
    lake.sql("SET spark.cmroot.enabled")  # reading it is fine
    try:
        t = "still_hooked"
        before = make_partitioned(lake, t)
        since = lake.daemon.current()
        lake.sql(f"DROP TABLE {t}")
    finally:
        lake.spark.conf.unset("spark.hadoop.spark.cmroot.enabled")
    [ev] = recycles(lake, since)
    assert parts(recycled_paths([ev])) == parts(before)

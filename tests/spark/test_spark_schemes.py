"""Spark's hook on a warehouse on another Hadoop file system than `file`: `disk://`
(tests/jvm: a second scheme over the local disk, standing for HDFS or an object store), its
hook built by `cmroot spark-conf --scheme disk=CLASS` as a subclass of the scheme's own file
system class. Real PySpark local[2] with its embedded metastore, a real daemon reading the
scheme through its fsspec twin.

Every destructive statement keeps what it deletes there, retrievable by (path, checksum)
with the same bytes; the daemon down fails the statement with nothing deleted; a delete of
the root is refused; LOAD DATA, which the hook does not keep, is refused before it runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmroot import jvm
from cmroot import spark as cmspark
from cmroot.vocab import DESTRUCTIVE as DESTRUCTIVE_OPS
from tests.jvm import DISK_FS, FSSPEC_DISK, disk_fs_jar
from tests.spark.sparklib import (
    REPO,
    Daemon,
    Lake,
    app_conf,
    assert_retrievable,
    fresh_jvm_if_needed,
    release_filesystems,
    spark_builder,
)

pytestmark = pytest.mark.timeout(600)


class DiskLake(Lake):
    """A lake whose warehouse is `disk://<base>/lake`."""

    @property
    def lake(self) -> Path:
        return self.base / "lake"

    def table_dir(self, table: str, db: str = "default") -> Path:
        return self.lake / table if db == "default" else self.lake / f"{db}.db" / table


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiskLake]:
    base = tmp_path_factory.mktemp("disk-lake")
    (base / "lake").mkdir()
    daemon = Daemon(base, env={
        "CMROOT_STORE_WAREHOUSE_ROOTS": f"{base / 'warehouse'},disk://{base / 'lake'}",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(FSSPEC_DISK)]),
    }).start()
    hook = jvm.build_scheme_jar("disk", DISK_FS, (disk_fs_jar(),))
    fresh_jvm_if_needed(hook)
    builder = spark_builder(base, base / "lake").config(
        "spark.sql.warehouse.dir", f"disk://{base / 'lake'}")
    spark = cmspark.configure(builder, url=daemon.url, schemes={"disk": DISK_FS},
                              scheme_jars=(disk_fs_jar(),)).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield DiskLake(base, daemon, spark)
    finally:
        spark.stop()
        release_filesystems()
        fresh_jvm_if_needed(None)  # the next module's application gets a JVM of its own
        daemon.stop()


def files_of(d: Path) -> dict[str, bytes]:
    """The data files under `d` by their `disk://` paths (as the events name them)."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = [n for n in dirnames if not n.startswith((".", "_"))]
        for f in filenames:
            if not f.startswith((".", "_")):
                p = os.path.join(dirpath, f)
                out[f"disk://{p}"] = Path(p).read_bytes()
    return out


def recycles(lake: Lake, since: int) -> list[dict[str, Any]]:
    return [e for e in lake.daemon.events_after(since)
            if e["eventType"] in DESTRUCTIVE_OPS and e["files"]]


def kept(lake: DiskLake, since: int, before: dict[str, bytes], op: str) -> None:
    """The files of `before` now gone were recycled by one `op` event, bytes intact."""
    now = files_of(lake.lake)
    gone = {p: b for p, b in before.items() if now.get(p) != b}
    assert gone, "the statement removed nothing"
    events = recycles(lake, since)
    assert [e["eventType"] for e in events] == [op], events
    assert set(gone) <= {f["path"] for f in events[0]["files"]}
    assert_retrievable(lake.daemon.client, gone)


def make(lake: DiskLake, name: str, fmt: str = "USING parquet") -> dict[str, bytes]:
    lake.sql(f"CREATE TABLE {name} (a INT, p INT) {fmt} PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, 1), (2, 1), (3, 2)")
    files = files_of(lake.table_dir(name))
    assert len(files) >= 2
    return files


def rows(lake: Lake, name: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in lake.sql(f"SELECT * FROM {name}"))


def test_the_hook_is_the_schemes_own_class(lake: DiskLake) -> None:
    """Hive and Spark may cast a scheme's file system to its class: the hook is one."""
    jvm_ = lake.spark.sparkContext._jvm
    conf = lake.spark.sparkContext._jsc.hadoopConfiguration()
    fs = jvm_.org.apache.hadoop.fs.Path(f"disk://{lake.lake}").getFileSystem(conf)
    assert fs.getClass().getName() == jvm.scheme_class_name("disk")
    assert fs.getClass().getSuperclass().getName() == DISK_FS


@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_drop_table(lake: DiskLake, fmt: str) -> None:
    name = "drop_" + fmt.split()[-1].lower()
    before = make(lake, name, fmt)
    since = lake.daemon.current()
    lake.sql(f"DROP TABLE {name}")
    assert not lake.table_dir(name).exists()
    kept(lake, since, before, "DROP_TABLE")


def test_drop_partition(lake: DiskLake) -> None:
    before = make(lake, "dp")
    since = lake.daemon.current()
    lake.sql("ALTER TABLE dp DROP PARTITION (p=1)")
    kept(lake, since, {p: b for p, b in before.items() if "/p=1/" in p}, "DROP_PARTITION")
    assert rows(lake, "dp") == [(3, 2)]


def test_truncate(lake: DiskLake) -> None:
    before = make(lake, "tr")
    since = lake.daemon.current()
    lake.sql("TRUNCATE TABLE tr")
    kept(lake, since, before, "TRUNCATE")
    assert rows(lake, "tr") == []


@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_insert_overwrite(lake: DiskLake, fmt: str) -> None:
    name = "ow_" + fmt.split()[-1].lower()
    before = make(lake, name, fmt)
    since = lake.daemon.current()
    lake.sql(f"INSERT OVERWRITE TABLE {name} PARTITION (p=1) SELECT 9")
    assert rows(lake, name) == [(3, 2), (9, 1)]
    kept(lake, since, {p: b for p, b in before.items() if "/p=1/" in p}, "INSERT_OVERWRITE")
    # The new files are recorded where they are, on the scheme, for replication.
    inserts = [e for e in lake.daemon.events_after(since) if e["eventType"] == "INSERT"]
    new = {p for p in files_of(lake.table_dir(name)) if "/p=1/" in p}
    assert new and new <= {f["path"] for e in inserts for f in e["files"]}


def test_daemon_down_fails_closed(lake: DiskLake) -> None:
    before = make(lake, "down")
    with lake.daemon.down():
        for statement in ("INSERT OVERWRITE TABLE down PARTITION (p=1) SELECT 9",
                          "TRUNCATE TABLE down", "DROP TABLE down"):
            with pytest.raises(Exception, match="cmroot"):
                lake.sql(statement)
    assert files_of(lake.table_dir("down")) == before
    assert rows(lake, "down") == [(1, 1), (2, 1), (3, 2)]


def test_a_delete_of_the_root_is_refused(lake: DiskLake) -> None:
    make(lake, "stays")
    before = files_of(lake.lake)
    jvm_ = lake.spark.sparkContext._jvm
    conf = lake.spark.sparkContext._jsc.hadoopConfiguration()
    for target in (lake.lake, lake.base):
        path = jvm_.org.apache.hadoop.fs.Path(f"disk://{target}")
        with pytest.raises(Exception, match="warehouse root"):
            path.getFileSystem(conf).delete(path, True)
    assert files_of(lake.lake) == before


def test_load_data_is_refused(lake: DiskLake, tmp_path: Path) -> None:
    lake.sql("CREATE TABLE loaded (a STRING) STORED AS TEXTFILE")
    src = lake.lake / "incoming.txt"  # data outside any table, inside the root
    src.write_text("x\n")
    since = lake.daemon.current()
    with pytest.raises(Exception, match="LOAD DATA"):
        lake.sql(f"LOAD DATA INPATH 'disk://{src}' INTO TABLE loaded")
    assert src.read_text() == "x\n" and rows(lake, "loaded") == []
    assert lake.daemon.events_after(since) == []


def spark_conf_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "spark-conf", "--url", "http://127.0.0.1:9750",
         *args], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_spark_conf_scheme_prints_the_hook() -> None:
    p = spark_conf_cli("--scheme", f"disk={DISK_FS}", "--scheme-jar", disk_fs_jar())
    assert p.returncode == 0, p.stderr
    conf = dict(a.split("=", 1) for a in shlex.split(p.stdout)[1::2])
    assert conf["spark.hadoop.fs.disk.impl"] == jvm.scheme_class_name("disk")
    assert disk_fs_jar() in conf["spark.driver.extraClassPath"].split(os.pathsep)
    hook = jvm.build_scheme_jar("disk", DISK_FS, (disk_fs_jar(),))
    assert hook in conf["spark.executor.extraClassPath"].split(os.pathsep)


def test_the_hdfs_hook_compiles_against_pysparks_hadoop() -> None:
    """HDFS itself cannot run here: its hook is only compiled (see the README)."""
    jar = jvm.build_scheme_jar("hdfs", jvm.SCHEME_CLASSES["hdfs"])
    name = jvm.scheme_class_name("hdfs").replace(".", "/") + ".class"
    assert name in zipfile.ZipFile(jar).namelist()


@pytest.mark.parametrize(("args", "words"), [
    (["--scheme", "file"], ["SCHEME=CLASS"]),
    (["--scheme", "Bad Scheme"], ["SCHEME=CLASS"]),
    (["--scheme", "myfs"], ["myfs", "--scheme myfs=CLASS"]),
    (["--scheme", "disk=no.such.FileSystem"], ["disk://", "--scheme-jar"]),
    (["--scheme", "hdfs", "--scheme-jar", "/nonexistent.jar"], ["/nonexistent.jar"]),
])
def test_spark_conf_scheme_errors(args: list[str], words: list[str]) -> None:
    p = spark_conf_cli(*args)
    assert p.returncode != 0 and p.stdout == ""
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    for w in words:
        assert w in p.stderr, p.stderr


# -- review 24: escaped partition values, dynamic and failing overwrites, renames, bulk
# deletes, and the local root beside a scheme's (the shared Deletes) --------------------

ODD = "x:y%z"  # a partition value Spark escapes in its directory name (p=x%3Ay%25z)


def recycled(lake: DiskLake, since: int) -> list[dict[str, Any]]:
    return [e for e in lake.daemon.events_after(since)
            if e["eventType"] in DESTRUCTIVE_OPS and e["files"]]


def all_kept(lake: DiskLake, since: int, before: dict[str, bytes],
             ops: set[str] | None = None) -> set[str]:
    """Every file of `before` now gone or changed is recycled (by events of `ops`), bytes
    intact. Returns the gone paths."""
    now = files_of(lake.lake)
    gone = {p: b for p, b in before.items() if now.get(p) != b}
    assert gone, "the statement removed nothing"
    events = recycled(lake, since)
    if ops is not None:
        assert {e["eventType"] for e in events} <= ops, events
    paths = {f["path"] for e in events for f in e["files"]}
    assert set(gone) <= paths, (sorted(set(gone) - paths), events)
    assert_retrievable(lake.daemon.client, gone)
    return set(gone)


def hadoop(lake: DiskLake) -> tuple[Any, Any]:
    jvm_ = lake.spark.sparkContext._jvm
    conf = lake.spark.sparkContext._jsc.hadoopConfiguration()
    fs = jvm_.org.apache.hadoop.fs.Path(f"disk://{lake.lake}").getFileSystem(conf)
    return jvm_, fs


def disk(jvm_: Any, p: Path) -> Any:
    return jvm_.org.apache.hadoop.fs.Path(f"disk://{p}")


# -- partition values Spark escapes ---------------------------------------------------------

def make_odd(lake: DiskLake, name: str, fmt: str = "USING parquet") -> dict[str, bytes]:
    lake.sql(f"CREATE TABLE {name} (a INT, p STRING) {fmt} PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, '{ODD}'), (2, '{ODD}'), (3, 'k')")
    files = files_of(lake.table_dir(name))
    assert any("%3A" in p for p in files), files
    return files


def odd_part(files: dict[str, bytes]) -> dict[str, bytes]:
    return {p: b for p, b in files.items() if "%3A" in p}


def test_drop_partition_escaped_value(lake: DiskLake) -> None:
    before = make_odd(lake, "odd_dp")
    since = lake.daemon.current()
    lake.sql(f"ALTER TABLE odd_dp DROP PARTITION (p='{ODD}')")
    assert rows(lake, "odd_dp") == [(3, "k")]
    gone = all_kept(lake, since, before, {"DROP_PARTITION"})
    assert gone == set(odd_part(before))
    events = recycled(lake, since)
    assert [e["partitions"] for e in events] == [[{"p": ODD}]], events


def test_truncate_partition_escaped_value(lake: DiskLake) -> None:
    before = make_odd(lake, "odd_tr")
    since = lake.daemon.current()
    lake.sql(f"TRUNCATE TABLE odd_tr PARTITION (p='{ODD}')")
    assert rows(lake, "odd_tr") == [(3, "k")]
    gone = all_kept(lake, since, before, {"TRUNCATE"})
    assert gone == set(odd_part(before))
    events = recycled(lake, since)
    assert len(events) == 1 and events[0]["partitions"] == [{"p": ODD}], events


@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_static_overwrite_escaped_value(lake: DiskLake, fmt: str) -> None:
    name = "odd_ow_" + fmt.split()[-1].lower()
    before = make_odd(lake, name, fmt)
    since = lake.daemon.current()
    lake.sql(f"INSERT OVERWRITE TABLE {name} PARTITION (p='{ODD}') SELECT 9")
    assert rows(lake, name) == [(3, "k"), (9, ODD)]
    gone = all_kept(lake, since, before, {"INSERT_OVERWRITE"})
    assert gone == set(odd_part(before))
    events = recycled(lake, since)
    assert len(events) == 1 and events[0]["partitions"] == [{"p": ODD}], events
    inserts = [e for e in lake.daemon.events_after(since) if e["eventType"] == "INSERT"]
    new = set(odd_part(files_of(lake.table_dir(name))))
    assert new and new <= {f["path"] for e in inserts for f in e["files"]}, inserts


# -- dynamic partition overwrite ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_dynamic_overwrite(lake: DiskLake, fmt: str) -> None:
    name = "dyn_" + fmt.split()[-1].lower()
    before = make_odd(lake, name, fmt)
    since = lake.daemon.current()
    lake.sql("SET spark.sql.sources.partitionOverwriteMode=dynamic")
    lake.sql("SET hive.exec.dynamic.partition.mode=nonstrict")
    try:
        lake.sql(f"INSERT OVERWRITE TABLE {name} PARTITION (p) SELECT 9, '{ODD}'")
    finally:
        lake.sql("SET spark.sql.sources.partitionOverwriteMode=static")
    assert rows(lake, name) == [(3, "k"), (9, ODD)]
    gone = all_kept(lake, since, before, {"INSERT_OVERWRITE"})
    assert gone == set(odd_part(before))


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_overwrite_whose_job_fails_keeps_everything(lake: DiskLake, mode: str) -> None:
    name = "fail_" + mode
    lake.sql(f"CREATE TABLE {name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, 1), (2, 1), (3, 2)")
    before = files_of(lake.table_dir(name))
    since = lake.daemon.current()
    lake.sql(f"SET spark.sql.sources.partitionOverwriteMode={mode}")
    try:
        with pytest.raises(Exception, match="boom"):
            lake.sql(f"INSERT OVERWRITE TABLE {name} "
                     + ("PARTITION (p=1) SELECT " if mode == "static" else "SELECT ")
                     + "IF(id = 2, CAST(raise_error('boom') AS INT), CAST(id AS INT))"
                     + ("" if mode == "static" else ", 1") + " FROM range(4)")
    finally:
        lake.sql("SET spark.sql.sources.partitionOverwriteMode=static")
    assert files_of(lake.table_dir(name)) == before
    assert rows(lake, name) == [(1, 1), (2, 1), (3, 2)]
    assert recycled(lake, since) == []


# -- paths the catalog does not name -------------------------------------------------------------

def test_dataframe_overwrite_of_a_path(lake: DiskLake) -> None:
    target = lake.lake / "loose"
    lake.spark.range(4).repartition(2).write.parquet(f"disk://{target}")
    before = files_of(target)
    assert before
    since = lake.daemon.current()
    lake.spark.range(1).write.mode("overwrite").parquet(f"disk://{target}")
    assert sorted(r[0] for r in lake.spark.read.parquet(f"disk://{target}").collect()) == [0]
    all_kept(lake, since, before)


def test_custom_partition_location(lake: DiskLake) -> None:
    lake.sql("CREATE TABLE cust (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql("INSERT INTO cust VALUES (1, 1)")
    where = lake.lake / "elsewhere" / "p5"
    lake.sql(f"ALTER TABLE cust ADD PARTITION (p=5) LOCATION 'disk://{where}'")
    lake.sql("INSERT INTO cust PARTITION (p=5) SELECT 50")
    lake.sql("INSERT INTO cust PARTITION (p=5) SELECT 51")
    before = files_of(lake.lake)
    assert files_of(where)
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE cust PARTITION (p=5) SELECT 52")
    assert rows(lake, "cust") == [(1, 1), (52, 5)]
    all_kept(lake, since, {p: b for p, b in before.items() if str(where) in p},
             {"INSERT_OVERWRITE"})
    before = files_of(lake.lake)
    since = lake.daemon.current()
    lake.sql("ALTER TABLE cust DROP PARTITION (p=5)")
    all_kept(lake, since, {p: b for p, b in before.items() if str(where) in p},
             {"DROP_PARTITION"})


def test_ctas_rename_then_drop(lake: DiskLake) -> None:
    lake.sql("CREATE TABLE ctas USING parquet PARTITIONED BY (p) AS "
             "SELECT CAST(id AS INT) a, CAST(id % 2 AS INT) p FROM range(4)")
    lake.sql("ALTER TABLE ctas RENAME TO ctas2")
    before = files_of(lake.table_dir("ctas2"))
    assert before
    since = lake.daemon.current()
    lake.sql("DROP TABLE ctas2")
    assert not lake.table_dir("ctas2").exists()
    all_kept(lake, since, before, {"DROP_TABLE"})


def test_drop_database_cascade(lake: DiskLake) -> None:
    lake.sql("CREATE DATABASE casc")
    lake.sql("CREATE TABLE casc.t1 (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql("INSERT INTO casc.t1 VALUES (1, 1), (2, 2)")
    lake.sql("CREATE TABLE casc.t2 (a INT) STORED AS TEXTFILE")
    lake.sql("INSERT INTO casc.t2 VALUES (1)")
    db_dir = lake.lake / "casc.db"
    before = files_of(db_dir)
    assert len(before) >= 3
    since = lake.daemon.current()
    lake.sql("DROP DATABASE casc CASCADE")
    all_kept(lake, since, before)
    assert lake.lake.is_dir()


# -- the file system API (what any Spark application can call) -----------------------------

def one_file(lake: DiskLake, name: str) -> tuple[Path, bytes]:
    lake.sql(f"CREATE TABLE {name} (a INT) USING parquet")
    lake.sql(f"INSERT INTO {name} VALUES (1)")
    files = files_of(lake.table_dir(name))
    (p, b), = files.items()
    return Path(p[len("disk://"):]), b


def test_rename_onto_itself_deletes_nothing(lake: DiskLake) -> None:
    """A rename of a file onto itself is a no-op (the local hook says so): nothing recycled."""
    f, data = one_file(lake, "self_ren")
    jvm_, fs = hadoop(lake)
    since = lake.daemon.current()
    try:
        fs.rename(disk(jvm_, f), disk(jvm_, f))
    except Exception:
        pass
    assert f.exists() and f.read_bytes() == data, "the file is gone"
    assert recycled(lake, since) == [], "a DELETE recorded for a file still in place"
    assert rows(lake, "self_ren") == [(1,)]


def test_failed_rename_leaves_the_target(lake: DiskLake) -> None:
    """A rename that fails (a directory onto a file) changes nothing: its target stays."""
    f, data = one_file(lake, "fail_ren")
    src = lake.lake / "somedir"
    src.mkdir()
    (src / "x.txt").write_text("x")
    jvm_, fs = hadoop(lake)
    since = lake.daemon.current()
    try:
        ok = fs.rename(disk(jvm_, src), disk(jvm_, f))
    except Exception:
        ok = False
    assert not ok
    assert f.exists() and f.read_bytes() == data, "the target was removed by a failed rename"
    assert recycled(lake, since) == [], "a DELETE recorded by a rename that did not happen"


def test_rename_without_overwrite_does_not_replace(lake: DiskLake) -> None:
    """rename(src, dst, Rename.NONE) onto an existing file fails and leaves dst."""
    f, data = one_file(lake, "none_ren")
    src = lake.lake / "incoming.bin"
    src.write_bytes(b"new bytes")
    jvm_, fs = hadoop(lake)
    gw = lake.spark.sparkContext._gateway
    opts = gw.new_array(jvm_.org.apache.hadoop.fs.Options.Rename, 1)
    opts[0] = jvm_.org.apache.hadoop.fs.Options.Rename.NONE
    since = lake.daemon.current()
    try:
        fs.rename(disk(jvm_, src), disk(jvm_, f), opts)
    except Exception:
        pass
    assert f.read_bytes() == data, "a rename without OVERWRITE replaced an existing file"
    assert recycled(lake, since) == []


def test_bulk_delete_is_kept(lake: DiskLake) -> None:
    before = make_odd(lake, "bulk")
    jvm_, fs = hadoop(lake)
    gw = lake.spark.sparkContext._gateway
    targets = [p for p in before if "/p=k/" in p]
    base = disk(jvm_, lake.table_dir("bulk"))
    bd = fs.createBulkDelete(base)
    lst = gw.jvm.java.util.ArrayList()
    for p in targets:
        lst.add(jvm_.org.apache.hadoop.fs.Path(p))
    since = lake.daemon.current()
    bd.bulkDelete(lst)
    gone = all_kept(lake, since, {p: before[p] for p in targets})
    assert gone == set(targets)


def test_rename_of_a_root_is_refused(lake: DiskLake) -> None:
    """A root is never removed: renaming it away removes it as surely as a delete."""
    make_odd(lake, "stays_put")
    jvm_, fs = hadoop(lake)
    away = lake.base / "moved-lake"
    try:
        fs.rename(disk(jvm_, lake.lake), disk(jvm_, away))
    except Exception:
        pass
    moved = away.exists()
    if moved:
        os.rename(away, lake.lake)  # put it back for the other tests
    assert not moved, "the warehouse root was renamed away, its files out of cmroot's reach"


# -- statements that fail after part of them ran -------------------------------------------

@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_multi_insert_whose_second_part_fails(lake: DiskLake, fmt: str) -> None:
    """FROM ... INSERT OVERWRITE a ... INSERT OVERWRITE b ...: b's job fails after a's
    overwrite ran: all or nothing, a's old files back, no event."""
    tag = fmt.split()[-1].lower()
    a, b = f"mi_a_{tag}", f"mi_b_{tag}"
    for t in (a, b):
        lake.sql(f"CREATE TABLE {t} (x INT) {fmt}")
        lake.sql(f"INSERT INTO {t} VALUES (1), (2)")
    before = files_of(lake.lake)
    since = lake.daemon.current()
    with pytest.raises(Exception, match="boom"):
        lake.sql(f"FROM range(3) INSERT OVERWRITE TABLE {a} SELECT CAST(id AS INT) "
                 f"INSERT OVERWRITE TABLE {b} SELECT "
                 "IF(id = 1, CAST(raise_error('boom') AS INT), CAST(id AS INT))")
    assert rows(lake, a) == [(1,), (2,)]
    assert rows(lake, b) == [(1,), (2,)]
    assert {p: v for p, v in files_of(lake.lake).items() if f"/{a}/" in p or f"/{b}/" in p} \
        == {p: v for p, v in before.items() if f"/{a}/" in p or f"/{b}/" in p}
    assert lake.daemon.events_after(since) == []


@pytest.mark.parametrize("fmt", ["USING parquet", "STORED AS TEXTFILE"])
def test_daemon_down_dynamic_overwrite_fails_closed(lake: DiskLake, fmt: str) -> None:
    name = "downdyn_" + fmt.split()[-1].lower()
    before = make_odd(lake, name, fmt)
    lake.sql("SET spark.sql.sources.partitionOverwriteMode=dynamic")
    lake.sql("SET hive.exec.dynamic.partition.mode=nonstrict")
    try:
        with lake.daemon.down():
            with pytest.raises(Exception, match="cmroot"):
                lake.sql(f"INSERT OVERWRITE TABLE {name} PARTITION (p) SELECT 9, '{ODD}'")
            with pytest.raises(Exception, match="cmroot"):
                lake.spark.range(1).write.mode("overwrite").parquet(
                    f"disk://{lake.table_dir(name)}/p=k")
    finally:
        lake.sql("SET spark.sql.sources.partitionOverwriteMode=static")
    assert files_of(lake.table_dir(name)) == before
    assert rows(lake, name) == [(1, ODD), (2, ODD), (3, "k")]


def test_hive_overwrite_of_an_unpartitioned_table_is_one_event(lake: DiskLake) -> None:
    lake.sql("CREATE TABLE hun (x INT) STORED AS TEXTFILE")
    for i in range(3):
        lake.sql(f"INSERT INTO hun VALUES ({i})")
    before = files_of(lake.table_dir("hun"))
    assert len(before) == 3
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE hun SELECT 7")
    assert rows(lake, "hun") == [(7,)]
    all_kept(lake, since, before, {"INSERT_OVERWRITE"})
    assert len(recycled(lake, since)) == 1, recycled(lake, since)


# -- the same attacks on the local root (the shared Deletes refactor) ---------------------

def test_local_root_alongside(lake: DiskLake) -> None:
    """Spark's roots named both (spark.cmroot.warehouseRoots): the local hook, now on the
    shared Deletes, keeps a local overwrite and drop as before."""
    wh = lake.base / "warehouse"
    with app_conf(lake.spark, "spark.cmroot.warehouseRoots", f"{wh},disk://{lake.lake}"):
        local_root_alongside(lake, wh)


def local_root_alongside(lake: DiskLake, wh: Path) -> None:
    lake.sql(f"CREATE DATABASE locdb LOCATION 'file:{wh}/locdb.db'")
    lake.sql("CREATE TABLE locdb.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql("INSERT INTO locdb.t VALUES (1, 1), (2, 2)")
    tdir = wh / "locdb.db" / "t"
    before = {str(p): p.read_bytes() for p in tdir.rglob("part-*")}
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE locdb.t PARTITION (p=1) SELECT 5")
    lake.sql("DROP TABLE locdb.t")
    events = recycled(lake, since)
    assert [e["eventType"] for e in events] == ["INSERT_OVERWRITE", "DROP_TABLE"], events
    paths = {f["path"] for e in events for f in e["files"]}
    assert set(before) <= paths
    assert_retrievable(lake.daemon.client, before)


def test_local_rename_onto_itself_and_of_the_root(lake: DiskLake) -> None:
    """The local hook: a rename onto itself changes nothing; the root is not renamed away."""
    wh = lake.base / "warehouse"
    d = wh / "cmp"
    d.mkdir(exist_ok=True)
    f = d / "data.bin"
    f.write_bytes(b"local")
    jvm_ = lake.spark.sparkContext._jvm
    conf = lake.spark.sparkContext._jsc.hadoopConfiguration()
    p = jvm_.org.apache.hadoop.fs.Path(f"file:{f}")
    fs = p.getFileSystem(conf)
    since = lake.daemon.current()
    away = lake.base / "moved-wh"
    with app_conf(lake.spark, "spark.cmroot.warehouseRoots", f"{wh},disk://{lake.lake}"):
        fs.rename(p, p)
        assert f.read_bytes() == b"local"
        assert recycled(lake, since) == []
        for moving in (wh, lake.base):
            with pytest.raises(Exception, match="warehouse root"):
                fs.rename(jvm_.org.apache.hadoop.fs.Path(f"file:{moving}"),
                          jvm_.org.apache.hadoop.fs.Path(f"file:{away}"))
    moved = away.exists()
    if moved:
        os.rename(away, wh)
    assert not moved, "the local hook let the root be renamed away"



def test_overwriting_rename_keeps_the_replaced_file(lake: DiskLake) -> None:
    """rename(src, dst, Rename.OVERWRITE) onto a data file replaces it, the old one kept."""
    f, data = one_file(lake, "ow_ren")
    src = lake.lake / "replacement.bin"
    src.write_bytes(b"new bytes")
    jvm_, fs = hadoop(lake)
    gw = lake.spark.sparkContext._gateway
    opts = gw.new_array(jvm_.org.apache.hadoop.fs.Options.Rename, 1)
    opts[0] = jvm_.org.apache.hadoop.fs.Options.Rename.OVERWRITE
    since = lake.daemon.current()
    fs.rename(disk(jvm_, src), disk(jvm_, f), opts)
    assert f.read_bytes() == b"new bytes" and not src.exists()
    (event,) = recycled(lake, since)
    assert [x["path"] for x in event["files"]] == [f"disk://{f}"]
    assert_retrievable(lake.daemon.client, {f"disk://{f}": data})

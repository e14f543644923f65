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

"""Replication of a warehouse whose metastore is remote: the Spark source talks to a
standalone Hive metastore (hive.metastore.uris) running the cmroot plugin, which records
the catalog's events and keeps the data of drops; Spark's hook keeps what only Spark does
(overwrites, truncates, inserts). The scenario tests of tests/repl run here unchanged
against that source."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.metastore.conftest import metastore_conf
from tests.metastore.hms import Metastore, spark_remote_conf, start_metastore
from tests.repl.conftest import Destination, SharedDestination, Source
from tests.repl.test_replication import (  # noqa: F401 - collected here, on the remote source
    test_a_table_swap_replicates,
    test_moves_and_adoptions_replicate,
    test_no_rubber_banding,
)
from tests.spark.sparklib import Daemon, hooked_lake

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    pytest.importorskip("pyspark")
    base = tmp_path_factory.mktemp("remote-source")
    started: list[Metastore] = []

    def remote(daemon: Daemon) -> Mapping[str, str]:
        conf = metastore_conf("--url", daemon.url)
        ms = start_metastore(base / "hms", daemon.warehouse, conf["properties"],
                             conf["classpath"])
        started.append(ms)
        return spark_remote_conf(ms.uri, daemon.warehouse) | {
            "spark.cmroot.metastorePlugin": "true"}

    try:
        with hooked_lake(base, Source, extra=remote) as src:
            yield src
    finally:
        for ms in started:
            ms.stop()


@pytest.fixture(scope="module")
def destination(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Destination]:
    d = SharedDestination(tmp_path_factory.mktemp("remote-shared") / "destination")
    try:
        yield d
    finally:
        d.close()


def test_spark_drops_through_the_remote_metastore_are_kept_once(source: Source) -> None:
    """DROP TABLE from Spark: the metastore deletes the data, its plugin keeps it. DROP
    PARTITION of two: Spark's hook stages both up front (the statement is one unit; Spark
    drops them one metastore call each), each call records its metadata-only drop, the
    statement's recycle follows with the files. Spark's overwrite is Spark's hook's. Every
    file is kept exactly once."""
    source.sql("CREATE DATABASE IF NOT EXISTS sr")
    source.sql("CREATE TABLE sr.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO sr.t VALUES (1, 1), (2, 2), (3, 3)")
    source.sql("CREATE TABLE sr.h (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO sr.h VALUES (1), (2)")
    top = source.table_dir("t", "sr")
    before = {str(p) for p in Path(top).rglob("*") if p.is_file()}
    since = source.daemon.current()
    source.sql("ALTER TABLE sr.t DROP PARTITION (p=1), PARTITION (p=2)")
    source.sql("INSERT OVERWRITE TABLE sr.h SELECT 5")
    source.sql("DROP TABLE sr.t")
    events = [e for e in source.daemon.events_after(since) if e["eventType"].startswith(
        ("DROP", "INSERT_OVERWRITE"))]
    kinds = [(e["eventType"], e["table"], [p for p in e["partitions"]]) for e in events]
    assert kinds == [
        ("DROP_PARTITION", "t", [{"p": "1"}]), ("DROP_PARTITION", "t", [{"p": "2"}]),
        ("DROP_PARTITION", "t", [{"p": "1"}, {"p": "2"}]),
        ("INSERT_OVERWRITE", "h", []), ("DROP_TABLE", "t", [])], kinds
    assert [len(e["files"]) > 0 for e in events[:3]] == [False, False, True]
    kept = [f["path"] for e in events if e["table"] == "t" for f in e["files"]]
    assert sorted(kept) == sorted(before)  # each file kept once, none missed
    assert source.rows("SELECT a FROM sr.h") == [[5]]


def test_spark_refuses_remote_drops_without_the_plugin(source: Source) -> None:
    from tests.spark.sparklib import app_conf

    source.sql("CREATE DATABASE IF NOT EXISTS sr")
    source.sql("CREATE TABLE sr.unprotected (a INT) USING parquet")
    source.sql("INSERT INTO sr.unprotected VALUES (1)")
    with app_conf(source.spark, "spark.cmroot.metastorePlugin", "false"), pytest.raises(
            Exception, match="metastore is remote"):
        source.sql("DROP TABLE sr.unprotected")
    assert source.rows("SELECT a FROM sr.unprotected") == [[1]]

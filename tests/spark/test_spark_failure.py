"""Failure semantics of the Spark hook (invariant 2): a statement that fails leaves the
table's data as it was; with the daemon down every destructive statement fails with an
error naming cmroot and deletes nothing; `spark.cmroot.failOpen=true` (an application
setting) lets it go on, logged and counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.spark.conftest import Lake
from tests.spark.sparklib import app_conf, data_files

pytestmark = pytest.mark.timeout(600)

# Fails inside a task, row by row (not constant-folded at planning).
BOOM = "IF(a > 0, CAST(raise_error('boom in a task') AS INT), a)"


def make(lake: Lake, name: str, fmt: str = "USING parquet") -> dict[str, bytes]:
    lake.sql(f"CREATE TABLE {name} (a INT, p INT) {fmt} PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, 1), (2, 1), (3, 2), (4, 3)")
    return data_files(lake.table_dir(name))


def error_chain(e: BaseException) -> str:
    """The messages of a (py4j-captured) error and of every JVM cause under it: Spark wraps
    some failures (TRUNCATE's) in its own message and keeps cmroot's as the cause."""
    parts = [str(e)]
    jvm_error = getattr(e, "_origin", None) or getattr(e, "java_exception", None)
    while jvm_error is not None:
        parts.append(str(jvm_error.toString()))
        jvm_error = jvm_error.getCause()
    return "\n".join(parts)


def rows(lake: Lake, name: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in lake.sql(f"SELECT a, p FROM {name}"))


ORIGINAL = [(1, 1), (2, 1), (3, 2), (4, 3)]


def unchanged(lake: Lake, name: str, before: dict[str, bytes], since: int) -> None:
    assert data_files(lake.table_dir(name)) == before
    assert rows(lake, name) == ORIGINAL
    assert lake.daemon.events_after(since) == []


@pytest.mark.parametrize(
    "statement",
    [
        f"INSERT OVERWRITE TABLE {{t}} PARTITION (p=1) SELECT {BOOM} FROM {{t}}_src",
        f"INSERT OVERWRITE TABLE {{t}} SELECT {BOOM}, p FROM {{t}}_src",
        "dynamic",
        "hive",
    ],
    ids=["static-partition", "whole-table", "dynamic-partitions", "hive-format"],
)
def test_failing_overwrite_leaves_the_table(lake: Lake, statement: str) -> None:
    name = {"dynamic": "fail_dyn", "hive": "fail_hive"}.get(statement) or (
        "fail_static" if "PARTITION" in statement else "fail_whole")
    before = make(lake, name, "STORED AS TEXTFILE" if statement == "hive" else "USING parquet")
    lake.sql(f"CREATE TABLE {name}_src USING parquet AS SELECT a, p FROM {name}")
    since = lake.daemon.current()
    if statement == "dynamic":
        lake.spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
        statement = f"INSERT OVERWRITE TABLE {{t}} SELECT {BOOM}, p FROM {{t}}_src"
    elif statement == "hive":
        statement = f"INSERT OVERWRITE TABLE {{t}} PARTITION (p=1) SELECT {BOOM} FROM {{t}}_src"
    try:
        with pytest.raises(Exception, match="boom in a task"):
            lake.sql(statement.format(t=name))
    finally:
        lake.spark.conf.unset("spark.sql.sources.partitionOverwriteMode")
    unchanged(lake, name, before, since)


def test_failing_dataframe_overwrite_leaves_the_table(lake: Lake) -> None:
    from pyspark.sql import functions as F

    before = make(lake, "fail_df")
    lake.sql("CREATE TABLE fail_df_src USING parquet AS SELECT a, p FROM fail_df")
    since = lake.daemon.current()
    bad = lake.spark.table("fail_df_src").select(
        F.when(F.col("a") > 0, F.raise_error(F.lit("boom in a task"))).cast("int").alias("a"),
        "p",
    )
    with pytest.raises(Exception, match="boom in a task"):
        bad.write.mode("overwrite").insertInto("fail_df")
    unchanged(lake, "fail_df", before, since)


DOWN_STATEMENTS: dict[str, Callable[[Lake, str], object]] = {
    "drop-table": lambda lake, t: lake.sql(f"DROP TABLE {t}"),
    "drop-partition": lambda lake, t: lake.sql(f"ALTER TABLE {t} DROP PARTITION (p=1)"),
    "truncate": lambda lake, t: lake.sql(f"TRUNCATE TABLE {t}"),
    "insert-overwrite": lambda lake, t: lake.sql(
        f"INSERT OVERWRITE TABLE {t} PARTITION (p=1) SELECT 99"),
    "insert-overwrite-hive": lambda lake, t: lake.sql(f"INSERT OVERWRITE TABLE {t} SELECT 9, 1"),
}


@pytest.fixture
def daemon_down(lake: Lake) -> Iterator[None]:
    with lake.daemon.down():
        yield


@pytest.mark.parametrize("op", list(DOWN_STATEMENTS))
def test_daemon_down_fails_closed(lake: Lake, op: str) -> None:
    name = "down_" + op.replace("-", "_")
    before = make(lake, name, "STORED AS TEXTFILE" if op.endswith("hive") else "USING parquet")
    since = lake.daemon.current()
    with lake.daemon.down(), pytest.raises(Exception) as info:
        DOWN_STATEMENTS[op](lake, name)
    text = error_chain(info.value)
    assert "cmroot could not recycle" in text and "unreachable" in text, text[:2000]
    unchanged(lake, name, before, since)


def test_fail_open_proceeds_and_counts(lake: Lake) -> None:
    before = make(lake, "fail_open")
    jvm = lake.spark.sparkContext._jvm
    counted = jvm.io.cmroot.core.Cmroot.failOpenDeletes()
    since = lake.daemon.current()
    with app_conf(lake.spark, "spark.cmroot.failOpen", "true"), lake.daemon.down():
        lake.sql("ALTER TABLE fail_open DROP PARTITION (p=1)")
        lake.sql("DROP TABLE fail_open")
    assert before and not lake.table_dir("fail_open").exists()
    assert jvm.io.cmroot.core.Cmroot.failOpenDeletes() >= counted + 2
    assert lake.daemon.events_after(since) == []
    assert "fail_open" not in [t.name for t in lake.spark.catalog.listTables()]


def test_disabled_deletes_as_spark_does(lake: Lake) -> None:
    make(lake, "disabled")
    since = lake.daemon.current()
    with app_conf(lake.spark, "spark.cmroot.enabled", "false"):
        lake.sql("DROP TABLE disabled")
    assert not lake.table_dir("disabled").exists()
    assert lake.daemon.events_after(since) == []


def test_a_root_on_another_file_system_refuses_every_command(lake: Lake) -> None:
    """A warehouse root on a file system without cmroot's hook (s3a:// here, with no
    `spark-conf --scheme s3a`): Spark would delete the data of drops and overwrites there
    unkept. Every command is refused, saying so and how to hook it, and changes nothing;
    queries still run."""
    before = make(lake, "foreign_root")
    since = lake.daemon.current()
    roots = f"{lake.warehouse},s3a://bucket/warehouse"
    with app_conf(lake.spark, "spark.cmroot.warehouseRoots", roots):
        for statement in ("DROP TABLE foreign_root",
                          "INSERT OVERWRITE foreign_root SELECT 9, 1",
                          "TRUNCATE TABLE foreign_root",
                          "ALTER TABLE foreign_root DROP PARTITION (p=1)"):
            with pytest.raises(Exception, match=r"cmroot refuses .*s3a://bucket/warehouse\]"
                               r" are on file systems whose deletes cmroot does not see.*"
                               r"--scheme"):
                lake.sql(statement)
        with pytest.raises(Exception, match="cmroot refuses"):
            lake.spark.range(1).selectExpr("CAST(id AS INT) a", "1 p").write.mode(
                "overwrite").saveAsTable("foreign_root")
        assert lake.sql("SELECT count(*) FROM foreign_root")[0][0] == 4
    assert data_files(lake.table_dir("foreign_root")) == before
    assert lake.daemon.events_after(since) == []


def test_a_root_on_another_file_system_with_fail_open_keeps_the_local_ones(
    lake: Lake,
) -> None:
    before = make(lake, "foreign_open")
    since = lake.daemon.current()
    roots = f"{lake.warehouse},s3a://bucket/warehouse"
    with app_conf(lake.spark, "spark.cmroot.warehouseRoots", roots), \
            app_conf(lake.spark, "spark.cmroot.failOpen", "true"):
        lake.sql("DROP TABLE foreign_open")
    (event,) = lake.daemon.events_after(since)
    assert event["eventType"] == "DROP_TABLE"
    assert sorted(f["path"] for f in event["files"]) == sorted(before)

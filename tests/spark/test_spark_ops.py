"""Every destructive Spark operation hands the files it deletes to cmroot: real PySpark
local[2] with Hive support and its embedded Derby metastore, a real daemon on loopback.

For each operation: every file it removed is retrievable by (path, checksum) with identical
bytes, the event carries the right op, db, table and partitions, files of untouched
partitions stay where they were, and Spark's temp/staging paths are never recycled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cmroot.vocab import DESTRUCTIVE as DESTRUCTIVE_OPS
from tests.spark.conftest import Lake
from tests.spark.sparklib import SPARK_TEMP, assert_retrievable, data_files, recycled_paths

pytestmark = pytest.mark.timeout(600)


def make_partitioned(lake: Lake, name: str, fmt: str = "USING parquet") -> dict[str, bytes]:
    lake.sql(f"CREATE TABLE {name} (a INT, p INT) {fmt} PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {name} VALUES (1, 1), (2, 1), (3, 2), (4, 2), (5, 3)")
    files = data_files(lake.table_dir(name))
    assert len([f for f in files if "/part-" in f]) >= 3
    return files


def under(files: dict[str, bytes], d: Path) -> dict[str, bytes]:
    return {p: b for p, b in files.items() if p.startswith(str(d) + "/")}


def recycles(lake: Lake, since: int) -> list[dict[str, Any]]:
    """The recycle events since `since`: not the CREATE/INSERT/ALTER/... events the hook also
    records for replication, nor drops that held no data (test_spark_events covers those)."""
    return [
        e for e in lake.daemon.events_after(since)
        if e["eventType"] in DESTRUCTIVE_OPS and e["files"]
    ]


def one_event(lake: Lake, since: int) -> dict[str, Any]:
    events = recycles(lake, since)
    assert len(events) == 1, f"expected one recycle, got {events}"
    return events[0]


def check_removed(lake: Lake, before: dict[str, bytes], after: dict[str, bytes],
                  events: list[dict[str, Any]]) -> dict[str, bytes]:
    """Files in `before` that are gone or changed: all recycled, all retrievable."""
    removed = {p: b for p, b in before.items() if after.get(p) != b}
    assert removed, "the operation removed nothing"
    assert set(removed) <= recycled_paths(events)
    assert_retrievable(lake.daemon.client, removed)
    for p in recycled_paths(events):
        assert not any(seg.startswith(SPARK_TEMP) for seg in p.split("/")), p
    return removed


def rows(lake: Lake, q: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in lake.sql(q))


def test_drop_table(lake: Lake) -> None:
    before = make_partitioned(lake, "drop_me")
    since = lake.daemon.current()
    lake.sql("DROP TABLE drop_me")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"], ev["purge"]) == (
        "DROP_TABLE", "default", "drop_me", False)
    check_removed(lake, before, data_files(lake.table_dir("drop_me")), [ev])
    assert not lake.table_dir("drop_me").exists()


def test_drop_table_purge_hive_format(lake: Lake) -> None:
    lake.sql("CREATE TABLE purge_me (a INT) STORED AS TEXTFILE")
    lake.sql("INSERT INTO purge_me VALUES (1), (2)")
    before = data_files(lake.table_dir("purge_me"))
    since = lake.daemon.current()
    lake.sql("DROP TABLE purge_me PURGE")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"], ev["purge"]) == (
        "DROP_TABLE", "default", "purge_me", True)
    check_removed(lake, before, {}, [ev])


def test_drop_table_in_database(lake: Lake) -> None:
    lake.sql("CREATE DATABASE sales")
    lake.sql("CREATE TABLE sales.orders (a INT) USING parquet")
    lake.sql("INSERT INTO sales.orders VALUES (1), (2)")
    before = data_files(lake.table_dir("orders", "sales"))
    since = lake.daemon.current()
    lake.sql("DROP TABLE sales.orders")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"]) == ("DROP_TABLE", "sales", "orders")
    check_removed(lake, before, {}, [ev])


def test_drop_partition(lake: Lake) -> None:
    before = make_partitioned(lake, "dp")
    since = lake.daemon.current()
    lake.sql("ALTER TABLE dp DROP PARTITION (p=2)")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"], ev["partitions"]) == (
        "DROP_PARTITION", "default", "dp", [{"p": "2"}])
    after = data_files(lake.table_dir("dp"))
    removed = check_removed(lake, before, after, [ev])
    assert set(removed) == set(under(before, lake.table_dir("dp") / "p=2"))
    for part in ("p=1", "p=3"):
        kept = under(before, lake.table_dir("dp") / part)
        assert kept and all(after.get(p) == b for p, b in kept.items())
    assert rows(lake, "SELECT a, p FROM dp") == [(1, 1), (2, 1), (5, 3)]


def test_truncate_table(lake: Lake) -> None:
    before = make_partitioned(lake, "tr", "USING parquet")
    since = lake.daemon.current()
    lake.sql("TRUNCATE TABLE tr")
    events = recycles(lake, since)
    assert events and all(
        (e["eventType"], e["db"], e["table"]) == ("TRUNCATE", "default", "tr") for e in events
    )
    check_removed(lake, before, data_files(lake.table_dir("tr")), events)
    assert rows(lake, "SELECT * FROM tr") == []


def test_truncate_partition(lake: Lake) -> None:
    before = make_partitioned(lake, "trp")
    since = lake.daemon.current()
    lake.sql("TRUNCATE TABLE trp PARTITION (p=1)")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["table"], ev["partitions"]) == ("TRUNCATE", "trp", [{"p": "1"}])
    after = data_files(lake.table_dir("trp"))
    removed = check_removed(lake, before, after, [ev])
    assert set(removed) == set(under(before, lake.table_dir("trp") / "p=1"))
    assert rows(lake, "SELECT a, p FROM trp") == [(3, 2), (4, 2), (5, 3)]


def test_insert_overwrite_static_partition(lake: Lake) -> None:
    before = make_partitioned(lake, "ios")
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE ios PARTITION (p=1) SELECT 10")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"], ev["partitions"]) == (
        "INSERT_OVERWRITE", "default", "ios", [{"p": "1"}])
    after = data_files(lake.table_dir("ios"))
    removed = check_removed(lake, before, after, [ev])
    assert {p for p in removed if "/part-" in p} == {
        p for p in under(before, lake.table_dir("ios") / "p=1") if "/part-" in p}
    assert rows(lake, "SELECT a, p FROM ios") == [(3, 2), (4, 2), (5, 3), (10, 1)]


def test_insert_overwrite_dynamic_partitions(lake: Lake) -> None:
    before = make_partitioned(lake, "iod")
    since = lake.daemon.current()
    lake.spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    try:
        lake.sql("INSERT OVERWRITE TABLE iod SELECT a * 10, p FROM iod WHERE p <> 2")
    finally:
        lake.spark.conf.unset("spark.sql.sources.partitionOverwriteMode")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["table"]) == ("INSERT_OVERWRITE", "iod")
    assert sorted(ev["partitions"], key=str) == [{"p": "1"}, {"p": "3"}]
    after = data_files(lake.table_dir("iod"))
    removed = check_removed(lake, before, after, [ev])
    tdir = lake.table_dir("iod")
    assert set(removed) == set(under(before, tdir / "p=1")) | set(under(before, tdir / "p=3"))
    assert all(after.get(p) == b for p, b in under(before, tdir / "p=2").items())
    # the query read the old rows: it ran before the old files were recycled
    assert rows(lake, "SELECT a, p FROM iod") == [(3, 2), (4, 2), (10, 1), (20, 1), (50, 3)]


def test_insert_overwrite_unpartitioned_hive_table_reads_itself(lake: Lake) -> None:
    lake.sql("CREATE TABLE ioh (a INT) STORED AS TEXTFILE")
    lake.sql("INSERT INTO ioh VALUES (1), (2)")
    before = data_files(lake.table_dir("ioh"))
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE ioh SELECT a + 100 FROM ioh")
    events = recycles(lake, since)
    assert events and all(
        (e["eventType"], e["db"], e["table"]) == ("INSERT_OVERWRITE", "default", "ioh")
        for e in events
    )
    check_removed(lake, before, data_files(lake.table_dir("ioh")), events)
    assert rows(lake, "SELECT a FROM ioh") == [(101,), (102,)]


def test_insert_overwrite_whole_partitioned_table(lake: Lake) -> None:
    before = make_partitioned(lake, "iow")
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE iow SELECT 7, 9")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["table"]) == ("INSERT_OVERWRITE", "iow")
    assert sorted(ev["partitions"], key=str) == [{"p": "1"}, {"p": "2"}, {"p": "3"}]
    removed = check_removed(lake, before, data_files(lake.table_dir("iow")), [ev])
    assert {p for p in before if "/part-" in p} <= set(removed)
    assert rows(lake, "SELECT a, p FROM iow") == [(7, 9)]


def test_dataframe_insert_into_overwrite(lake: Lake) -> None:
    before = make_partitioned(lake, "dfi")
    since = lake.daemon.current()
    lake.spark.createDataFrame([(42, 3)], "a INT, p INT").write.mode("overwrite").insertInto("dfi")
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"]) == ("INSERT_OVERWRITE", "default", "dfi")
    check_removed(lake, before, data_files(lake.table_dir("dfi")), [ev])
    assert rows(lake, "SELECT a, p FROM dfi") == [(42, 3)]


def test_dataframe_save_as_table_overwrite(lake: Lake) -> None:
    lake.spark.createDataFrame([(1, "x"), (2, "y")], "a INT, b STRING").write.saveAsTable("sat")
    before = data_files(lake.table_dir("sat"))
    since = lake.daemon.current()
    df = lake.spark.createDataFrame([(3, "z")], "a INT, b STRING")
    df.write.mode("overwrite").saveAsTable("sat")
    # Spark drops the old table and creates a new one: the old files go as a DROP_TABLE.
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"]) == ("DROP_TABLE", "default", "sat")
    check_removed(lake, before, data_files(lake.table_dir("sat")), [ev])
    assert rows(lake, "SELECT a, b FROM sat") == [(3, "z")]


def test_dataframe_overwrite_path_under_warehouse(lake: Lake) -> None:
    target = lake.warehouse / "raw" / "events"
    df = lake.spark.createDataFrame([(1, "a"), (2, "b")], "id INT, day STRING")
    df.write.partitionBy("day").parquet(str(target))
    before = data_files(target)
    since = lake.daemon.current()
    df2 = lake.spark.createDataFrame([(9, "c")], "id INT, day STRING")
    df2.write.mode("overwrite").partitionBy("day").parquet(str(target))
    ev = one_event(lake, since)
    assert (ev["eventType"], ev["db"], ev["table"]) == ("INSERT_OVERWRITE", None, None)
    assert sorted(ev["partitions"], key=str) == [{"day": "a"}, {"day": "b"}]
    check_removed(lake, before, data_files(target), [ev])
    assert sorted(tuple(r) for r in lake.spark.read.parquet(str(target)).collect()) == [(9, "c")]


def test_paths_outside_the_warehouse_are_not_recycled(lake: Lake, tmp_path: Path) -> None:
    since = lake.daemon.current()
    target = tmp_path / "scratch"
    lake.spark.range(3).write.parquet(str(target))
    lake.spark.range(2).write.mode("overwrite").parquet(str(target))
    assert lake.daemon.events_after(since) == []
    assert lake.spark.read.parquet(str(target)).count() == 2


def test_events_say_who_and_what_asked(lake: Lake) -> None:
    """Every recycle and event the hook records carries its audit: the Spark user, this
    host, the application and the statement's text; `GET /v1/entries` shows it too."""
    import getpass
    import socket

    make_partitioned(lake, "audited")
    since = lake.daemon.current()
    lake.sql("INSERT OVERWRITE TABLE audited PARTITION (p = 1) VALUES (9)")
    lake.sql("DROP TABLE audited")
    events = lake.daemon.events_after(since)
    assert {e["eventType"] for e in events} >= {"INSERT_OVERWRITE", "DROP_TABLE"}
    sc = lake.spark.sparkContext
    for e in events:
        audit = e.get("audit")
        assert audit is not None, e
        assert audit["user"] == sc.sparkUser() == getpass.getuser()
        assert audit["host"] == socket.gethostname()
        assert sc.applicationId in audit["app"]
    statements = {e["eventType"]: e["audit"].get("statement") for e in events}
    assert statements["DROP_TABLE"] == "DROP TABLE audited", statements
    assert statements["INSERT_OVERWRITE"].startswith("INSERT OVERWRITE TABLE audited")
    entries = lake.daemon.client.entries(db="default", table="audited")["entries"]
    assert entries and all(x["audit"]["statement"] for x in entries)

"""The event log the Spark hook writes for replication, statement by statement: real PySpark
local[2] with Hive support and its embedded Derby metastore, a real daemon on loopback.

Each test asserts the exact events a statement adds (types, order, db, table, partitions,
location) and that the files they list are exactly the new data files, with the checksums
of the bytes on disk (the hook sends paths only; the daemon hashes them).

Order Spark produces, which replication replays as is:
- an insert that creates partitions: INSERT (the new files), then ADD_PARTITION (the same
  files: Spark registers the partitions after the job committed);
- INSERT OVERWRITE: INSERT_OVERWRITE (the old files, recycled), then INSERT (the new ones);
- CREATE TABLE ... USING ... AS SELECT: CREATE_TABLE, then INSERT (Spark writes the files
  before it creates the table; the hook holds the INSERT back until the table exists)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cmroot import checksum as cks
from tests.spark.conftest import Lake
from tests.spark.sparklib import app_conf
from tests.spark.test_spark_failure import error_chain

pytestmark = pytest.mark.timeout(600)

DB = "repl_src"
TABLE_OBJ_KEYS = {
    "db", "table", "tableType", "location", "columns", "partitionKeys", "parameters",
    "inputFormat", "outputFormat", "serde", "serdeParameters",
}
BOOM = "IF(a > 0, CAST(raise_error('boom in a task') AS INT), a)"


def run(lake: Lake, statement: str) -> list[dict[str, Any]]:
    """The events one statement added, in order."""
    since = lake.daemon.current()
    lake.sql(statement)
    return lake.daemon.events_after(since)


def shape(e: dict[str, Any]) -> tuple[Any, ...]:
    return (e["eventType"], e["db"], e["table"], e["partitions"], e["location"])


def data_files(d: Path) -> set[str]:
    """The data files under d: no hidden (".x.crc", "_SUCCESS") or temporary names."""
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = [n for n in dirnames if not n.startswith((".", "_"))]
        out.update(os.path.join(dirpath, f) for f in filenames if not f.startswith((".", "_")))
    return out


def listed(e: dict[str, Any]) -> dict[str, str]:
    """The event's files as {path: checksum}, each checked against the bytes on disk."""
    out = {f["path"]: f["checksum"] for f in e["files"]}
    for f in e["files"]:
        assert f["checksum"] == cks.of_local_file(f["path"]), f
        assert f["size"] == os.path.getsize(f["path"]), f
    return out


def tdir(lake: Lake, table: str) -> Path:
    return lake.warehouse / f"{DB}.db" / table


def table_json(lake: Lake, table: str) -> dict[str, Any]:
    """The call `cmroot repl dump` makes through py4j for a bootstrap."""
    spark = lake.spark
    raw = (
        spark._jsparkSession.sharedState()
        .externalCatalog()
        .unwrapped()
        .client()
        .getRawHiveTable(DB, table)
        .rawTable()
    )
    return dict(json.loads(spark.sparkContext._jvm.io.cmroot.core.Cmroot.tableJson(raw)))


@pytest.fixture(scope="module")
def db(lake: Lake) -> str:
    [e] = run(lake, f"CREATE DATABASE {DB}")
    assert shape(e) == ("CREATE_DATABASE", DB, None, [], str(lake.warehouse / f"{DB}.db"))
    assert (e["files"], e["tableObj"]) == ([], None)
    return DB


def make_partitioned(lake: Lake, name: str) -> dict[str, Any]:
    [e] = run(lake, f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    assert shape(e) == ("CREATE_TABLE", DB, name, [], str(tdir(lake, name)))
    assert e["files"] == []
    return e


def test_create_table_records_the_definition(lake: Lake, db: str) -> None:
    e = make_partitioned(lake, "created")
    obj = e["tableObj"]
    assert set(obj) == TABLE_OBJ_KEYS
    assert (obj["db"], obj["table"], obj["tableType"], obj["location"]) == (
        DB, "created", "MANAGED_TABLE", str(tdir(lake, "created")))
    assert [k["name"] for k in obj["partitionKeys"]] == ["p"]
    assert obj["parameters"]["spark.sql.sources.provider"] == "parquet"
    assert "ParquetHiveSerDe" in obj["serde"]
    # The bootstrap's py4j call gives the same definition.
    assert table_json(lake, "created") == obj


def test_insert_into_new_partitions_then_existing(lake: Lake, db: str) -> None:
    make_partitioned(lake, "ins")
    t = tdir(lake, "ins")
    insert, add = run(lake, f"INSERT INTO {DB}.ins VALUES (1, 1), (2, 2), (3, 2)")
    new = data_files(t)
    assert shape(insert) == ("INSERT", DB, "ins", [{"p": "1"}, {"p": "2"}], str(t))
    assert set(listed(insert)) == new and len(new) >= 2
    assert shape(add) == ("ADD_PARTITION", DB, "ins", [{"p": "1"}, {"p": "2"}], str(t))
    assert listed(add) == listed(insert)

    before = data_files(t)
    [again] = run(lake, f"INSERT INTO {DB}.ins VALUES (4, 1)")  # the partition exists
    assert shape(again) == ("INSERT", DB, "ins", [{"p": "1"}], str(t))
    assert set(listed(again)) == data_files(t) - before != set()


def test_insert_into_a_static_partition(lake: Lake, db: str) -> None:
    make_partitioned(lake, "stat")
    t = tdir(lake, "stat")
    insert, add = run(lake, f"INSERT INTO {DB}.stat PARTITION (p=5) VALUES (5)")
    assert shape(insert) == ("INSERT", DB, "stat", [{"p": "5"}], str(t))
    assert set(listed(insert)) == data_files(t / "p=5") == data_files(t)
    assert shape(add) == ("ADD_PARTITION", DB, "stat", [{"p": "5"}], str(t))
    assert listed(add) == listed(insert)


def test_insert_overwrite_recycles_then_inserts(lake: Lake, db: str) -> None:
    make_partitioned(lake, "ovw")
    t = tdir(lake, "ovw")
    run(lake, f"INSERT INTO {DB}.ovw VALUES (1, 1), (2, 2)")
    old = {p: cks.of_local_file(p) for p in data_files(t / "p=1")}
    kept = data_files(t / "p=2")
    recycle, insert = run(lake, f"INSERT OVERWRITE {DB}.ovw PARTITION (p=1) VALUES (9)")
    assert shape(recycle) == ("INSERT_OVERWRITE", DB, "ovw", [{"p": "1"}], str(t))
    gone = {f["path"]: f["checksum"] for f in recycle["files"]}
    assert {p: c for p, c in gone.items() if "/." not in p} == old  # and their .crc siblings
    assert shape(insert) == ("INSERT", DB, "ovw", [{"p": "1"}], str(t))
    assert set(listed(insert)) == data_files(t / "p=1") and not set(old) & set(listed(insert))
    assert data_files(t / "p=2") == kept


def test_overwrite_of_a_whole_partitioned_table(lake: Lake, db: str) -> None:
    make_partitioned(lake, "whole")
    t = tdir(lake, "whole")
    run(lake, f"INSERT INTO {DB}.whole VALUES (1, 1), (2, 2)")
    events = run(lake, f"INSERT OVERWRITE {DB}.whole VALUES (3, 3)")
    assert [e["eventType"] for e in events] == [
        "INSERT_OVERWRITE", "INSERT", "ADD_PARTITION", "DROP_PARTITION", "DROP_PARTITION"]
    recycle, insert, add, *drops = events
    assert sorted(recycle["partitions"], key=str) == [{"p": "1"}, {"p": "2"}]
    assert shape(insert) == ("INSERT", DB, "whole", [{"p": "3"}], str(t))
    assert set(listed(insert)) == data_files(t)
    assert shape(add) == ("ADD_PARTITION", DB, "whole", [{"p": "3"}], str(t))
    # The old partitions, emptied by the overwrite, leave the catalog with no data to recycle.
    assert sorted(d["partitions"][0]["p"] for d in drops) == ["1", "2"]
    assert all(shape(d)[:3] == ("DROP_PARTITION", DB, "whole") and d["files"] == []
               for d in drops)


def test_external_table(lake: Lake, db: str) -> None:
    data = lake.warehouse / "external" / "ext"
    [create] = run(lake, f"CREATE EXTERNAL TABLE {DB}.ext (a INT) STORED AS PARQUET "
                         f"LOCATION '{data}'")
    assert shape(create) == ("CREATE_TABLE", DB, "ext", [], str(data))
    assert create["tableObj"]["tableType"] == "EXTERNAL_TABLE"
    [insert] = run(lake, f"INSERT INTO {DB}.ext VALUES (1)")
    assert shape(insert) == ("INSERT", DB, "ext", [], str(data))
    assert set(listed(insert)) == data_files(data) != set()
    [drop] = run(lake, f"DROP TABLE {DB}.ext")  # the data stays: nothing to recycle
    assert shape(drop) == ("DROP_TABLE", DB, "ext", [], str(data))
    assert drop["files"] == [] and data_files(data) == set(listed(insert))


def test_ctas_creates_then_inserts(lake: Lake, db: str) -> None:
    t = tdir(lake, "ctas")
    create, insert = run(lake, f"CREATE TABLE {DB}.ctas USING parquet AS SELECT 1 AS a, 'x' AS b")
    assert shape(create) == ("CREATE_TABLE", DB, "ctas", [], str(t))
    assert create["tableObj"]["table"] == "ctas" and create["files"] == []
    assert shape(insert) == ("INSERT", DB, "ctas", [], str(t))
    assert set(listed(insert)) == data_files(t) != set()


def test_alter_table(lake: Lake, db: str) -> None:
    run(lake, f"CREATE TABLE {DB}.alt USING parquet AS SELECT 1 AS a")
    [rename] = run(lake, f"ALTER TABLE {DB}.alt RENAME TO {DB}.alt2")
    t = tdir(lake, "alt2")
    # The old name and where the files were: the daemon follows the move to tableObj's.
    assert shape(rename) == ("ALTER_TABLE", DB, "alt", [], str(tdir(lake, "alt")))
    assert (rename["tableObj"]["table"], rename["tableObj"]["location"]) == ("alt2", str(t))
    assert rename["files"] == []

    [add] = run(lake, f"ALTER TABLE {DB}.alt2 ADD COLUMNS (b STRING)")
    assert shape(add) == ("ALTER_TABLE", DB, "alt2", [], str(t))
    assert [c["name"] for c in add["tableObj"]["columns"]] == ["a", "b"]

    [props] = run(lake, f"ALTER TABLE {DB}.alt2 SET TBLPROPERTIES ('owner.team'='etl')")
    assert shape(props) == ("ALTER_TABLE", DB, "alt2", [], str(t))
    assert props["tableObj"]["parameters"]["owner.team"] == "etl"
    assert table_json(lake, "alt2")["parameters"]["owner.team"] == "etl"

    # Statistics are the metastore's own business: not a change to replay.
    assert run(lake, f"ANALYZE TABLE {DB}.alt2 COMPUTE STATISTICS") == []


def test_drop_of_an_empty_table_is_metadata_only(lake: Lake, db: str) -> None:
    run(lake, f"CREATE TABLE {DB}.empty (a INT) USING parquet")
    [drop] = run(lake, f"DROP TABLE {DB}.empty")
    assert shape(drop) == ("DROP_TABLE", DB, "empty", [], str(tdir(lake, "empty")))
    assert (drop["files"], drop["purge"]) == ([], False)


def test_drop_of_an_empty_partition_is_metadata_only(lake: Lake, db: str) -> None:
    make_partitioned(lake, "emptyp")
    [add] = run(lake, f"ALTER TABLE {DB}.emptyp ADD PARTITION (p=7)")
    assert shape(add) == ("ADD_PARTITION", DB, "emptyp", [{"p": "7"}], str(tdir(lake, "emptyp")))
    assert add["files"] == []
    [drop] = run(lake, f"ALTER TABLE {DB}.emptyp DROP PARTITION (p=7)")
    assert shape(drop) == ("DROP_PARTITION", DB, "emptyp", [{"p": "7"}],
                           str(tdir(lake, "emptyp")))
    assert drop["files"] == []


def test_a_failing_insert_records_nothing(lake: Lake, db: str) -> None:
    make_partitioned(lake, "fails")
    run(lake, f"INSERT INTO {DB}.fails VALUES (1, 1)")
    since = lake.daemon.current()
    with pytest.raises(Exception, match="boom in a task"):
        lake.sql(f"INSERT INTO {DB}.fails SELECT {BOOM}, 2 FROM {DB}.fails")
    assert lake.daemon.events_after(since) == []


def test_an_unrecorded_change_fails_the_statement_saying_so(lake: Lake, db: str) -> None:
    make_partitioned(lake, "unrec")
    with lake.daemon.down(), pytest.raises(Exception) as info:
        lake.sql(f"INSERT INTO {DB}.unrec VALUES (1, 1)")
    text = error_chain(info.value)
    for words in ("cmroot could not record the INSERT event", "unreachable",
                  "WAS applied", f"{DB}.unrec", "cmroot repl dump` without --from"):
        assert words in text, text[:3000]


def test_fail_open_counts_unrecorded_changes(lake: Lake, db: str) -> None:
    jvm = lake.spark.sparkContext._jvm
    counted = jvm.io.cmroot.core.Cmroot.failOpenEvents()
    with app_conf(lake.spark, "spark.cmroot.failOpen", "true"), lake.daemon.down():
        lake.sql(f"CREATE TABLE {DB}.open (a INT) USING parquet")
        lake.sql(f"INSERT INTO {DB}.open VALUES (1)")
    assert jvm.io.cmroot.core.Cmroot.failOpenEvents() == counted + 2
    assert [tuple(r) for r in lake.sql(f"SELECT a FROM {DB}.open")] == [(1,)]


def test_drop_database_cascade(lake: Lake) -> None:
    run(lake, "CREATE DATABASE gone")
    run(lake, "CREATE TABLE gone.full USING parquet AS SELECT 1 AS a")
    run(lake, "CREATE TABLE gone.hollow (a INT) USING parquet")
    events = run(lake, "DROP DATABASE gone CASCADE")
    assert [shape(e) for e in events] == [
        ("DROP_TABLE", "gone", "full", [], str(lake.warehouse / "gone.db" / "full")),
        ("DROP_TABLE", "gone", "hollow", [], str(lake.warehouse / "gone.db" / "hollow")),
        ("DROP_DATABASE", "gone", None, [], None),
    ]
    assert events[0]["files"] and events[1]["files"] == []

"""Column changes replicate (issue 12, alters): a column dropped, renamed or retyped at
the source, which Spark SQL cannot do to a non-v2 table but the metastore does for any
engine, gives the replica the same columns, and the same rows from the same files."""

from __future__ import annotations

import pytest

from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)


def _set_columns(source: Source, db: str, table: str, ddl: str) -> None:
    """The table's data columns become `ddl`, through the metastore (as another engine's
    ALTER TABLE ... REPLACE COLUMNS / CHANGE COLUMN does)."""
    jvm = source.spark.sparkContext._jvm
    schema = jvm.org.apache.spark.sql.types.StructType.fromDDL(ddl)
    source.spark._jsparkSession.sharedState().externalCatalog().alterTableDataSchema(
        db, table, schema)
    source.sql(f"REFRESH TABLE {db}.{table}")


def test_columns_dropped_renamed_and_retyped_replicate(
    source: Source, destination: Destination
) -> None:
    start = source.daemon.current()
    source.sql("CREATE DATABASE cc")
    source.sql("CREATE TABLE cc.t (a INT, b STRING, c INT) PARTITIONED BY (p INT)"
               " STORED AS PARQUET")
    source.sql("INSERT INTO cc.t PARTITION (p=1) VALUES (1, 'x', 3)")
    source.sql("CREATE TABLE cc.h (a INT, b STRING) STORED AS PARQUET")
    source.sql("INSERT INTO cc.h VALUES (1, 'x')")
    url1, h1 = source.dump("cc", from_id=start)
    _set_columns(source, "cc", "t", "a2 BIGINT, b STRING")  # a renamed, retyped; c dropped
    source.sql("INSERT INTO cc.t PARTITION (p=2) VALUES (10, 'y')")
    _set_columns(source, "cc", "h", "a BIGINT, b STRING, d DOUBLE")  # retyped, one added
    url2, h2 = source.dump("cc", from_id=h1.last_event_id)
    q = {"t": "SELECT coalesce(a2, -1), b, p FROM cc.t", "t cols": "DESCRIBE TABLE cc.t",
         "h cols": "DESCRIBE TABLE cc.h"}
    first, second = destination.run(
        {"load": {"dump": url1}, "queries": q},
        {"load": {"dump": url2}, "queries": q, "status": ["cc"]},
    )
    assert ["a", "int"] in [r[:2] for r in first["rows"]["t cols"]]
    assert "error" not in second["load"], second["load"]
    for name, sql in q.items():
        assert second["rows"][name] == source.rows(sql), name
    assert second["rows"]["t"] == [[-1, "x", 1], [10, "y", 2]]  # a2: not in the old file
    assert sorted(r[:2] for r in source.rows(q["h cols"])) == [
        ["a", "bigint"], ["b", "string"], ["d", "double"]]
    assert second["status"]["cc"] == h2.last_event_id

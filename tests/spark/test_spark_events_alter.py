"""The events replication needs for statements that move, re-point or adopt data rather than
delete it (issue 11, item 7): real PySpark local[2] with its embedded metastore, a real
daemon on loopback, real files.

- `ALTER TABLE t PARTITION (...) RENAME TO PARTITION (...)`: ADD_PARTITION of the new
  partition with its files (now at the new directory), then a metadata-only DROP_PARTITION
  of the old one. A replica replaying them ends with the same partitions and files.
- `ALTER TABLE t SET LOCATION` and `ALTER TABLE t PARTITION (...) SET LOCATION`:
  ALTER_LOCATION with the files now at the new location (what the table or partition holds
  from then on) and, for a table, its new definition.
- `CREATE TABLE ... LOCATION` over a directory that already holds data: CREATE_TABLE lists
  those files (an unpartitioned table's; a partitioned table's data arrives with its
  partitions).
- Hive-format inserts (Hive SerDe tables): INSERT with the files at their final paths.
- A metastore change that fails records nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import Lake
from tests.spark.test_spark_events import data_files, listed, run, shape

pytestmark = pytest.mark.timeout(600)

DB = "alter_src"


@pytest.fixture(scope="module")
def db(lake: Lake) -> str:
    run(lake, f"CREATE DATABASE {DB}")
    return DB


def tdir(lake: Lake, table: str) -> Path:
    return lake.warehouse / f"{DB}.db" / table


def partitioned(lake: Lake, name: str, fmt: str = "USING parquet PARTITIONED BY (p)") -> Path:
    cols = "(a INT, p INT)" if fmt.startswith("USING") else "(a INT) PARTITIONED BY (p INT)"
    if not fmt.startswith("USING"):
        fmt = fmt.replace("PARTITIONED BY (p)", "")
    lake.sql(f"CREATE TABLE {DB}.{name} {cols} {fmt}")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1), (2, 2)")
    return tdir(lake, name)


def test_rename_partition_adds_the_new_then_drops_the_old(lake: Lake, db: str) -> None:
    t = partitioned(lake, "renp")
    events = run(lake, f"ALTER TABLE {DB}.renp PARTITION (p=1) RENAME TO PARTITION (p=9)")
    assert [shape(e) for e in events] == [
        ("ADD_PARTITION", DB, "renp", [{"p": "9"}], str(t)),
        ("DROP_PARTITION", DB, "renp", [{"p": "1"}], str(t)),
    ]
    add, drop = events
    assert set(listed(add)) == data_files(t / "p=9") != set()
    assert drop["files"] == [] and not (t / "p=1").exists()
    assert sorted(tuple(r) for r in lake.sql(f"SELECT a, p FROM {DB}.renp")) == [(1, 9), (2, 2)]


def test_set_location_of_a_table_lists_what_it_now_holds(lake: Lake, db: str) -> None:
    lake.sql(f"CREATE TABLE {DB}.moved (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.moved VALUES (1)")
    new = lake.warehouse / "elsewhere" / "moved"
    lake.spark.range(3).selectExpr("CAST(id AS INT) AS a").write.parquet(str(new))
    [alter] = run(lake, f"ALTER TABLE {DB}.moved SET LOCATION '{new}'")
    assert shape(alter) == ("ALTER_LOCATION", DB, "moved", [], str(new))
    assert alter["tableObj"]["location"] == str(new)
    assert set(listed(alter)) == data_files(new) != set()
    assert lake.sql(f"SELECT count(*) FROM {DB}.moved")[0][0] == 3


def test_set_location_of_a_partition(lake: Lake, db: str) -> None:
    t = partitioned(lake, "plocs")
    new = lake.warehouse / "elsewhere" / "plocs_p1"
    lake.spark.range(4).selectExpr("CAST(id AS INT) AS a").write.parquet(str(new))
    [alter] = run(lake, f"ALTER TABLE {DB}.plocs PARTITION (p=1) SET LOCATION '{new}'")
    assert shape(alter) == ("ALTER_LOCATION", DB, "plocs", [{"p": "1"}], str(t))
    assert set(listed(alter)) == data_files(new) != set()
    assert lake.sql(f"SELECT count(*) FROM {DB}.plocs WHERE p = 1")[0][0] == 4


def test_a_location_change_only_out_of_the_roots_lists_no_outside_file(
    lake: Lake, db: str, tmp_path: Path
) -> None:
    lake.sql(f"CREATE TABLE {DB}.leaves (a INT) USING parquet")
    out = tmp_path / "outside"
    lake.spark.range(2).selectExpr("CAST(id AS INT) AS a").write.parquet(str(out))
    [alter] = run(lake, f"ALTER TABLE {DB}.leaves SET LOCATION '{out}'")
    # Still news to a replica holding the table; the files are none of cmroot's business.
    assert (alter["eventType"], alter["table"], alter["files"]) == ("ALTER_LOCATION", "leaves", [])


def test_create_table_over_existing_data_lists_its_files(lake: Lake, db: str) -> None:
    data = lake.warehouse / "landing" / "adopted"
    lake.spark.range(5).selectExpr("CAST(id AS INT) AS a").write.parquet(str(data))
    [create] = run(lake, f"CREATE TABLE {DB}.adopted (a INT) USING parquet LOCATION '{data}'")
    assert shape(create) == ("CREATE_TABLE", DB, "adopted", [], str(data))
    assert set(listed(create)) == data_files(data) != set()


def test_create_of_a_partitioned_table_over_data_lists_none(lake: Lake, db: str) -> None:
    data = lake.warehouse / "landing" / "adoptedp"
    (lake.spark.range(4).selectExpr("CAST(id AS INT) AS a", "CAST(id % 2 AS INT) AS p")
     .write.partitionBy("p").parquet(str(data)))
    [create] = run(lake, f"CREATE TABLE {DB}.adoptedp (a INT, p INT) USING parquet "
                         f"PARTITIONED BY (p) LOCATION '{data}'")
    assert shape(create) == ("CREATE_TABLE", DB, "adoptedp", [], str(data))
    assert create["files"] == []  # not the table's until its partitions are added
    [add] = run(lake, f"MSCK REPAIR TABLE {DB}.adoptedp")
    assert add["eventType"] == "ADD_PARTITION"
    assert set(listed(add)) == data_files(data) != set()


def test_ctas_still_lists_its_files_once(lake: Lake, db: str) -> None:
    create, insert = run(lake, f"CREATE TABLE {DB}.ctas2 USING parquet AS SELECT 1 AS a")
    assert create["files"] == [] and set(listed(insert)) == data_files(tdir(lake, "ctas2"))


@pytest.mark.parametrize("statement", [
    "INSERT INTO {t} VALUES (7)",
    "INSERT INTO {t} SELECT a + 10 FROM {t}",
])
def test_hive_format_insert_lists_its_final_files(
    lake: Lake, db: str, statement: str
) -> None:
    name = f"hive_ins_{abs(hash(statement)) % 1000}"
    t = tdir(lake, name)
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1)")
    before = data_files(t)
    events = run(lake, statement.format(t=f"{DB}.{name}"))
    assert [shape(e) for e in events] == [("INSERT", DB, name, [], str(t))]
    new = data_files(t) - before
    assert set(listed(events[0])) == new != set()


def test_hive_format_insert_into_a_partition(lake: Lake, db: str) -> None:
    t = partitioned(lake, "hive_part", "STORED AS TEXTFILE PARTITIONED BY (p)")
    before = data_files(t)
    events = run(lake, f"INSERT INTO {DB}.hive_part PARTITION (p=3) VALUES (3)")
    kinds = [e["eventType"] for e in events]
    assert kinds[0] == "INSERT" and set(kinds[1:]) <= {"ADD_PARTITION"}, kinds
    assert shape(events[0]) == ("INSERT", DB, "hive_part", [{"p": "3"}], str(t))
    assert set(listed(events[0])) == data_files(t) - before != set()


def test_a_failed_metastore_change_records_nothing(lake: Lake, db: str) -> None:
    partitioned(lake, "dup")
    since = lake.daemon.current()
    with pytest.raises(Exception, match=r"(?i)exist"):
        lake.sql(f"ALTER TABLE {DB}.dup ADD PARTITION (p=1)")
    assert lake.daemon.events_after(since) == []


def _files_of(events: list[dict[str, Any]]) -> set[str]:
    return {f["path"] for e in events for f in e["files"]}


def test_rename_partition_of_a_hive_table(lake: Lake, db: str) -> None:
    t = partitioned(lake, "hrenp", "STORED AS TEXTFILE PARTITIONED BY (p)")
    events = run(lake, f"ALTER TABLE {DB}.hrenp PARTITION (p=2) RENAME TO PARTITION (p=5)")
    assert [e["eventType"] for e in events] == ["ADD_PARTITION", "DROP_PARTITION"]
    assert _files_of(events) == data_files(t / "p=5") != set()
    assert all(os.path.exists(p) for p in _files_of(events))


def test_load_data_records_the_files_it_moved_in(lake: Lake, db: str, tmp_path: Path) -> None:
    lake.sql(f"CREATE TABLE {DB}.loaded (a INT) STORED AS TEXTFILE")
    landing = tmp_path / "landing.txt"
    landing.write_text("41\n42\n")
    [insert] = run(lake, f"LOAD DATA INPATH '{landing}' INTO TABLE {DB}.loaded")
    assert shape(insert) == ("INSERT", DB, "loaded", [], str(tdir(lake, "loaded")))
    assert set(listed(insert)) == data_files(tdir(lake, "loaded")) != set()
    assert sorted(r[0] for r in lake.sql(f"SELECT a FROM {DB}.loaded")) == [41, 42]


def test_load_data_of_another_tables_file_is_refused_whole_when_unkept(
    lake: Lake, db: str
) -> None:
    for n in ("lsrc", "ldst"):
        lake.sql(f"CREATE TABLE {DB}.{n} (a INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.lsrc VALUES (1)")
    [moved] = data_files(tdir(lake, "lsrc"))
    since = lake.daemon.current()
    with lake.daemon.down(), pytest.raises(Exception, match="cmroot could not recycle"):
        lake.sql(f"LOAD DATA INPATH '{moved}' INTO TABLE {DB}.ldst")
    assert os.path.exists(moved) and data_files(tdir(lake, "ldst")) == set()
    assert lake.daemon.events_after(since) == []


@pytest.mark.parametrize("statement", [
    "DROP TABLE {t}",
    "ALTER TABLE {t} DROP PARTITION (p=1), PARTITION (p=9)",
    "TRUNCATE TABLE {t}",
])
def test_a_partition_at_its_own_location_is_part_of_its_tables_recycle(
    lake: Lake, db: str, statement: str
) -> None:
    name = f"own_{statement.split()[0].lower()}"
    t = partitioned(lake, name)
    own = lake.warehouse / "own_parts" / name
    lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=9) LOCATION '{own}'")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p=9) VALUES (9)")
    kept = data_files(own)
    assert kept
    events = run(lake, statement.format(t=f"{DB}.{name}"))
    destructive = [e for e in events if e["files"]]
    assert len(destructive) == 1, [(e["eventType"], e["table"]) for e in events]
    [e] = destructive
    assert (e["db"], e["table"], e["location"]) == (DB, name, str(t))
    assert kept <= {f["path"] for f in e["files"]}
    assert not data_files(own)


@pytest.mark.parametrize("statement", [
    "CREATE TABLE {t} (a INT) USING parquet",
    "CREATE TABLE {t} (a INT) STORED AS TEXTFILE",
])
def test_an_unrecorded_catalog_change_fails_with_cmroots_error(
    lake: Lake, db: str, statement: str
) -> None:
    """The metastore already made the change; its event cannot be recorded (daemon down):
    the statement fails saying so, not with the "already exists" of a retried create."""
    from tests.spark.test_spark_failure import error_chain

    name = f"unrec_{'hive' if 'STORED' in statement else 'ds'}"
    with lake.daemon.down(), pytest.raises(Exception) as info:
        lake.sql(statement.format(t=f"{DB}.{name}"))
    text = error_chain(info.value)
    assert "cmroot could not record the CREATE_TABLE event" in text, text[:2000]
    assert "already exists" not in text.lower(), text[:2000]
    assert lake.spark.catalog.tableExists(f"{DB}.{name}")


def _recycle_requests(lake: Lake) -> float:
    """POST /v1/recycle requests the daemon has answered (prepares and plain recycles)."""
    import re
    import urllib.request

    with urllib.request.urlopen(lake.daemon.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^cmroot_http_request_duration_seconds_count\{[^}]*route="/v1/recycle"[^}]*\} (\S+)$',
        text, re.M))


@pytest.mark.parametrize(("statement", "requests"), [
    ("INSERT OVERWRITE TABLE {t} PARTITION (p) SELECT CAST(id AS INT), CAST(id AS INT) "
     "FROM range(4)", 1),
    ("TRUNCATE TABLE {t}", 1),
])
def test_no_round_trip_per_file(lake: Lake, db: str, statement: str, requests: int) -> None:
    """A Hive-format overwrite (Hive deletes the old files one by one, from several threads)
    stages the old files of every partition it wrote in one prepare request at job commit;
    a TRUNCATE of a partitioned table (Spark deletes one partition directory at a time)
    stages all of them in one."""
    name = f"trips_{statement.split()[0].lower()}"
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p) "
             "SELECT /*+ REPARTITION(12) */ CAST(id AS INT), CAST(id % 4 AS INT) FROM range(48)")
    t = tdir(lake, name)
    old = data_files(t)
    assert len(old) >= 12
    before = _recycle_requests(lake)
    [recycle, *_] = run(lake, statement.format(t=f"{DB}.{name}"))
    assert _recycle_requests(lake) - before == requests
    assert old <= {f["path"] for f in recycle["files"]}

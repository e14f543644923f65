"""Second hostile review of the Spark hook: the events of issue 11 item 7 (partition renames,
SET LOCATION, CREATE TABLE over data, Hive SerDe inserts) and the statement machinery
around them. Real PySpark local[2] with its embedded metastore, a real daemon, real files.

Each test asserts what the README's Spark section or DESIGN.md promises and fails on the
current shim; the few kept probes (marked "probe") pass and cover what no other test does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from cmroot.vocab import DESTRUCTIVE
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake
from tests.spark.test_spark_events import data_files, listed

pytestmark = pytest.mark.timeout(600)

DB = "rev2"


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


def run(lake: Lake, statement: str) -> list[dict[str, Any]]:  # noqa: F811
    since = lake.daemon.current()
    lake.sql(statement)
    return lake.daemon.events_after(since)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["eventType"] for e in events]


def rows(lake: Lake, q: str) -> list[tuple[Any, ...]]:  # noqa: F811
    return sorted(tuple(r) for r in lake.sql(q))


def brief(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["eventType"], e["table"], e["partitions"], sorted(f["path"] for f in e["files"]))
            for e in events]


# -- Hive SerDe inserts ---------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["INTO", "OVERWRITE TABLE"])
def test_hive_insert_into_a_custom_location_partition_records_its_files(
    lake: Lake, db: str, verb: str  # noqa: F811
) -> None:
    """README: an INSERT into a Hive SerDe table records `INSERT` with the files at the paths
    Hive moved them to; a write to a partition at a custom location records its partition
    and new files (and an overwrite's recycle is the table's INSERT_OVERWRITE of it)."""
    name = "hcl_" + verb.split()[0].lower()
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    custom = lake.warehouse / "elsewhere" / f"{name}_p2"
    lake.sql(f"ALTER TABLE {DB}.{name} ADD PARTITION (p=2) LOCATION '{custom}'")
    lake.sql(f"INSERT INTO {DB}.{name} PARTITION (p=2) VALUES (4)")
    before = data_files(custom)
    events = run(lake, f"INSERT {verb} {DB}.{name} PARTITION (p=2) VALUES (5)")
    new = data_files(custom) - before
    assert new, "the insert wrote nothing where the partition is"
    if verb == "INTO":
        assert kinds(events) == ["INSERT"], brief(events)
    else:
        assert kinds(events) == ["INSERT_OVERWRITE", "INSERT"], brief(events)
        assert (events[0]["table"], events[0]["partitions"]) == (name, [{"p": "2"}])
    ins = events[-1]
    assert (ins["table"], ins["partitions"]) == (name, [{"p": "2"}]), brief(events)
    assert set(listed(ins)) == new, brief(events)


def test_hive_insert_with_a_session_staging_dir_records_a_phantom(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """DESIGN "no phantom"; README (a Hive SerDe INSERT records `INSERT` with the files where
    Hive moved them). `SET hive.exec.stagingdir=.stage` (a plain Hive setting, not refused)
    gives a staging directory the shim's name patterns (Cmroot.isTemporary) do not know: the
    append records an INSERT of the staging path at job commit, then a destructive DELETE of
    the staging directory's _SUCCESS when Spark removes it (nothing of the table was
    deleted)."""
    lake.sql(f"CREATE TABLE {DB}.hstg (a INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.hstg VALUES (1)")
    t = tdir(lake, "hstg")
    before = data_files(t)
    lake.sql("SET hive.exec.stagingdir=.stage")
    try:
        events = run(lake, f"INSERT INTO {DB}.hstg VALUES (2)")
    finally:
        lake.sql("SET hive.exec.stagingdir=.hive-staging")
    new = data_files(t) - before
    assert rows(lake, f"SELECT a FROM {DB}.hstg") == [(1,), (2,)]
    assert [e for e in events if e["eventType"] in DESTRUCTIVE] == [], brief(events)
    assert kinds(events) == ["INSERT"], brief(events)
    assert set(listed(events[0])) == new != set()


def test_hive_dynamic_partition_overwrite_events(lake: Lake, db: str) -> None:  # noqa: F811
    """probe: a Hive SerDe INSERT OVERWRITE with dynamic partitions."""
    lake.sql(f"CREATE TABLE {DB}.hdyn (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.hdyn PARTITION (p) VALUES (1, 1), (2, 2)")
    t = tdir(lake, "hdyn")
    old = data_files(t)
    events = run(lake, f"INSERT OVERWRITE TABLE {DB}.hdyn PARTITION (p) "
                       "SELECT * FROM VALUES (10, 1), (30, 3) AS v(a, p)")
    assert rows(lake, f"SELECT a, p FROM {DB}.hdyn") == [(2, 2), (10, 1), (30, 3)]
    now = data_files(t)
    ow = [e for e in events if e["eventType"] == "INSERT_OVERWRITE"]
    ins = [e for e in events if e["eventType"] == "INSERT"]
    assert len(ow) == 1 and len(ins) == 1, brief(events)
    assert {f["path"] for f in ow[0]["files"] if not Path(f["path"]).name.startswith(".")} \
        == {p for p in old if "/p=1/" in p}
    assert set(listed(ins[0])) == now - old


# -- partition renames ------------------------------------------------------------------------

def test_rename_partition_of_a_table_with_an_upper_case_partition_column(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """README: RENAME TO PARTITION records ADD_PARTITION {the new partition, its files at
    their new paths}, then DROP_PARTITION. Spark moves a managed table's partition directory
    a second time when its partition column has upper case (the metastore names it p=9,
    Spark wants P=9)."""
    lake.sql(f"CREATE TABLE {DB}.upr (a INT, P INT) USING parquet PARTITIONED BY (P)")
    lake.sql(f"INSERT INTO {DB}.upr VALUES (1, 1), (2, 2)")
    t = tdir(lake, "upr")
    events = run(lake, f"ALTER TABLE {DB}.upr PARTITION (P=1) RENAME TO PARTITION (P=9)")
    assert rows(lake, f"SELECT a, P FROM {DB}.upr") == [(1, 9), (2, 2)]
    assert kinds(events) == ["ADD_PARTITION", "DROP_PARTITION"], brief(events)
    add = events[0]
    paths = [f["path"] for f in add["files"]]
    assert paths and all(os.path.exists(p) for p in paths), (paths, sorted(data_files(t)))


def test_rename_partition_onto_a_directory_holding_files(lake: Lake, db: str) -> None:  # noqa: F811
    """probe: a rename to a partition whose directory already holds a file not of the
    table is refused by the metastore, and records nothing."""
    lake.sql(f"CREATE TABLE {DB}.rocc (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.rocc VALUES (1, 1), (2, 2)")
    t = tdir(lake, "rocc")
    moved = {Path(p).name for p in data_files(t / "p=1")}
    (t / "p=9").mkdir()
    (t / "p=9" / "stray.txt").write_bytes(b"not the table's")
    since = lake.daemon.current()
    err = None
    try:
        lake.sql(f"ALTER TABLE {DB}.rocc PARTITION (p=1) RENAME TO PARTITION (p=9)")
    except Exception as e:
        err = e
    events = lake.daemon.events_after(since)
    # probe: the metastore refuses ("already exists"): nothing recorded, nothing moved.
    assert err is not None and "already exists" in str(err)
    assert events == []
    assert {Path(p).name for p in data_files(t / "p=1")} == moved
    assert (t / "p=9" / "stray.txt").read_bytes() == b"not the table's"


# -- the commit protocol switched by a session ------------------------------------------------

def test_session_set_of_the_commit_protocol_drops_the_insert_events(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """README: the shim replaces spark.sql.sources.commitProtocolClass, and every INSERT
    records an INSERT event; a SET of the keys that switch the hook off is refused. A session
    can SET the commit protocol back to Spark's own: its inserts are then not recorded."""
    lake.sql(f"CREATE TABLE {DB}.cp (a INT) USING parquet")
    key = "spark.sql.sources.commitProtocolClass"
    refused = False
    try:
        lake.sql(f"SET {key}="
                 "org.apache.spark.sql.execution.datasources.SQLHadoopMapReduceCommitProtocol")
    except Exception:
        refused = True
    try:
        events = run(lake, f"INSERT INTO {DB}.cp VALUES (1)")
    finally:
        if not refused:
            lake.sql(f"SET {key}=io.cmroot.spark.CmrootCommitProtocol")
    assert refused or kinds(events) == ["INSERT"], brief(events)


# -- CREATE TABLE over data -------------------------------------------------------------------

def test_create_over_a_directory_with_a_symlink_out_of_the_roots(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """README: CREATE TABLE over data records CREATE_TABLE with the files at the location; a
    change whose event cannot be recorded fails with `cmroot could not record the … event`.
    A landing directory holding a symlink to a file elsewhere (the daemon refuses to hash
    it): the CREATE ends with the metastore's "already exists" (the create was retried after
    the listener's failure), the table exists, and no CREATE_TABLE was recorded."""
    data = lake.warehouse / "landing" / "symed"
    lake.spark.range(2).selectExpr("CAST(id AS INT) AS a").write.parquet(str(data))
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(Path(sorted(data_files(data))[0]).read_bytes())
    (data / "part-link.parquet").symlink_to(outside)
    since = lake.daemon.current()
    err: Exception | None = None
    try:
        lake.sql(f"CREATE TABLE {DB}.symed (a INT) USING parquet LOCATION '{data}'")
    except Exception as e:
        err = e
    events = lake.daemon.events_after(since)
    exists = lake.spark.catalog.tableExists(f"{DB}.symed")
    if err is None:
        assert kinds(events) == ["CREATE_TABLE"], brief(events)
    else:
        assert "cmroot could not record" in error_chain(err), (exists, error_chain(err)[:600])


def error_chain(e: BaseException) -> str:
    parts = [str(e)]
    j = getattr(e, "_origin", None) or getattr(e, "java_exception", None)
    while j is not None:
        parts.append(str(j.toString()))
        j = j.getCause()
    return "\n".join(parts)


# -- a statement is one unit --------------------------------------------------------------------

def test_hive_dynamic_overwrite_refused_in_a_later_partition_mixes_old_and_new(
    lake: Lake, db: str, tmp_path: Path  # noqa: F811
) -> None:
    """DESIGN invariant 2 / README ("once a part is staged, a later failure puts every part
    back"): a failed statement leaves the data as it was. A Hive SerDe INSERT OVERWRITE with
    dynamic partitions: Hive loads partition by partition (replace the old files, move the
    new ones in). p=3 holds a symlink out of the roots, which the daemon refuses to recycle:
    the statement fails and p=1's old files are put back, but the new files Hive already
    moved into p=1 stay (no undo is registered for a Hive write), so p=1 holds both."""
    lake.sql(f"CREATE TABLE {DB}.hmix (a INT) PARTITIONED BY (p INT) STORED AS TEXTFILE")
    lake.sql(f"INSERT INTO {DB}.hmix PARTITION (p) VALUES (1, 1), (3, 3)")
    t = tdir(lake, "hmix")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"")  # no rows: the table reads the same through it
    (t / "p=3" / "zz-link").symlink_to(outside)
    before = data_files(t)
    hive_conf = (lake.spark._jsparkSession.sharedState().externalCatalog().unwrapped()
                 .client().conf())
    hive_conf.set("hive.load.dynamic.partitions.thread", "1")  # one partition after another
    since = lake.daemon.current()
    err: Exception | None = None
    try:
        lake.sql(f"INSERT OVERWRITE TABLE {DB}.hmix PARTITION (p) "
                 "SELECT * FROM VALUES (10, 1), (30, 3) AS v(a, p)")
    except Exception as e:
        err = e
    finally:
        hive_conf.unset("hive.load.dynamic.partitions.thread")
    after = rows(lake, f"SELECT a, p FROM {DB}.hmix")
    events = lake.daemon.events_after(since)
    if err is None:  # it stood: then every old file must be recycled with its event
        assert "INSERT_OVERWRITE" in kinds(events), brief(events)
        return
    assert after == [(1, 1), (3, 3)], (after, sorted(set(data_files(t)) - set(before)))
    assert data_files(t) == before
    assert [e for e in events if e["eventType"] in DESTRUCTIVE] == []


def test_hive_multi_insert_records_each_tables_insert(lake: Lake, db: str) -> None:  # noqa: F811
    """probe: FROM s INSERT INTO h1 ... INSERT INTO h2 ... into two Hive SerDe tables: one
    INSERT per table, each with exactly its table's new files."""
    for n in ("hm1", "hm2"):
        lake.sql(f"CREATE TABLE {DB}.{n} (a INT) STORED AS TEXTFILE")
    events = run(lake, f"FROM (SELECT 1 AS a) s INSERT INTO {DB}.hm1 SELECT a "
                       f"INSERT INTO {DB}.hm2 SELECT a + 1")
    assert sorted((e["eventType"], e["table"]) for e in events) == [
        ("INSERT", "hm1"), ("INSERT", "hm2")], brief(events)
    for e in events:
        assert set(listed(e)) == data_files(tdir(lake, e["table"])) != set()

"""Review 14: the load's holds (read_after), refusals, column changes and `repl dump
--after` (9cbf625, bcf4058), attacked with real dumps of the hooked source and forged
copies of them, loaded on the shared destination (one long-lived process).

Invariant: a load leaves the destination equal to the source as of the dump's last event;
a forged or odd dump never makes it skip events it must apply, nor crash with a
traceback (a ReplError is fine); a refusal changes nothing; a database that is not this
replication's own is never written by its incremental or one-table loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cmroot.repl import dumpdir
from cmroot.repl.dumpdir import Dump, DumpEvent
from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)


# -- helpers ---------------------------------------------------------------------------------


def _set_columns(src: Source, db: str, table: str, ddl: str) -> None:
    """The table's data columns become `ddl`, through the metastore (another engine's
    REPLACE COLUMNS / CHANGE COLUMN)."""
    jvm = src.spark.sparkContext._jvm
    schema = jvm.org.apache.spark.sql.types.StructType.fromDDL(ddl)
    src.spark._jsparkSession.sharedState().externalCatalog().alterTableDataSchema(
        db, table, schema)
    src.sql(f"REFRESH TABLE {db}.{table}")


_forged = 0


def _forge(src: Source, url: str, edit: Callable[[Dump], None]) -> str:
    """A copy of the dump at `url`, edited."""
    global _forged
    _forged += 1
    d = dumpdir.read(url)
    edit(d)
    out = str(src.base / "forged" / f"rv14-{_forged}")
    dumpdir.write(out, d.header, d.events, d.tables)
    return out


def _combined(src: Source, boot: str, inc: str, edit: Callable[[Dump], None]) -> str:
    """One bootstrap holding `boot` and then the events of `inc` (as if they ran while the
    bootstrap read), edited."""
    b, i = dumpdir.read(boot), dumpdir.read(inc)

    def go(d: Dump) -> None:
        d.header.last_event_id = i.header.last_event_id
        d.events = b.events + i.events
        for name, meta in i.tables.items():
            d.tables[name] = {**d.tables.get(name, {}), **meta}
        edit(d)

    return _forge(src, boot, go)


def _no_error(step: dict[str, Any]) -> None:
    assert "error" not in step["load"], step["load"]


# -- read_after ------------------------------------------------------------------------------
def test_forged_read_after_never_skips_what_must_be_applied(
    source: Source, destination: Destination
) -> None:
    """read_after keyed by another database's table (a database bootstrap never reads one),
    read_after in an incremental dump, and read_after past the dump's end: none may make the
    load skip the rename that brings rv14_rb.t into rv14_ra with its rows."""
    for db in ("rv14_ra", "rv14_rb"):
        source.sql(f"CREATE DATABASE {db}")
    source.sql("CREATE TABLE rv14_ra.keep (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_ra.keep VALUES (1)")
    source.sql("CREATE TABLE rv14_rb.t (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_rb.t VALUES (5)")
    boot, hb = source.dump("rv14_ra")
    source.rename_across("rv14_rb", "t", "rv14_ra")
    source.sql("INSERT INTO rv14_ra.t VALUES (6)")
    inc, hi = source.dump("rv14_ra", from_id=hb.last_event_id)
    rename = next(e for e in dumpdir.read(inc).events if e.type == "ALTER_TABLE")

    def other_db_key(d: Dump) -> None:
        d.tables["rv14_rb.t"] = {"partitions": None, "read_after": rename.id}

    def own_key_in_incremental(d: Dump) -> None:
        d.tables.setdefault("rv14_ra.t", {"partitions": None})["read_after"] = rename.id

    def past_the_end(d: Dump) -> None:
        d.tables["rv14_ra.t"]["read_after"] = hi.last_event_id + 100
        d.tables["rv14_rb.t"] = {"partitions": None, "read_after": hi.last_event_id + 100}

    f1 = _combined(source, boot, inc, other_db_key)
    f2 = _forge(source, inc, own_key_in_incremental)
    f3 = _combined(source, boot, inc, past_the_end)
    want = source.rows("SELECT * FROM rv14_ra.t")
    assert want == [[5], [6]]

    def q(db: str) -> dict[str, str]:
        return {"t": f"SELECT * FROM {db}.t", "keep": f"SELECT * FROM {db}.keep"}

    one, _, two, three = destination.run(
        {"load": {"dump": f1, "target": "rv14_ra_f1"}, "queries": q("rv14_ra_f1")},
        {"load": {"dump": boot, "target": "rv14_ra_f2"}},
        {"load": {"dump": f2, "target": "rv14_ra_f2"}, "queries": q("rv14_ra_f2")},
        {"load": {"dump": f3, "target": "rv14_ra_f3"}, "queries": q("rv14_ra_f3")},
    )
    bad = {}
    for name, step in (("other-db key", one), ("incremental", two), ("past the end", three)):
        if "error" in step["load"] or step["rows"]["keep"] != [[1]] or step["rows"]["t"] != want:
            bad[name] = (step["load"].get("error"), step["rows"])
    assert not bad, bad


# -- refusals --------------------------------------------------------------------------------
def test_one_table_dump_refused_inside_a_database_replica_whose_first_load_stopped(
    source: Source, destination: Destination
) -> None:
    """A database-level incremental load that stopped before its first id leaves a database
    marked with the source only (cmroot.repl.source): it is still a database-level replica
    (its rerun goes on in it), so a one-table dump must not land inside it."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE rv14_s")
    source.sql("CREATE TABLE rv14_s.t (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_s.t VALUES (1)")
    inc, hi = source.dump("rv14_s", from_id=start)
    boot_t, _ = source.dump("rv14_s.t")

    def stop_at_the_end(d: Dump) -> None:  # a load error after the database was created
        d.events.append(DumpEvent(hi.last_event_id, 999, "NOT_AN_EVENT", "rv14_s", "t"))

    bad = _forge(source, inc, stop_at_the_end)
    tables = {"tables": "SHOW TABLES IN rv14_s"}
    stopped, one_table = destination.run(
        {"load": {"dump": bad}, "queries": tables, "status": ["rv14_s"]},
        {"load": {"dump": boot_t, "target": "rv14_s.u"}, "queries": tables},
    )
    assert stopped["load"].get("kind") == "ReplError", stopped["load"]
    assert stopped["status"]["rv14_s"] is None
    assert one_table["load"].get("kind") == "ReplError", (
        "a one-table bootstrap landed in a database-level replica", one_table["load"],
        one_table["rows"]["tables"])
    assert one_table["rows"]["tables"] == stopped["rows"]["tables"]


def test_incremental_dump_of_another_database_refused_on_a_replica(
    source: Source, destination: Destination
) -> None:
    """A replica of rv14_a must not take rv14_b's incremental dump (same source, ids that
    line up): its tables would be written into rv14_a's replica."""
    for db in ("rv14_a", "rv14_b"):
        source.sql(f"CREATE DATABASE {db}")
    source.sql("CREATE TABLE rv14_a.t (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_a.t VALUES (1)")
    boot_a, ha = source.dump("rv14_a")
    source.sql("CREATE TABLE rv14_b.v (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_b.v VALUES (7)")
    inc_b, _ = source.dump("rv14_b", from_id=ha.last_event_id)
    tables = {"tables": "SHOW TABLES IN rv14_rep"}
    first, second = destination.run(
        {"load": {"dump": boot_a, "target": "rv14_rep"}, "queries": tables,
         "status": ["rv14_rep"]},
        {"load": {"dump": inc_b, "target": "rv14_rep"}, "queries": tables,
         "status": ["rv14_rep"]},
    )
    _no_error(first)
    assert second["load"].get("kind") == "ReplError", (
        "rv14_b's dump applied to rv14_a's replica", second["load"], second["rows"]["tables"])
    assert second["rows"]["tables"] == first["rows"]["tables"]
    assert second["status"] == first["status"]


# -- column changes --------------------------------------------------------------------------
def test_column_changes_keep_the_source_columns(
    source: Source, destination: Destination
) -> None:
    """char/varchar columns unchanged across an alter, a struct column added, a column
    dropped from a partitioned datasource table: the replica has the source's columns and
    rows after each dump."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE rv14_c")
    source.sql("CREATE TABLE rv14_c.h (c VARCHAR(10), k CHAR(3), a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_c.h VALUES ('x', 'y', 1)")
    source.sql("CREATE TABLE rv14_c.d (c VARCHAR(10), k CHAR(3), a INT) USING parquet")
    source.sql("INSERT INTO rv14_c.d VALUES ('x', 'y', 1)")
    source.sql("CREATE TABLE rv14_c.s (a INT, s STRUCT<x: INT>) USING parquet")
    source.sql("INSERT INTO rv14_c.s VALUES (1, named_struct('x', 1))")
    source.sql("CREATE TABLE rv14_c.p (a INT, b STRING, q INT) USING parquet PARTITIONED BY (q)")
    source.sql("INSERT INTO rv14_c.p VALUES (1, 'one', 1)")
    inc1, h1 = source.dump("rv14_c", from_id=start)
    source.sql("ALTER TABLE rv14_c.h SET TBLPROPERTIES ('rv14' = '1')")
    source.sql("ALTER TABLE rv14_c.d SET TBLPROPERTIES ('rv14' = '1')")
    source.sql("ALTER TABLE rv14_c.h ADD COLUMNS (z INT)")
    # (a struct gaining a field is refused by the source's own metastore: not tried)
    source.sql("ALTER TABLE rv14_c.s ADD COLUMNS (z STRUCT<w: INT>)")
    source.sql("INSERT INTO rv14_c.s VALUES (2, named_struct('x', 2), named_struct('w', 3))")
    _set_columns(source, "rv14_c", "p", "a INT")
    source.sql("INSERT INTO rv14_c.p VALUES (2, 2)")
    inc2, h2 = source.dump("rv14_c", from_id=h1.last_event_id)
    q = {}
    for t in ("h", "d", "s", "p"):
        q[f"{t} cols"] = f"DESCRIBE TABLE rv14_c.{t}"
        q[f"{t} rows"] = f"SELECT * FROM rv14_c.{t}"
    q["s z"] = "SELECT a, s.x, z.w FROM rv14_c.s"
    first, second = destination.run(
        {"load": {"dump": inc1}, "queries": {"h": q["h cols"], "d": q["d cols"]}},
        {"load": {"dump": inc2}, "queries": q, "status": ["rv14_c"]},
    )
    _no_error(first)
    # Before the alters the replica declares what the source declared (char/varchar).
    before = {t: sorted(r[:2] for r in first["rows"][t]) for t in ("h", "d")}
    _no_error(second)
    bad: dict[str, Any] = {}
    if before != {t: [["a", "int"], ["c", "varchar(10)"], ["k", "char(3)"]] for t in ("h", "d")}:
        bad["after the first load"] = before
    for name, sql in q.items():
        want = json.loads(json.dumps(source.rows(sql), default=str))
        got = second["rows"][name]
        if name.endswith("cols"):
            want = [r[:2] for r in want]
            got = got if isinstance(got, dict) else [r[:2] for r in got]
        if got != want:
            bad[name] = (got, want)
    assert not bad, bad
    assert second["status"]["rv14_c"] == h2.last_event_id


def test_forged_alter_that_drops_the_partition_columns_is_a_repl_error(
    source: Source, destination: Destination
) -> None:
    """An ALTER_TABLE whose definition no longer names the table's partition column (a
    forged or foreign event) must be refused as a ReplError, not crash the load with a
    Spark exception."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE rv14_pk")
    source.sql("CREATE TABLE rv14_pk.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO rv14_pk.t VALUES (1, 1)")
    source.sql("ALTER TABLE rv14_pk.t SET TBLPROPERTIES ('rv14' = '1')")
    inc, _ = source.dump("rv14_pk", from_id=start)

    def unpartition(d: Dump) -> None:
        e = next(x for x in d.events if x.type == "ALTER_TABLE")
        obj = json.loads(json.dumps(e.table_obj))
        params = obj.get("parameters") or {}
        for k in [k for k in params if "numPartCols" in k or ".partCol." in k]:
            del params[k]
        obj["partitionKeys"] = []
        e.table_obj = obj
        for meta in d.tables.values():
            meta["tableObj"] = obj

    forged = _forge(source, inc, unpartition)
    (got,) = destination.run(
        {"load": {"dump": forged, "target": "rv14_pk_f"},
         "queries": {"t": "SELECT * FROM rv14_pk_f.t"}},
    )
    assert "kind" not in got["load"] or got["load"]["kind"] == "ReplError", got["load"]


# -- cmroot repl dump --after ----------------------------------------------------------------
def _after(
    source: Source, previous: str, to_dir: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "repl", "dump", "--after", previous,
         "--to-dir", str(to_dir), "--url", source.daemon.url],
        capture_output=True, text=True, timeout=120,
    )


def test_dump_after_odd_previous_dumps(source: Source, tmp_path: Path) -> None:
    """--after with a database dump continues it (or refuses clearly); with a previous dump
    that cannot be read, or of another source, it fails naming the previous dump, never
    blaming --to-dir, never with a traceback."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE rv14_af")
    source.sql("CREATE TABLE rv14_af.t (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO rv14_af.t VALUES (1)")
    db_dump, hd = source.dump("rv14_af", from_id=start)
    source.sql("INSERT INTO rv14_af.t VALUES (2)")
    out = tmp_path / "out"
    out.mkdir()

    ok = _after(source, db_dump, out)
    assert "Traceback" not in ok.stderr, ok.stderr[-3000:]
    if ok.returncode == 0:
        header = dumpdir.read(ok.stdout.split("\t")[0].strip()).header
        assert (header.db, header.table, header.first_event_id) == (
            "rv14_af", None, hd.last_event_id)

    a_file = tmp_path / "a-file"
    a_file.write_text("not a dump")
    header_dir = tmp_path / "header-is-a-dir"
    shutil.copytree(db_dump, header_dir)
    os.unlink(header_dir / dumpdir.HEADER)
    (header_dir / dumpdir.HEADER).mkdir()
    other = tmp_path / "other-source"
    shutil.copytree(db_dump, other)
    raw = json.loads((other / dumpdir.HEADER).read_text())
    raw["source"] = "someone-else"
    (other / dumpdir.HEADER).write_text(json.dumps(raw))

    bad = {}
    for name, prev in (("a file", a_file), ("header a directory", header_dir),
                       ("another source", other), ("missing", tmp_path / "nowhere")):
        res = _after(source, str(prev), out)
        if res.returncode == 0 or "Traceback" in res.stderr or "--to-dir" in res.stderr \
                or "cannot write" in res.stderr:
            bad[name] = (res.returncode, res.stderr[-600:])
    assert not bad, bad

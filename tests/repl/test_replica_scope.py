"""What a load may write into (issue 12, refusals that protect a replica): an incremental
dump never lands on a database or table that is not its replica, a one-table dump never
lands inside a database-level replica, and a one-table bootstrap killed right after it
created its table reruns. Each refusal leaves the destination as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cmroot.exceptions import ReplError
from cmroot.repl import after
from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)


def test_targets_that_are_not_this_replica_are_refused(
    source: Source, destination: Destination, fresh_destination: Destination
) -> None:
    start = source.daemon.current()
    source.sql("CREATE DATABASE sc")
    source.sql("CREATE TABLE sc.t (a INT) USING parquet")
    source.sql("INSERT INTO sc.t VALUES (1)")
    inc, _ = source.dump("sc", from_id=start)  # creates the database: fine for a new target
    boot_db, _ = source.dump("sc")
    boot_t, hb = source.dump("sc.t")
    mine = {"mine": "SELECT * FROM sc.mine", "t": "SELECT * FROM sc.t"}
    foreign, whole, inside = destination.run(
        {"sql": ["CREATE DATABASE sc", "CREATE TABLE sc.mine (a INT) USING parquet",
                 "INSERT INTO sc.mine VALUES (42)"],
         "load": {"dump": inc}, "queries": mine, "status": ["sc"]},
        {"load": {"dump": boot_db, "target": "whole"}, "status": ["whole"]},
        {"load": {"dump": boot_t, "target": "whole.t2"},
         "queries": {"t2": "SELECT * FROM whole.t2"}, "status": ["whole"]},
    )
    assert foreign["load"]["kind"] == "ReplError", foreign["load"]
    assert "not a replica" in foreign["load"]["error"]
    assert foreign["rows"]["mine"] == [[42]] and "error" in foreign["rows"]["t"]
    assert foreign["status"]["sc"] is None
    assert "error" not in whole["load"], whole["load"]
    assert inside["load"]["kind"] == "ReplError", inside["load"]
    assert "whole database" in inside["load"]["error"]
    assert "error" in inside["rows"]["t2"] and inside["status"]["whole"] == whole["status"][
        "whole"]

    # A one-table bootstrap killed just after it created its table: the rerun goes on.
    fresh_destination.run({"load": {"dump": boot_t, "target": "one.t"}},
                          faults="load.table_created@1")
    (rerun,) = fresh_destination.run({"load": {"dump": boot_t, "target": "one.t"},
                                "queries": {"t": "SELECT * FROM one.t"}, "status": ["one.t"]})
    assert "error" not in rerun["load"], rerun["load"]
    assert rerun["rows"]["t"] == [[1]] and rerun["status"]["one.t"] == hb.last_event_id


def test_a_table_level_replica_follows_its_table_across_renames_between_dumps(
    source: Source, destination: Destination
) -> None:
    """`cmroot repl dump --after PREVIOUS` continues a one-table replication under the name
    the table has now; a new table taking the old name is not followed."""
    source.sql("CREATE DATABASE tl")
    source.sql("CREATE TABLE tl.t (a INT) USING parquet")
    source.sql("INSERT INTO tl.t VALUES (1)")
    boot, _ = source.dump("tl.t")
    source.sql("ALTER TABLE tl.t RENAME TO t2")
    source.sql("INSERT INTO tl.t2 VALUES (2)")
    inc1, h1 = after(source.daemon.client, boot, str(source.base / "dumps"))
    assert (h1.db, h1.table, h1.table_now) == ("tl", "t", "tl.t2")
    source.sql("CREATE TABLE tl.t (a INT) USING parquet")  # another table, the old name
    source.sql("INSERT INTO tl.t VALUES (99)")
    source.sql("INSERT INTO tl.t2 VALUES (3)")
    inc2, h2 = after(source.daemon.client, inc1, str(source.base / "dumps"))
    assert h2.table_now == "tl.t2" and h2.first_event_id == h1.last_event_id
    q = {"t": "SELECT * FROM rep.t"}
    got = destination.run(
        {"load": {"dump": boot, "target": "rep.t"}, "queries": q},
        {"load": {"dump": inc1, "target": "rep.t"}, "queries": q},
        {"load": {"dump": inc2, "target": "rep.t"}, "queries": q, "status": ["rep.t"]},
    )
    assert [step["rows"]["t"] for step in got] == [[[1]], [[1], [2]], [[1], [2], [3]]]
    assert got[2]["status"]["rep.t"] == h2.last_event_id

    bad = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "repl", "dump", "--after", inc1, "--from", "3",
         "--to-dir", str(source.base / "dumps"), "--url", source.daemon.url],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--after takes its scope" in bad.stderr


def test_a_table_outside_the_roots_is_refused_never_frozen(
    source: Source, destination: Destination
) -> None:
    """A table the hook records nothing for (its location outside the warehouse roots)
    would stand still on a replica: a bootstrap refuses it, naming it and the fix, and a
    load refuses the event that moved a replicated table there, changing nothing."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE ol")
    source.sql("CREATE TABLE ol.t (a INT) USING parquet")
    source.sql("INSERT INTO ol.t VALUES (1)")
    inc1, _ = source.dump("ol", from_id=start)
    outside = source.base / "outside-the-roots" / "t"
    source.spark.range(2).selectExpr("CAST(id + 7 AS INT) AS a").write.parquet(str(outside))
    source.sql(f"ALTER TABLE ol.t SET LOCATION '{outside}'")
    inc2, _ = source.dump("ol", from_id=start)
    with pytest.raises(ReplError) as e:
        source.dump("ol")
    assert "outside the warehouse roots" in e.value.message
    assert "ol.t" in e.value.detail and str(outside) in e.value.detail
    q = {"t": "SELECT * FROM ol.t"}
    first, moved = destination.run(
        {"load": {"dump": inc1}, "queries": q, "status": ["ol"]},
        {"load": {"dump": inc2}, "queries": q, "status": ["ol"]},
    )
    assert first["rows"]["t"] == [[1]]
    assert moved["load"]["kind"] == "ReplError", moved["load"]
    assert "outside the warehouse roots" in moved["load"]["error"]
    assert moved["rows"]["t"] == [[1]] and moved["status"] == first["status"]


class _ViewFsDestination(Destination):
    """A destination whose warehouse is on Hadoop's `viewfs` scheme (a real Hadoop
    filesystem, mounted here on a local directory): not a `file:` warehouse."""

    def __init__(self, base: Path) -> None:
        super().__init__(base)
        self.mount = f"/cmroot-viewfs-{uuid.uuid4().hex[:12]}"  # a path nobody has
        self.real = base / "viewfs-backing"

    def with_args(self) -> list[str]:
        out = super().with_args()
        for k, v in {"spark.sql.warehouse.dir": f"viewfs://cl{self.mount}/warehouse",
                     f"spark.hadoop.fs.viewfs.mounttable.cl.link.{self.mount}":
                         f"file://{self.real}"}.items():
            out += ["--with", f"{k}={v}"]
        return out


def test_a_destination_warehouse_on_another_filesystem_is_refused(
    source: Source, tmp_path: Path
) -> None:
    """The load writes with local file operations. A warehouse on another scheme used to
    be taken for the local path of the same name: the files went to `/<mount>/warehouse/…`
    on the local disk and the replica's tables, on the other filesystem, stayed empty. It is
    refused now, before anything is created anywhere."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE vw")
    source.sql("CREATE TABLE vw.t (a INT) USING parquet")
    source.sql("INSERT INTO vw.t VALUES (1)")
    inc, _ = source.dump("vw", from_id=start)
    dest = _ViewFsDestination(tmp_path / "destination")
    res = dest.cli("load", "--from-dir", inc, check=False)
    assert res.returncode != 0, res.stdout
    assert "destination not on the local filesystem" in res.stderr, res.stderr[-3000:]
    assert f"viewfs://cl{dest.mount}/warehouse" in res.stderr
    assert "Traceback" not in res.stderr
    assert not os.path.exists(dest.mount)
    assert not (dest.real / "warehouse" / "vw.db").exists()


def test_a_view_in_the_replica_database_does_not_stop_the_load(
    source: Source, destination: Destination
) -> None:
    """Views are not replicated, but a user may make one in a replica's database. The load
    went over every table's directory at its start, and a view has none: every later load
    of that database failed. Views are left alone now."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE vv")
    source.sql("CREATE TABLE vv.t (a INT) USING parquet")
    source.sql("INSERT INTO vv.t VALUES (1)")
    inc1, h1 = source.dump("vv", from_id=start)
    source.sql("INSERT INTO vv.t VALUES (2)")
    inc2, _ = source.dump("vv", from_id=h1.last_event_id)
    q = {"t": "SELECT * FROM vv.t", "v": "SELECT * FROM vv.v"}
    first, second = destination.run(
        {"load": {"dump": inc1}},
        {"sql": ["CREATE VIEW vv.v AS SELECT a * 10 AS a FROM vv.t"],
         "load": {"dump": inc2}, "queries": q},
    )
    assert "error" not in first["load"] and "error" not in second["load"], second["load"]
    assert second["rows"] == {"t": [[1], [2]], "v": [[10], [20]]}

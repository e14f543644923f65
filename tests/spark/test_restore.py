"""`cmroot restore` on real Spark (local[2], hooked, embedded Derby metastore) and a real
daemon: each test drops, truncates or overwrites through Spark SQL, restores, and compares
the table's rows, partitions and data files with what it had at that event; then checks the
events the restore recorded, which a replica replays."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmroot import checksum as cks
from cmroot import faults
from cmroot.cli import main
from cmroot.exceptions import BadRequest, FileLost, NotFound, ReplError
from cmroot.repl.restore import restore
from tests.spark.sparklib import Lake, hooked_lake

pytestmark = pytest.mark.timeout(900)

DB = "rst"


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lake]:
    # Tables of the `gone` database keep what they recycle for one second.
    env = {"CMROOT_STORE_RETAIN_OVERRIDES": "gone.*=1s"}
    with hooked_lake(tmp_path_factory.mktemp("restore"), Lake, env) as lk:
        lk.sql(f"CREATE DATABASE IF NOT EXISTS {DB}")
        yield lk


def files(top: Path) -> dict[str, str]:
    """The data files below `top` (hidden and housekeeping names left out): relative path
    -> checksum."""
    out = {}
    for d, dirs, names in os.walk(top):
        dirs[:] = [n for n in dirs if not n.startswith((".", "_"))]
        for n in names:
            if not n.startswith((".", "_")):
                p = os.path.join(d, n)
                out[os.path.relpath(p, top)] = cks.of_local_file(p)
    return out


def rows(lake: Lake, table: str) -> list[tuple[Any, ...]]:
    """The table's rows, sorted (by their text: a NULL sorts with the rest)."""
    return sorted((tuple(r) for r in lake.sql(f"SELECT * FROM {table}")), key=repr)


def parts(lake: Lake, table: str) -> list[str]:
    return sorted(r[0] for r in lake.sql(f"SHOW PARTITIONS {table}"))


def run(lake: Lake, statement: str) -> list[dict[str, Any]]:
    since = lake.daemon.current()
    lake.sql(statement)
    return lake.daemon.events_after(since)


def one(events: list[dict[str, Any]], kind: str) -> int:
    [e] = [e for e in events if e["eventType"] == kind]
    return int(e["id"])


def do(lake: Lake, event_id: int | None = None, **kw: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Restore; returns the result and the events it added."""
    since = lake.daemon.current()
    res = restore(lake.spark, lake.daemon.client, event_id, **kw)
    return res, lake.daemon.events_after(since)


def partitioned(lake: Lake, name: str) -> Path:
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1, 1), (2, 1), (3, 2)")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (4, 3)")
    return lake.table_dir(name, DB)


def test_undrop_partitioned_table_in_place(lake: Lake) -> None:
    t = partitioned(lake, "undrop")
    before = (rows(lake, f"{DB}.undrop"), parts(lake, f"{DB}.undrop"), files(t))
    drop = one(run(lake, f"DROP TABLE {DB}.undrop"), "DROP_TABLE")
    assert not t.exists() or files(t) == {}
    res, events = do(lake, drop)
    assert (rows(lake, f"{DB}.undrop"), parts(lake, f"{DB}.undrop"), files(t)) == before
    [r] = res.tables
    assert r.created and r.copied == r.files and r.recycled == 0
    kinds = [e["eventType"] for e in events]
    assert kinds[0] == "CREATE_TABLE" and set(kinds[1:]) == {"ADD_PARTITION"}
    # The events list every data file back in place, with its checksum: a replica has it.
    listed = {os.path.relpath(f["path"], t): f["checksum"] for e in events for f in e["files"]
              if not os.path.basename(f["path"]).startswith((".", "_"))}
    assert listed == before[2]
    # Done is done: a second run changes nothing and records nothing.
    res, events = do(lake, drop)
    assert events == [] and res.tables[0].copied == 0
    assert rows(lake, f"{DB}.undrop") == before[0]


def test_undrop_under_another_name(lake: Lake) -> None:
    t = partitioned(lake, "undrop_as")
    before = (rows(lake, f"{DB}.undrop_as"), parts(lake, f"{DB}.undrop_as"), files(t))
    drop = one(run(lake, f"DROP TABLE {DB}.undrop_as"), "DROP_TABLE")
    _res, events = do(lake, drop, as_name=f"{DB}.undrop_copy")
    new = lake.table_dir("undrop_copy", DB)
    assert (rows(lake, f"{DB}.undrop_copy"), parts(lake, f"{DB}.undrop_copy"),
            files(new)) == before
    assert not lake.sql(f"SHOW TABLES IN {DB} LIKE 'undrop_as'")
    assert {e["table"] for e in events} == {"undrop_copy"}


def test_undo_overwrite_then_undo_the_undo(lake: Lake) -> None:
    t = partitioned(lake, "ovw")
    before = (rows(lake, f"{DB}.ovw"), files(t))
    ovw = one(run(lake, f"INSERT OVERWRITE {DB}.ovw PARTITION (p=1) VALUES (9)"),
              "INSERT_OVERWRITE")
    after = (rows(lake, f"{DB}.ovw"), files(t))
    res, events = do(lake, ovw)
    assert (rows(lake, f"{DB}.ovw"), files(t)) == before
    [r] = res.tables
    assert r.recycled >= 1 and not r.created
    assert [e["eventType"] for e in events] == ["INSERT_OVERWRITE", "INSERT"]
    assert {os.path.relpath(f["path"], t) for f in events[0]["files"]
            if "/." not in f["path"]} == set(after[1]) - set(before[1])
    # The restore is an overwrite too: undoing it brings back what it replaced.
    res, _ = do(lake, int(events[0]["id"]))
    assert (rows(lake, f"{DB}.ovw"), files(t)) == after


def test_undo_overwrite_of_a_whole_partitioned_table(lake: Lake) -> None:
    t = partitioned(lake, "whole")
    before = (rows(lake, f"{DB}.whole"), parts(lake, f"{DB}.whole"), files(t))
    ovw = one(run(lake, f"INSERT OVERWRITE {DB}.whole VALUES (7, 7)"), "INSERT_OVERWRITE")
    assert parts(lake, f"{DB}.whole") == ["p=7"]
    res, _ = do(lake, ovw)
    assert (rows(lake, f"{DB}.whole"), parts(lake, f"{DB}.whole"), files(t)) == before
    assert res.tables[0].partitions_dropped == [{"p": "7"}]


def test_undo_truncate(lake: Lake) -> None:
    lake.sql(f"CREATE TABLE {DB}.trunc USING parquet AS SELECT id AS a FROM range(5)")
    t = lake.table_dir("trunc", DB)
    before = (rows(lake, f"{DB}.trunc"), files(t))
    tr = one(run(lake, f"TRUNCATE TABLE {DB}.trunc"), "TRUNCATE")
    assert rows(lake, f"{DB}.trunc") == []
    res, events = do(lake, tr)
    assert (rows(lake, f"{DB}.trunc"), files(t)) == before
    assert [e["eventType"] for e in events] == ["INSERT"]
    assert res.tables[0].recycled == 0


def test_undrop_partition(lake: Lake) -> None:
    t = partitioned(lake, "dp")
    before = (rows(lake, f"{DB}.dp"), parts(lake, f"{DB}.dp"), files(t))
    dp = one(run(lake, f"ALTER TABLE {DB}.dp DROP PARTITION (p=1)"), "DROP_PARTITION")
    res, events = do(lake, dp)
    assert (rows(lake, f"{DB}.dp"), parts(lake, f"{DB}.dp"), files(t)) == before
    assert [e["eventType"] for e in events] == ["ADD_PARTITION"]
    assert res.tables[0].partitions_added == [{"p": "1"}]


def test_undrop_database(lake: Lake) -> None:
    lake.sql("CREATE DATABASE rst_db")
    lake.sql("CREATE TABLE rst_db.a USING parquet AS SELECT 1 AS x")
    lake.sql("CREATE TABLE rst_db.b (x INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql("INSERT INTO rst_db.b VALUES (1, 1), (2, 2)")
    before = {n: rows(lake, f"rst_db.{n}") for n in "ab"}
    drop = one(run(lake, "DROP DATABASE rst_db CASCADE"), "DROP_DATABASE")
    res, _ = do(lake, drop)
    assert {n: rows(lake, f"rst_db.{n}") for n in "ab"} == before
    assert sorted(r.table for r in res.tables) == ["a", "b"]


def test_restore_refused_over_a_live_table(lake: Lake) -> None:
    t = partitioned(lake, "live")
    drop = one(run(lake, f"DROP TABLE {DB}.live"), "DROP_TABLE")
    lake.sql(f"CREATE TABLE {DB}.live (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.live VALUES (100, 1)")
    now = (rows(lake, f"{DB}.live"), files(t))
    since = lake.daemon.current()
    with pytest.raises(ReplError, match="holds data the restore would replace") as e:
        restore(lake.spark, lake.daemon.client, drop)
    assert "--replace" in e.value.detail
    assert (rows(lake, f"{DB}.live"), files(t)) == now and lake.daemon.current() == since
    # Told to: what was there goes to the cmroot (undoable), the dropped table comes back.
    res, events = do(lake, drop, replace=True)
    assert [r for r in rows(lake, f"{DB}.live")] == [(1, 1), (2, 1), (3, 2), (4, 3)]
    assert events[0]["eventType"] == "INSERT_OVERWRITE" and res.tables[0].recycled >= 1


def test_restore_killed_midway_then_rerun(lake: Lake) -> None:
    t = partitioned(lake, "killed")
    before = (rows(lake, f"{DB}.killed"), parts(lake, f"{DB}.killed"), files(t))
    ovw = one(run(lake, f"INSERT OVERWRITE {DB}.killed VALUES (8, 8)"), "INSERT_OVERWRITE")
    for point in ("restore.recycled", "restore.published", "restore.created"):
        faults.arm(point, crash=True)
        try:
            with pytest.raises(faults.Crash):
                restore(lake.spark, lake.daemon.client, ovw)
        finally:
            faults.disarm()
        _res, _ = do(lake, ovw)
        got = (rows(lake, f"{DB}.killed"), parts(lake, f"{DB}.killed"), files(t))
        assert got == before, point
        # Overwrite again: the next crash point starts from an overwrite too.
        ovw = one(run(lake, f"INSERT OVERWRITE {DB}.killed VALUES (8, 8)"), "INSERT_OVERWRITE")


def test_as_of(lake: Lake) -> None:
    lake.sql(f"CREATE TABLE {DB}.hist (a INT, p INT) USING parquet PARTITIONED BY (p)")
    t = lake.table_dir("hist", DB)
    lake.sql(f"INSERT INTO {DB}.hist VALUES (1, 1)")
    lake.sql(f"INSERT INTO {DB}.hist VALUES (2, 2)")
    at = lake.daemon.current()
    then = (rows(lake, f"{DB}.hist"), parts(lake, f"{DB}.hist"), files(t))
    lake.sql(f"INSERT INTO {DB}.hist VALUES (3, 1)")
    lake.sql(f"INSERT OVERWRITE {DB}.hist PARTITION (p=2) VALUES (5)")
    lake.sql(f"INSERT INTO {DB}.hist VALUES (6, 6)")
    with pytest.raises(ReplError, match="holds data the restore would replace"):
        restore(lake.spark, lake.daemon.client, db=DB, table="hist", as_of=str(at))
    res, _ = do(lake, db=DB, table="hist", as_of=str(at), replace=True)
    assert (rows(lake, f"{DB}.hist"), parts(lake, f"{DB}.hist"), files(t)) == then
    assert res.tables[0].partitions_dropped == [{"p": "6"}]


def test_a_file_expired_refuses_before_any_change(lake: Lake) -> None:
    lake.sql("CREATE DATABASE IF NOT EXISTS gone")
    lake.sql("CREATE TABLE gone.t USING parquet AS SELECT id AS a FROM range(3)")
    lake.sql("INSERT INTO gone.t VALUES (10)")
    drop = one(run(lake, "DROP TABLE gone.t"), "DROP_TABLE")
    time.sleep(1.5)
    lake.daemon.client.gc(dry_run=False)
    since = lake.daemon.current()
    with pytest.raises(FileLost, match="file lost: /") as e:
        restore(lake.spark, lake.daemon.client, drop)
    assert f"event {drop}" in e.value.detail and "Nothing of gone.t was changed" in e.value.detail
    assert not lake.sql("SHOW TABLES IN gone LIKE 't'") and lake.daemon.current() == since


def test_bad_requests(lake: Lake) -> None:
    ins = one(run(lake, f"CREATE TABLE {DB}.bad USING parquet AS SELECT 1 AS a"), "INSERT")
    with pytest.raises(BadRequest, match="nothing to undo"):
        restore(lake.spark, lake.daemon.client, ins)
    with pytest.raises(NotFound, match="no event"):
        restore(lake.spark, lake.daemon.client, 10**9)
    with pytest.raises(BadRequest, match="bad --as"):
        restore(lake.spark, lake.daemon.client, ins, as_name="nodot")


def test_cli_dry_run_names_what_comes_back(lake: Lake, capsys: pytest.CaptureFixture[str]) -> None:
    t = partitioned(lake, "dry")
    drop = one(run(lake, f"DROP TABLE {DB}.dry"), "DROP_TABLE")
    since = lake.daemon.current()
    url = lake.daemon.url
    assert main(["restore", str(drop), "--url", url, "--dry-run", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"would restore {DB}.dry to event {drop} (DROP_TABLE)" in out
    assert "partition added: p=1" in out and "table created" in out
    assert lake.daemon.current() == since and (not t.exists() or files(t) == {})
    assert main(["restore", str(drop), "--url", url, "--dry-run", "--json", "-q"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dry_run"] and data["tables"][0]["copied"] >= 3
    assert main(["restore", "--url", url, "--as-of", "x", "--db", DB, "--table", "dry"]) == 2
    err = capsys.readouterr().err
    assert "bad --as-of" in err and "Traceback" not in err

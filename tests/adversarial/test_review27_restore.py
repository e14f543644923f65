"""Review 27: attacks on `cmroot restore` (cmroot/repl/restore.py) on real Spark (local[2],
hooked) and a real daemon. Each test names the invariant it breaks; a failing test is a
bug in the restore, not in the test."""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmroot.cli import main
from cmroot.exceptions import CmrootError, ReplError
from cmroot.repl.restore import restore
from tests.spark.sparklib import Lake, hooked_lake
from tests.spark.test_restore import do, files, one, parts, rows, run

pytestmark = pytest.mark.timeout(900)

DB = "rv27"


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lake]:
    pytest.importorskip("pyspark")
    with hooked_lake(tmp_path_factory.mktemp("review27_restore"), Lake) as lk:
        lk.sql(f"CREATE DATABASE IF NOT EXISTS {DB}")
        yield lk


def state(lake: Lake, name: str, top: Path) -> tuple[Any, ...]:
    return rows(lake, f"{DB}.{name}"), parts(lake, f"{DB}.{name}"), files(top)


# -- invariant 3/2: the live table's shape ---------------------------------------------------
def test_recreated_table_in_another_format_is_not_the_same_shape(lake: Lake) -> None:
    """A table dropped, then re-created (empty) under its name with the same columns but
    another file format: the restore must refuse (another definition) or bring back the
    rows. `_same_shape` compares only columns, so parquet files are put into a JSON table."""
    lake.sql(f"CREATE TABLE {DB}.fmt (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.fmt VALUES (1), (2)")
    drop = one(run(lake, f"DROP TABLE {DB}.fmt"), "DROP_TABLE")
    lake.sql(f"CREATE TABLE {DB}.fmt (a INT) USING json")
    since = lake.daemon.current()
    try:
        restore(lake.spark, lake.daemon.client, drop)
    except ReplError as e:
        assert "another definition" in e.message
        assert lake.daemon.current() == since
        return
    got: Any
    try:
        got = rows(lake, f"{DB}.fmt")
    except Exception as e:
        got = f"unreadable: {type(e).__name__}"
    assert got == [(1,), (2,)], "parquet files restored into a JSON table"


def test_overwrite_undo_over_a_table_recreated_with_other_columns(lake: Lake) -> None:
    """Undo of an INSERT OVERWRITE in place, after the table was dropped and re-created
    under its name with other columns and new data: no definition is checked (table_obj
    None, `alive`), so without --replace the new table's data is moved out and files of
    another schema put in. It must refuse and change nothing."""
    lake.sql(f"CREATE TABLE {DB}.reborn (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.reborn VALUES (1)")
    ovw = one(run(lake, f"INSERT OVERWRITE {DB}.reborn VALUES (2)"), "INSERT_OVERWRITE")
    lake.sql(f"DROP TABLE {DB}.reborn")
    lake.sql(f"CREATE TABLE {DB}.reborn (s STRING) USING parquet")
    lake.sql(f"INSERT INTO {DB}.reborn VALUES ('new')")
    t = lake.table_dir("reborn", DB)
    now = (rows(lake, f"{DB}.reborn"), files(t))
    since = lake.daemon.current()
    with pytest.raises(CmrootError):
        restore(lake.spark, lake.daemon.client, ovw)
    assert (rows(lake, f"{DB}.reborn"), files(t)) == now
    assert lake.daemon.current() == since


def test_overwrite_undo_moves_a_later_insert_to_the_cmroot(lake: Lake) -> None:
    """Undo of an overwrite after a later, separate INSERT: as issue 15 asks, what was
    written since goes to the cmroot first (no --replace needed: undoing an overwrite means
    replacing the live data), and undoing the restore brings it all back."""
    lake.sql(f"CREATE TABLE {DB}.later (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.later VALUES (1)")
    ovw = one(run(lake, f"INSERT OVERWRITE {DB}.later VALUES (2)"), "INSERT_OVERWRITE")
    lake.sql(f"INSERT INTO {DB}.later VALUES (3)")
    _, events = do(lake, ovw)
    assert rows(lake, f"{DB}.later") == [(1,)]
    undo = one(events, "INSERT_OVERWRITE")
    do(lake, undo)
    assert rows(lake, f"{DB}.later") == [(2,), (3,)]


# -- invariant 3: partitions -----------------------------------------------------------------
def test_undrop_table_with_a_null_partition(lake: Lake) -> None:
    """A partition whose value is NULL (directory p=__HIVE_DEFAULT_PARTITION__) comes back
    as the NULL partition, with its rows."""
    lake.sql(f"CREATE TABLE {DB}.nul (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.nul VALUES (1, NULL), (2, 2)")
    t = lake.table_dir("nul", DB)
    before = state(lake, "nul", t)
    drop = one(run(lake, f"DROP TABLE {DB}.nul"), "DROP_TABLE")
    restore(lake.spark, lake.daemon.client, drop)
    assert state(lake, "nul", t) == before


def test_undrop_partitions_with_special_characters(lake: Lake) -> None:
    """Partition values with a space, '=', '/', '%' and non-ASCII come back in place and
    under another name, rows and partitions equal."""
    lake.sql(f"CREATE TABLE {DB}.sp (a INT, p STRING) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.sp VALUES (1, 'a b'), (2, 'x=y'), (3, 'c/d'), (4, 'é%2F'),"
             " (5, 'q:r')")
    t = lake.table_dir("sp", DB)
    before = state(lake, "sp", t)
    dp = one(run(lake, f"ALTER TABLE {DB}.sp DROP PARTITION (p='c/d')"), "DROP_PARTITION")
    restore(lake.spark, lake.daemon.client, dp)
    assert state(lake, "sp", t) == before
    drop = one(run(lake, f"DROP TABLE {DB}.sp"), "DROP_TABLE")
    restore(lake.spark, lake.daemon.client, drop, as_name=f"{DB}.sp_copy")
    new = lake.table_dir("sp_copy", DB)
    assert state(lake, "sp_copy", new) == before
    restore(lake.spark, lake.daemon.client, drop)
    assert state(lake, "sp", t) == before


def test_undo_partial_static_overwrite_of_nested_partitions(lake: Lake) -> None:
    """INSERT OVERWRITE t PARTITION (p=1, q) on a table partitioned by (p, q) replaces every
    p=1/q=* partition; undoing it brings them back and removes what it wrote."""
    lake.sql(f"CREATE TABLE {DB}.nest (a INT, p INT, q STRING) USING parquet"
             " PARTITIONED BY (p, q)")
    lake.sql(f"INSERT INTO {DB}.nest VALUES (1, 1, 'a'), (2, 1, 'b'), (3, 2, 'a')")
    t = lake.table_dir("nest", DB)
    before = state(lake, "nest", t)
    ovw = one(run(lake, f"INSERT OVERWRITE {DB}.nest PARTITION (p=1, q) SELECT 9, 'c'"),
              "INSERT_OVERWRITE")
    assert rows(lake, f"{DB}.nest") == [(3, 2, "a"), (9, 1, "c")]
    restore(lake.spark, lake.daemon.client, ovw)
    assert state(lake, "nest", t) == before


def test_undrop_partition_re_added_at_another_location(lake: Lake) -> None:
    """A partition dropped, then re-added (empty) at a custom LOCATION: undoing the drop
    must bring its rows back into what the table reads (or refuse, changing nothing). The
    plan copies into the default directory while the catalog reads the custom one."""
    lake.sql(f"CREATE TABLE {DB}.moved (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.moved VALUES (1, 1), (2, 1), (3, 2)")
    before = rows(lake, f"{DB}.moved")
    dp = one(run(lake, f"ALTER TABLE {DB}.moved DROP PARTITION (p=1)"), "DROP_PARTITION")
    custom = lake.base / "moved_p1"
    lake.sql(f"ALTER TABLE {DB}.moved ADD PARTITION (p=1) LOCATION '{custom}'")
    since = lake.daemon.current()
    try:
        restore(lake.spark, lake.daemon.client, dp)
    except CmrootError:
        assert lake.daemon.current() == since
        return
    assert rows(lake, f"{DB}.moved") == before, "restore reported success, rows not back"


def test_undrop_of_an_empty_database(lake: Lake) -> None:
    """Undoing DROP DATABASE of a database without tables brings the database back (the
    restore reports success but does nothing)."""
    lake.sql("CREATE DATABASE rv27_empty")
    events = run(lake, "DROP DATABASE rv27_empty")
    drop = one(events, "DROP_DATABASE")
    restore(lake.spark, lake.daemon.client, drop)
    assert lake.sql("SHOW DATABASES LIKE 'rv27_empty'"), "the database is not back"


# -- invariant 6: confinement ----------------------------------------------------------------
def test_event_paths_outside_the_table_are_not_written(lake: Lake) -> None:
    """An event of a table whose file path lies outside the table's directory and outside
    every partition's own location (a DROP_PARTITION of p=5, default directory): restoring it
    in place writes that path, outside the table."""
    lake.sql(f"CREATE TABLE {DB}.conf (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.conf VALUES (1, 1)")
    t = lake.table_dir("conf", DB)
    # In the warehouse (the daemon's root), not below the table: conf2 shares its prefix.
    outside = lake.table_dir("conf2", DB)
    outside.mkdir(parents=True)
    victim = outside / "part-00000.parquet"
    victim.write_bytes(b"not a table's file")
    rec = lake.daemon.client.recycle([str(victim)], op="DROP_PARTITION", db=DB, table="conf",
                                     partitions=[{"p": "5"}], location=str(t))
    assert not victim.exists()
    try:
        restore(lake.spark, lake.daemon.client, rec.event_id)
    except CmrootError:
        pass
    assert not victim.exists(), "restore wrote outside the table and its partitions"


def test_undrop_external_table(lake: Lake) -> None:
    """An external table dropped (its files stay) comes back at its location, rows equal."""
    where = lake.warehouse / "ext_rv27"
    lake.sql(f"CREATE TABLE {DB}.ext (a INT, p INT) USING parquet PARTITIONED BY (p)"
             f" LOCATION '{where}'")
    lake.sql(f"INSERT INTO {DB}.ext VALUES (1, 1), (2, 2)")
    before = state(lake, "ext", where)
    drop = one(run(lake, f"DROP TABLE {DB}.ext"), "DROP_TABLE")
    restore(lake.spark, lake.daemon.client, drop)
    assert state(lake, "ext", where) == before


def test_undrop_external_table_with_replace_keeps_its_data(lake: Lake) -> None:
    """The same with --replace (what the refusal above advises): the external table's own
    files, which its DROP left in place, must not be recycled away (the event lists none),
    and the table must come back with its rows."""
    where = lake.warehouse / "ext_rv27b"
    lake.sql(f"CREATE TABLE {DB}.extb (a INT) USING parquet LOCATION '{where}'")
    lake.sql(f"INSERT INTO {DB}.extb VALUES (1), (2)")
    before = (rows(lake, f"{DB}.extb"), files(where))
    drop = one(run(lake, f"DROP TABLE {DB}.extb"), "DROP_TABLE")
    restore(lake.spark, lake.daemon.client, drop, replace=True)
    assert (rows(lake, f"{DB}.extb"), files(where)) == before


def test_as_of_in_place_rerun_records_nothing(lake: Lake) -> None:
    """A completed --as-of restore run again changes nothing and records nothing."""
    lake.sql(f"CREATE TABLE {DB}.again (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.again VALUES (1, 1), (2, 2)")
    at = lake.daemon.current()
    t = lake.table_dir("again", DB)
    then = state(lake, "again", t)
    lake.sql(f"INSERT OVERWRITE {DB}.again PARTITION (p=2) VALUES (5)")
    lake.sql(f"INSERT INTO {DB}.again VALUES (6, 6)")
    do(lake, db=DB, table="again", as_of=str(at), replace=True)
    assert state(lake, "again", t) == then
    _res, events = do(lake, db=DB, table="again", as_of=str(at), replace=True)
    assert events == [] and state(lake, "again", t) == then


def test_daemon_down_during_the_copy_then_rerun(lake: Lake, monkeypatch: Any) -> None:
    """The daemon stops while a restore copies: a clear error; once it is back, a rerun
    finishes the job (rows, partitions, files equal)."""
    import cmroot.repl.restore as mod

    lake.sql(f"CREATE TABLE {DB}.down (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.down VALUES (1, 1), (2, 2)")
    t = lake.table_dir("down", DB)
    before = state(lake, "down", t)
    drop = one(run(lake, f"DROP TABLE {DB}.down"), "DROP_TABLE")
    real = mod.copy_on_spark

    def copy_while_down(*a: Any, **kw: Any) -> Any:
        with lake.daemon.down():
            return real(*a, **kw)

    monkeypatch.setattr(mod, "copy_on_spark", copy_while_down)
    with pytest.raises(CmrootError):
        restore(lake.spark, lake.daemon.client, drop)
    monkeypatch.setattr(mod, "copy_on_spark", real)
    restore(lake.spark, lake.daemon.client, drop)
    assert state(lake, "down", t) == before


# -- invariant 2/7: leftovers in the way -----------------------------------------------------
def test_undrop_over_a_killed_writers_leftover(lake: Lake) -> None:
    """A dropped managed table's directory holds a killed writer's `_temporary` directory
    (which the plan's listing leaves out): the restore must work, or refuse with a clear
    error before any change; it fails with Spark's own exception instead."""
    lake.sql(f"CREATE TABLE {DB}.tmpl USING parquet AS SELECT 1 AS a")
    t = lake.table_dir("tmpl", DB)
    drop = one(run(lake, f"DROP TABLE {DB}.tmpl"), "DROP_TABLE")
    (t / "_temporary" / "0").mkdir(parents=True)
    since = lake.daemon.current()
    try:
        restore(lake.spark, lake.daemon.client, drop)
    except CmrootError:
        assert lake.daemon.current() == since
        return
    assert rows(lake, f"{DB}.tmpl") == [(1,)]


# -- invariant 7: bad input ------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--db", DB, "--table", "x", "--as-of", "\u00b2"],  # isdigit(), yet not int()
    ["99999999999999999999999"],
    ["--db", DB, "--table", "x", "--as-of", "99999999999999999999999"],
    ["--db", DB, "--table", "x", "--as-of", "1", "--partition", "p=1", "--partition", "=2"],
])
def test_cli_bad_input_is_a_clear_error(lake: Lake, capsys: pytest.CaptureFixture[str],
                                        argv: list[str]) -> None:
    """Bad input is refused with a clear error (exit 2), never an `unexpected` bug line."""
    rc = main(["restore", "--url", lake.daemon.url, "-q", *argv])
    err = capsys.readouterr().err
    assert "unexpected" not in err and "Traceback" not in err, err
    assert rc == 2, err


# -- invariant 3: --as-of a time -------------------------------------------------------------
def test_as_of_a_time(lake: Lake) -> None:
    """--as-of an ISO time rebuilds the table as it was then, under another name."""
    lake.sql(f"CREATE TABLE {DB}.clock (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.clock VALUES (1)")
    time.sleep(1.2)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat()
    time.sleep(1.2)
    lake.sql(f"INSERT INTO {DB}.clock VALUES (2)")
    restore(lake.spark, lake.daemon.client, db=DB, table="clock", as_of=when,
            as_name=f"{DB}.clock_then")
    assert rows(lake, f"{DB}.clock_then") == [(1,)]


# -- invariant 4: two at once ----------------------------------------------------------------
def test_two_restores_of_one_drop_at_once(lake: Lake) -> None:
    """Two restores of the same DROP_TABLE at once (threads, one session): each ends with
    the table back or a clear error, the table equals what it was, and the log lists its
    files once."""
    lake.sql(f"CREATE TABLE {DB}.twice (a INT, p INT) USING parquet PARTITIONED BY (p)")
    lake.sql(f"INSERT INTO {DB}.twice VALUES (1, 1), (2, 2)")
    t = lake.table_dir("twice", DB)
    before = state(lake, "twice", t)
    drop = one(run(lake, f"DROP TABLE {DB}.twice"), "DROP_TABLE")
    since = lake.daemon.current()
    errors: list[BaseException] = []

    def go() -> None:
        try:
            restore(lake.spark, lake.daemon.client, drop)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(isinstance(e, CmrootError) for e in errors), errors
    assert len(errors) < 2
    assert state(lake, "twice", t) == before
    listed = [f["path"] for e in lake.daemon.events_after(since) for f in e.get("files") or []
              if e["eventType"] in ("CREATE_TABLE", "ADD_PARTITION", "INSERT")
              and not os.path.basename(f["path"]).startswith((".", "_"))]
    assert len(listed) == len(set(listed)), listed

"""Bootstrap consolidation (issue 12): statements that run while a bootstrap dump takes its
snapshot (renames, drops, re-creates of the same name, a table swap, a database dropped and
re-created) never leave the replica with a lost or an empty table. Each statement runs at a
deterministic point of the snapshot (the dump's fault points), and the replica must equal
the source as it was when the dump ended."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cmroot.repl import dumpdir
from tests.cmroot_testlib import on_point
from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)

# Where in the snapshot a statement lands: tables listed, definitions read, files listed.
POINTS = ("dump.tables_listed", "dump.defined", "dump.files_listed")


def _tables(source: Source, db: str) -> dict[str, str]:
    names = sorted(r[1] for r in source.sql(f"SHOW TABLES IN {db}"))
    return {t: f"SELECT * FROM {db}.{t}" for t in names}


def _dump_with(
    source: Source, monkeypatch: pytest.MonkeyPatch, db: str, point: str,
    during: Callable[[], None],
) -> tuple[str, Any, dict[str, str], dict[str, Any]]:
    """Bootstrap-dump `db` with `during` run at `point`; the dump's URL and header, and the
    source's tables and rows as the dump ended."""
    with monkeypatch.context() as m:
        on_point(m, point, during)
        url, header = source.dump(db)
    assert header.last_event_id > header.first_event_id, "nothing ran during the snapshot"
    queries = _tables(source, db)
    return url, header, queries, {t: source.rows(q) for t, q in queries.items()}


def test_renames_and_swaps_during_a_bootstrap(
    source: Source, destination: Destination, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At each point of the snapshot (one database each): a rename, a partitioned table's
    rename, a table dropped and re-created under its name, and the ETL table swap. The
    replica has every table under its new name with its rows, none empty, none left under
    an old name."""
    steps, wanted = [], []
    for point in POINTS:
        db = f"cons_{point.split('.')[1]}"
        source.sql(f"CREATE DATABASE {db}")
        source.sql(f"CREATE TABLE {db}.a (x INT) USING parquet")
        source.sql(f"INSERT INTO {db}.a VALUES (1), (2)")
        source.sql(f"CREATE TABLE {db}.p (x INT, k INT) USING parquet PARTITIONED BY (k)")
        source.sql(f"INSERT INTO {db}.p VALUES (1, 1), (2, 2)")
        source.sql(f"CREATE TABLE {db}.r (x INT) USING parquet")
        source.sql(f"INSERT INTO {db}.r VALUES (5)")
        source.sql(f"CREATE TABLE {db}.s (x INT) USING parquet")
        source.sql(f"INSERT INTO {db}.s VALUES (7), (8)")
        source.sql(f"CREATE TABLE {db}.keep (x INT) USING parquet")
        source.sql(f"INSERT INTO {db}.keep VALUES (3)")

        def during(db: str = db) -> None:
            source.sql(f"ALTER TABLE {db}.a RENAME TO a2")
            source.sql(f"ALTER TABLE {db}.p RENAME TO p2")
            source.sql(f"DROP TABLE {db}.r")
            source.sql(f"CREATE TABLE {db}.r (y STRING) USING parquet")
            source.sql(f"INSERT INTO {db}.r VALUES ('new')")
            source.sql(f"CREATE TABLE {db}.s_new USING parquet AS SELECT x + 10 AS x"
                       f" FROM {db}.s")
            source.sql(f"DROP TABLE {db}.s")
            source.sql(f"ALTER TABLE {db}.s_new RENAME TO s")

        url, header, queries, want = _dump_with(source, monkeypatch, db, point, during)
        assert sorted(queries) == ["a2", "keep", "p2", "r", "s"], point
        assert want["a2"] == [[1], [2]] and want["s"] == [[17], [18]]
        assert want["r"] == [["new"]]
        steps.append({"load": {"dump": url}, "queries": queries, "status": [db],
                      "partitions": [f"{db}.p2"]})
        wanted.append((point, db, header.last_event_id, want))
    for got, (point, db, last, want) in zip(destination.run(*steps), wanted, strict=True):
        assert "error" not in got["load"], (point, got["load"])
        assert got["rows"] == want, point
        assert got["partitions"][f"{db}.p2"] == ["k=1", "k=2"], point
        assert got["status"][db] == last, point


def test_a_database_dropped_and_re_created_during_a_bootstrap(
    source: Source, fresh_destination: Destination, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database itself is dropped and re-created with other tables while the snapshot
    is taken: the replica is the new database. A load killed just after it re-created the
    database and its table is rerun to the end, and an incremental dump follows."""
    db = "cons_db"
    source.sql(f"CREATE DATABASE {db}")
    source.sql(f"CREATE TABLE {db}.old (x INT) USING parquet")
    source.sql(f"INSERT INTO {db}.old VALUES (1)")

    def during() -> None:
        source.sql(f"DROP DATABASE {db} CASCADE")
        source.sql(f"CREATE DATABASE {db}")
        source.sql(f"CREATE TABLE {db}.new (x INT) USING parquet")
        source.sql(f"INSERT INTO {db}.new VALUES (2), (3)")

    url, header, queries, want = _dump_with(source, monkeypatch, db, "dump.defined", during)
    assert sorted(queries) == ["new"]
    source.sql(f"INSERT INTO {db}.new VALUES (4)")
    url2, header2 = source.dump(db, from_id=header.last_event_id)
    q = {"new": f"SELECT * FROM {db}.new", "old": f"SELECT * FROM {db}.old"}
    events = dumpdir.read(url).events
    created = next(i for i, e in enumerate(events) if e.type == "CREATE_TABLE" and e.table == "new")
    assert any(e.type == "DROP_DATABASE" for e in events[:created])
    fresh_destination.run({"load": {"dump": url}}, faults=f"load.applied@{created + 1}")
    first, inc = fresh_destination.run(
        {"load": {"dump": url}, "queries": q, "status": [db]},
        {"load": {"dump": url2}, "queries": q, "status": [db]},
    )
    assert "error" not in first["load"], first["load"]
    assert first["rows"]["new"] == want["new"] == [[2], [3]]
    assert "error" in first["rows"]["old"]  # no such table
    assert first["status"][db] == header.last_event_id
    assert "error" not in inc["load"], inc["load"]
    assert inc["rows"]["new"] == [[2], [3], [4]]
    assert inc["status"][db] == header2.last_event_id


def test_partitions_added_and_dropped_between_the_two_partition_reads(
    source: Source, destination: Destination, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's partitions are read twice (their names, then the ones with places of their
    own): a writer adding one at its default place, one at a place of its own, and dropping
    one between the two reads is a table that changed while it was read, re-read, never a
    failed dump (seen in CI as "cannot read a partition's spec")."""
    db = "cons_parts"
    source.sql(f"CREATE DATABASE {db}")
    source.sql(f"CREATE TABLE {db}.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql(f"INSERT INTO {db}.t VALUES (1, 1), (2, 2), (3, 3)")
    own = source.warehouse / f"{db}.db" / "t" / "elsewhere"

    def during() -> None:
        source.sql(f"INSERT INTO {db}.t PARTITION (p=7) VALUES (7)")
        source.sql(f"ALTER TABLE {db}.t ADD PARTITION (p=8) LOCATION '{own}'")
        source.sql(f"INSERT INTO {db}.t PARTITION (p=8) VALUES (8)")
        source.sql(f"ALTER TABLE {db}.t DROP PARTITION (p=2)")

    url, header, queries, want = _dump_with(
        source, monkeypatch, db, "dump.partitions_listed", during)
    assert want["t"] == [[1, 1], [3, 3], [7, 7], [8, 8]]
    (got,) = destination.run({"load": {"dump": url}, "queries": queries, "status": [db],
                              "partitions": [f"{db}.t"], "files": [f"{db}.t"]})
    assert "error" not in got["load"], got["load"]
    assert got["rows"] == want
    assert got["partitions"][f"{db}.t"] == ["p=1", "p=3", "p=7", "p=8"]
    assert got["files"][f"{db}.t"] == source.data_files(db, "t")
    assert got["status"][db] == header.last_event_id

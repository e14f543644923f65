"""Partitions with their own locations (issue 12, locations): a partition the source keeps
away from its default place (`ADD PARTITION ... LOCATION`, `PARTITION (...) SET LOCATION`)
replicates to `<destination warehouse>/_external/<database>/<source path>` when it lies
outside its table's directory, with the source's rows, through bootstraps and incremental
loads, moves, overwrites, drops and re-adds, also after the source rewrote what the dump
names (its files then come from the cmroot). One outside the warehouse roots (where the
hook records nothing) is refused by name, never replicated empty."""

from __future__ import annotations

from typing import Any

import pytest

from cmroot.exceptions import ReplError
from tests.repl.conftest import Destination, Source, files_below

pytestmark = pytest.mark.timeout(900)

_TABLES = ("t", "h")


def _queries(db: str) -> dict[str, str]:
    q = {name: f"SELECT * FROM {db}.{name}" for name in _TABLES}
    for name, p in (("t", 1), ("t", 2), ("h", 1)):
        q[f"{name}{p} at"] = f"SHOW TABLE EXTENDED IN {db} LIKE '{name}' PARTITION (p={p})"
    return q


def _location(step: dict[str, Any], key: str) -> str:
    """The partition's location, from SHOW TABLE EXTENDED's information column."""
    rows = step["rows"][key]
    assert isinstance(rows, list) and len(rows) == 1, rows
    info = dict(line.partition(": ")[::2] for line in str(rows[0][3]).splitlines())
    return info["Location"].removeprefix("file:")


def test_partitions_with_their_own_locations_replicate(
    source: Source, destination: Destination
) -> None:
    start = source.daemon.current()
    own = source.warehouse / "landing" / "plc"
    source.sql("CREATE DATABASE plc")
    source.sql("CREATE TABLE plc.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO plc.t VALUES (1, 1)")
    source.sql(f"ALTER TABLE plc.t ADD PARTITION (p=2) LOCATION '{own}/t2'")
    source.sql("INSERT INTO plc.t PARTITION (p=2) VALUES (2)")
    source.sql("CREATE TABLE plc.h (a INT) PARTITIONED BY (p INT) STORED AS PARQUET")
    source.sql(f"ALTER TABLE plc.h ADD PARTITION (p=1) LOCATION '{own}/h1'")
    source.sql("INSERT INTO plc.h PARTITION (p=1) VALUES (10)")
    source.sql("INSERT INTO plc.h PARTITION (p=2) VALUES (20)")
    then = {n: source.rows(f"SELECT * FROM plc.{n}") for n in _TABLES}
    inc1, h1 = source.dump("plc", from_id=start)
    boot, _ = source.dump("plc")
    # After the dumps: a partition moved to an empty place and written there, an overwrite
    # inside a partition's own location, one dropped and added again elsewhere. The first
    # dumps' files of p=2 and h's p=1 now exist only in the cmroot.
    source.sql(f"ALTER TABLE plc.t PARTITION (p=1) SET LOCATION '{own}/t1'")
    source.sql("INSERT INTO plc.t PARTITION (p=1) VALUES (3)")
    source.sql("INSERT OVERWRITE TABLE plc.h PARTITION (p=1) VALUES (11)")
    source.sql("ALTER TABLE plc.t DROP PARTITION (p=2)")
    source.sql(f"ALTER TABLE plc.t ADD PARTITION (p=2) LOCATION '{own}/t2b'")
    source.sql("INSERT INTO plc.t PARTITION (p=2) VALUES (4)")
    now = {n: source.rows(f"SELECT * FROM plc.{n}") for n in _TABLES}
    inc2, _ = source.dump("plc", from_id=h1.last_event_id)

    first, booted, second = destination.run(
        {"load": {"dump": inc1}, "queries": _queries("plc")},
        {"load": {"dump": boot, "target": "plcb"}, "queries": _queries("plcb")},
        {"load": {"dump": inc2}, "queries": _queries("plc")},
    )
    for step in (first, booted, second):
        assert "error" not in step["load"], step["load"]
    assert then == {"t": [[1, 1], [2, 2]], "h": [[10, 1], [20, 2]]}
    assert now == {"t": [[3, 1], [4, 2]], "h": [[11, 1], [20, 2]]}
    for step, want in ((first, then), (booted, then), (second, now)):
        assert {n: step["rows"][n] for n in _TABLES} == want
    ext = destination.warehouse / "_external"
    assert _location(first, "t2 at") == f"{ext}/plc{own}/t2"
    assert _location(first, "h1 at") == f"{ext}/plc{own}/h1"
    assert _location(booted, "t2 at") == f"{ext}/plcb{own}/t2"
    assert _location(booted, "h1 at") == f"{ext}/plcb{own}/h1"
    assert _location(first, "t1 at").endswith("/plc.db/t/p=1")
    assert _location(second, "t1 at") == f"{ext}/plc{own}/t1"
    assert _location(second, "t2 at") == f"{ext}/plc{own}/t2b"
    # Each place holds what the source's does: the dropped managed partition's files are
    # gone, those at the place a partition moved away from stay (as at the source).
    for name in ("t1", "t2", "t2b", "h1"):
        assert files_below(ext / f"plc{own}" / name) == files_below(own / name), name
    assert not files_below(own / "t2")
    old = source.warehouse / "plc.db" / "t" / "p=1"
    assert files_below(destination.warehouse / "plc.db" / "t" / "p=1") == files_below(old)
    assert files_below(old)


def test_a_partition_outside_the_roots_is_refused(
    source: Source, destination: Destination
) -> None:
    """The hook records nothing outside the warehouse roots: a replica of such a partition
    would stand still. A bootstrap refuses the table, a load the event that adds or moves
    the partition there, each naming it, and nothing of that event is applied."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE plo")
    source.sql("CREATE TABLE plo.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO plo.t VALUES (1, 1)")
    inc1, h1 = source.dump("plo", from_id=start)
    outside = source.base / "outside-the-roots" / "plo_p2"
    source.sql(f"ALTER TABLE plo.t ADD PARTITION (p=2) LOCATION '{outside}'")
    inc2, _ = source.dump("plo", from_id=h1.last_event_id)
    with pytest.raises(ReplError) as e:
        source.dump("plo")
    assert "outside the warehouse roots" in e.value.message and str(outside) in e.value.detail
    q = {"t": "SELECT * FROM plo.t"}
    first, refused = destination.run(
        {"load": {"dump": inc1}, "queries": q, "status": ["plo"], "partitions": ["plo.t"]},
        {"load": {"dump": inc2}, "queries": q, "status": ["plo"], "partitions": ["plo.t"]},
    )
    assert first["rows"]["t"] == [[1, 1]]
    assert refused["load"]["kind"] == "ReplError", refused["load"]
    assert "outside the warehouse roots" in refused["load"]["error"]
    assert "{'p': '2'}" in refused["load"]["detail"]
    assert refused["rows"] == first["rows"] and refused["status"] == first["status"]
    assert refused["partitions"] == first["partitions"] == {"plo.t": ["p=1"]}

"""Review 17: replication of partitions with their own locations (08cb4b0, 79d43cf),
attacked with real dumps of the hooked source, forged copies of them, and the daemon's API.

Invariants: after every load the destination equals the source as of the dump's last
event; a load never deletes data outside its own replica (another table's partitions or
another replica's copies); a damaged or hostile dump gives a ReplError and changes
nothing; the daemon never 5xxs on bad partitionLocations and records nothing on refusal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cmroot.repl import dumpdir
from cmroot.repl.dumpdir import Dump
from tests.repl.conftest import Destination, Source, files_below, load_ok
from tests.server.cmroot_daemon import Daemon

pytestmark = pytest.mark.timeout(900)


# -- helpers ---------------------------------------------------------------------------------


_forged = 0


def _forge(src: Source, url: str, edit: Callable[[Dump], None]) -> str:
    """A copy of the dump at `url`, edited."""
    global _forged
    _forged += 1
    d = dumpdir.read(url)
    edit(d)
    out = str(src.base / "forged" / f"r17-{_forged}")
    dumpdir.write(out, d.header, d.events, d.tables)
    return out


# -- the daemon ------------------------------------------------------------------------------


def test_daemon_refuses_hostile_partition_locations(daemon: Daemon) -> None:
    """POST /v1/events with partitionLocations that escape the roots through `..` (as a
    path and as a file: URL), are empty strings, hold a NUL, are nested lists or objects,
    or outnumber the partitions: each is answered with a 4xx naming the field or the
    problem, never a 5xx, and the daemon's state (warehouse, store, index, API) is
    unchanged."""
    d = daemon
    tdir = d.warehouse / "sales.db" / "orders"
    (tdir / "p=1").mkdir(parents=True)
    escape = f"{d.warehouse}/sales.db/../../outside/p1"
    base = {"eventType": "ADD_PARTITION", "db": "sales", "table": "orders",
            "partitions": [{"p": "1"}], "location": str(tdir)}
    bad: list[Any] = [
        [escape],
        [f"file://{escape}"],
        [""],
        [f"{tdir}/p=1\u0000x"],
        [[str(tdir)]],
        [{"p": str(tdir)}],
        [None, None],
        [str(tdir / "p=1"), str(tdir / "p=1")],
        [None] * 100_001,
    ]
    for places in bad:
        before = d.snapshot()
        r = d.request("POST", "/v1/events", {**base, "partitionLocations": places},
                      scope="write")
        assert 400 <= r.status < 500, (places[:3], r)
        err = r.json()
        assert isinstance(err, dict) and err.get("error"), err
        assert d.snapshot() == before, places[:3]
    assert not d.errors(), d.errors()


# -- loads -----------------------------------------------------------------------------------


def test_dropping_a_partition_keeps_another_tables_partition_inside_it(
    source: Source, destination: Destination
) -> None:
    """Source: external table r17n.e with partition p=1 at its own location X; managed
    table r17n.m with partition p=1 at X/m1 (inside e's partition directory); a row in
    each. Load that. Then the source drops e's partition (external: its files, and m's,
    stay). Load that. Expected: after each load the replica's rows of e and m equal the
    source's; dropping e's partition on the replica never removes m's replica of p=1
    (another table's partition lying inside the dropped directory)."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r17n"
    source.sql("CREATE DATABASE r17n")
    source.sql("CREATE TABLE r17n.e (a INT, p INT) USING parquet PARTITIONED BY (p)"
               f" LOCATION '{own}/e'")
    source.sql(f"ALTER TABLE r17n.e ADD PARTITION (p=1) LOCATION '{own}/x'")
    source.sql("INSERT INTO r17n.e PARTITION (p=1) VALUES (1)")
    source.sql("CREATE TABLE r17n.m (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql(f"ALTER TABLE r17n.m ADD PARTITION (p=1) LOCATION '{own}/x/m1'")
    source.sql("INSERT INTO r17n.m PARTITION (p=1) VALUES (2)")
    source.sql("REFRESH TABLE r17n.e")
    then = {n: source.rows(f"SELECT * FROM r17n.{n}") for n in ("e", "m")}
    inc1, h1 = source.dump("r17n", from_id=start)
    source.sql("ALTER TABLE r17n.e DROP PARTITION (p=1)")
    now = {n: source.rows(f"SELECT * FROM r17n.{n}") for n in ("e", "m")}
    inc2, _ = source.dump("r17n", from_id=h1.last_event_id)
    q = {n: f"SELECT * FROM r17n.{n}" for n in ("e", "m")}
    first, second, refreshed = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}},
        {"sql": ["REFRESH TABLE r17n.e", "REFRESH TABLE r17n.m"], "queries": q},
    )
    load_ok(first)
    load_ok(second)
    second["rows"] = refreshed["rows"]
    m1 = (destination.warehouse / "_external" / "r17n" / str(own / "x" / "m1").lstrip("/"))
    assert files_below(m1), f"the replica of r17n.m's p=1 ({m1}) lost its files"
    assert now["m"] == [[2, 1]], now
    assert first["rows"] == then
    assert second["rows"] == now, (second["rows"], now)


def test_two_table_replicas_of_one_source_table_keep_their_own_partitions(
    source: Source, destination: Destination
) -> None:
    """Source table r17s.t: p=1 at its default place, p=2 at its own location outside the
    table. One bootstrap of r17s.t is loaded twice into one destination database, as
    r17d.a and r17d.b (two replicas of one source table). The source then drops p=2, and
    the incremental dump is loaded into r17d.a only. Expected: r17d.a loses p=2, r17d.b
    (not loaded since) keeps both rows and its copy of p=2's files: a load never deletes
    another replica's data."""
    own = source.warehouse / "landing" / "r17s"
    source.sql("CREATE DATABASE r17s")
    source.sql("CREATE TABLE r17s.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r17s.t VALUES (1, 1)")
    source.sql(f"ALTER TABLE r17s.t ADD PARTITION (p=2) LOCATION '{own}/t2'")
    source.sql("INSERT INTO r17s.t PARTITION (p=2) VALUES (2)")
    boot, h = source.dump("r17s.t")
    source.sql("ALTER TABLE r17s.t DROP PARTITION (p=2)")
    inc, _ = source.dump("r17s.t", from_id=h.last_event_id)
    q = {"a": "SELECT * FROM r17d.a", "b": "SELECT * FROM r17d.b"}
    answers = destination.run(
        {"load": {"dump": boot, "target": "r17d.a"}, "queries": q},
        {"load": {"dump": boot, "target": "r17d.b"}, "queries": q},
        {"load": {"dump": inc, "target": "r17d.a"}, "partitions": ["r17d.a", "r17d.b"]},
        {"sql": ["REFRESH TABLE r17d.a", "REFRESH TABLE r17d.b"], "queries": q},
    )
    # A one-table replica keeps what lies outside its table below `_external/<db>.<table>`.
    held = files_below(destination.warehouse / "_external" / "r17d.b")
    gone = files_below(destination.warehouse / "_external" / "r17d.a")
    one, two, three = answers[:3]
    three["rows"] = answers[-1]["rows"]
    for step in (one, two, three):
        load_ok(step)
    assert two["rows"] == {"a": [[1, 1], [2, 2]], "b": [[1, 1], [2, 2]]}
    assert three["partitions"] == {"r17d.a": ["p=1"], "r17d.b": ["p=1", "p=2"]}
    assert three["rows"]["a"] == [[1, 1]]
    assert held, "r17d.b's copy of p=2 is gone from _external/r17d.b"
    assert not gone, gone
    assert three["rows"]["b"] == [[1, 1], [2, 2]], three["rows"]


def test_forged_partition_locations_are_refused_and_change_nothing(
    source: Source, destination: Destination
) -> None:
    """Source r17f.t: p=1 at its default place, p=2 at its own location; loaded. Then the
    source adds p=3 at its own location and writes a row there; that dump is forged so the
    ADD_PARTITION and INSERT of p=3 say p=3 lies at: the table's own location (a partition
    at the table root), `<table>/../elsewhere`, a relative path, `/`, a path escaping with
    `..`; one variant keeps only the ADD_PARTITION (no files) at the table root.
    Expected: each forged load fails with a ReplError; the replica's rows, partitions and
    the files below its `_external/r17f` and table directories are as before. The
    unforged dump then loads p=3."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r17f"
    source.sql("CREATE DATABASE r17f")
    source.sql("CREATE TABLE r17f.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r17f.t VALUES (1, 1)")
    source.sql(f"ALTER TABLE r17f.t ADD PARTITION (p=2) LOCATION '{own}/t2'")
    source.sql("INSERT INTO r17f.t PARTITION (p=2) VALUES (2)")
    inc1, h1 = source.dump("r17f", from_id=start)
    source.sql(f"ALTER TABLE r17f.t ADD PARTITION (p=3) LOCATION '{own}/t3'")
    source.sql("INSERT INTO r17f.t PARTITION (p=3) VALUES (3)")
    inc2, _ = source.dump("r17f", from_id=h1.last_event_id)
    d2 = dumpdir.read(inc2)
    placed = [e for e in d2.events if e.partition_locations and e.partitions == [{"p": "3"}]]
    assert placed, [(e.type, e.partitions, e.partition_locations) for e in d2.events]
    table_loc = str(next(e.location for e in placed if e.location)).rstrip("/")

    def at(*where: str | None) -> Callable[[Dump], None]:
        def edit(d: Dump) -> None:
            for e in d.events:
                if e.partitions == [{"p": "3"}] and e.partition_locations:
                    e.partition_locations = list(where)
        return edit

    def alone(where: str) -> Callable[[Dump], None]:
        """Only the ADD_PARTITION of p=3 (no files), placed at `where`."""
        def edit(d: Dump) -> None:
            d.events = [e for e in d.events if not (e.partitions == [{"p": "3"}]
                                                    and e.type != "ADD_PARTITION")]
            at(where)(d)
        return edit

    forged = {
        "table root": _forge(source, inc2, at(table_loc)),
        "table root with slash": _forge(source, inc2, at(table_loc + "/")),
        "beside the table": _forge(source, inc2, at(f"{table_loc}/../r17f_x")),
        "relative": _forge(source, inc2, at("landing/r17f/t3")),
        "slash": _forge(source, inc2, at("/")),
        "escaping": _forge(source, inc2, at("/../../../../../../../../../tmp/r17f")),
        # last: once one is accepted, the replica has moved on
        "table root, partition alone": _forge(source, inc2, alone(table_loc)),
    }
    q = {"t": "SELECT * FROM r17f.t",
         "p3 at": "SHOW TABLE EXTENDED IN r17f LIKE 't' PARTITION (p=3)"}
    look = {"queries": q, "partitions": ["r17f.t"]}
    steps = [{"load": {"dump": inc1}, **look}]
    steps += [{"load": {"dump": url}, **look} for url in forged.values()]
    answers = destination.run(*steps)
    ext = destination.warehouse / "_external" / "r17f"
    tdir = destination.warehouse / "r17f.db" / "t"
    held = (files_below(ext), files_below(tdir))
    first, refused = answers[0], dict(zip(forged, answers[1:], strict=True))
    load_ok(first)
    assert first["rows"]["t"] == [[1, 1], [2, 2]]
    wrong = {}
    for name, step in refused.items():
        if step["load"].get("kind") != "ReplError":
            wrong[name] = ("accepted", step["load"], step["rows"], step["partitions"])
        elif step["rows"]["t"] != first["rows"]["t"] or step["partitions"] != first["partitions"]:
            wrong[name] = ("changed", step["rows"], step["partitions"])
    assert (files_below(ext), files_below(tdir)) == held
    assert not wrong, wrong
    last, = destination.run({"load": {"dump": inc2}, **look})
    load_ok(last)
    assert last["rows"]["t"] == [[1, 1], [2, 2], [3, 3]]


def test_dropping_an_outer_partition_leaves_the_replica_equal_to_the_source(
    source: Source, destination: Destination
) -> None:
    """Source r17o.t (Hive format, STORED AS PARQUET): p=1 at its own location X, p=2 at
    X/inner (nested inside p=1's), a row each; p=3 at the table root's `p=3`. Loaded. Then
    the source drops p=1 (the metastore removes X with what it holds) and writes p=2
    again. Expected: after each load the replica's rows and partitions equal the
    source's, whatever the source kept of the nested partition."""
    start = source.daemon.current()
    own = source.warehouse / "landing" / "r17o"
    source.sql("CREATE DATABASE r17o")
    source.sql("CREATE TABLE r17o.t (a INT) PARTITIONED BY (p INT) STORED AS PARQUET")
    source.sql(f"ALTER TABLE r17o.t ADD PARTITION (p=1) LOCATION '{own}/x'")
    source.sql(f"ALTER TABLE r17o.t ADD PARTITION (p=2) LOCATION '{own}/x/inner'")
    source.sql("INSERT INTO r17o.t PARTITION (p=1) VALUES (1)")
    source.sql("INSERT INTO r17o.t PARTITION (p=2) VALUES (2)")
    source.sql("INSERT INTO r17o.t PARTITION (p=3) VALUES (3)")
    then = source.rows("SELECT * FROM r17o.t")
    inc1, h1 = source.dump("r17o", from_id=start)
    source.sql("ALTER TABLE r17o.t DROP PARTITION (p=1)")
    source.sql("REFRESH TABLE r17o.t")
    mid = source.rows("SELECT * FROM r17o.t")
    inc2, h2 = source.dump("r17o", from_id=h1.last_event_id)
    source.sql("INSERT INTO r17o.t PARTITION (p=2) VALUES (4)")
    now = source.rows("SELECT * FROM r17o.t")
    inc3, _ = source.dump("r17o", from_id=h2.last_event_id)
    q = {"t": "SELECT * FROM r17o.t"}
    answers = destination.run(
        {"load": {"dump": inc1}, "queries": q},
        {"load": {"dump": inc2}, "queries": q},
        {"load": {"dump": inc3}, "queries": q},
    )
    for step in answers:
        load_ok(step)
    assert [s["rows"]["t"] for s in answers] == [then, mid, now]

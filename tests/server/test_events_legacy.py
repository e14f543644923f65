"""Events an older version (or a hand-edited index) left with a `tableObj` today's
requests refuse: 60 MiB of JSON, nested 975 or 100,000 levels deep, or not an object.
Through the real daemon over a real index file: every page of GET /v1/events answers 200
within the page cap, such an event comes with a small `{"_cmroot": "tableObj omitted: ..."}`
marker in place of its tableObj and everything else intact, the events around it are
untouched, and the client pages past it (replication does not stall). The largest
tableObj a request may store is still served whole."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cmroot.index.events import PAGE_BYTES
from tests.server.cmroot_daemon import MakeDaemon

pytestmark = pytest.mark.timeout(300)

HUGE = 60 << 20


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _insert(index: Path, table: str, meta: str, files: list[dict[str, Any]]) -> int:
    """An event row written straight into the index, as an older daemon stored it."""
    con = sqlite3.connect(index, timeout=30)
    try:
        with con:
            cur = con.execute(
                "INSERT INTO events (type, db, tbl, partitions, timestamp, server, purge, files,"
                " meta) VALUES ('CREATE_TABLE', 'db', ?, '[]', 1700000000.0, 'old', 0, '[]', ?)",
                (table, meta),
            )
            event_id = cur.lastrowid
            assert event_id is not None
            con.executemany(
                "INSERT INTO event_files (event_id, seq, path, checksum, size)"
                " VALUES (?, ?, ?, ?, ?)",
                [(event_id, i, f["path"], f["checksum"], f["size"]) for i, f in enumerate(files)],
            )
    finally:
        con.close()
    return event_id


def test_old_events_with_an_oversized_table_obj_page(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    c = d.client("admin")
    loc = str(d.warehouse / "db.db")
    small = {"db": "db", "table": "small", "columns": [{"name": "x", "type": "int"}]}
    first = c.add_event("CREATE_TABLE", db="db", table="small", location=f"{loc}/small",
                        tableObj=small)
    assert d.stop() == 0, d.log()

    index = d.store / "index.sqlite"
    legacy: dict[int, tuple[str, list[dict[str, Any]]]] = {}
    for n, (table, table_json) in enumerate(
        [
            ("huge", json.dumps({"db": "db", "table": "huge", "blob": "x" * HUGE})),
            ("deep", '{"db": "db", "table": "deep", "n": ' + _deep(975) + "}"),
            ("deeper", '{"n": ' + _deep(100_000) + "}"),
            ("listed", "[1, 2, 3]"),
        ]
    ):
        files = [
            {"path": f"{loc}/{table}/part-{i}", "checksum": f"{n:016x}{i:016x}", "size": i}
            for i in range(3)
        ]
        # The form the index writes: json.dumps({"location", "tableObj"}).
        meta = f'{{"location": {json.dumps(f"{loc}/{table}")}, "tableObj": {table_json}}}'
        legacy[_insert(index, table, meta, files)] = (table, files)

    d.start()
    c = d.client("admin")  # the old one's keep-alive connection died with the daemon
    last = c.add_event("CREATE_TABLE", db="db", table="later", location=f"{loc}/later",
                       tableObj={**small, "table": "later"})

    # Every page that can hold one of them, from every start: 200, within the cap.
    seen: dict[int, dict[str, Any]] = {}
    for start in range(first, last + 1):
        for limit in (1, 100):
            r = d.request("GET", f"/v1/events?from={start}&limit={limit}")
            assert r.status == 200, r
            assert len(r.body) <= PAGE_BYTES, len(r.body)
            for e in r.json()["events"]:
                seen.setdefault(e["id"], e)
    assert sorted(seen) == list(range(first, last + 1))

    # The marker keeps the names of a definition it can read them from without building it.
    names = {"huge": {"db": "db", "table": "huge"}, "deep": {"db": "db", "table": "deep"},
             "deeper": {}, "listed": {}}
    for event_id, (table, files) in legacy.items():
        e = seen[event_id]
        marker = e["tableObj"]
        assert {k: v for k, v in marker.items() if k != "_cmroot"} == names[table], marker
        assert marker["_cmroot"].startswith("tableObj omitted"), marker
        assert len(json.dumps(marker)) < 300, marker
        assert (e["eventType"], e["db"], e["table"]) == ("CREATE_TABLE", "db", table)
        assert e["location"] == f"{loc}/{table}"
        assert e["files"] == files
    assert "bytes" in seen[next(iter(legacy))]["tableObj"]["_cmroot"]
    assert seen[first]["tableObj"] == small
    assert seen[last]["tableObj"] == {**small, "table": "later"}

    # What a replication dump reads: every event, in order, through the client.
    events = c.events(first, 100)
    assert [e["id"] for e in events] == list(range(first, last + 1))
    assert all(e == seen[e["id"]] for e in events)
    assert d.errors() == [], d.log()


def test_a_table_obj_at_the_request_limit_is_served_whole(make_daemon: MakeDaemon) -> None:
    """The largest tableObj a request may carry (1 MiB of UTF-8, here of 4-byte characters
    that the index stores escaped, three times as long) is served as it was given."""
    d = make_daemon()
    table_obj = {"db": "db", "table": "wide", "comment": "\U0001f600" * ((1 << 20) // 4 - 64)}
    body = {"eventType": "CREATE_TABLE", "db": "db", "table": "wide", "tableObj": table_obj}
    r = d.request("POST", "/v1/events", raw=json.dumps(body, ensure_ascii=False).encode())
    assert r.status == 200, r
    page = d.request("GET", f"/v1/events?from={r.json()['id']}&limit=1")
    assert page.status == 200, page
    assert page.json()["events"][0]["tableObj"] == table_obj
    assert d.errors() == [], d.log()


def test_a_rename_with_an_omitted_table_obj_is_still_a_rename(make_daemon: MakeDaemon) -> None:
    """A rename stored by an older daemon with a tableObj over today's limits: the marker
    served in its place keeps the new name and location, so the rename is recognised (a
    database scope takes a table renamed into it) and resolve follows it to the files."""
    from cmroot import checksum as cks
    from cmroot.repl import dumpdir

    d = make_daemon()
    old, new = d.warehouse / "db.db" / "t", d.warehouse / "db2.db" / "t2"
    new.mkdir(parents=True)
    (new / "part-0").write_bytes(b"renamed bytes")
    assert d.stop() == 0, d.log()
    table_json = json.dumps({"db": "db2", "table": "t2", "location": str(new),
                             "blob": "x" * HUGE})
    meta = f'{{"location": {json.dumps(str(old))}, "tableObj": {table_json}}}'
    con = sqlite3.connect(d.store / "index.sqlite", timeout=30)
    try:
        with con:
            event_id = con.execute(
                "INSERT INTO events (type, db, tbl, partitions, timestamp, server, purge, files,"
                " meta) VALUES ('ALTER_TABLE', 'db', 't', '[]', 1700000000.0, 'old', 0, '[]', ?)",
                (meta,),
            ).lastrowid
    finally:
        con.close()
    d.start()
    c = d.client("admin")
    [e] = c.events(event_id, 1)
    assert e["tableObj"]["_cmroot"].startswith("tableObj omitted"), e["tableObj"]
    assert dumpdir.renamed(e) == (("db", "t"), ("db2", "t2"))
    [scoped] = [ok for _, ok in dumpdir.in_scope([e], "db2", None)]
    assert scoped
    [answer] = c.resolve([{"path": str(old / "part-0"),
                           "checksum": cks.of_bytes(b"renamed bytes")}]).files
    assert (answer.status, answer.location) == ("original", str(new / "part-0")), answer
    assert d.errors() == [], d.log()

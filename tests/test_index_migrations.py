"""An index written by the release before schema versioning (user_version 0) opens with
this one and keeps everything: events with their files in order, entries, objects, the
running totals, a pending transaction. The old files are built by hand with that release's
schema (`SCHEMA` of cmroot/index.py before the split into a package), one without the
`meta` column (before it was added) and one with it, and one from the very first release
(no `stats` table). A newer schema is refused naming the fix; two processes opening an old
index at once migrate it once."""

from __future__ import annotations

import json
import multiprocessing
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cmroot.exceptions import ConfigError
from cmroot.index import Event, Index
from cmroot.index.schema import VERSION

pytestmark = pytest.mark.timeout(120)

# The schema of the last unversioned release, verbatim (it created what was missing with
# IF NOT EXISTS on every open and never set user_version).
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    checksum TEXT PRIMARY KEY,
    size     INTEGER NOT NULL,
    created  REAL NOT NULL,
    expires  REAL NOT NULL,
    keep     INTEGER NOT NULL      -- 1 if any entry was not purged: trash it at expiry
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS objects_expires ON objects(expires);
CREATE INDEX IF NOT EXISTS objects_created ON objects(created);

-- Running totals kept by triggers, so a metrics scrape costs O(1), not a scan.
CREATE TABLE IF NOT EXISTS stats (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    objects INTEGER NOT NULL,
    bytes   INTEGER NOT NULL
);
INSERT OR IGNORE INTO stats VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS objects_insert AFTER INSERT ON objects BEGIN
    UPDATE stats SET objects = objects + 1, bytes = bytes + NEW.size WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS objects_delete AFTER DELETE ON objects BEGIN
    UPDATE stats SET objects = objects - 1, bytes = bytes - OLD.size WHERE id = 1;
END;

CREATE TABLE IF NOT EXISTS entries (
    id         INTEGER PRIMARY KEY,
    path       TEXT NOT NULL,
    checksum   TEXT NOT NULL,
    size       INTEGER NOT NULL,
    recycled   REAL NOT NULL,
    expires    REAL NOT NULL,
    op         TEXT NOT NULL,
    db         TEXT,
    tbl        TEXT,
    partition  TEXT,
    purge      INTEGER NOT NULL,
    event_id   INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_path ON entries(path, checksum);
CREATE INDEX IF NOT EXISTS entries_checksum ON entries(checksum);
CREATE INDEX IF NOT EXISTS entries_table ON entries(db, tbl, id);

CREATE TABLE IF NOT EXISTS events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    type       TEXT NOT NULL,
    db         TEXT,
    tbl        TEXT,
    partitions TEXT NOT NULL,
    timestamp  REAL NOT NULL,
    server     TEXT NOT NULL,
    purge      INTEGER NOT NULL,
    files      TEXT NOT NULL,
    meta       TEXT            -- JSON {"location", "tableObj"}, or NULL
);

CREATE TABLE IF NOT EXISTS txs (
    txid    TEXT PRIMARY KEY,
    started REAL NOT NULL,
    mode    TEXT NOT NULL,
    request TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS journal (
    txid     TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    source   TEXT NOT NULL,
    staged   TEXT NOT NULL,
    PRIMARY KEY (txid, seq)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS checksums (
    path     TEXT PRIMARY KEY,
    size     INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    checksum TEXT NOT NULL
) WITHOUT ROWID;
"""
# Before events carried location/tableObj.
OLD_SCHEMA_NO_META = re.sub(
    r"files      TEXT NOT NULL,\n\s*meta [^\n]*", "files TEXT NOT NULL", OLD_SCHEMA
)
assert "meta" not in OLD_SCHEMA_NO_META and "meta " in OLD_SCHEMA
# The first release: no running totals, no index on creation time.
FIRST_SCHEMA = (
    OLD_SCHEMA_NO_META[: OLD_SCHEMA_NO_META.index("CREATE INDEX IF NOT EXISTS objects_created")]
    + (OLD_SCHEMA_NO_META[OLD_SCHEMA_NO_META.index("CREATE TABLE IF NOT EXISTS entries") :])
)

A, B, C = "a" * 32, "b" * 32, "c" * 32


def _files(n: int, prefix: str) -> list[dict[str, Any]]:
    return [
        {"path": f"/wh/{prefix}/part-{i:05d}", "checksum": f"{i:032x}", "size": i * 10}
        for i in range(n)
    ]


# (type, db, table, partitions, timestamp, server, purge, files, meta)
EVENTS: list[tuple[Any, ...]] = [
    (
        "CREATE_TABLE",
        "sales",
        "orders",
        [],
        100.0,
        "hms1",
        0,
        [],
        {"location": "/wh/sales.db/orders", "tableObj": {"table": "orders"}},
    ),
    (
        "DROP_PARTITION",
        "sales",
        "orders",
        [{"p": "1"}],
        101.0,
        "hms1",
        1,
        # out of lexical order on purpose: the order of the array is the order kept
        [
            {"path": "/wh/sales.db/orders/p=1/z", "checksum": A, "size": 3},
            {"path": "/wh/sales.db/orders/p=1/a", "checksum": B, "size": 5},
        ],
        None,
    ),
    (
        "INSERT",
        "sales",
        "orders",
        [{"p": "2"}],
        102.0,
        "hms1",
        0,
        _files(250, "sales.db/orders/p=2"),
        None,
    ),
    (
        "DROP_TABLE",
        "sales",
        "old",
        [],
        103.0,
        "hms2",
        0,
        [{"path": "/wh/sales.db/old/x", "checksum": C, "size": 7}],
        {"location": None, "tableObj": None},
    ),
]
OBJECTS = [(A, 3, 101.0, 9e9, 0), (B, 5, 101.0, 9e9, 1), (C, 7, 103.0, 50.0, 1)]
ENTRIES = [
    (
        "/wh/sales.db/orders/p=1/z",
        A,
        3,
        101.0,
        9e9,
        "DROP_PARTITION",
        "sales",
        "orders",
        '{"p": "1"}',
        1,
        2,
    ),
    (
        "/wh/sales.db/orders/p=1/a",
        B,
        5,
        101.0,
        9e9,
        "DROP_PARTITION",
        "sales",
        "orders",
        '{"p": "1"}',
        1,
        2,
    ),
    ("/wh/sales.db/old/x", C, 7, 103.0, 50.0, "DROP_TABLE", "sales", "old", None, 0, 4),
    ("/wh/displaced", C, 7, 104.0, 50.0, "DELETE", None, None, None, 0, 0),
]
REQUEST = {
    "paths": ["/wh/sales.db/t"],
    "mode": "move",
    "op": "TRUNCATE",
    "db": "sales",
    "table": "t",
}


def build_old(
    path: Path, schema: str = OLD_SCHEMA, meta: bool = True, events: list[tuple[Any, ...]] = EVENTS
) -> None:
    """An index as the old release left it, with a transaction still in its journal."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(schema)
    db.execute("BEGIN")
    for typ, d, t, parts, ts, server, purge, files, m in events:
        cols = "type, db, tbl, partitions, timestamp, server, purge, files"
        args = [typ, d, t, json.dumps(parts), ts, server, purge, json.dumps(files)]
        if meta:
            cols += ", meta"
            args.append(json.dumps(m) if m is not None else None)
        db.execute(f"INSERT INTO events ({cols}) VALUES ({', '.join('?' * len(args))})", args)
    db.executemany("INSERT INTO objects VALUES (?, ?, ?, ?, ?)", OBJECTS)
    db.executemany(
        "INSERT INTO entries (path, checksum, size, recycled, expires, op, db, tbl, partition,"
        " purge, event_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ENTRIES,
    )
    db.execute("INSERT INTO txs VALUES ('tx-move', 200.0, 'move', ?)", (json.dumps(REQUEST),))
    db.execute(
        "INSERT INTO txs VALUES ('tx-copy', 201.0, 'copy', ?)",
        (json.dumps({**REQUEST, "mode": "copy"}),),
    )
    db.executemany(
        "INSERT INTO journal VALUES (?, ?, ?, ?)",
        [
            ("tx-move", 0, "/wh/sales.db/t/f0", "/st/staging/tx-move/0"),
            ("tx-move", 1, "/wh/sales.db/t/f1", "/st/staging/tx-move/1"),
            ("tx-move", 2, "s3://bucket/wh/sales.db/t/f2", "/st/staging/tx-move/2"),
            ("tx-copy", 0, "/wh/sales.db/t/f3", "/st/staging/tx-copy/0"),
        ],
    )
    db.executemany(
        "INSERT INTO checksums VALUES (?, ?, ?, ?)",
        [("/wh/sales.db/t/f0", 10, 123, A), ("/wh/sales.db/t/f1", 11, 124, B)],
    )
    db.execute("COMMIT")
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    db.close()


def expected_events(meta: bool) -> list[dict[str, Any]]:
    out = []
    for i, (typ, d, t, parts, ts, server, purge, files, m) in enumerate(EVENTS, start=1):
        m = (m or {}) if meta else {}
        out.append(
            {
                "id": i,
                "eventType": typ,
                "db": d,
                "table": t,
                "partitions": parts,
                "timestamp": ts,
                "server": server,
                "purge": bool(purge),
                "files": files,
                "location": m.get("location"),
                "tableObj": m.get("tableObj"),
            }
        )
    return out


def dump(path: Path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return [*db.iterdump(), f"user_version={db.execute('PRAGMA user_version').fetchone()[0]}"]
    finally:
        db.close()


def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


@pytest.mark.parametrize("meta", [True, False], ids=["with-meta", "before-meta"])
def test_an_old_index_opens_and_keeps_everything(tmp_path: Path, meta: bool) -> None:
    path = tmp_path / "index.db"
    build_old(path, OLD_SCHEMA if meta else OLD_SCHEMA_NO_META, meta)
    index = Index(str(path))
    try:
        assert user_version(path) == VERSION == 8
        assert len(index.log_id()) == 32  # the event log gains its identity
        # Events: every one, in id order, each with its files in their recorded order.
        assert [e.to_json() for e in index.events(0, 100)] == expected_events(meta)
        assert index.current_event_id() == len(EVENTS)
        assert (
            index.event_files(3, after=99, limit=2) == _files(250, "sales.db/orders/p=2")[100:102]
        )
        # Entries (newest first), objects and the running totals.
        entries = index.entries(limit=100)
        assert [
            (e.path, e.checksum, e.size, e.op, e.db, e.table, e.partition, e.purge, e.event_id)
            for e in entries
        ] == [
            (p, c, s, op, d, t, json.loads(part) if part else None, bool(purge), ev)
            for p, c, s, _, _, op, d, t, part, purge, ev in reversed(ENTRIES)
        ]
        for checksum, size, created, expires, keep in OBJECTS:
            o = index.get_object(checksum)
            assert o is not None and (o.size, o.created, o.expires, o.keep) == (
                size,
                created,
                expires,
                bool(keep),
            )
        assert index.stats() == (3, 15, 101.0)
        assert [o.checksum for o in index.expired(60.0, 10)] == [C]
        # The pending transactions, with how each file was staged.
        pending = {p.txid: p for p in index.pending()}
        assert set(pending) == {"tx-move", "tx-copy"}
        move = pending["tx-move"]
        assert (move.mode, move.request, move.state, move.error, move.dirs) == (
            "move",
            REQUEST,
            "open",
            None,
            [],
        )
        assert [(r.seq, r.source, r.staged, r.method) for r in move.rows] == [
            (0, "/wh/sales.db/t/f0", "/st/staging/tx-move/0", "rename"),
            (1, "/wh/sales.db/t/f1", "/st/staging/tx-move/1", "rename"),
            # the old release renamed only local sources: a remote one was copied
            (2, "s3://bucket/wh/sales.db/t/f2", "/st/staging/tx-move/2", "copy"),
        ]
        assert [r.method for r in pending["tx-copy"].rows] == ["copy"]
        # The checksum cache is only a cache: re-keyed by identity, it starts empty and works.
        assert index.cached_checksums([("/wh/sales.db/t/f0", "10:123")]) == {}
        index.cache_checksums([("/wh/sales.db/t/f0", "ident", A)])
        assert index.cached_checksums([("/wh/sales.db/t/f0", "ident")]) == {"/wh/sales.db/t/f0": A}
        # New events go on from the old ids (the old `files` column is NOT NULL, no default).
        new = index.add_event(
            Event(0, "INSERT", "sales", "orders", [], 300.0, "hms1", False, _files(2, "n"))
        )
        assert new == len(EVENTS) + 1
        assert index.events(new, 1)[0].files == _files(2, "n")
    finally:
        index.close()
    # Reopening is a no-op.
    before = dump(path)
    Index(str(path)).close()
    assert dump(path) == before


def test_an_index_of_the_first_release_gets_its_running_totals(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    build_old(path, FIRST_SCHEMA, meta=False)
    index = Index(str(path))
    try:
        assert index.stats() == (3, 15, 101.0)
        index.forget([C])
        assert index.stats() == (2, 8, 101.0)  # kept from now on
        assert [e.to_json() for e in index.events(0, 100)] == expected_events(False)
    finally:
        index.close()


def test_totals_an_older_release_started_from_zero_are_recounted(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    build_old(path)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE stats SET objects = 0, bytes = 0")  # stats added over existing objects
    db.close()
    index = Index(str(path))
    try:
        assert index.stats() == (3, 15, 101.0)
    finally:
        index.close()


def test_a_fresh_index_is_at_the_current_version_and_reopens_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    Index(str(path)).close()
    assert user_version(path) == VERSION
    before = dump(path)
    Index(str(path)).close()
    assert dump(path) == before


def test_a_newer_index_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    Index(str(path)).close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(f"PRAGMA user_version = {VERSION + 1}")
    db.close()
    before = dump(path)
    with pytest.raises(ConfigError) as e:
        Index(str(path))
    text = str(e.value)
    assert "newer cmroot" in text and str(path) in text and "Upgrade cmroot" in text
    assert f"version {VERSION + 1}" in text
    assert dump(path) == before


def _open(path: str, go: Any, out: Any) -> None:  # pragma: no cover - runs in a child
    go.wait()
    try:
        Index(path).close()
        out.put("ok")
    except BaseException as e:
        out.put(f"{type(e).__name__}: {e}")


def test_two_processes_opening_an_old_index_migrate_it_once(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    # Enough files that the migration takes a while, so both really open it together.
    big = [
        *EVENTS,
        *[
            ("INSERT", "sales", "big", [], 200.0 + i, "hms1", 0, _files(2000, f"big{i}"), None)
            for i in range(20)
        ],
    ]
    build_old(path, events=big)
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_open, args=(str(path), go, out)) for _ in range(2)]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert results == ["ok", "ok"]
    assert user_version(path) == VERSION
    db = sqlite3.connect(path)
    try:
        assert (
            db.execute("SELECT count(*) FROM event_files").fetchone()[0] == 2 + 250 + 1 + 20 * 2000
        )
        assert db.execute("SELECT count(*) FROM events").fetchone()[0] == len(big)
    finally:
        db.close()
    index = Index(str(path))
    try:
        assert [e.to_json() for e in index.events(0, len(EVENTS))] == expected_events(True)
        assert index.event_files(len(EVENTS) + 20)[-1] == _files(2000, "big19")[-1]
    finally:
        index.close()


def test_a_migrated_index_has_the_fresh_columns(tmp_path: Path) -> None:
    """Every table a fresh index has, an upgraded one has, with the same columns (a
    migration that forgot one would fail only when that column is first used)."""
    old, fresh = tmp_path / "old.db", tmp_path / "fresh.db"
    build_old(old, OLD_SCHEMA, True)
    Index(str(old)).close()
    Index(str(fresh)).close()

    def columns(path: Path) -> dict[str, set[str]]:
        db = sqlite3.connect(path)
        try:
            tables = [r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")]
            return {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")} for t in tables}
        finally:
            db.close()

    got, want = columns(old), columns(fresh)
    assert {t: got.get(t) for t in want} == want

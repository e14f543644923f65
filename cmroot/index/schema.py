"""The index's schema and its migrations, versioned by `PRAGMA user_version`.

A new index is created at the current version in one go. An existing one is brought up
step by step, each step in its own transaction that also bumps the version, so a store
written by any earlier release opens (and a crash mid-migration resumes cleanly).
Version 0 is every store from before versioning."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from cmroot.exceptions import ConfigError

VERSION = 8

SCHEMA = """
CREATE TABLE objects (
    checksum TEXT PRIMARY KEY,
    size     INTEGER NOT NULL,
    created  REAL NOT NULL,
    expires  REAL NOT NULL,
    keep     INTEGER NOT NULL,     -- 1 if any entry was not purged: trash it at expiry
    last     REAL NOT NULL         -- its newest entry's recycle time (the budget's age)
) WITHOUT ROWID;
CREATE INDEX objects_expires ON objects(expires);
CREATE INDEX objects_created ON objects(created);
CREATE INDEX objects_last ON objects(last);

-- Running totals, so a metrics scrape costs O(1), not a scan. Deletes keep them by
-- trigger; inserts (catalog.py) add once per transaction: a trigger per inserted row
-- was 60% of the cost of recording a recycle's objects.
CREATE TABLE stats (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    objects INTEGER NOT NULL,
    bytes   INTEGER NOT NULL
);
INSERT INTO stats VALUES (1, 0, 0);
CREATE TRIGGER objects_delete AFTER DELETE ON objects BEGIN
    UPDATE stats SET objects = objects - 1, bytes = bytes - OLD.size WHERE id = 1;
END;

-- One recycle of one file. event_id 0: kept without an event (a displaced file: its
-- source path was re-created while a failed recycle had it away).
CREATE TABLE entries (
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
CREATE INDEX entries_path ON entries(path, checksum);
CREATE INDEX entries_checksum ON entries(checksum);
CREATE INDEX entries_table ON entries(db, tbl, id);

CREATE TABLE events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    type       TEXT NOT NULL,
    db         TEXT,
    tbl        TEXT,
    partitions TEXT NOT NULL,
    timestamp  REAL NOT NULL,
    server     TEXT NOT NULL,
    purge      INTEGER NOT NULL,
    files      TEXT NOT NULL DEFAULT '[]',  -- unused since version 2: see event_files
    meta       TEXT,           -- JSON {"location", "tableObj"}, or NULL
    txid       TEXT,           -- the recycle transaction that recorded it, or NULL
    audit      TEXT            -- JSON: who and what asked for it (cmroot.audit), or NULL
);
-- A commit retried after its answer was lost finds the event it made.
CREATE UNIQUE INDEX events_txid ON events(txid) WHERE txid IS NOT NULL;
-- The files of an event, one row each: a million-file drop is a million small rows that
-- can be paged, not one huge JSON value.
CREATE TABLE event_files (
    event_id INTEGER NOT NULL,
    seq      INTEGER NOT NULL,
    path     TEXT NOT NULL,
    checksum TEXT NOT NULL,
    size     INTEGER NOT NULL,
    PRIMARY KEY (event_id, seq)
) WITHOUT ROWID;

-- Facts about this index itself. `log_id`: the identity of its event log, random at
-- creation; event ids mean something only within one log, so a replica records it and
-- refuses dumps of another.
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
INSERT INTO settings VALUES ('log_id', lower(hex(randomblob(16))));

-- Holds: everything recycled from a database (tbl NULL) or one table is kept past its
-- expiry until `until`. Names are kept lowercase, as the metastore keeps them.
CREATE TABLE holds (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    db      TEXT NOT NULL,
    tbl     TEXT,
    created REAL NOT NULL,
    until   REAL NOT NULL,
    reason  TEXT NOT NULL,
    -- JSON list of path prefixes (the table's directories under each warehouse root): an
    -- entry recycled with no names (a file system hook's) is held by where it was.
    paths   TEXT NOT NULL DEFAULT '[]'
);

-- The recycle journal: a transaction and, per file, where it is staged and how.
CREATE TABLE txs (
    txid    TEXT PRIMARY KEY,
    started REAL NOT NULL,
    mode    TEXT NOT NULL,
    request TEXT NOT NULL,
    state   TEXT NOT NULL DEFAULT 'open',   -- vocab.TxState
    error   TEXT,                           -- why a quarantined transaction is stuck
    dirs    TEXT NOT NULL DEFAULT '[]',     -- directories whose emptied parts go at clean-up
    lease   REAL            -- a prepared transaction is rolled back once this has passed
) WITHOUT ROWID;
CREATE TABLE journal (
    txid     TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    source   TEXT NOT NULL,
    staged   TEXT NOT NULL,
    method   TEXT NOT NULL DEFAULT 'rename',  -- vocab.Method, written before the file moves
    ident    TEXT,        -- a copied source's identity: removed at clean-up only if unchanged
    checksum TEXT,        -- of the staged bytes, once hashed (a prepared transaction)
    size     INTEGER,
    PRIMARY KEY (txid, seq)
) WITHOUT ROWID;

-- Checksums of originals, keyed by an identity a writer cannot forge (see cache.py).
-- Rowids follow write order: the oldest rows are evicted first when the cache is full.
CREATE TABLE checksums (
    id       INTEGER PRIMARY KEY,
    path     TEXT NOT NULL UNIQUE,
    ident    TEXT NOT NULL,
    checksum TEXT NOT NULL
);
"""


# The layout of every unversioned release (version 0), as the last of them created it on
# each open with IF NOT EXISTS. An index from an earlier one may lack some of it (the first
# release had no `stats`), so version 1 starts by creating whatever is missing.
_V0_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (checksum TEXT PRIMARY KEY, size INTEGER NOT NULL,
    created REAL NOT NULL, expires REAL NOT NULL, keep INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS objects_expires ON objects(expires);
CREATE INDEX IF NOT EXISTS objects_created ON objects(created);
CREATE TABLE IF NOT EXISTS stats (id INTEGER PRIMARY KEY CHECK (id = 1),
    objects INTEGER NOT NULL, bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO stats VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS objects_insert AFTER INSERT ON objects BEGIN
    UPDATE stats SET objects = objects + 1, bytes = bytes + NEW.size WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS objects_delete AFTER DELETE ON objects BEGIN
    UPDATE stats SET objects = objects - 1, bytes = bytes - OLD.size WHERE id = 1;
END;
CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY, path TEXT NOT NULL,
    checksum TEXT NOT NULL, size INTEGER NOT NULL, recycled REAL NOT NULL,
    expires REAL NOT NULL, op TEXT NOT NULL, db TEXT, tbl TEXT, partition TEXT,
    purge INTEGER NOT NULL, event_id INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS entries_path ON entries(path, checksum);
CREATE INDEX IF NOT EXISTS entries_checksum ON entries(checksum);
CREATE INDEX IF NOT EXISTS entries_table ON entries(db, tbl, id);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, type TEXT NOT NULL,
    db TEXT, tbl TEXT, partitions TEXT NOT NULL, timestamp REAL NOT NULL,
    server TEXT NOT NULL, purge INTEGER NOT NULL, files TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS txs (txid TEXT PRIMARY KEY, started REAL NOT NULL,
    mode TEXT NOT NULL, request TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS journal (txid TEXT NOT NULL, seq INTEGER NOT NULL,
    source TEXT NOT NULL, staged TEXT NOT NULL, PRIMARY KEY (txid, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checksums (path TEXT PRIMARY KEY, size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, checksum TEXT NOT NULL) WITHOUT ROWID;
"""


def _v1(db: sqlite3.Connection) -> None:
    """The whole version-0 layout (whatever an older release lacked is created); events
    gain `meta` (location, tableObj). The running totals are recounted from `objects`:
    a release that added `stats` to an existing store started it at zero."""
    for statement in _statements(_V0_SCHEMA):
        db.execute(statement)
    if "meta" not in _columns(db, "events"):
        db.execute("ALTER TABLE events ADD COLUMN meta TEXT")
    db.execute(
        "UPDATE stats SET objects = (SELECT count(*) FROM objects),"
        " bytes = (SELECT coalesce(sum(size), 0) FROM objects) WHERE id = 1"
    )


def _v2(db: sqlite3.Connection) -> None:
    """Event files move to their own table; the journal records how each file is staged
    and transaction states; the checksum cache is re-keyed by identity (emptied: it is
    only a cache)."""
    db.execute(
        "CREATE TABLE event_files (event_id INTEGER NOT NULL, seq INTEGER NOT NULL,"
        " path TEXT NOT NULL, checksum TEXT NOT NULL, size INTEGER NOT NULL,"
        " PRIMARY KEY (event_id, seq)) WITHOUT ROWID"
    )
    # Every file is kept, in order (its array index is its seq); a malformed one from
    # some old release is kept as well as it can be rather than refusing to open.
    db.execute(
        "INSERT INTO event_files SELECT e.id, f.key,"
        " coalesce(json_extract(f.value, '$.path'), ''),"
        " coalesce(json_extract(f.value, '$.checksum'), ''),"
        " coalesce(json_extract(f.value, '$.size'), 0)"
        " FROM events e, json_each(CASE WHEN NOT json_valid(e.files) THEN '[]'"
        " WHEN json_type(e.files) = 'array' THEN e.files ELSE '[]' END) f"
        " WHERE f.type = 'object'"
    )
    db.execute("UPDATE events SET files = '[]'")
    db.execute("ALTER TABLE txs ADD COLUMN state TEXT NOT NULL DEFAULT 'open'")
    db.execute("ALTER TABLE txs ADD COLUMN error TEXT")
    db.execute("ALTER TABLE txs ADD COLUMN dirs TEXT NOT NULL DEFAULT '[]'")
    db.execute("ALTER TABLE journal ADD COLUMN method TEXT NOT NULL DEFAULT 'rename'")
    db.execute("ALTER TABLE journal ADD COLUMN ident TEXT")
    # A copy-mode transaction left open by an older release staged copies, never renames;
    # so did a move from a remote warehouse (it renamed only local sources). A local move
    # stays 'rename' even if it crossed filesystems (then it was copied): the index cannot
    # tell, and 'rename' is the safe guess, since recovery puts the file back unless the
    # source is there with the same bytes, whereas 'copy' would drop a staged file whose
    # source is gone.
    db.execute(
        "UPDATE journal SET method = 'copy'"
        " WHERE txid IN (SELECT txid FROM txs WHERE mode = 'copy')"
        " OR (source LIKE '%://%' AND source NOT LIKE 'file://%')"
    )
    db.execute("DROP TABLE IF EXISTS checksums")
    db.execute(
        "CREATE TABLE checksums (id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE,"
        " ident TEXT NOT NULL, checksum TEXT NOT NULL)"
    )


def _v3(db: sqlite3.Connection) -> None:
    """Two-phase recycles: a prepared transaction's lease, and the checksum and size of
    each staged file, so a commit after a restart needs no second hash."""
    db.execute("ALTER TABLE txs ADD COLUMN lease REAL")
    db.execute("ALTER TABLE journal ADD COLUMN checksum TEXT")
    db.execute("ALTER TABLE journal ADD COLUMN size INTEGER")


def _v4(db: sqlite3.Connection) -> None:
    """The transaction of each recycle event, so a commit retried after its answer was
    lost is answered with the event it made (events recorded before have none)."""
    db.execute("ALTER TABLE events ADD COLUMN txid TEXT")
    db.execute("CREATE UNIQUE INDEX events_txid ON events(txid) WHERE txid IS NOT NULL")


def _v5(db: sqlite3.Connection) -> None:
    """The event log's identity (see SCHEMA's `settings`)."""
    db.execute("CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID")
    db.execute("INSERT INTO settings VALUES ('log_id', lower(hex(randomblob(16))))")


def _v6(db: sqlite3.Connection) -> None:
    """Holds, and each object's newest recycle time (the capacity guard evicts the
    oldest first), taken from its entries. Each part only if missing (an index whose
    version was set back by hand has them)."""
    db.execute(
        "CREATE TABLE IF NOT EXISTS holds (id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " db TEXT NOT NULL, tbl TEXT, created REAL NOT NULL, until REAL NOT NULL,"
        " reason TEXT NOT NULL)"
    )
    if "last" not in _columns(db, "objects"):
        db.execute("ALTER TABLE objects ADD COLUMN last REAL NOT NULL DEFAULT 0")
        db.execute(
            "UPDATE objects SET last = coalesce((SELECT max(recycled) FROM entries e"
            " WHERE e.checksum = objects.checksum), created)"
        )
    db.execute("CREATE INDEX IF NOT EXISTS objects_last ON objects(last)")


def _v7(db: sqlite3.Connection) -> None:
    """Who and what asked for each event (events recorded before say nothing); the
    directories a hold covers."""
    if "audit" not in _columns(db, "events"):
        db.execute("ALTER TABLE events ADD COLUMN audit TEXT")
    if "paths" not in _columns(db, "holds"):
        db.execute("ALTER TABLE holds ADD COLUMN paths TEXT NOT NULL DEFAULT '[]'")


def _v8(db: sqlite3.Connection) -> None:
    """Inserts into `objects` add to the running totals themselves (see SCHEMA)."""
    db.execute("DROP TRIGGER IF EXISTS objects_insert")


MIGRATIONS: list[tuple[int, Callable[[sqlite3.Connection], None]]] = [
    (1, _v1), (2, _v2), (3, _v3), (4, _v4), (5, _v5), (6, _v6), (7, _v7), (8, _v8)
]


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def migrate(db: sqlite3.Connection) -> None:
    """Create or upgrade the schema to VERSION (the connection is in autocommit mode)."""
    db.execute("BEGIN IMMEDIATE")  # one process migrates; the others wait, then see it done
    try:
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > VERSION:
            path = db.execute("PRAGMA database_list").fetchone()[2] or "the index"
            raise ConfigError(
                "index written by a newer cmroot",
                f"{path} has schema version {version}; this cmroot reads up to {VERSION}."
                " Upgrade cmroot (pip install -U cmroot) to open it; downgrading an index"
                " is not supported",
            )
        # Fresh: no table at all. Anything else is an index to bring up, however partial.
        fresh = not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table'").fetchone()
        if fresh:
            for statement in _statements(SCHEMA):
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {VERSION}")
        else:
            for target, step in MIGRATIONS:
                if version < target:
                    step(db)
                    db.execute(f"PRAGMA user_version = {target}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _statements(script: str) -> list[str]:
    """Split SCHEMA into statements (executescript would commit our transaction)."""
    out: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        if line.lstrip().startswith("--"):
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    return out

"""The SQLite index: objects, entries, the event log, the recycle journal, a checksum cache.

It knows nothing of files on disk. One connection in WAL mode, serialised by a lock: SQLite
allows one writer at a time anyway, and reads are short indexed lookups. `synchronous=FULL`
because the journal must be on disk before any file moves.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CACHE_KIB = 64 * 1024
READER_CACHE_KIB = 8 * 1024

SCHEMA = """
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


@dataclass(frozen=True)
class Entry:
    """One recycle of one file."""

    path: str
    checksum: str
    size: int
    recycled: float
    expires: float
    op: str
    db: str | None
    table: str | None
    partition: dict[str, str] | None
    purge: bool
    event_id: int = 0
    id: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "path": self.path,
            "checksum": self.checksum,
            "size": self.size,
            "recycled": self.recycled,
            "expires": self.expires,
            "op": self.op,
            "db": self.db,
            "table": self.table,
            "partition": self.partition,
            "purge": self.purge,
            "event_id": self.event_id,
        }


@dataclass(frozen=True)
class StoredObject:
    checksum: str
    size: int
    created: float
    expires: float
    keep: bool


@dataclass(frozen=True)
class Event:
    """One entry of the ordered event log; field names follow the HCatalog JSON messages."""

    id: int
    type: str
    db: str | None
    table: str | None
    partitions: list[dict[str, str]]
    timestamp: float
    server: str
    purge: bool = False
    files: list[dict[str, Any]] = field(default_factory=list)
    location: str | None = None  # the table's (or database's) location, as a path key
    table_obj: dict[str, Any] | None = None  # the table definition at event time

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "eventType": self.type,
            "db": self.db,
            "table": self.table,
            "partitions": self.partitions,
            "timestamp": self.timestamp,
            "server": self.server,
            "purge": self.purge,
            "files": self.files,
            "location": self.location,
            "tableObj": self.table_obj,
        }


@dataclass(frozen=True)
class JournalRow:
    txid: str
    seq: int
    source: str
    staged: str


@dataclass(frozen=True)
class PendingTx:
    txid: str
    started: float
    mode: str
    request: dict[str, Any]
    rows: list[JournalRow]


class Index:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=30000")
        # Entry inserts land at random places in the checksum and path indexes; with
        # SQLite's 2 MiB default cache a 10,000-file commit slowed as the index grew
        # (0.13 s -> 0.25 s by 40,000 entries). 64 MiB keeps it flat at that size.
        self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self._db.executescript(SCHEMA)
        _migrate(self._db)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []

    def close(self) -> None:
        with self._lock:
            self._db.close()
            for conn in self._readers:
                conn.close()
            self._readers.clear()

    def _reader(self) -> sqlite3.Connection:
        """This thread's read-only connection. WAL lets readers run beside the writer and
        each other; sharing the writer's connection made every lookup of the daemon's
        worker threads queue on one lock (a third of the time of a small GET)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA query_only=1")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute(f"PRAGMA cache_size=-{READER_CACHE_KIB}")
            self._local.conn = conn
            with self._lock:
                self._readers.append(conn)
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: the write lock is taken up front, so nothing that
        reads inside it can be overtaken by another writer."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        return self._reader().execute(sql, args).fetchall()

    # -- journal -------------------------------------------------------------------------
    def journal_begin(
        self,
        txid: str,
        started: float,
        mode: str,
        request: dict[str, Any],
        rows: Iterable[tuple[int, str, str]],
    ) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO txs VALUES (?, ?, ?, ?)", (txid, started, mode, json.dumps(request))
            )
            db.executemany(
                "INSERT INTO journal (txid, seq, source, staged) VALUES (?, ?, ?, ?)",
                ((txid, seq, src, staged) for seq, src, staged in rows),
            )

    def journal_end(self, txid: str) -> None:
        with self.transaction() as db:
            _drop_tx(db, txid)

    def pending(self) -> list[PendingTx]:
        txs = self._query("SELECT txid, started, mode, request FROM txs ORDER BY started")
        out = []
        for txid, started, mode, request in txs:
            rows = [
                JournalRow(*r)
                for r in self._query(
                    "SELECT txid, seq, source, staged FROM journal WHERE txid = ? ORDER BY seq",
                    (txid,),
                )
            ]
            out.append(PendingTx(txid, started, mode, json.loads(request), rows))
        return out

    # -- recycle commit --------------------------------------------------------------------
    def commit_recycle(self, txid: str | None, event: Event, entries: Sequence[Entry]) -> int:
        """Record the event, its entries and their objects, and close the journal record,
        atomically. Returns the new event id."""
        with self.transaction() as db:
            event_id = _insert_event(db, event)
            db.executemany(
                "INSERT INTO entries (path, checksum, size, recycled, expires, op, db, tbl,"
                " partition, purge, event_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        e.path,
                        e.checksum,
                        e.size,
                        e.recycled,
                        e.expires,
                        e.op,
                        e.db,
                        e.table,
                        json.dumps(e.partition) if e.partition is not None else None,
                        int(e.purge),
                        event_id,
                    )
                    for e in entries
                ),
            )
            db.executemany(
                "INSERT INTO objects (checksum, size, created, expires, keep)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT(checksum) DO UPDATE SET"
                " expires = max(expires, excluded.expires), keep = max(keep, excluded.keep)",
                ((e.checksum, e.size, e.recycled, e.expires, int(not e.purge)) for e in entries),
            )
            if txid is not None:
                _drop_tx(db, txid)
        return event_id

    def add_event(self, event: Event) -> int:
        with self.transaction() as db:
            return _insert_event(db, event)

    # -- lookups ---------------------------------------------------------------------------
    def get_object(self, checksum: str) -> StoredObject | None:
        rows = self._query(
            "SELECT checksum, size, created, expires, keep FROM objects WHERE checksum = ?",
            (checksum,),
        )
        return _object(rows[0]) if rows else None

    def recorded(self, pairs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Of the (path, checksum) pairs, those with an entry whose object is indexed,
        mapped to the object's size."""
        wanted = set(pairs)
        out: dict[tuple[str, str], int] = {}
        for chunk in _chunks(sorted({p for p, _ in wanted})):
            for path, checksum, size in self._query(
                "SELECT e.path, e.checksum, o.size FROM entries e"
                " JOIN objects o ON o.checksum = e.checksum"
                f" WHERE e.path IN ({','.join('?' * len(chunk))})",
                chunk,
            ):
                if (path, checksum) in wanted:
                    out[(path, checksum)] = size
        return out

    def entries(
        self,
        db: str | None = None,
        table: str | None = None,
        limit: int = 100,
        cursor: int | None = None,
        checksum: str | None = None,
    ) -> list[Entry]:
        """Entries newest first; `cursor` is the id of the last entry of the previous page."""
        where: list[str] = []
        args: list[Any] = []
        for column, value in (("db", db), ("tbl", table), ("checksum", checksum)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if cursor is not None:
            where.append("id < ?")
            args.append(cursor)
        sql = (
            "SELECT path, checksum, size, recycled, expires, op, db, tbl, partition, purge,"
            " event_id, id FROM entries"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY id DESC LIMIT ?"
        )
        return [_entry(r) for r in self._query(sql, [*args, limit])]

    def events(self, start: int = 0, limit: int = 100) -> list[Event]:
        rows = self._query(
            "SELECT id, type, db, tbl, partitions, timestamp, server, purge, files, meta"
            " FROM events WHERE id >= ? ORDER BY id LIMIT ?",
            (start, limit),
        )
        out = []
        for r in rows:
            meta = json.loads(r[9]) if r[9] is not None else {}
            out.append(
                Event(
                    r[0],
                    r[1],
                    r[2],
                    r[3],
                    json.loads(r[4]),
                    r[5],
                    r[6],
                    bool(r[7]),
                    json.loads(r[8]),
                    meta.get("location"),
                    meta.get("tableObj"),
                )
            )
        return out

    def current_event_id(self) -> int:
        return int(self._query("SELECT coalesce(max(id), 0) FROM events")[0][0])

    def stats(self) -> tuple[int, int, float | None]:
        """(objects, bytes, oldest object's creation time)."""
        n, total = self._query("SELECT objects, bytes FROM stats")[0]
        oldest = self._query("SELECT min(created) FROM objects")[0][0]
        return int(n), int(total), oldest

    def all_checksums(self) -> set[str]:
        return {r[0] for r in self._query("SELECT checksum FROM objects")}

    # -- retention -------------------------------------------------------------------------
    def expired(
        self, now: float, limit: int, after: tuple[float, str] | None = None
    ) -> list[StoredObject]:
        """Expired objects in (expires, checksum) order, the page after `after`."""
        last_expires, last_checksum = after or (float("-inf"), "")
        rows = self._query(
            "SELECT checksum, size, created, expires, keep FROM objects"
            " WHERE expires <= ? AND (expires, checksum) > (?, ?)"
            " ORDER BY expires, checksum LIMIT ?",
            (now, last_expires, last_checksum, limit),
        )
        return [_object(r) for r in rows]

    def still_expired(self, checksums: list[str], now: float) -> set[str]:
        """Of these objects, those still indexed and expired at `now`."""
        out: set[str] = set()
        for chunk in _chunks(checksums):
            out.update(
                r[0]
                for r in self._query(
                    f"SELECT checksum FROM objects WHERE checksum IN ({','.join('?' * len(chunk))})"
                    " AND expires <= ?",
                    [*chunk, now],
                )
            )
        return out

    def forget_expired(self, checksums: Sequence[str], now: float) -> None:
        """Drop objects still expired at `now`, with their entries. An object recycled again
        since it was picked has a later expiry and stays."""
        with self.transaction() as db:
            db.executemany(
                "DELETE FROM objects WHERE checksum = ? AND expires <= ?",
                ((c, now) for c in checksums),
            )
            db.executemany(
                "DELETE FROM entries WHERE checksum = ? AND NOT EXISTS"
                " (SELECT 1 FROM objects WHERE checksum = ?)",
                ((c, c) for c in checksums),
            )

    def forget(self, checksums: Sequence[str]) -> None:
        """Drop objects and their entries whatever their expiry (fsck repair)."""
        with self.transaction() as db:
            db.executemany("DELETE FROM entries WHERE checksum = ?", ((c,) for c in checksums))
            db.executemany("DELETE FROM objects WHERE checksum = ?", ((c,) for c in checksums))

    def register_object(self, obj: StoredObject) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO objects VALUES (?, ?, ?, ?, ?)",
                (obj.checksum, obj.size, obj.created, obj.expires, int(obj.keep)),
            )

    # -- checksum cache ----------------------------------------------------------------------
    def cached_checksums(self, files: Sequence[tuple[str, int, int]]) -> dict[str, str]:
        """Cached checksums of the (path, size, mtime_ns) given, where both still match."""
        wanted = {path: (size, mtime_ns) for path, size, mtime_ns in files}
        out: dict[str, str] = {}
        for chunk in _chunks(list(wanted)):
            for path, size, mtime_ns, checksum in self._query(
                "SELECT path, size, mtime_ns, checksum FROM checksums"
                f" WHERE path IN ({','.join('?' * len(chunk))})",
                chunk,
            ):
                if wanted[path] == (size, mtime_ns):
                    out[path] = checksum
        return out

    def cache_checksums(self, rows: Iterable[tuple[str, int, int, str]]) -> None:
        rows = list(rows)
        if not rows:
            return
        # The cache is advisory: losing its last writes to a crash costs a re-hash.
        with self.transaction() as db:
            db.executemany("INSERT OR REPLACE INTO checksums VALUES (?, ?, ?, ?)", rows)


def _chunks(items: list[str], size: int = 500) -> Iterator[list[str]]:
    """Slices small enough for one `IN (...)` list of SQL parameters."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _drop_tx(db: sqlite3.Connection, txid: str) -> None:
    db.execute("DELETE FROM journal WHERE txid = ?", (txid,))
    db.execute("DELETE FROM txs WHERE txid = ?", (txid,))


def _migrate(db: sqlite3.Connection) -> None:
    """Bring an index written by an older release up to SCHEMA (CREATE TABLE IF NOT EXISTS
    leaves existing tables as they were)."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(events)")}
    if "meta" not in columns:
        try:
            db.execute("ALTER TABLE events ADD COLUMN meta TEXT")
        except sqlite3.OperationalError as e:
            if "duplicate column" not in str(e):  # another process migrated it first
                raise


def _insert_event(db: sqlite3.Connection, e: Event) -> int:
    meta = None
    if e.location is not None or e.table_obj is not None:
        meta = json.dumps({"location": e.location, "tableObj": e.table_obj})
    cur = db.execute(
        "INSERT INTO events (type, db, tbl, partitions, timestamp, server, purge, files, meta)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            e.type,
            e.db,
            e.table,
            json.dumps(e.partitions),
            e.timestamp,
            e.server,
            int(e.purge),
            json.dumps(e.files),
            meta,
        ),
    )
    assert cur.lastrowid is not None
    return cur.lastrowid


def _object(r: Sequence[Any]) -> StoredObject:
    return StoredObject(r[0], r[1], r[2], r[3], bool(r[4]))


def _entry(r: Sequence[Any]) -> Entry:
    return Entry(
        path=r[0],
        checksum=r[1],
        size=r[2],
        recycled=r[3],
        expires=r[4],
        op=r[5],
        db=r[6],
        table=r[7],
        partition=json.loads(r[8]) if r[8] is not None else None,
        purge=bool(r[9]),
        event_id=r[10],
        id=r[11],
    )

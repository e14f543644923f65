"""The connection handling every part of the index shares."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

CACHE_KIB = 64 * 1024
READER_CACHE_KIB = 8 * 1024


class Base:
    """One writer connection in WAL mode, serialised by a lock (SQLite allows one writer
    at a time anyway), and a read-only connection per thread. `synchronous=FULL` because
    the journal must be on disk before any file moves."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        # The timeout first: switching to WAL takes a lock another process may hold.
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        # Entry inserts land at random places in the checksum and path indexes; with
        # SQLite's 2 MiB default cache a 10,000-file commit slowed as the index grew
        # (0.13 s -> 0.25 s by 40,000 entries). 64 MiB keeps it flat at that size.
        self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        # Its own lock, not the writer's: a thread's first read must not wait behind a
        # stream of write transactions (two writers in a loop starved a reader for minutes).
        self._readers_lock = threading.Lock()

    def close(self) -> None:
        with self._lock, self._readers_lock:
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
            with self._readers_lock:
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

    def _query(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        return self._reader().execute(sql, args).fetchall()


def chunks(items: list[T], size: int = 500) -> Iterator[list[T]]:
    """Slices small enough for one `IN (...)` list of SQL parameters."""
    for i in range(0, len(items), size):
        yield items[i : i + size]

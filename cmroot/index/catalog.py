"""Objects and their entries: what the store holds, for which paths, until when."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from cmroot.index.base import Base, chunks
from cmroot.index.records import Entry, StoredObject

_ENTRY_COLUMNS = (
    "path, checksum, size, recycled, expires, op, db, tbl, partition, purge, event_id, id"
)


class Catalog(Base):
    def _record_entries(
        self, db: sqlite3.Connection, entries: Sequence[Entry], event_id: int
    ) -> None:
        """Insert entries and create or extend their objects, inside the caller's
        transaction (`event_id` 0: no event)."""
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
                    str(e.op),
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
        for chunk in chunks(sorted({p for p, _ in wanted})):
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
            f"SELECT {_ENTRY_COLUMNS} FROM entries"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY id DESC LIMIT ?"
        )
        return [_entry(r) for r in self._query(sql, [*args, limit])]

    def stats(self) -> tuple[int, int, float | None]:
        """(objects, bytes, oldest object's creation time)."""
        n, total = self._query("SELECT objects, bytes FROM stats")[0]
        oldest = self._query("SELECT min(created) FROM objects")[0][0]
        return int(n), int(total), oldest

    def objects_between(self, low: str, high: str) -> dict[str, StoredObject]:
        """Indexed objects whose checksum is in [low, high): one shard's worth for fsck."""
        return {
            r[0]: _object(r)
            for r in self._query(
                "SELECT checksum, size, created, expires, keep FROM objects"
                " WHERE checksum >= ? AND checksum < ?",
                (low, high),
            )
        }

    # -- retention ---------------------------------------------------------------------
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
        for chunk in chunks(checksums):
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

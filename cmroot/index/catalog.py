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


# Files a job leaves beside its data: kept like any other, hidden from readable listings.
_NOT_HOUSEKEEPING = r"NOT (path GLOB '*/_SUCCESS' OR path GLOB '*/.*.crc')"


class Catalog(Base):
    def _record_entries(
        self, db: sqlite3.Connection, entries: Sequence[Entry], event_id: int
    ) -> None:
        """Insert entries and create or extend their objects, inside the caller's
        transaction (`event_id` 0: no event). Objects go in key order: B-tree pages
        are then filled one after the other rather than at random (half the time with
        200,000 objects indexed). Entries keep theirs: their ids order them."""
        sizes = {e.checksum: e.size for e in entries}
        present: set[str] = set()
        for chunk in chunks(sorted(sizes)):
            present.update(r[0] for r in db.execute(
                f"SELECT checksum FROM objects WHERE checksum IN ({','.join('?' * len(chunk))})",
                chunk,
            ))
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
            "INSERT INTO objects (checksum, size, created, expires, keep, last)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(checksum) DO UPDATE SET"
            " expires = max(expires, excluded.expires), keep = max(keep, excluded.keep),"
            " last = max(last, excluded.last)",
            sorted(
                (e.checksum, e.size, e.recycled, e.expires, int(not e.purge), e.recycled)
                for e in entries
            ),
        )
        _add_to_totals(db, [size for c, size in sizes.items() if c not in present])

    def get_object(self, checksum: str) -> StoredObject | None:
        rows = self._query(
            "SELECT checksum, size, created, expires, keep, last FROM objects WHERE checksum = ?",
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
        housekeeping: bool = True,
    ) -> list[Entry]:
        """Entries newest first; `cursor` is the id of the last entry of the previous page.
        Without `housekeeping`, job markers and checksum sidecars (`_SUCCESS`, `.*.crc`)
        are left out."""
        where: list[str] = []
        args: list[Any] = []
        if not housekeeping:
            where.append(_NOT_HOUSEKEEPING)
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

    def entries_of(self, checksums: list[str], housekeeping: bool = True) -> list[Entry]:
        """Every entry of these objects (what a sweep of them takes away), in id order."""
        out: list[Entry] = []
        hide = f" AND {_NOT_HOUSEKEEPING}" if not housekeeping else ""
        for chunk in chunks(checksums):
            out += [
                _entry(r)
                for r in self._query(
                    f"SELECT {_ENTRY_COLUMNS} FROM entries"
                    f" WHERE checksum IN ({','.join('?' * len(chunk))}){hide} ORDER BY id",
                    chunk,
                )
            ]
        return out

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
                "SELECT checksum, size, created, expires, keep, last FROM objects"
                " WHERE checksum >= ? AND checksum < ?",
                (low, high),
            )
        }

    def forget(self, checksums: Sequence[str]) -> None:
        """Drop objects and their entries whatever their expiry (fsck repair)."""
        with self.transaction() as db:
            db.executemany("DELETE FROM entries WHERE checksum = ?", ((c,) for c in checksums))
            db.executemany("DELETE FROM objects WHERE checksum = ?", ((c,) for c in checksums))

    def register_object(self, obj: StoredObject) -> None:
        with self.transaction() as db:
            made = db.execute(
                "INSERT OR IGNORE INTO objects (checksum, size, created, expires, keep, last)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (obj.checksum, obj.size, obj.created, obj.expires, int(obj.keep),
                 obj.last or obj.created),
            ).rowcount
            _add_to_totals(db, [obj.size] * made)


def _add_to_totals(db: sqlite3.Connection, sizes: Sequence[int]) -> None:
    """Count objects just inserted into the running totals (`stats`; deletes are counted
    by trigger)."""
    if sizes:
        db.execute("UPDATE stats SET objects = objects + ?, bytes = bytes + ? WHERE id = 1",
                   (len(sizes), sum(sizes)))


def _object(r: Sequence[Any]) -> StoredObject:
    return StoredObject(r[0], r[1], r[2], r[3], bool(r[4]), r[5])


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

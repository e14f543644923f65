"""What the retention sweep may remove: expired objects, objects evicted to bring the store
under its byte budget, and the holds that keep both from going.

A hold names a database (every table) or one table; an object is held while any of its
entries belongs to a held table and the hold's `until` has not passed. Held objects are
neither expired nor evicted: a hold only ever keeps more."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cmroot.index.base import Base, chunks
from cmroot.index.records import Hold, StoredObject

_OBJECT = "o.checksum, o.size, o.created, o.expires, o.keep, o.last"
# An object (alias o) with an entry of a table a hold active at :now keeps.
_HELD = (
    "EXISTS (SELECT 1 FROM entries e JOIN holds h ON h.db = lower(e.db)"
    " AND (h.tbl IS NULL OR h.tbl = lower(e.tbl))"
    " WHERE e.checksum = o.checksum AND h.until > :now)"
)


class Retention(Base):
    # -- holds ----------------------------------------------------------------------------
    def add_hold(self, db: str, table: str | None, until: float, reason: str, now: float) -> Hold:
        with self.transaction() as conn:
            cur = conn.execute(
                "INSERT INTO holds (db, tbl, created, until, reason) VALUES (?, ?, ?, ?, ?)",
                (db.lower(), table.lower() if table is not None else None, now, until, reason),
            )
            hold_id = int(cur.lastrowid or 0)
        return Hold(hold_id, db.lower(), table.lower() if table else None, now, until, reason)

    def holds(self, active_at: float | None = None) -> list[Hold]:
        """Holds by id; only those still active at `active_at` when given."""
        sql = "SELECT id, db, tbl, created, until, reason FROM holds"
        args: list[Any] = []
        if active_at is not None:
            sql += " WHERE until > ?"
            args.append(active_at)
        return [Hold(*r) for r in self._query(sql + " ORDER BY id", args)]

    def remove_hold(self, hold_id: int) -> bool:
        with self.transaction() as conn:
            return conn.execute("DELETE FROM holds WHERE id = ?", (hold_id,)).rowcount > 0

    def _any_hold(self, now: float) -> bool:
        return bool(self._query("SELECT 1 FROM holds WHERE until > ? LIMIT 1", (now,)))

    def held_totals(self, now: float) -> tuple[int, int]:
        """(objects, bytes) expired at `now` that only a hold keeps."""
        if not self._any_hold(now):
            return 0, 0
        n, size = self._query(
            f"SELECT count(*), coalesce(sum(o.size), 0) FROM objects o"
            f" WHERE o.expires <= :now AND {_HELD}",
            {"now": now},
        )[0]
        return int(n), int(size)

    def held_until(
        self, entries: Iterable[tuple[str | None, str | None]], now: float
    ) -> dict[tuple[str, str | None], float]:
        """For (db, table) pairs, the latest `until` of the holds active at `now` that keep
        that table, keyed by the lowercased pair; pairs no hold keeps are left out."""
        out: dict[tuple[str, str | None], float] = {}
        active = self.holds(now)
        for db, table in entries:
            if db is None:
                continue
            key = (db.lower(), table.lower() if table is not None else None)
            for h in active:
                if h.db == key[0] and (h.table is None or h.table == key[1]):
                    out[key] = max(out.get(key, 0.0), h.until)
        return out

    # -- expiry ---------------------------------------------------------------------------
    def expired(
        self, now: float, limit: int, after: tuple[float, str] | None = None
    ) -> list[StoredObject]:
        """Expired objects no hold keeps, in (expires, checksum) order, the page after
        `after`."""
        return self._page("expires", now, now, limit, after)

    def still_expired(self, checksums: list[str], now: float) -> set[str]:
        """Of these objects, those still indexed, expired at `now` and kept by no hold."""
        return self._still(checksums, "o.expires <= :now", {"now": now})

    def forget_expired(self, checksums: Sequence[str], now: float) -> None:
        """Drop objects still expired at `now`, with their entries. An object recycled again
        since it was picked has a later expiry and stays."""
        self._forget(checksums, "expires <= ?", now)

    # -- the byte budget ------------------------------------------------------------------
    def evictable(
        self, cutoff: float, now: float, limit: int, after: tuple[float, str] | None = None
    ) -> list[StoredObject]:
        """Objects last recycled at or before `cutoff` that no hold keeps at `now`, oldest
        first ((last, checksum) order), the page after `after`."""
        return self._page("last", cutoff, now, limit, after)

    def still_evictable(self, checksums: list[str], cutoff: float, now: float) -> set[str]:
        """Of these objects, those still indexed, not recycled since `cutoff` and kept by no
        hold at `now`."""
        return self._still(checksums, "o.last <= :cutoff", {"now": now, "cutoff": cutoff})

    def forget_evicted(self, checksums: Sequence[str], cutoff: float) -> None:
        """Drop evicted objects, with their entries, unless recycled again since `cutoff`."""
        self._forget(checksums, "last <= ?", cutoff)

    def _page(
        self, column: str, bound: float, now: float, limit: int,
        after: tuple[float, str] | None,
    ) -> list[StoredObject]:
        """Objects whose `column` is at most `bound`, kept by no hold at `now`, in
        (`column`, checksum) order, the page after `after`."""
        value, checksum = after or (float("-inf"), "")
        held = f" AND NOT {_HELD}" if self._any_hold(now) else ""
        rows = self._query(
            f"SELECT {_OBJECT} FROM objects o WHERE o.{column} <= :bound"
            f" AND (o.{column}, o.checksum) > (:v, :c){held}"
            f" ORDER BY o.{column}, o.checksum LIMIT :limit",
            {"now": now, "bound": bound, "v": value, "c": checksum, "limit": limit},
        )
        return [_object(r) for r in rows]

    def _still(self, checksums: list[str], condition: str, args: dict[str, Any]) -> set[str]:
        out: set[str] = set()
        for chunk in chunks(checksums):
            names = {f"k{i}": c for i, c in enumerate(chunk)}
            out.update(
                r[0]
                for r in self._query(
                    f"SELECT o.checksum FROM objects o WHERE o.checksum IN"
                    f" ({','.join(':' + k for k in names)}) AND {condition} AND NOT {_HELD}",
                    {**args, **names},
                )
            )
        return out

    def _forget(self, checksums: Sequence[str], condition: str, bound: float) -> None:
        with self.transaction() as db:
            db.executemany(
                f"DELETE FROM objects WHERE checksum = ? AND {condition}",
                ((c, bound) for c in checksums),
            )
            db.executemany(
                "DELETE FROM entries WHERE checksum = ? AND NOT EXISTS"
                " (SELECT 1 FROM objects WHERE checksum = ?)",
                ((c, c) for c in checksums),
            )


def _object(r: Sequence[Any]) -> StoredObject:
    return StoredObject(r[0], r[1], r[2], r[3], bool(r[4]), r[5])

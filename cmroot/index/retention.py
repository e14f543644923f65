"""What the retention sweep may remove: expired objects, objects evicted to bring the store
under its byte budget, and the holds that keep both from going.

A hold names a database (every table) or one table; an object is held while any of its
entries belongs to a held table and the hold's `until` has not passed. Held objects are
neither expired nor evicted: a hold only ever keeps more."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cmroot.index.base import Base, chunks
from cmroot.index.records import Hold, StoredObject

_OBJECT = "o.checksum, o.size, o.created, o.expires, o.keep, o.last"
# An object (alias o) with an entry of a table a hold active at :now keeps: by the entry's
# names, or, for one recycled with none, by where it was (the hold's path prefixes).
# The one rule for which entries (alias e) a hold (alias h) active at :now keeps.
_KEEPS = (
    "h.until > :now"
    " AND ((h.db = lower(e.db) AND (h.tbl IS NULL OR h.tbl = lower(e.tbl)))"
    " OR EXISTS (SELECT 1 FROM json_each(h.paths) p"
    " WHERE substr(e.path, 1, length(p.value)) = p.value))"
)
_HELD = f"EXISTS (SELECT 1 FROM entries e JOIN holds h ON {_KEEPS} WHERE e.checksum = o.checksum)"


class Retention(Base):
    # -- holds ----------------------------------------------------------------------------
    def add_hold(
        self, db: str, table: str | None, until: float, reason: str, now: float,
        paths: Sequence[str] = (),
    ) -> Hold:
        """A hold on `db` (or its `table`), also covering entries under `paths` (prefixes
        ending in "/") whatever their names."""
        with self.transaction() as conn:
            cur = conn.execute(
                "INSERT INTO holds (db, tbl, created, until, reason, paths)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (db.lower(), table.lower() if table is not None else None, now, until, reason,
                 json.dumps(list(paths))),
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

    def held_until(self, entry_ids: Sequence[int], now: float) -> dict[int, float]:
        """For these entries, the latest `until` of the holds active at `now` that keep
        each, by entry id (entries no hold keeps are left out)."""
        out: dict[int, float] = {}
        ids = list(entry_ids)
        if not ids or not self._any_hold(now):
            return out
        for chunk in chunks(ids):
            names = {f"k{i}": v for i, v in enumerate(chunk)}
            for entry_id, until in self._query(
                f"SELECT e.id, max(h.until) FROM entries e JOIN holds h ON {_KEEPS}"
                f" WHERE e.id IN ({','.join(':' + k for k in names)}) GROUP BY e.id",
                {"now": now, **names},
            ):
                out[int(entry_id)] = float(until)
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

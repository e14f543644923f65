"""A cache of the checksums of originals, so resolving the same files again (a replication
load does) does not re-read them.

A row is trusted only while the file's identity is unchanged: on local filesystems
`(st_dev, st_ino, size, mtime_ns, ctime_ns)` (a writer can restore mtime, never ctime);
on object stores the ETag or version id. The cache is advisory: losing its last writes
to a crash costs a re-hash."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cmroot.index.base import Base, chunks

CACHE_ROWS = 1_000_000  # the cache's bound; the oldest-written rows go first


class ChecksumCache(Base):
    cache_rows = CACHE_ROWS

    def cached_checksums(self, files: Sequence[tuple[str, str]]) -> dict[str, str]:
        """Cached checksums of the (path, identity) given, where the identity matches."""
        wanted = dict(files)
        out: dict[str, str] = {}
        for chunk in chunks(list(wanted)):
            for path, ident, checksum in self._query(
                "SELECT path, ident, checksum FROM checksums"
                f" WHERE path IN ({','.join('?' * len(chunk))})",
                chunk,
            ):
                if wanted[path] == ident:
                    out[path] = checksum
        return out

    def cache_checksums(self, rows: Iterable[tuple[str, str, str]]) -> None:
        """Remember (path, identity, checksum) rows, evicting the oldest past the bound."""
        rows = list(rows)
        if not rows:
            return
        with self.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO checksums (path, ident, checksum) VALUES (?, ?, ?)", rows
            )
            (newest,) = db.execute("SELECT coalesce(max(id), 0) FROM checksums").fetchone()
            db.execute("DELETE FROM checksums WHERE id <= ?", (newest - self.cache_rows,))

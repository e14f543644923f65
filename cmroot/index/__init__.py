"""The SQLite index: objects and entries, the event log, the recycle journal, a checksum
cache, and what retention may remove (holds, the byte budget), one module each. It knows
nothing of files on disk."""

from __future__ import annotations

from cmroot.index.cache import ChecksumCache
from cmroot.index.journal import JournalTables
from cmroot.index.records import Entry, Event, Hold, JournalRow, PendingTx, StoredObject
from cmroot.index.retention import Retention
from cmroot.index.schema import migrate

__all__ = ["Entry", "Event", "Hold", "Index", "JournalRow", "PendingTx", "StoredObject"]


class Index(JournalTables, ChecksumCache, Retention):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        migrate(self._db)

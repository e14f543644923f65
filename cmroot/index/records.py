"""The rows the index hands out, as frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Entry:
    """One recycle of one file. `event_id` 0: kept without an event (displaced)."""

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
            "event_id": self.event_id or None,
        }


@dataclass(frozen=True)
class StoredObject:
    checksum: str
    size: int
    created: float
    expires: float
    keep: bool
    last: float = 0.0  # its newest entry's recycle time (0: unknown, taken as `created`)


@dataclass(frozen=True)
class Hold:
    """Everything recycled from database `db` (or its table `table` only) is kept past
    its expiry until `until`."""

    id: int
    db: str
    table: str | None
    created: float
    until: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "db": self.db, "table": self.table, "created": self.created,
                "until": self.until, "reason": self.reason}


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
    # Where each of `partitions` lives, in order (None: outside the warehouse roots);
    # None when the recorder did not say (the partitions are at their default places).
    partition_locations: list[str | None] | None = None
    audit: dict[str, str] | None = None  # who and what asked for it (cmroot.audit)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "eventType": str(self.type),
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
        if self.partition_locations is not None:
            out["partitionLocations"] = self.partition_locations
        if self.audit is not None:
            out["audit"] = self.audit
        return out


@dataclass(frozen=True)
class JournalRow:
    txid: str
    seq: int
    source: str
    staged: str
    method: str  # vocab.Method
    ident: str | None = None
    checksum: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class PendingTx:
    txid: str
    started: float
    mode: str
    request: dict[str, Any]
    state: str  # vocab.TxState
    error: str | None
    dirs: list[str]
    rows: list[JournalRow]
    lease: float | None = None  # a prepared transaction's deadline

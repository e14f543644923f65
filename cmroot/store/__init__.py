"""The store: recycle files into it, resolve and read them back, sweep what expired.

`Store.open` takes the configuration, an index and a clock; it knows nothing of HTTP,
Spark or the command line, so the daemon and the CLI are thin layers over it."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec

from cmroot import audit as audit_mod
from cmroot import checksum as cks
from cmroot.config import Config, StoreConfig
from cmroot.exceptions import BadRequest, CmrootError, Forbidden, NotFound
from cmroot.index import Entry, Event, Hold, Index
from cmroot.store.fsck import LIMIT as FSCK_LIMIT
from cmroot.store.fsck import FsckReport, fsck
from cmroot.store.journal import Recovery
from cmroot.store.layout import open_layout
from cmroot.store.objects import Objects
from cmroot.store.read import Quarantined, Reader, Verified, locate
from cmroot.store.recycle import (
    Prepared,
    Progress,
    Recycler,
    RecycleRequest,
    RecycleResult,
    validate_partitions,
)
from cmroot.store.resolve import Renames, Resolution, Resolver, parse_pairs
from cmroot.store.sweep import Budget, SweepReport, sweep
from cmroot.store.warehouse import Located, Warehouse
from cmroot.vocab import METADATA_DROPS, RECORDABLE

__all__ = [
    "Prepared",
    "Quarantined",
    "RecycleRequest",
    "RecycleResult",
    "Resolution",
    "Store",
    "Verified",
]

log = logging.getLogger(__name__)

# A database or table name as Hive keeps it (no dots: DB.TABLE is split before this).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,127}")
MAX_REASON = 1000
MAX_HOLD_UNTIL = 1e11  # seconds since the epoch: year 5138


class Store:
    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        clock: Callable[[], float] = time.time,
        readonly: bool = False,
    ) -> None:
        self.config = config
        self.index = index
        self.clock = clock
        self.readonly = readonly
        self.warehouse = Warehouse(config.warehouse_roots, config.root)  # refuses overlap
        # A remote store keeps its lock and scratch files beside the (always local) index.
        self.layout = open_layout(config.root, os.path.dirname(os.path.abspath(index.path)))
        self._lock_fd = None if readonly else self.layout.lock()
        self.recovery = Recovery()
        self.objects = Objects(self.layout, index, clock)
        self.recycler = Recycler(self.layout, index, self.objects, self.warehouse, config, clock)
        self.resolver = Resolver(self.layout, index, not readonly, cks.default_workers())
        self.reader = Reader(self.layout, index, self.warehouse, clock, readonly)
        self.renames = Renames(index, self.warehouse)
        if not readonly:
            self.recovery = self.recycler.journal.recover(config.retain_for, clock())
            r = self.recovery
            if r.rolled_back or r.finished or r.quarantined:
                log.warning(
                    "recovered interrupted recycles",
                    extra={"rolled_back": r.rolled_back, "finished": r.finished,
                           "quarantined": r.quarantined, "displaced": len(r.displaced)},
                )

    @classmethod
    def open(
        cls, config: Config, clock: Callable[[], float] = time.time, readonly: bool = False
    ) -> Store:
        os.makedirs(os.path.dirname(config.index_path), exist_ok=True)
        index = Index(config.index_path)
        try:
            return cls(config.store, index, clock, readonly)
        except BaseException:
            index.close()  # refused (overlap, locked, unreachable): nothing left open
            raise

    def close(self) -> None:
        self.recycler.close()
        self.index.close()
        if self._lock_fd is not None:
            self.layout.unlock(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reconfigure(self, config: StoreConfig) -> None:
        """Apply new retention settings (SIGHUP); roots and the store location stay."""
        self.config = config
        self.recycler.config = config

    # -- writes ---------------------------------------------------------------------------
    def recycle(self, req: RecycleRequest, progress: Progress | None = None) -> RecycleResult:
        return self.recycler.recycle(req, progress)

    def prepare(
        self, req: RecycleRequest, lease: float | None = None, txid: str | None = None,
        progress: Progress | None = None,
    ) -> Prepared:
        """First phase of a two-phase recycle: the files move into staging, unseen until
        `commit`; `abort`, or a lease (default `store.prepare_lease`) passing without a
        `renew`, puts them back. `txid` joins another part of the same statement."""
        return self.recycler.prepare(
            req, self.config.prepare_lease if lease is None else lease, txid, progress
        )

    def commit(self, txid: str) -> RecycleResult:
        return self.recycler.commit(txid)

    def abort(self, txid: str) -> list[str]:
        return self.recycler.abort(txid)

    def renew(self, txid: str, lease: float | None = None) -> float:
        return self.recycler.renew(txid, self.config.prepare_lease if lease is None else lease)

    def expire_prepared(self) -> int:
        """Roll back prepared transactions whose lease passed (the daemon calls this on
        a short timer)."""
        return self.recycler.expire()

    def add_event(
        self,
        type: str,
        db: str | None = None,
        table: str | None = None,
        partitions: list[dict[str, str]] | None = None,
        files: list[dict[str, Any]] | None = None,
        server: str | None = None,
        location: str | None = None,
        table_obj: dict[str, Any] | None = None,
        partition_locations: list[str | None] | None = None,
        audit: dict[str, str] | None = None,
    ) -> int:
        """Record a non-destructive event (CREATE_TABLE, ADD_PARTITION, INSERT, ...), or a
        drop that held no data. A file given without its checksum is hashed here, from disk:
        the hook then need not read the bytes it just wrote. `partition_locations` says
        where each of `partitions` lives (None: outside the roots, where nothing of it is
        recorded)."""
        if not isinstance(type, str) or type not in RECORDABLE:
            raise BadRequest(
                "unknown eventType", f"{type!r}: use one of {', '.join(sorted(RECORDABLE))}"
            )
        if type in METADATA_DROPS and files:
            raise BadRequest(
                f"{type} with files",
                "files of a drop go through POST /v1/recycle; POST /v1/events records only a "
                "drop that held no data",
            )
        if table_obj is not None and not isinstance(table_obj, dict):
            raise BadRequest("bad tableObj", "give the table definition as a JSON object")
        validate_partitions(partitions or [])
        where = self.warehouse.locate(location).key if location is not None else None
        places = self._partition_places(partitions or [], partition_locations)
        clean = self._event_files(files or [])
        return self.index.add_event(
            Event(
                0,
                type,
                db,
                table,
                list(partitions or []),
                self.clock(),
                server or self.recycler.server,
                False,
                clean,
                where,
                table_obj,
                places,
                audit_mod.clean(audit),
            )
        )

    def _partition_places(
        self, partitions: list[dict[str, str]], places: list[str | None] | None
    ) -> list[str | None] | None:
        """`places` confined to the roots and canonical, one per partition."""
        if places is None:
            return None
        if not isinstance(places, list) or len(places) != len(partitions):
            raise BadRequest(
                "bad partitionLocations",
                f"give one location (or null) per partition: {len(partitions)} partitions",
            )
        return [None if p is None else self.warehouse.locate(p).key for p in places]

    def _event_files(self, files: list[Any]) -> list[dict[str, Any]]:
        """Confine and check every file first, so a bad one refuses the event before any
        hashing; then hash, together, those that came without a checksum."""
        clean: list[dict[str, Any]] = []
        unhashed: list[tuple[int, Located]] = []
        for i, f in enumerate(files):
            size = f.get("size", 0) if isinstance(f, dict) else None
            if type(size) is not int or not 0 <= size < 2**63:  # bool is not a size
                raise BadRequest(
                    f"bad file #{i}",
                    'each file is {"path", "checksum", "size"}, size a non-negative integer',
                )
            loc = self.warehouse.locate(f.get("path"))
            if "checksum" in f or "size" in f:
                checksum = cks.validate(f.get("checksum"))
                clean.append({"path": loc.key, "checksum": checksum, "size": f.get("size", 0)})
            else:
                self.warehouse.confirm(loc)
                unhashed.append((i, loc))
                clean.append({"path": loc.key})
        found = [(i, loc, self.resolver.original(loc)) for i, loc in unhashed]
        for i, loc, original in found:
            if original is None:
                raise NotFound("no such file", f"file #{i} {loc.key} is not a file on disk")
        sums = self.resolver.checksums([o for _, _, o in found if o is not None])
        for i, loc, original in found:
            if loc.key not in sums:
                raise NotFound("no such file", f"file #{i} {loc.key} vanished while hashed")
            clean[i]["checksum"] = sums[loc.key]
            clean[i]["size"] = original.size if original is not None else 0
        return clean

    def gc(
        self, dry_run: bool = False, progress: Callable[[int], None] | None = None,
        files: bool = False, housekeeping: bool = False,
    ) -> SweepReport:
        """A retention sweep (expiry, then the byte budget). A dry run names the tables and
        partitions whose files would go, and with `files` the files (`housekeeping`:
        `_SUCCESS` and `.*.crc` too)."""
        trash = self.config.on_expire == "trash"
        budget = Budget(self.config.max_bytes, self.config.min_retain)
        return sweep(
            self.index, self.objects, self.clock(), trash, dry_run, progress, budget=budget,
            list_files=files, housekeeping=housekeeping,
        )

    # -- holds ----------------------------------------------------------------------------
    def add_hold(self, db: object, table: object, until: object, reason: object) -> Hold:
        """Keep everything recycled from `db` (or its `table`) past its expiry, and out of
        the budget's evictions, until `until` (seconds since the epoch)."""
        now = self.clock()
        for name, value, optional in (("db", db, False), ("table", table, True)):
            if value is None and optional:
                continue
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                raise BadRequest(
                    f"bad {name}",
                    f"{value!r}: give a {'table' if optional else 'database'} name (letters,"
                    " digits, _ and -, as the metastore writes it)",
                )
        if (
            not isinstance(until, (int, float)) or isinstance(until, bool)
            or not now < until <= MAX_HOLD_UNTIL
        ):
            raise BadRequest(
                "bad until", f"{until!r}: give a time in the future (seconds since the epoch)"
            )
        if (
            not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON
            or not _encodable(reason)
        ):
            raise BadRequest(
                "bad reason",
                f"say why the hold is needed, in at most {MAX_REASON} characters of text",
            )
        assert isinstance(db, str) and (table is None or isinstance(table, str))
        # Under the lock a sweep removes a page under: once this returns, no sweep removes
        # anything the hold covers (a page in progress finishes first).
        with self.objects.exclusive():
            hold = self.index.add_hold(
                db, table, float(until), reason.strip(), now,
                self._hold_paths(db.lower(), table.lower() if table else None),
            )
        log.info("hold added", extra={"hold": hold.id, "db": hold.db, "table": hold.table,
                                      "until": hold.until, "reason": hold.reason})
        return hold

    def _hold_paths(self, db: str, table: str | None) -> list[str]:
        """Where the held table (or database) lives by the warehouse layout, under each
        root: entries recycled with no names there are held too. The default database's
        tables sit at the roots' tops, beside the other databases: a hold of all of it
        goes by names alone."""
        out: list[str] = []
        for r in self.warehouse.roots:
            base = r.url.rstrip("/")
            if table is not None:
                out.append(f"{base}/{db}.db/{table}/")
                if db == "default":
                    out.append(f"{base}/{table}/")
            elif db != "default":
                out.append(f"{base}/{db}.db/")
        return out

    def holds(self, everything: bool = False) -> list[Hold]:
        """Active holds; with `everything`, those past their `until` too."""
        return self.index.holds(None if everything else self.clock())

    def remove_hold(self, hold_id: int) -> None:
        if type(hold_id) is not int or not 0 < hold_id < 2**63 or not self.index.remove_hold(
            hold_id
        ):
            raise NotFound("no such hold", f"hold {hold_id} does not exist: see `cmroot hold ls`")
        log.info("hold removed", extra={"hold": hold_id})

    def fsck(
        self,
        repair: bool = False,
        progress: Callable[[int, int], None] | None = None,
        limit: int = FSCK_LIMIT,
        online: bool = False,
    ) -> FsckReport:
        """Check the objects against the index, shard by shard (`progress(done, total)`
        per shard); with `repair`, fix what can be fixed without losing anything. Lists
        in the report hold at most `limit` items each; its counts are complete. `online`:
        recycles and sweeps go on meanwhile (in the daemon, or this store is read-only
        beside it); a read-only store only checks."""
        if repair and self.readonly:
            raise BadRequest(
                "fsck --repair needs the store's writer",
                "repair through the running daemon (cmroot fsck --repair reaches it), or"
                " stop it first",
            )
        return fsck(
            self.layout, self.index, self.clock(), self.config.retain, repair, progress, limit,
            guard=None if self.readonly else self.objects, online=online or self.readonly,
        )

    # -- reads ----------------------------------------------------------------------------
    def resolve(self, pairs: object) -> list[Resolution]:
        """Where the bytes of each (path, checksum) are: at the path, in the store, or at
        the path a later rename of its table moved it to (the table swap: CTAS new, DROP
        old, RENAME new TO old). A followed pair keeps the asked path; its `location` is
        where the bytes are, read like any pair (confined, verified by checksum)."""
        out = self.resolver.resolve(parse_pairs(self.warehouse, pairs))
        missing = [i for i, r in enumerate(out) if r.status == "missing"]
        if not missing:
            return out
        self.renames.refresh()
        moved: list[tuple[int, Located]] = []
        for i in missing:
            for path in self.renames.candidates(out[i].path):
                try:
                    moved.append((i, self.warehouse.locate(path)))
                except CmrootError:  # moved out of the roots: not ours to read
                    continue
        # One batch: the bound on bytes hashed per request holds for followed pairs too.
        found = self.resolver.resolve([(loc, out[i].checksum) for i, loc in moved])
        for (i, _), r in zip(moved, found, strict=True):
            if out[i].status == "missing" and r.status != "missing":
                out[i] = msgspec.structs.replace(r, path=out[i].path)
        return out

    def open_cached(self, path: object, checksum: object, inline_max: int) -> Verified:
        """`open_verified` from memory alone, for an event loop (see Reader.open_cached):
        raises WouldBlock whenever `open_verified` must be asked instead."""
        return self.reader.open_cached(path, checksum, inline_max)

    def open_verified(self, path: object, checksum: object, inline_max: int = 0) -> Verified:
        """The verified bytes for (path, checksum), as an open descriptor (invariant 3):
        the original if it still hashes to the checksum, else the store's object if an
        entry records that pair. Serve from `Verified.fd` (or `.data`), never by path;
        close it when done. Raises NotFound (also for an object found corrupt, which is
        quarantined)."""
        try:
            return self.reader.open_verified(path, checksum, inline_max)
        except Quarantined:
            raise
        except NotFound as missing:
            # Moved by a later rename of its table (see `resolve`): read where it went,
            # with the same confinement and verification.
            self.renames.refresh()
            for moved in self.renames.candidates(locate(self.warehouse, path).key):
                try:
                    return self.reader.open_verified(moved, checksum, inline_max)
                except (NotFound, BadRequest, Forbidden):
                    continue
            raise missing

    def entries(
        self,
        db: str | None = None,
        table: str | None = None,
        limit: int = 100,
        cursor: int | None = None,
        housekeeping: bool = True,
    ) -> list[Entry]:
        """A page of entries, newest first (`housekeeping`: `_SUCCESS`, `.*.crc` too)."""
        return self.index.entries(db, table, limit, cursor, housekeeping=housekeeping)

    def listing(
        self,
        db: str | None = None,
        table: str | None = None,
        limit: int = 100,
        cursor: int | None = None,
        housekeeping: bool = True,
    ) -> list[dict[str, Any]]:
        """`entries` as JSON, each saying until when a hold keeps it (`held_until`, null
        if none does) and who asked for its recycle (`audit`, its event's, null when
        unknown): what GET /v1/entries and `cmroot ls` show."""
        rows = self.entries(db, table, limit, cursor, housekeeping)
        held = self.index.held_until([e.id for e in rows], self.clock())
        audits = self.index.audits(e.event_id for e in rows)
        return [
            {**e.to_json(), "held_until": held.get(e.id), "audit": audits.get(e.event_id)}
            for e in rows
        ]

    def events(self, start: int = 0, limit: int = 100) -> list[Event]:
        return self.index.events(start, limit)


def _encodable(text: str) -> bool:
    """Whether `text` can be stored (no lone surrogates, as an undecodable argv gives)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True

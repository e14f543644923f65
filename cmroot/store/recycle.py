"""Recycle: move (or copy) files into the store as one all-or-nothing, crash-safe step.

The sequence, for every request (the journal, `cmroot.store.journal`, decides what any
failure or crash in between leaves):
1. journal: the request and, per file, where it will be staged and how (one SQLite
   commit, fsynced, before anything moves);
2. stage: rename each file into `staging/<txid>/` relative to directory descriptors (no
   data copied, no symlink followed), or copy it there with fsync and re-verify (copy
   mode, another filesystem, an object store);
3. hash the staged bytes and publish them under their checksum (a hard link,
   deduplicated only after a byte-for-byte comparison). A prepared recycle publishes in
   the background while its statement runs (an object no entry names is served to no
   one), so that its commit only records;
4. flush the filesystem, then record entries, objects and the event and mark the
   transaction committed in one SQLite transaction;
5. clean up (staging names, copied sources, emptied directories), journaled: a crash
   here is finished at the next open.
Hashing the staged copy rather than the source means an object's name always matches
its bytes even if a writer races the recycle.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

from cmroot import audit, faults
from cmroot import checksum as cks
from cmroot.config import StoreConfig
from cmroot.exceptions import (
    BadRequest,
    CmrootError,
    Conflict,
    Forbidden,
    NotFound,
    RecycleFailed,
    StoreFull,
)
from cmroot.index import Entry, Event, Index, PendingTx
from cmroot.store.journal import Item, Journal, Sessions, entries_of
from cmroot.store.layout import Layout
from cmroot.store.objects import Objects
from cmroot.store.source import Session
from cmroot.store.warehouse import Root, Warehouse
from cmroot.vocab import DESTRUCTIVE, FileState, Method, Mode, TxState

log = logging.getLogger(__name__)

_BATCH = 64  # files per task handed to a staging thread
_PARALLEL_MIN_SIZE = 1 << 20  # mean file size from which staging uses several threads
_PARALLEL_MIN_FILES = 256  # files from which a prepare's staging uses several threads
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class RecycleRequest:
    paths: Sequence[str]
    mode: str = "move"
    purge: bool = False
    op: str = "DELETE"
    db: str | None = None
    table: str | None = None
    partitions: Sequence[dict[str, str]] = ()
    location: str | None = None  # the table's location, recorded on the event
    # The table's partitions' own locations outside its directory: files under them are the
    # labelled table's too (see _one_table).
    partition_locations: Sequence[str] = ()
    audit: dict[str, str] | None = None  # who and what asked (cmroot.audit), on the event

    def validate(self) -> None:
        if (
            isinstance(self.paths, (str, bytes))
            or not isinstance(self.paths, Sequence)
            or not self.paths
        ):
            raise BadRequest("bad paths", "give a non-empty list of paths")
        if not isinstance(self.mode, str) or self.mode not in set(Mode):
            raise BadRequest("bad mode", f'{self.mode!r}: use "move" or "copy"')
        if not isinstance(self.op, str) or self.op not in DESTRUCTIVE:
            raise BadRequest(
                "unknown op", f"{self.op!r}: use one of {', '.join(sorted(DESTRUCTIVE))}"
            )
        if not isinstance(self.purge, bool):
            raise BadRequest("bad purge", f"{self.purge!r}: use true or false")
        for name, value in (("db", self.db), ("table", self.table)):
            if value is not None and (
                not isinstance(value, str) or "\0" in value or len(value) > 1024
            ):
                raise BadRequest(f"bad {name}", f"{value!r}: give a name as a string")
        validate_partitions(self.partitions)
        if isinstance(self.partition_locations, (str, bytes)) or not all(
            isinstance(p, str) for p in self.partition_locations
        ):
            raise BadRequest("bad partitionLocations", "give a list of absolute paths or URLs")
        if self.partition_locations and self.table is None:
            raise BadRequest(
                "partitionLocations without a table",
                'partitionLocations are a table\'s partitions: give "table" too',
            )
        audit.clean(self.audit)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecycleRequest:
        """The request as the journal recorded it (`to_json`)."""
        return cls(**{k: v for k, v in d.items() if k in _REQUEST_FIELDS})

    def to_json(self) -> dict[str, Any]:
        return {
            "paths": list(self.paths),
            "mode": str(self.mode),
            "purge": self.purge,
            "op": str(self.op),
            "db": self.db,
            "table": self.table,
            "partitions": [dict(p) for p in self.partitions],
            "location": self.location,
            "partition_locations": list(self.partition_locations),
            "audit": self.audit,
        }


_REQUEST_FIELDS = frozenset(f.name for f in fields(RecycleRequest))


def validate_partitions(partitions: object) -> None:
    if not isinstance(partitions, (list, tuple)) or not all(
        isinstance(p, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in p.items())
        for p in partitions
    ):
        raise BadRequest("bad partitions", 'give a list of {"key": "value"} objects')


@dataclass(frozen=True)
class RecycledFile:
    path: str
    checksum: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "checksum": self.checksum, "size": self.size}


@dataclass(frozen=True)
class RecycleResult:
    event_id: int
    files: list[RecycledFile]
    op: str = "DELETE"  # the event's type (for metrics; not part of the answer)
    again: bool = False  # a retried commit's answer: nothing moved now (not counted twice)

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "files": [f.to_json() for f in self.files]}


@dataclass
class _Statement:
    """A prepared transaction as a join checks its new part against it: what
    `_one_table` and the copy-mode dedupe need of the files staged so far, so that a
    join costs its own part, not every earlier one (a statement can join thousands of
    parts of one file each). Read and changed only under the transaction's lock; built
    from the journal by the first join, and again after a restart (`Recycler._statement`)."""

    next_seq: int = 0  # the next part's first file number
    keys: set[str] = field(default_factory=set)  # every file staged so far
    locations: list[str] = field(default_factory=list)  # partition locations `tables` knows
    # The files staged so far outside `locations`, by table (`_table_of`), in seq order:
    # all in one table, or none, once a join has checked them.
    tables: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def add(self, req: RecycleRequest, files: Iterable[tuple[int, Root, str, str]]) -> None:
        """Record files (seq, root, path below it, key) of the transaction, whose request
        with them included is `req`."""
        self.refile(req)
        declared = _dirs(self.locations)
        for seq, root, rel, key in files:
            self.next_seq = max(self.next_seq, seq + 1)
            self.keys.add(key)
            if req.table is not None and not _in_any(key, declared):
                self.tables.setdefault(_table_of(root, rel), []).append(key)

    def refile(self, req: RecycleRequest) -> None:
        """Take the files in partition locations that `req` declares anew out of `tables`:
        they are the labelled table's whatever their directory (see `_one_table`)."""
        new = [d for d in req.partition_locations if d not in self.locations]
        if not new:
            return
        self.locations += new
        fresh = _dirs(new)
        self.tables = {
            table: kept
            for table, keys in self.tables.items()
            if (kept := [k for k in keys if not _in_any(k, fresh)])
        }


@dataclass
class _Ahead:
    """One prepared part's objects, published by the background publisher once the part is
    prepared, while its statement goes on. `private`: the files (by seq) whose object must
    be a copy of their bytes (other names at prepare; the copy was made then).
    `published`: the files whose object is in place; `flushed`: every one of them, and the
    whole part, is durable (syncfs after the last link)."""

    items: list[Item]
    first: bool  # the transaction's first part: with it, this process prepared them all
    private: set[int] = field(default_factory=set)
    published: set[int] = field(default_factory=set)
    flushed: bool = False
    future: Future[None] | None = None


@dataclass
class Recycler:
    layout: Layout
    index: Index
    objects: Objects
    warehouse: Warehouse
    config: StoreConfig
    clock: Callable[[], float]
    workers: int = field(default_factory=cks.default_workers)
    server: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        self.journal = Journal(self.layout, self.index, self.objects, self.warehouse)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._statements: dict[str, _Statement] = {}  # of prepared transactions joined to
        # Parts published ahead of their commit, by txid; read and changed under the
        # transaction's lock, which waits for them (`_tx_lock`).
        self._ahead: dict[str, list[_Ahead]] = {}
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cmroot-publish")

    def close(self) -> None:
        """Wait for the objects being published ahead (none starts after this)."""
        self._publisher.shutdown(wait=True)

    def recycle(self, req: RecycleRequest, progress: Progress | None = None) -> RecycleResult:
        req, mode, items, dirs = self._plan(req, txid := uuid.uuid4().hex, 0)
        now = self.clock()

        def stage() -> bool:
            self.journal.begin(txid, now, mode, req.to_json(), dirs, items)
            with self.journal.sessions() as sessions:
                self._stage_all(txid, items, sessions, progress)
            faults.point("recycle.staged")
            return True

        return self._complete(txid, req, mode, items, dirs, now, stage)

    def _complete(
        self, txid: str, req: RecycleRequest, mode: Mode, items: list[Item], dirs: Sequence[str],
        now: float, publish: Callable[[], bool],
    ) -> RecycleResult:
        """Run `publish` (whatever makes every file an object; True unless what it did is
        already durable), flush, then record the event and entries and mark the
        transaction committed; any failure rolls it all back. Clean-up follows the
        commit."""
        try:
            if publish():
                self.layout.flush()
            faults.point("recycle.flushed")
            event_id = self.journal.commit(txid, self._event(req, items, now),
                                           self._entries(req, items, now))
        except faults.Crash:
            raise  # an injected crash: nothing more happens, as if the process died
        except BaseException as e:
            self._abort(txid, req, lambda: items, now, e)
            raise  # _abort raised already; this keeps type checkers sure
        finally:
            self.objects.release(txid, {it.checksum for it in items if it.checksum})
        self._finish(txid, mode, items, dirs)
        return RecycleResult(
            event_id, [RecycledFile(it.key, it.checksum or "", it.size) for it in items],
            str(req.op),
        )

    def _plan(
        self, req: RecycleRequest, txid: str, first_seq: int
    ) -> tuple[RecycleRequest, Mode, list[Item], list[str]]:
        """Check and confine a request and list its files (nothing moves): the request
        with its location canonical, its mode, its items numbered from `first_seq`, and
        the directories it names."""
        req.validate()
        if req.location is not None:
            req = replace(req, location=self.warehouse.locate(req.location).key)
        if req.partition_locations:
            req = replace(req, partition_locations=self._partition_dirs(req))
        mode = Mode(req.mode)
        located = self.warehouse.locate_all(req.paths)
        for loc in located:
            if self.warehouse.protects(loc):
                raise Forbidden(
                    "a warehouse root is never recycled",
                    f"{loc.key} is a warehouse root or contains one: name the tables or files"
                    " under it instead",
                )
        _one_table(req, ((loc.root, loc.rel, loc.key) for loc in located))
        found, dirs = self.warehouse.expand(located)
        items = [
            Item(i, f.key, f.rel, root, self.layout.staged_path(txid, i),
                 self._method(root, mode), f.size)
            for i, (root, f) in enumerate(found, first_seq)
        ]
        return req, mode, items, [d.key for d in dirs]

    def _method(self, root: Root, mode: Mode) -> Method:
        """How a file of `root` is staged: as its filesystem prefers, except that nothing
        is renamed into a store that is not a local directory. A move is then a take (the
        source removed once its copy is journaled), never a copy that leaves it until the
        commit: a prepared delete must be a delete, or a writer's new file at the path
        would replace bytes that an abort could then no longer bring back."""
        method = root.source.method(mode)
        return Method.TAKE if method == Method.RENAME and not self.layout.renames else method

    def _partition_dirs(self, req: RecycleRequest) -> list[str]:
        """The request's declared partition locations, confined and canonical. Never a root
        or above one, a database directory (`<root>/<db>.db`), or another table's directory
        by the warehouse layout (`<root>/<db>.db/<table>`): declared, those would file other
        tables' files under this one's label."""
        out: list[str] = []
        for d in req.partition_locations:
            loc = self.warehouse.locate(d)
            parts = loc.rel.split("/")
            own = (f"{req.db}.db" if req.db else parts[0], req.table)
            if self.warehouse.protected(loc.key):
                raise Forbidden(
                    "a warehouse root is not a partition",
                    f"{loc.key} is a warehouse root or contains one: give the partition's own"
                    " directory in partitionLocations",
                )
            if parts[0].endswith(".db") and (
                len(parts) == 1 or (len(parts) == 2 and (parts[0], parts[1]) != own)
            ):
                raise BadRequest(
                    "one table per recycle",
                    f"{loc.key} is a database directory or another table's directory: give"
                    f" the own directories of {req.table!r}'s partitions in partitionLocations",
                )
            out.append(loc.key)
        return out

    def _finish(self, txid: str, mode: Mode, items: Sequence[Item], dirs: Sequence[str]) -> None:
        try:
            self.journal.finish(txid, mode, items, dirs)
        except (OSError, CmrootError) as e:
            # Committed: nothing is lost. The record stays and the next open finishes it.
            self.index.quarantine_tx(txid, f"clean-up: {type(e).__name__}: {e}")
            log.warning("clean-up after a recycle failed; finished at next start",
                        extra={"txid": txid, "error": str(e)})

    def _abort(
        self, txid: str, req: RecycleRequest, items: Callable[[], Sequence[Item]], now: float,
        cause: BaseException,
    ) -> None:
        """Roll back after a failure, and raise what the client should see. `items` lists
        every file of the transaction: called only here, so a join need not load the files
        of earlier parts unless it fails, and a failure to load them quarantines the
        transaction like any other failed rollback."""
        retain = self.config.retain_for(req.db, req.table)
        try:
            displaced = self.journal.rollback(txid, items(), req.to_json(), now, retain)
        except Exception as e:
            self.index.quarantine_tx(txid, f"rollback: {type(e).__name__}: {e}")
            log.error("recycle could not be rolled back: quarantined",
                      extra={"txid": txid, "error": str(e), "cause": str(cause)})
            raise RecycleFailed(
                "recycle failed and could not be rolled back",
                f"{cause}; then {e}: transaction {txid} is quarantined with its files kept"
                " in the store's staging area; nothing is lost and no event was recorded."
                " Run `cmroot fsck` for details; it is retried at the next start",
            ) from cause
        if displaced:
            raise RecycleFailed(
                "recycle failed and was rolled back",
                f"{cause}; every file is back at its source except {len(displaced)} whose"
                f" path a writer re-created meanwhile ({', '.join(displaced[:5])}"
                f"{', ...' if len(displaced) > 5 else ''}): their old bytes are kept in the"
                " store, retrievable by path and old checksum, with no event recorded",
            ) from cause
        if isinstance(cause, CmrootError) or not isinstance(cause, Exception):
            raise cause
        if isinstance(cause, OSError) and cause.errno in _CHANGED:
            raise Conflict(
                "a file changed while it was recycled",
                f"{cause}; the recycle was rolled back and every file is back at its source:"
                " another writer (or recycle) changed these paths meanwhile; try again",
            ) from cause
        if _out_of_space(cause):
            raise StoreFull(
                "the store is out of space",
                f"{cause}; the recycle was rolled back and every file is back at its source:"
                f" free space on the filesystem of {self.layout.root}",
            ) from cause
        raise RecycleFailed(
            "recycle failed and was rolled back", f"{cause}; every file is back at its source"
        ) from cause

    # -- stage, hash, publish -------------------------------------------------------------
    def _stage_all(
        self, txid: str, items: list[Item], sessions: Sessions, progress: Progress | None,
        ahead: _Ahead | None = None,
    ) -> None:
        """Stage, hash and publish every file, a few threads at once; preparing (`ahead`,
        the prepared part), stage and hash only, and tell `ahead` which files need a
        private object. Work is handed out in batches: per-file task overhead would
        otherwise rival the work on small files."""
        failed = threading.Event()
        done = 0
        done_lock = threading.Lock()

        def batch(chunk: list[Item]) -> None:
            nonlocal done
            for it in chunk:
                if failed.is_set():
                    return
                try:
                    self._stage(txid, it, sessions, ahead)
                except BaseException:
                    failed.set()
                    raise
            if progress:
                with done_lock:
                    done += len(chunk)
                    progress(done, len(items))

        # Small files published on the way are GIL-bound: threads only contend for it
        # (measured 1.6x slower on 64 KiB files). Large ones are hashed with the GIL
        # released, so threads pay; so do a prepare's renames and reads of many small
        # ones, which publishes nothing (2,000 x 64 KiB: 10% faster in-process, the
        # prepare of a Spark statement 0.16 -> 0.12 s, 2 cores).
        total = sum(it.size for it in items)
        many = ahead is not None and len(items) >= _PARALLEL_MIN_FILES
        workers = self.workers if many or total >= _PARALLEL_MIN_SIZE * max(1, len(items)) else 1
        size = max(1, min(_BATCH, len(items) // (workers * 4) or 1))
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        if workers == 1:
            for chunk in chunks:  # no thread hand-off for GIL-bound work
                batch(chunk)
            return
        batches = _Batches()
        pool = ThreadPoolExecutor(max_workers=workers)
        try:
            futures = []
            for chunk in chunks:
                futures.append(pool.submit(batches.run, batch, chunk))
            for f in futures:
                f.result()
        except BaseException:
            failed.set()  # the other threads stop at their next file
            raise
        finally:
            try:
                batches.close_and_wait(failed)
            finally:
                pool.shutdown(wait=False, cancel_futures=True)  # idle threads exit

    def _stage(self, txid: str, it: Item, sessions: Sessions, ahead: _Ahead | None) -> None:
        session = sessions.open(it.root)
        if it.method == Method.RENAME:
            try:
                session.rename_out(it.rel, it.staged)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                self.journal.fall_back_to_take(txid, it)
        faults.point("recycle.file_staged")
        if it.method == Method.RENAME:
            # Read, not mmap: the inode is the warehouse file's, and a straggler writer
            # truncating a mapped file would kill the daemon with SIGBUS. A symlink or a
            # directory swapped in since the listing is refused here (and put back as is).
            it.checksum, it.size, st = cks.of_regular_file(it.staged)
            nlink = st.st_nlink
        else:
            it.checksum, it.ident = self.layout.stage_copy(session, it.rel, it.staged)
            info = self.layout.staged_info(it.staged)
            if info is None:
                raise NotFound("staged file vanished", f"{it.staged} is gone from the store")
            it.size, nlink = info.size, info.nlink
            if it.method == Method.TAKE:
                self._take(txid, it, session)
        if ahead is None:
            # Staged and published in one go: no prepare made a private copy before.
            self._publish(txid, it, self.layout.needs_private(it.staged, nlink, fresh=True))
        elif nlink > 1:
            # Prepared: copy a hard-linked file's bytes now, while they are the ones just
            # hashed, not at commit, after the statement's other names may have changed.
            self.layout.private_copy(it.staged, it.checksum)
            ahead.private.add(it.seq)

    def _take(self, txid: str, it: Item, session: Session) -> None:
        """Remove a copied source now, as a rename would have (a prepared delete is a
        delete: the caller may write a new file at the path before it commits). Only the
        object that was copied: one rewritten or removed since fails the recycle."""
        assert it.ident is not None
        self.journal.copied(txid, it)
        faults.point("recycle.copy_journaled")
        if not session.remove_if_unchanged(it.rel, it.ident, self.journal.take_tag(txid, it)):
            # Not taken (a writer changed or removed it): the copy goes first, so that no
            # rollback puts back a file this recycle never removed.
            self.layout.unlink_staged(it.staged)
            it.checksum = None
            raise Conflict(
                "a file changed while it was recycled",
                f"{it.key} was rewritten or removed after it was copied into the store; the"
                " recycle was rolled back and nothing of it recorded: try again",
            )
        faults.point("recycle.source_taken")

    def _publish(self, txid: str, it: Item, private: bool) -> bool:
        """Publish one file's object (`private`: a copy of its bytes, not its inode); True
        if this made it (False: deduplicated)."""
        assert it.checksum is not None
        made = self.objects.publish(txid, it.checksum, it.staged, private=private)
        faults.point("recycle.file_published")
        return made

    # -- what a commit records ------------------------------------------------------------
    def _entries(self, req: RecycleRequest, items: Sequence[Item], now: float) -> list[Entry]:
        return entries_of(items, req.to_json(), now, self.config.retain_for(req.db, req.table))

    def _event(self, req: RecycleRequest, items: Sequence[Item], now: float) -> Event:
        return Event(
            id=0,
            type=req.op,
            db=req.db,
            table=req.table,
            partitions=[dict(p) for p in req.partitions],
            timestamp=now,
            server=self.server,
            purge=req.purge,
            files=[{"path": it.key, "checksum": it.checksum, "size": it.size} for it in items],
            location=req.location,
            audit=audit.clean(req.audit),
        )

    # -- two-phase: prepare, then commit or abort ------------------------------------------
    def prepare(
        self, req: RecycleRequest, lease: float, txid: str | None = None,
        progress: Progress | None = None,
    ) -> Prepared:
        """Stage and hash the files of `req` (nothing is published or recorded: no one
        sees them yet) and hold them until `commit` or `abort`, or until `lease` seconds
        pass without a `renew`. With `txid`, the files join that prepared transaction
        (another recycle of the same statement); if they cannot, the whole transaction
        is rolled back, every earlier part included: a statement is one unit."""
        until = self.clock() + _lease(lease)
        if txid is None:
            new = uuid.uuid4().hex
            req, mode, items, dirs = self._plan(req, new, 0)
            with self._tx_lock(new):
                self._stage_prepared(
                    new, req, items, until, progress, True,
                    lambda: self.journal.begin(new, self.clock(), mode, req.to_json(), dirs,
                                               items),
                    lambda: [],
                )
                return Prepared.of(new, items, until, len(items))
        joined = txid
        with self._tx_lock(joined):
            tx = self._prepared(joined, rows=False)
            until = max(until, tx.lease or 0.0)  # a part never shortens the statement's lease
            # Out of the map while this part joins, back only once it has: a join that fails
            # leaves nothing behind that could disagree with the journal.
            found = self._statements.pop(joined, None)
            statement = self._statement(joined) if found is None else found
            first_seq = statement.next_seq

            def earlier() -> list[Item]:
                return [it for t in self.index.pending(joined)
                        for it in self.journal.items_of(t) if it.seq < first_seq]

            merged = RecycleRequest.from_json(tx.request)
            try:
                req, mode, items, dirs = self._plan(req, joined, first_seq)
                merged = _merge(merged, req)
                statement.refile(merged)
                # Every part is filed under the statement's one label.
                _one_table(merged, ((it.root, it.rel, it.key) for it in items), statement.tables)
                # Copy mode leaves sources in place: a file named by two parts is one file.
                items = [it for it in items if it.key not in statement.keys]
            except BaseException as e:
                self._abort(joined, merged, earlier, self.clock(), e)
                raise

            def join() -> None:
                if not self.index.journal_join(
                    joined, merged.to_json(), list(dict.fromkeys([*tx.dirs, *dirs])),
                    ((it.seq, it.key, it.staged, it.method) for it in items),
                ):
                    raise self._gone(joined)

            self._stage_prepared(joined, merged, items, until, progress, False, join,
                                 earlier)
            statement.add(merged, ((it.seq, it.root, it.rel, it.key) for it in items))
            self._statements[joined] = statement
            return Prepared.of(joined, items, until, len(statement.keys))

    def _statement(self, txid: str) -> _Statement:
        """What the journal holds of a prepared transaction, as a join checks against it:
        built by its first join (then kept), so a statement of one part (a TRUNCATE of a
        million files) never holds its keys in memory, and again after a restart.
        Sources are placed under their roots by name: nothing is resolved again, the
        journal recorded them confined and canonical."""
        statement = _Statement()
        for tx in self.index.pending(txid):
            located = ((r.seq, self.warehouse.place(r.source)) for r in tx.rows)
            statement.add(
                RecycleRequest.from_json(tx.request),
                ((seq, loc.root, loc.rel, loc.key) for seq, loc in located),
            )
        return statement

    def _stage_prepared(
        self, txid: str, req: RecycleRequest, items: list[Item], until: float,
        progress: Progress | None, first: bool, record: Callable[[], None],
        earlier: Callable[[], list[Item]],
    ) -> None:
        """`record` the new part in the journal, stage and hash it, then mark the whole
        transaction prepared; any failure rolls back every part (`earlier` lists the files
        of the parts before this one). Then the background publisher links the part's
        objects while the statement goes on."""
        ahead = _Ahead(items, first)
        try:
            record()
            with self.journal.sessions() as sessions:
                self._stage_all(txid, items, sessions, progress, ahead)
            self.index.journal_prepared(
                txid, until, ((it.seq, it.checksum or "", it.size, it.ident) for it in items)
            )
        except faults.Crash:
            raise
        except BaseException as e:
            self._abort(txid, req, lambda: [*earlier(), *items], self.clock(), e)
            raise
        faults.point("recycle.prepared")
        # Only now: an object published before its checksum is journaled could not be
        # found again by a recovery after a crash (if a straggler writer changed the file
        # meanwhile, it would stay behind, sharing the warehouse file's inode).
        ahead.future = self._publisher.submit(self._publish_ahead, txid, ahead)
        self._ahead.setdefault(txid, []).append(ahead)

    def _publish_ahead(self, txid: str, ahead: _Ahead) -> None:
        """Publish a prepared part's objects and flush them while its statement goes on
        (its metastore transaction, its job commit), so that the commit only records.
        Nothing here is final: the objects are claimed, no entry names them, and a
        rollback removes them as it would a failed commit's. A failure only leaves the
        rest to the commit, which reports it."""
        try:
            for it in ahead.items:
                # A file with one name at prepare (the staged one, in our private staging
                # area, where nobody can give it another) is published as its inode; one
                # with more as the copy the prepare made. Only an object this made is
                # settled: one deduplicated against is compared again by the commit (it
                # may rot meanwhile, and the commit drops our copy).
                if self._publish(txid, it, it.seq in ahead.private):
                    ahead.published.add(it.seq)
            self.layout.flush()
            ahead.flushed = True
        except Exception as e:
            log.debug("objects not published ahead; the commit will",
                      extra={"txid": txid, "error": str(e)})

    def commit(self, txid: str) -> RecycleResult:
        """Publish a prepared transaction's files and record them with their one event.
        A commit retried after its answer was lost gets the same answer again."""
        with self._tx_lock(txid):
            event_id = self._committed(txid)
            if event_id is not None:
                files = self.index.event_files(event_id)
                return RecycleResult(
                    event_id,
                    [RecycledFile(f["path"], f["checksum"], f["size"]) for f in files],
                    again=True,
                )
            ahead = self._ahead.pop(txid, [])
            # Every part prepared since this process started: its files are in memory as
            # the journal has them; otherwise (a restart between parts) the journal's.
            whole = bool(ahead) and ahead[0].first
            tx = self._prepared(txid, rows=not whole)
            items = [it for a in ahead for it in a.items] if whole else self.journal.items_of(tx)
            done = {seq for a in ahead for seq in a.published}

            def publish() -> bool:
                for it in items:
                    if it.seq in done:
                        continue
                    # Claimed before it is looked at: a sweep must not take an object
                    # published ahead before a restart (claims live in memory) meanwhile.
                    self.objects.claim(txid, it.checksum or "")
                    if self.journal.observe(it) != FileState.PUBLISHED:
                        info = self.layout.staged_info(it.staged)
                        nlink = info.nlink if info is not None else 1
                        self._publish(txid, it, self.layout.needs_private(it.staged, nlink))
                return len(done) < len(items) or not all(a.flushed for a in ahead)

            return self._complete(txid, RecycleRequest.from_json(tx.request), Mode(tx.mode),
                                  items, tx.dirs, self.clock(), publish)

    def abort(self, txid: str) -> list[str]:
        """Put every file of a prepared transaction back. Returns the displaced paths
        (re-created by a writer meanwhile: their old bytes are kept, with no event)."""
        with self._tx_lock(txid):
            return self._roll_back(self._prepared(txid))

    def renew(self, txid: str, lease: float) -> float:
        """Extend a prepared transaction's lease; returns its new deadline. One whose
        lease has passed is rolled back, not renewed (`_prepared`)."""
        until = self.clock() + _lease(lease)
        with self._tx_lock(txid):
            self._prepared(txid, rows=False)
            if not self.index.journal_renew(txid, until):
                raise self._gone(txid)
        return until

    def expire(self) -> int:
        """Roll back the prepared transactions whose lease has passed (the statement that
        prepared them died or hung). Returns how many; one that fails is quarantined."""
        n = 0
        for txid in self.index.expired_prepared(self.clock()):
            with self._tx_lock(txid):
                found = self.index.pending(txid)
                if not found or found[0].state != TxState.PREPARED:
                    continue  # committed or aborted while we waited
                tx = found[0]
                if tx.lease is not None and tx.lease >= self.clock():
                    continue  # renewed meanwhile
                log.warning("prepared recycle not committed within its lease: rolled back",
                            extra={"txid": txid, "files": len(tx.rows)})
                try:
                    self._roll_back(tx)
                except CmrootError as e:
                    log.error("expired prepared recycle could not be rolled back",
                              extra={"txid": txid, "error": str(e)})
                    continue
                n += 1
        return n

    def _roll_back(self, tx: PendingTx) -> list[str]:
        """Roll back a prepared transaction: `tx` with its rows (`_prepared(rows=True)`)."""
        req = RecycleRequest.from_json(tx.request)
        retain = self.config.retain_for(req.db, req.table)
        try:
            return self.journal.rollback(
                tx.txid, self.journal.items_of(tx), tx.request, self.clock(), retain
            )
        except Exception as e:
            self.index.quarantine_tx(tx.txid, f"rollback: {type(e).__name__}: {e}")
            raise RecycleFailed(
                "prepared recycle could not be rolled back",
                f"{e}: transaction {tx.txid} is quarantined with its files kept in the"
                " store's staging area; nothing is lost and no event was recorded. Run"
                " `cmroot fsck` for details; it is retried at the next start",
            ) from e

    def _prepared(self, txid: str, rows: bool = True) -> PendingTx:
        """A prepared transaction still within its lease; without `rows`, without its file
        rows (a join or renew needs none, and reading them all made every join cost every
        file staged before it). One whose lease has passed is rolled back here and now,
        whether or not the expiry job got to it yet: the answer to a late commit, join,
        renew or abort never depends on timing."""
        found = self.index.pending(txid, rows) if _TXID.fullmatch(txid) else []
        if not found or found[0].state != TxState.PREPARED:
            raise self._gone(txid)
        tx = found[0]
        if tx.lease is not None and tx.lease < self.clock():
            self._roll_back(tx if rows else self.index.pending(txid)[0])
            raise self._gone(txid)
        return tx

    def _committed(self, txid: str) -> int | None:
        """The event a committed transaction recorded (None: not committed)."""
        return self.index.event_of_tx(txid) if _TXID.fullmatch(txid) else None

    def _gone(self, txid: str) -> CmrootError:
        """Why `txid` is no longer prepared: committed (409, so a late abort is never
        taken for a rollback), or rolled back, expired or unknown (404)."""
        event_id = self._committed(txid)
        if event_id is not None:
            return Conflict(
                "transaction already committed",
                f"{txid} was committed as event {event_id}: there is nothing to abort, "
                "renew or join; a new statement prepares a new transaction",
            )
        return NotFound(
            "no such prepared transaction",
            f"{txid[:64]!r} is not prepared: it was aborted or rolled back when its lease"
            " expired (or never existed); run the statement again",
        )

    @contextmanager
    def _tx_lock(self, txid: str) -> Iterator[None]:
        """One operation at a time per transaction (commit racing abort, a join racing
        the expiry timer): the later one finds the transaction gone."""
        with self._locks_lock:
            lock = self._locks.setdefault(txid, threading.Lock())
        with lock:
            # A part still being published ahead finishes first: a join, commit or
            # rollback then sees every file where the journal and the disk say it is.
            wait([a.future for a in self._ahead.get(txid, []) if a.future is not None])
            try:
                yield
            finally:
                with self._locks_lock:
                    state = self.index.tx_state(txid)
                    if state != TxState.PREPARED:  # committed, rolled back or quarantined
                        self._statements.pop(txid, None)
                        self._ahead.pop(txid, None)
                    if state is None:
                        self._locks.pop(txid, None)

    def recover(self) -> int:
        """Settle what a crash left (see Journal.recover). Returns how many transactions
        were rolled back or finished."""
        r = self.journal.recover(self.config.retain_for, self.clock())
        return r.rolled_back + r.finished


@dataclass(frozen=True)
class Prepared:
    """One prepared part of a transaction: the files it staged, how many the whole
    transaction holds (all its parts), and when it is rolled back unless committed or
    renewed."""

    txid: str
    files: list[RecycledFile]
    expires: float
    staged: int

    @classmethod
    def of(cls, txid: str, items: Sequence[Item], expires: float, staged: int) -> Prepared:
        # This part's files only: a statement that joins one file at a time (Hive's
        # deletes) would otherwise be answered with every earlier file again, n² in all.
        return cls(txid, [RecycledFile(it.key, it.checksum or "", it.size) for it in items],
                   expires, staged)

    def to_json(self) -> dict[str, Any]:
        return {"txid": self.txid, "files": [f.to_json() for f in self.files],
                "expires": self.expires, "staged": self.staged}


MAX_LEASE = 86400.0  # a statement holding files away for over a day is a stuck one
_TXID = re.compile(r"[0-9a-f]{32}")


def _lease(seconds: float) -> float:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 1 <= seconds <= MAX_LEASE
    ):
        raise BadRequest("bad lease", f"{seconds!r}: give seconds between 1 and {MAX_LEASE:.0f}")
    return float(seconds)


def _one_table(
    req: RecycleRequest, paths: Iterable[tuple[Root, str, str]],
    earlier: dict[tuple[str, str], list[str]] | None = None,
) -> None:
    """Refuse a recycle labelled as one table whose (root, path below it, key) span
    several tables (Hive layout: `<root>/<db>.db/<table>`, or `<root>/<table>` for
    `default`), or name a database directory; `earlier`: the files of a transaction's
    earlier parts by table (`_Statement.tables`), which count as if listed first.
    Refused rather than warned about: replicas replay the event, so files filed under
    the wrong table are dropped or restored with it there, long after a warning scrolled
    by."""
    if req.table is None:
        return
    tables = {table: keys[0] for table, keys in (earlier or {}).items()}
    declared = _dirs(req.partition_locations)
    for root, rel, key in paths:
        if _in_any(key, declared):
            continue  # in a partition's own location, declared as the table's
        if "/" not in rel and rel.endswith(".db"):
            raise BadRequest(
                "one table per recycle",
                f"{key} is database {rel[:-3]!r}, with all its tables: name the table's"
                ' directory, or leave out "table" (--table)',
            )
        tables.setdefault(_table_of(root, rel), key)
    if len(tables) > 1:
        a, b = list(tables.values())[:2]
        raise BadRequest(
            "one table per recycle",
            f"{a} and {b} are in different tables, and the recycle is labelled as table "
            f"{req.table!r}: recycle each table on its own with its own \"table\" (--table), "
            'or leave out "table"',
        )


def _table_of(root: Root, rel: str) -> tuple[str, str]:
    """The table directory a path below `root` lies in: (root, `<db>.db/<table>` or
    `<table>`)."""
    parts = rel.split("/")
    return root.url, "/".join(parts[: 2 if parts[0].endswith(".db") else 1])


def _dirs(dirs: Iterable[str]) -> frozenset[str]:
    return frozenset(d.rstrip("/") for d in dirs)


def _in_any(key: str, known: frozenset[str]) -> bool:
    """Is `key` one of the directories `known` (from `_dirs`) or under one? By its
    ancestors, not by every directory: a request may declare many and name many paths."""
    if not known:
        return False
    at = key.rstrip("/")
    while at:
        if at in known:
            return True
        cut = at.rfind("/")
        if cut <= 0 or at[:cut].endswith(":/"):  # "/" or "s3://": no ancestor to test
            return False
        at = at[:cut]
    return False


def _merge(first: RecycleRequest, more: RecycleRequest) -> RecycleRequest:
    """The request of a transaction after one more part of its statement joined it."""
    for name in ("mode", "op", "db", "table", "purge"):
        if getattr(first, name) != getattr(more, name):
            raise Conflict(
                "a transaction is one statement",
                f"{name} {getattr(more, name)!r} differs from the transaction's"
                f" {getattr(first, name)!r}: prepare another transaction for it",
            )
    partitions = [dict(p) for p in first.partitions]
    partitions += [dict(p) for p in more.partitions if dict(p) not in partitions]
    dirs = list(dict.fromkeys([*first.partition_locations, *more.partition_locations]))
    return replace(
        first, paths=[*first.paths, *more.paths], partitions=partitions, partition_locations=dirs
    )


# A source that vanished, or whose path changed shape, between listing and staging.
# ENXIO: a socket, which cannot be opened.
_CHANGED = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ESTALE, errno.ENXIO}
)


class _Batches:
    """The staging batches of one part, and the wait for them before a rollback. Not
    `pool.shutdown(wait=True)`: an interrupt (a Ctrl-C of an in-process caller, which
    lands in the waiting thread) can make it return while a thread still moves a file.
    In the pool's thread start (inside `submit`) it leaves a running worker out of the
    pool's threads; in `Thread.join` (CPython 3.11) it can mark a running thread stopped.
    Here each batch counts itself in, and none starts once the wait began."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False

    def run(self, fn: Callable[[list[Item]], None], chunk: list[Item]) -> None:
        with self._cond:
            if self._closed:
                return
            self._running += 1
        try:
            fn(chunk)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def close_and_wait(self, failed: threading.Event) -> None:
        """Start no more batches and wait for the running ones, through interrupts too:
        the rollback that follows a failure must never run while a thread still moves a
        file. An interrupt received meanwhile is raised once they have stopped."""
        interrupted: BaseException | None = None
        while True:
            try:
                with self._cond:
                    self._closed = True
                    while self._running:
                        self._cond.wait()
                break
            except BaseException as e:
                failed.set()
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted


def _out_of_space(e: BaseException) -> bool:
    """ENOSPC/EDQUOT from the filesystem, or SQLite's "database or disk is full"."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, sqlite3.OperationalError) and "full" in str(e)

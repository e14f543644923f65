"""The recycle journal: the one place that decides what a crash or a failure leaves.

Each file of a recycle moves through these states (`vocab.FileState`):

    planned --rename--> staged-by-rename --hash, link--> published --+
            --copy----> staged-by-copy   --hash, link--> published --+--commit--> committed
                                                                            --clean-up--> cleaned

What is durable: the transaction and, per file, its source, staged name and *method*
(written before the file moves, and rewritten before a refused rename falls back to a
copy), then, in the one SQLite transaction that records the event, the committed state
and the identities of copied sources. Everything else is observed on disk, so recovery
never guesses: a staged file of a rename is the source itself; one of a copy is a copy
(maybe partial) of a source that never left; one of a take is a copy whose source was
removed only after the copy's checksum was journaled (no checksum: it never left).

Rolling back an open transaction (a failure, or recovery after a crash), per file:
- unpublish: an object that is a hard link of the staged file is removed if nobody else
  uses it, else given bytes of its own, so no warehouse file ever shares an inode with a
  store object;
- a copy is dropped; a renamed file goes back to its source path with a link that never
  clobbers, and a taken one (copied off an object store, then removed there) is uploaded
  back by an exclusive create: if a writer re-created that path meanwhile, the old bytes
  stay in the store as a *displaced* entry (retrievable by path and old checksum,
  recorded with no event: no replica may replay a drop that did not happen).
A committed transaction is finished instead: copied sources are removed (only if
unchanged), staging names and emptied directories go. Each transaction is recovered on
its own: one that fails is quarantined (kept, reported, retried at the next open) and
the others go on."""

from __future__ import annotations

import functools
import hmac
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.index import Entry, Event, Index, PendingTx
from cmroot.store.layout import Layout, StagedInfo
from cmroot.store.layout.local import LocalLayout
from cmroot.store.objects import Objects
from cmroot.store.source import RootUnavailable, Session
from cmroot.store.warehouse import Root, Warehouse
from cmroot.vocab import FileState, Method, Mode, TxState

log = logging.getLogger(__name__)


@dataclass
class Item:
    """One file of a transaction, as the forward path and the rollback both see it."""

    seq: int
    key: str
    rel: str
    root: Root
    staged: str
    method: Method
    size: int = 0
    checksum: str | None = None
    ident: str | None = None  # a copied source's identity, for its removal after commit


@dataclass
class Recovery:
    """What `Journal.recover` did at open."""

    rolled_back: int = 0
    finished: int = 0
    quarantined: list[str] = field(default_factory=list)
    displaced: list[str] = field(default_factory=list)


class Journal:
    def __init__(
        self, layout: Layout, index: Index, objects: Objects, warehouse: Warehouse
    ) -> None:
        self.layout = layout
        self.index = index
        self.objects = objects
        self.warehouse = warehouse

    @functools.cached_property
    def _take_key(self) -> bytes:
        return self.index.take_key()

    def take_tag(self, txid: str, it: Item) -> str:
        """The name a take hides file `it`'s source under between its check and its
        removal (Session.remove_if_unchanged): the rollback finds it again by this name,
        which no writer can guess (keyed) to plant a file there."""
        return hmac.new(self._take_key, f"{txid}/{it.seq}".encode(), "sha256").hexdigest()[:32]

    # -- the forward path's records ------------------------------------------------------
    def begin(
        self, txid: str, now: float, mode: Mode, request: dict[str, Any], dirs: Sequence[str],
        items: Sequence[Item],
    ) -> None:
        self.index.journal_begin(
            txid, now, mode, request, dirs,
            ((it.seq, it.key, it.staged, it.method) for it in items),
        )
        faults.point("journal.begun")
        self.layout.begin_tx(txid)

    def fall_back_to_take(self, txid: str, it: Item) -> None:
        """A rename was refused (EXDEV: another filesystem, or a bind mount): record that
        this file is taken instead (copied, then its source removed as a rename removes
        it), before the copy starts."""
        self.index.journal_set_method(txid, it.seq, Method.TAKE)
        it.method = Method.TAKE

    def copied(self, txid: str, it: Item) -> None:
        """A take's copy is whole: record it before the source goes (see `_undo`)."""
        assert it.checksum is not None and it.ident is not None
        self.index.journal_copied(txid, it.seq, it.checksum, it.size, it.ident)

    def commit(self, txid: str, event: Event, entries: Sequence[Entry]) -> int:
        event_id = self.index.commit_recycle(txid, event, entries)
        faults.point("journal.committed")
        return event_id

    @contextmanager
    def sessions(self) -> Iterator[Sessions]:
        """Source sessions, one per root, opened on first use."""
        with ExitStack() as stack:
            yield Sessions(stack)

    # -- after commit ---------------------------------------------------------------------
    def finish(
        self, txid: str, mode: Mode, items: Sequence[Item], dirs: Sequence[str]
    ) -> None:
        """Clean up a committed transaction: copied sources (moved, and unchanged since),
        staging names, emptied directories; then close the record. Idempotent."""
        with self.sessions() as sessions:
            if mode == Mode.MOVE:
                # A move copies nothing any more (a refused rename is a take), but a
                # journal committed by an earlier version may still name copied sources.
                for it in items:
                    if it.method == Method.COPY and it.ident is not None:
                        session = sessions.open(it.root)
                        if not session.remove_if_unchanged(
                            it.rel, it.ident, self.take_tag(txid, it), resumed=True
                        ):
                            log.warning(
                                "recycled copy's source changed since; left in place",
                                extra={"path": it.key, "txid": txid},
                            )
                        faults.point("journal.source_removed")
            self.layout.end_tx(txid)
            faults.point("journal.unstaged")
            for d in dirs:
                try:
                    loc = self.warehouse.locate(d)
                except CmrootError as e:  # became a symlink out of the roots, say: not ours
                    log.warning("emptied directory not removed", extra={"dir": d, "error": str(e)})
                    continue
                sessions.open(loc.root).remove_empty_dirs(loc.rel, self._keeper(loc.root.url))
        self.index.journal_end(txid)

    def _keeper(self, url: str) -> Callable[[str], bool]:
        """Which directories below root `url` clean-up must keep: roots and their parents."""
        return lambda rel: self.warehouse.protected(f"{url}/{rel}" if rel else url)

    # -- rollback -------------------------------------------------------------------------
    def rollback(
        self, txid: str, items: Sequence[Item], request: dict[str, Any], now: float,
        retain: float,
    ) -> list[str]:
        """Undo an open transaction. Returns the keys of displaced files (kept in the store
        without an event). Raises if a file cannot be put back; the caller quarantines."""
        self.index.journal_reopen(txid)  # a prepared one: no longer committable from here
        displaced: list[Item] = []
        with self.sessions() as sessions:
            for it in items:
                try:
                    state = self._undo(txid, it, sessions.open(it.root))
                except (OSError, RootUnavailable) as e:
                    # Its way back is gone (the parent became a file, or a symlink out of
                    # the root): keep it in the store rather than stop the whole rollback.
                    # A take's upload failed (the store unreachable, say): quarantined,
                    # retried at the next start, when it can usually go back.
                    info = self.layout.staged_info(it.staged)
                    if it.method != Method.RENAME or info is None or not info.regular:
                        raise
                    log.warning("a file cannot go back to its source path: kept in the store",
                                extra={"path": it.key, "error": str(e), "txid": txid})
                    state = FileState.STAGED_BY_RENAME
                if state == FileState.STAGED_BY_RENAME:
                    displaced.append(it)
                faults.point("journal.rolled_back_file")
        if displaced:
            self._keep_displaced(txid, displaced, request, now, retain)
        self.layout.end_tx(txid)
        self.index.journal_end(txid)
        return [it.key for it in displaced]

    def observe(self, it: Item) -> FileState:
        """Where one file of an open transaction is, from its journal row and the disk."""
        info = self.layout.staged_info(it.staged)
        if info is None:
            return FileState.PLANNED  # never moved, or already put back
        if info.regular and it.checksum is None:
            it.checksum = self.layout.hash_staged(it.staged)
        if it.checksum is not None and self.layout.published(it.staged, info, it.checksum):
            return FileState.PUBLISHED
        if it.method == Method.RENAME:
            return FileState.STAGED_BY_RENAME
        return FileState.STAGED_BY_COPY

    def _undo(self, txid: str, it: Item, session: Session) -> FileState:
        """Undo one file. Returns STAGED_BY_RENAME if it could not go back (displaced),
        else the state it was found in."""
        # A take's copy is whole only if its checksum was journaled (or, on the forward
        # path, known) before the source went; observe() hashes whatever is staged.
        whole = it.checksum is not None
        state = self.observe(it)
        if state == FileState.PLANNED:
            if it.checksum:
                self.objects.discard_unindexed(txid, it.checksum, made_only=True)
            return state
        assert it.checksum is not None or not _regular(self.layout.staged_info(it.staged))
        if state == FileState.PUBLISHED:
            assert it.checksum is not None
            if not self.objects.discard_unindexed(txid, it.checksum) and it.method == Method.RENAME:
                # Another recycle deduplicated against this object, or the index keeps
                # it: it stays, but with bytes of its own, not the warehouse file's inode.
                self._break_link(txid, it)
        elif it.checksum:
            # Deduplicated against an object another statement published ahead: if that
            # statement is gone too (rolled back before us), nobody needs it any more.
            self.objects.discard_unindexed(txid, it.checksum, made_only=True)
        if it.method == Method.COPY or (it.method == Method.TAKE and not whole):
            self.layout.unlink_staged(it.staged)  # the source never left (a take's copy
            # was never whole)
            return FileState.STAGED_BY_COPY
        if it.method == Method.TAKE and it.ident is not None and session.take_back(
            it.rel, it.ident, self.take_tag(txid, it)
        ):
            # Died between moving its source aside and removing it: that file is back.
            self.layout.unlink_staged(it.staged)
            return FileState.PLANNED
        # A rename, or a take whose copy was whole: the source may be gone. It goes back
        # unless its path holds other bytes now (then the old ones are kept, displaced).
        if self.layout.put_back(session, it.rel, it.staged):
            return FileState.PLANNED
        return FileState.STAGED_BY_RENAME

    def _break_link(self, txid: str, it: Item) -> None:
        assert it.checksum is not None
        # Only a rename shares an inode with the warehouse, and only a local store renames.
        assert isinstance(self.layout, LocalLayout)
        self.layout.break_link(txid, it.seq, it.staged, it.checksum)

    def _keep_displaced(
        self, txid: str, items: list[Item], request: dict[str, Any], now: float, retain: float,
    ) -> None:
        """A file whose source path was re-created while it was away cannot go back without
        clobbering the new file: keep the old bytes in the store, recorded for (path, old
        checksum) as an entry with no event. The log claims no drop."""
        for it in items:
            assert it.checksum is not None
            info = self.layout.staged_info(it.staged)
            assert info is not None
            it.size = info.size
            self.objects.publish(txid, it.checksum, it.staged,
                                 private=self.layout.needs_private(it.staged, info.nlink))
        self.layout.flush()
        known = self.index.recorded([(it.key, it.checksum or "") for it in items])
        # Skip what an earlier try already kept.
        fresh = [it for it in items if (it.key, it.checksum) not in known]
        entries = entries_of(fresh, request, now, retain)
        self.index.commit_recycle(None, None, entries)
        self.objects.release(txid, {it.checksum for it in items if it.checksum})
        for it in items:
            self.layout.unlink_staged(it.staged)
        log.warning(
            "source re-created during a failed recycle: kept the old bytes in the store,"
            " with no event",
            extra={"txid": txid, "files": [it.key for it in items]},
        )

    # -- recovery -------------------------------------------------------------------------
    def recover(self, retain_for: Any, now: float) -> Recovery:
        """Settle every transaction a crash (or an earlier failed rollback) left: finish the
        committed, roll back the open, quarantine any that fails. Never raises for one."""
        out = Recovery()
        for txid in self.index.pending_txids():
            found = self.index.pending(txid)
            if not found:
                continue
            tx = found[0]
            try:
                items = self.items_of(tx)
                mode = Mode(tx.mode)
                if tx.state == TxState.COMMITTED:
                    self.finish(tx.txid, mode, items, tx.dirs)
                    out.finished += 1
                elif tx.state == TxState.PREPARED and (tx.lease or 0) >= now:
                    continue  # its statement may still commit it: the lease decides
                else:
                    log.warning(
                        "rolling back an interrupted recycle",
                        extra={"txid": tx.txid, "files": len(items), "state": tx.state},
                    )
                    retain = retain_for(tx.request.get("db"), tx.request.get("table"))
                    out.displaced += self.rollback(
                        tx.txid, items, tx.request, now, retain
                    )
                    out.rolled_back += 1
            except Exception as e:  # one stuck transaction must not keep the daemon down
                self.index.quarantine_tx(tx.txid, f"{type(e).__name__}: {e}")
                out.quarantined.append(tx.txid)
                log.error(
                    "recycle transaction could not be recovered: quarantined",
                    extra={"txid": tx.txid, "state": tx.state, "error": str(e),
                           "fix": "see `cmroot fsck`; it is retried at every start"},
                )
        try:
            self._clear_orphans()
        except Exception as e:  # leftovers are only tidied: never a reason not to start
            log.error("could not tidy the staging area; fsck reports what is there",
                      extra={"error": str(e)})
        return out

    def items_of(self, tx: PendingTx) -> list[Item]:
        """A journaled transaction's files, as the forward path knew them. Each source is
        placed under its root by name: the journal recorded it confined and canonical, and
        every later step reaches it through directory descriptors with no symlink
        followed, so resolving it again would only cost a realpath() per file (and refuse
        to put back a file whose parent became a symlink meanwhile)."""
        out = []
        for row in tx.rows:
            loc = self.warehouse.place(row.source)
            it = Item(row.seq, loc.key, loc.rel, loc.root, row.staged, Method(row.method),
                      row.size or 0, row.checksum)
            it.ident = row.ident
            out.append(it)
        return out

    def _clear_orphans(self) -> None:
        """Staging directories with no journal record (left by an older release, whose
        clean-up ran after closing the record): a file there that is also a present object
        goes; anything else stays, for fsck to report."""
        live = set(self.index.pending_txids())
        for name in self.layout.transactions():
            if name in live:
                continue
            kept = False
            for path in self.layout.staged_files(name):
                c = self.layout.hash_staged(path)
                if self.index.get_object(c) is not None and self.layout.object_exists(c):
                    self.layout.unlink_staged(path)
                else:
                    kept = True
            if not kept:
                self.layout.end_tx(name)


class Sessions:
    """Source sessions of one piece of work, a root's opened the first time it is needed
    (by any of the staging threads) and all closed together."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, root: Root) -> Session:
        s = self._open.get(root.url)  # a dict read is atomic: the lock guards inserts only
        if s is not None:
            return s
        with self._lock:
            s = self._open.get(root.url)
            if s is None:
                s = self._stack.enter_context(root.source.session())
                self._open[root.url] = s
            return s


def entries_of(
    items: Sequence[Item], request: dict[str, Any], now: float, retain: float
) -> list[Entry]:
    """The entries recording `items` as recycled by `request` (RecycleRequest.to_json())."""
    partitions = request.get("partitions") or []
    return [
        Entry(
            path=it.key,
            checksum=it.checksum or "",
            size=it.size,
            recycled=now,
            expires=now + retain,
            op=str(request.get("op") or "DELETE"),
            db=request.get("db"),
            table=request.get("table"),
            partition=partition_of(it.key, partitions),
            purge=bool(request.get("purge")),
        )
        for it in items
    ]


def partition_of(path: str, partitions: Sequence[dict[str, str]]) -> dict[str, str] | None:
    """The request partition a file belongs to: the one whose k=v pairs are all segments
    of its path, or the only one given."""
    segments = set(path.split("/"))
    for p in partitions:
        if p and all(f"{k}={v}" in segments for k, v in p.items()):
            return dict(p)
    return dict(partitions[0]) if len(partitions) == 1 else None


def _regular(info: StagedInfo | None) -> bool:
    return info is not None and info.regular

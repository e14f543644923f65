"""fsck: check that the objects on disk and the index agree, and that every object's bytes
hash to its name.

What it never does: destroy what it could not read. A shard directory or an object that
cannot be read (EIO, EACCES, ...) is reported under `unreadable` and left alone, and the
index rows it may hold are kept, with or without `--repair`.

What `--repair` does:
- an object the index lacks is re-registered (never deleted), for a full retention;
- a valid object (its bytes hash to its name) in the wrong shard directory is moved to its
  place if that is free (or holds a corrupt copy, which is quarantined); a stray duplicate of
  a valid, correctly placed copy is removed once both are compared byte for byte;
- an object whose bytes do not hash to its name is moved to
  `<store>/quarantine/<checksum>.<unix time>` (the daemon's name for what it quarantines);
- index rows are forgotten only when, after all of the above, no file is at the object's
  place and no valid copy of it was found anywhere in the store.
Stray files are reported, never touched.

Online (`online=True`: inside the running daemon, or read-only beside it), recycles,
rollbacks and sweeps go on while the walk runs. In the daemon each finding is decided
again, when it is reported and acted on, under the lock publishes, rollbacks and sweeps
take (`Objects.settled`): an object a recycle is between its publish and its index commit
is neither unindexed nor registered, one a rollback removed is not registered, one healed
since it was hashed is not quarantined, and a sweep unlinks and forgets under that lock,
so a row with no object under it is a real loss. Beside the daemon (a read-only store, no
lock) findings are looked at again after the walk; work in flight at that moment (a
recycle between publish and commit, a sweep between unlink and forget) can still show:
the CLI checks through the daemon whenever it can reach it.

It streams: `objects/` is walked one shard directory at a time (`ab`; `ab/cd` in a
two-level store) in sorted order and compared with the index rows of that shard alone
(`Index.objects_between`), so memory is one shard's worth, not the store's. Rows whose
shard directory is absent are found by visiting every shard prefix the index has (a small
index) or every possible prefix (a large one), never by loading all checksums. Report
lists are capped (`limit`); counts are always exact.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmroot import checksum as cks
from cmroot import faults
from cmroot.index import Index, PendingTx, StoredObject
from cmroot.store.layout import OBJECT_NAME as _NAME
from cmroot.store.layout import SHARD_NAME as _PREFIX
from cmroot.store.layout import Layout, fsync_dir, same_bytes
from cmroot.store.layout.local import LocalLayout
from cmroot.store.objects import Objects
from cmroot.vocab import TxState

LIMIT = 1000  # items kept per report list; counts are always complete
# Up to this many indexed objects, the shards the index uses are found with one query per
# top-level prefix (at most this many rows held at once); above it, every possible shard
# (256, or 65,536 in a two-level store) is asked for its own rows (about a second of
# queries, next to hours of hashing such a store).
SMALL_INDEX = 65_536

KINDS = (
    "unindexed",
    "missing",
    "corrupt",
    "stray",
    "unreadable",
    "misplaced",
    "quarantined_transactions",
)


@dataclass
class FsckReport:
    repair: bool
    limit: int = LIMIT
    checked: int = 0  # object files read and hashed
    shards: int = 0  # shard directories visited
    unindexed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)  # {path, error}
    misplaced: list[dict[str, str]] = field(default_factory=list)  # {path, checksum, action}
    quarantined_transactions: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, kind: str, item: Any) -> None:
        self.counts[kind] += 1
        items: list[Any] = getattr(self, kind)
        if len(items) < self.limit:
            items.append(_printable(item))

    @property
    def truncated(self) -> bool:
        """Whether some list holds fewer items than its count (see `counts`)."""
        return any(self.counts[k] > len(getattr(self, k)) for k in KINDS)

    @property
    def clean(self) -> bool:
        return not any(self.counts.values())

    @property
    def needs_attention(self) -> bool:
        """Findings no repair fixes: a person must look (unreadable files, recycle
        transactions recovery could not finish)."""
        return bool(self.counts["unreadable"] or self.counts["quarantined_transactions"])

    def to_json(self) -> dict[str, Any]:
        return {
            "repair": self.repair,
            "checked": self.checked,
            "shards": self.shards,
            "clean": self.clean,
            "unindexed": self.unindexed,
            "missing": self.missing,
            "corrupt": self.corrupt,
            "stray": self.stray,
            "unreadable": self.unreadable,
            "misplaced": self.misplaced,
            "quarantined_transactions": self.quarantined_transactions,
            "counts": dict(self.counts),
            "truncated": self.truncated,
            "limit": self.limit,
        }


def fsck(
    layout: Layout,
    index: Index,
    now: float,
    retain: float,
    repair: bool = False,
    progress: Callable[[int, int], None] | None = None,
    limit: int = LIMIT,
    guard: Objects | None = None,
    online: bool = False,
) -> FsckReport:
    """Check (and with `repair`, fix) the store. `progress(done, total)` is called once per
    shard directory visited. `guard`: the writer's objects, whose lock and claims every
    repair decides under; `online`: recycles and sweeps run meanwhile (see above)."""
    if not isinstance(layout, LocalLayout):
        from cmroot.store.fsck_remote import fsck_remote

        return fsck_remote(layout, index, now, retain, repair, progress, limit, guard, online)
    report = FsckReport(repair, limit)
    owned, in_flight = _journaled(layout, index, None if online else report)
    if not online:
        _staging(layout, owned, report)
    with ThreadPoolExecutor(max_workers=cks.default_workers()) as pool:
        walk = _Walk(layout, index, now, retain, repair, report, pool)
        walk.in_flight = in_flight
        walk.guard = guard
        walk.online = online
        shards = walk.plan()
        for i, shard in enumerate(shards, 1):
            walk.shard(shard)
            report.shards += 1
            if progress:
                progress(i, len(shards))
        walk.settle()
        walk.finish()
    if online:
        # As things are at the end (a walk of hours sees transactions come and go): the
        # staging area is listed first, the journal read after (a transaction is journaled
        # before its directory exists and ends after it is removed).
        try:
            listed = sorted(os.listdir(layout.staging))
        except OSError:
            listed = []
        owned = _journaled(layout, index, report)[0]
        _staging(layout, owned, report, [n for n in listed if n not in owned])
    return report


def _journaled(
    layout: Layout, index: Index, report: FsckReport | None
) -> tuple[set[str], set[str]]:
    """(staging entries the journal's transactions own, objects they published ahead of
    their commit); troubled transactions are reported to `report` if given."""
    owned: set[str] = set()
    published: set[str] = set()
    for txid in index.pending_txids():  # one transaction's rows in memory at a time
        for tx in index.pending(txid):
            if report is not None:
                _transaction(layout, tx, report)
            owned |= _owned(layout, tx)
            published.update(r.checksum for r in tx.rows if r.checksum)
    return owned, published


def _printable(item: Any) -> Any:
    """A finding as JSON can carry it: the bytes of a file name that is not UTF-8 (Python's
    surrogate escapes) written as \\xNN."""
    if isinstance(item, str):
        return item.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(item, dict):
        return {k: _printable(v) for k, v in item.items()}
    return item


def describe(err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, "")
    text = err.strerror or str(err)
    return f"{name}: {text}" if name else text


# -- recycle transactions --------------------------------------------------------------------


def troubled(tx: PendingTx) -> bool:
    """A transaction recovery could not finish: its rollback failed (quarantined), or it
    committed and its clean-up failed (committed with an error)."""
    return tx.state == TxState.QUARANTINED or (
        tx.state == TxState.COMMITTED and tx.error is not None
    )


def _transaction(layout: Layout, tx: PendingTx, report: FsckReport) -> None:
    if troubled(tx):
        report.add(
            "quarantined_transactions",
            {
                "txid": tx.txid,
                "state": str(tx.state),
                "error": tx.error,
                "files": len(tx.rows),
                "staging": layout.tx_dir(tx.txid),
                "started": tx.started,
            },
        )


def _owned(layout: Layout, tx: PendingTx) -> set[str]:
    """The staging entries a transaction of the journal (troubled or not) owns: its
    directory, and wherever its rows say its files are staged."""
    owned = {os.path.basename(layout.tx_dir(tx.txid))}
    for row in tx.rows:
        rel = os.path.relpath(row.staged, layout.staging)
        if not rel.startswith(os.pardir):
            owned.add(rel.split(os.sep, 1)[0])
    return owned


def _staging(
    layout: Layout, owned: set[str], report: FsckReport, candidates: list[str] | None = None
) -> None:
    """Whatever is in staging and belongs to no transaction of the journal is stray (it is
    reported, never removed). `candidates`: names listed before the journal was read
    (online), stray only if still there now."""
    if candidates is not None:
        for name in candidates:
            path = os.path.join(layout.staging, name)
            if os.path.lexists(path):
                report.add("stray", path)
        return
    try:
        names = sorted(os.listdir(layout.staging))
    except FileNotFoundError:
        return
    except OSError as e:
        report.add("unreadable", {"path": layout.staging, "error": describe(e)})
        return
    for name in names:
        if name not in owned:
            report.add("stray", os.path.join(layout.staging, name))


# -- objects -------------------------------------------------------------------------------


def _after(prefix: str) -> str:
    """The smallest string above every checksum starting with this hex prefix."""
    n = int(prefix, 16) + 1
    return f"{n:0{len(prefix)}x}" if n < 16 ** len(prefix) else "g"


def _hash(path: str) -> tuple[str, int]:
    """Hash an object file, never following a symlink. Read, not mmap: on a failing disk a
    mapped read kills the process with SIGBUS, where read() reports EIO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return cks.of_stream(f), st.st_size


def _try_hash(path: str) -> tuple[str, int] | OSError:
    try:
        return _hash(path)
    except OSError as e:
        return e


def _regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return True  # cannot tell: hashing it will say (and report it unreadable)


class _Walk:
    def __init__(
        self,
        layout: LocalLayout,
        index: Index,
        now: float,
        retain: float,
        repair: bool,
        report: FsckReport,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.layout = layout
        self.index = index
        self.now = now
        self.retain = retain
        self.repair = repair
        self.report = report
        self.pool = pool
        # Shards with index rows whose object was not at its place: settled at the end,
        # once every misplaced copy has been seen (and moved home, on repair).
        self.recheck: set[str] = set()
        # Objects whose rows are never forgotten this run: a valid copy sits in a wrong
        # shard, or a file of that name could not be read (rarities: O(findings)).
        self.keep_rows: set[str] = set()
        # Objects quarantined this run: their rows go (unless a valid copy was found), but
        # they are reported corrupt, not missing.
        self.quarantined: set[str] = set()
        # Misplaced objects moved to a shard not yet visited: already hashed once.
        self.moved_ahead: set[str] = set()
        self.current = ""
        # A prepared transaction's objects, published ahead of its commit: its own, neither
        # unindexed nor to register (its commit indexes them, its rollback removes them).
        self.in_flight: set[str] = set()
        self.guard: Objects | None = None  # the writer's objects (in the daemon)
        self.online = False
        # Beside a running daemon: unindexed objects to look at again at the end, when
        # recycles that were in flight have committed; corrupt ones (paths) to hash again.
        self.deferred: list[str] = []
        self.deferred_corrupt: list[str] = []

    @contextlib.contextmanager
    def _settled(self, name: str) -> Iterator[bool]:
        """Decide and act on one object with no recycle between its publish and its index
        commit (True: none claims it); offline, nothing else runs."""
        if self.guard is None:
            yield True
        else:
            with self.guard.settled(name) as free:
                yield free

    # -- which shards to visit ----------------------------------------------------------
    def plan(self) -> list[str]:
        """Every shard (`Layout.shard_of`) present on disk or in the index, in sorted
        order, except under an unreadable top-level directory of a two-level store (an
        unreadable shard is reported when visited). Strays found on the way are
        reported."""
        top = self.layout.objects
        listed = self._list(top)
        if listed is None:
            return []
        two = self.layout.shard_levels == 2
        on_disk: set[str] = set()
        unreadable_tops: set[str] = set()
        for entry in listed:
            if not (_PREFIX.fullmatch(entry.name) and _is_dir(entry)):
                self.report.add("stray", entry.path)
                continue
            if not two:
                on_disk.add(entry.name)  # its `ab/cd` leftovers are walked with it
                continue
            subs = self._list(entry.path)
            if subs is None:
                unreadable_tops.add(entry.name)
                continue
            for sub in subs:
                if _PREFIX.fullmatch(sub.name) and _is_dir(sub):
                    on_disk.add(f"{entry.name}/{sub.name}")
                elif _NAME.fullmatch(sub.name) and _regular(sub):
                    on_disk.add(entry.name)  # a one-level object: walked, misplaced
                else:
                    self.report.add("stray", sub.path)
        tops = [t for t in (f"{i:02x}" for i in range(256)) if t not in unreadable_tops]
        if self.index.stats()[0] <= SMALL_INDEX:
            in_index = {self.layout.shard_of(c) for t in tops for c in self._rows(t)}
        elif two:
            in_index = {f"{t}/{i:02x}" for t in tops for i in range(256)}
        else:
            in_index = set(tops)
        return sorted(on_disk | in_index)

    def _list(self, path: str) -> list[os.DirEntry[str]] | None:
        """A directory's entries sorted by name; [] if it does not exist; None (and
        reported) if it cannot be read."""
        try:
            with os.scandir(path) as it:
                return sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except OSError as e:
            self.report.add("unreadable", {"path": path, "error": describe(e)})
            return None

    def _rows(self, prefix: str) -> dict[str, StoredObject]:
        return self.index.objects_between(prefix, _after(prefix))

    # -- one shard ----------------------------------------------------------------------
    def shard(self, shard: str) -> None:
        """Walk one directory of objects: a shard of the store's layout, or one of the
        other layout's (a two-level store's `ab`, a one-level store's `ab/cd`: written by
        a release that knew no LAYOUT file), whose objects are all misplaced."""
        self.current = shard
        home = shard.count("/") + 1 == self.layout.shard_levels
        prefix = shard.replace("/", "")
        d = os.path.join(self.layout.objects, shard)
        entries = self._list(d)
        if entries is None:
            # Unreadable: its rows stay, whatever they are (the other layout's directory
            # may hold the only copy of objects whose own shard was walked already).
            if not home:
                self.keep_rows.update(self._rows(prefix))
            return
        indexed = self._rows(prefix) if home else {}
        present: set[str] = set()
        to_hash: list[str] = []
        below: list[str] = []
        for e in entries:
            if not (_NAME.fullmatch(e.name) and _regular(e)):
                sub = "/" not in shard and _PREFIX.fullmatch(e.name) and _is_dir(e)
                if sub and home:
                    below.append(f"{shard}/{e.name}")  # one-level: a two-level leftover
                elif not sub and (home or "/" in shard):
                    self.report.add("stray", e.path)
                # (else a two-level store's `ab`: its shards are walked on their own, and
                # its plan reported its strays)
                continue
            if home and e.name.startswith(prefix):
                present.add(e.name)  # hashed below; unreadable or not, it is there
                if e.name in self.moved_ahead:
                    self.moved_ahead.discard(e.name)  # hashed (and registered) when moved
                    continue
            to_hash.append(e.path)
        for path, res in zip(to_hash, self.pool.map(_try_hash, to_hash), strict=True):
            name = os.path.basename(path)
            if isinstance(res, OSError) and res.errno in (errno.ENOENT, errno.ENOTDIR):
                # Gone since the listing (a sweep, a rollback): nothing to hash; its rows,
                # if any, are settled with the others at the end.
                present.discard(name)
                continue
            if isinstance(res, OSError):
                # Never quarantined, never forgotten: we do not know what it holds.
                self.report.add("unreadable", {"path": path, "error": describe(res)})
                self.keep_rows.add(name)
                continue
            self.report.checked += 1
            digest, size = res
            faults.point("fsck.object_hashed")
            try:
                if not home or not name.startswith(prefix):
                    self._misplaced(path, name, digest, size)
                elif digest != name:
                    self._corrupt(path, name, shard)
                elif name not in indexed and name not in self.in_flight:
                    self._unindexed(name, size)
            except OSError as e:  # a repair the filesystem refused: left, rows kept
                self.report.add("unreadable", {"path": path, "error": f"repair: {describe(e)}"})
                self.keep_rows.add(name)
        if any(c not in present for c in indexed):
            self.recheck.add(shard)
        for leftover in below:
            self.shard(leftover)

    def _corrupt(self, path: str, name: str, shard: str) -> None:
        if self.online and self.guard is None:
            self.deferred_corrupt.append(path)  # hashed again once the walk is done
            return
        with self._settled(name) as free:
            if not free:
                return  # a recycle of these bytes is healing it (Objects.publish) right now
            if self.guard is not None:
                again = _try_hash(path)
                if isinstance(again, OSError) or again[0] == name:
                    # Healed since it was hashed (a recycle of the same bytes finished), or
                    # gone (swept): nothing of it to quarantine.
                    return
            self.report.add("corrupt", name)
            if self.repair:
                self._quarantine(path, name)
                self.recheck.add(shard)

    def _unindexed(self, name: str, size: int) -> None:
        if self.online and self.guard is None:
            self.deferred.append(name)  # looked at again once the walk is done (finish)
            return
        with self._settled(name) as free:
            # Claimed: between its publish and its commit. Indexed since the shard's rows
            # were read: committed meanwhile. Gone: a rollback removed it. None of them is
            # unindexed.
            if not free or (self.online and (
                self.index.get_object(name) is not None
                or not os.path.lexists(self.layout.object_path(name))
            )):
                return
            self.report.add("unindexed", name)
            if self.repair:
                self._register(name, size)

    def finish(self) -> None:
        """Beside a running daemon: of the objects found unindexed, those still unindexed
        and in no journaled transaction now (and still there); of those found corrupt,
        those whose bytes still do not hash to their name."""
        for path in self.deferred_corrupt:
            again = _try_hash(path)
            if not isinstance(again, OSError) and again[0] != os.path.basename(path):
                self.report.add("corrupt", os.path.basename(path))
        if not self.deferred:
            return
        journaled = _journaled(self.layout, self.index, None)[1]
        for name in self.deferred:
            if (
                name not in journaled
                and self.index.get_object(name) is None
                and os.path.lexists(self.layout.object_path(name))
            ):
                self.report.add("unindexed", name)

    def _register(self, name: str, size: int) -> None:
        # A full retention from now, so a person has time to sort it out.
        self.index.register_object(
            StoredObject(name, size, self.now, self.now + self.retain, True)
        )

    def _quarantine(self, path: str, name: str) -> None:
        q = self.layout.quarantine
        os.makedirs(q, exist_ok=True)
        # <checksum>.<unix time>, as the daemon names what it quarantines when serving
        base = os.path.join(q, f"{name}.{int(self.now)}")
        target, n = base, 0
        while os.path.lexists(target):  # an earlier quarantined copy stays too
            n += 1
            target = f"{base}.{n}"
        os.rename(path, target)
        self.quarantined.add(name)
        fsync_dir(q)
        fsync_dir(os.path.dirname(path))

    # -- an object in the wrong shard ---------------------------------------------------
    def _misplaced(self, path: str, name: str, digest: str, size: int) -> None:
        with self._settled(name) as free:
            if free:
                self._misplaced_settled(path, name, digest, size)
            else:
                self.keep_rows.add(name)  # a recycle is at work on it: left for next time

    def _misplaced_settled(self, path: str, name: str, digest: str, size: int) -> None:
        if _absent(path):
            return  # swept or moved since it was hashed: nothing is there to place
        if digest != name:
            # Bytes that do not hash to their name, wherever they sit: corrupt. No rows
            # are touched here: they belong to the object's own place.
            self.report.add("corrupt", name)
            if self.repair:
                self._quarantine(path, name)
            return
        self.keep_rows.add(name)
        home = self.layout.object_path(name)
        state = self._home_state(home, name)
        if state == "absent":
            todo, done = "move to its place", "moved to its place"
            if self.repair:
                self._move_home(path, home, name, size)
        elif state == "valid" and same_bytes(path, home):
            todo, done = "remove: a duplicate of its place", "removed: a duplicate of its place"
            if self.repair:
                os.unlink(path)
                fsync_dir(os.path.dirname(path))
        elif state == "valid":  # two contents, one checksum: both kept for a person
            todo = done = "left: differs from the valid copy at its place (hash collision?)"
        elif state == "corrupt":
            todo = "replace the corrupt copy at its place"
            done = "replaced the corrupt copy at its place (quarantined)"
            if self.repair:
                # Reported here: the walk of the home shard will find the valid copy.
                self.report.add("corrupt", name)
                self._quarantine(home, name)
                self._move_home(path, home, name, size)
        else:
            todo = done = f"left: its place cannot be read ({state})"
        action = done if self.repair else todo
        self.report.add("misplaced", {"path": path, "checksum": name, "action": action})

    def _home_state(self, home: str, name: str) -> str:
        """What is at an object's place: absent, valid, corrupt, or an error."""
        try:
            os.lstat(home)
        except FileNotFoundError:
            return "absent"
        except NotADirectoryError:
            return "absent"
        except OSError as e:
            return describe(e)
        res = _try_hash(home)
        if isinstance(res, OSError):
            return describe(res)
        return "valid" if res[0] == name else "corrupt"

    def _move_home(self, path: str, home: str, name: str, size: int) -> None:
        shard_dir = os.path.dirname(home)
        if not os.path.isdir(shard_dir):
            self.layout.make_shard(name)
        os.link(path, home)  # never clobbers a file that appeared meanwhile
        fsync_dir(shard_dir)
        os.unlink(path)
        fsync_dir(os.path.dirname(path))
        if self.index.get_object(name) is None:
            self.report.add("unindexed", name)
            self._register(name, size)
        if self.layout.shard_of(name) > self.current:
            self.moved_ahead.add(name)

    # -- rows whose object is gone ------------------------------------------------------
    def settle(self) -> None:
        """Report (and on repair forget) the rows of objects absent from their place once
        every shard was walked, unless a valid copy of the object exists elsewhere."""
        for shard in sorted(self.recheck):
            rows = self._rows(shard.replace("/", ""))
            gone = [
                c
                for c in sorted(rows)
                if c not in self.keep_rows and _absent(self.layout.object_path(c))
            ]
            if self.online:
                for c in gone:
                    self._forget_one(c)
                continue
            for c in gone:
                if c not in self.quarantined:
                    self.report.add("missing", c)
            if self.repair and gone:
                self.index.forget(gone)

    def _forget_one(self, c: str) -> None:
        """Online: a row whose object is absent, decided again now. A recycle may have
        published it since (claimed, or present), or the sweep forgotten it."""
        with self._settled(c) as free:
            if not free or not _absent(self.layout.object_path(c)):
                return
            if self.index.get_object(c) is None:
                return
            if c not in self.quarantined:
                self.report.add("missing", c)
            if self.repair:
                self.index.forget([c])


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _absent(path: str) -> bool:
    """True only if nothing is at `path` for sure; an error to look is not absence."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return not stat.S_ISREG(st.st_mode)


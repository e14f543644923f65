"""fsck of a store on an object store (`s3://bucket/prefix`, any fsspec filesystem).

It applies the rules of the local fsck (cmroot.store.fsck: read its docstring) with the same
report kinds, through the filesystem's listings and reads instead of directories and inodes:

- `unindexed`: an object whose bytes hash to its name and that the index lacks (nor does a
  journaled transaction own it); `--repair` registers it for a full retention, never
  deletes it;
- `missing`: an index row with no object at its place and no valid copy anywhere in the
  store; `--repair` forgets the row;
- `corrupt`: bytes that do not hash to their name; `--repair` moves them to
  `quarantine/<checksum>.<unix time>[.n]` and, when no valid copy is left, forgets the rows
  (reported corrupt, not missing);
- `misplaced`: a valid object in the wrong `ab/cd` shard: moved to its place if that is
  free (or holds a corrupt copy, quarantined first), removed if its place holds the same
  bytes, left if its place holds other valid bytes or cannot be read; its rows are kept;
- `stray`: under `objects/`, anything not shaped like `ab/cd/<checksum>`; under `staging/`,
  a transaction area no journaled transaction owns. Reported, never touched;
- `unreadable`: a listing or an object the store refused to give (its rows are kept), or a
  repair it refused;
- `quarantined_transactions`: journaled recycles recovery could not finish.

An object store has no directories to walk: `objects/` is listed one top-level prefix
(`ab/`) at a time, each with one recursive listing (`fs.find`, paged by the server), and
compared with that prefix's index rows; memory is 1/256 of the store at most, `progress`
is called once per prefix. Rows whose object was not listed are settled at the end by
listing their shard again (one request per shard with findings, not one per row).

Online, every repair decision on one object is taken again inside `Objects.settled` and
re-checks the index and the store there, as the local fsck does; beside the daemon (no
guard) findings are looked at again after the walk, and nothing is repaired.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cmroot import checksum as cks
from cmroot import faults
from cmroot.index import Index, StoredObject
from cmroot.store.fsck import FsckReport, _after, _journaled, describe
from cmroot.store.layout import OBJECT_NAME as _NAME
from cmroot.store.layout import SHARD_NAME as _PREFIX
from cmroot.store.layout import Layout, streams_equal
from cmroot.store.layout.remote import RemoteLayout
from cmroot.store.objects import Objects
from cmroot.store.source.remote import fresh_info, identity

_TOPS = [f"{i:02x}" for i in range(256)]


def fsck_remote(
    layout: Layout, index: Index, now: float, retain: float, repair: bool,
    progress: Callable[[int, int], None] | None, limit: int, guard: Objects | None,
    online: bool,
) -> FsckReport:
    """Check (and with `repair`, fix) a remote store: `fsck` for a RemoteLayout, with its
    arguments. `progress(done, 256)` is called once per top-level prefix."""
    if not isinstance(layout, RemoteLayout):
        raise TypeError(f"fsck_remote needs a RemoteLayout, not {type(layout).__name__}")
    report = FsckReport(repair, limit)
    owned, in_flight = _journaled(layout, index, None if online else report)
    if not online:
        _staging(layout, owned, report)
    with ThreadPoolExecutor(max_workers=cks.default_workers()) as pool:
        walk = _RemoteWalk(layout, index, now, retain, repair, report, pool)
        walk.in_flight = in_flight
        walk.guard = guard
        walk.online = online
        tops = walk.tops()
        if tops is not None:
            for i, top in enumerate(_TOPS, 1):
                walk.top(top, top in tops)
                if progress:
                    progress(i, len(_TOPS))
            walk.settle()
        walk.finish()
        report.shards = len(walk.shards)
    if online:
        # As the local fsck does: staging listed first, the journal read after (a
        # transaction is journaled before its first staged file and ends after its last
        # one is removed), so a transaction that comes and goes is never stray.
        try:
            listed = sorted(layout.transactions())
        except OSError:
            listed = []
        owned = _journaled(layout, index, report)[0]
        _staging(layout, owned, report, [n for n in listed if n not in owned])
    return report


def _url(layout: RemoteLayout, path: str) -> str:
    """A path of the store's filesystem as a URL a person can use (`s3://...`)."""
    url: str = layout.fs.unstrip_protocol(path)
    return url


def _staging(
    layout: RemoteLayout, owned: set[str], report: FsckReport,
    candidates: list[str] | None = None,
) -> None:
    """A transaction area in staging that no journaled transaction owns is stray: reported,
    never removed (recovery at open already removed what it could prove redundant).
    `candidates` (online): names listed before the journal was read, stray if still there."""
    if candidates is not None:
        for name in candidates:
            try:
                still = bool(layout.staged_files(name))
            except OSError as e:
                report.add("unreadable", {"path": _url(layout, layout.tx_dir(name)),
                                          "error": describe(e)})
                continue
            if still:
                report.add("stray", _url(layout, layout.tx_dir(name)))
        return
    try:
        names = sorted(layout.transactions())
    except OSError as e:
        report.add("unreadable", {"path": _url(layout, layout.staging), "error": describe(e)})
        return
    for name in names:
        if name and name not in owned:
            report.add("stray", _url(layout, layout.tx_dir(name)))


def _hash(fs: Any, path: str) -> tuple[str, int]:
    """The checksum and size of the bytes read from `path`."""
    with fs.open(path, "rb") as f:
        return cks.of_stream(f), f.tell()


def _try_hash(fs: Any, path: str) -> tuple[str, int] | OSError:
    try:
        return _hash(fs, path)
    except OSError as e:
        return e


def _forget_listing(fs: Any, base: str) -> None:
    """Drop the listings a recursive find cached under `base`: a client's listing cache
    would otherwise end up holding the whole store, and answer later looks with old news
    (invalidate_cache drops a path and its parents, never its children)."""
    fs.invalidate_cache(base)
    cache = getattr(fs, "dircache", None)
    if cache is None:
        return
    for key in [k for k in cache if k == base or k.startswith(base + "/")]:
        cache.pop(key, None)


class _RemoteWalk:
    """The walk of `objects/`, one top-level prefix at a time (cmroot.store.fsck._Walk's
    counterpart: the same decisions, the same report)."""

    def __init__(
        self,
        layout: RemoteLayout,
        index: Index,
        now: float,
        retain: float,
        repair: bool,
        report: FsckReport,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.layout = layout
        self.fs: Any = layout.fs
        self.index = index
        self.now = now
        self.retain = retain
        self.repair = repair
        self.report = report
        self.pool = pool
        # Shards ("ab/cd") with index rows whose object was not listed at its place:
        # settled at the end, once every misplaced copy was seen (and moved home).
        self.recheck: set[str] = set()
        # Objects whose rows are never forgotten this run: a valid copy sits in a wrong
        # shard, or a file of that name could not be read.
        self.keep_rows: set[str] = set()
        # Objects quarantined this run: reported corrupt, not missing.
        self.quarantined: set[str] = set()
        # Misplaced objects moved home under a prefix not yet listed: hashed already.
        self.moved_ahead: set[str] = set()
        self.current = ""
        self.in_flight: set[str] = set()
        self.guard: Objects | None = None
        self.online = False
        self.deferred: list[str] = []
        self.deferred_corrupt: list[str] = []
        # Shards ("ab/cd") listed or holding index rows: `shards` of the report, as the
        # local walk counts the shard directories it visits.
        self.shards: set[str] = set()

    @contextlib.contextmanager
    def _settled(self, name: str) -> Iterator[bool]:
        """Decide and act on one object with no recycle between its publish and its index
        commit (True: none claims it); offline, nothing else runs."""
        if self.guard is None:
            yield True
        else:
            with self.guard.settled(name) as free:
                yield free

    def _url(self, path: str) -> str:
        return _url(self.layout, path)

    # -- listing --------------------------------------------------------------------------
    def tops(self) -> set[str] | None:
        """The top-level prefixes `objects/` holds; anything else there is stray. None (and
        reported) if `objects/` cannot be listed: then nothing is decided, no row goes."""
        objects = self.layout.objects
        self.fs.invalidate_cache(objects)
        try:
            entries: list[dict[str, Any]] = self.fs.ls(objects, detail=True)
        except FileNotFoundError:
            return set()
        except OSError as e:
            self.report.add("unreadable", {"path": self._url(objects), "error": describe(e)})
            return None
        found: set[str] = set()
        for entry in sorted(entries, key=lambda e: str(e["name"])):
            path = str(entry["name"]).rstrip("/")
            name = path.rsplit("/", 1)[-1]
            if path == objects:
                continue  # the prefix's own "directory" marker
            if entry.get("type") == "directory" and _PREFIX.fullmatch(name):
                found.add(name)
            else:
                self.report.add("stray", self._url(path))
        return found

    def _listing(self, top: str) -> dict[str, dict[str, Any]] | None:
        """Every file under `objects/<top>/` with its listed info; None if refused."""
        base = f"{self.layout.objects}/{top}"
        self.fs.invalidate_cache(base)
        try:
            found: dict[str, dict[str, Any]] = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        except OSError as e:
            self.report.add("unreadable", {"path": self._url(base), "error": describe(e)})
            return None
        return found

    def _rows(self, prefix: str) -> dict[str, StoredObject]:
        return self.index.objects_between(prefix, _after(prefix))

    # -- one top-level prefix -------------------------------------------------------------
    def top(self, top: str, listed: bool) -> None:
        """Compare `objects/<top>/` with the index rows of that prefix (the rows of a
        prefix with nothing stored are still looked at: their objects are missing)."""
        self.current = top
        base = f"{self.layout.objects}/{top}"
        files: dict[str, dict[str, Any]] = {}
        if listed:
            got = self._listing(top)
            if got is None:
                return  # unreadable: its rows stay, whatever they are
            files = got
        try:
            self._compare(top, base, files)
        finally:
            _forget_listing(self.fs, base)

    def _compare(self, top: str, base: str, files: dict[str, dict[str, Any]]) -> None:
        indexed = self._rows(top)
        self.shards.update(f"{c[:2]}/{c[2:4]}" for c in indexed)
        present: set[str] = set()
        strays: set[str] = set()
        to_hash: list[tuple[str, str, bool]] = []  # path, name, at its place
        for path in sorted(files):
            if files[path].get("type") == "directory" or path.endswith("/"):
                continue  # a directory marker: no object, nothing stray
            parts = path[len(base) + 1 :].split("/")
            stray = self._stray_of(base, parts)
            if stray is not None:
                if stray not in strays:  # a stray directory is reported once
                    strays.add(stray)
                    self.report.add("stray", self._url(stray))
                continue
            shard, name = parts
            self.shards.add(f"{top}/{shard}")
            home = name.startswith(top + shard)
            if home:
                present.add(name)  # hashed below; readable or not, it is there
                if name in self.moved_ahead:
                    self.moved_ahead.discard(name)  # hashed (and registered) when moved
                    continue
            to_hash.append((path, name, home))
        paths = [p for p, _, _ in to_hash]
        hashed = self.pool.map(lambda p: _try_hash(self.fs, p), paths)
        for (path, name, home), res in zip(to_hash, hashed, strict=True):
            if isinstance(res, FileNotFoundError):
                # Gone since the listing (a sweep, a rollback): its rows, if any, are
                # settled with the others at the end.
                if home:
                    present.discard(name)
                continue
            if isinstance(res, OSError):
                # Never quarantined, never forgotten: we do not know what it holds.
                self.report.add("unreadable", {"path": self._url(path),
                                               "error": describe(res)})
                self.keep_rows.add(name)
                continue
            self.report.checked += 1
            digest, size = res
            faults.point("fsck.object_hashed")
            try:
                if not home:
                    self._misplaced(path, name, digest, size)
                elif digest != name:
                    self._corrupt(path, name)
                elif name not in indexed and name not in self.in_flight:
                    self._unindexed(name, size)
            except OSError as e:  # a repair the store refused: left, rows kept
                self.report.add("unreadable", {"path": self._url(path),
                                               "error": f"repair: {describe(e)}"})
                self.keep_rows.add(name)
        self.recheck.update(f"{c[:2]}/{c[2:4]}" for c in indexed if c not in present)

    @staticmethod
    def _stray_of(base: str, parts: list[str]) -> str | None:
        """None for `<shard>/<checksum>` below a top-level prefix; else the path to report
        stray: the first level that is not what a store holds there (a directory once, not
        each file in it), as the local walk reports a directory entry."""
        if len(parts) == 1:
            return f"{base}/{parts[0]}"  # a file beside the shards
        if not _PREFIX.fullmatch(parts[0]):
            return f"{base}/{parts[0]}"
        if len(parts) > 2:
            return f"{base}/{parts[0]}/{parts[1]}"  # a "directory" inside a shard
        if not _NAME.fullmatch(parts[1]):
            return f"{base}/{parts[0]}/{parts[1]}"
        return None

    # -- findings at an object's place ----------------------------------------------------
    def _judge(self, path: str) -> tuple[str, str] | None:
        """(identity, checksum) of what is at `path` now, the identity taken before the
        read (a quarantine then moves only those bytes); None if nothing is there."""
        try:
            ident = identity(fresh_info(self.fs, path))
            return ident, _hash(self.fs, path)[0]
        except FileNotFoundError:
            return None

    def _corrupt(self, path: str, name: str) -> None:
        if self.online and self.guard is None:
            self.deferred_corrupt.append(path)  # hashed again once the walk is done
            return
        with self._settled(name) as free:
            if not free:
                return  # a recycle of these bytes is healing it (Objects.publish) right now
            ident = None
            if self.guard is not None:
                again = self._judge(path)
                if again is None or again[1] == name:
                    # Healed since it was hashed (a recycle of the same bytes finished), or
                    # gone (swept): nothing of it to quarantine.
                    return
                ident = again[0]
            self.report.add("corrupt", name)
            if self.repair and self._quarantine(path, name, ident):
                self.recheck.add(f"{name[:2]}/{name[2:4]}")

    def _unindexed(self, name: str, size: int) -> None:
        if self.online and self.guard is None:
            self.deferred.append(name)  # looked at again once the walk is done (finish)
            return
        with self._settled(name) as free:
            # Claimed: between its publish and its commit. Indexed since the prefix's rows
            # were read: committed meanwhile. Gone: a rollback removed it.
            if not free or (self.online and (
                self.index.get_object(name) is not None
                or not self.layout.object_exists(name)
            )):
                return
            self.report.add("unindexed", name)
            if self.repair:
                self._register(name, size)

    def finish(self) -> None:
        """Beside a running daemon: of the objects found unindexed, those still unindexed,
        in no journaled transaction and still there now; of those found corrupt, those
        whose bytes still do not hash to their name."""
        for path in self.deferred_corrupt:
            name = path.rsplit("/", 1)[-1]
            again = _try_hash(self.fs, path)
            if not isinstance(again, OSError) and again[0] != name:
                self.report.add("corrupt", name)
        if not self.deferred:
            return
        journaled = _journaled(self.layout, self.index, None)[1]
        for name in self.deferred:
            if (
                name not in journaled
                and self.index.get_object(name) is None
                and self.layout.object_exists(name)
            ):
                self.report.add("unindexed", name)

    def _register(self, name: str, size: int) -> None:
        # A full retention from now, so a person has time to sort it out.
        self.index.register_object(
            StoredObject(name, size, self.now, self.now + self.retain, True)
        )

    def _quarantine(self, path: str, name: str, ident: str | None) -> bool:
        """Move the bytes at `path` to `quarantine/<name>.<unix time>[.n]`, if they are
        still those judged (`ident`; None: those there now). Not
        RemoteLayout.quarantine_object: that one only moves an object from its place, and
        copies over a copy quarantined under the same name in the same second."""
        try:
            now_ident = identity(fresh_info(self.fs, path))
        except FileNotFoundError:
            return False  # gone meanwhile: nothing to quarantine
        if ident is not None and now_ident != ident:
            return False  # other bytes since they were judged
        base = f"{self.layout.quarantine}/{name}.{int(self.now)}"
        target, n = base, 0
        self.fs.invalidate_cache(self.layout.quarantine)
        while self.fs.exists(target):  # an earlier quarantined copy stays too
            n += 1
            target = f"{base}.{n}"
        self.fs.cp_file(path, target)
        self.fs.rm_file(path)
        self.quarantined.add(name)
        return True

    # -- an object in the wrong shard -----------------------------------------------------
    def _misplaced(self, path: str, name: str, digest: str, size: int) -> None:
        with self._settled(name) as free:
            if free:
                self._misplaced_settled(path, name, digest, size)
            else:
                self.keep_rows.add(name)  # a recycle is at work on it: left for next time

    def _misplaced_settled(self, path: str, name: str, digest: str, size: int) -> None:
        if digest != name:
            # Bytes that do not hash to their name, wherever they sit: corrupt. No rows
            # are touched here: they belong to the object's own place.
            self.report.add("corrupt", name)
            if self.repair:
                self._quarantine(path, name, None)
            return
        self.keep_rows.add(name)
        home = self.layout.object_path(name)
        state = self._home_state(home, name)
        if state == "absent":
            todo, done = "move to its place", "moved to its place"
            if self.repair:
                self._move_home(path, home, name, size)
        elif state == "valid" and self._same_bytes(path, home):
            todo, done = "remove: a duplicate of its place", "removed: a duplicate of its place"
            if self.repair:
                self.fs.rm_file(path)
        elif state == "valid":  # two contents, one checksum: both kept for a person
            todo = done = "left: differs from the valid copy at its place (hash collision?)"
        elif state == "corrupt":
            todo = "replace the corrupt copy at its place"
            done = "replaced the corrupt copy at its place (quarantined)"
            if self.repair:
                # Reported here: the walk of its own prefix will find the valid copy.
                self.report.add("corrupt", name)
                self._quarantine(home, name, None)  # False: gone meanwhile, free all the same
                self._move_home(path, home, name, size)
        else:
            todo = done = f"left: its place cannot be read ({state})"
        action = done if self.repair else todo
        self.report.add("misplaced", {"path": self._url(path), "checksum": name,
                                      "action": action})

    def _home_state(self, home: str, name: str) -> str:
        """What is at an object's place: absent, valid, corrupt, or an error."""
        try:
            info = fresh_info(self.fs, home)
        except FileNotFoundError:
            return "absent"
        except OSError as e:
            return describe(e)
        if info.get("type") != "file":
            return "not a file"
        res = _try_hash(self.fs, home)
        if isinstance(res, FileNotFoundError):
            return "absent"
        if isinstance(res, OSError):
            return describe(res)
        return "valid" if res[0] == name else "corrupt"

    def _same_bytes(self, a: str, b: str) -> bool:
        """Whether two objects hold the same bytes: equal sizes and equal single-part
        ETags (content MD5s; both already hash alike with xxh3-128), else byte for byte."""
        ia, ib = fresh_info(self.fs, a), fresh_info(self.fs, b)
        if int(ia.get("size") or 0) != int(ib.get("size") or 0):
            return False
        ea, eb = ia.get("ETag"), ib.get("ETag")
        if ea and ea == eb and "-" not in str(ea):
            return True
        with self.fs.open(a, "rb") as x, self.fs.open(b, "rb") as y:
            return streams_equal(x, y, cks.CHUNK)

    def _move_home(self, path: str, home: str, name: str, size: int) -> None:
        """Copy a valid misplaced object to its free place, then remove it. Its place was
        found free under the lock publishes take (or offline), so the copy replaces
        nothing; the misplaced one goes only once the copy is known to hold its bytes."""
        self.fs.cp_file(path, home)
        if not self._same_bytes(path, home):
            raise OSError(errno.EIO, "the copy at its place differs: the misplaced one stays",
                          self._url(home))
        self.fs.rm_file(path)
        if self.index.get_object(name) is None:
            self.report.add("unindexed", name)
            self._register(name, size)
        if name[:2] > self.current:
            self.moved_ahead.add(name)

    # -- rows whose object is gone --------------------------------------------------------
    def settle(self) -> None:
        """Report (and on repair forget) the rows of objects absent from their place once
        every prefix was walked, unless a valid copy of the object exists elsewhere. Each
        shard with such rows is listed again: what is absent is absent now."""
        for shard in sorted(self.recheck):
            rows = self._rows(shard.replace("/", ""))
            if not rows:
                continue
            there = self._names_in(shard)
            if there is None:
                continue  # cannot tell: rows kept
            gone = [c for c in sorted(rows) if c not in self.keep_rows and c not in there]
            if self.online:
                for c in gone:
                    self._forget_one(c)
                continue
            for c in gone:
                if c not in self.quarantined:
                    self.report.add("missing", c)
            if self.repair and gone:
                self.index.forget(gone)

    def _names_in(self, shard: str) -> set[str] | None:
        """The files of a shard now; None (and reported) if it cannot be listed."""
        d = f"{self.layout.objects}/{shard}"
        self.fs.invalidate_cache(d)
        try:
            entries: list[dict[str, Any]] = self.fs.ls(d, detail=True)
        except FileNotFoundError:
            return set()
        except OSError as e:
            self.report.add("unreadable", {"path": self._url(d), "error": describe(e)})
            return None
        finally:
            self.fs.invalidate_cache(d)
        return {
            str(e["name"]).rsplit("/", 1)[-1] for e in entries if e.get("type") == "file"
        }

    def _forget_one(self, c: str) -> None:
        """Online: a row whose object is absent, decided again now. A recycle may have
        published it since (claimed, or present), or the sweep forgotten it."""
        with self._settled(c) as free:
            if not free or self.layout.object_exists(c):
                return
            if self.index.get_object(c) is None:
                return
            if c not in self.quarantined:
                self.report.add("missing", c)
            if self.repair:
                self.index.forget([c])

"""Resolve (path, checksum) pairs: is the original still those bytes, or is a copy in the
store, or neither. Checksums of originals are cached by (path, identity): a replication
load that resolves the same files again does not re-read them, and a file whose identity
changed (ctime moves even when a writer restores size and mtime) is read again."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, CmrootError, PayloadTooLarge
from cmroot.index import Index
from cmroot.store import confined, read
from cmroot.store.layout import Layout
from cmroot.store.source import RootUnavailable
from cmroot.store.source.local import LocalSource, ident_of, ident_str
from cmroot.store.source.remote import changed, fresh_info, remote_ident
from cmroot.store.warehouse import Located, Warehouse

MAX_PAIRS = 100_000
# Bytes of originals one resolve may hash (those whose checksum is not cached): a minute
# or two of reading at disk speed, so one request cannot hold a thread for hours. A
# batch over it is refused before anything is read (413: split it); a single file over
# it is still hashed, as splitting cannot help.
MAX_HASH_BYTES = 16 << 30
_PAIR_KEYS = frozenset({"path", "checksum"})


class Resolution(msgspec.Struct, frozen=True, gc=False):
    """One pair's answer; a Struct, so the daemon writes a 10,000-pair answer as JSON
    straight from these (its fields are the API's, in its order)."""

    path: str
    checksum: str
    status: str  # "original" | "cmroot" | "missing"
    location: str | None = None
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class _Original(msgspec.Struct, frozen=True, gc=False):
    """A regular file at a pair's path: its size and identity (see read.ident_str, or
    read.remote_ident on object stores; None when the filesystem gives none)."""

    loc: Located
    size: int
    ident: str | None
    # False while a local file's ctime is too recent for its identity to vouch for it
    settled: bool = True


def parse_pairs(warehouse: Warehouse, pairs: object) -> list[tuple[Located, str]]:
    """Validate a batch; any bad pair refuses the whole batch, naming that pair."""
    if not isinstance(pairs, list):
        raise BadRequest("bad files", 'give a list of {"path": ..., "checksum": ...} objects')
    if len(pairs) > MAX_PAIRS:
        raise BadRequest("too many files", f"{len(pairs)} pairs: send at most {MAX_PAIRS} per call")
    out = []
    for i, pair in enumerate(pairs):
        try:
            if not isinstance(pair, dict) or not pair.keys() <= _PAIR_KEYS:
                raise BadRequest("bad pair", 'each pair is {"path": ..., "checksum": ...}')
            c = cks.validate(pair.get("checksum"))
            out.append((read.locate(warehouse, pair.get("path")), c))
        except CmrootError as e:
            raise BadRequest(f"bad pair #{i}", f"{str(pair)[:300]}: {e}") from None
    return out


class Resolver:
    def __init__(self, layout: Layout, index: Index, cache_writes: bool, workers: int) -> None:
        self.layout = layout
        self.index = index
        self.cache_writes = cache_writes
        self.workers = workers

    def resolve(self, pairs: Sequence[tuple[Located, str]]) -> list[Resolution]:
        originals = _stat_all([loc for loc, _ in pairs])
        sums = self.checksums(list(originals.values()), MAX_HASH_BYTES)
        out: list[Resolution | None] = []
        rest = []
        for i, (loc, c) in enumerate(pairs):
            o = originals.get(loc.key)
            if o is not None and sums.get(loc.key) == c:
                out.append(Resolution(loc.key, c, "original", loc.key, o.size))
            else:
                out.append(None)
                rest.append((i, loc.key, c))
        recorded = self.index.recorded([(k, c) for _, k, c in rest])
        for i, key, c in rest:
            size = recorded.get((key, c))
            where = None if size is None else self.layout.find_object(c)
            if where is not None:
                out[i] = Resolution(key, c, "cmroot", where, size)
            else:
                out[i] = Resolution(key, c, "missing")
        return [r for r in out if r is not None]

    def checksums(
        self, originals: list[_Original], max_bytes: int | None = None
    ) -> dict[str, str]:
        """Checksums of existing originals: from the cache while their identity is the
        one cached, else hashed. A local file is hashed from the descriptor its identity
        was taken from; a file is left out (no checksum) if it vanished or changed while
        hashed: such a pair is then not `original`. More than one file to hash holding
        over `max_bytes` is refused (PayloadTooLarge) before any is read."""
        sums = self.index.cached_checksums(
            [(o.loc.key, o.ident) for o in originals if o.ident is not None and o.settled]
        )
        todo = [o for o in originals if o.loc.key not in sums]
        total = sum(o.size for o in todo)
        if max_bytes is not None and len(todo) > 1 and total > max_bytes:
            raise PayloadTooLarge(
                "too many bytes of originals to hash",
                f"{len(todo)} original files not hashed before hold {total} bytes; one "
                f"resolve hashes at most {max_bytes} bytes ({max_bytes / (1 << 30):g} GiB): "
                "split the batch into smaller ones",
            )
        if todo:
            with ThreadPoolExecutor(self.workers) as pool:
                fresh = list(pool.map(_hash, todo))
            rows = []
            for o, got in zip(todo, fresh, strict=True):
                if got is None:
                    continue
                ident, c = got
                sums[o.loc.key] = c
                if ident is not None and o.settled:
                    rows.append((o.loc.key, ident, c))
            if self.cache_writes and rows:
                self.index.cache_checksums(rows)
        return sums

    def original(self, loc: Located) -> _Original | None:
        return _stat(loc)


def _stat(loc: Located) -> _Original | None:
    """The file at a pair's path, if a regular one is there: locally, opened below its root
    with no symlink followed, and fstat'ed (a symlink on the way means no original)."""
    if loc.local:
        if loc.statted and loc.st is None:
            return None  # confining it just found no regular file there
        opened = _open_regular(loc)
        if opened is None:
            return None
        fd, st = opened
        os.close(fd)
        ident = ident_of(st)
        return _Original(loc, st.st_size, ident_str(ident), read.settled(ident))
    try:
        info = fresh_info(loc.root.fs, loc.path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if info.get("type") != "file":
        return None
    return _Original(loc, int(info.get("size") or 0), remote_ident(info))


def _stat_all(locs: Sequence[Located]) -> dict[str, _Original]:
    """`_stat` of each path (by key), local ones a directory at a time: each root and
    directory opened once, below the root with no symlink followed, and each file then by
    its name in it, no symlink followed (a batch of a table's files shares few
    directories: the ctypes openat2 of every whole path was a third of a resolve)."""
    out: dict[str, _Original] = {}
    by_dir: dict[tuple[int, str], list[tuple[Located, str]]] = {}
    for loc in locs:
        if loc.key in out:
            continue
        if not loc.local:
            if (o := _stat(loc)) is not None:
                out[loc.key] = o
            continue
        if loc.statted and loc.st is None:
            continue  # confining it just found no regular file there
        parent, _, name = read.root_rel(loc).rpartition("/")
        if name not in ("", ".", ".."):
            by_dir.setdefault((id(loc.root), parent), []).append((loc, name))
    for (_, parent), group in by_dir.items():
        out.update((o.loc.key, o) for o in _stat_in(parent, group))
    return out


def _stat_in(parent: str, group: list[tuple[Located, str]]) -> Iterator[_Original]:
    """The regular files among `group` (all in directory `parent` of one local root)."""
    source = group[0][0].root.source
    assert isinstance(source, LocalSource), "a local root"
    try:
        with source.root() as rfd:
            dfd = confined.open_dir_beneath(rfd, parent) if parent else rfd
            try:
                for loc, name in group:
                    st = _open_named(dfd, name)
                    if st is not None:
                        ident = ident_of(st)
                        yield _Original(loc, st.st_size, ident_str(ident), read.settled(ident))
            finally:
                if dfd != rfd:
                    os.close(dfd)
    except RootUnavailable:
        return  # e.g. a nested root swapped for a symlink: nothing of ours is there
    except OSError as e:
        if e.errno in read.NO_FILE:
            return  # the directory is gone, or a symlink is on its way
        raise


def _open_named(dir_fd: int, name: str) -> os.stat_result | None:
    """fstat of the regular file `name` in `dir_fd`, opened as `_open_regular` opens one
    (no symlink followed; not openable, as unreadable, is no original). Opened, not only
    lstat'ed: whether this process may read a file can change with nothing of the file
    changing (its groups, a security policy), so a cached checksum says nothing of it."""
    try:
        fd = os.open(name, read.READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in read.NO_FILE:
            return None
        raise
    opened = _regular(fd)
    if opened is None:
        return None
    os.close(opened[0])
    return opened[1]


def _hash(o: _Original) -> tuple[str | None, str] | None:
    """(identity, checksum) of an original, read once; None if it is gone, or changed
    while hashed: the identity cached is the one the bytes were read under. Local files:
    open, fstat, hash from that descriptor, fstat again. Remote ones: the identity `_stat`
    read, looked at again once the bytes are read."""
    if not o.loc.local:
        fs, path = o.loc.root.fs, o.loc.path
        try:
            c = cks.of_file(fs, path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        # A writer between `_stat` and the read would have its bytes' checksum cached
        # under the old ETag, which the old bytes bring back (a single-part ETag is their
        # MD5). An original with no identity is never cached, so is not looked at again.
        if o.ident is not None and changed(fs, path, o.ident):
            return None
        return o.ident, c
    opened = _open_regular(o.loc)
    if opened is None:
        return None
    fd, st = opened
    try:
        before = ident_of(st)
        if ident_str(before) != o.ident:
            return None  # replaced since it was looked at: answer for neither version
        c, _ = cks.of_fd(fd)
        if ident_of(os.fstat(fd)) != before:
            return None  # written to while we read it: no answer to cache or trust
        return o.ident, c
    except OSError as e:
        if e.errno in read.VANISHED:
            return None
        raise
    finally:
        os.close(fd)


def _open_regular(loc: Located) -> tuple[int, os.stat_result] | None:
    """A descriptor of the local original at `loc` (confined, no symlink followed) and its
    fstat; None unless a regular file is there. The caller closes the descriptor."""
    fd = read.open_original(loc)
    return None if fd is None else _regular(fd)


def _regular(fd: int) -> tuple[int, os.stat_result] | None:
    """`fd` and its fstat if it is a regular file; else None, `fd` closed."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        if e.errno in read.VANISHED:
            return None
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st



class Renames:
    """The table renames of the daemon's log by old location, read as the log grows (it is
    append-only): where the files of a renamed table went. Locations are canonical, as
    the warehouse places them; a rename into or out of the roots is not followed."""

    MAX_CANDIDATES = 16

    def __init__(self, index: Index, warehouse: Warehouse) -> None:
        self._index = index
        self._warehouse = warehouse
        self._lock = threading.Lock()
        self._after = 0
        self._by_old: dict[str, list[tuple[int, str]]] = {}

    def refresh(self) -> None:
        with self._lock:
            for event_id, old, new in self._index.relocations(self._after):
                self._after = max(self._after, event_id)
                try:
                    a = self._warehouse.locate(old, resolve=False).key
                    b = self._warehouse.locate(new, resolve=False).key
                except CmrootError:
                    continue
                if a != b:
                    self._by_old.setdefault(a, []).append((event_id, b))

    def candidates(self, path: str) -> list[str]:
        """The paths renames, applied in log order, lead `path` to: the newest renames
        first (a table renamed nightly to a dated backup is found at the last one), at
        most MAX_CANDIDATES. Which one holds the bytes is for the checksum to say."""
        out: list[str] = []
        seen: set[tuple[str, int]] = set()
        todo = [(path, 0)]
        while todo and len(out) < self.MAX_CANDIDATES:
            p, after = todo.pop(0)
            for event_id, old, new in self._moves_of(p, after):
                q = new + p[len(old):]
                if (q, event_id) in seen:
                    continue
                seen.add((q, event_id))
                if q != path and q not in out:
                    out.append(q)
                todo.append((q, event_id))
        return out[: self.MAX_CANDIDATES]

    def _moves_of(self, path: str, after: int) -> list[tuple[int, str, str]]:
        """(event id, old, new) of the renames after `after` of `path` or a directory
        above it, newest first: one lookup per directory level, whatever the log holds."""
        found = []
        d = path
        with self._lock:
            while d:
                for event_id, new in self._by_old.get(d, ()):
                    if event_id > after:
                        found.append((event_id, d, new))
                parent = d.rsplit("/", 1)[0]
                d = "" if parent == d else parent
        return sorted(found, reverse=True)

"""Resolve (path, checksum) pairs: is the original still those bytes, or is a copy in the
store, or neither. Checksums of originals are cached by (path, size, mtime) so a
replication load that resolves the same files again does not re-read them."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, CmrootError
from cmroot.index import Index
from cmroot.store.layout import Layout
from cmroot.store.warehouse import Located, Warehouse

MAX_PAIRS = 100_000


@dataclass(frozen=True)
class Resolution:
    path: str
    checksum: str
    status: str  # "original" | "cmroot" | "missing"
    location: str | None = None
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "checksum": self.checksum,
            "status": self.status,
            "location": self.location,
            "size": self.size,
        }


@dataclass(frozen=True)
class _Original:
    loc: Located
    size: int
    mtime_ns: int | None


def parse_pairs(warehouse: Warehouse, pairs: object) -> list[tuple[Located, str]]:
    """Validate a batch; any bad pair refuses the whole batch, naming that pair."""
    if not isinstance(pairs, list):
        raise BadRequest("bad files", 'give a list of {"path": ..., "checksum": ...} objects')
    if len(pairs) > MAX_PAIRS:
        raise BadRequest("too many files", f"{len(pairs)} pairs: send at most {MAX_PAIRS} per call")
    out = []
    for i, pair in enumerate(pairs):
        try:
            if not isinstance(pair, dict) or set(pair) - {"path", "checksum"}:
                raise BadRequest("bad pair", 'each pair is {"path": ..., "checksum": ...}')
            c = cks.validate(pair.get("checksum"))
            out.append((warehouse.locate(pair.get("path")), c))
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
        originals = {loc.key: o for loc, _ in pairs if (o := _stat(loc)) is not None}
        sums = self.checksums(list(originals.values()))
        out: list[Resolution | None] = []
        rest = []
        for i, (loc, c) in enumerate(pairs):
            o = originals.get(loc.key)
            if o is not None and sums[loc.key] == c:
                out.append(Resolution(loc.key, c, "original", loc.key, o.size))
            else:
                out.append(None)
                rest.append((i, loc.key, c))
        recorded = self.index.recorded([(k, c) for _, k, c in rest])
        for i, key, c in rest:
            size = recorded.get((key, c))
            obj = self.layout.object_path(c)
            if size is not None and os.path.exists(obj):
                out[i] = Resolution(key, c, "cmroot", obj, size)
            else:
                out[i] = Resolution(key, c, "missing")
        return [r for r in out if r is not None]

    def checksums(self, originals: list[_Original]) -> dict[str, str]:
        """Checksums of existing originals: from the cache when size and mtime match."""
        sums = self.index.cached_checksums(
            [(o.loc.key, o.size, o.mtime_ns) for o in originals if o.mtime_ns is not None]
        )
        todo = [o for o in originals if o.loc.key not in sums]
        if todo:
            with ThreadPoolExecutor(self.workers) as pool:
                fresh = list(pool.map(lambda o: cks.of_file(o.loc.root.fs, o.loc.path), todo))
            for o, c in zip(todo, fresh, strict=True):
                sums[o.loc.key] = c
            if self.cache_writes:
                self.index.cache_checksums(
                    (o.loc.key, o.size, o.mtime_ns, c)
                    for o, c in zip(todo, fresh, strict=True)
                    if o.mtime_ns is not None
                )
        return sums

    def original(self, loc: Located) -> _Original | None:
        return _stat(loc)


def _stat(loc: Located) -> _Original | None:
    if loc.statted:
        return _Original(loc, loc.st.st_size, loc.st.st_mtime_ns) if loc.st else None
    if loc.local:
        try:
            st = os.stat(loc.key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENAMETOOLONG):  # a symlink loop: no file there
                return None
            raise
        if not stat.S_ISREG(st.st_mode):
            return None
        return _Original(loc, st.st_size, st.st_mtime_ns)
    try:
        info = loc.root.fs.info(loc.path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file":
        return None
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    mtime_ns = (
        int(mtime.timestamp() * 1e9)
        if hasattr(mtime, "timestamp")
        else (int(float(mtime) * 1e9) if mtime is not None else None)
    )
    return _Original(loc, int(info.get("size") or 0), mtime_ns)

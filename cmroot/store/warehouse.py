"""Confinement: which paths the store may touch, in one canonical spelling.

Every request path goes through `Warehouse.locate`: it is refused unless, once normalised
and (for local files) with symlinks resolved, it lies under a configured warehouse root.
The canonical spelling is what entries record, so `file:///wh/t/f` and `/wh/t/f` are one file.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cmroot.config import local_path, place_key
from cmroot.exceptions import BadRequest, ConfigError, Conflict, OutsideRoots
from cmroot.store.source import Source, SourceFile, SymlinkRefused, for_root
from cmroot.store.source.local import LocalSource

MAX_PATH = 4096
NAME_MAX = 255
_REALPATH_TTL = 1.0
_REALPATH_CACHE = 65536


class PathUnsettled(Conflict):
    """realpath() failed on a path (a symlink on it swapped while read, a chain too long):
    nothing is known of what is there."""


@dataclass(frozen=True)
class Root:
    url: str
    fs: Any
    path: str
    local: bool
    real: str
    source: Source = field(compare=False, repr=False)


class Located(msgspec.Struct, frozen=True, gc=False):
    """A confined path: its canonical key, the root it lies under, and its path on `root.fs`.
    A Struct: a batch locates thousands, and a frozen dataclass cost 2 µs each to make."""

    key: str
    root: Root
    path: str
    # lstat of a local regular file, taken while confining it, so resolve need not stat
    # it again; None when missing, a symlink or not local.
    st: os.stat_result | None = None
    # True when `st` is the whole answer: None then means no regular file is there.
    statted: bool = False
    # Resolved afresh for this request (`locate_all`), not from the one-second cache.
    fresh: bool = False

    @property
    def local(self) -> bool:
        return self.root.local

    @property
    def is_file(self) -> bool:
        """A regular file is there, as resolved afresh for this request: it names no
        directory, so it holds no root and lists itself only."""
        return self.fresh and self.st is not None

    @property
    def rel(self) -> str:
        """The path below the root ("" for the root itself)."""
        return self.key[len(self.root.url) :].lstrip("/")


class Warehouse:
    def __init__(self, roots: Sequence[str], store: str | None = None) -> None:
        """`store`: the store's root, which no root may hold or lie in by any spelling or
        real path (a recycle would take the store's own files)."""
        self.roots: list[Root] = []
        local = [p for url in roots if (p := local_path(url)) is not None]
        reals = _local_reals(local)
        for url in roots:
            lp = local_path(url)
            if lp is not None:
                src = for_root(lp, reals[lp][0])
                self.roots.append(Root(lp, src.fs, lp, True, reals[lp][0], src))
            else:
                src = for_root(url, None)
                self.roots.append(Root(_url_key(url), src.fs, src.root_path, False, "", src))
        by_path = {r.path: r.source for r in self.roots if r.local}
        for path, (_, outer) in reals.items():
            inner_src, outer_src = by_path[path], by_path[outer[0]] if outer else None
            if isinstance(inner_src, LocalSource) and isinstance(outer_src, LocalSource):
                assert outer is not None
                inner_src.outer = (outer_src, outer[1])
        # Local roots with their spellings' prefixes, made once: every path of every
        # request is placed and checked against them.
        self._local: list[tuple[Root, str, str]] = [
            (r, r.url.rstrip("/") + "/", r.real.rstrip("/") + "/") for r in self.roots if r.local
        ]
        self._reals = frozenset(r.real for r, _, _ in self._local)
        self._real_prefixes = tuple(prefix for _, _, prefix in self._local)
        self._real_dirs: dict[str, tuple[float, str]] = {}
        if store is not None:
            self._fence(store)

    def _fence(self, store: str) -> None:
        lp = local_path(store)
        where = place_key(_realpath(lp) if lp is not None else store)
        for r in self.roots:
            here = place_key(r.real if r.local else r.url)
            if _under(here, where) or _under(where, here):
                raise ConfigError(
                    "store.root and store.warehouse_roots overlap",
                    f"{r.url} is {here} and the store {store} is {where}: keep the store"
                    " beside the warehouse, not inside it (or the reverse)",
                )

    def _realpath(
        self, path: str, dirs: dict[str, tuple[float, str]] | None = None
    ) -> tuple[str, os.stat_result | None, bool]:
        """realpath(), with the parent directory's answer cached for a second (or, given
        `dirs`, for as long as that map is kept): a batch of thousands of files in a few
        partitions costs one lstat per file, not one per path component. Also returns
        that lstat when it found a regular file, and whether that lstat settles what is
        there (it does unless the name is a symlink)."""
        cache = self._real_dirs if dirs is None else dirs
        parent, _, name = path.rpartition("/")
        now = time.monotonic()
        hit = cache.get(parent)
        if hit is None or (dirs is None and now - hit[0] > _REALPATH_TTL):
            if len(cache) > _REALPATH_CACHE:
                cache.clear()
            hit = (now, _realpath(parent or "/"))
            cache[parent] = hit
        joined = f"{hit[1].rstrip('/')}/{name}"
        try:
            st = os.lstat(joined)
        except OSError:  # missing, or a name the filesystem refuses: nothing to follow
            return joined, None, True
        if stat.S_ISLNK(st.st_mode):
            return _realpath(joined), None, False
        return joined, st if stat.S_ISREG(st.st_mode) else None, True

    def locate_all(self, raws: Iterable[object]) -> list[Located]:
        """locate() the paths of a request that moves files, each parent directory
        resolved afresh once for the whole batch, not taken from the cache a moment-old
        lookup filled: what is moved is confined on its path as it is now."""
        dirs: dict[str, tuple[float, str]] = {}
        try:
            return [self.locate(raw, dirs=dirs) for raw in raws]
        finally:
            if len(self._real_dirs) + len(dirs) > _REALPATH_CACHE:
                self._real_dirs.clear()
            self._real_dirs.update(dirs)  # fresh answers serve later lookups as well

    def locate(
        self, raw: object, resolve: bool = True, dirs: dict[str, tuple[float, str]] | None = None
    ) -> Located:
        """Canonicalise and confine one request path (it need not exist). Without
        `resolve`, a local path is placed under its root by name only and marked as having
        no file there: enough to look up its recycled copies, never to touch the path.
        `dirs` is `locate_all`'s map of parent directories resolved for its batch."""
        if not isinstance(raw, str) or not raw:
            raise BadRequest("bad path", f"{raw!r}: give an absolute path or URL as a string")
        if "\0" in raw or len(raw) > MAX_PATH:
            raise BadRequest(
                "bad path", f"{raw[:200]!r}: NUL bytes and paths over 4096 chars are refused"
            )
        try:
            encoded = raw.encode("utf-8")  # a lone surrogate (JSON "\ud800") names no file
            lp = local_path(raw)  # urlsplit refuses e.g. "file://[x"
        except ValueError as e:
            raise BadRequest("bad path", f"{raw[:200]!r}: {e}") from None
        if lp is not None:
            if not lp.startswith("/"):
                raise BadRequest("bad path", f"{raw!r} is relative: give an absolute path")
            key = _normalise(lp, raw)
            # (the key is never longer than the raw path: the test of its length first)
            if len(encoded) > NAME_MAX and any(
                len(s.encode()) > NAME_MAX for s in key.split("/")
            ):
                raise BadRequest("bad path", f"{raw[:200]!r} has a name over {NAME_MAX} bytes")
            root = self._local_root(key, raw)
            if not resolve:
                return Located(key, root, key, None, True)
            real, st, statted = self._resolve(key, raw, dirs)
            inside = self._inside(real)
            if dirs is None and not inside:
                # A refusal is made on a fresh look, never on a cached parent that was a
                # symlink a moment ago and has since been put back.
                fresh: dict[str, tuple[float, str]] = {}
                real, st, statted = self._resolve(key, raw, fresh)
                self._real_dirs.update(fresh)
                inside = self._inside(real)
            if not inside:
                raise OutsideRoots(
                    "path escapes the warehouse roots",
                    f"{raw!r} resolves through a symlink to {real!r}",
                )
            return Located(key, root, key, st, statted, dirs is not None)
        key = _url_key(raw)
        for root in self.roots:
            if not root.local and _under(key, root.url):
                return Located(key, root, root.path + key[len(root.url) :])
        raise OutsideRoots(
            "path outside the warehouse roots", f"{raw!r} is not under {self._names()}"
        )

    def _resolve(
        self, key: str, raw: str, dirs: dict[str, tuple[float, str]] | None
    ) -> tuple[str, os.stat_result | None, bool]:
        try:
            return self._realpath(key, dirs)
        except OSError as e:
            raise PathUnsettled(
                "path changed while it was looked up",
                f"{raw[:300]!r}: {e.strerror or e} (a symlink on its way was swapped, or"
                " the chain is too long): try again",
            ) from None

    def _inside(self, real: str) -> bool:
        return real in self._reals or real.startswith(self._real_prefixes)

    def place(self, key: str) -> Located:
        """A key this store recorded (confined and canonical when it was located), placed
        under its root by name: what `locate(key, resolve=False)` answers, without checking
        its spelling again, for the thousands of files of a journaled transaction."""
        if key.startswith("/"):
            root = self._local_root(key, key)
            return Located(key, root, key, None, True)
        return self.locate(key, resolve=False)

    def _local_root(self, key: str, raw: str) -> Root:
        for root, prefix, _ in self._local:
            if key == root.url or key.startswith(prefix):
                return root
        raise OutsideRoots(
            "path outside the warehouse roots", f"{raw!r} is not under {self._names()}"
        )

    def _names(self) -> str:
        return ", ".join(r.url for r in self.roots)

    def expand(
        self, located: Iterable[Located]
    ) -> tuple[list[tuple[Root, SourceFile]], list[Located]]:
        """The regular files under each path (directories recurse), with their roots, and
        the directories named. A missing path, a symlink or a special file refuses the
        whole request."""
        files: dict[str, tuple[Root, SourceFile]] = {}
        dirs: list[Located] = []
        for loc in located:
            if loc.is_file:
                # Nothing to resolve again here: staging reaches the file through
                # directory descriptors with no symlink followed, and refuses whatever is
                # not that regular file by then (a batch of thousands of files must not
                # cost a realpath() each).
                assert loc.st is not None
                files.setdefault(loc.key, (loc.root, SourceFile(loc.key, loc.rel,
                                                                loc.st.st_size)))
                continue
            self.confirm(loc)
            try:
                found, is_dir = loc.root.source.expand(loc.rel, loc.key)
            except SymlinkRefused as e:
                real = _realpath(e.key)
                if not any(r.local and _under(real, r.real) for r in self.roots):
                    raise OutsideRoots(
                        "symlink escapes the warehouse roots", f"{e.key} points to {real}"
                    ) from None
                raise
            for f in found:
                if not loc.root.local:
                    _addressable(f.key)
                files.setdefault(f.key, (loc.root, f))
            if is_dir:
                dirs.append(loc)
        return list(files.values()), dirs

    def protected(self, key: str) -> bool:
        """A root, or a directory that contains one (by its configured or its real path):
        never removed, moved or recycled (invariant 5)."""
        real = _realpath(key) if local_path(key) is not None else key
        return any(
            _under(r.url, key) or (r.local and (_under(r.real, key) or _under(r.real, real)))
            for r in self.roots
        )

    def protects(self, loc: Located) -> bool:
        """protected(), for a path `locate_all` just confined: a regular file found there
        names no directory, so unless its name is a root's (or above one: a root's path
        holding a file is still never recycled) nothing need be resolved again."""
        if loc.is_file and not any(_under(r.url, loc.key) for r in self.roots):
            return False
        return self.protected(loc.key)

    def is_root(self, loc: Located) -> bool:
        return loc.key == loc.root.url

    def confirm(self, loc: Located) -> None:
        """Re-check confinement without the realpath cache, just before a file is moved or
        served: a parent swapped for a symlink a moment ago must not let it escape."""
        if loc.local:
            real = _realpath(loc.key)
            if not self._inside(real):
                raise OutsideRoots(
                    "path escapes the warehouse roots",
                    f"{loc.key!r} resolves through a symlink to {real!r}",
                )


def _local_reals(paths: Sequence[str]) -> dict[str, tuple[str, tuple[str, str] | None]]:
    """For each configured local root: its real directory, and the root it lies in with
    its path below that one (None for a top-level root).

    A root configured inside another (/wh/t/inner inside /wh) is nested by its name: its
    real directory is the outer one's plus that name, never what realpath() says at
    start-up, because a writer of the outer root could have made it a symlink before a
    restart. Otherwise a root whose real path lies in another's (an administrator's alias
    such as /links/inner -> /wh/t/inner) is nested by that real path. Either way it is
    then only ever opened through the outer root's descriptor."""
    out: dict[str, tuple[str, tuple[str, str] | None]] = {}
    norm = {p: posixpath.normpath(p) for p in paths}
    for p in sorted(dict.fromkeys(paths), key=lambda q: len(norm[q])):  # outer names first
        named = [q for q in out if norm[q] != norm[p] and _under(norm[p], norm[q])]
        if named:
            outer = max(named, key=lambda q: len(norm[q]))
            rel = norm[p][len(norm[outer]) :].strip("/")
            out[p] = (f"{out[outer][0].rstrip('/')}/{rel}", (outer, rel))
        else:
            out[p] = (_realpath(p), None)
    for p, (real, nested) in list(out.items()):
        if nested is None:
            by_real = [q for q in out if out[q][0] != real and _under(real, out[q][0])]
            if by_real:
                outer = max(by_real, key=lambda q: len(out[q][0]))
                out[p] = (real, (outer, real[len(out[outer][0]) :].strip("/")))
    return out


def _realpath(path: str) -> str:
    """os.path.realpath, with a symlink chain too deep for its recursion reported as the
    kernel reports one too long (ELOOP), not as a RecursionError."""
    try:
        return os.path.realpath(path)
    except RecursionError:
        raise OSError(errno.ELOOP, "too many levels of symbolic links", path) from None
    except OSError as e:  # a symlink on the way swapped while it was read
        raise PathUnsettled(
            "path changed while it was looked up",
            f"{path[:300]!r}: {e.strerror or e} (a symlink on its way was swapped): try again",
        ) from None


def _normalise(path: str, raw: str) -> str:
    if "/.." in path and ".." in path.split("/"):
        raise BadRequest("bad path", f"{raw!r} has a '..' segment: give the plain absolute path")
    if "//" in path or "/." in path or path.endswith("/"):
        return posixpath.normpath(path).replace("//", "/")
    return path  # already normal: nothing for normpath to do (most paths of a batch)


def _url_key(raw: str) -> str:
    """A URL as roots and paths on other filesystems are compared and recorded: its path
    normalised, its authority as given. An empty authority stays empty (`hdfs:///wh` is
    the default namenode's /wh, never a namenode called `wh`)."""
    if "?versionId=" in raw:
        # s3fs reads it as a version of the key before it: what would be moved is not
        # what would be recorded.
        raise BadRequest("bad path", f"{raw[:300]!r}: name the file without ?versionId=")
    scheme, _, rest = raw.partition("://")
    authority, _, path = rest.partition("/")
    return f"{scheme}://{authority}{_normalise('/' + path, raw).rstrip('/')}"


def _addressable(key: str) -> None:
    """Refuse a listed object whose key is not its own normal spelling (`t/./a`,
    `t/p=1//a`: keys of their own on an object store): recorded as listed, every lookup
    would normalise the path and never find it again. Raised before anything moves."""
    try:
        same = _url_key(key) == key.rstrip("/")
    except BadRequest:
        same = False
    if not same:
        raise Conflict(
            "a file cannot be recorded by its path",
            f"{key[:300]!r} has '.', '..' or empty segments or '?versionId=' in its key, which"
            " no path lookup can name: rename it (copy it to a plain key), then try again",
        )


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")

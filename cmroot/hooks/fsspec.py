"""`cmroot`: an fsspec filesystem that wraps another one and hands every file it would
delete or overwrite under a warehouse root to the cmroot daemon first (op `DELETE`).

    import fsspec
    fs = fsspec.filesystem("cmroot", target_protocol="file", url="http://127.0.0.1:9750")
    fs.rm("/lake/warehouse/sales.db/orders/p=1", recursive=True)   # recycled, then gone
    with fs.open("/lake/warehouse/x/part-0.parquet", "wb") as f:  # old bytes recycled
        f.write(data)

or by URL chaining, e.g. `pd.read_parquet(...)`/`df.to_parquet("cmroot::file:///lake/...")`.

What is protected, and how:

- **The roots and their ancestors.** A warehouse root (`warehouse_roots=`, default the
  cmroot config's `store.warehouse_roots`) and every directory that contains one (`/lake`
  for the root `/lake/warehouse`, and `/`) is never removed, moved or written over: `rm`
  (recursive or not, named or matched by a glob), `rm_file`, `rmdir`, `mv`/`rename` of
  one or onto one's name (moving files *into* a root is fine) and every write onto one
  raise `Forbidden` naming the root and the fix, before anything is listed or deleted,
  whether the daemon is up or not (`fail_open` included). Paths are compared after
  normalisation: `..`, repeated and trailing slashes, URL chaining
  (`cmroot::file:///lake`) and, on the local filesystem, symlinks (a path is refused if
  it or its real path is, or contains, a root's configured or real path).
- **Deletes.** Files under a root (by name, or by real path through a symlinked directory;
  Spark and Hive staging directories excepted) are recycled before they go, every path of
  the call in one all-or-nothing request. When the same call also deletes paths outside
  the roots, the recycle is prepared, those are deleted, then it is committed: a failure
  in between aborts it (the recycled files come back).
- **Overwrites** (`open(..., "wb"|"ab")`, `pipe_file`, `put_file`, `cp_file`, `mv` onto an
  existing file, `touch(truncate=True)`). The new bytes are written beside the file first
  (an append copies the file and appends to the copy). Once they are complete, one
  two-phase recycle replaces it: *prepare* moves the old file into the daemon's staging
  (nothing is published), the new file is moved into place (never over anything that
  appeared there meanwhile), then *commit* publishes the event. A failed write or a
  refused prepare leaves the old file untouched; a failed move-in takes the new files
  already moved back out and aborts, so every old file is back and no event exists.
- **One transaction per call.** A call that replaces several files (`put`, `copy`, `mv`
  of several files, `pipe` of a dict) writes every new file first, then makes one
  prepare, the move-ins and one commit. If any part fails or is refused, every path under
  a root is as it was: old files back, files the call created there removed, moved
  sources returned.
- **The lease.** Between prepare and commit there are only renames on a local
  filesystem (the long writes come before the prepare); on an object store a move-in is a
  server-side copy, which can take long for big objects, so between move-ins the lease is
  renewed whenever a third of it has passed.
- **A commit that fails** after the new files are in place is retried (`retry_delays`:
  the daemon may be restarting); a retry that finds the transaction gone looks in the
  entries for whether an earlier try committed before its answer was lost. If the commit
  cannot be made, the call raises a CmrootError saying the change was applied but not
  recorded. The new files stay (taking them back could leave neither file, were the
  commit in fact made). The daemon rolls the prepared transaction back when its lease
  (`store.prepare_lease`) ends; as each path now holds its new file, and a rollback never
  overwrites, the old bytes are kept in the store as *displaced* entries, retrievable by
  path and old checksum, with no event. Nothing is lost and no replica replays a change
  that is not recorded; replicas do not see this overwrite either, so the error says to
  bootstrap what they replicate. For a delete, the rollback puts the files back.

If the daemon refuses or is unreachable, the call raises a CmrootError and nothing is
deleted, unless `fail_open=True`: then it is logged and counted in
`CmrootFileSystem.fail_open_count`, and files are deleted or replaced without a copy (an
overwrite whose commit failed is kept likewise; a delete whose commit failed is not: the
daemon puts its files back, so that still raises).

Every other call is forwarded unchanged to the target filesystem.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from glob import has_magic
from typing import Any, ClassVar

from fsspec import filesystem
from fsspec.spec import AbstractFileSystem
from fsspec.utils import other_paths

try:  # fsspec >= 2025: a chained filesystem takes the inner URL's path ("cmroot::file://...")
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

from cmroot import faults
from cmroot.client import Client, PreparedTx
from cmroot.exceptions import CmrootError, DaemonUnavailable, Forbidden, NotFound

log = logging.getLogger("cmroot.hooks.fsspec")

# Pauses before each retry of a commit or an abort the daemon did not answer: together
# longer than a daemon restart takes.
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)
# A lost commit answer is looked up among this many newest entries at most.
_ENTRY_PAGES, _ENTRY_PAGE = 3, 1000
# Entries this much older (by our clock) than the prepare cannot be its commit's, whatever
# the skew between the daemon's clock and ours.
_CLOCK_SLACK = 60.0


class CmrootFileSystem(_Base):  # type: ignore[misc]
    protocol = "cmroot"
    root_marker = ""
    cachable = False
    fail_open_count: ClassVar[int] = 0

    def __init__(
        self,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fs: AbstractFileSystem | None = None,
        url: str | None = None,
        token: str | None = None,
        warehouse_roots: list[str] | tuple[str, ...] | str | None = None,
        fail_open: bool = False,
        client: Client | None = None,
        op: str = "DELETE",
        retry_delays: Sequence[float] = RETRY_DELAYS,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("fo", None)  # URL chaining passes the inner URL; paths come per call
        super().__init__(**kwargs)
        self.fs: AbstractFileSystem = (
            fs
            if fs is not None
            else filesystem(target_protocol or "file", **(target_options or {}))
        )
        self._local = "file" in _protocols(self.fs)
        config = None
        if url is None or warehouse_roots is None:
            from cmroot import config as cfg

            config = cfg.load(cfg.default_config_path())
        self.url = url or os.environ.get("CMROOT_URL") or (config and config.server.base_url)
        if isinstance(warehouse_roots, str):
            warehouse_roots = [r for r in warehouse_roots.split(",") if r]
        roots = list(warehouse_roots or (config.store.warehouse_roots if config else ()))
        self.roots = [self._norm(r) for r in roots]
        self.client = client or Client(
            str(self.url), token if token is not None else os.environ.get("CMROOT_TOKEN")
        )
        self.fail_open = fail_open
        self.op = op
        self.retry_delays = tuple(retry_delays)
        self._calls = _Calls()

    # -- paths ------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        for prefix in ("cmroot::", "cmroot://"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        if path.startswith("file://"):
            path = path[len("file://") :]
        # "" (not "/") for a bare "cmroot://", so chaining takes the inner URL's path
        return path.rstrip("/") or ("/" if path else "")

    def _norm(self, path: str) -> str:
        """The path as the daemon names it: absolute local path, else the full URL."""
        if self._local:
            p = path[len("file://") :] if path.startswith("file://") else path
            # normpath keeps a leading "//" (POSIX leaves its meaning open); Linux does not
            return re.sub("^/+", "/", os.path.normpath(os.path.abspath(p)))
        return str(self.fs.unstrip_protocol(self.fs._strip_protocol(path))).rstrip("/")

    def _spellings(self, path: str, real: bool = True) -> set[str]:
        """The names `path` goes by when compared with a root: its normalised name and, on
        the local filesystem (with `real`), its real path."""
        name = self._norm(path)
        if not self._local:
            # `..` and "//" resolved by name: an object store may keep them literally, but
            # refusing too much here is safe and refusing too little is not.
            scheme, sep, rest = name.partition("://")
            return {scheme + sep + posixpath.normpath("/" + rest)[1:]} if sep else {name}
        return {name, os.path.realpath(name)} if real else {name}

    def _refuse_roots(self, paths: Iterable[str]) -> None:
        """Forbidden if any of `paths` is a warehouse root or a directory containing one."""
        roots = [(r, s) for r in self.roots for s in self._spellings(r)]
        for p in paths:
            # Only a directory (or a symlink to one) can contain a root through a symlink:
            # one stat spares a realpath for each of a listing's files.
            real = self._local and os.path.isdir(p)
            for name in self._spellings(p, real):
                for root, spelling in roots:
                    if _under(spelling, name):
                        raise Forbidden(
                            "a warehouse root, or a directory that contains one, is never"
                            " removed, moved or overwritten",
                            f"{p} {'is' if name == spelling else 'contains'} the warehouse"
                            f" root {root}: nothing was changed. Name the tables or files"
                            f" under {root} instead (they are recycled); to retire the"
                            " warehouse itself, take it out of warehouse_roots"
                            " (store.warehouse_roots) first",
                        )

    def _key(self, path: str) -> str | None:
        """The daemon's name for `path` if it lies under a warehouse root (Spark and Hive
        staging directories excepted), else None. On the local filesystem a path reached
        through a symlinked directory counts by its real path, named under its root."""
        name = self._norm(path)
        if any(
            seg.startswith((".spark-staging-", ".hive-staging")) or seg == "_temporary"
            for seg in name.split("/")
        ):
            return None
        if any(_under(name, r) for r in self.roots):
            return name
        if not self._local:
            return None
        parent, _, base = name.rpartition("/")
        # The parent's real path only: the file itself, if a symlink, is the daemon's to
        # refuse, not ours to follow.
        real = posixpath.join(os.path.realpath(parent or "/"), base)
        for r in self.roots:
            rr = os.path.realpath(r)
            if _under(real, rr):
                return r + real[len(rr.rstrip("/")) :]
        return None

    def protected(self, path: str) -> bool:
        """Whether `path` lies under a warehouse root (and is recycled before it goes)."""
        return self._key(path) is not None

    def _replaces(self, path: str) -> bool:
        return self._key(path) is not None and bool(self.fs.isfile(path))

    def _recyclable(self, path: str) -> bool:
        """Under a root and there. Not a symlink: removing a link deletes no data, so the
        target removes it (the daemon refuses symlinks)."""
        return (
            self._key(path) is not None
            and bool(self.fs.lexists(path))
            and not (self._local and os.path.islink(path))
        )

    def _is_dir(self, path: str) -> bool:
        """A directory itself; a symlink to one is a name, removed as a file is."""
        if self._local:
            return os.path.isdir(path) and not os.path.islink(path)
        return bool(self.fs.isdir(path))

    # -- talking to the daemon --------------------------------------------------------------
    def _daemon_failed(self, paths: list[str], e: CmrootError) -> None:
        """The daemon refused or could not be reached: raise, or with fail_open log and
        count it (the caller then goes on without a copy)."""
        if not self.fail_open:
            raise CmrootError(
                f"cmroot could not recycle {len(paths)} path(s) (first {paths[0]}); "
                "nothing was deleted",
                str(e) + (self._where_to_write() if isinstance(e, Forbidden) else ""),
            ) from e
        type(self).fail_open_count += 1
        log.warning(
            "cmroot unavailable; deleting without a copy (fail_open=True)",
            extra={"paths": len(paths), "first": paths[0], "error": str(e)},
        )

    def _recycle(self, paths: list[str]) -> bool:
        """Recycle `paths` (all or nothing). False when failed open: delete as usual."""
        try:
            self.client.recycle([self._key(p) or self._norm(p) for p in paths], op=self.op)
            return True
        except CmrootError as e:
            self._daemon_failed(paths, e)
            return False

    def _prepare(self, paths: list[str]) -> _Tx | None:
        """Move the files at `paths` into the daemon's staging, unpublished. None when
        failed open: the caller deletes them as usual."""
        started = time.time()
        try:
            tx = self.client.prepare([self._key(p) or self._norm(p) for p in paths], op=self.op)
        except CmrootError as e:
            self._daemon_failed(paths, e)
            return None
        return _Tx(self.client, tx, started)

    def _commit(self, tx: _Tx, paths: list[str], replaced: bool) -> None:
        """Publish, retrying while the daemon cannot be reached (it may be restarting).
        One that cannot be made leaves the change applied but not recorded: say so."""
        error: CmrootError | None = None
        unknown = False  # whether an earlier try may have committed before its answer broke
        for delay in (0.0, *self.retry_delays):
            time.sleep(delay)
            try:
                self.client.commit(tx.txid)
                return
            except DaemonUnavailable as e:
                error, unknown = e, True
            except NotFound as e:
                if unknown and tx.recorded():
                    return
                error = e
                break
            except CmrootError as e:  # the daemon's commit failed: it rolled back
                error = e
                break
        assert error is not None
        what = f"{len(paths)} file(s) (first {paths[0]})"
        if replaced:
            message = f"the overwrite of {what} was applied but not recorded"
            after = (
                f"the new files are in place. The daemon rolls the prepared transaction"
                f" {tx.txid} back when its lease ends ({tx.until}), if it has not already;"
                " as each path now holds its new file, the old bytes are kept in the store"
                " as displaced entries,"
                " retrievable by path and old checksum, with no event: nothing is lost,"
                " but replicas replaying the event log do not see this overwrite;"
                " bootstrap the tables they replicate from here"
            )
            if self.fail_open:
                type(self).fail_open_count += 1
                log.warning(message, extra={"error": str(error), "txid": tx.txid})
                return
        else:
            message = f"the delete of {what} could not be recorded"
            after = (
                f"the daemon puts the files back when the lease of transaction {tx.txid}"
                f" ends ({tx.until}), if it has not already, with no event; paths outside"
                " the warehouse roots"
                " named by the same call are deleted: run it again once the daemon is back"
            )
        raise CmrootError(message, f"{error}; {after}") from error

    def _abort(self, tx: _Tx, cause: BaseException) -> None:
        """Have every old file put back after `cause` (retried while the daemon cannot be
        reached); the caller re-raises `cause`. Raises a CmrootError saying what is left
        if the daemon could not be told."""
        error: CmrootError | None = None
        for delay in (0.0, *self.retry_delays):
            time.sleep(delay)
            try:
                displaced = self.client.abort(tx.txid)
            except DaemonUnavailable as e:
                error = e
                continue
            except NotFound:
                return  # its lease passed: the daemon rolled it back already
            except CmrootError as e:
                error = e
                break
            if displaced:
                log.warning(
                    "paths re-created during a failed overwrite: their old bytes are kept"
                    " in the store (by path and old checksum), with no event",
                    extra={"txid": tx.txid, "paths": displaced},
                )
            return
        raise CmrootError(
            "the call failed and the daemon could not be told to put the old files back",
            f"{cause}; then {error}: the daemon puts them back when the lease of"
            f" transaction {tx.txid} ends ({tx.until}); nothing is lost and no event is"
            " recorded",
        ) from cause

    def _where_to_write(self) -> str:
        """A 403 names no paths (it may reach an unauthenticated caller): the roots come
        from the cmroot config here, which a daemon on this host shares."""
        from cmroot import config as cfg

        try:
            roots = cfg.load(cfg.default_config_path()).store.warehouse_roots
        except CmrootError:
            roots = tuple(self.roots)
        return (
            f"; cmroot keeps files under {', '.join(roots)}: write the table under "
            f"{roots[0]} (Spark: spark.sql.warehouse.dir={roots[0]}, as `cmroot spark-conf` "
            "prints), or add its directory to store.warehouse_roots"
        )

    # -- deleting ---------------------------------------------------------------------------
    def _delete(
        self, keep: list[str], rest: list[str], recursive: bool, maxdepth: int | None
    ) -> None:
        """Recycle `keep` and delete `rest` (outside the roots) as one step: one recycle
        when there is nothing else to delete, else prepare, delete `rest`, commit."""
        if not keep:
            if rest:
                self.fs.rm(rest, recursive=recursive, maxdepth=maxdepth)
            return
        if not rest:
            if not self._recycle(keep):
                self.fs.rm(keep, recursive=recursive, maxdepth=maxdepth)
            return
        tx = self._prepare(keep)
        if tx is None:
            self.fs.rm(keep + rest, recursive=recursive, maxdepth=maxdepth)
            return
        try:
            faults.point("fsspec.prepared")
            self.fs.rm(rest, recursive=recursive, maxdepth=maxdepth)
        except faults.Crash:
            raise  # an injected crash: nothing more happens, as if the process died
        except BaseException as e:
            self._abort(tx, e)
            raise
        self._commit(tx, keep, replaced=False)

    def _prune(self, dirs: Iterable[str]) -> None:
        """Remove those of `dirs` left empty, deepest first; a non-empty one stays."""
        for d in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
            try:
                if not self.fs.ls(d, detail=False):
                    self.fs.rmdir(d)
            except OSError as e:
                log.debug("directory left in place", extra={"dir": d, "error": str(e)})

    # -- replacing --------------------------------------------------------------------------
    @contextmanager
    def _one_call(self) -> Iterator[None]:
        """Every file replaced inside (by put_file, cp_file, pipe_file, a move) joins one
        transaction, swapped in when the outermost call returns; if the call raises,
        everything it wrote under a root is taken back."""
        if self._calls.batch is not None:
            yield
            return
        batch = self._calls.batch = _Batch()
        try:
            yield
        except BaseException:
            self._undo(batch)
            raise
        finally:
            self._calls.batch = None
        self._swap_in(batch)

    def _replace(
        self,
        path: str,
        write: Callable[[str], None],
        take_back: Callable[[str], None] | None = None,
    ) -> None:
        """Write `path` with `write(target)`: straight onto it unless that replaces a file
        under a root, else beside it, then swapped in (with the rest of the call).
        `take_back(where)` undoes a write (default: delete what it wrote)."""
        self._refuse_roots([path])
        back = take_back or self._drop
        if not self._replaces(path):
            write(path)
            batch = self._calls.batch
            if batch is not None and self._key(path) is not None:
                batch.created.append((path, back))
            return
        swap = _Swap(path, _sibling(path), back)
        try:
            write(swap.tmp)
        except BaseException:
            self._quietly(back, swap.tmp)
            raise
        self._finish(swap)

    def _finish(self, swap: _Swap) -> None:
        batch = self._calls.batch
        if batch is None:
            self._swap_in(_Batch({swap.path: swap}))
        else:
            earlier = batch.swaps.pop(swap.path, None)
            if earlier is not None:  # the same path written twice in one call: last wins
                self._quietly(earlier.take_back, earlier.tmp)
            batch.swaps[swap.path] = swap

    def _swap_in(self, batch: _Batch) -> None:
        """Prepare the old files, move the new ones into place, commit; on any failure the
        new files come back out, then the old ones are put back (abort)."""
        swaps = list(batch.swaps.values())
        if not swaps:
            return
        try:
            tx = self._prepare([s.path for s in swaps])
        except BaseException:
            self._undo(batch)
            raise
        moved: list[_Swap] = []
        try:
            faults.point("fsspec.prepared")
            for s in swaps:
                if tx is None:
                    self.fs.rm_file(s.path)  # failed open: the old file goes uncopied
                self._move_in(s)
                moved.append(s)
                faults.point("fsspec.moved_in")
                if tx is not None:
                    tx.keep()
        except faults.Crash:
            raise
        except BaseException as e:
            if tx is not None:
                # Out of the way first: the abort puts an old file back only where nothing is.
                for s in reversed(moved):
                    self._quietly(partial(self._move_out, s), s.path)
            self._undo(batch)
            if tx is not None:
                self._abort(tx, e)
            raise
        if tx is not None:
            self._commit(tx, [s.path for s in swaps], replaced=True)

    def _move_in(self, s: _Swap) -> None:
        """The new file onto the path its old one left, never over anything that appeared
        there since (a racing writer's file stays, and this call fails)."""
        if self.fs.lexists(s.path):
            raise FileExistsError(
                errno.EEXIST, "re-created during the overwrite: the new bytes stay out", s.path
            )
        self.fs.mv(s.tmp, s.path)

    def _move_out(self, s: _Swap, where: str) -> None:
        self.fs.mv(where, s.tmp)

    def _undo(self, batch: _Batch) -> None:
        for s in batch.swaps.values():
            self._quietly(s.take_back, s.tmp)
        for path, back in reversed(batch.created):
            self._quietly(back, path)

    def _quietly(self, fn: Callable[[str], None], path: str) -> None:
        """Clean-up after a failure: an error here is logged, never raised over the
        failure being reported."""
        try:
            fn(path)
        except Exception as e:
            log.warning(
                "could not clean up after a failed call", extra={"path": path, "error": str(e)}
            )

    def _drop(self, path: str) -> None:
        if self.fs.lexists(path):
            self.fs.rm_file(path)

    def _give_back(self, src: str, where: str) -> None:
        """Undo a move of `src` to `where`; if `src` is taken again, the file stays."""
        if not self.fs.lexists(where):
            return
        if self.fs.lexists(src):
            log.warning(
                "a moved file cannot go back: its source was re-created",
                extra={"path": where, "source": src},
            )
            return
        self.fs.mv(where, src)

    def _pairs(
        self,
        path1: str | list[str],
        path2: str | list[str],
        recursive: bool,
        maxdepth: int | None,
    ) -> tuple[list[tuple[str, str]], list[str]]:
        """(source, destination) of every file a move of `path1` onto `path2` names, laid
        out as fsspec's `copy` lays them out, and the destination directories."""
        if isinstance(path1, list) and isinstance(path2, list):  # both named in full
            paths1 = [self._strip_protocol(p) for p in path1]
            paths2 = [self._strip_protocol(p) for p in path2]
        else:
            one = isinstance(path1, str)
            srcs = (
                self._strip_protocol(path1)
                if isinstance(path1, str)
                else [self._strip_protocol(p) for p in path1]
            )
            paths1 = self.fs.expand_path(srcs, recursive=recursive, maxdepth=maxdepth)
            if one and (not recursive or maxdepth is not None):
                paths1 = [p for p in paths1 if not self.fs.isdir(p)]
            dst = self._strip_protocol(str(path2))
            into = str(path2).endswith("/") or bool(self.fs.isdir(dst))
            magic = one and has_magic(str(path1))
            exists = one and (
                (magic and len(paths1) == 1)
                or (not magic and into and not str(path1).endswith("/"))
            )
            paths2 = other_paths(paths1, dst, exists=exists, flatten=not one)
        pairs: list[tuple[str, str]] = []
        dirs: list[str] = []
        for a, b in zip(paths1, paths2, strict=True):
            if self.fs.isdir(a):
                dirs.append(b)
            else:
                pairs.append((a, b))
        return pairs, dirs

    # -- destructive calls --------------------------------------------------------------------
    def rm(
        self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None
    ) -> None:
        paths = [self._strip_protocol(p) for p in (path if isinstance(path, list) else [path])]
        self._refuse_roots(paths)  # before anything is listed
        pruned: list[str] = []
        if recursive and maxdepth is None:
            # A directory under a root goes whole: the daemon recycles what is in it.
            found = self.fs.expand_path(paths, recursive=False)
            self._refuse_roots(found)  # what a glob matched
            keep = [p for p in found if self._recyclable(p)]
        else:
            # Exactly what the target would delete, file by file.
            found = self.fs.expand_path(paths, recursive=recursive, maxdepth=maxdepth)
            self._refuse_roots(found)
            under = [p for p in found if self._recyclable(p)]
            keep = [p for p in under if not self._is_dir(p)]
            if recursive:
                # The target may remove a directory whole (the local one ignores maxdepth):
                # one under a root goes only once emptied.
                pruned = [p for p in under if self._is_dir(p)]
        taken = {*keep, *pruned}
        rest = [p for p in found if p not in taken and self.fs.lexists(p)]
        self._delete(keep, rest, recursive, maxdepth)
        self._prune(pruned)

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        self._refuse_roots([path])
        if self._recyclable(path) and not self._is_dir(path) and self._recycle([path]):
            return
        self.fs.rm_file(path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rmdir(self, path: str) -> None:
        path = self._strip_protocol(path)
        self._refuse_roots([path])
        self.fs.rmdir(path)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: Any = None,
        autocommit: bool = True,
        cache_options: Any = None,
        **kwargs: Any,
    ) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode:
            return self.fs.open(
                path, mode, block_size=block_size, cache_options=cache_options, **kwargs
            )
        self._refuse_roots([path])
        if "x" in mode or not self._replaces(path):
            return self.fs.open(path, mode, block_size=block_size, **kwargs)
        swap = _Swap(path, _sibling(path), self._drop)
        try:
            if "a" in mode:  # the old bytes, then the appended ones, replace the file
                self.fs.cp_file(path, swap.tmp)
            inner = self.fs.open(swap.tmp, mode, block_size=block_size, **kwargs)
        except BaseException:
            self._quietly(self._drop, swap.tmp)
            raise
        return _ReplacingFile(self, swap, inner)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if kwargs.get("mode") == "create" and self.fs.exists(path):
            raise FileExistsError(path)
        self._replace(path, lambda p: self.fs.pipe_file(p, value, **kwargs))

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        rpath = self._strip_protocol(rpath)
        self._replace(rpath, lambda p: self.fs.put_file(lpath, p, **kwargs))

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        self._replace(p2, lambda p: self.fs.cp_file(p1, p, **kwargs))

    def put(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().put(*args, **kwargs)

    def copy(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().copy(*args, **kwargs)

    def pipe(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().pipe(*args, **kwargs)

    def mv(
        self,
        path1: str | list[str],
        path2: str | list[str],
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        srcs = [self._strip_protocol(p) for p in (path1 if isinstance(path1, list) else [path1])]
        if isinstance(path2, str) and srcs == [self._strip_protocol(path2)]:
            return
        self._refuse_roots(srcs)
        found = self.fs.expand_path(srcs, recursive=False)
        self._refuse_roots(found)
        if (
            self._local
            and isinstance(path1, str)
            and isinstance(path2, str)
            and found == srcs
            and self._is_dir(srcs[0])
        ):
            # One rename, as the target makes it: shutil.move puts a directory into an
            # existing one under its own name and refuses a name already taken, so it
            # never replaces a file.
            dst = self._strip_protocol(path2)
            into = posixpath.join(dst, posixpath.basename(srcs[0]))
            self._refuse_roots([into if self.fs.isdir(dst) else dst])
            self.fs.mv(srcs[0], dst, recursive=recursive, maxdepth=maxdepth, **kwargs)
            return
        pairs, dirs = self._pairs(path1, path2, recursive, maxdepth)
        # What a moved directory leaves behind, removed once empty (as mv leaves none).
        emptied = [
            d
            for top in found
            if recursive and self._is_dir(top)
            for d in (top, *self.fs.find(top, maxdepth=maxdepth, withdirs=True, detail=False))
            if self._is_dir(d)
        ]
        with self._one_call():
            for d in dirs:  # never destructive: an existing one (a root, say) is kept as is
                self.fs.makedirs(d, exist_ok=True)
            for src, to in pairs:
                self._replace(to, partial(self.fs.mv, src), partial(self._give_back, src))
        self._prune(emptied)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if truncate:
            self._replace(path, lambda p: self.fs.touch(p, truncate=True, **kwargs))
            return
        self.fs.touch(path, truncate=truncate, **kwargs)

    # -- everything else: forwarded --------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.fs.ls(self._strip_protocol(path), detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.fs.info(self._strip_protocol(path), **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.fs.exists(self._strip_protocol(path), **kwargs))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(self._strip_protocol(path)))

    def isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(self._strip_protocol(path)))

    def lexists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.fs.lexists(self._strip_protocol(path), **kwargs))

    def size(self, path: str) -> Any:
        return self.fs.size(self._strip_protocol(path))

    def checksum(self, path: str) -> Any:
        return self.fs.checksum(self._strip_protocol(path))

    def ukey(self, path: str) -> Any:
        return self.fs.ukey(self._strip_protocol(path))

    def modified(self, path: str) -> Any:
        return self.fs.modified(self._strip_protocol(path))

    def created(self, path: str) -> Any:
        return self.fs.created(self._strip_protocol(path))

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> Any:
        return self.fs.cat_file(self._strip_protocol(path), start=start, end=end, **kwargs)

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        self.fs.get_file(self._strip_protocol(rpath), lpath, **kwargs)

    def find(
        self,
        path: str,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        return self.fs.find(
            self._strip_protocol(path),
            maxdepth=maxdepth,
            withdirs=withdirs,
            detail=detail,
            **kwargs,
        )

    def walk(
        self,
        path: str,
        maxdepth: int | None = None,
        topdown: bool = True,
        on_error: str = "omit",
        **kwargs: Any,
    ) -> Any:
        return self.fs.walk(
            self._strip_protocol(path),
            maxdepth=maxdepth,
            topdown=topdown,
            on_error=on_error,
            **kwargs,
        )

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> Any:
        return self.fs.glob(self._strip_protocol(path), maxdepth=maxdepth, **kwargs)

    def du(
        self,
        path: str,
        total: bool = True,
        maxdepth: int | None = None,
        withdirs: bool = False,
        **kwargs: Any,
    ) -> Any:
        return self.fs.du(
            self._strip_protocol(path), total=total, maxdepth=maxdepth, withdirs=withdirs, **kwargs
        )

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.fs.mkdir(self._strip_protocol(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.fs.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def sign(self, path: str, expiration: int = 100, **kwargs: Any) -> Any:
        return self.fs.sign(self._strip_protocol(path), expiration=expiration, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(None if path is None else self._strip_protocol(path))


@dataclass
class _Swap:
    """One file a call replaces: its new bytes wait at `tmp`, beside `path`;
    `take_back(where)` removes them again (or returns a moved file to its source)."""

    path: str
    tmp: str
    take_back: Callable[[str], None]


@dataclass
class _Batch:
    """What one call has written under the roots so far: the replacements waiting to be
    swapped in, and the files it created (with how to take each back)."""

    swaps: dict[str, _Swap] = field(default_factory=dict)
    created: list[tuple[str, Callable[[str], None]]] = field(default_factory=list)


class _Calls(threading.local):
    """The batch of the call running in this thread, if any."""

    batch: _Batch | None = None


class _Tx:
    """A prepared transaction as the hook holds it."""

    def __init__(self, client: Client, prepared: PreparedTx, started: float) -> None:
        self.client = client
        self.txid = prepared.txid
        self.files = prepared.files
        self.started = started  # our clock, just before the prepare
        self._schedule(prepared.expires)

    def _schedule(self, expires: float) -> None:
        self.expires = expires
        # The daemon's clock: on another host it may be a little off ours, which moves
        # the renewal, not the deadline.
        self.renew_at = time.monotonic() + max(1.0, expires - time.time()) / 3

    @property
    def until(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.expires))

    def keep(self) -> None:
        """Renew the lease once a third of it has passed. Best effort: if the daemon
        cannot be reached the commit decides, and says what is left."""
        if time.monotonic() < self.renew_at:
            return
        try:
            self._schedule(self.client.renew(self.txid))
        except CmrootError as e:
            log.warning(
                "could not renew a prepared recycle's lease",
                extra={"txid": self.txid, "error": str(e)},
            )

    def recorded(self) -> bool:
        """Whether a commit whose answer was lost went through: the newest entry of the
        transaction's first file since the prepare carries an event (a rollback would
        have left a displaced entry, without one)."""
        first = self.files[0]
        cursor = None
        try:
            for _ in range(_ENTRY_PAGES):
                page = self.client.entries(limit=_ENTRY_PAGE, cursor=cursor)
                for e in page["entries"]:
                    if e["recycled"] < self.started - _CLOCK_SLACK:
                        return False
                    if (e["path"], e["checksum"]) == (first.path, first.checksum):
                        return e.get("event_id") is not None
                cursor = page.get("cursor")
                if cursor is None:
                    return False
        except CmrootError as e:
            log.warning(
                "could not tell whether a commit went through",
                extra={"txid": self.txid, "error": str(e)},
            )
        return False


class _ReplacingFile:
    """A file being written beside its target; on a clean close it is swapped in (see
    `CmrootFileSystem._swap_in`), on an error (or `discard()`) it is dropped."""

    def __init__(self, owner: CmrootFileSystem, swap: _Swap, inner: Any) -> None:
        self._owner, self._swap, self._inner = owner, swap, inner
        self.path = swap.path
        self._done = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, data: Any) -> Any:
        return self._inner.write(data)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return bool(self._inner.seekable())

    @property
    def closed(self) -> bool:
        return bool(self._done)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._inner.close()
        except BaseException:
            self._owner._quietly(self._owner._drop, self._swap.tmp)
            raise
        self._owner._finish(self._swap)

    def discard(self) -> None:
        if not self._done:
            self._done = True
            self._inner.close()
            self._owner._quietly(self._owner._drop, self._swap.tmp)

    def __enter__(self) -> _ReplacingFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


def _under(path: str, top: str) -> bool:
    """`path` is `top` or lies below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _sibling(path: str) -> str:
    d, name = posixpath.split(path)
    return posixpath.join(d, f".{name}.cmroot-{uuid.uuid4().hex[:12]}.tmp")


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (list, tuple)) else (str(p),)

"""`cmroot`: an fsspec filesystem that wraps another one and hands every file it would
delete or overwrite under a warehouse root to the cmroot daemon first (op `DELETE`).

    import fsspec
    fs = fsspec.filesystem("cmroot", target_protocol="file", url="http://127.0.0.1:9750")
    fs.rm("/lake/warehouse/sales.db/orders/p=1", recursive=True)   # recycled, then gone
    with fs.open("/lake/warehouse/x/part-0.parquet", "wb") as f:  # old bytes recycled
        f.write(data)

or by URL chaining, e.g. `pd.read_parquet(...)`/`df.to_parquet("cmroot::file:///lake/...")`.

What is protected, and how:

- **Paths as the target reaches them.** A path is read as the target filesystem reads it
  (its own `_strip_protocol`: on the local filesystem `file:`, `local:` and `~` too;
  `os.PathLike` accepted, anything else a `BadRequest`). On the local filesystem it is
  then resolved as the kernel resolves it, once, before anything is decided: every
  symlink and `..` on the way (`x/link/..` is the link target's parent), and for a write
  the file itself too (a write through a symlink writes the file it points to); a delete
  removes a symlink, not what it points to. Every decision (a root or not, the Spark and
  Hive staging exemption) is made on that real path, and the call acts on it, not on the
  name it was given: a symlink on the way that changes afterwards changes nothing.
- **The roots and their ancestors.** A warehouse root (`warehouse_roots=`, default the
  cmroot config's `store.warehouse_roots`) and every directory that contains one (`/lake`
  for the root `/lake/warehouse`, and `/`) is never removed, moved or written over: `rm`
  (recursive or not, named or matched by a glob), `rm_file`, `rmdir`, `mv`/`rename` of
  one or onto one's name (moving files *into* a root is fine) and every write onto one
  raise `Forbidden` naming the root and the fix, before anything is listed or deleted,
  whether the daemon is up or not (`fail_open` included). On the local filesystem what
  the hook removes itself (paths outside the roots, symlinks and staging directories
  under them, emptied directories) is removed relative to a directory descriptor opened
  without following any symlink, and a directory whose device and inode are a root's or
  an ancestor's is never removed: a directory on the way swapped for a symlink after the
  path was resolved makes the call fail (`Conflict`) instead of deleting elsewhere.
- **Deletes.** Files under a root (Spark and Hive staging directories excepted) are
  recycled before they go, every path of the call in one two-phase transaction: prepare,
  delete the call's paths outside the roots, commit; a failure in between aborts it (the
  recycled files come back). Everything a call names is checked first (a directory
  without `recursive=True`, a missing path), so a call the target would refuse midway
  deletes nothing.
- **Overwrites** (`open(..., "wb"|"ab"|"r+b"|...)`, `pipe_file`, `put_file`, `cp_file`,
  `get_file` onto the local filesystem, `mv` onto an existing file,
  `touch(truncate=True)`). The new bytes are written beside the file first (an append or
  a `+` mode works on a copy of the file). Once they are complete, one two-phase recycle
  replaces it: *prepare* moves the old file into the daemon's staging (nothing is
  published), the new file is moved into place (never over anything that appeared there
  meanwhile: renameat2 RENAME_NOREPLACE on the local filesystem), then *commit* publishes
  the event. A failed write leaves the old file untouched (a `with` block that raises
  drops the new bytes, in text mode and under a compression codec too); a refused
  prepare leaves it too; a failed move-in takes the new files already moved back out and
  aborts, so every old file is back and no event exists. A copy the target would refuse
  or that replaces nothing (a directory as the source, a file onto itself) goes to the
  target as it is: its answer, nothing recycled.
- **One transaction per call.** A call that replaces several files (`put`, `get`, `copy`,
  `mv` of several files, `pipe` of a dict) writes every new file first, then makes one
  prepare, the move-ins and one commit. If any part fails or is refused, every path under
  a root is as it was: old files back, files the call created there removed, moved
  sources returned. A file the call itself created is its own output: writing it again
  replaces it without a recycle. A warehouse file the unit moved onto a name is not: a
  write over it whole undoes that move and recycles the file at its old path.
- **Moves out of the roots** (`mv` of a file or directory under a root to a path outside
  every root) are deletes as far as the table and its replicas are concerned: the call
  copies the files beside their destinations, prepares the sources in its transaction,
  then renames each copy over its destination (as a rename would: a symlink there is
  replaced, never written through) and commits; a refused recycle removes the copies
  and the directories the call made, and leaves the sources and the destinations.
- **`fs.transaction`** is one unit too: the replacements made inside it wait for its end,
  `rm`s inside it join its two-phase transaction at once (the files leave for staging;
  paths outside the roots are only noted, and deleted at its end after the prepare, so
  reads inside the block still see them), the copies of a move out of the roots are
  put in place at its end, files it creates under a root are taken back if it fails,
  and files opened for writing elsewhere are deferred by the target, as fsspec defers
  them. A block that ends cleanly commits all of it with one event; one that raises
  leaves every path as it was, with no event, and so does a process that dies inside it
  (the daemon puts the recycled files back when the lease ends). A block inside another
  joins it: the outermost end commits or takes back the whole, and an inner block that
  raises fails it even if the error is caught.
- **The lease.** Between prepare and commit there are only renames on a local
  filesystem (the long writes come before the prepare); on an object store a move-in is a
  server-side copy, which can take long for big objects, so between move-ins the lease is
  renewed whenever a third of it has passed.
- **A commit that fails** after the new files are in place is retried (`retry_delays`:
  the daemon may be restarting; a commit whose answer was lost is answered with its event
  when sent again, and a 404 means the lease passed and the daemon rolled it back). If
  the commit cannot be made, the call raises a CmrootError saying the change was applied but not
  recorded. The new files stay (taking them back could leave neither file, were the
  commit in fact made). The daemon rolls the prepared transaction back when its lease
  (`store.prepare_lease`) ends; as each path now holds its new file, and a rollback never
  overwrites, the old bytes are kept in the store as *displaced* entries, retrievable by
  path and old checksum, with no event. Nothing is lost and no replica replays a change
  that is not recorded; replicas do not see this overwrite either, so the error says to
  bootstrap what they replicate. For a delete, the rollback puts the files back; if the
  daemon could not be reached to tell, the error says the outcome is unknown and where
  to look.

If the daemon refuses or is unreachable, the call raises a CmrootError and nothing is
deleted, unless `fail_open=True` and the daemon is down (unreachable, or a 5xx; a 4xx
refusal always raises): then it is logged and counted in
`CmrootFileSystem.fail_open_count`, and files are deleted or replaced without a copy (an
overwrite whose commit failed is kept likewise; a delete whose commit failed is not: the
daemon puts its files back, so that still raises).

Every other call is forwarded unchanged to the target filesystem.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from glob import has_magic
from typing import Any, ClassVar, TypeVar

from fsspec import filesystem
from fsspec.compression import compr
from fsspec.core import get_compression
from fsspec.spec import AbstractFileSystem
from fsspec.transaction import Transaction
from fsspec.utils import isfilelike, other_paths, stringify_path

try:  # fsspec >= 2025: a chained filesystem takes the inner URL's path ("cmroot::file://...")
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

from cmroot import audit, faults
from cmroot.client import Client, PreparedTx
from cmroot.exceptions import (
    BadRequest,
    CmrootError,
    Conflict,
    DaemonUnavailable,
    Forbidden,
    NotFound,
)

log = logging.getLogger("cmroot.hooks.fsspec")

# Pauses before each retry of a commit or an abort the daemon did not answer: together
# longer than a daemon restart takes.
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)
# Directory names Spark's and Hive's commit protocols write their job output under.
_STAGING = (".spark-staging-", ".hive-staging")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# (device, inode) of each root and of each directory above one -> the root, as configured.
_Guard = Mapping[tuple[int, int], str]


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
            str(self.url), token if token is not None else os.environ.get("CMROOT_TOKEN"),
            audit=audit.here(),
        )
        self.fail_open = fail_open
        self.op = op
        self.retry_delays = tuple(retry_delays)
        self._calls = _Calls()

    # -- paths ------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        """This filesystem's own prefixes off (`cmroot::`, `cmroot://`, and `file://`,
        kept for callers that name this class's paths without an instance); the target's
        are taken off by `_name`."""
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = _text(path)
        for prefix in ("cmroot::", "cmroot://"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        if path.startswith("file://"):
            path = path[len("file://") :]
        # "" (not "/") for a bare "cmroot://", so chaining takes the inner URL's path
        return path.rstrip("/") or ("/" if path else "")

    def _name(self, path: Any) -> str:
        """`path` as the target names it: the target's own `_strip_protocol` after ours, so
        that the hook and the target agree on which file it is (the local one also strips
        `file:`, `local://` and `local:`, expands `~` and makes the path absolute)."""
        return str(self.fs._strip_protocol(self._strip_protocol(path)))

    def _norm(self, path: str) -> str:
        """A root's name as configured, normalised by name: an absolute local path, else
        the full URL."""
        if self._local:
            return _slash(os.path.normpath(self._name(path)))
        return str(self.fs.unstrip_protocol(self.fs._strip_protocol(path))).rstrip("/")

    def _real(self, name: str, follow: bool = False) -> str:
        """On the local filesystem, the path the kernel reaches for the target's `name`:
        every symlink and `..` on the way resolved (physically: `link/..` is the parent of
        the link's target), and with `follow` the last component too (a write goes through
        a symlink; a delete or a rename acts on the link itself). Elsewhere, `name`."""
        if not self._local:
            return name
        head, base = posixpath.split(name)
        if follow or base in ("", ".", ".."):
            return _slash(os.path.realpath(name))
        return posixpath.join(_slash(os.path.realpath(head or "/")), base)

    def _resolve(self, path: Any) -> str:
        """The path a delete, or the source of a move, acts on."""
        return self._real(self._name(path))

    def _dest(self, path: Any, follow: bool = True) -> str:
        """The path a write acts on (refused if it is a root or contains one): through a
        symlink with `follow` (what open and copy do), the name itself without (what a
        rename replaces). A symlink that itself lies under a root is not followed: cmroot
        does not follow links under a root, and the daemon refuses to recycle one."""
        dst = self._resolve(path)
        if follow and self._local and os.path.islink(dst) and self._key(dst) is None:
            dst = _slash(os.path.realpath(dst))
        self._refuse_roots([dst])
        return dst

    def _real_roots(self) -> list[tuple[str, str]]:
        """(root as configured, its real path) for each root."""
        if not self._local:
            return [(r, r) for r in self.roots]
        return [(r, _slash(os.path.realpath(r))) for r in self.roots]

    def _spellings(self, path: str) -> set[str]:
        """The names `path` goes by when compared with a root: itself and, for a directory
        (or a symlink to one) on the local filesystem, its real path."""
        if not self._local:
            # `..` and "//" resolved by name: an object store may keep them literally, but
            # refusing too much here is safe and refusing too little is not.
            name = self._norm(path)
            scheme, sep, rest = name.partition("://")
            return {scheme + sep + posixpath.normpath("/" + rest)[1:]} if sep else {name}
        # Only a directory can contain a root: one stat spares a realpath for each file.
        return {path, _slash(os.path.realpath(path))} if os.path.isdir(path) else {path}

    def _refuse_roots(self, paths: Iterable[str]) -> None:
        """Forbidden if any of `paths` (resolved) is a warehouse root or contains one."""
        roots = [
            (r, s) for r, real in self._real_roots() for s in {*self._spellings(r), real}
        ]
        for p in paths:
            for name in self._spellings(p):
                for root, spelling in roots:
                    if _under(spelling, name):
                        raise _refusal(p, root, "is" if name == spelling else "contains")

    def _root_ids(self) -> _Guard:
        """The device and inode of every root and of every directory above one, as they
        are now: what the hook's own removals check each directory against."""
        guard: dict[tuple[int, int], str] = {}
        for root, real in self._real_roots():
            p = real
            while True:
                try:
                    st = os.stat(p)
                except OSError:
                    pass  # a root not created yet: its existing ancestors still count
                else:
                    guard.setdefault((st.st_dev, st.st_ino), root)
                if p == "/":
                    break
                p = posixpath.dirname(p)
        return guard

    def _key(self, path: str) -> str | None:
        """The daemon's name for the resolved `path` if it lies under a warehouse root (and
        not in a Spark or Hive staging directory there), else None: the root's configured
        name and the path below it."""
        below = self._below(path)
        if below is None:
            return None
        root, rel = below
        if any(seg.startswith(_STAGING) or seg == "_temporary" for seg in rel.split("/")):
            return None
        return root.rstrip("/") + rel

    def _below(self, path: str) -> tuple[str, str] | None:
        """(root as configured, the path below it) if the resolved `path` lies under a
        warehouse root, staging directories included; else None."""
        name = path if self._local else self._norm(path)
        for root, real in self._real_roots():
            if _under(name, real):
                return root, name[len(real.rstrip("/")) :]
        return None

    def protected(self, path: str) -> bool:
        """Whether `path` lies under a warehouse root (and is recycled before it goes)."""
        return self._key(self._resolve(path)) is not None

    def _replaces(self, dst: str) -> bool:
        """Whether writing the resolved `dst` replaces a file under a root."""
        return self._key(dst) is not None and bool(self.fs.isfile(dst))

    def _recyclable(self, path: str) -> bool:
        """Under a root and there. Not a symlink: removing a link deletes no data, so the
        hook removes it (the daemon refuses symlinks)."""
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

    def _same(self, src: str, dst: str, same_fs: bool) -> bool:
        """Whether copying `src` onto `dst` copies a file onto itself."""
        if self._local:
            try:
                return os.path.samefile(src, dst)
            except OSError:
                return False
        return same_fs and self._norm(src) == self._norm(dst)

    # -- talking to the daemon --------------------------------------------------------------
    def _daemon_failed(self, paths: list[str], e: CmrootError) -> None:
        """The daemon refused or could not be reached: raise, or, when it is down
        (unreachable or a 5xx) and fail_open is set, log and count it (the caller then goes
        on without a copy). A 4xx refusal is never failed open: deleting anyway would lose
        exactly what the daemon refused to take."""
        if not self.fail_open or e.status < 500:
            detail = str(e) + (self._where_to_write() if isinstance(e, Forbidden) else "")
            if isinstance(e, DaemonUnavailable):
                detail += (
                    "; if the daemon staged the files before the connection was lost, it"
                    " puts them back when that prepared transaction's lease ends"
                )
            raise CmrootError(
                f"cmroot could not recycle {len(paths)} path(s) (first {paths[0]}); "
                "nothing was deleted",
                detail,
            ) from e
        type(self).fail_open_count += 1
        log.warning(
            "cmroot unavailable; deleting without a copy (fail_open=True)",
            extra={"paths": len(paths), "first": paths[0], "error": str(e)},
        )

    def _prepare(self, paths: list[str], join: _Tx | None = None) -> _Tx | None:
        """Move the files at `paths` into the daemon's staging, unpublished (adding them to
        the prepared transaction `join`). None when failed open: the caller deletes them
        as usual. A part that cannot join a transaction is never failed open: the daemon
        has rolled the whole transaction back."""
        keys = [self._key(p) or self._norm(p) for p in paths]
        try:
            prepared = self.client.prepare(keys, txid=join.txid if join else None, op=self.op)
        except CmrootError as e:
            if join is None:
                self._daemon_failed(paths, e)
                return None
            raise CmrootError(
                f"cmroot could not recycle {len(paths)} path(s) (first {paths[0]}) as part"
                f" of transaction {join.txid}",
                f"{e}; the daemon rolls the whole transaction back: every file it recycled"
                " is put back, and nothing of it is recorded",
            ) from e
        if join is None:
            return _Tx(self.client, prepared)
        join.joined(prepared)
        return join

    def _commit(self, tx: _Tx, paths: list[str], replaced: bool) -> None:
        """Publish, retrying while the daemon cannot be reached (it may be restarting). A
        commit is safe to send again: one that went through before its answer was lost is
        answered with its event, and a 404 means the transaction was rolled back. Raises a
        CmrootError saying what is left if no try commits."""
        error: CmrootError | None = None
        for delay in (0.0, *self.retry_delays):
            time.sleep(delay)
            try:
                self.client.commit(tx.txid)
                return
            except DaemonUnavailable as e:
                error = e
            except CmrootError as e:  # the daemon's commit failed, or its lease passed
                error = e
                break
        assert error is not None
        lost = isinstance(error, DaemonUnavailable)
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
            if lost:
                after += (
                    " (unless a commit the daemon could not answer went through: then the"
                    " overwrite is recorded, as GET /v1/entries shows)"
                )
            if self.fail_open:
                type(self).fail_open_count += 1
                log.warning(message, extra={"error": str(error), "txid": tx.txid})
                return
        elif lost:
            message = f"the delete of {what} could not be recorded, or its answer was lost"
            after = (
                "the daemon could not be reached to confirm the commit. If it committed"
                " before the connection was lost, the files are recycled with their"
                f" event; if not, it puts them back when the lease of transaction {tx.txid}"
                f" ends ({tx.until}), with no event. Resolve the paths (or read GET"
                " /v1/entries) once the daemon is back to see which; paths outside the"
                " warehouse roots named by the same call are deleted"
            )
        else:
            message = f"the delete of {what} could not be recorded"
            after = (
                f"the daemon puts the files back when the lease of transaction {tx.txid}"
                f" ends ({tx.until}), if it has not already, with no event; paths outside"
                " the warehouse roots"
                " named by the same call are deleted: run it again once the daemon is back"
            )
        raise CmrootError(message, f"{error}; {after}") from error

    def _abort(self, tx: _Tx, cause: BaseException | None) -> None:
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
                return  # its lease passed, or a part failed to join: rolled back already
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
            f"{cause or 'the transaction was discarded'}; then {error}: the daemon puts"
            f" them back when the lease of transaction {tx.txid} ends ({tx.until});"
            " nothing is lost and no event is recorded",
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
    def _check_removable(self, paths: Iterable[str], recursive: bool) -> None:
        """Raise what the local target would raise for any of `paths`, before anything is
        deleted: the target checks each path only when it reaches it."""
        if not self._local:
            return
        for p in paths:
            if not os.path.lexists(p):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), p)
            if self._is_dir(p):
                if not recursive:
                    raise ValueError("Cannot delete directory, set recursive=True")
                if p == os.getcwd():
                    raise ValueError("Cannot delete current working directory")

    def _delete(
        self, keep: list[str], rest: list[str], recursive: bool, maxdepth: int | None
    ) -> None:
        """Recycle `keep` and delete `rest` (not recycled) as one step: prepare, delete
        `rest`, commit. Inside `fs.transaction` the prepare joins the transaction's, and
        `rest` is only noted (`_doom`): its end deletes it and commits, or aborts. Inside
        a call (the sources a move takes out of the roots, a moved file written over) the
        prepare joins the call's, which its end commits or aborts."""
        unit = self._unit()
        batch = unit or self._calls.batch
        remove = self._remove if batch is None else partial(self._doom, batch)
        if not keep:
            remove(rest, recursive, maxdepth)
            return
        if batch is not None and batch.broken is not None:
            raise CmrootError(
                "an earlier part of this transaction failed: nothing more is deleted",
                str(batch.broken),
            )
        try:
            tx = self._prepare(keep, join=batch.tx if batch else None)
        except BaseException as e:
            if batch is not None and batch.tx is not None:
                batch.broken = e
            raise
        if tx is None:
            remove(keep + rest, recursive, maxdepth)
            return
        if batch is not None:
            batch.tx = tx
        try:
            faults.point("fsspec.prepared")
            remove(rest, recursive, maxdepth)
        except faults.Crash:
            raise  # an injected crash: nothing more happens, as if the process died
        except BaseException as e:
            if batch is not None:
                batch.broken = e
            self._abort(tx, e)
            raise
        if batch is None:
            self._commit(tx, keep, replaced=False)

    def _doom(self, batch: _Batch, paths: list[str], recursive: bool, maxdepth: int | None) -> None:
        """Inside a unit, what would be deleted without a recycle (paths outside the roots,
        or anything when failed open) is only noted, the paths checked to be there (by
        the caller: `rm` checks what it names): the unit's end deletes it once its
        prepare has succeeded (`_set_aside`, `_drop_aside`). Nothing is renamed before:
        a block that raises, or a process that dies inside it, leaves those paths as
        they were (a failed open source of a move out goes only after its copy is in
        place)."""
        if not paths:
            return
        if self._local:
            # The local target removes a directory whole (it ignores maxdepth): so does
            # `_set_aside`, which takes the topmost paths.
            files, dirs = list(paths), []
        else:
            # Elsewhere exactly the files the target would delete now; their directories
            # (mere prefixes on an object store) go once empty, at the end.
            found = self.fs.expand_path(paths, recursive=recursive, maxdepth=maxdepth)
            dirs = [p for p in found if self.fs.isdir(p)]
            files = [p for p in found if p not in dirs]
        with batch.lock:
            batch.doomed += files
            batch.emptied += dirs

    def _set_aside(self, batch: _Batch) -> None:
        """At the unit's end, after its prepare: rename what it deletes without a recycle
        (`_doom`) to hidden names beside it, all of it before anything is removed for good
        (`_drop_aside`), so that a failure on the way renames it all back (`_undo`)."""
        if not batch.doomed:
            return
        if self._local:
            guard = self._root_ids()
            # Topmost only: a path named twice, or inside a directory named too, goes
            # with it.
            for p in _tops(batch.doomed):
                where = _sibling(p)
                parent, name = posixpath.split(p)
                with _bound_dir(parent) as pfd, _named(name, p):
                    if stat.S_ISDIR(os.lstat(name, dir_fd=pfd).st_mode):
                        _check_dir_at(pfd, name, p, guard)
                    os.rename(name, posixpath.basename(where), src_dir_fd=pfd, dst_dir_fd=pfd)
                batch.aside.append((p, where))
            return
        for p in dict.fromkeys(batch.doomed):  # once each, in the order the rms named them
            where = _sibling(p)
            self.fs.mv(p, where)
            batch.aside.append((p, where))

    def _drop_aside(self, batch: _Batch) -> None:
        """Remove for good what `_set_aside` kept (the unit is about to commit)."""
        self._remove([where for _, where in batch.aside], True, None)
        self._prune(batch.emptied)

    def _remove(self, paths: list[str], recursive: bool, maxdepth: int | None) -> None:
        """Delete `paths` without a copy, deepest first: on the local filesystem bound to
        what was checked (see `_remove_local`), elsewhere by the target."""
        if not paths:
            return
        if not self._local:
            self.fs.rm(paths, recursive=recursive, maxdepth=maxdepth)
            return
        guard = self._root_ids()
        for p in sorted(set(paths), reverse=True):
            self._remove_local(p, recursive, guard)

    def _remove_local(self, path: str, recursive: bool, guard: _Guard) -> None:
        """Remove the resolved `path` as the local target would (a directory whole, a
        symlink as a name), relative to its parent's descriptor opened without following
        a symlink: the removal is bound to the directory that was checked. No directory
        that is a root or holds one (by device and inode) is removed."""
        parent, name = posixpath.split(path)
        with _bound_dir(parent) as pfd, _named(name, path):
            if recursive and stat.S_ISDIR(os.lstat(name, dir_fd=pfd).st_mode):
                _rmtree_at(pfd, name, path, guard)
            else:  # rm checked for directories first: this is rm_file's os.remove
                os.unlink(name, dir_fd=pfd)

    def _rmdir_local(self, path: str, guard: _Guard) -> None:
        parent, name = posixpath.split(path)
        with _bound_dir(parent) as pfd, _named(name, path):
            _check_dir_at(pfd, name, path, guard)
            os.rmdir(name, dir_fd=pfd)

    def _prune(self, dirs: Iterable[str]) -> None:
        """Remove those of `dirs` left empty, deepest first; a non-empty one stays."""
        if not dirs:
            return
        guard = self._root_ids() if self._local else {}
        for d in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
            try:
                if self._local:
                    self._rmdir_local(d, guard)
                elif not self.fs.ls(d, detail=False):
                    self.fs.rmdir(d)
            except OSError as e:
                log.debug("directory left in place", extra={"dir": d, "error": str(e)})

    # -- replacing --------------------------------------------------------------------------
    def _unit(self) -> _Batch | None:
        """The batch of the `fs.transaction` in progress, if any."""
        t = self._transaction if self._intrans else None
        return t.batch if isinstance(t, _CmrootTransaction) else None

    def _batch(self) -> _Batch | None:
        """Where a replacement joins: the call running in this thread, else the
        transaction in progress."""
        return self._calls.batch or self._unit()

    def start_transaction(self) -> _CmrootTransaction:
        """As entering `with fs.transaction:` (fsspec's would start a new transaction over
        one in progress, dropping what it holds): inside one, this joins it."""
        t: _CmrootTransaction = self.transaction
        t.start()
        return t

    def end_transaction(self) -> None:
        """As a `with fs.transaction:` block ending cleanly: an inner end does nothing
        (fsspec's would drop the transaction in progress), the outermost commits."""
        t: _CmrootTransaction = self.transaction
        if t.depth > 1:
            t.complete()
            return
        super().end_transaction()

    @contextmanager
    def _one_call(self) -> Iterator[None]:
        """Every file replaced inside (by put_file, cp_file, pipe_file, a move) joins one
        transaction, swapped in when the outermost call returns (or, inside
        `fs.transaction`, when it ends); if the call raises, everything it wrote under a
        root is taken back."""
        if self._calls.batch is not None:
            yield
            return
        batch = self._calls.batch = _Batch()
        try:
            yield
        except BaseException as e:
            self._rollback(batch, e)  # with the sources a move out of the roots prepared
            raise
        finally:
            self._calls.batch = None
        unit = self._unit()
        if unit is None:
            self._swap_in(batch)
            return
        with unit.lock:
            for s in batch.swaps.values():
                self._add_swap(unit, s)
            unit.created += batch.created
            unit.outs += batch.outs
            unit.doomed += batch.doomed
            unit.emptied += batch.emptied
            unit.dirs += batch.dirs

    def _made(self, dst: str) -> tuple[_Batch, _Made] | None:
        """What this call (or transaction) last wrote at `dst`, and in which batch."""
        for b in (self._calls.batch, self._unit()):  # the call's is the newer
            if b is not None:
                with b.lock:
                    made = next((m for m in reversed(b.created) if m.path == dst), None)
                if made is not None:
                    return b, made
        return None

    def _created_here(self, dst: str) -> bool:
        """Whether this call (or transaction) wrote `dst` itself: its own output. A
        warehouse file it moved there is not (see `_reclaim`)."""
        found = self._made(dst)
        return found is not None and found[1].source is None

    def _reclaim(self, dst: str) -> None:
        """Before `dst` is written whole: if this unit moved a warehouse file there, the
        write would destroy it with no recycle (its old path is gone, and it is not the
        unit's output). The move is undone and the file recycled at its source, into
        the unit's transaction, as if the move had been a delete. If its source was
        taken again meanwhile, the file stays at `dst`, where the write recycles it as it
        recycles any existing file."""
        found = self._made(dst)
        if found is None:
            return
        batch, made = found
        source = made.source
        if source is None or self.fs.lexists(source):
            return
        self.fs.mv(dst, source)
        with batch.lock:
            batch.created.remove(made)
        self._delete([source], [], False, None)

    def _replace(
        self,
        dst: str,
        write: Callable[[str], None],
        take_back: Callable[[str], None] | None = None,
        source: str | None = None,
    ) -> None:
        """Write the resolved `dst` with `write(target)`: straight onto it unless that
        replaces a file under a root, else beside it, then swapped in (with the rest of
        the call). `take_back(where)` undoes a write (default: delete what it wrote);
        `source` is the warehouse file a move writes there."""
        back = take_back or self._drop
        self._reclaim(dst)
        if not self._replaces(dst) or self._created_here(dst):
            write(dst)
            batch = self._batch()
            if batch is not None and self._key(dst) is not None:
                with batch.lock:
                    batch.created.append(_Made(dst, back, source))
            return
        swap = _Swap(dst, _sibling(dst), back)
        try:
            write(swap.tmp)
        except BaseException:
            self._quietly(back, swap.tmp)
            raise
        self._finish(swap)

    def _copy_onto(
        self, src: str, path: Any, copy: Callable[[str], None], src_is_dir: bool, same_fs: bool
    ) -> None:
        """`copy(dst)` a file `src` onto `path`, replacing through `_replace`. A directory
        source (the target makes a directory, or fails on a file) or a file copied onto
        itself (the target refuses) replaces nothing: the target answers as it would."""
        dst = self._dest(path)
        if src_is_dir or self._same(src, dst, same_fs):
            copy(dst)
            return
        self._replace(dst, copy)

    def _finish(self, swap: _Swap) -> None:
        batch = self._batch()
        if batch is None:
            self._swap_in(_Batch(swaps={swap.path: swap}))
            return
        with batch.lock:
            self._add_swap(batch, swap)

    def _add_swap(self, batch: _Batch, swap: _Swap) -> None:
        earlier = batch.swaps.pop(swap.path, None)
        if earlier is not None:  # the same path written twice in one unit: last wins
            self._quietly(earlier.take_back, earlier.tmp)
        batch.swaps[swap.path] = swap

    def _swap_in(self, batch: _Batch) -> None:
        """Prepare the old files (joining the transaction's, if an rm began one), move the
        new ones into place, set aside what the unit deletes without a recycle, put the
        copies of a move out of the roots in place, commit what the target deferred,
        remove what was set aside, then commit; on any failure before the removal the
        new files come back out, what was set aside is renamed back, then the old ones
        are put back (abort)."""
        swaps = list(batch.swaps.values())
        if batch.broken is not None:
            self._rollback(batch, batch.broken)
            raise CmrootError(
                "the transaction was not committed: a part of it failed",
                f"{batch.broken}; every path under the warehouse roots is as it was",
            ) from batch.broken
        if not (swaps or batch.tx or batch.deferred or batch.doomed or batch.emptied or batch.outs):
            return
        tx = batch.tx
        try:
            if swaps:
                tx = self._prepare([s.path for s in swaps], join=tx)
        except BaseException as e:
            self._rollback(batch, e)
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
            # Before the copies: a path an rm named and a move out then wrote keeps the copy.
            self._set_aside(batch)
            for s in batch.outs:
                self._place(s)
            while batch.deferred:
                batch.deferred.pop(0).commit()
            self._drop_aside(batch)
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
            self._commit(tx, [s.path for s in swaps] or tx.paths, replaced=bool(swaps))

    def _move_in(self, s: _Swap) -> None:
        """The new file onto the path its old one left, never over anything that appeared
        there since (a racing writer's file stays, and this call fails)."""
        if self._local:
            # Linux renameat2(RENAME_NOREPLACE): no moment between a check and the rename.
            from cmroot.store.confined import rename_noreplace

            parent, name = posixpath.split(s.path)
            try:
                with _bound_dir(parent) as pfd:
                    rename_noreplace(s.tmp, name, pfd)
            except FileExistsError as e:
                raise _retaken(s.path) from e
            return
        if self.fs.lexists(s.path):
            raise _retaken(s.path)
        self.fs.mv(s.tmp, s.path)

    def _move_out(self, s: _Swap, where: str) -> None:
        self.fs.mv(where, s.tmp)

    def _place(self, s: _Swap) -> None:
        """A copy out of the roots renamed over its destination, as a move would: the name
        is replaced (a symlink there included), nothing it pointed to is written."""
        if not self._local:
            self.fs.mv(s.tmp, s.path)
            return
        parent, name = posixpath.split(s.path)
        with _bound_dir(parent) as pfd, _named(name, s.path):
            os.rename(posixpath.basename(s.tmp), name, src_dir_fd=pfd, dst_dir_fd=pfd)

    def _undo(self, batch: _Batch) -> None:
        """Take back what `batch` wrote: new files beside old ones, files it created under
        a root, copies out of one not yet in place, files the target deferred, then the
        directories it created, once empty; and put back what its rms set aside."""
        for s in [*batch.swaps.values(), *batch.outs]:
            self._quietly(s.take_back, s.tmp)
        for made in reversed(batch.created):
            self._quietly(made.take_back, made.path)
        for path, where in reversed(batch.aside):
            self._quietly(partial(self._give_back, path), where)
        while batch.deferred:
            f = batch.deferred.pop()
            try:
                f.discard()
            except Exception as e:
                log.warning("could not discard a deferred file", extra={"error": str(e)})
        try:
            self._prune(batch.dirs)
        except CmrootError as e:  # a directory on the way swapped for a symlink: left
            log.warning(
                "could not remove the directories a failed call made", extra={"error": str(e)}
            )

    def _rollback(self, batch: _Batch, cause: BaseException | None) -> None:
        """`_undo`, and abort the transaction its rms prepared."""
        self._undo(batch)
        if batch.tx is not None:
            self._abort(batch.tx, cause)

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
        """(resolved source, destination) of every file a move of `path1` onto `path2`
        names, laid out as fsspec's `copy` lays them out, and the destination
        directories."""
        one = isinstance(path1, str)
        srcs = [self._resolve(p) for p in _listed(path1)]
        if isinstance(path1, list) and isinstance(path2, list):  # both named in full
            paths1 = srcs
        else:
            paths1 = self.fs.expand_path(
                srcs[0] if one else srcs, recursive=recursive, maxdepth=maxdepth
            )
            if one and (not recursive or maxdepth is not None):
                paths1 = [p for p in paths1 if not self.fs.isdir(p)]
        if isinstance(path2, list):  # fsspec pairs the sources with the list, in order
            paths2 = [self._name(p) for p in path2]
            if len(paths2) != len(paths1):
                raise BadRequest(
                    "sources and destinations do not pair up",
                    f"{len(paths1)} source file(s), {len(paths2)} destination(s)",
                )
        else:
            dst = self._name(path2)
            into = path2.endswith("/") or bool(self.fs.isdir(dst))
            magic = isinstance(path1, str) and has_magic(path1)
            exists = isinstance(path1, str) and (
                (magic and len(paths1) == 1) or (not magic and into and not path1.endswith("/"))
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
    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        named = [self._resolve(p) for p in _listed(path)]
        self._refuse_roots(named)  # before anything is listed
        pruned: list[str] = []
        if recursive and maxdepth is None:
            # A directory under a root goes whole: the daemon recycles what is in it.
            found = self._resolved(self.fs.expand_path(named, recursive=False))
            self._refuse_roots(found)  # what a glob matched
            keep = [p for p in found if self._recyclable(p)]
        else:
            # Exactly what the target would delete, file by file.
            found = self._resolved(
                self.fs.expand_path(named, recursive=recursive, maxdepth=maxdepth)
            )
            self._refuse_roots(found)
            under = [p for p in found if self._recyclable(p)]
            keep = [p for p in under if not self._is_dir(p)]
            if recursive:
                # The target may remove a directory whole (the local one ignores maxdepth):
                # one under a root goes only once emptied.
                pruned = [p for p in under if self._is_dir(p)]
        self._check_removable(found, recursive)
        taken = {*keep, *pruned}
        rest = [p for p in found if p not in taken and self.fs.lexists(p)]
        self._delete(keep, rest, recursive, maxdepth)
        self._prune(pruned)

    def _resolved(self, paths: Iterable[str]) -> list[str]:
        """A listing's paths resolved (a glob may have matched through a symlinked
        directory), each parent once."""
        if not self._local:
            return list(paths)
        parents: dict[str, str] = {}
        out: list[str] = []
        for p in paths:
            head, base = posixpath.split(p)
            if base in ("", ".", ".."):
                out.append(self._real(p))
                continue
            real = parents.get(head)
            if real is None:
                real = parents[head] = _slash(os.path.realpath(head or "/"))
            out.append(posixpath.join(real, base))
        return sorted(set(out))

    def rm_file(self, path: Any) -> None:
        p = self._resolve(path)
        self._refuse_roots([p])
        if self._recyclable(p) and not self._is_dir(p):
            self._delete([p], [], False, None)
        elif self._unit() is not None:
            if not self.fs.lexists(p):
                raise FileNotFoundError(p)
            self._delete([], [p], False, None)  # noted: the unit's end deletes it
        elif self._local:
            self._remove_local(p, False, self._root_ids())
        else:
            self.fs.rm_file(p)

    def _rm(self, path: Any) -> None:
        self.rm_file(path)

    def rmdir(self, path: Any) -> None:
        p = self._resolve(path)
        self._refuse_roots([p])
        if self._local:
            self._rmdir_local(p, self._root_ids())
        else:
            self.fs.rmdir(p)

    def open(
        self,
        path: Any,
        mode: str = "rb",
        block_size: Any = None,
        cache_options: Any = None,
        compression: str | None = None,
        **kwargs: Any,
    ) -> Any:
        if "r" in mode and "+" not in mode:  # reading changes nothing
            return self.fs.open(
                self._name(path),
                mode,
                block_size=block_size,
                cache_options=cache_options,
                compression=compression,
                **kwargs,
            )
        kwargs.pop("autocommit", None)  # a unit is the call or `fs.transaction`, not a file
        dst = self._dest(path)
        binary = mode if "b" in mode else mode.replace("t", "") + "b"
        text: dict[str, Any] = {
            k: kwargs.pop(k) for k in ("encoding", "errors", "newline") if k in kwargs
        }
        if "w" in mode:  # written whole: a warehouse file the unit moved here is not kept
            self._reclaim(dst)
        unit = self._unit()
        if "x" in mode or not self._replaces(dst) or self._created_here(dst):
            if unit is None:
                return self.fs.open(
                    dst, mode, block_size=block_size, compression=compression, **kwargs, **text
                )
            if self._key(dst) is not None or "w" not in mode:
                # Created under a root (taken back if the transaction fails), or written
                # in place (the target defers only what it writes whole).
                f = self.fs.open(dst, binary, block_size=block_size, **kwargs)
                if self._key(dst) is not None:
                    with unit.lock:
                        unit.created.append(_Made(dst, self._drop))
            else:  # elsewhere: deferred by the target until the transaction commits
                f = self.fs.open(dst, binary, block_size=block_size, autocommit=False, **kwargs)
                with unit.lock:
                    unit.deferred.append(f)
            return _layered(f, mode, compression, text, dst, None)
        swap = _Swap(dst, _sibling(dst), self._drop)
        try:
            if "a" in mode or "r" in mode:  # the old bytes, changed, replace the file
                self.fs.cp_file(dst, swap.tmp)
            inner = self.fs.open(swap.tmp, binary, block_size=block_size, **kwargs)
        except BaseException:
            self._quietly(self._drop, swap.tmp)
            raise
        replacing = _ReplacingFile(self, swap, inner, binary)
        return _layered(replacing, mode, compression, text, dst, replacing)

    def _open(
        self,
        path: Any,
        mode: str = "rb",
        block_size: Any = None,
        autocommit: bool = True,
        cache_options: Any = None,
        **kwargs: Any,
    ) -> Any:
        return self.open(path, mode, block_size=block_size, cache_options=cache_options, **kwargs)

    def pipe_file(self, path: Any, value: bytes, **kwargs: Any) -> None:
        dst = self._dest(path)
        if kwargs.get("mode") == "create" and self.fs.exists(dst):
            raise FileExistsError(dst)
        if self._unit() is not None and self._key(dst) is None:
            # Inside fs.transaction, deferred as fsspec defers it: it writes through open.
            with self.open(dst, "wb", **{k: v for k, v in kwargs.items() if k != "mode"}) as f:
                f.write(value)
            return
        self._replace(dst, lambda p: self.fs.pipe_file(p, value, **kwargs))

    def put_file(self, lpath: Any, rpath: Any, **kwargs: Any) -> None:
        src = _text(lpath)
        if kwargs.get("mode") == "create" and self.fs.exists(self._dest(rpath)):
            raise FileExistsError(rpath)
        self._copy_onto(
            src,
            rpath,
            lambda p: self.fs.put_file(src, p, **kwargs),
            src_is_dir=os.path.isdir(src),
            same_fs=self._local,
        )

    def cp_file(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        src = self._name(path1)
        self._copy_onto(
            src,
            path2,
            lambda p: self.fs.cp_file(src, p, **kwargs),
            src_is_dir=bool(self.fs.isdir(src)),
            same_fs=True,
        )

    def get_file(self, rpath: Any, lpath: Any, **kwargs: Any) -> None:
        src = self._name(rpath)
        if not self._local or isfilelike(lpath):
            # A remote target's "local" path is not one of its paths: no root is there.
            self.fs.get_file(src, lpath, **kwargs)
            return
        self._copy_onto(
            src,
            lpath,
            lambda p: self.fs.get_file(src, p, **kwargs),
            src_is_dir=bool(self.fs.isdir(src)),
            same_fs=True,
        )

    def put(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().put(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().get(*args, **kwargs)

    def copy(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().copy(*args, **kwargs)

    def pipe(self, *args: Any, **kwargs: Any) -> None:
        with self._one_call():
            super().pipe(*args, **kwargs)

    def mv(
        self,
        path1: Any,
        path2: Any,
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        path1, path2 = _texts(path1), _texts(path2)
        srcs = [self._resolve(p) for p in _listed(path1)]
        if isinstance(path2, str) and srcs == [self._resolve(path2)]:
            return
        self._refuse_roots(srcs)
        found = self._resolved(self.fs.expand_path(srcs, recursive=False))
        self._refuse_roots(found)
        if (
            self._local
            and isinstance(path1, str)
            and isinstance(path2, str)
            and found == srcs
            and self._is_dir(srcs[0])
        ):
            dst = self._dir_dest(srcs[0], self._resolve(path2))
            if not self._leaves(srcs[0], dst):
                self._move_dir_local(srcs[0], dst)
                return
            # Out of the roots: whole, as the local target moves a directory, but file by
            # file below, so that its files are copied out and then recycled.
            path2, recursive, maxdepth = dst, True, None
        pairs, dirs = self._pairs(path1, path2, recursive, maxdepth)
        # What a moved directory leaves behind, removed once empty (as mv leaves none).
        emptied = [
            d
            for top in found
            if recursive and self._is_dir(top)
            for d in (top, *self.fs.find(top, maxdepth=maxdepth, withdirs=True, detail=False))
            if self._is_dir(d)
        ]
        leaving: list[str] = []
        with self._one_call():
            for d in dirs:  # never destructive: an existing one (a root, say) is kept as is
                self._makedirs(d)
            for src, to in pairs:
                dst = self._dest(to, follow=False)
                if self._leaves(src, dst):
                    self._copy_out(src, dst)
                    leaving.append(src)
                    continue
                self._replace(
                    dst,
                    partial(self.fs.mv, src),
                    partial(self._give_back, src),
                    source=src if self._recyclable(src) else None,
                )
            # A directory moved out whole is recycled as one (the daemon removes it once
            # the recycle commits: before, a rollback would find no directory to go to).
            tops = [
                t
                for t in found
                if recursive
                and maxdepth is None
                and self._is_dir(t)
                and self._recyclable(t)
                and any(_under(s, t) for s in leaving)
            ]
            gone = [s for s in leaving if not any(_under(s, t) for t in tops)]
            if leaving:
                self._delete([*tops, *gone], [], True, None)
        self._prune([d for d in emptied if not any(_under(d, t) for t in tops)])

    def _leaves(self, src: str, dst: str) -> bool:
        """Whether moving the resolved `src` to `dst` takes a warehouse file (or a
        directory of them) out of the roots: a delete, as far as its table and the
        replicas are concerned, so it is recycled (a move within the roots, into a
        staging directory included, is not)."""
        return self._recyclable(src) and self._below(dst) is None

    def _copy_out(self, src: str, dst: str) -> None:
        """The copy a move out of the roots leaves at `dst`: written beside it, and renamed
        over it (`_place`) only at the unit's end, once its source is prepared into the
        unit's transaction; if the unit fails the copy is removed and `dst` never changed.
        Never written through `dst`: a symlink there may point into the warehouse."""
        batch = self._calls.batch
        assert batch is not None  # mv runs in _one_call
        out = _Swap(dst, _sibling(dst), self._drop)
        with batch.lock:
            batch.outs.append(out)
        self.fs.cp_file(src, out.tmp)

    def _makedirs(self, path: str) -> None:
        """The target's makedirs, noting in the call's batch the directories it creates
        (resolved, for `_prune`), so that a failed call removes them again once empty.
        A root, or a directory containing one, is never noted: it is never removed."""
        missing: list[str] = []
        p = path
        while not self.fs.lexists(p):
            missing.append(p)
            parent = self.fs._parent(p)
            if not parent or parent == p:  # the top: "/", or a bucket's ""
                break
            p = parent
        self.fs.makedirs(path, exist_ok=True)
        batch = self._calls.batch
        assert batch is not None  # mv runs in _one_call
        for d in missing:
            real = self._real(d)
            try:
                self._refuse_roots([real])
            except Forbidden:
                continue
            with batch.lock:
                batch.dirs.append(real)

    def _dir_dest(self, src: str, dst: str) -> str:
        """Where the local target's move of the directory `src` to `dst` puts it
        (shutil.move: into an existing directory under its own name, never over a name
        already taken there, so it never replaces a file); refused if that is a root or
        contains one (moving into a root, or into its parent, is fine)."""
        real_dst = dst
        if os.path.isdir(dst):
            real_dst = posixpath.join(_slash(os.path.realpath(dst)), posixpath.basename(src))
        self._refuse_roots([real_dst])
        if real_dst != dst and os.path.lexists(real_dst):
            raise FileExistsError(errno.EEXIST, "Destination path already exists", real_dst)
        return real_dst

    def _move_dir_local(self, src: str, real_dst: str) -> None:
        """One rename of a directory to where `_dir_dest` puts it, bound to the checked
        directories: both parents opened without following a symlink, the source
        checked against the roots by inode."""
        guard = self._root_ids()
        (sparent, sname), (dparent, dname) = posixpath.split(src), posixpath.split(real_dst)
        with _bound_dir(sparent) as sfd, _bound_dir(dparent) as dfd:
            _check_dir_at(sfd, sname, src, guard)
            try:
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
                return
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
        # Another filesystem: copied as shutil.move copies it, the source then removed bound
        # to the checked directory (not by name, as shutil.move would).
        shutil.copytree(src, real_dst, symlinks=True)
        self._remove_local(src, True, guard)

    def touch(self, path: Any, truncate: bool = True, **kwargs: Any) -> None:
        if truncate:
            self._replace(
                self._dest(path), lambda p: self.fs.touch(p, truncate=True, **kwargs)
            )
            return
        self.fs.touch(self._name(path), truncate=truncate, **kwargs)

    # -- everything else: forwarded --------------------------------------------------------------
    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> Any:
        return self.fs.ls(self._name(path), detail=detail, **kwargs)

    def info(self, path: Any, **kwargs: Any) -> Any:
        return self.fs.info(self._name(path), **kwargs)

    def exists(self, path: Any, **kwargs: Any) -> bool:
        return bool(self.fs.exists(self._name(path), **kwargs))

    def isdir(self, path: Any) -> bool:
        return bool(self.fs.isdir(self._name(path)))

    def isfile(self, path: Any) -> bool:
        return bool(self.fs.isfile(self._name(path)))

    def lexists(self, path: Any, **kwargs: Any) -> bool:
        return bool(self.fs.lexists(self._name(path), **kwargs))

    def size(self, path: Any) -> Any:
        return self.fs.size(self._name(path))

    def checksum(self, path: Any) -> Any:
        return self.fs.checksum(self._name(path))

    def ukey(self, path: Any) -> Any:
        return self.fs.ukey(self._name(path))

    def modified(self, path: Any) -> Any:
        return self.fs.modified(self._name(path))

    def created(self, path: Any) -> Any:
        return self.fs.created(self._name(path))

    def cat_file(
        self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> Any:
        return self.fs.cat_file(self._name(path), start=start, end=end, **kwargs)

    def find(
        self,
        path: Any,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        return self.fs.find(
            self._name(path), maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs
        )

    def walk(
        self,
        path: Any,
        maxdepth: int | None = None,
        topdown: bool = True,
        on_error: str = "omit",
        **kwargs: Any,
    ) -> Any:
        return self.fs.walk(
            self._name(path), maxdepth=maxdepth, topdown=topdown, on_error=on_error, **kwargs
        )

    def glob(self, path: Any, maxdepth: int | None = None, **kwargs: Any) -> Any:
        return self.fs.glob(self._name(path), maxdepth=maxdepth, **kwargs)

    def du(
        self,
        path: Any,
        total: bool = True,
        maxdepth: int | None = None,
        withdirs: bool = False,
        **kwargs: Any,
    ) -> Any:
        return self.fs.du(
            self._name(path), total=total, maxdepth=maxdepth, withdirs=withdirs, **kwargs
        )

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        self.fs.mkdir(self._name(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        self.fs.makedirs(self._name(path), exist_ok=exist_ok)

    def sign(self, path: Any, expiration: int = 100, **kwargs: Any) -> Any:
        return self.fs.sign(self._name(path), expiration=expiration, **kwargs)

    def invalidate_cache(self, path: Any = None) -> None:
        self.fs.invalidate_cache(None if path is None else self._name(path))


@dataclass
class _Swap:
    """One file a call replaces: its new bytes wait at `tmp`, beside `path`;
    `take_back(where)` removes them again (or returns a moved file to its source)."""

    path: str
    tmp: str
    take_back: Callable[[str], None]


@dataclass
class _Made:
    """A file a unit wrote at `path` under a root and how to take it back; for a
    warehouse file it moved there, the `source` it came from (then not the unit's own
    output: see `CmrootFileSystem._reclaim`)."""

    path: str
    take_back: Callable[[str], None]
    source: str | None = None


@dataclass
class _Batch:
    """What one unit (a call, or `fs.transaction`) has done so far: the replacements
    waiting to be swapped in, the files it created under a root, the copies of a move out
    of the roots waiting beside their destinations, the directories it created, the
    files the target deferred, what it deletes without a recycle at its end (and the
    directories that leaves to remove once empty), what of that its end has set aside
    (path, where it waits), and the transaction its rms (or a move out of the roots)
    prepared (with the failure that broke it, if one did)."""

    swaps: dict[str, _Swap] = field(default_factory=dict)
    created: list[_Made] = field(default_factory=list)
    outs: list[_Swap] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    deferred: list[Any] = field(default_factory=list)
    doomed: list[str] = field(default_factory=list)
    emptied: list[str] = field(default_factory=list)
    aside: list[tuple[str, str]] = field(default_factory=list)
    tx: _Tx | None = None
    broken: BaseException | None = None
    # A transaction's batch is shared by the threads writing inside it.
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Calls(threading.local):
    """The batch of the call running in this thread, if any."""

    batch: _Batch | None = None


class _CmrootTransaction(Transaction):  # type: ignore[misc]
    """fsspec's `fs.transaction` on the hook: one unit (see the module docstring). Its
    end swaps in every replacement made inside it, with the deletes its rms prepared, in
    one two-phase transaction; a block that raises takes everything back. A block inside
    another joins it (`fs.transaction` is one object per filesystem): its end does
    nothing, the outermost one commits or takes back the whole."""

    fs: Any  # the filesystem, until the transaction completes (then None, as fsspec's)

    def __init__(self, fs: CmrootFileSystem, **kwargs: Any) -> None:
        super().__init__(fs, **kwargs)
        self.batch = _Batch()
        self.depth = 0  # blocks entered and not yet ended

    def start(self) -> None:
        self.depth += 1
        if self.depth == 1:
            super().start()
            self.batch = _Batch()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and self.depth > 1:
            # An inner block that raises fails the unit, even if the error is caught
            # before the outermost end: that end then takes everything back and says so.
            with self.batch.lock:
                self.batch.broken = self.batch.broken or exc
        self.complete(commit=exc_type is None)

    def complete(self, commit: bool = True) -> None:
        if self.depth > 1:
            self.depth -= 1
            return
        self.depth = 0
        fs: CmrootFileSystem = self.fs
        batch = self.batch
        self.batch = _Batch()
        try:
            if commit:
                fs._swap_in(batch)
            else:
                fs._rollback(batch, None)
        finally:
            fs._intrans = False
            fs._transaction = None
            self.fs = None


CmrootFileSystem.transaction_type = _CmrootTransaction


class _Tx:
    """A prepared transaction as the hook holds it."""

    def __init__(self, client: Client, prepared: PreparedTx) -> None:
        self.client = client
        self.txid = prepared.txid
        self.files = prepared.files
        self._schedule(prepared.expires)

    def joined(self, prepared: PreparedTx) -> None:
        """Another part was prepared into this transaction (the answer names that part's
        files only)."""
        self.files = [*self.files, *prepared.files]
        self._schedule(prepared.expires)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

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


_W = TypeVar("_W", bound="_CloseOrDiscard")


class _CloseOrDiscard:
    """A `with` block publishes the new bytes (close) when it ends normally and drops
    them (discard) when it raises."""

    def close(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


class _ReplacingFile(_CloseOrDiscard):
    """A file being written beside its target; on a clean close it is swapped in (see
    `CmrootFileSystem._swap_in`), on an error (or `discard()`) it is dropped."""

    def __init__(self, owner: CmrootFileSystem, swap: _Swap, inner: Any, mode: str) -> None:
        self._owner, self._swap, self._inner, self._mode = owner, swap, inner, mode
        self.path = swap.path
        self._done = False
        self._abandoned = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, data: Any) -> Any:
        return self._inner.write(data)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return "+" in self._mode

    def seekable(self) -> bool:
        return bool(self._inner.seekable())

    @property
    def closed(self) -> bool:
        return bool(self._done)

    def close(self) -> None:
        if self._done:
            return
        if self._abandoned:
            self.discard()
            return
        self._done = True
        try:
            self._inner.close()
        except BaseException:
            self._owner._quietly(self._owner._drop, self._swap.tmp)
            raise
        self._owner._finish(self._swap)

    def abandon(self) -> None:
        """From now on, closing drops the new bytes (the layers above are being closed
        after a failure)."""
        self._abandoned = True

    def discard(self) -> None:
        if not self._done:
            self._done = True
            self._inner.close()
            self._owner._quietly(self._owner._drop, self._swap.tmp)


class _Layers(_CloseOrDiscard):
    """A compression codec and/or text layer over a replacing file. Closing flushes the
    layers (a codec never closes the file it wraps, so its last bytes would otherwise
    never reach it), then swaps the file in; a `with` block that raises drops the new
    bytes instead (TextIOWrapper's own exit closes, which would publish half a file)."""

    def __init__(self, outer: Any, replacing: _ReplacingFile) -> None:
        self._outer, self._replacing = outer, replacing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._outer, name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._outer)

    def close(self) -> None:
        try:
            self._outer.close()
        except BaseException:
            self._replacing.discard()
            raise
        self._replacing.close()

    def discard(self) -> None:
        self._replacing.abandon()
        try:
            self._outer.close()  # the layers' last bytes go to the file being dropped
        except Exception as e:
            log.debug("closing a discarded file's layers failed", extra={"error": str(e)})
        self._replacing.discard()


def _layered(
    f: Any,
    mode: str,
    compression: str | None,
    text: dict[str, Any],
    path: str,
    replacing: _ReplacingFile | None,
) -> Any:
    """`f` with the codec and text layers fsspec's `open` would add, guarded by `_Layers`
    when `f` replaces a file."""
    outer = f
    if compression is not None:
        outer = compr[get_compression(path, compression)](outer, mode=mode[0])
    if "b" not in mode:
        outer = io.TextIOWrapper(outer, **text)
    return outer if replacing is None or outer is f else _Layers(outer, replacing)


@contextmanager
def _bound_dir(path: str) -> Iterator[int]:
    """A descriptor of the directory at the resolved `path`, opened component by component
    from `/` without following any symlink, so what is done relative to it happens in the
    directory that was checked. One on the way swapped for a symlink since the path was
    resolved: Conflict, nothing done."""
    # Imported here: the store package is heavy (index, SQLite) and only a local target
    # needs this module of it.
    from cmroot.store import confined

    with confined.directory("/") as top:
        try:
            fd = confined.open_dir_beneath(top, path.lstrip("/"))
        except OSError as e:
            # ELOOP/EXDEV for a symlink on the way; ENOTDIR when it is the last component
            # (O_DIRECTORY | O_NOFOLLOW): either way the path resolves elsewhere now.
            if not confined.is_escape(e) and _slash(os.path.realpath(path)) == path:
                raise
            raise Conflict(
                "a directory changed while cmroot worked on it",
                f"{path}: a directory on the way is now a symlink (it was not when the path"
                " was resolved); nothing was done there: run the call again",
            ) from e
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def _named(name: str, path: str) -> Iterator[None]:
    """An OSError of a call relative to a directory descriptor names `name`, the last
    component: name the whole path, as the call by path would."""
    try:
        yield
    except OSError as e:
        if e.filename == name:
            e.filename = path
        raise


def _check_guard(fd: int, path: str, guard: _Guard) -> None:
    """Forbidden if the directory open at `fd` is a root or holds one."""
    st = os.fstat(fd)
    root = guard.get((st.st_dev, st.st_ino))
    if root is not None:
        raise _refusal(path, root, "is" if path == root else "contains")


def _check_dir_at(dir_fd: int, name: str, path: str, guard: _Guard) -> None:
    """Forbidden if the directory `name` below `dir_fd` (not followed if a symlink) is a
    root or holds one."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        _check_guard(fd, path, guard)
    finally:
        os.close(fd)


def _rmtree_at(dir_fd: int, name: str, path: str, guard: _Guard) -> None:
    """Remove the directory `name` below `dir_fd` and everything in it, each directory
    opened without following a symlink (a symlink is removed as a name) and checked
    against the roots by inode before anything in it goes."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        _check_guard(fd, path, guard)
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                _rmtree_at(fd, e.name, f"{path}/{e.name}", guard)
            else:
                os.unlink(e.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _refusal(path: str, root: str, how: str) -> Forbidden:
    return Forbidden(
        "a warehouse root, or a directory that contains one, is never"
        " removed, moved or overwritten",
        f"{path} {how} the warehouse root {root}: nothing was changed. Name the tables or"
        f" files under {root} instead (they are recycled); to retire the warehouse itself,"
        " take it out of warehouse_roots (store.warehouse_roots) first",
    )


def _retaken(path: str) -> FileExistsError:
    return FileExistsError(
        errno.EEXIST, "re-created during the overwrite: the new bytes stay out", path
    )


def _text(path: Any) -> str:
    """A path argument as a str (os.PathLike accepted, as fsspec does); BadRequest for
    anything else (None, a number, bytes)."""
    path = stringify_path(path)
    if not isinstance(path, str):
        raise BadRequest(
            "not a path", f"{path!r} ({type(path).__name__}): give a str or an os.PathLike"
        )
    return path


def _texts(path: Any) -> str | list[str]:
    """A path argument, or a list of them, as str."""
    return [_text(p) for p in path] if isinstance(path, (list, tuple)) else _text(path)


def _listed(path: Any) -> list[Any]:
    return list(path) if isinstance(path, (list, tuple)) else [path]


def _slash(path: str) -> str:
    """POSIX leaves a leading "//" open (normpath and realpath keep it); Linux reads "/"."""
    return re.sub("^/+", "/", path)


def _under(path: str, top: str) -> bool:
    """`path` is `top` or lies below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _tops(paths: Iterable[str]) -> list[str]:
    """Those of `paths` below none of the others."""
    tops: list[str] = []
    for p in sorted(set(paths)):
        if not any(_under(p, t) for t in tops):
            tops.append(p)
    return tops


def _sibling(path: str) -> str:
    d, name = posixpath.split(path)
    return posixpath.join(d, f".{name}.cmroot-{uuid.uuid4().hex[:12]}.tmp")


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (list, tuple)) else (str(p),)

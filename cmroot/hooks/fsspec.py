"""`cmroot`: an fsspec filesystem that wraps another one and hands every file it would
delete or overwrite under a warehouse root to the cmroot daemon first (op `DELETE`).

    import fsspec
    fs = fsspec.filesystem("cmroot", target_protocol="file", url="http://127.0.0.1:9750")
    fs.rm("/lake/warehouse/sales.db/orders/p=1", recursive=True)   # recycled, then gone
    with fs.open("/lake/warehouse/x/part-0.parquet", "wb") as f:  # old bytes recycled
        f.write(data)

or by URL chaining, e.g. `pd.read_parquet(...)`/`df.to_parquet("cmroot::file:///lake/...")`.

What is protected: paths under the daemon's warehouse roots (`warehouse_roots=`, default
the cmroot config's `store.warehouse_roots`). Deletes (`rm`, `rm_file`) recycle the paths in
one all-or-nothing request, then nothing is left to delete. An overwrite (`open(..., "wb")`,
`pipe_file`, `put_file`, `cp_file`, `mv` onto an existing file, `touch(truncate=True)`)
writes the new bytes beside the file first and, only once they are complete, recycles the
old file and moves the new one into place: a failed write leaves the old file as it was.
An append (`"ab"`) first copies the current bytes into the cmroot. If the daemon refuses or
is unreachable, the call raises a CmrootError and nothing is deleted, unless
`fail_open=True` (then it is logged and counted in `CmrootFileSystem.fail_open_count`).

Every other call is forwarded unchanged to the target filesystem.
"""

from __future__ import annotations

import logging
import os
import posixpath
import uuid
from typing import Any, ClassVar

from fsspec import filesystem
from fsspec.spec import AbstractFileSystem

try:  # fsspec >= 2025: a chained filesystem takes the inner URL's path ("cmroot::file://...")
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

from cmroot.client import Client
from cmroot.exceptions import CmrootError, Forbidden

log = logging.getLogger("cmroot.hooks.fsspec")


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
            return os.path.normpath(os.path.abspath(p))
        return str(self.fs.unstrip_protocol(self.fs._strip_protocol(path))).rstrip("/")

    def protected(self, path: str) -> bool:
        p = self._norm(path)
        if any(
            seg.startswith((".spark-staging-", ".hive-staging")) or seg == "_temporary"
            for seg in p.split("/")
        ):
            return False
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in self.roots)

    # -- talking to the daemon --------------------------------------------------------------
    def _recycle(self, paths: list[str], mode: str = "move") -> bool:
        """Recycle `paths` (all or nothing). False when failed open: delete as usual."""
        if not paths:
            return True
        try:
            self.client.recycle([self._norm(p) for p in paths], mode=mode, op=self.op)
            return True
        except CmrootError as e:
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
            return False

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

    def _replace(self, path: str, write_new: Any) -> None:
        """Write the new bytes beside `path` with `write_new(tmp)`, then recycle the old file
        and move the new one into place. The old file is untouched if the write fails."""
        if not (self.protected(path) and self.fs.isfile(path)):
            write_new(path)
            return
        tmp = _sibling(path)
        try:
            write_new(tmp)
            if not self._recycle([path]):
                self.fs.rm_file(path)
            self.fs.mv(tmp, path)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)
            raise

    # -- destructive calls --------------------------------------------------------------------
    def rm(
        self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None
    ) -> None:
        paths = path if isinstance(path, list) else [path]
        paths = [self._strip_protocol(p) for p in paths]
        if not recursive or maxdepth is not None:
            # Exactly what the target would delete, file by file.
            expanded = self.fs.expand_path(paths, recursive=recursive, maxdepth=maxdepth)
            keep = [p for p in expanded if self.protected(p) and self.fs.isfile(p)]
            rest = [p for p in expanded if p not in set(keep)]
        else:
            tops = self.fs.expand_path(paths, recursive=False)
            keep = [p for p in tops if self.protected(p) and self.fs.exists(p)]
            rest = [p for p in tops if p not in set(keep)]
        if keep and not self._recycle(keep):
            rest = keep + rest
        if rest:
            self.fs.rm(
                [p for p in rest if self.fs.exists(p)], recursive=recursive, maxdepth=maxdepth
            )

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        if self.protected(path) and self.fs.isfile(path) and self._recycle([path]):
            return
        self.fs.rm_file(path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rmdir(self, path: str) -> None:
        self.fs.rmdir(self._strip_protocol(path))

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
        if "r" in mode or not self.protected(path) or not self.fs.isfile(path):
            return self.fs.open(
                path, mode, block_size=block_size, cache_options=cache_options, **kwargs
            )
        if "a" in mode:
            # the bytes before the append stay retrievable
            self._recycle([path], mode="copy")
            return self.fs.open(path, mode, block_size=block_size, **kwargs)
        tmp = _sibling(path)
        inner = self.fs.open(tmp, mode.replace("x", "w"), block_size=block_size, **kwargs)
        return _ReplacingFile(self, path, tmp, inner)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        self._replace(path, lambda p: self.fs.pipe_file(p, value, **kwargs))

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        rpath = self._strip_protocol(rpath)
        self._replace(rpath, lambda p: self.fs.put_file(lpath, p, **kwargs))

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        self._replace(p2, lambda p: self.fs.cp_file(p1, p, **kwargs))

    def mv(
        self,
        path1: str,
        path2: str,
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.protected(p2) and self.fs.isfile(p2) and not self.fs.isdir(p1):
            self._replace(p2, lambda p: self.fs.mv(p1, p, **kwargs))
            return
        self.fs.mv(p1, p2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if truncate and self.protected(path) and self.fs.isfile(path):
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


class _ReplacingFile:
    """A file being written beside its target; on a clean close the old file is recycled
    and the new one moved into place, on an error (or `discard()`) the new one is dropped."""

    def __init__(self, owner: CmrootFileSystem, path: str, tmp: str, inner: Any) -> None:
        self._owner, self.path, self._tmp, self._inner = owner, path, tmp, inner
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
        self._inner.close()
        self._done = True
        owner = self._owner
        try:
            if not owner._recycle([self.path]):
                owner.fs.rm_file(self.path)
            owner.fs.mv(self._tmp, self.path)
        except BaseException:
            if owner.fs.exists(self._tmp):
                owner.fs.rm_file(self._tmp)
            raise

    def discard(self) -> None:
        if not self._done:
            self._done = True
            self._inner.close()
            if self._owner.fs.exists(self._tmp):
                self._owner.fs.rm_file(self._tmp)

    def __enter__(self) -> _ReplacingFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


def _sibling(path: str) -> str:
    d, name = posixpath.split(path)
    return posixpath.join(d, f".{name}.cmroot-{uuid.uuid4().hex[:12]}.tmp")


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (list, tuple)) else (str(p),)

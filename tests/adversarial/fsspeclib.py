"""What the hostile reviews of the fsspec hook share: a hook on a test daemon, a table of
small files, and the checks of invariant 1 (a file is in place with its bytes, or
retrievable by its original path and checksum)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cmroot import checksum as cks
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, write_files


def hook(
    d: Daemon, roots: list[str] | None = None, scope: str = "write", **kw: Any
) -> CmrootFileSystem:
    return CmrootFileSystem(
        target_protocol="file",
        url=d.url,
        token=d.tokens[scope],
        warehouse_roots=roots or [str(d.warehouse)],
        **kw,
    )


def table(d: Daemon, n: int = 2, tag: str = "", db: str = "db") -> dict[str, bytes]:
    """n partitions of one new table of `db`, one small file each: {path: bytes}."""
    name = tag + os.urandom(4).hex()
    return write_files(
        d.warehouse,
        {f"{db}.db/t{name}/p={i}/part-{i}.parquet": f"old {i} {name}".encode() for i in range(n)},
    )


def status(d: Daemon, path: str, data: bytes) -> str:
    [r] = d.client("read").resolve([{"path": path, "checksum": cks.of_bytes(data)}]).files
    return str(r.status)


def lost(d: Daemon, files: dict[str, bytes]) -> list[str]:
    """Files neither in place with their bytes nor retrievable from the store by
    (original path, checksum): invariant 1 broken for each."""
    out = []
    for p, b in files.items():
        here = Path(p).is_file() and not Path(p).is_symlink() and Path(p).read_bytes() == b
        if not here and status(d, p, b) != "cmroot":
            out.append(p)
    return out


def attempt(call: Callable[[], Any]) -> BaseException | None:
    """Run `call`; its exception, if any (the outcome is judged by the state it leaves)."""
    try:
        call()
    except Exception as e:
        return e
    return None

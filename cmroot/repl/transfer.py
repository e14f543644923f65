"""Copying one dump's files to the destination, verified: the executor side of a load.

Each file is read from its original path if that still has the checksum, else from its
copy in the cmroot (read directly when the store is reachable from here, else through
the daemon's `GET /v1/files`). It is hashed while it is copied and written under a hidden
temporary name next to its destination; the driver renames the temporaries into place
only once every file of the batch arrived, so a failed batch changes nothing visible."""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import xxhash

from cmroot import checksum as cks
from cmroot.client import Client
from cmroot.exceptions import CmrootError

TEMP_PREFIX = ".cmroot-load-"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Copy:
    """One file to put at `dst` (a local path): the bytes of (`src`, `checksum`)."""

    src: str
    dst: str
    checksum: str
    size: int


@dataclass(frozen=True)
class Copied:
    dst: str
    temp: str | None  # None: `dst` already had the bytes
    source: str  # "present", "original", "cmroot" or "lost"
    size: int
    error: str | None = None
    made_dirs: tuple[str, ...] = ()


def temp_path(dst: str, checksum: str) -> str:
    """A hidden name beside `dst` (Spark and Hive skip names starting with '.'), the same
    on every attempt, so a rerun overwrites what a killed run left."""
    tag = xxhash.xxh3_64_hexdigest((os.path.basename(dst) + checksum).encode())
    return os.path.join(os.path.dirname(dst), TEMP_PREFIX + tag)


def _copy_hashed(src: IO[bytes], temp: str) -> tuple[str, int]:
    h = xxhash.xxh3_128()
    n = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(temp, "wb") as out:
        while k := src.readinto(buf):  # type: ignore[attr-defined]
            h.update(view[:k])
            out.write(view[:k])
            n += k
    return h.hexdigest(), n


def _try(
    opener: Callable[[], AbstractContextManager[Any]], temp: str, checksum: str
) -> int | None:
    """Copy what `opener` gives into `temp`; its size if it hashed to `checksum`."""
    try:
        with opener() as src:
            digest, n = _copy_hashed(src, temp)
    except (FileNotFoundError, PermissionError, IsADirectoryError, CmrootError):
        return None
    if digest == checksum:
        return n
    os.unlink(temp)
    return None


def _open_original(path: str) -> Callable[[], AbstractContextManager[Any]]:
    if path.startswith("/"):
        return functools.partial(open, path, "rb")
    return functools.partial(fsspec.open, path, "rb")


def _make_dirs(d: str) -> tuple[str, ...]:
    """Create `d` and its missing parents; return the ones created, deepest first."""
    made = []
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    for m in reversed(made):
        try:
            os.mkdir(m)
        except FileExistsError:
            pass
    return tuple(made)


def copy_all(rows: Iterable[Copy], daemon_url: str | None, token: str | None) -> Iterator[Copied]:
    """Copy each row into its temporary; runs on an executor (or in the driver)."""
    client = Client(daemon_url, token) if daemon_url else None
    try:
        for row in rows:
            yield _one(row, client)
    finally:
        if client is not None:
            client.close()


def _one(row: Copy, client: Client | None) -> Copied:
    try:
        st = os.stat(row.dst)
        if st.st_size == row.size and cks.of_local_file(row.dst) == row.checksum:
            return Copied(row.dst, None, "present", row.size)
    except FileNotFoundError:
        pass
    made = _make_dirs(os.path.dirname(row.dst))
    temp = temp_path(row.dst, row.checksum)
    n = _try(_open_original(row.src), temp, row.checksum)
    if n is not None:
        return Copied(row.dst, temp, "original", n, made_dirs=made)
    if client is None:
        return Copied(row.dst, None, "lost", 0, "not at its path and no daemon to ask", made)
    try:
        answer = client.resolve([{"path": row.src, "checksum": row.checksum}]).files[0]
    except CmrootError as e:
        return Copied(row.dst, None, "lost", 0, f"the daemon could not resolve it: {e}", made)
    if answer.status == "missing":
        return Copied(row.dst, None, "lost", 0, "neither at its path nor in the cmroot", made)
    location = answer.location
    # "original" at another path: a later rename of its table moved the file there.
    moved = answer.status == "original" and location is not None and location != row.src
    if (answer.status == "cmroot" or moved) and location and os.path.isfile(location):
        n = _try(functools.partial(open, location, "rb"), temp, row.checksum)
    else:
        n = None
    if n is None:
        served = location if moved and location else row.src
        n = _try(functools.partial(client.open, served, row.checksum), temp, row.checksum)
    if n is None:
        return Copied(row.dst, None, "lost", 0, "no copy hashed to its checksum", made)
    return Copied(row.dst, temp, "cmroot" if answer.status == "cmroot" else "original", n,
                  made_dirs=made)


def publish(done: Iterable[Copied]) -> None:
    """Rename every temporary into place (driver side, after the whole batch arrived)."""
    for c in done:
        if c.temp is not None:
            os.replace(c.temp, c.dst)


def discard(done: Iterable[Copied]) -> None:
    """Undo a failed batch: remove its temporaries and the directories it created."""
    made: list[str] = []
    for c in done:
        if c.temp is not None:
            try:
                os.unlink(c.temp)
            except FileNotFoundError:
                pass
        made.extend(c.made_dirs)
    for d in sorted(set(made), key=len, reverse=True):
        try:
            os.rmdir(d)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                raise

"""Warehouse filesystems, one implementation per kind, chosen by protocol.

The store moves files out of a warehouse and back through this interface only, so the
guarantees that depend on the filesystem (no symlink followed, no source clobbered, a
copied source removed only if unchanged) are written once per kind of filesystem rather
than as `if local:` branches. `local` works through directory descriptors; `remote`
through fsspec (object stores and anything else fsspec can open)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from cmroot.exceptions import BadRequest, NotFound
from cmroot.vocab import Method, Mode


class SymlinkRefused(BadRequest):
    """A symlink where a regular file or directory was to be recycled. The warehouse
    decides whether it escapes the roots (403) or is merely refused (400)."""

    def __init__(self, key: str) -> None:
        super().__init__("symlinks are not recycled", f"{key} is a symlink: recycle its target")
        self.key = key


class RootUnavailable(NotFound):
    """A warehouse root's directory cannot be opened: nothing under it is read or moved."""


@dataclass(frozen=True)
class SourceFile:
    """A regular file found under a root: its canonical key, path relative to the root
    and size when listed."""

    key: str
    rel: str
    size: int


class Session(ABC):
    """Source-side work of one recycle, rollback or clean-up: holds whatever handles the
    filesystem needs (directory descriptors) until closed."""

    @abstractmethod
    def rename_out(self, rel: str, staged: str) -> None:
        """Rename the file at `rel` to the local path `staged` (same filesystem); raise
        OSError(EXDEV) when the two are on different filesystems. What arrives is checked
        by the caller's hash of `staged`, which refuses anything but a regular file."""

    @abstractmethod
    def copy_out(self, rel: str, staged: str) -> tuple[str, str]:
        """Copy the file at `rel` to the new local file `staged` (fsynced), hashing it as it
        goes; return (checksum, identity of the source that was copied)."""

    @abstractmethod
    def put_back(self, rel: str, staged: str) -> bool:
        """Return a file staged by rename to `rel` without clobbering anything: False if
        `rel` now holds other bytes (the caller keeps the staged file)."""

    @abstractmethod
    def remove_if_unchanged(self, rel: str, ident: str, tag: str, resumed: bool = False
                            ) -> bool:
        """Remove the file at `rel` if its identity is still `ident` (a copied source).
        False if it was changed or is gone. `tag` (secret) names the transaction's file: a
        source that can only check, then remove, keeps what it checks under it meanwhile,
        and a `resumed` try (after a crash) starts from there."""

    def take_back(self, rel: str, ident: str, tag: str) -> bool:
        """After a take of `rel` (tagged `tag`) died between its check and its removal:
        what it had moved aside goes back. True if that was the file copied, now back at
        `rel` (the caller drops its copy); False otherwise (the caller puts its copy back,
        or keeps it in the store if `rel` holds other bytes)."""
        return False

    @abstractmethod
    def remove_empty_dirs(self, rel: str, keep: Callable[[str], bool]) -> None:
        """Remove the directories at and under `rel` that are empty, deepest first, except
        those `keep(rel)` protects (roots, and directories containing one)."""

    def close(self) -> None:  # noqa: B027 - optional: most sessions hold nothing
        """Release what the session holds."""


class Source(ABC):
    """One warehouse root's filesystem."""

    local: bool
    fs: Any  # the fsspec filesystem, for readers that stream bytes
    root_path: str  # the root's path on `fs`

    @abstractmethod
    def expand(self, rel: str, key: str) -> tuple[list[SourceFile], bool]:
        """The regular files at or under `rel` and whether it is a directory. Raises
        NotFound for a missing path, BadRequest/OutsideRoots for symlinks and specials."""

    @abstractmethod
    def method(self, mode: Mode) -> Method:
        """How a file of this filesystem is first tried to be staged."""

    @abstractmethod
    def session(self) -> AbstractContextManager[Session]:
        """A session for source-side work, closed on exit."""


def for_root(url: str, real: str | None) -> Source:
    """The source for a warehouse root: local for a local path (`real` is its resolved
    path), fsspec for any other URL."""
    if real is not None:
        from cmroot.store.source.local import LocalSource

        return LocalSource(real)
    from cmroot.store.source.remote import RemoteSource

    return RemoteSource(url)

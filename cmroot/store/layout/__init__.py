"""Where the store keeps things, and every operation on them that depends on where that is.

<root>/objects/ab/<checksum>      content-addressed objects, immutable once published
                                 (`ab/cd/<checksum>` in object stores, and in local stores
                                 made before the `LAYOUT` file: see LocalLayout)
<root>/staging/<txid>/<seq>       files of a recycle in flight (named by the journal)
<root>/trash/<YYYY-MM-DD>/<checksum>  expired objects when on_expire = "trash"
<root>/quarantine/<checksum>.<unix time>  objects found corrupt (by fsck, a read, a heal)

The journal, the recycler, the objects' claims and the reader are written once against
`Layout`; `local` (a POSIX directory: hard links, renames, fsync) and `remote` (an fsspec
filesystem, object stores above all: server-side copies, ETags) implement it. Only the
local one can take a warehouse file by rename or share an inode with it, so the
operations about hard links (`break_link`, private copies) are the local one's alone and
are never reached for a remote store."""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from cmroot.config import local_path
from cmroot.durable import fsync_dir, sync_filesystem

if TYPE_CHECKING:
    from cmroot.store.source import Session

__all__ = [
    "OBJECT_NAME", "SHARD_NAME", "Layout", "StagedInfo", "fsync_dir", "open_layout",
    "same_bytes", "shard_of", "sync_filesystem",
]


# The names below `objects/`: a shard directory, an object.
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
OBJECT_NAME = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class StagedInfo:
    """A staged file as found: whether it is a regular file, its size, its link count
    (1 where links do not exist) and, locally, its stat (the journal compares inodes)."""

    regular: bool
    size: int
    nlink: int = 1
    st: os.stat_result | None = None


class Layout(ABC):
    """The store's places and the operations on them."""

    root: str  # as configured: a path, or a URL
    objects: str
    staging: str
    trash: str
    quarantine: str
    local: bool
    renames: bool  # whether a warehouse file can be renamed into staging
    scratch: str  # a local directory for spooled reads and copies in passing

    # Directory levels between `objects` and an object: 2 (`ab/cd/<checksum>`), or 1
    # (`ab/<checksum>`: local stores made since the LAYOUT file, see LocalLayout).
    shard_levels: int = 2

    def shard_of(self, checksum: str) -> str:
        return shard_of(checksum, self.shard_levels)

    def object_rel(self, checksum: str) -> str:
        """An object's path below `objects`."""
        return f"{shard_of(checksum, self.shard_levels)}/{checksum}"

    def object_path(self, checksum: str) -> str:
        return f"{self.objects}/{self.object_rel(checksum)}"

    def object_rels(self, checksum: str) -> tuple[str, ...]:
        """Where object `checksum` may be below `objects`: its place, then (a local store)
        the other layout's place, where a release that knew no LAYOUT file put it."""
        return (self.object_rel(checksum),)

    def staged_path(self, txid: str, seq: int) -> str:
        return f"{self.staging}/{txid}/{seq}"

    def tx_dir(self, txid: str) -> str:
        return f"{self.staging}/{txid}"

    def location(self, checksum: str) -> str:
        """Where an object is, as a resolve answers it."""
        return self.object_path(checksum)

    # -- the writer's lock and the area of a transaction ------------------------------------
    @abstractmethod
    def lock(self) -> object:
        """Take the store's write lock (StoreLocked if another writer holds it)."""

    @abstractmethod
    def unlock(self, handle: object) -> None: ...

    @abstractmethod
    def writable(self) -> bool:
        """Whether the store can be written now (readiness)."""

    def owned(self) -> bool:
        """Whether this index may delete objects: one that another index also uses holds
        objects only that one knows. A local store is the host's alone (its lock), so
        always; a remote one asks its `OWNER` marker (see RemoteLayout)."""
        return True

    @abstractmethod
    def begin_tx(self, txid: str) -> None:
        """Make room for a transaction's staged files."""

    @abstractmethod
    def end_tx(self, txid: str) -> None:
        """Remove whatever is left of a transaction's staging area."""

    @abstractmethod
    def flush(self) -> None:
        """Make every staged file and published object written so far durable."""

    @abstractmethod
    def transactions(self) -> list[str]:
        """The names of the transaction areas in staging."""

    @abstractmethod
    def staged_files(self, txid: str) -> list[str]:
        """The files under one transaction area, as staged paths."""

    # -- staged files ---------------------------------------------------------------------
    @abstractmethod
    def stage_copy(self, session: Session, rel: str, staged: str) -> tuple[str, str]:
        """Copy the source file `rel` of `session` to `staged`, verified; return its checksum
        (of the staged bytes) and the identity of the source copied."""

    @abstractmethod
    def staged_info(self, staged: str) -> StagedInfo | None:
        """The staged file, or None if nothing is there."""

    @abstractmethod
    def hash_staged(self, staged: str) -> str: ...

    @abstractmethod
    def unlink_staged(self, staged: str) -> None:
        """Remove a staged file (gone already is fine)."""

    @abstractmethod
    def put_back(self, session: Session, rel: str, staged: str) -> bool:
        """Return a staged file to its source path without clobbering anything; False if
        the path holds other bytes now (the staged file stays)."""

    @abstractmethod
    def published(self, staged: str, info: StagedInfo, checksum: str) -> bool:
        """Whether the staged file was published as object `checksum` (a recovery asks)."""

    def needs_private(self, staged: str, nlink: int, fresh: bool = False) -> bool:
        """Must the object of this staged file be a copy of its bytes rather than its
        inode? Only where inodes are shared (see LocalLayout). `fresh`: staged by the
        caller just now, so no earlier step can have made a copy of it."""
        return False

    def private_copy(self, staged: str, checksum: str) -> str:
        raise NotImplementedError("only a local store shares inodes with the warehouse")

    # -- objects --------------------------------------------------------------------------
    @abstractmethod
    def link(self, staged: str, checksum: str) -> bool:
        """Publish `staged` as object `checksum` unless one is there: True if this made it.
        Never replaces an object. Called under the objects' lock."""

    @abstractmethod
    def same_content(self, staged: str, checksum: str) -> bool:
        """Whether object `checksum` holds exactly the staged bytes (the collision guard)."""

    @abstractmethod
    def hash_object(self, checksum: str) -> str: ...

    @abstractmethod
    def heal(self, checksum: str, staged: str, now: float) -> str:
        """Object `checksum` is corrupt and `staged` hashes to it: move the bad bytes to
        quarantine and put the staged bytes in place. Returns where the bad ones went."""

    @abstractmethod
    def object_exists(self, checksum: str) -> bool: ...

    def find_object(self, checksum: str) -> str | None:
        """Where object `checksum` is, as a resolve answers it; None if it is nowhere."""
        return self.location(checksum) if self.object_exists(checksum) else None

    @abstractmethod
    def unlink_object(self, checksum: str) -> None:
        """Remove an object (gone already is fine)."""

    @abstractmethod
    def trash_object(self, checksum: str, day: str) -> None:
        """Move an object to trash/<day>/."""

    @abstractmethod
    def quarantined(self, checksum: str) -> bool:
        """Whether an object of this checksum was quarantined."""


def shard_of(checksum: str, levels: int) -> str:
    """An object's shard directory below `objects`: "ab", or "ab/cd" with two levels."""
    return checksum[:2] if levels == 1 else f"{checksum[:2]}/{checksum[2:4]}"


def open_layout(root: str, work: str) -> Layout:
    """The layout of a store at `root` (a local path or `file://` URL, or any fsspec URL);
    `work` is a local directory a remote store keeps its lock and scratch files in."""
    local = local_path(root)
    if local is not None:
        from cmroot.store.layout.local import LocalLayout

        return LocalLayout(local)
    from cmroot.store.layout.remote import RemoteLayout

    return RemoteLayout(root, work)


def same_bytes(a: str, b: str | IO[bytes], chunk: int = 1 << 20) -> bool:
    """Compare a local file with another (a path, or a binary file open at its start) byte
    for byte: the guard against hash collisions."""
    size = os.path.getsize(a)
    if isinstance(b, str):
        with open(b, "rb") as fb:
            return same_bytes(a, fb, chunk)
    if size != os.fstat(b.fileno()).st_size:
        return False
    return same_stream(a, b, chunk)


def same_stream(a: str, b: IO[bytes], chunk: int = 1 << 20) -> bool:
    """Whether the local file `a` and the stream `b` (at its start) hold the same bytes."""
    with open(a, "rb") as fa:
        return streams_equal(fa, b, chunk)


def streams_equal(x: IO[bytes], y: IO[bytes], chunk: int = 1 << 20) -> bool:
    """Whether two streams hold the same bytes from where they are. Reads are filled to
    `chunk` (a network stream may answer a read with fewer bytes than asked)."""
    while True:
        p, q = _read_full(x, chunk), _read_full(y, chunk)
        if p != q:
            return False
        if not p:
            return True


def _read_full(f: IO[bytes], n: int) -> bytes:
    buf = f.read(n)
    while buf and len(buf) < n:
        more = f.read(n - len(buf))
        if not more:
            break
        buf += more
    return buf

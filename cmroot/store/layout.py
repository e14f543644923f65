"""Where things live under the store root, and the durability primitives the store needs.

<root>/objects/ab/cd/<checksum>   content-addressed objects, immutable once published
<root>/staging/<txid>/<seq>       files of a recycle in flight (named by the journal)
<root>/trash/<YYYY-MM-DD>/<checksum>  expired objects when on_expire = "trash"
<root>/quarantine/<checksum>.<unix time>  objects found corrupt (by fsck, a read, a heal)
<root>/LOCK                       held by the one process that may write the store
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from typing import IO

from cmroot.durable import fsync_dir, sync_filesystem
from cmroot.exceptions import StoreLocked

# Stores this process holds the write lock of, by real path.
_HELD: dict[str, int] = {}
_HELD_LOCK = threading.Lock()

__all__ = ["Layout", "fsync_dir", "same_bytes", "sync_filesystem"]

class Layout:
    def __init__(self, root: str) -> None:
        self.root = root
        self.objects = os.path.join(root, "objects")
        self.staging = os.path.join(root, "staging")
        self.trash = os.path.join(root, "trash")
        self.quarantine = os.path.join(root, "quarantine")
        for d in (root, self.objects, self.staging):
            os.makedirs(d, exist_ok=True)

    def object_path(self, checksum: str) -> str:
        return f"{self.objects}/{checksum[:2]}/{checksum[2:4]}/{checksum}"

    def make_shard(self, checksum: str) -> None:
        """Create the object's directory. Callers try their link first and call this only
        when the directory is missing, so a shard is created on its first use, once."""
        os.makedirs(f"{self.objects}/{checksum[:2]}/{checksum[2:4]}", exist_ok=True)

    def tx_dir(self, txid: str) -> str:
        return os.path.join(self.staging, txid)

    def staged_path(self, txid: str, seq: int) -> str:
        return f"{self.staging}/{txid}/{seq}"

    def lock(self) -> int:
        """Take the store's write lock (released when the process dies, even by kill -9).
        A second writer in this very process is refused too, by name: flock would refuse
        it as "in use by pid <our own pid>", and its recovery would roll back our own
        in-flight recycles."""
        real = os.path.realpath(self.root)
        with _HELD_LOCK:
            if real in _HELD:
                raise StoreLocked(
                    f"store {self.root} is already open for writing in this process",
                    "use the Store already open (or close it first), or open this one with"
                    " readonly=True",
                )
            fd = os.open(os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise StoreLocked(
                    f"store {self.root} is in use by pid {holder}",
                    "stop that process, or act through the running daemon with --url",
                ) from None
            _HELD[real] = fd
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        return fd

    def unlock(self, fd: int) -> None:
        with _HELD_LOCK:
            _HELD.pop(os.path.realpath(self.root), None)
        os.close(fd)


def same_bytes(a: str, b: str | IO[bytes], chunk: int = 1 << 20) -> bool:
    """Compare a local file with another (a path, or a binary file open at its start) byte
    for byte: the guard against hash collisions."""
    size = os.path.getsize(a)
    if isinstance(b, str):
        with open(b, "rb") as fb:
            return same_bytes(a, fb, chunk)
    if size != os.fstat(b.fileno()).st_size:
        return False
    chunk = min(chunk, size + 1)
    with open(a, "rb") as fa:
        while True:
            x, y = fa.read(chunk), b.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def is_cross_device(err: OSError) -> bool:
    return err.errno == errno.EXDEV

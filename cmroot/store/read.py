"""Verified reads (invariant 3): the bytes of (path, checksum), opened once and checked
from the very descriptor that then serves them.

A path checked by name and reopened to be served can be swapped in between (a symlink to
a secret, other bytes renamed over it). So the original is opened once, below its root's
descriptor with no symlink followed (`confined.open_beneath`), fstat'ed, and hashed by
pread from that descriptor; the daemon and the CLI then copy from the same descriptor.

A verification is remembered (a bounded LRU in memory) keyed on the checksum and the
file's identity `(st_dev, st_ino, size, mtime_ns, ctime_ns)`: a writer can restore mtime
(`cp -p`, `os.utime`) but never ctime. An identity that moved while hashing is not
trusted. Store objects are hard links of the recycled inode, so a writer that kept a
descriptor from before the recycle can still change them: an object that no longer hashes
to its name is quarantined, reported and counted, and never served."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from cmroot import checksum as cks
from cmroot.exceptions import NotFound
from cmroot.index import Index
from cmroot.store import confined
from cmroot.store.layout import Layout
from cmroot.store.layout.local import LocalLayout
from cmroot.store.layout.remote import RemoteLayout
from cmroot.store.source import RootUnavailable
from cmroot.store.source.local import Ident, LocalSource, ident_of, ident_str
from cmroot.store.source.remote import fresh_info, remote_ident, spool
from cmroot.store.warehouse import Located, PathUnsettled, Warehouse
from cmroot.vocab import Status

log = logging.getLogger(__name__)

TRUSTED = 100_000  # verifications remembered
# A file whose ctime is this recent is never trusted or cached by identity: timestamps
# tick coarsely (a jiffy), so a rewrite within the same tick would keep the identity
# ("racy git"). Such a file is simply hashed again until it settles.
RACY_NS = 2_000_000_000
_ATTEMPTS = 3  # hashes of a file whose identity keeps moving before giving up on it
# O_NONBLOCK: a FIFO planted in the warehouse must not block the open; it is then
# refused by fstat like any other special file.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Errors that mean the file went away between two steps (NFS says ESTALE).
VANISHED = frozenset({errno.ENOENT, errno.ESTALE, errno.ENOTDIR})
# Errors of an open that mean "no readable regular file here, through no symlink".
NO_FILE = (
    VANISHED
    | confined.ESCAPE
    | frozenset(
        {
            errno.EACCES,
            errno.EPERM,
            errno.EISDIR,
            errno.ENAMETOOLONG,
            errno.ENXIO,
            errno.EINVAL,
            errno.ENODEV,
            errno.EOPNOTSUPP,
            # Under another program's write lease (Samba, NFS): a non-blocking open says
            # EWOULDBLOCK rather than wait up to lease-break-time for the holder.
            errno.EAGAIN,
        }
    )
)


def settled(ident: Ident) -> bool:
    """Whether the identity can vouch for the bytes (its ctime is not too recent)."""
    return time.time_ns() - ident[4] > RACY_NS


class WouldBlock(Exception):
    """`Reader.open_cached` cannot answer from memory alone: ask `open_verified` on a
    thread, which gives the full answer."""


class Quarantined(NotFound):
    """The store's object did not hash to its name: moved aside, never served (a 404: the
    request was fine, the bytes are not there)."""


class LeftCorrupt(Quarantined):
    """A read-only reader (a serving process) found the store's object corrupt: never
    served, and left where it is for the store's writer, who alone may move it."""


@dataclass(eq=False)
class Verified:
    """An open, verified file: `fd` holds bytes that hashed to `checksum` when `ident` was
    its identity. `data` is the whole content when it was small enough to be read (and
    hashed) in one go. Close it (or use it as a context manager)."""

    status: Status
    checksum: str
    size: int
    ident: Ident
    fd: int
    data: bytes | None = None
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> Verified:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def unchanged(self) -> bool:
        """Whether the descriptor's identity is still the one that was verified."""
        try:
            return ident_of(os.fstat(self.fd)) == self.ident
        except OSError:
            return False

    def pread(self, n: int, offset: int) -> bytes:
        if self.data is not None:
            return self.data[offset : offset + n]
        return os.pread(self.fd, n, offset)

    def copy_to(self, out: Any, chunk: int = cks.CHUNK) -> tuple[int, str]:
        """Write the whole verified content to a binary stream, hashing what is written:
        (bytes written, their checksum), which the caller compares with `checksum`."""
        if self.data is not None:
            out.write(self.data)
            return len(self.data), cks.of_bytes(self.data)
        h = xxhash.xxh3_128()
        offset = 0
        while buf := os.pread(self.fd, chunk, offset):
            h.update(buf)
            out.write(buf)
            offset += len(buf)
        return offset, h.hexdigest()


class TrustCache:
    """Bounded LRU of (checksum, identity) pairs whose bytes were verified."""

    def __init__(self, bound: int = TRUSTED) -> None:
        self.bound = bound
        self._seen: OrderedDict[tuple[str, Ident], None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, Ident]) -> bool:
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return True
            return False

    def add(self, key: tuple[str, Ident]) -> None:
        with self._lock:
            self._seen[key] = None
            self._seen.move_to_end(key)
            while len(self._seen) > self.bound:
                self._seen.popitem(last=False)


@dataclass
class _Check:
    matched: bool
    stable: bool  # identity unchanged across the hash that decided
    ident: Ident
    data: bytes | None = None


class Reader:
    """`open_verified` and what it needs: the roots, the index, the store's layout."""

    def __init__(
        self,
        layout: Layout,
        index: Index,
        warehouse: Warehouse,
        clock: Callable[[], float],
        readonly: bool,
    ) -> None:
        self.layout = layout
        self.index = index
        self.warehouse = warehouse
        self.clock = clock
        self.readonly = readonly
        self.trusted = TrustCache()
        # Where open_cached may look (asked here, off any event loop: statfs of a hung
        # network mount blocks): local roots and the objects dir on local filesystems.
        self._local_roots = {
            r.source.real: confined.local_filesystem(r.source.real)
            for r in warehouse.roots
            if isinstance(r.source, LocalSource) and r.source.outer is None
        }
        self._objects_fs = (
            layout.objects
            if isinstance(layout, LocalLayout) and confined.local_filesystem(layout.objects)
            else None
        )
        # Called once per mismatch found (the daemon counts them).
        self.on_mismatch: Callable[[], None] | None = None

    def open_verified(self, path: object, checksum: object, inline_max: int = 0) -> Verified:
        """The bytes of (path, checksum): the original if it still hashes to the checksum,
        else the store's object if an entry records that pair. Files up to `inline_max`
        bytes are read whole (`Verified.data`), hashed as read. Raises NotFound."""
        c = cks.validate(checksum)
        loc = locate(self.warehouse, path)
        original = self._original(loc, c, inline_max)
        if original is not None:
            return original
        if self.index.recorded([(loc.key, c)]):
            obj = self._object(loc.key, c, inline_max)
            if obj is not None:
                return obj
            if self._quarantined(c):
                raise Quarantined(
                    "stored object is corrupt",
                    f"object {c} of {loc.key} did not hash to its name and was quarantined;"
                    " run cmroot fsck",
                )
        raise NotFound(
            "no such file", f"{loc.key} with checksum {c} is neither at its path nor in the store"
        )

    def open_cached(self, path: object, checksum: object, inline_max: int) -> Verified:
        """`open_verified` for the event loop: the same checks on the same descriptor, with
        every lookup answered from the kernel's caches (openat2 RESOLVE_CACHED, preadv2
        RWF_NOWAIT) on local filesystems, so no warehouse file, disk or server is waited
        for. The index lookup is an SQLite point query, as on the threads: its pages are
        the daemon's hottest, read from the store's local disk when the page cache lost
        them. It only ever returns bytes it verified. Anything else raises WouldBlock,
        for `open_verified` on a thread to decide with its full rules: a file over
        `inline_max`, a path through a symlink or a mount point, a remote or network
        root or store, bytes not in the page cache, an original or object that is
        missing or does not match (quarantine is the thread's job). Bad input raises
        what `open_verified` raises."""
        if self._objects_fs is None:
            raise WouldBlock("the store is not on a local filesystem")
        c = cks.validate(checksum)
        loc = self.warehouse.locate(path, resolve=False)  # by name: symlinks fail below
        source = loc.root.source
        if not isinstance(source, LocalSource) or not self._local_roots.get(source.real):
            raise WouldBlock("a remote, nested or network root")
        try:
            found = self._cached_original(source.real, root_rel(loc), c, inline_max)
            if found is not None:
                return found
            if not self.index.recorded([(loc.key, c)]):
                raise WouldBlock("no entry: the thread looks for renames and says 404")
            return self._cached_object(self._objects_fs, c, inline_max)
        except OSError as e:
            raise WouldBlock(str(e)) from None

    def _cached_original(self, root: str, rel: str, c: str, inline_max: int
                         ) -> Verified | None:
        """The original, verified; None when no regular file is at its path or it holds
        other bytes (then its recycled copy may answer)."""
        if not rel:
            return None
        rfd = confined.open_cached(confined.AT_FDCWD, root, DIR_FLAGS, beneath=False)
        try:
            fd = _open_regular_cached(rfd, rel)
        finally:
            os.close(rfd)
        if fd is None:
            return None
        return self._cached_verified(Status.ORIGINAL, fd, c, inline_max, "original")

    def _cached_object(self, objects: str, c: str, inline_max: int) -> Verified:
        # Opened by its path each time: a descriptor kept would go on serving from a
        # directory moved out of the store.
        ofd = confined.open_cached(confined.AT_FDCWD, objects, DIR_FLAGS, beneath=False)
        try:
            fd = _open_object_cached(ofd, self.layout.object_rel(c))
        finally:
            os.close(ofd)
        found = None if fd is None else self._cached_verified(
            Status.CMROOT, fd, c, inline_max, "object")
        if found is None:
            raise WouldBlock("no object, or it does not match: the thread decides")
        return found

    def _cached_verified(self, status: Status, fd: int, c: str, inline_max: int, what: str
                         ) -> Verified | None:
        """A Verified of `fd` (closed otherwise) if its bytes, read whole from the page
        cache, hash to `c`; None if they do not."""
        try:
            check = self._check(fd, c, inline_max, None, nowait=True)
            if check is not None and check.matched and check.stable:
                return self._verified(status, c, fd, check)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if check is None:
            raise WouldBlock(f"the {what} changed while read")
        return None

    # -- originals ------------------------------------------------------------------------
    def _original(self, loc: Located, c: str, inline_max: int) -> Verified | None:
        if not loc.local:
            return self._remote(loc, c, inline_max)
        if loc.statted and loc.st is None:
            return None  # confining it just found no regular file there
        fd = open_original(loc)
        if fd is None:
            return None
        try:
            check = self._check(fd, c, inline_max, loc.key)
            if check is not None and check.matched and check.stable:
                return self._verified(Status.ORIGINAL, c, fd, check)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def _remote(self, loc: Located, c: str, inline_max: int) -> Verified | None:
        """An object-store original, streamed once into an unnamed file in the store's
        staging area while hashed: what is served is that verified copy."""
        fs = loc.root.fs
        try:
            info = fresh_info(fs, loc.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if info.get("type") != "file":
            return None
        ident = remote_ident(info)
        if ident is not None:
            cached = self.index.cached_checksums([(loc.key, ident)]).get(loc.key)
            if cached is not None and cached != c:
                return None  # known to hold other bytes: do not download it
        try:
            tmp, got = spool(fs, loc.path, self.layout.scratch)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with tmp:
            if got != c:
                return None
            fd = os.dup(tmp.fileno())
        st = os.fstat(fd)
        data = cks.read_fd(fd, st.st_size) if st.st_size <= inline_max else None
        return Verified(Status.ORIGINAL, c, st.st_size, ident_of(st), fd, data)

    # -- store objects --------------------------------------------------------------------
    def _object(self, key: str, c: str, inline_max: int) -> Verified | None:
        if isinstance(self.layout, RemoteLayout):
            return self._remote_object(self.layout, key, c, inline_max)
        quarantined = False
        rels = self.layout.object_rels(c)
        # Its place, then the other layout's (see Layout.object_rels): a corrupt copy at
        # one is quarantined and the other still looked at. Its place again last: a
        # publish may have moved it there between the two looks (a link, then an unlink).
        for rel in (*rels, rels[0]) if len(rels) > 1 else rels:
            fd = self._open_object(rel)
            if fd is None:
                continue
            try:
                check = self._check(fd, c, inline_max, None)
                if check is not None and check.matched:
                    return self._verified(Status.CMROOT, c, fd, check)
                if check is not None:
                    if self.readonly:
                        raise self._left(key, c)
                    self._report(key, c, self._quarantine(c, rel, os.fstat(fd)))
                    quarantined = True
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        if not quarantined:
            return None
        raise Quarantined(
            "stored object is corrupt",
            f"object {c} of {key} does not hash to its name; quarantined; not served: run"
            " cmroot fsck",
        )

    def _open_object(self, rel: str) -> int | None:
        """A read descriptor of the local object at `rel` below `objects`, reached with
        no symlink followed; None if none is there."""
        try:
            with confined.directory(self.layout.objects) as ofd:
                return confined.open_beneath(ofd, rel, READ_FLAGS)
        except OSError as e:
            if e.errno not in NO_FILE:
                raise
        return None

    def _remote_object(
        self, layout: RemoteLayout, key: str, c: str, inline_max: int
    ) -> Verified | None:
        """An object of a remote store, streamed once into an unnamed local file while
        hashed: what is served is that verified copy, never the object read again."""
        spooled = layout.spool_object(c)
        if spooled is None:
            return None
        tmp, got, ident = spooled
        with tmp:
            if got != c:
                if self.readonly:
                    raise self._left(key, c)
                where = layout.quarantine_object(c, ident, self.clock())
                self._report(key, c, where)
                raise Quarantined(
                    "stored object is corrupt",
                    f"object {c} of {key} does not hash to its name"
                    + ("; quarantined" if where else "") + "; not served: run cmroot fsck",
                )
            fd = os.dup(tmp.fileno())
        st = os.fstat(fd)
        data = cks.read_fd(fd, st.st_size) if st.st_size <= inline_max else None
        return Verified(Status.CMROOT, c, st.st_size, ident_of(st), fd, data)

    def _left(self, key: str, c: str) -> LeftCorrupt:
        """What a read-only reader raises for a corrupt object: left to the writer, who
        counts and reports it when it meets it (a serving process passes the request on
        to the primary for that)."""
        log.warning("stored object is corrupt, not served; left to the store's writer",
                    extra={"checksum": c, "path": key})
        return LeftCorrupt("stored object is corrupt", f"object {c} of {key} does not hash"
                           " to its name; not served: run cmroot fsck")

    def _report(self, key: str, c: str, where: str | None) -> None:
        """Count and log a corrupt object once: by the reader that moved it to quarantine
        (`where`). Readers that hashed it at the same time find it moved, or healed since
        by a fresh publish, and say so quietly."""
        if where is None:
            log.info("stored object found corrupt was already quarantined or healed",
                     extra={"checksum": c, "path": key})
            return
        if self.on_mismatch is not None:
            self.on_mismatch()
        log.error(
            "checksum mismatch: stored object is corrupt, not served",
            extra={"checksum": c, "path": key, "quarantined": where},
        )

    def _quarantine(self, c: str, rel: str, st: os.stat_result) -> str | None:
        """Move the object we checked at `rel` below `objects` (the same inode, not
        whatever took its name since) to <store>/quarantine/<checksum>.<unix time>; its
        new path, or None."""
        os.makedirs(self.layout.quarantine, exist_ok=True)
        name = f"{c}.{int(self.clock())}"
        try:
            with (
                confined.directory(self.layout.objects) as ofd,
                confined.parent_of(ofd, rel) as (sfd, base),
                confined.directory(self.layout.quarantine) as qfd,
            ):
                cur = os.stat(base, dir_fd=sfd, follow_symlinks=False)
                if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                    return None  # already moved, or replaced by a fresh publish
                n = 0
                while True:
                    dest = name if n == 0 else f"{name}.{n}"
                    try:
                        os.stat(dest, dir_fd=qfd, follow_symlinks=False)
                    except FileNotFoundError:
                        break
                    n += 1
                os.rename(base, dest, src_dir_fd=sfd, dst_dir_fd=qfd)
                return os.path.join(self.layout.quarantine, dest)
        except OSError as e:
            if e.errno in VANISHED:
                return None
            raise

    def _quarantined(self, c: str) -> bool:
        return self.layout.quarantined(c)

    # -- the check ------------------------------------------------------------------------
    def _check(self, fd: int, c: str, inline_max: int, cache_key: str | None,
               nowait: bool = False) -> _Check | None:
        """Hash the open file (or trust an earlier verification of this very identity).
        None when it is not a regular file or vanished meanwhile. With `nowait`, a file
        up to `inline_max` read from the page cache only (BlockingIOError otherwise)."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            ident = ident_of(st)
            if nowait and st.st_size > inline_max:
                raise BlockingIOError(errno.EAGAIN, "over the inline size: hashed on a thread")
            if st.st_size <= inline_max:
                # What is read is what will be served: its hash alone decides. One byte
                # past the bound is enough to tell a file that grew meanwhile.
                data = cks.read_fd(fd, st.st_size, nowait, limit=inline_max + 1)
                ok = len(data) <= inline_max and cks.of_bytes(data) == c
                return _Check(ok, True, ident, data)
            if (c, ident) in self.trusted:
                return _Check(True, True, ident)
            if cache_key is not None and settled(ident):
                cached = self.index.cached_checksums([(cache_key, ident_str(ident))])
                if cache_key in cached:
                    ok = cached[cache_key] == c
                    if ok:
                        self.trusted.add((c, ident))
                    return _Check(ok, True, ident)
            check = _Check(False, False, ident)
            for _ in range(_ATTEMPTS):
                got, _n = cks.of_fd(fd)
                after = ident_of(os.fstat(fd))
                check = _Check(got == c, after == ident, after)
                if check.stable:
                    if check.matched and settled(ident):
                        self.trusted.add((c, ident))
                    return check
                ident = after  # written to while we hashed: look again
            return check
        except OSError as e:
            if e.errno in VANISHED:
                return None
            raise

    def _verified(self, status: Status, c: str, fd: int, check: _Check) -> Verified:
        size = len(check.data) if check.data is not None else check.ident[2]
        return Verified(status, c, size, check.ident, fd, check.data)


def locate(warehouse: Warehouse, raw: object, attempts: int = 3) -> Located:
    """Warehouse.locate, tolerant of the path changing under it: realpath() raises
    (ENOENT, EINVAL) when a symlink on the way is swapped while it is being read. Tried
    again, then placed by name with no original there: the pair can still be answered
    from its recycled copies (never an internal error, never a refused batch)."""
    for _ in range(attempts):
        try:
            return warehouse.locate(raw)
        except PathUnsettled:
            continue
    log.info("path kept changing while looked up: its original is not considered",
             extra={"path": str(raw)[:300]})
    return warehouse.locate(raw, resolve=False)


def _open_object_cached(objects_fd: int, rel: str) -> int | None:
    """A read descriptor of the object at `rel` below the objects dir, looked up from
    memory; None when nothing is there or it is no regular file. Opened at once, as the
    threads open objects (`READ_FLAGS`: no symlink, and a FIFO opens without waiting):
    the store is on a local filesystem (open_cached asks), and only its owner writes
    there, so no open of an object runs anyone's code."""
    try:
        fd = confined.open_cached(objects_fd, rel, READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def _open_regular_cached(dir_fd: int, rel: str) -> int | None:
    """A read descriptor of the regular file `rel` below `dir_fd`, looked up from memory
    (confined.open_cached); None when nothing is there or it is no regular file. The file
    is first reached by O_PATH, which opens nothing: a FIFO or a device is never opened
    (the threads' lstat never opens them either), a FUSE or NFS open never runs here."""
    try:
        pfd = confined.open_cached(dir_fd, rel, os.O_PATH)
    except (FileNotFoundError, NotADirectoryError):
        return None  # a cached negative lookup says so for certain
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            return None
        fd = confined.open_cached(dir_fd, rel, READ_FLAGS)
    finally:
        os.close(pfd)
    try:
        now = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise BlockingIOError(errno.EAGAIN, "replaced while opened", rel)
    return fd


def root_rel(loc: Located) -> str:
    """A local path's name below its root ("" for the root itself)."""
    return loc.key[len(loc.root.url.rstrip("/")) :].strip("/")


def open_original(loc: Located, root_fd: int | None = None) -> int | None:
    """A read descriptor of the local original at `loc`, opened below its root with no
    symlink followed; None when no file is there (or a symlink is on the way)."""
    rel = root_rel(loc)
    if not rel:
        return None
    try:
        if root_fd is not None:
            return confined.open_beneath(root_fd, rel, READ_FLAGS)
        source = loc.root.source
        assert isinstance(source, LocalSource), "open_original is for local roots"
        with source.root() as rfd:
            return confined.open_beneath(rfd, rel, READ_FLAGS)
    except RootUnavailable:
        return None  # e.g. a nested root swapped for a symlink: nothing of ours is there
    except OSError as e:
        if e.errno in NO_FILE:
            return None
        raise

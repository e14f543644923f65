"""A local (POSIX) warehouse root, worked on through directory descriptors.

Every name is resolved below the root's descriptor with no symlink followed
(`cmroot.store.confined`), and moves are `renameat`/`linkat` between directory
descriptors, so a directory swapped for a symlink cannot redirect a recycle, a put-back
or a clean-up outside the root."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import fsspec
import xxhash

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import BadRequest, ChecksumMismatch, NotFound
from cmroot.store import confined
from cmroot.store.layout import same_bytes
from cmroot.store.source import (
    RootUnavailable,
    Session,
    Source,
    SourceFile,
    SymlinkRefused,
)
from cmroot.vocab import Method, Mode

log = logging.getLogger(__name__)

Ident = tuple[int, int, int, int, int]  # st_dev, st_ino, size, mtime_ns, ctime_ns


def ident_of(st: os.stat_result) -> Ident:
    """What a writer cannot forge: it can restore mtime (`cp -p`, `touch -d`), not ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def ident_str(ident: Ident) -> str:
    """The identity as the journal and the checksum cache record it."""
    dev, ino, size, mtime, ctime = ident
    return f"local:{dev}:{ino}:{size}:{mtime}:{ctime}"


def identity(st: os.stat_result) -> str:
    return ident_str(ident_of(st))


# The hidden name a take moves its source to before the check, ended by the caller's tag
# (transaction and file): a crash that leaves it there, the rollback or the next try of
# the same take finds it by that name.
_TAKE = ".cmroot-take-"


def _same_file(st: os.stat_result, ident: str) -> bool:
    """Whether `st` is the file whose identity was `ident`, but for its ctime (which a
    rename changes)."""
    return identity(st).rpartition(":")[0] == ident.rpartition(":")[0]


# Errors of a rename or a directory made on a path that another filesystem, permissions
# or a read-only mount now stand in the way of.
_UNREACHABLE = (errno.ENOENT, errno.ENOTDIR, errno.EXDEV, errno.EACCES, errno.EPERM,
                errno.EROFS)
# FS_IOC_GETFLAGS, and the inode flags that keep what is renamed into a directory there:
# append-only (no unlink, no rename out) and immutable (nothing in either).
_FS_IOC_GETFLAGS = 0x80086601
_PINNED = 0x00000020 | 0x00000010


def _inode_flags(fd: int) -> int:
    """The inode flags of `fd` (chattr's); 0 where the filesystem has none."""
    buf = bytearray(8)
    try:
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
    except OSError:
        return 0
    return int.from_bytes(buf[:4], sys.byteorder)


def _lstat(name: str, pfd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _return_beside(src: str, name: str, pfd: int, tag: str, rel: str, what: str) -> None:
    """Rename the absolute path `src` back to `name` below `pfd`, never over anything
    created there meanwhile: then beside it, as `<name>.cmroot-conflict-<tag>`, said in
    the log."""
    try:
        confined.rename_noreplace(src, name, pfd)
    except FileExistsError:
        beside = f"{name}.cmroot-conflict-{tag}"
        confined.rename_noreplace(src, beside, pfd)
        log.warning(f"{what} was put back beside the path re-created meanwhile",
                    extra={"path": rel, "as": beside})


class LocalSource(Source):
    local = True

    def __init__(self, real: str) -> None:
        self.real = real
        self.root_path = real
        self.fs = fsspec.filesystem("file")
        # The nearest other root this one lies in, and its path below that root: a writer
        # of the outer root could swap this root's directory for a symlink, so it is
        # reached through the outer root's descriptor, never by its path.
        self.outer: tuple[LocalSource, str] | None = None

    def method(self, mode: Mode) -> Method:
        return Method.RENAME if mode == Mode.MOVE else Method.COPY

    def open_root(self) -> int:
        """A new descriptor of the root directory (the caller closes it). A top-level root
        is opened by its real path (its parents belong to administrators, not to warehouse
        writers); a nested one below its outer root's descriptor, no symlink followed, so
        a swap makes every request under it fail instead of reading outside files."""
        try:
            if self.outer is None:
                return os.open(self.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            source, rel = self.outer
            outer = source.open_root()
            try:
                return confined.open_dir_beneath(outer, rel)
            finally:
                os.close(outer)
        except OSError as e:
            # For a symlink as the last component the kernel may say ENOTDIR, not ELOOP.
            raise RootUnavailable(
                "warehouse root unavailable",
                f"{self.real}: {e.strerror or e} (missing, not a directory, or a symlink"
                " inside another root): restore the directory, or configure the root by"
                " its real path",
            ) from None

    @contextmanager
    def root(self) -> Iterator[int]:
        fd = self.open_root()
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def session(self) -> Iterator[LocalSession]:
        root = self.open_root()
        try:
            outer = self._outer_tops()
        except BaseException:
            os.close(root)  # an outer root renamed meanwhile: this session fails whole
            raise
        s = LocalSession(root, outer)
        try:
            yield s
        finally:
            s.close()

    def _outer_tops(self) -> list[tuple[int, str]]:
        """Descriptors of the roots this one lies in, outermost first, each with this
        root's path below it (the caller closes them)."""
        out: list[tuple[int, str]] = []
        src, below = self, ""
        try:
            while src.outer is not None:
                outer, rel = src.outer
                below = f"{rel}/{below}" if below else rel
                out.append((outer.open_root(), below))
                src = outer
        except BaseException:
            for fd, _ in out:
                os.close(fd)
            raise
        return out[::-1]

    def expand(self, rel: str, key: str) -> tuple[list[SourceFile], bool]:
        with self.root() as root:
            try:
                if not rel:
                    top = confined.open_dir_beneath(root, "")
                else:
                    with confined.parent_of(root, rel) as (pfd, name):
                        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                        if not stat.S_ISDIR(st.st_mode):
                            _check_regular(key, st)
                            return [SourceFile(key, rel, st.st_size)], False
                        top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                      dir_fd=pfd)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFound("no such file", f"{key} does not exist") from None
            except OSError as e:
                if confined.is_escape(e):
                    raise SymlinkRefused(key) from None
                raise
        try:
            files = []
            for dirpath, dirnames, names, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                for d in dirnames:  # fwalk lists a symlink to a directory here, unfollowed
                    if stat.S_ISLNK(os.stat(d, dir_fd=dfd, follow_symlinks=False).st_mode):
                        sub = os.path.normpath(os.path.join(dirpath, d))
                        raise SymlinkRefused(f"{key.rstrip('/')}/{sub}")
                for n in names:
                    st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
                    sub = os.path.normpath(os.path.join(dirpath, n))
                    k = f"{key.rstrip('/')}/{sub}"
                    _check_regular(k, st)
                    files.append(SourceFile(k, f"{rel}/{sub}" if rel else sub, st.st_size))
            return files, True
        finally:
            os.close(top)


def _check_regular(key: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise SymlinkRefused(key)
    if not stat.S_ISREG(st.st_mode):
        raise BadRequest("not a regular file", f"{key} is a device, socket or pipe")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("file name is not UTF-8", f"{key!r}: rename it first") from None


class LocalSession(Session):
    """Directory descriptors of the root and of each parent directory used, opened once
    per session (a 10,000-file drop in 100 partitions opens 100, not 10,000). `outer`: the
    roots this one lies in, outermost first (descriptor, this root's path below it)."""

    def __init__(self, root_fd: int, outer: list[tuple[int, str]] | None = None) -> None:
        self.root = root_fd  # owned: closed with the session, as are the outer ones
        self._outer = outer or []
        self._dirs: dict[tuple[int, str], int] = {}
        self._tops: dict[int, bool] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for fd in self._dirs.values():
                os.close(fd)
            self._dirs.clear()
            for fd, _ in self._outer:
                os.close(fd)
            os.close(self.root)

    def _dir(self, head: str, create: bool = False, base: int | None = None) -> int:
        """The directory `head` below `base` (default: the root), opened once."""
        top = self.root if base is None else base
        if not head:
            return top
        fd = self._dirs.get((top, head))  # a dict read is atomic: the lock guards inserts
        if fd is None:
            fd = confined.open_dir_beneath(top, head, create)
            with self._lock:
                if (top, head) in self._dirs:
                    os.close(fd)
                    fd = self._dirs[(top, head)]
                else:
                    self._dirs[(top, head)] = fd
        return fd

    def _parent(self, rel: str, create: bool = False) -> tuple[int, str]:
        head, _, name = rel.rpartition("/")
        return self._dir(head, create), name

    def rename_out(self, rel: str, staged: str) -> None:
        pfd, name = self._parent(rel)
        before = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            raise BadRequest("not a regular file", f"{rel} changed into a non-file meanwhile")
        # Swapped for a symlink or a directory between that look and the rename: the
        # caller's hash of the staged name refuses it, and its rollback puts it back.
        os.rename(name, staged, src_dir_fd=pfd)

    def copy_out(self, rel: str, staged: str) -> tuple[str, str]:
        pfd, name = self._parent(rel)
        # O_NONBLOCK: a FIFO swapped in for the file must not hang the copy (fstat refuses it).
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                      dir_fd=pfd)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest("not a regular file", f"{rel} changed into a non-file")
            h = xxhash.xxh3_128()
            with open(staged, "xb") as out:
                while chunk := os.read(src, cks.CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            after = os.fstat(src)
        finally:
            os.close(src)
        if identity(after) != identity(st):
            raise ChecksumMismatch("source changed while copied", f"{rel}: try again")
        checksum = h.hexdigest()
        if cks.of_local_file(staged) != checksum:
            raise ChecksumMismatch("copy verification failed", f"{staged} does not hash like {rel}")
        return checksum, identity(st)

    def put_back(self, rel: str, staged: str) -> bool:
        pfd, name = self._parent(rel, create=True)
        if not stat.S_ISREG(os.lstat(staged).st_mode):
            # Not a file (a directory or symlink swapped in the instant between the check
            # and the rename): it goes back as it is, never over anything; if its name was
            # taken meanwhile, beside it under a name that says why. The store keeps
            # regular files only, so this is the one place such a thing can go.
            _return_beside(staged, name, pfd, os.path.basename(os.path.dirname(staged)), rel,
                           "a non-file swapped in during a recycle")
            return True
        try:
            # A link never replaces a file a writer created meanwhile; a crash between it
            # and the unlink leaves two names of one inode, which the next try settles.
            try:
                os.link(staged, name, dst_dir_fd=pfd, follow_symlinks=False)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                self._link_copy(staged, name, pfd)
        except FileExistsError:
            if not self._holds(pfd, name, staged):
                return False
        os.unlink(staged)
        return True

    def _link_copy(self, staged: str, name: str, pfd: int) -> None:
        """Put a file that is on another filesystem (a take's copy, fetched back from a
        store elsewhere) at `name`: copied into an unnamed file in its directory
        (O_TMPFILE), flushed, then linked, so it never replaces a file created meanwhile
        and a kill on the way leaves nothing behind. Where the filesystem has no O_TMPFILE,
        into a hidden name beside it instead, removed after."""
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=pfd)
            tmp = None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            tmp = f".cmroot-put-back-{os.getpid()}-{threading.get_ident()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=pfd)
        try:
            with open(staged, "rb") as src, open(fd, "wb", closefd=False) as dst:
                while chunk := src.read(cks.CHUNK):
                    dst.write(chunk)
            os.fsync(fd)
            faults.point("source.put_back_copied")
            if tmp is None:
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=pfd, follow_symlinks=True)
            else:
                os.link(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(fd)
            if tmp is not None:
                os.unlink(tmp, dir_fd=pfd)

    def _holds(self, pfd: int, name: str, staged: str) -> bool:
        """Whether `name` is a regular file with the staged bytes (a put-back that got as
        far as its link before a crash, or a writer that wrote the same bytes)."""
        try:
            # O_NONBLOCK: a FIFO made at the path must not hang the rollback (fstat says no)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=pfd)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            with open(fd, "rb", closefd=False) as f:
                return same_bytes(staged, f)
        finally:
            os.close(fd)

    def remove_if_unchanged(self, rel: str, ident: str, tag: str, resumed: bool = False
                            ) -> bool:
        aside = f"{_TAKE}{tag}"
        if resumed and (found := self._find_aside(aside, rel, ident)) is not None:
            return self._settle_aside(rel, aside, *found)  # the try before died there
        try:
            pfd, name = self._parent(rel)
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR) or confined.is_escape(e):
                return False
            raise
        if identity(st) != ident:
            return False
        faults.point("source.take_checked")
        # Take exactly the file checked: unlink has no condition, so whatever is at the
        # name now (a writer may have renamed a new file over it since) is first renamed
        # aside, atomically, and looked at there. Only the file copied is removed.
        try:
            afd = self._rename_aside(pfd, name, aside)
        except FileNotFoundError:
            return False
        faults.point("source.taken_aside")
        moved = os.stat(aside, dir_fd=afd, follow_symlinks=False)
        return self._settle_aside(rel, aside, afd, _same_file(moved, ident))

    def _rename_aside(self, pfd: int, name: str, aside: str) -> int:
        """Rename `name` (in `pfd`) to `aside`, at the top of its root where it can be: a
        crash may leave it there until the next open, and a writer who renames the
        partition directory meanwhile must not carry it out of the rollback's sight. In
        its own directory when the top is another filesystem (a mount below it), not
        writable, sticky, append-only or immutable (a file renamed in could not be removed
        or renamed out again). Returns the directory it went to."""
        if self._holds_asides(self.root):
            try:
                os.rename(name, aside, src_dir_fd=pfd, dst_dir_fd=self.root)
                return self.root
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
        os.rename(name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)
        return pfd

    def _holds_asides(self, top: int) -> bool:
        held = self._tops.get(top)
        if held is None:
            held = self._tops[top] = not (
                os.fstat(top).st_mode & stat.S_ISVTX or _inode_flags(top) & _PINNED)
        return held

    def _find_aside(self, aside: str, rel: str, ident: str) -> tuple[int, bool] | None:
        """The directory holding the aside of `rel`, and whether the aside is the file
        copied (identity `ident`). The file copied is looked for in
        every directory that holds the path, from the outermost root's top down (a root
        added to or removed from the configuration since the take moves the top it went
        to); anything else of that name (a writer's file the take moved aside) only where
        a take puts one: a top that holds asides, or the file's own directory. The name
        can be read there after a crash: a file planted under it elsewhere is never
        taken for ours."""
        places = [fd for fd, _ in self._outer] + [self.root]
        places = [fd for fd in places if self._holds_asides(fd)]
        try:
            places.append(self._dir(rel.rpartition("/")[0]))
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR) and not confined.is_escape(e):
                raise
        other = None
        for fd in self._ancestors(rel):
            st = _lstat(aside, fd)
            if st is None:
                continue
            if _same_file(st, ident):
                return fd, True
            if other is None and fd in places:
                other = fd
        return None if other is None else (other, False)

    def _ancestors(self, rel: str) -> Iterator[int]:
        places = [(fd, below) for fd, below in self._outer]
        places.append((self.root, rel.rpartition("/")[0]))
        for base, below in places:
            yield base
            parts = below.split("/") if below else []
            for i in range(1, len(parts) + 1):
                try:
                    yield self._dir("/".join(parts[:i]), base=base)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.ENOTDIR) or confined.is_escape(e):
                        break  # nothing below a missing or swapped directory is ours
                    raise

    def _settle_aside(self, rel: str, aside: str, afd: int, copied: bool) -> bool:
        """Remove what a take moved aside (`aside` in `afd`) if it is the file copied
        (True); anything else (a writer's file, renamed over the name before the take's
        rename) goes back."""
        if copied:
            os.unlink(aside, dir_fd=afd)
            return True
        self._return_aside(rel, afd, aside)
        return False

    def _return_aside(self, rel: str, afd: int, aside: str) -> None:
        """Put a writer's file that a take moved aside back at `rel` (its directory made
        again if it went), never over anything: beside it then. Where it cannot go (a
        symlink or another filesystem on its path now) it stays, said in the log."""
        try:
            pfd, name = self._parent(rel, create=True)
            _return_beside(f"/proc/self/fd/{afd}/{aside}", name, pfd, aside[len(_TAKE):], rel,
                           "a file written during a take")
        except OSError as e:
            if e.errno not in _UNREACHABLE and not confined.is_escape(e):
                raise
            log.error("a file written during a take cannot go back to its path: kept aside",
                      extra={"path": rel, "kept_as": aside, "error": e.strerror or str(e)})

    def take_back(self, rel: str, ident: str, tag: str) -> bool:
        aside = f"{_TAKE}{tag}"
        found = self._find_aside(aside, rel, ident)
        if found is None:
            return False
        afd, copied = found
        if not copied:
            # What the take found at the name and put aside (a writer's file renamed over
            # the source after the check) goes back; the copy of the old bytes is kept
            # all the same (the caller finds the name taken).
            self._return_aside(rel, afd, aside)
            return False
        try:
            # Back at its path, its directory made again if it went meanwhile (put_back
            # would make it for the copy all the same).
            pfd, name = self._parent(rel, create=True)
            confined.rename_noreplace(f"/proc/self/fd/{afd}/{aside}", name, pfd)
        except OSError as e:
            if not isinstance(e, FileExistsError) and e.errno not in _UNREACHABLE and (
                    not confined.is_escape(e)):
                raise
            # Its name was re-created since, or it cannot get there (a symlink on the way,
            # another filesystem): the copy staged in the store has these bytes, and the
            # caller's put-back takes it back, or keeps it in the store.
            try:
                os.unlink(aside, dir_fd=afd)
            except OSError as gone:
                log.error("a take's hidden copy cannot be removed", extra={
                    "path": rel, "kept_as": aside, "error": gone.strerror or str(gone)})
            return False
        return True

    def remove_empty_dirs(self, rel: str, keep: Callable[[str], bool]) -> None:
        try:
            top = confined.open_dir_beneath(self.root, rel)
        except OSError:
            return  # gone, or swapped for a symlink: nothing of ours to tidy
        try:
            for dirpath, dirnames, _, dfd in os.fwalk(
                ".", dir_fd=top, topdown=False, follow_symlinks=False
            ):
                for d in dirnames:
                    sub = os.path.normpath(os.path.join(rel, dirpath, d))
                    if keep(sub):
                        continue
                    try:
                        os.rmdir(d, dir_fd=dfd)
                    except OSError:
                        pass  # not empty: a writer added a file; leave it, as mv would
        finally:
            os.close(top)
        if rel and not keep(rel):
            try:
                pfd, name = self._parent(rel)
                os.rmdir(name, dir_fd=pfd)
            except OSError:
                pass

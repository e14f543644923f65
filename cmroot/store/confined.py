"""Path work that cannot be redirected: every open, rename and mkdir below a root is made
relative to a directory descriptor, with no symlink followed on the way.

A path checked with realpath() and then opened by name can be swapped for a symlink in
between (a race any writer of the warehouse can run). Here the check *is* the open:
`openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has it (Linux 5.6+),
else a walk that opens one component at a time with O_NOFOLLOW from the root's
descriptor. Either way a symlink anywhere on the path fails with ELOOP (or EXDEV), and
".." cannot climb out."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(platform.machine())
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_CACHED = 0x20  # Linux 5.12+: EAGAIN unless every component is in the dcache
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
# Errors that mean "a symlink, or a way out of the root, is on the path".
ESCAPE = frozenset({errno.ELOOP, errno.EXDEV})


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_have_openat2 = _SYS_OPENAT2 is not None
_probe_lock = threading.Lock()


def _openat2(dir_fd: int, rel: str, flags: int, mode: int) -> int | None:
    """The fd, or None when this kernel (or a seccomp filter) has no openat2."""
    global _have_openat2
    if not _have_openat2:
        return None
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and fd == -1:
        with _probe_lock:
            _have_openat2 = False  # containers often filter it: walk instead, from now on
        return None
    raise OSError(err, os.strerror(err), rel)


def open_cached(dir_fd: int, rel: str, flags: int, beneath: bool = True) -> int:
    """openat2 of `rel` (below `dir_fd` with no symlink followed and no mount point crossed,
    or, without `beneath`, a path an administrator configured) whose lookup is answered
    from the kernel's dentry cache alone. BlockingIOError when it would have to ask the
    disk (or this kernel cannot promise that): the caller does the open on a thread. The
    lookup only: the open itself is the filesystem's (a FUSE or NFS server may be asked),
    which is why `beneath` refuses to cross into another mount (EXDEV)."""
    if not _have_openat2:
        raise BlockingIOError(errno.EAGAIN, "openat2 unavailable", rel)
    resolve = _RESOLVE_CACHED
    if beneath:
        _parts(rel)
        resolve |= (_RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
                    | _RESOLVE_NO_XDEV)
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.ENOSYS, errno.EPERM, errno.EINVAL):
        # EINVAL: a kernel before RESOLVE_CACHED; ENOSYS/EPERM: no openat2 (seccomp)
        raise BlockingIOError(errno.EAGAIN, "not answerable from the dentry cache", rel)
    raise OSError(err, os.strerror(err), rel)


# statfs(2) f_type of filesystems whose open, stat and cached reads are the local
# kernel's own work: ext2-4, XFS, Btrfs, tmpfs, ZFS, F2FS. Not FUSE, NFS, SMB, Ceph,
# overlayfs (an open may copy a file up) or anything unknown.
_LOCAL_FS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0x2FC12FC1, 0xF2F52010})


def local_filesystem(path: str) -> bool:
    """Whether `path` lies on a filesystem of _LOCAL_FS. Ask it off the event loop: statfs
    of a hung network mount blocks."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in _LOCAL_FS


AT_FDCWD = -100


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, "not a plain relative path", rel)
    return parts


def open_beneath(dir_fd: int, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """Open `rel` (a plain relative path) below the directory `dir_fd`, following no
    symlink in any component. Raises OSError: ELOOP/EXDEV for a symlink or escape,
    ENOENT, ENOTDIR, EACCES, ... as the kernel says."""
    parts = _parts(rel)
    fd = _openat2(dir_fd, "/".join(parts), flags, mode)
    if fd is not None:
        return fd
    parent = open_dir_beneath(dir_fd, "/".join(parts[:-1])) if len(parts) > 1 else None
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                       dir_fd=dir_fd if parent is None else parent)
    finally:
        if parent is not None:
            os.close(parent)


def open_dir_beneath(dir_fd: int, rel: str, create: bool = False) -> int:
    """A descriptor of the directory `rel` below `dir_fd` ("" for `dir_fd` itself), no
    symlink followed. With `create`, missing directories are made on the way (mkdirat),
    each one relative to its parent's descriptor."""
    if not rel.strip("/"):
        return os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    parts = _parts(rel)
    if not create:
        fd = _openat2(dir_fd, "/".join(parts), _DIR_FLAGS, 0)
        if fd is not None:
            return fd
    fd = os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    try:
        for name in parts:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made by someone else meanwhile: open what is there
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def parent_of(dir_fd: int, rel: str, create: bool = False) -> Iterator[tuple[int, str]]:
    """(descriptor of the parent directory of `rel`, final name), closed on exit."""
    head, _, name = rel.strip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not a plain relative path", rel)
    fd = open_dir_beneath(dir_fd, head, create)
    try:
        yield fd, name
    finally:
        os.close(fd)


@contextmanager
def directory(path: str) -> Iterator[int]:
    """A descriptor of the directory at absolute `path` (the root itself may be a
    symlink an administrator configured), closed on exit."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276}.get(platform.machine())
_RENAME_NOREPLACE = 1


def rename_noreplace(src: str, dst: str, dst_dir_fd: int) -> None:
    """Rename the absolute path `src` to `dst` below `dst_dir_fd`, never over anything
    that is there (FileExistsError): renameat2(RENAME_NOREPLACE), or a check then a rename
    where the kernel or filesystem lacks it."""
    if _SYS_RENAMEAT2 is not None:
        r = _libc.syscall(_SYS_RENAMEAT2, AT_FDCWD, os.fsencode(src), dst_dir_fd,
                          os.fsencode(dst), _RENAME_NOREPLACE)
        if r == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
            raise OSError(err, os.strerror(err), dst)
    if os.path.lexists(f"/proc/self/fd/{dst_dir_fd}/{dst}"):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst, dst_dir_fd=dst_dir_fd)


def is_escape(err: OSError) -> bool:
    """Whether an error of this module means a symlink or a way out was on the path."""
    return err.errno in ESCAPE

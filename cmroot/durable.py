"""Durability primitives: flush a whole filesystem (renames included) at once, or one
directory's entries."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def sync_filesystem(path: str) -> None:
    """Flush the filesystem holding `path` (renames included) with one syncfs(2) call,
    instead of an fsync per directory touched."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The primary's private run directory (server.processes > 1): its socket, the shared
metrics and the config its serving processes run with. Mode 0700, one per primary, held
under an flock for the primary's life: a primary killed with -9 cannot remove its own,
and the next one to start removes every one whose lock is free."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time

from cmroot import config as cfg

log = logging.getLogger("cmroot.server")

PREFIX = "cmroot-serve-"
# Made under this name, locked, then renamed to PREFIX...: a primary sweeping stale
# directories never sees one that is not locked yet. One left under this name (its
# primary killed between the two) is swept once older than _MAKING_AGE seconds: a live
# primary is a few syscalls from taking its lock.
_MAKING = ".cmroot-serve-making-"
_MAKING_AGE = 60.0
_LOCK = "lock"
_LONGEST_NAME = f"{PREFIX}12345678"


class RunDir:
    """A locked run directory; `close` removes it."""

    def __init__(self, longest_entry: str) -> None:
        base = _base(longest_entry)
        sweep(base)
        making = tempfile.mkdtemp(prefix=_MAKING, dir=base)
        self._lock = os.open(os.path.join(making, _LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path = os.path.join(base, PREFIX + os.path.basename(making)[len(_MAKING):])
        os.rename(making, self.path)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)


def _base(longest_entry: str) -> str:
    """systemd's RuntimeDirectory when there is one, else the temp directory, else /tmp
    when that one is too deep for a Unix socket's path (`longest_entry` in the run dir
    must fit)."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    for base in (runtime, tempfile.gettempdir()):
        longest = os.path.join(base, _LONGEST_NAME, longest_entry)
        if base and len(os.fsencode(longest)) <= cfg.MAX_SOCKET_PATH:
            return base
    return "/tmp"


def sweep(base: str) -> None:
    """Remove the run directories in `base` of primaries that are gone (this user's,
    their lock free), and those a primary killed while making one left."""
    try:
        names = [n for n in os.listdir(base) if n.startswith((PREFIX, _MAKING))]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
                continue
            if name.startswith(_MAKING) and time.time() - st.st_mtime < _MAKING_AGE:
                continue
            fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # not ours, or not a run dir of this kind: left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its primary runs
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the run directory of a primary that is gone", extra={"path": path})

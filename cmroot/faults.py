"""Deterministic fault points for crash tests.

`point("recycle.staged")` does nothing unless the process was started with
`CMROOT_FAULTS=NAME[@K][,NAME[@K]...]` (or a test called `arm`): then the K-th time (default
1st) execution passes NAME, the process dies right there. The default death is a real
SIGKILL of the whole process; `arm(..., crash=True)` raises `Crash` instead, which the
store treats exactly like death (nothing after the point runs: no rollback, no clean-up),
so property-based tests can explore many crash points in one process.

Unarmed, a point costs one dict lookup on an empty dict."""

from __future__ import annotations

import os
import signal
import threading

_armed: dict[str, list[int | bool]] = {}
_lock = threading.Lock()


class Crash(BaseException):
    """An injected crash. Not an Exception: nothing that handles errors may handle it."""


def _parse(spec: str) -> None:
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, k = item.partition("@")
        _armed[name] = [int(k or 1), False]


def arm(name: str, k: int = 1, crash: bool = False) -> None:
    """Die (or raise Crash) the k-th time `name` is passed."""
    with _lock:
        _armed[name] = [k, crash]


def disarm() -> None:
    with _lock:
        _armed.clear()


def point(name: str) -> None:
    if not _armed:
        return
    with _lock:
        slot = _armed.get(name)
        if slot is None:
            return
        slot[0] = int(slot[0]) - 1
        if slot[0] != 0:
            return
        crash = bool(slot[1])
        del _armed[name]
    if crash:
        raise Crash(name)
    os.kill(os.getpid(), signal.SIGKILL)


_parse(os.environ.get("CMROOT_FAULTS", ""))

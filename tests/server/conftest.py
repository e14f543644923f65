"""Fixtures of the daemon suite: real `cmroot serve` subprocesses on free loopback ports,
each with its own warehouse and store under tmp_path, always stopped at teardown."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.server.cmroot_daemon import Daemon, MakeDaemon  # noqa: E402


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[MakeDaemon]:
    """`make_daemon(name="d", start=True, **Daemon kwargs)`: a daemon in tmp_path/name."""
    made: list[Daemon] = []

    def make(name: str = "d", start: bool = True, **kw: Any) -> Daemon:
        d = Daemon(tmp_path / name, **kw)
        made.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture
def daemon(make_daemon: MakeDaemon) -> Daemon:
    """A running daemon with one token per scope."""
    return make_daemon()

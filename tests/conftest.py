"""Shared fixtures for the core suite: a temporary warehouse, a store beside it, a config
built the way the daemon builds it (`cmroot.config.load` with `CMROOT_*` overrides) and an
injectable clock. Helpers that lay out partitioned tables of random bytes and inspect the
store live in `cmroot_testlib.py`.

Everything is real: files on a real filesystem, a real SQLite index. Nothing here mocks the
store; tests that inject faults monkeypatch os-level calls themselves."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

TESTS = Path(__file__).resolve().parent
for p in (TESTS.parent, TESTS):  # run from a checkout, installed or not, any import mode
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from cmroot_testlib import Clock, Env  # noqa: E402

from cmroot import config as cfg  # noqa: E402
from cmroot.store import Store  # noqa: E402


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def env(tmp_path: Path, clock: Clock) -> Iterator[Env]:
    """<tmp>/warehouse (the one warehouse root), <tmp>/cmroot (the store root, beside it),
    <tmp>/outside (a directory under no root)."""
    e = Env(
        base=tmp_path,
        warehouse=tmp_path / "warehouse",
        store_root=tmp_path / "cmroot",
        outside=tmp_path / "outside",
        clock=clock,
    )
    for d in (e.warehouse, e.outside):
        d.mkdir()
    yield e
    e.close_all()


@pytest.fixture
def store(env: Env) -> Store:
    """A writable store on `env`, with the injected clock and a 24h retention."""
    return env.open()


@pytest.fixture(autouse=True)
def _no_fault_left_armed() -> Iterator[None]:
    """A fault point a test armed but never reached must not fire in the next test."""
    from cmroot import faults

    yield
    faults.disarm()


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[tuple[Store, Any, str]]:
    """A store whose one warehouse root is a bucket on fsspec's in-memory filesystem:
    (store, fs, bucket), the bucket removed afterwards."""
    bucket = f"wh-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    config = cfg.load(
        None,
        {
            "CMROOT_STORE_ROOT": str(tmp_path / "store"),
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"memory://{bucket}",
        },
    )
    with Store.open(config) as store:
        yield store, fs, bucket
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)

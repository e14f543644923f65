"""Shared fixtures for the core suite: a temporary warehouse, a store beside it, a config
built the way the daemon builds it (`cmroot.config.load` with `CMROOT_*` overrides) and an
injectable clock. Helpers that lay out partitioned tables of random bytes and inspect the
store live in `cmroot_testlib.py`.

Everything is real: files on a real filesystem, a real SQLite index. Nothing here mocks the
store; tests that inject faults monkeypatch os-level calls themselves."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import pytest

TESTS = Path(__file__).resolve().parent
for p in (TESTS.parent, TESTS):  # run from a checkout, installed or not, any import mode
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from cmroot_testlib import Clock, Env, bind_mount  # noqa: E402
from remote_backends import RemoteWarehouse, memory_warehouse, s3_warehouse  # noqa: E402

from cmroot.store import Store  # noqa: E402

if TYPE_CHECKING:
    from s3server import S3Server  # moto is imported only when an S3 test runs


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
def bind_mounted_warehouse(env: Env) -> Iterator[Env]:
    """`env` with its warehouse root a bind mount of a directory on the store's filesystem:
    same st_dev as the store, yet rename() between them fails with EXDEV (every move is a
    take). Skipped where a bind mount cannot be made (not root)."""
    with bind_mount(env.base / "real-warehouse", env.warehouse):
        yield env


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
    with memory_warehouse(tmp_path / "store") as wh:
        yield wh.store, wh.fs, wh.bucket


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on loopback, for the whole session; while it runs, the process's
    AWS environment and fsspec's `s3` config point at it (dummy credentials, no AWS file
    read), both restored afterwards."""
    from s3server import S3Server

    server = S3Server().start()
    saved = fsspec.config.conf.get("s3")
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in server.env().items():
                mp.setenv(name, value)
            fsspec.config.conf["s3"] = server.fsspec_conf()
            yield server
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_server: S3Server) -> Any:
    """The tests' own s3fs client of the S3 server (not the store's), without listing cache."""
    return s3_server.client()


@pytest.fixture
def memory_wh(tmp_path: Path) -> Iterator[RemoteWarehouse]:
    """A store on a fresh bucket of fsspec's in-memory filesystem."""
    with memory_warehouse(tmp_path / "store") as wh:
        yield wh


@pytest.fixture
def s3_wh(tmp_path: Path, s3_client: Any) -> Iterator[RemoteWarehouse]:
    """A store on a fresh bucket of the loopback S3 server."""
    with s3_warehouse(tmp_path / "store", s3_client) as wh:
        yield wh


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """An empty directory (0700) for a daemon's RUNTIME_DIRECTORY, on a short path: the run
    dir made in it holds a Unix socket, whose whole path must fit in 107 bytes, and a test's
    tmp_path under pytest-xdist (.../popen-gw0/<test name>0/) may be too deep for that (the
    daemon then puts its run dir in /tmp instead)."""
    d = Path(tempfile.mkdtemp(prefix="cmroot-rt-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)

"""Re-use the daemon fixtures of tests/server (make_daemon, daemon); the Spark reviews'
database; for the replication reviews, a hooked source and a shared destination, kept from
one module to the next (their tests use databases of their own, as those of tests/repl do:
review 12's rv12_*, review 14's rv14_*, r17*, r18*, r19*), made again when another module
took the process's one Spark session in between, and gone when the package ends."""

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.adversarial.s3_store import s3s  # noqa: F401 - the reviews of the store on S3
from tests.repl.conftest import (  # noqa: F401 - fixtures the modules use
    RETAIN_OVERRIDES,
    SharedDestination,
    Source,
    destination,
    fresh_destination,
)
from tests.server.conftest import daemon, make_daemon  # noqa: F401
from tests.spark.sparklib import hooked_lake


class _ReplWorld:
    """The replication reviews' source and shared destination, each made on first use and
    kept for the next module. A source whose Spark session is no longer the process's
    active one (a Spark review module in between stopped it) is closed and made again."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp = tmp_path_factory
        self._source: Source | None = None
        self._source_stack = contextlib.ExitStack()
        self._destination: SharedDestination | None = None

    def source(self) -> Source:
        from pyspark import SparkContext

        src = self._source
        if src is not None and (SparkContext._active_spark_context is not src.spark.sparkContext
                                or src.daemon.proc is None or src.daemon.proc.poll() is not None):
            self.close_source()
        if self._source is None:
            env = {"CMROOT_STORE_RETAIN_OVERRIDES": RETAIN_OVERRIDES}
            self._source = self._source_stack.enter_context(
                hooked_lake(self.tmp.mktemp("source"), Source, env))
        return self._source

    def destination(self) -> SharedDestination:
        if self._destination is None:
            self._destination = SharedDestination(self.tmp.mktemp("shared") / "destination")
        return self._destination

    def close_source(self) -> None:
        self._source = None
        self._source_stack.close()

    def close(self) -> None:
        try:
            if self._destination is not None:
                self._destination.close()
        finally:
            self.close_source()


@pytest.fixture(scope="package")
def _repl_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_ReplWorld]:
    world = _ReplWorld(tmp_path_factory)
    try:
        yield world
    finally:
        world.close()


def _uses_world(item: pytest.Item) -> bool:
    """Does the test take this package's source or shared destination (not one of its
    module's own, as review 21's remote source)?"""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    return any(
        getattr(getattr(defs[name][-1].func, "__code__", None), "co_filename", None) == __file__
        for name in ("source", "shared_destination") if defs.get(name)
    )


@pytest.fixture(scope="module", autouse=True)
def _repl_world_released(request: pytest.FixtureRequest, _repl_world: _ReplWorld) -> None:
    """Once no test left to run takes them, the source and shared destination go (an idle
    destination JVM is not kept to the end of the package)."""
    items = request.session.items
    module = request.node.path
    first = next((i for i, it in enumerate(items) if it.path == module), len(items))
    if not any(_uses_world(it) for it in items[first:]):
        _repl_world.close()


@pytest.fixture(scope="module")
def source(_repl_world: _ReplWorld) -> Source:
    pytest.importorskip("pyspark")
    return _repl_world.source()


@pytest.fixture(scope="module")
def shared_destination(_repl_world: _ReplWorld) -> SharedDestination:
    return _repl_world.destination()


@pytest.fixture(scope="module")
def db(request: pytest.FixtureRequest, lake: Any) -> str:
    """The Spark review module's own database (its `DB`), made once in its shared session
    (`lake`, which each Spark review module imports from tests/spark/conftest)."""
    name: str = request.module.DB
    lake.sql(f"CREATE DATABASE IF NOT EXISTS {name}")
    return name

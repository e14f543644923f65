"""Re-use the daemon fixtures of tests/server (make_daemon, daemon); the Spark reviews'
database; for the replication reviews, a hooked source and a shared destination per module,
gone when the module ends (one Spark session per process: each module's source replaces the
last, and a destination kept to the end of the package would hold a JVM idle)."""

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


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    pytest.importorskip("pyspark")
    env = {"CMROOT_STORE_RETAIN_OVERRIDES": RETAIN_OVERRIDES}
    with hooked_lake(tmp_path_factory.mktemp("source"), Source, env) as src:
        yield src


@pytest.fixture(scope="module")
def shared_destination(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDestination]:
    d = SharedDestination(tmp_path_factory.mktemp("shared") / "destination")
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def db(request: pytest.FixtureRequest, lake: Any) -> str:
    """The Spark review module's own database (its `DB`), made once in its shared session
    (`lake`, which each Spark review module imports from tests/spark/conftest)."""
    name: str = request.module.DB
    lake.sql(f"CREATE DATABASE IF NOT EXISTS {name}")
    return name

"""Re-use the daemon fixtures of tests/server (make_daemon, daemon); the Spark reviews'
database."""

from typing import Any

import pytest

from tests.server.conftest import daemon, make_daemon  # noqa: F401


@pytest.fixture(scope="module")
def db(request: pytest.FixtureRequest, lake: Any) -> str:
    """The Spark review module's own database (its `DB`), made once in its shared session
    (`lake`, which each Spark review module imports from tests/spark/conftest)."""
    name: str = request.module.DB
    lake.sql(f"CREATE DATABASE IF NOT EXISTS {name}")
    return name

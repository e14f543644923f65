"""One daemon and one hooked SparkSession per test module (JVM start-up is the slow part;
the py4j JVM itself is reused across modules when its class path already has the shim)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark")

from tests.spark.sparklib import Lake, hooked_lake

__all__ = ["Lake", "lake"]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lake]:
    with hooked_lake(tmp_path_factory.mktemp("lake"), Lake) as lk:
        yield lk

"""One daemon and one hooked SparkSession per test module (JVM start-up is the slow part;
the py4j JVM itself is reused across modules when its class path already has the shim)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from cmroot import spark as cmspark
from tests.spark.sparklib import (
    Daemon,
    fresh_jvm_if_needed,
    release_filesystems,
    spark_builder,
)


@dataclass
class Lake:
    base: Path
    daemon: Daemon
    spark: Any

    @property
    def warehouse(self) -> Path:
        return self.daemon.warehouse

    def sql(self, q: str) -> list[Any]:
        return list(self.spark.sql(q).collect())

    def table_dir(self, table: str, db: str = "default") -> Path:
        return self.warehouse / table if db == "default" else self.warehouse / f"{db}.db" / table


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lake]:
    base = tmp_path_factory.mktemp("lake")
    daemon = Daemon(base).start()
    jar = cmspark.build_jar()
    fresh_jvm_if_needed(jar)
    builder = cmspark.configure(
        spark_builder(base, daemon.warehouse), url=daemon.url, jar=jar
    )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield Lake(base, daemon, spark)
    finally:
        spark.stop()
        release_filesystems()
        daemon.stop()

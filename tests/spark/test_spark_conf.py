"""`cmroot spark-conf` and `cmroot.spark.configure`: the jar is built once and cached, the
lines are exact, and configure() appends to list-valued keys a builder already has."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import zipfile

import pytest

from cmroot import spark as cmspark
from tests.spark.sparklib import REPO

pytest.importorskip("pyspark")


def test_jar_is_cached_and_holds_the_shim() -> None:
    jar = cmspark.build_jar()
    assert cmspark.build_jar() == jar and jar.startswith(str(cmspark.cache_dir()))
    names = set(zipfile.ZipFile(jar).namelist())
    for cls in cmspark.CLASSES.values():
        assert cls.replace(".", "/") + ".class" in names


def test_cli_prints_the_conf_lines() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "spark-conf", "--url", "http://10.0.0.5:9750",
         "--token", "s3cret"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    args = shlex.split(out)
    assert args[::2] == ["--conf"] * (len(args) // 2)
    conf = dict(a.split("=", 1) for a in args[1::2])
    # Another daemon than the config's: its warehouse roots are unknown here, no guess.
    assert "spark.sql.warehouse.dir" not in conf
    assert conf == cmspark.spark_conf("http://10.0.0.5:9750", "s3cret")
    assert conf["spark.cmroot.url"] == "http://10.0.0.5:9750"
    assert conf["spark.cmroot.token"] == "s3cret"
    assert conf["spark.cmroot.failOpen"] == "false"
    assert conf["spark.hadoop.fs.file.impl"] == cmspark.CLASSES["filesystem"]


def test_configure_appends_to_existing_extensions() -> None:
    class Builder:
        def __init__(self) -> None:
            self._options = {"spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension"}

        def config(self, key: str, value: str) -> Builder:
            self._options[key] = value
            return self

    b = cmspark.configure(Builder(), url="http://127.0.0.1:1", fail_open=True)
    assert b._options["spark.sql.extensions"] == (
        "io.delta.sql.DeltaSparkSessionExtension," + cmspark.CLASSES["extensions"])
    assert b._options["spark.cmroot.failOpen"] == "true"


def test_cli_declares_the_metastore_plugin() -> None:
    """`--metastore-plugin`: the application's remote metastore keeps drops; the embedded
    metastore's listeners (the same plugin) stay in the conf for applications without one."""
    out = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "spark-conf", "--url", "http://10.0.0.5:9750",
         "--metastore-plugin", "--format", "defaults"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    conf = dict(line.split(" ", 1) for line in out.splitlines())
    assert conf["spark.cmroot.metastorePlugin"] == "true"
    assert conf["spark.hadoop.hive.metastore.transactional.event.listeners"] == (
        "io.cmroot.metastore.CmrootTransactionalListener")
    assert "spark.cmroot.metastorePlugin" not in cmspark.spark_conf("http://10.0.0.5:9750")

"""The Spark session a `cmroot repl` command runs in: `--with k=v` settings on top of the
environment's (spark-defaults.conf, spark-submit), with the Hive catalog unless told
otherwise. Under spark-submit the session already exists and is reused."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from cmroot.exceptions import BadRequest, ConfigError

OPTION_PREFIX = "cmroot."  # `--with cmroot.url=...`: an option of cmroot, not of Spark


def parse_with(pairs: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """`k=v` items as (Spark conf, cmroot options)."""
    conf, options = {}, {}
    for item in pairs:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise BadRequest("bad --with", f"{item!r}: write key=value")
        k = k.strip()
        if k.startswith(OPTION_PREFIX):
            options[k[len(OPTION_PREFIX) :]] = v
        else:
            conf[k] = v
    return conf, options


def session(app: str, conf: dict[str, str], hook: tuple[str, str | None] | None = None) -> Any:
    """A SparkSession; `hook` = (daemon URL, token) also loads the cmroot shim (a bootstrap
    dump reads table definitions through it)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise ConfigError(
            "pyspark is not installed", "pip install 'cmroot[spark]' (PySpark 4 or later)"
        ) from e
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per py4j call
    # Spark's Python workers run `python3` from PATH unless told: not this interpreter when
    # cmroot was started by absolute path from a virtualenv (cron, systemd), and then they
    # cannot import cmroot. The driver reads only the environment variable, so a
    # `--with spark.pyspark.python=...` is passed on through it too.
    python = conf.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python or sys.executable
    builder = SparkSession.builder.appName(app)
    for k, v in conf.items():
        builder = builder.config(k, v)
    if hook is not None:
        from cmroot import spark as cmspark

        builder = cmspark.configure(builder, hook[0], hook[1])
    if conf.get("spark.sql.catalogImplementation", "hive") == "hive":
        builder = builder.enableHiveSupport()
    return builder.getOrCreate()

"""cmroot for Spark: the conf lines that route every destructive operation of a Spark
application through the cmroot daemon, and record in its event log the other changes
replication replays.

    from cmroot.spark import configure
    spark = configure(SparkSession.builder, url="http://127.0.0.1:9750").getOrCreate()

or, for `spark-submit`, `spark-sql`, `pyspark` or spark-defaults.conf, `cmroot spark-conf`.

The JVM side is a thin shim (`cmroot.jvm`: Java sources compiled on first use and cached).
It tells the daemon what to recycle and what changed; the store logic stays in the daemon.
See the README section "Spark" for what each part hooks.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import Any

from cmroot import jvm
from cmroot.exceptions import ConfigError
from cmroot.metastore import LISTENERS

__all__ = [
    "CLASSES",
    "build_jar",
    "conf_lines",
    "configure",
    "format_conf",
    "spark_conf",
]

PACKAGE = "io.cmroot.spark"
CLASSES = {
    "extensions": f"{PACKAGE}.CmrootExtensions",
    "filesystem": f"{PACKAGE}.CmrootLocalFileSystem",
    "filecontext": f"{PACKAGE}.CmrootLocalFs",
    "commit_protocol": f"{PACKAGE}.CmrootCommitProtocol",
}
DEFAULT_URL = "http://127.0.0.1:9750"
# Keys whose values are lists: configure() appends to what the builder already has.
_LIST_KEYS = {
    "spark.sql.extensions": ",",
    "spark.hadoop.hive.metastore.pre.event.listeners": ",",
    "spark.hadoop.hive.metastore.event.listeners": ",",
    "spark.hadoop.hive.metastore.transactional.event.listeners": ",",
    "spark.hadoop.hive.metastore.end.function.listeners": ",",
    "spark.driver.extraClassPath": os.pathsep,
    "spark.executor.extraClassPath": os.pathsep,
}


def build_jar(force: bool = False) -> str:
    """The Spark hook jar for the installed pyspark: built once, then taken from the cache."""
    return jvm.build_spark_jar(force)


cache_dir = jvm.cache_dir


def spark_conf(
    url: str | None = None,
    token: str | None = None,
    *,
    jar: str | None = None,
    fail_open: bool = False,
    enabled: bool = True,
    warehouse_roots: list[str] | None = None,
    metastore_plugin: bool = False,
    schemes: Mapping[str, str | None] | None = None,
    scheme_jars: tuple[str, ...] = (),
    **extra: Any,
) -> dict[str, str]:
    """The Spark conf that turns the hook on, as {key: value}.

    `schemes`: the other Hadoop file systems the warehouse roots are on, {scheme: its file
    system class, or None for the well-known one (`jvm.SCHEME_CLASSES`)}: each gets a hook
    class built on it (`scheme_jars` hold the classes, if not in pyspark's jars).

    `metastore_plugin`: the application's metastore is remote and runs the cmroot plugin
    (`cmroot metastore-conf`), which then protects drops; without it, drops a remote
    metastore would delete are refused.

    `extra` adds `spark.cmroot.<key>` entries (e.g. `debug=True`); keys containing a dot
    are taken as full Spark keys."""
    jar = jar or build_jar()
    conf = {
        "spark.driver.extraClassPath": jar,
        "spark.executor.extraClassPath": jar,
        "spark.sql.extensions": CLASSES["extensions"],
        "spark.hadoop.fs.file.impl": CLASSES["filesystem"],
        "spark.hadoop.fs.AbstractFileSystem.file.impl": CLASSES["filecontext"],
        "spark.sql.sources.commitProtocolClass": CLASSES["commit_protocol"],
        # The embedded metastore's listeners: the metastore plugin, joined to the statement.
        **{f"spark.hadoop.{k}": v for k, v in LISTENERS.items()},
        "spark.cmroot.url": (url or os.environ.get("CMROOT_URL") or DEFAULT_URL).rstrip("/"),
        "spark.cmroot.enabled": _bool(enabled),
        "spark.cmroot.failOpen": _bool(fail_open),
    }
    for scheme, base in (schemes or {}).items():
        hook = jvm.build_scheme_jar(scheme, base or _scheme_class(scheme), scheme_jars)
        for key in ("spark.driver.extraClassPath", "spark.executor.extraClassPath"):
            conf[key] = os.pathsep.join([conf[key], hook, *scheme_jars])
        conf[f"spark.hadoop.fs.{scheme}.impl"] = jvm.scheme_class_name(scheme)
    if metastore_plugin:
        conf["spark.cmroot.metastorePlugin"] = "true"
    token = token or os.environ.get("CMROOT_TOKEN")
    if token:
        conf["spark.cmroot.token"] = token
    if warehouse_roots:
        conf["spark.cmroot.warehouseRoots"] = ",".join(warehouse_roots)
    for key, value in extra.items():
        full = key if "." in key else f"spark.cmroot.{key}"
        conf[full] = _bool(value) if isinstance(value, bool) else str(value)
    return conf


def _scheme_class(scheme: str) -> str:
    try:
        return jvm.SCHEME_CLASSES[scheme]
    except KeyError:
        raise ConfigError(
            f"no known file system class for the {scheme}:// scheme",
            f"name it: --scheme {scheme}=CLASS (the class fs.{scheme}.impl names)",
        ) from None


def _bool(value: bool) -> str:
    return "true" if value else "false"


def conf_lines(
    url: str | None = None, token: str | None = None, style: str = "submit", **kw: Any
) -> list[str]:
    """The conf as lines: `--conf k=v` for spark-submit / spark-sql / pyspark (`submit`),
    or `k v` for spark-defaults.conf (`defaults`)."""
    return format_conf(spark_conf(url, token, **kw), style)


def format_conf(conf: Mapping[str, str], style: str = "submit") -> list[str]:
    """{key: value} as `--conf k=v` lines (`submit`) or spark-defaults.conf lines."""
    if style == "defaults":
        return [f"{k} {v}" for k, v in conf.items()]
    return [f"--conf {shlex.quote(f'{k}={v}')}" for k, v in conf.items()]


def configure(builder: Any, url: str | None = None, token: str | None = None, **conf: Any) -> Any:
    """Set the cmroot hook on a `SparkSession.builder` and return it (the delta-spark
    convention). List-valued keys (extensions, class paths, metastore listeners) are
    appended to values already set on the builder. `conf`: fail_open, enabled,
    warehouse_roots, jar, or more `spark.cmroot.*` keys.

    Takes effect when the JVM starts: call it before the first SparkSession or
    SparkContext of the Python process."""
    existing: Mapping[str, Any] = getattr(builder, "_options", {}) or {}
    for key, value in spark_conf(url, token, **conf).items():
        sep = _LIST_KEYS.get(key)
        old = existing.get(key)
        if sep and old and value not in str(old).split(sep):
            value = f"{old}{sep}{value}"
        builder = builder.config(key, value)
    return builder

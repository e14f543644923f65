"""cmroot for Spark: the conf lines that route every destructive operation of a Spark
application through the cmroot daemon, and record in its event log the other changes
replication replays.

    from cmroot.spark import configure
    spark = configure(SparkSession.builder, url="http://127.0.0.1:9750").getOrCreate()

or, for `spark-submit`, `spark-sql`, `pyspark` or spark-defaults.conf, `cmroot spark-conf`.

The JVM side is a thin shim (Java source in `cmroot/spark/java/`), compiled on first use
with the JDK's `javac` against the jars of the installed pyspark and cached as a jar under
`~/.cache/cmroot/` (`$CMROOT_SPARK_CACHE` overrides), keyed by a hash of the sources, the
Spark version and the Java version. It tells the daemon what to recycle and what changed;
the store logic stays in the daemon. See the README section "Spark" for what each part hooks.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cmroot.exceptions import ConfigError

__all__ = [
    "CLASSES",
    "build_jar",
    "conf_lines",
    "configure",
    "format_conf",
    "spark_conf",
]

JAVA_SOURCES = Path(__file__).resolve().parent / "java"
PACKAGE = "io.cmroot.spark"
CLASSES = {
    "extensions": f"{PACKAGE}.CmrootExtensions",
    "filesystem": f"{PACKAGE}.CmrootLocalFileSystem",
    "filecontext": f"{PACKAGE}.CmrootLocalFs",
    "commit_protocol": f"{PACKAGE}.CmrootCommitProtocol",
    "metastore_listener": f"{PACKAGE}.CmrootMetastoreListener",
    "metastore_events": f"{PACKAGE}.CmrootMetastoreEvents",
    "metastore_restage": f"{PACKAGE}.CmrootMetastoreRestage",
}
DEFAULT_URL = "http://127.0.0.1:9750"
# Keys whose values are lists: configure() appends to what the builder already has.
_LIST_KEYS = {
    "spark.sql.extensions": ",",
    "spark.hadoop.hive.metastore.pre.event.listeners": ",",
    "spark.hadoop.hive.metastore.event.listeners": ",",
    "spark.hadoop.hive.metastore.transactional.event.listeners": ",",
    "spark.driver.extraClassPath": os.pathsep,
    "spark.executor.extraClassPath": os.pathsep,
}


def _pyspark_home() -> Path:
    try:
        import pyspark
    except ImportError as e:
        raise ConfigError(
            "pyspark is not installed", "pip install 'cmroot[spark]' (PySpark 4 or later)"
        ) from e
    return Path(pyspark.__file__).resolve().parent


def _spark_version() -> str:
    import pyspark

    return str(pyspark.__version__)


def _tool(name: str) -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / name).exists():
        return str(Path(java_home) / "bin" / name)
    found = shutil.which(name)
    if not found:
        raise ConfigError(
            f"`{name}` not found",
            "the cmroot Spark shim is compiled on first use: install a JDK 17 or later "
            "(e.g. apt-get install openjdk-17-jdk-headless) or set JAVA_HOME",
        )
    return found


def _sources() -> list[Path]:
    return sorted(JAVA_SOURCES.rglob("*.java"))


def cache_dir() -> Path:
    base = os.environ.get("CMROOT_SPARK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "cmroot",
    )
    return Path(base)


@functools.lru_cache(maxsize=4)
def _java_version(javac: str) -> str:
    out = subprocess.run([javac, "-version"], capture_output=True, text=True, check=False)
    return (out.stdout + out.stderr).strip()


def build_jar(force: bool = False) -> str:
    """The shim jar for the installed pyspark: built once, then taken from the cache."""
    javac, jar = _tool("javac"), _tool("jar")
    digest = hashlib.sha256()
    for src in _sources():
        digest.update(src.relative_to(JAVA_SOURCES).as_posix().encode() + b"\0")
        digest.update(src.read_bytes())
    digest.update(_spark_version().encode() + b"\0" + _java_version(javac).encode())
    key = digest.hexdigest()[:16]
    out = cache_dir() / f"cmroot-spark-{_spark_version()}-{key}.jar"
    if out.exists() and not force:
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others reuse it
        if out.exists() and not force:
            return str(out)
        with tempfile.TemporaryDirectory(prefix="cmroot-spark-build-") as tmp:
            classes = Path(tmp) / "classes"
            classes.mkdir()
            jars = _pyspark_home() / "jars"
            cmd = [javac, "-nowarn", "-encoding", "UTF-8", "--release", "17"]
            cmd += ["-cp", str(jars / "*"), "-d", str(classes)] + [str(s) for s in _sources()]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise ConfigError(
                    "could not compile the cmroot Spark shim",
                    f"{shlex.join(cmd[:6])} ...: {res.stdout[-2000:]}{res.stderr[-2000:]}",
                )
            part = Path(tmp) / out.name
            res = subprocess.run(
                [jar, "--create", "--file", str(part), "-C", str(classes), "."],
                capture_output=True,
                text=True,
                check=False,
            )
            if res.returncode != 0:
                raise ConfigError("could not package the cmroot Spark shim", res.stderr[-2000:])
            os.replace(part, out)
    return str(out)


def spark_conf(
    url: str | None = None,
    token: str | None = None,
    *,
    jar: str | None = None,
    fail_open: bool = False,
    enabled: bool = True,
    warehouse_roots: list[str] | None = None,
    **extra: Any,
) -> dict[str, str]:
    """The Spark conf that turns the hook on, as {key: value}.

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
        "spark.hadoop.hive.metastore.pre.event.listeners": CLASSES["metastore_listener"],
        "spark.hadoop.hive.metastore.event.listeners": CLASSES["metastore_events"],
        "spark.hadoop.hive.metastore.transactional.event.listeners": CLASSES[
            "metastore_restage"],
        "spark.cmroot.url": (url or os.environ.get("CMROOT_URL") or DEFAULT_URL).rstrip("/"),
        "spark.cmroot.enabled": _bool(enabled),
        "spark.cmroot.failOpen": _bool(fail_open),
    }
    token = token or os.environ.get("CMROOT_TOKEN")
    if token:
        conf["spark.cmroot.token"] = token
    if warehouse_roots:
        conf["spark.cmroot.warehouseRoots"] = ",".join(warehouse_roots)
    for key, value in extra.items():
        full = key if "." in key else f"spark.cmroot.{key}"
        conf[full] = _bool(value) if isinstance(value, bool) else str(value)
    return conf


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

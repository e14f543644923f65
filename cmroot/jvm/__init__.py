"""The JVM side of cmroot, built from the Java sources in `cmroot/jvm/java/` on first use with
the JDK's `javac` against the jars of the installed pyspark, and cached under
`~/.cache/cmroot/` (`$CMROOT_SPARK_CACHE` overrides), keyed by a hash of the sources and the
compiler (and the Spark version, for the Spark jar):

- `io.cmroot.core`: settings, path rules, the daemon's HTTP client, the two-phase recycle.
- `io.cmroot.metastore`: the Hive metastore plugin (listeners). With the core it makes the
  metastore jar: Java 8 bytecode, no Spark classes, so a Hive 2.3/3.x metastore loads it.
- `io.cmroot.spark`: the Spark hook (extensions, commit protocol, filesystem). The Spark jar
  holds all three packages: one jar on a Spark application's class path.
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
from collections.abc import Callable
from pathlib import Path

from cmroot.exceptions import ConfigError

__all__ = [
    "SCHEME_CLASSES",
    "build_metastore_jar",
    "build_scheme_jar",
    "build_spark_jar",
    "cache_dir",
    "pyspark_home",
    "scheme_class_name",
]

JAVA_SOURCES = Path(__file__).resolve().parent / "java"
_PLUGIN = ("io/cmroot/core", "io/cmroot/metastore")  # the metastore jar's packages
_SPARK = ("io/cmroot/spark",)
SCHEME_TEMPLATE = Path(__file__).resolve().parent / "template" / "SchemeFileSystem.java.in"
# The file system class each well-known scheme's hook extends (`--scheme NAME` alone).
SCHEME_CLASSES = {
    "hdfs": "org.apache.hadoop.hdfs.DistributedFileSystem",
    "viewfs": "org.apache.hadoop.fs.viewfs.ViewFileSystem",
    "s3a": "org.apache.hadoop.fs.s3a.S3AFileSystem",
    "abfs": "org.apache.hadoop.fs.azurebfs.AzureBlobFileSystem",
    "abfss": "org.apache.hadoop.fs.azurebfs.SecureAzureBlobFileSystem",
    "gs": "com.google.cloud.hadoop.fs.gcs.GoogleHadoopFileSystem",
}


def pyspark_home() -> Path:
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
            "the cmroot JVM hooks are compiled on first use: install a JDK 17 or later "
            "(e.g. apt-get install openjdk-17-jdk-headless) or set JAVA_HOME",
        )
    return found


def _sources(packages: tuple[str, ...]) -> list[Path]:
    return sorted(s for p in packages for s in (JAVA_SOURCES / p).rglob("*.java"))


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


def _key(sources: list[Path], *extra: str) -> str:
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.relative_to(JAVA_SOURCES).as_posix().encode() + b"\0")
        digest.update(src.read_bytes())
    for e in extra:
        digest.update(e.encode() + b"\0")
    return digest.hexdigest()[:16]


def _run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise ConfigError(
            f"could not {what}",
            f"{shlex.join(cmd[:6])} ...: {res.stdout[-2000:]}{res.stderr[-2000:]}",
        )


def _compile(sources: list[Path], release: str, classpath: list[str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [_tool("javac"), "-nowarn", "-encoding", "UTF-8", "--release", release]
    cmd += ["-cp", os.pathsep.join(classpath), "-d", str(into)] + [str(s) for s in sources]
    _run(cmd, "compile the cmroot JVM hooks")


def _cached(name: str, force: bool, build: Callable[[Path, Path], None]) -> str:
    """The jar `name` in the cache; built by `build(tmp, jar)` when missing (or `force`),
    one build at a time across processes."""
    out = cache_dir() / name
    if out.exists() and not force:
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others reuse it
        if out.exists() and not force:
            return str(out)
        with tempfile.TemporaryDirectory(prefix="cmroot-jvm-build-") as tmp:
            part = Path(tmp) / name
            build(Path(tmp), part)
            os.replace(part, out)
    return str(out)


def _jar(part: Path, *class_dirs: Path) -> None:
    cmd = [_tool("jar"), "--create", "--file", str(part)]
    for d in class_dirs:
        cmd += ["-C", str(d), "."]
    _run(cmd, "package the cmroot JVM hooks")


def build_metastore_jar(force: bool = False) -> str:
    """The metastore plugin jar (core and listeners, Java 8 bytecode): built once, then
    taken from the cache. Compiled against the Hive 2.3 metastore API in pyspark's jars."""
    sources = _sources(_PLUGIN)
    key = _key(sources, _java_version(_tool("javac")))
    jars = str(pyspark_home() / "jars" / "*")

    def build(tmp: Path, part: Path) -> None:
        _compile(sources, "8", [jars], tmp / "classes")
        _jar(part, tmp / "classes")

    return _cached(f"cmroot-metastore-{key}.jar", force, build)


def build_spark_jar(force: bool = False) -> str:
    """The Spark hook jar for the installed pyspark (it holds the metastore plugin too):
    built once, then taken from the cache."""
    plugin = _sources(_PLUGIN)
    sources = _sources(_SPARK)
    key = _key(plugin + sources, _spark_version(), _java_version(_tool("javac")))
    jars = str(pyspark_home() / "jars" / "*")

    def build(tmp: Path, part: Path) -> None:
        _compile(plugin, "8", [jars], tmp / "plugin")
        _compile(sources, "17", [str(tmp / "plugin"), jars], tmp / "spark")
        _jar(part, tmp / "plugin", tmp / "spark")

    return _cached(f"cmroot-spark-{_spark_version()}-{key}.jar", force, build)


def scheme_class_name(scheme: str) -> str:
    """The hook class of `scheme` (`disk` -> io.cmroot.spark.schemes.CmrootDiskFileSystem)."""
    word = "".join(c for c in scheme.title() if c.isalnum())
    return f"io.cmroot.spark.schemes.Cmroot{word}FileSystem"


def build_scheme_jar(
    scheme: str, base: str, classpath: tuple[str, ...] = (), force: bool = False
) -> str:
    """The hook of the file system scheme `scheme`: a subclass of `base` (its file system
    class, found in pyspark's jars or `classpath`) routing deletes, replacing creates and
    renames through cmroot. Built once per (scheme, class, Spark jar), then cached."""
    spark_jar = build_spark_jar()
    name = scheme_class_name(scheme)
    simple = name.rsplit(".", 1)[1]
    source = (
        SCHEME_TEMPLATE.read_text(encoding="utf-8")
        .replace("@SCHEME@", scheme)
        .replace("@BASE@", base)
        .replace("@CLASS@", simple)
    )
    key = hashlib.sha256(
        "\0".join([source, spark_jar, *classpath]).encode()
    ).hexdigest()[:16]
    jars = [spark_jar, str(pyspark_home() / "jars" / "*"), *classpath]

    def build(tmp: Path, part: Path) -> None:
        src = tmp / "src" / f"{simple}.java"
        src.parent.mkdir(parents=True)
        src.write_text(source, encoding="utf-8")
        try:
            _compile([src], "17", jars, tmp / "classes")
        except ConfigError as e:
            said = " ".join(e.detail.split(": ", 1)[-1].split())[:500]
            raise ConfigError(
                f"cannot build cmroot's hook for the {scheme}:// scheme on {base} ({said})",
                f"put the jar holding {base} on the class path with --scheme-jar, or name the "
                f"scheme's file system class as --scheme {scheme}=CLASS",
            ) from e
        _jar(part, tmp / "classes")

    return _cached(f"cmroot-scheme-{scheme}-{key}.jar", force, build)

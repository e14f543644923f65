"""Helpers for the Spark hook tests and benchmark: a real daemon on loopback (a `cmroot
serve` subprocess), a PySpark builder with Hive support and an embedded Derby metastore in a
temporary directory, and checks that recycled files come back byte for byte."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cmroot import checksum as cks
from cmroot.client import Client

REPO = Path(__file__).resolve().parents[2]
SPARK_TEMP = (".spark-staging-", ".hive-staging", "_temporary")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """`cmroot serve` on loopback over <base>/cmroot, with <base>/warehouse as its root."""

    def __init__(
        self, base: Path, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.base = base
        self.extra_env = env or {}
        self.warehouse = base / "warehouse"
        self.store = base / "cmroot"
        self.warehouse.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = Client(self.url, timeout=120)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CMROOT_")}
        env.update(
            CMROOT_STORE_ROOT=str(self.store),
            CMROOT_STORE_WAREHOUSE_ROOTS=str(self.warehouse),
            CMROOT_SERVER_PORT=str(self.port),
            CMROOT_SERVER_HOST="127.0.0.1",
            CMROOT_STORE_RETAIN="24h",
            CMROOT_CONFIG="",
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        env.update(self.extra_env)
        return env

    def start(self) -> Daemon:
        log = open(self.base / "daemon.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cmroot.cli", "serve"],
            env=self.env(),
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cmroot serve exited: {(self.base / 'daemon.log').read_text()}")
            if self.client.healthy():
                return self
            time.sleep(0.1)
        raise RuntimeError("cmroot serve did not become ready")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self.client.close()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The daemon stopped for the duration, then started again on the same port."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def events_after(self, event_id: int) -> list[dict[str, Any]]:
        return [e for e in self.client.events(event_id + 1, 1000) if e["id"] > event_id]

    def current(self) -> int:
        return self.client.current_event()


@dataclass
class Lake:
    """A warehouse with a running daemon and a hooked Spark session over it."""

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


L = TypeVar("L", bound=Lake)


@contextlib.contextmanager
def hooked_lake(
    base: Path, cls: type[L], daemon_env: dict[str, str] | None = None,
    extra: Callable[[Daemon], Mapping[str, str]] | None = None,
) -> Iterator[L]:
    """A daemon over <base>/warehouse and a local[2] session with the cmroot hook; `extra`
    gives more Spark conf once the daemon runs (a remote metastore's, say)."""
    from cmroot import spark as cmspark

    daemon = Daemon(base, env=daemon_env).start()
    jar = cmspark.build_jar()
    fresh_jvm_if_needed(jar)
    builder = spark_builder(base, daemon.warehouse)
    for k, v in (extra(daemon) if extra else {}).items():
        builder = builder.config(k, v)
    spark = cmspark.configure(builder, url=daemon.url, jar=jar).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield cls(base, daemon, spark)
    finally:
        # A later lake in this process (one JVM, one SparkContext) may have stopped this
        # one's session already (tests/repl/test_two_clusters.py, after the package's
        # shared source): then there is nothing left to stop.
        with contextlib.suppress(Exception):
            spark.stop()
            release_filesystems()
            if extra is not None:
                # Hive's client state outlives the session in this JVM (a remote metastore's
                # URIs, say): the next application gets a JVM of its own.
                fresh_jvm_if_needed(None)
        daemon.stop()


@contextlib.contextmanager
def app_conf(spark: Any, key: str, value: str) -> Iterator[None]:
    """`key` set in the application's static conf (the SparkConf its SparkEnv shares) for the
    duration: what an administrator sets at launch. The cmroot settings are read from there
    only; a session cannot change them (`SET` and `spark.conf.set` are refused)."""
    conf = spark.sparkContext._jsc.sc().conf()  # the SparkConf its SparkEnv holds
    old = conf.getOption(key)
    conf.set(key, value)
    try:
        yield
    finally:
        if old.isDefined():
            conf.set(key, old.get())
        else:
            conf.remove(key)


@contextlib.contextmanager
def shim_log(spark: Any) -> Iterator[Any]:
    """What the JVM shim logs (logger io.cmroot) for the duration, as a callable
    returning the text so far: the JVM writes to its own stderr, which pytest's capfd does
    not see."""
    jvm = spark.sparkContext._jvm
    log4j = jvm.org.apache.logging.log4j
    writer = jvm.java.io.StringWriter()
    appender = log4j.core.appender.WriterAppender.createAppender(
        log4j.core.layout.PatternLayout.createDefaultLayout(), None, writer, "cmroot-test",
        False, True)
    appender.start()
    logger = log4j.LogManager.getContext(False).getLogger("io.cmroot")
    logger.addAppender(appender)
    try:
        yield lambda: str(writer.toString())
    finally:
        logger.removeAppender(appender)
        appender.stop()


# JVM options for a driver that lives for one command (a destination's `cmroot repl`, a
# plan of tests/repl/destination.py): its time goes to starting up, and on 2 cores the C2
# compiler and a parallel collector cost more CPU there than they win back. Semantics are
# the JVM's either way.
SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_settings(
    base: Path, warehouse: Path, short_lived: bool = False, archived: bool | None = None
) -> dict[str, str]:
    """local[2], an embedded Derby metastore and scratch dirs under `base`: as Spark conf,
    for a builder here or `--with` options of a `cmroot repl` subprocess; `short_lived`
    adds SHORT_LIVED_JVM to the driver's JVM options, `archived` (by default: when
    short-lived) the class-data archive of tests/spark/jvm_archive.py, for a driver
    started in a process of its own without the shim on its class path."""
    derby = base / "derby"
    derby.mkdir(parents=True, exist_ok=True)
    java = f"-Dderby.system.home={derby}" + (f" {SHORT_LIVED_JVM}" if short_lived else "")
    if short_lived if archived is None else archived:
        from tests.spark import jvm_archive

        java = f"{java} {jvm_archive.options()}".rstrip()
    return {
        "spark.master": "local[2]",
        "spark.sql.warehouse.dir": str(warehouse),
        "spark.hadoop.javax.jdo.option.ConnectionURL":
            f"jdbc:derby:;databaseName={base}/metastore_db;create=true",
        "spark.driver.extraJavaOptions": java,
        "spark.hadoop.hive.exec.scratchdir": str(base / "hive-scratch"),
        "spark.local.dir": str(base / "spark-local"),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.default.parallelism": "2",
        "spark.sql.adaptive.enabled": "false",
        "spark.driver.memory": "1g",
        "spark.hadoop.hive.exec.dynamic.partition.mode": "nonstrict",
    }


def spark_builder(base: Path, warehouse: Path, app: str = "cmroot-test") -> Any:
    """A builder with `spark_settings` and Hive support."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app)
    for k, v in spark_settings(base, warehouse).items():
        builder = builder.config(k, v)
    return builder.enableHiveSupport()


def fresh_jvm_if_needed(jar: str | None) -> None:
    """Stop any session; restart the py4j JVM when it was launched without `jar` on its
    class path (class paths are fixed when the JVM starts)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()
    gw = SparkContext._gateway
    if gw is None:
        return
    classpath = gw.jvm.java.lang.System.getProperty("java.class.path") or ""
    if jar is None or jar not in classpath.split(os.pathsep):
        gw.shutdown()
        SparkContext._gateway = None
        SparkContext._jvm = None


def release_filesystems() -> None:
    """Forget cached Hadoop file systems, so the next application builds its own."""
    from pyspark import SparkContext

    if SparkContext._jvm is not None:
        with contextlib.suppress(Exception):
            SparkContext._jvm.org.apache.hadoop.fs.FileSystem.closeAll()


def data_files(root: Path) -> dict[str, bytes]:
    """Every regular file under `root` (Spark's temp/staging excluded), with its bytes."""
    out: dict[str, bytes] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(SPARK_TEMP)]
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[p] = fh.read()
    return out


def parquet_files(files: Iterable[str]) -> list[str]:
    return [p for p in files if p.endswith(".parquet") or "/part-" in p]


def assert_retrievable(client: Client, files: dict[str, bytes]) -> None:
    """Each (path, checksum) resolves to the cmroot and its bytes come back identical."""
    assert files, "nothing to check"
    pairs = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    res = client.resolve(pairs)["files"]
    wrong = [r for r in res if r["status"] != "cmroot"]
    assert not wrong, f"not in the cmroot: {wrong[:3]}"
    import io

    for p, b in files.items():
        buf = io.BytesIO()
        client.get(p, cks.of_bytes(b), buf)
        assert buf.getvalue() == b, f"bytes differ for {p}"


def recycled_paths(events: list[dict[str, Any]]) -> set[str]:
    return {f["path"] for e in events for f in (e.get("files") or [])}


def rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)

"""Start a real standalone Hive 2.3 metastore (the one inside the pyspark wheel) for tests.

Why: the metastore-side behaviour we care about (what a drop_table / drop_partitions call does
to the warehouse files, and what a metastore plugin on the classpath sees) can only be checked
against the real ``org.apache.hadoop.hive.metastore.HiveMetaStore`` Thrift server, not against
Spark's in-process embedded catalog. The pyspark wheel already ships every jar it needs
(hive-metastore 2.3, DataNucleus, Derby, Hadoop client), so no extra download is required.

The server runs as a subprocess in its own process group, on a free loopback port, with an
embedded Derby database and all state (database, logs, scratch and tmp dirs) under ``base``.
Start-up takes roughly 20-30 s on a 2-core machine (the schema is created by DataNucleus).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from xml.sax.saxutils import escape

MAIN_CLASS = "org.apache.hadoop.hive.metastore.HiveMetaStore"
POLL_INTERVAL = 0.2
# logged by HiveMetaStore right after its server socket is bound
READY_MARKER = "Started the new metaserver on port ["
BIND_ATTEMPTS = 3

# Hadoop / DataNucleus reflect into JDK internals; Spark passes the same flags to its own JVMs.
JAVA17_OPENS = [
    "-XX:+IgnoreUnrecognizedVMOptions",
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.invoke=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/java.net=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/java.util=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.cs=ALL-UNNAMED",
    "--add-opens=java.base/sun.security.action=ALL-UNNAMED",
    "--add-opens=java.base/sun.util.calendar=ALL-UNNAMED",
]

# Console-only logging (the hive-log4j2.properties inside hive-common writes to
# ${java.io.tmpdir}/${user.name}/hive.log instead); ours comes first on the classpath.
LOG4J2_PROPERTIES = """\
status = WARN
name = CmrootTestMetastore
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{ISO8601} %5p [%t] %c{2}: %m%n
logger.DataNucleus.name = DataNucleus
logger.DataNucleus.level = ERROR
logger.Datastore.name = Datastore
logger.Datastore.level = ERROR
rootLogger.level = INFO
rootLogger.appenderRef.console.ref = console
"""


def pyspark_home() -> Path:
    """The installed pyspark package directory (its ``jars/`` holds the Hive 2.3 jars)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def java_executable() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise RuntimeError("no java: set JAVA_HOME or put java on PATH")
    return found


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    # the STARTUP_MSG classpath line alone is ~20 kB: cut long lines
    return "\n".join(line[:400] for line in text.splitlines()[-lines:])


def hive_site_xml(properties: dict[str, str]) -> str:
    body = "".join(
        f"  <property>\n    <name>{escape(k)}</name>\n    <value>{escape(v)}</value>\n"
        "  </property>\n"
        for k, v in properties.items()
    )
    return f'<?xml version="1.0"?>\n<configuration>\n{body}</configuration>\n'


class MetastoreStartError(RuntimeError):
    pass


@dataclass
class Metastore:
    """A running (or stopped) metastore subprocess; ``uri`` stays the same across restart()."""

    uri: str
    port: int
    base: Path
    warehouse: Path
    log: Path
    command: list[str]
    env: dict[str, str]
    timeout: float = 120.0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    startup_seconds: float = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    def _ready(self, log_from: int) -> bool:
        """Our JVM logged that it bound the port (so a foreign listener on a reused port
        does not count) and the port accepts connections."""
        try:
            with open(self.log, "rb") as f:
                f.seek(log_from)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return f"{READY_MARKER}{self.port}]" in text and port_open(self.port)

    def _launch(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(self.log, "ab") as out:
            out.write(f"\n==== starting metastore on port {self.port} ====\n".encode())
            out.flush()
            log_from = out.tell()
            self.process = subprocess.Popen(
                [*self.command, "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.base,
                env=self.env,
                start_new_session=True,  # own process group: stop()/kill() reach the whole JVM
            )
        deadline = began + self.timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise MetastoreStartError(
                    f"metastore exited with {code} before listening on {self.port}; "
                    f"log {self.log}:\n{log_tail(self.log)}"
                )
            if self._ready(log_from):
                break
            if time.monotonic() > deadline:
                self.kill()
                raise MetastoreStartError(
                    f"metastore not listening on {self.port} after {self.timeout:.0f}s; "
                    f"log {self.log}:\n{log_tail(self.log)}"
                )
            time.sleep(POLL_INTERVAL)
        self.startup_seconds = time.monotonic() - began

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it if it has not exited after ``grace`` s."""
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait(timeout=30)
        self._wait_port_closed()

    def kill(self) -> None:
        """SIGKILL the process group (a crash: no shutdown hooks run)."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self._wait_port_closed()

    def restart(self) -> None:
        """Stop (if running) and start again on the same port with the same Derby database."""
        self.stop()
        self._launch()

    def _wait_port_closed(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)

    def __enter__(self) -> Metastore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_metastore(
    base: Path,
    warehouse: Path,
    properties: dict[str, str],
    classpath: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> Metastore:
    """Write ``base/conf/hive-site.xml`` and start a metastore; return once its port accepts.

    ``properties`` are extra hive-site entries (e.g. ``hive.metastore.event.listeners``) and
    ``classpath`` extra jars/dirs appended after the pyspark jars. ``env`` entries are added
    to the current environment of the subprocess.
    """
    base = Path(base).resolve()
    warehouse = Path(warehouse).resolve()
    conf_dir = base / "conf"
    tmp_dir = base / "tmp"
    for d in (conf_dir, tmp_dir, warehouse):
        d.mkdir(parents=True, exist_ok=True)

    site = {
        "javax.jdo.option.ConnectionURL": (
            f"jdbc:derby:;databaseName={base / 'metastore_db'};create=true"
        ),
        "javax.jdo.option.ConnectionDriverName": "org.apache.derby.jdbc.EmbeddedDriver",
        "datanucleus.schema.autoCreateAll": "true",
        "hive.metastore.schema.verification": "false",
        "hive.metastore.warehouse.dir": str(warehouse),
        "hive.async.log.enabled": "false",
        # The wheel has no BoneCP (Hive's default pool): the ACID listener's transaction
        # store, opened on DROP DATABASE, takes commons-dbcp instead.
        "datanucleus.connectionPoolingType": "dbcp",
        # keep every scratch path under base, so root and normal-user runs never share /tmp/hive
        "hive.exec.scratchdir": str(tmp_dir / "scratch"),
        "hive.exec.local.scratchdir": str(tmp_dir / "local-scratch"),
        "hive.downloaded.resources.dir": str(tmp_dir / "resources"),
        "hive.querylog.location": str(tmp_dir / "querylog"),
        **properties,
    }
    (conf_dir / "hive-site.xml").write_text(hive_site_xml(site))
    (conf_dir / "hive-log4j2.properties").write_text(LOG4J2_PROPERTIES)

    cp = os.pathsep.join([str(conf_dir), str(pyspark_home() / "jars" / "*"), *classpath])
    command = [
        java_executable(),
        "-Xmx512m",
        "-XX:+UseSerialGC",
        "-XX:-UsePerfData",  # no /tmp/hsperfdata_<user>
        *JAVA17_OPENS,
        f"-Dderby.system.home={base}",
        f"-Djava.io.tmpdir={tmp_dir}",
        f"-Dhive.log.dir={base}",
        f"-Dlog4j2.configurationFile={conf_dir / 'hive-log4j2.properties'}",
        "-cp",
        cp,
        MAIN_CLASS,
    ]
    full_env = dict(os.environ)
    full_env.pop("HADOOP_CONF_DIR", None)
    full_env.pop("HIVE_CONF_DIR", None)
    if env:
        full_env.update(env)
    for attempt in range(BIND_ATTEMPTS):
        port = free_port()
        ms = Metastore(
            uri=f"thrift://127.0.0.1:{port}",
            port=port,
            base=base,
            warehouse=warehouse,
            log=base / "metastore.log",
            command=command,
            env=full_env,
            timeout=timeout,
        )
        try:
            ms._launch()
        except MetastoreStartError as e:
            # another process took the port between free_port() and the JVM's bind
            if attempt + 1 < BIND_ATTEMPTS and "Address already in use" in str(e):
                continue
            raise
        return ms
    raise AssertionError("unreachable")


def spark_remote_conf(uri: str, warehouse: Path | None = None) -> dict[str, str]:
    """Spark settings that make a local[1] SparkSession use the metastore at ``uri``.

    With ``hive.metastore.uris`` set, Spark's built-in Hive 2.3 client talks Thrift to it and
    never opens an embedded Derby. The Hive client is created once per SparkContext, so stop
    the SparkSession/SparkContext before pointing a new one at another metastore.
    """
    conf = {
        "spark.sql.catalogImplementation": "hive",
        "spark.hadoop.hive.metastore.uris": uri,
        "spark.sql.hive.metastore.version": "2.3.10",
        "spark.sql.hive.metastore.jars": "builtin",
        # fail fast instead of retrying for minutes when the metastore is down
        "spark.hadoop.hive.metastore.failure.retries": "1",
        "spark.hadoop.hive.metastore.connect.retries": "3",
        "spark.hadoop.hive.metastore.client.connect.retry.delay": "1s",
        "spark.hadoop.hive.metastore.client.socket.timeout": "60s",
        # Spark only checks the server answers, not the schema
        "spark.hadoop.hive.metastore.schema.verification": "false",
    }
    if warehouse is not None:
        conf["spark.sql.warehouse.dir"] = Path(warehouse).resolve().as_uri()
    return conf

"""Class-data sharing (CDS) for the Spark drivers the tests start in processes of their own
(a destination's plans, `cmroot repl ...`): a JDK archive of the classes such a driver
loads, mapped at start-up instead of reading, parsing and verifying them from the jars
again. On 2 cores a destination process spends about half its life loading classes; with
the archive a plan that creates a session, a table and queries it takes ~9 s, not ~16 s.

Semantics are the JVM's either way: the archive holds the same classes from the same jars,
and the JVM checks the jars it was made from (paths, sizes, times) and ignores an archive
that does not match. The archive is made once per Java and pyspark installation (a
throw-away driver run with -XX:ArchiveClassesAtExit), under the system temp directory, by
whichever process needs it first (a lock file keeps that to one); tests run without it
when it cannot be made. CMROOT_TEST_NO_CDS=1 turns it off.

    python -m tests.spark.jvm_archive ARCHIVE   (makes ARCHIVE; what `archive()` runs)"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OFF = "CMROOT_TEST_NO_CDS"
WORKLOAD = 1  # bump when `_workload` changes: a new archive is made
# Silent when the archive cannot be used (another class path, say): tests read stderr.
USE = "-XX:SharedArchiveFile={} -Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
TIMEOUT = 300
RETRY = 3600  # seconds before a failed attempt is made again


def options() -> str:
    """JVM options that map the archive (made first if need be), or "" without one."""
    path = archive()
    return USE.format(path) if path is not None else ""


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


def _path() -> Path | None:
    """Where the archive for this Java and this pyspark lives (None: no Java, no pyspark)."""
    try:
        import pyspark
    except ImportError:
        return None
    java = _java()
    if java is None:
        return None
    real = os.path.realpath(java)
    home = Path(pyspark.__file__).resolve().parent
    jars = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                  for p in (home / "jars").glob("*.jar"))
    from tests.spark.sparklib import SHORT_LIVED_JVM

    key = json.dumps([WORKLOAD, pyspark.__version__, str(home), jars, real,
                      os.stat(real).st_mtime_ns, SHORT_LIVED_JVM])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"cmroot-tests-{os.getuid()}" / f"spark-{digest}.jsa"


def archive() -> Path | None:
    """The archive, made now if it is not there yet (None: off, or it could not be made)."""
    if os.environ.get(OFF):
        return None
    path = _path()
    if path is None:
        return None
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    failed = path.with_suffix(".failed")
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker; the others wait and take its archive
        if path.exists():
            return path
        if failed.exists() and time.time() - failed.stat().st_mtime < RETRY:
            return None  # it failed a moment ago: every driver after it would pay again
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CMROOT_")}
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        try:
            res = subprocess.run([sys.executable, "-m", "tests.spark.jvm_archive", str(tmp)],
                                 capture_output=True, text=True, env=env, cwd=path.parent,
                                 timeout=TIMEOUT)
            ok = res.returncode == 0 and tmp.exists()
        except subprocess.TimeoutExpired:
            ok = False
            res = None
        if ok:
            os.replace(tmp, path)
            return path
        with contextlib.suppress(OSError):
            tmp.unlink()
        failed.write_text(res.stderr[-5000:] if res is not None else "timed out")
        return None


def _workload(spark: object, base: Path) -> None:
    """What a destination's driver does: a catalog, tables and partitions, inserts and
    queries, a Python job."""
    sql = spark.sql  # type: ignore[attr-defined]
    own = base / "elsewhere"
    for q in [
        "CREATE DATABASE w",
        "CREATE TABLE w.t (a INT, p INT) USING parquet PARTITIONED BY (p)",
        "INSERT INTO w.t VALUES (1, 1), (2, 2)",
        f"ALTER TABLE w.t ADD PARTITION (p=3) LOCATION '{own}'",
        "ALTER TABLE w.t DROP PARTITION (p=2)",
        "CREATE TABLE w.h (a INT) STORED AS PARQUET",
        "INSERT INTO w.h SELECT a FROM w.t",
        "INSERT OVERWRITE TABLE w.h SELECT 5",
        "ALTER TABLE w.h RENAME TO w.h2",
        "ALTER DATABASE w SET DBPROPERTIES ('k' = 'v')",
        "SHOW PARTITIONS w.t",
        "SHOW TABLES IN w",
        "DESCRIBE DATABASE EXTENDED w",
        "DESCRIBE TABLE EXTENDED w.t",
        "SELECT count(*), sum(a) FROM w.t",
        "SELECT * FROM w.h2",
        "DROP TABLE w.h2",
        "DROP DATABASE w CASCADE",
    ]:
        sql(q).collect()
    sc = spark.sparkContext  # type: ignore[attr-defined]
    sc.parallelize(range(4), 2).mapPartitions(lambda it: [sum(it)]).collect()


def _make(target: Path) -> int:
    from pyspark import SparkContext

    from cmroot.repl.session import session
    from tests.spark.sparklib import spark_settings

    with tempfile.TemporaryDirectory(prefix="cmroot-cds-") as d:
        base = Path(d)
        conf = spark_settings(base, base / "warehouse", short_lived=True, archived=False)
        conf["spark.driver.extraJavaOptions"] += f" -XX:ArchiveClassesAtExit={target}"
        spark = session("cmroot-cds", conf)
        spark.sparkContext.setLogLevel("ERROR")
        _workload(spark, base)
        spark.stop()
        gateway = SparkContext._gateway
        assert gateway is not None
        proc = gateway.proc  # the JVM writes the archive as it exits: wait for it
        gateway.shutdown()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(TIMEOUT)
    return 0 if target.exists() else 1


if __name__ == "__main__":
    sys.exit(_make(Path(sys.argv[1])))

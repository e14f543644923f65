"""A hooked source (a real daemon on loopback and a PySpark local[2] session with the
cmroot hook and its own Derby metastore, in this process) and destinations (each a
warehouse and metastore of its own, driven in a subprocess: one JVM holds one metastore)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from cmroot.repl import dump
from cmroot.repl.dumpdir import Header
from tests.spark.sparklib import REPO, Lake, hooked_lake, spark_settings

# Tables of the `expiring` database keep their recycled files for one second only.
RETAIN_OVERRIDES = "expiring.*=1s"


def files_below(top: Path) -> list[str]:
    """The data files below `top` (hidden names left out), relative to it, sorted."""
    return sorted(os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top)
                  for f in fs if not f.startswith((".", "_")))


def load_ok(step: dict[str, Any]) -> None:
    """A destination step's load went through."""
    assert "error" not in step["load"], step["load"]


class Source(Lake):
    """The hooked source lake, with what the replication tests ask of it."""

    def rows(self, q: str) -> list[list[Any]]:
        return sorted(list(r) for r in self.sql(q))

    def partitions(self, table: str) -> list[str]:
        return sorted(r[0] for r in self.sql(f"SHOW PARTITIONS {table}"))

    def data_files(self, db: str, table: str) -> list[str]:
        """Data file paths relative to the table directory (hidden names left out)."""
        root = self.table_dir(table, db)
        return sorted(
            os.path.relpath(os.path.join(d, f), root)
            for d, subdirs, fs in os.walk(root)
            for f in fs
            if not f.startswith((".", "_")) and "/." not in d[len(str(root)):]
        )

    def rename_across(self, db: str, table: str, new_db: str) -> None:
        """ALTER TABLE db.table RENAME TO new_db.table, as another engine sends it: through
        the metastore client of this session (Spark itself refuses a rename across
        databases), so the hook records it as it would any engine's."""
        jvm = self.spark.sparkContext._jvm
        client = self.spark._jsparkSession.sharedState().externalCatalog().unwrapped().client()
        moved = client.getRawHiveTable(db, table).rawTable().getTTable().deepCopy()
        moved.setDbName(new_db)
        jvm.org.apache.hadoop.hive.ql.metadata.Hive.get(client.conf()).getMSC().alter_table(
            db, table, moved
        )
        self.spark.catalog.clearCache()

    def dump(self, scope: str, from_id: int | None = None, **kw: Any) -> tuple[str, Header]:
        db, _, table = scope.partition(".")
        return dump(self.daemon.client, db, table or None, str(self.base / "dumps"), from_id,
                    spark=self.spark, **kw)


@pytest.fixture(scope="package")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    pytest.importorskip("pyspark")
    env = {"CMROOT_STORE_RETAIN_OVERRIDES": RETAIN_OVERRIDES}
    with hooked_lake(tmp_path_factory.mktemp("source"), Source, env) as src:
        yield src


class Destination:
    """A warehouse and metastore under `base`, loaded and queried from subprocesses."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.warehouse = base / "warehouse"
        self.plans = 0
        base.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get(
            "PYTHONPATH", "")}

    def run(self, *steps: dict[str, Any], faults: str | None = None) -> list[dict[str, Any]]:
        """Run the steps (see tests/repl/destination.py) in one destination process. With
        `faults` (CMROOT_FAULTS), the process must die at that fault point: nothing is
        returned."""
        self.plans += 1
        plan = self.base / f"plan-{self.plans}.json"
        plan.write_text(json.dumps({"base": str(self.base), "steps": list(steps)}))
        env = self.env() | ({"CMROOT_FAULTS": faults} if faults else {})
        res = subprocess.run(
            [sys.executable, "-m", "tests.repl.destination", str(plan)],
            capture_output=True, text=True, env=env, cwd=self.base, timeout=600,
        )
        if faults:
            assert res.returncode == -signal.SIGKILL, res.stderr[-5000:]
            return []
        assert res.returncode == 0, res.stderr[-5000:]
        answers: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
        return answers

    def with_args(self) -> list[str]:
        out = []
        for k, v in spark_settings(self.base, self.warehouse, short_lived=True).items():
            out += ["--with", f"{k}={v}"]
        return out

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`cmroot repl ...` against this destination, as cron or systemd runs it: the
        virtualenv's `cmroot` by absolute path, the virtualenv not on PATH (Spark's Python
        workers must still import cmroot)."""
        venv_bin = os.path.dirname(sys.executable)
        path = [d for d in os.environ.get("PATH", "").split(os.pathsep)
                if d and os.path.realpath(d) != os.path.realpath(venv_bin)]
        env = {k: v for k, v in self.env().items() if k != "PYSPARK_PYTHON"}
        res = subprocess.run(
            [os.path.join(venv_bin, "cmroot"), "repl", *args, *self.with_args()],
            capture_output=True, text=True, env=env | {"PATH": os.pathsep.join(path)},
            cwd=self.base, timeout=600,
        )
        if check:
            assert res.returncode == 0, res.stderr[-5000:]
        return res


class SharedDestination(Destination):
    """A destination whose steps all run in one long-lived process (one JVM and metastore
    start for the whole package, instead of one per run). Its tests use names of their
    own; a test that runs other processes on the destination (the CLI, spark-submit, a
    killed load) takes a `fresh_destination` (two JVMs cannot share one Derby metastore)."""

    def __init__(self, base: Path) -> None:
        super().__init__(base)
        self.log = base / "server.log"
        self.proc: subprocess.Popen[str] | None = None
        self._err: IO[str] | None = None

    def run(self, *steps: dict[str, Any], faults: str | None = None) -> list[dict[str, Any]]:
        assert faults is None, "a killed load needs a fresh_destination"
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._err = self.log.open("a")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.repl.destination", "--serve", str(self.base)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                text=True, env=self.env(), cwd=self.base,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(list(steps)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.log.read_text()[-5000:]
        reply: dict[str, Any] = json.loads(line)
        assert "crash" not in reply, reply["crash"]
        answers: list[dict[str, Any]] = reply["answers"]
        return answers

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
        if self._err is not None:
            self._err.close()
            self._err = None


@pytest.fixture(scope="package")
def shared_destination(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDestination]:
    d = SharedDestination(tmp_path_factory.mktemp("shared") / "destination")
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def destination(shared_destination: SharedDestination) -> Destination:
    return shared_destination


@pytest.fixture
def fresh_destination(tmp_path: Path) -> Destination:
    """A destination of this test's own (empty catalog, runs a process per `run`)."""
    return Destination(tmp_path / "destination")

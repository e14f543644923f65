"""A cmroot daemon and a real standalone Hive metastore (the Hive 2.3 one in the pyspark
wheel) running the cmroot metastore plugin with the settings `cmroot metastore-conf` printed,
the plugin's token in a file as an administrator would keep it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.jvm import DISK_FS, FSSPEC_DISK, disk_fs_jar
from tests.metastore.hms import Metastore, start_metastore
from tests.metastore.thrift_client import HmsClient
from tests.server.cmroot_daemon import Daemon
from tests.spark.sparklib import REPO


def metastore_conf(*args: str) -> dict[str, Any]:
    """`cmroot metastore-conf --json ARGS`, through the command line."""
    out = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "metastore-conf", "--json", *args],
        capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    conf: dict[str, Any] = json.loads(out)
    return conf


@dataclass
class Hms:
    """The daemon and the metastore whose plugin talks to it."""

    base: Path
    daemon: Daemon
    metastore: Metastore

    @property
    def warehouse(self) -> Path:
        return self.daemon.warehouse

    def client(self) -> HmsClient:
        return HmsClient(self.metastore.uri)

    def current(self) -> int:
        return self.daemon.client().current_event()

    def events(self, since: int) -> list[dict[str, Any]]:
        return [e for e in self.daemon.client().events(since + 1, 1000) if e["id"] > since]

    def served(self, path: str, checksum: str) -> bytes:
        """The bytes the daemon serves for (path, checksum)."""
        buf = io.BytesIO()
        self.daemon.client().get(path, checksum, buf)
        return buf.getvalue()


def start_hms(
    base: Path, *conf_args: str, site: dict[str, str] | None = None,
    classpath: list[str] | None = None, daemon_env: dict[str, str] | None = None,
) -> Hms:
    """A daemon and a metastore running the plugin as `cmroot metastore-conf CONF_ARGS`
    prints it; `site` and `classpath` add what the metastore needs besides (a file system),
    `daemon_env` what the daemon does (its roots, say)."""
    daemon = Daemon(base, env=daemon_env).start()
    token = base / "plugin.token"
    token.write_text(daemon.tokens["write"] + "\n")
    token.chmod(0o600)
    conf = metastore_conf("--url", daemon.url, "--token-file", str(token), *conf_args)
    try:
        ms = start_metastore(base / "hms", daemon.warehouse,
                             {**conf["properties"], **(site or {})},
                             [*conf["classpath"], *(classpath or [])])
    except BaseException:
        daemon.stop()
        raise
    return Hms(base, daemon, ms)


def start_disk_hms(
    base: Path, lake: Path, *, plugin_roots: list[str] | None = None,
    daemon_roots: str | None = None, site: dict[str, str] | None = None,
) -> Hms:
    """`start_hms` with a second root on `disk://` (tests/jvm: a Hadoop scheme over the
    local disk, read by the daemon through its fsspec twin): by default both the plugin
    and the daemon have the roots [base/warehouse (local), disk://LAKE]."""
    lake.mkdir(parents=True, exist_ok=True)
    local = base / "warehouse"  # the daemon's own root (tests.server.cmroot_daemon)
    roots = plugin_roots if plugin_roots is not None else [str(local), f"disk://{lake}"]
    return start_hms(
        base, *[a for r in roots for a in ("--warehouse-root", r)],
        site={"fs.disk.impl": DISK_FS, **(site or {})}, classpath=[disk_fs_jar()],
        daemon_env={"CMROOT_STORE_WAREHOUSE_ROOTS": daemon_roots
                    if daemon_roots is not None else f"{local},disk://{lake}",
                    "PYTHONPATH": os.pathsep.join([str(REPO), str(FSSPEC_DISK)])})


@pytest.fixture(scope="package")
def hms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hms]:
    pytest.importorskip("pyspark")
    h = start_hms(tmp_path_factory.mktemp("hms"))
    try:
        yield h
    finally:
        h.metastore.stop()
        h.daemon.stop()

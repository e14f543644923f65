"""The `spark-sql` shell shipped in pyspark, given only the `--conf` lines printed by
`cmroot spark-conf` (plus the test's own warehouse and metastore location): DROP TABLE
recycles the table's files, which come back by (path, checksum) with the right bytes."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cmroot import checksum as cks
from tests.spark.sparklib import REPO, Daemon

pytestmark = pytest.mark.timeout(600)


def test_spark_sql_shell_drop_table_recycles(tmp_path: Path) -> None:
    pyspark = pytest.importorskip("pyspark")
    shell = Path(pyspark.__file__).parent / "bin" / "spark-sql"
    daemon = Daemon(tmp_path).start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "cmroot.cli", "spark-conf", "--url", daemon.url],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        ).stdout
        conf_args = shlex.split(out)
        assert conf_args and conf_args[0] == "--conf"
        test_env = [
            "--master", "local[2]",
            "--conf", f"spark.sql.warehouse.dir={daemon.warehouse}",
            "--conf", "spark.hadoop.javax.jdo.option.ConnectionURL="
            f"jdbc:derby:;databaseName={tmp_path}/metastore_db;create=true",
            "--conf", f"spark.driver.extraJavaOptions=-Dderby.system.home={tmp_path}",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.sql.shuffle.partitions=2",
        ]
        script = (
            "CREATE TABLE shell_t (a INT, p INT) USING parquet PARTITIONED BY (p);"
            "INSERT INTO shell_t VALUES (1, 1), (2, 2);"
            "DROP TABLE shell_t;"
        )
        res = subprocess.run(
            [str(shell), *test_env, *conf_args, "-e", script],
            capture_output=True, text=True, cwd=tmp_path, timeout=400,
            env={k: v for k, v in os.environ.items() if k != "SPARK_HOME"},
        )
        assert res.returncode == 0, res.stderr[-4000:]
        events = daemon.events_after(0)
        drops = [e for e in events if e["eventType"] == "DROP_TABLE"]
        assert len(drops) == 1, events
        ev = drops[0]
        assert (ev["db"], ev["table"]) == ("default", "shell_t")
        parts = [f for f in ev["files"] if "/part-" in f["path"] and f["path"].endswith(".parquet")]
        assert len(parts) >= 2
        table_dir = daemon.warehouse / "shell_t"
        assert not table_dir.exists()
        for f in ev["files"]:
            assert f["path"].startswith(str(table_dir) + "/")
            buf = io.BytesIO()
            daemon.client.get(f["path"], f["checksum"], buf)
            assert cks.of_bytes(buf.getvalue()) == f["checksum"]
            assert len(buf.getvalue()) == f["size"]
            if f in parts:
                assert buf.getvalue()[:4] == b"PAR1"
    finally:
        daemon.stop()

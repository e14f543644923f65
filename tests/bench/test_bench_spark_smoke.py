"""The Spark hook benchmark at smoke scale: it runs end to end and reports positive
figures (no timing assertions here; the full scale is run by hand)."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.bench import bench_spark

pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]


def test_bench_spark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pyspark")
    if not shutil.which("javac"):
        pytest.skip("javac (a JDK) is needed to build the Spark shim")
    assert bench_spark.main(["--scale", "smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()
            if line.startswith(("| DROP", "| INSERT", "| TRUNCATE"))]
    assert len(rows) == len(bench_spark.OPS) == 5, out
    for row in rows:
        without, with_hook, ratio = re.findall(r"\| ([0-9.]+)x? ", row)[1:4]
        assert float(without) > 0 and float(with_hook) > 0 and float(ratio) > 0, row
    # the daemon's requests per statement are counted and shown (a destructive statement
    # makes at least its prepare and commit)
    counted = re.findall(r"^  (.+): (\d+) request\(s\) for", out, re.M)
    assert len(counted) == 5 and int(dict(counted)["DROP TABLE"]) >= 2, out

"""The replication load benchmark at smoke scale: it runs end to end (a real Spark
destination, `cp -r` beside it) and reports positive figures (no timing assertions here;
the full scale is run by hand)."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.bench import bench_repl, harness

pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]


def test_bench_repl_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pyspark")
    if not shutil.which("java"):
        pytest.skip("a Java runtime is needed for Spark")
    assert bench_repl.main(["--scale", "smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| load ")]
    assert len(rows) == (2 if harness.xxhsum_available() else 1), out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        figures = [re.match(r"[0-9.e-]+", c) for c in cells[1:4]]
        assert all(figures), row
        load_s, cp_s, ratio = (float(m[0]) for m in figures if m)
        assert load_s > 0 and cp_s > 0 and ratio > 0, row

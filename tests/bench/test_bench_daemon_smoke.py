"""Smoke run of the daemon benchmarks (`python -m tests.bench.bench_daemon --scale smoke`):
every row runs its real code path at tiny sizes (the daemon as a subprocess, nginx and wrk
as the baselines). Only that each row produced positive figures is checked, never speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench import bench_daemon

pytestmark = pytest.mark.bench


def test_daemon_benchmarks_smoke(tmp_path: Path) -> None:
    missing = bench_daemon.missing_tools()
    if missing:
        pytest.skip("; ".join(missing))
    rows = bench_daemon.run_benchmarks("smoke", tmp_path)
    assert [r.name for r in rows] == list(bench_daemon.BENCHMARKS)
    for r in rows:
        assert r.cmroot, r.name
        assert r.baseline, r.name
        assert all(v > 0 for v in r.cmroot + r.baseline), (r.name, r.cmroot, r.baseline)
        assert r.ratio > 0, r.name
    table = bench_daemon.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert all(line.startswith("|") and line.endswith("|") for line in table)
    assert list(tmp_path.iterdir()) == []  # the scratch directory was removed


@pytest.mark.parametrize("only", ["rss", "resolve"])
def test_each_row_runs_alone(tmp_path: Path, only: str) -> None:
    """`--only ROW`: a row makes what it needs itself (`--only rss` once failed to find the
    warehouse's db directory the other rows make)."""
    if missing := bench_daemon.missing_tools():
        pytest.skip("; ".join(missing))
    rows = bench_daemon.run_benchmarks("smoke", tmp_path, only=[only])
    assert [r.name for r in rows] == [only] and rows[0].ratio > 0

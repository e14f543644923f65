"""Smoke run of the core benchmarks: tiny sizes, same code paths as the full run.

It checks only that every row was measured (positive timings on both sides and a ratio);
timings on a shared CI machine say nothing, so nothing is asserted about them."""

from __future__ import annotations

import math

import pytest

from . import bench_core, harness

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(not harness.xxhsum_available(), reason=harness.XXHSUM_HINT),
]


def test_smoke_scale_measures_every_row(tmp_path):
    rows = bench_core.run_benchmarks("smoke", tmp_path)

    assert [r.name for r in rows] == list(bench_core.BENCHMARKS)
    for r in rows:
        assert len(r.cmroot) == len(r.baseline) == bench_core.SCALES["smoke"].reps, r.name
        assert all(t > 0 for t in r.cmroot + r.baseline), r.name
        assert math.isfinite(r.ratio) and r.ratio > 0, r.name
    table = bench_core.format_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert list(tmp_path.iterdir()) == []  # the scratch directory was removed


def test_cli_smoke_prints_the_table(tmp_path, capsys):
    assert bench_core.main(["--scale", "smoke", "--dir", str(tmp_path), "--only", "sweep"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| benchmark | cmroot | baseline | ratio | goal |")
    assert "find -type f -delete" in out


def test_missing_xxhsum_fails_with_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_core.shutil, "which", lambda name: None)
    assert bench_core.main(["--scale", "smoke", "--dir", str(tmp_path)]) == 2
    assert "apt-get install xxhash" in capsys.readouterr().err

"""Smoke run of the S3 store benchmark: tiny sizes, the same code paths as the full run;
nothing is asserted about timings."""

from __future__ import annotations

import math

import pytest

from . import bench_s3

pytestmark = pytest.mark.bench


def test_smoke_scale_measures_the_row(tmp_path):
    [row] = bench_s3.run_benchmarks("smoke", tmp_path)
    assert len(row.cmroot) == len(row.baseline) == bench_s3.SCALES["smoke"].reps
    assert all(t > 0 for t in row.cmroot + row.baseline)
    assert math.isfinite(row.ratio) and row.ratio > 0
    assert bench_s3.format_table([row]).count("\n") == 2

"""Spark hook benchmark: the same destructive statements with the cmroot hook and without,
in the same run.

    python -m tests.bench.bench_spark [--scale full|smoke] [--dir DIR] [--reps N]

Rows:
  DROP TABLE        of a managed, unpartitioned parquet table of N files (2,000 at full
                    scale, 64 KiB each, every file distinct).
  INSERT OVERWRITE  `INSERT OVERWRITE TABLE t SELECT ...` of such a table (the old N files
                    are deleted; one small new file is written).

Each side is its own Spark application (local[2], Hive support, embedded Derby metastore):
"without" is plain PySpark, "with" adds exactly what `cmroot.spark.configure` sets and talks
to a real `cmroot serve` on loopback whose store is on the same filesystem as the warehouse
(recycling is a rename, as the README asks). Both sides run the same statements on identical
tables copied from one generated master, after one untimed warm-up round; each figure is
the median of `--reps` rounds, timed with `time.perf_counter` around the `spark.sql` call
(JVM start-up and table set-up are not timed). Goal: with/without <= 1.5x.

Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.bench.harness import log

REPO = Path(__file__).resolve().parents[2]
GOAL = 1.5
OPS = ("drop", "overwrite")
LABELS = {"drop": "DROP TABLE", "overwrite": "INSERT OVERWRITE"}


@dataclass(frozen=True)
class Scale:
    files: int
    rows_per_file: int  # 8 bytes each, random: ~64 KiB per file at full scale
    reps: int


SCALES = {
    "full": Scale(files=2000, rows_per_file=8192, reps=5),
    "smoke": Scale(files=40, rows_per_file=64, reps=1),
}

def make_master(d: Path, scale: Scale) -> Path:
    """N distinct parquet files, written once with pyarrow, copied into each table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    master = d / "master"
    master.mkdir(parents=True)
    for i in range(scale.files):
        n = scale.rows_per_file
        ids = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(os.urandom(8 * n))])
        pq.write_table(pa.table({"id": ids}), master / f"part-{i:05d}.parquet",
                       compression="none")
    return master


# -- one side: a Spark application ------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from tests.spark.sparklib import spark_builder

    base = Path(args.dir)
    warehouse = base / "warehouse"
    builder = spark_builder(base, warehouse, app=f"bench-{args.side}")
    if args.side == "with":
        from cmroot.spark import configure

        builder = configure(builder, url=args.url)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    master = Path(args.master)
    results: dict[str, list[float]] = {op: [] for op in OPS}

    def make(name: str) -> None:
        spark.sql(f"CREATE TABLE {name} (id BIGINT) USING parquet")
        tdir = warehouse / name
        for f in master.iterdir():
            shutil.copyfile(f, tdir / f.name)
        spark.sql(f"REFRESH TABLE {name}")
        os.sync()

    for rnd in range(args.reps + 1):  # round 0 warms up and is not counted
        for op in OPS:
            name = f"t_{op}_{rnd}"
            make(name)
            q = (f"DROP TABLE {name}" if op == "drop"
                 else f"INSERT OVERWRITE TABLE {name} SELECT 42L")
            t = time.perf_counter()
            spark.sql(q).collect()
            elapsed = time.perf_counter() - t
            left = [p for p in (warehouse / name).glob("part-*") if p.name in _names(master)]
            if left:
                raise SystemExit(f"{q}: {len(left)} old files still there")
            if rnd:
                results[op].append(elapsed)
            if op == "overwrite":
                spark.sql(f"DROP TABLE {name}")
    spark.stop()
    print(json.dumps(results))


_NAMES: set[str] = set()


def _names(master: Path) -> set[str]:
    if not _NAMES:
        _NAMES.update(p.name for p in master.iterdir())
    return _NAMES


def run_side(side: str, base: Path, master: Path, reps: int, url: str | None) -> dict[str, Any]:
    d = base / side
    d.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "tests.bench.bench_spark", "--worker", side, "--dir", str(d),
           "--master", str(master), "--reps", str(reps)]
    if url:
        cmd += ["--url", url]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log(f"running the {side}-hook side")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=d, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"the {side}-hook side failed:\n{res.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=list(SCALES), default="full")
    p.add_argument("--dir", help="scratch directory (default: $TMPDIR)")
    p.add_argument("--reps", type=int)
    p.add_argument("--worker", choices=["with", "without"], help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    scale = SCALES[args.scale]
    reps = args.reps or scale.reps
    if args.worker:
        args.side = args.worker
        worker(args)
        return 0

    sys.path.insert(0, str(REPO))
    from cmroot.spark import build_jar
    from tests.spark.sparklib import Daemon

    base = Path(tempfile.mkdtemp(prefix="cmroot-bench-spark-", dir=args.dir))
    daemon = None
    try:
        log(f"generating {scale.files} parquet files")
        master = make_master(base, scale)
        build_jar()
        without = run_side("without", base, master, reps, None)
        daemon = Daemon(base / "with").start()
        with_hook = run_side("with", base, master, reps, daemon.url)
        recycled = sum(len(e["files"] or []) for e in daemon.client.events(0, 1000))
        size = sum(f.stat().st_size for f in master.iterdir())
    finally:
        if daemon:
            daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(f"Spark hook benchmark ({args.scale}): {scale.files} files per table, "
          f"{size / scale.files / 1024:.0f} KiB each; median of {reps} rounds after a warm-up; "
          f"{recycled} files recycled by the hooked side\n")
    print("| operation | files | without hook (s) | with hook (s) | ratio | goal |")
    print("|---|---|---|---|---|---|")
    for op in OPS:
        a, b = statistics.median(without[op]), statistics.median(with_hook[op])
        print(f"| {LABELS[op]} | {scale.files} | {a:.3f} | {b:.3f} | {b / a:.2f}x "
              f"| <= {GOAL}x {'met' if b / a <= GOAL else 'NOT met'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

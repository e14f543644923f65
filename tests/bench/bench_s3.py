"""The store on S3: recycle (move) of a table of small objects from an S3 warehouse into an
S3 store, against the plain work of moving them (a server-side copy and a delete per
object, through the same s3fs), both against one S3 server (moto's, in its own process on
loopback), in the same run.

    python -m tests.bench.bench_s3                 # 500 x 64 KiB, 3 runs per side
    python -m tests.bench.bench_s3 --scale smoke   # tiny, seconds

What cmroot pays for on top of the baseline: the journal, one read of each staged copy to
hash it, a second server-side copy to publish it under its checksum (after an existence
check), an identity check before each delete, the index commit. moto is a Python server:
its per-request cost dominates both sides, so the ratio counts requests more than bytes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import harness
from .harness import KiB, Medians, log

KEY, SECRET = "bench-key", "bench-secret"


@dataclass(frozen=True)
class Scale:
    files: int
    size: int
    reps: int


SCALES = {"full": Scale(500, 64 * KiB, 3), "smoke": Scale(8, 4 * KiB, 1)}


@dataclass
class Row(Medians):
    name: str
    baseline_name: str
    cmroot: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in a child process on a free loopback port; its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise harness.BenchError("moto's S3 server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(30)


def _env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
            "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true"}


def _fill(fs: Any, bucket: str, files: int, size: int) -> None:
    for i in range(files):
        with fs.open(f"{bucket}/db.db/t/p={i % 10}/part-{i:05d}", "wb") as f:
            f.write(os.urandom(size))


def run_benchmarks(scale_name: str, work: Path, reps: int | None = None) -> list[Row]:
    import fsspec
    import s3fs

    from cmroot import config as cfg
    from cmroot.store import RecycleRequest, Store

    scale = SCALES[scale_name]
    reps = reps or scale.reps
    row = Row(f"recycle move S3 -> S3 store {scale.files} x {harness.human_size(scale.size)}",
              "s3fs copy + delete per object")
    with moto_server() as endpoint:
        saved, saved_conf = dict(os.environ), fsspec.config.conf.get("s3")
        os.environ.update(_env(endpoint))
        fsspec.config.conf["s3"] = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            fs = fsspec.filesystem("s3")
            for rep in range(reps):
                wh, dest, store_b = (f"{p}-{uuid.uuid4().hex[:8]}" for p in ("wh", "dst", "st"))
                for b in (wh, dest, store_b):
                    fs.mkdir(b)

                def ours(wh: str = wh, store_b: str = store_b, rep: int = rep) -> None:
                    _fill(fs, wh, scale.files, scale.size)
                    config = cfg.load(None, {
                        "CMROOT_STORE_ROOT": f"s3://{store_b}/cm",
                        "CMROOT_STORE_WAREHOUSE_ROOTS": f"s3://{wh}",
                        "CMROOT_INDEX_PATH": str(work / f"idx{rep}" / "index.sqlite"),
                    })
                    with Store.open(config) as store:
                        t = time.perf_counter()
                        r = store.recycle(RecycleRequest([f"s3://{wh}/db.db/t"], op="DROP_TABLE",
                                                         db="db", table="t"))
                        row.cmroot.append(time.perf_counter() - t)
                    if len(r.files) != scale.files:
                        raise harness.BenchError(f"recycled {len(r.files)} of {scale.files}")

                def theirs(wh: str = wh, dest: str = dest) -> None:
                    _fill(fs, wh, scale.files, scale.size)
                    fs.invalidate_cache()
                    t = time.perf_counter()
                    for p in fs.find(f"{wh}/db.db/t"):
                        fs.cp_file(p, f"{dest}/{p.split('/', 1)[1]}")
                        fs.rm_file(p)
                    row.baseline.append(time.perf_counter() - t)

                harness.alternate(rep, [ours, theirs])
                log(f"rep {rep + 1}/{reps}: cmroot {row.cmroot[-1]:.2f}s,"
                    f" baseline {row.baseline[-1]:.2f}s")
        finally:
            os.environ.clear()
            os.environ.update(saved)
            if saved_conf is None:
                fsspec.config.conf.pop("s3", None)
            else:
                fsspec.config.conf["s3"] = saved_conf
            s3fs.S3FileSystem.clear_instance_cache()
    return [row]


def format_table(rows: Sequence[Row]) -> str:
    lines = list(harness.TABLE_HEADER)
    for r in rows:
        runs = ", ".join(f"{c / b:.2f}" for c, b in zip(r.cmroot, r.baseline, strict=True))
        lines.append(f"| {r.name} | {r.cmroot_median:.2f} s | {r.baseline_median:.2f} s"
                     f" ({r.baseline_name}) | {r.ratio:.2f}x (runs: {runs}) | none |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = harness.arg_parser("bench_s3", __doc__ or "", SCALES, ["recycle-s3"],
                            "runs per side (default: the scale's)")
    args = ap.parse_args(argv)
    work = harness.make_work_dir("cmroot-bench-s3-", args.dir, args.scale, 1, 0)
    try:
        rows = run_benchmarks(args.scale, work, args.reps)
    except harness.BenchError as e:
        print(f"bench_s3: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Core store benchmarks: each cmroot figure beside a shell baseline timed in the same run.

    python -m tests.bench.bench_core [--scale full|smoke] [--dir DIR] [--reps N]
                                     [--only recycle-small,recycle-small-new,recycle-large,sweep]
                                     [--phases]

Rows (full scale):
  recycle-small  `Store.recycle` (move, same filesystem) of 10,000 x 64 KiB files in 100
                 partition directories, into a store whose shard directories exist, vs
                 `xxhsum -H2` over the same files plus `find DIR -type f -exec mv -t DEST {} +`
                 (timed together).
  recycle-small-new  the same into a brand-new store, which makes ~9,500 shard directories
                 on the way (what the first recycles into a store pay).
  recycle-large  the same with 8 x 256 MiB files.
  sweep          `Store.gc()` of 100,000 expired objects vs `find OBJDIR -type f -delete`
                 on an identical copy of the store's objects/ab/cd/<checksum> tree.

Fairness: both sides of a row run on identical trees copied (`cp -a`) from one generated
master, alternate which side goes first from one repetition to the next, and are timed
with `time.perf_counter` around the whole operation. `sync` runs after setup and right
before each timed side, so neither pays for the other's (or the setup's) writeback. The
page cache is warm for both sides: each side's files are read once (`cat > /dev/null`)
just before its timed run. Every figure is the median of `--reps` repetitions (3 at full
scale); the ratio is median(cmroot) / median(baseline).

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmroot import checksum as cks
from cmroot.config import Config, load
from cmroot.store import RecycleRequest, Store

from .harness import (
    TABLE_HEADER,
    XXHSUM_HINT,
    BenchError,
    GiB,
    KiB,
    Medians,
    MiB,
    Phases,
    alternate,
    arg_parser,
    check_names,
    fmt_seconds,
    human_size,
    log,
    make_work_dir,
    parse_args,
    sync,
)

# A fixed, fake "now" for the sweep's store: objects are recycled at T0 and swept after
# T0 + retain, so no one waits a day and nothing depends on the wall clock.
T0 = 1_700_000_000.0
BENCHMARKS = ("recycle-small", "recycle-small-new", "recycle-large", "sweep")
CACHE_NOTE = (
    "page cache: warm on both sides (each side's files are read once with `cat > /dev/null` "
    "right before its timed run); `sync` runs before each timed side"
)


@dataclass(frozen=True)
class Scale:
    reps: int
    small_files: int
    small_size: int
    small_partitions: int
    large_files: int
    large_size: int
    sweep_objects: int
    sweep_batch: int
    sweep_size: int
    # Rough peak disk use, checked before starting.
    disk_needed: int


SCALES = {
    "full": Scale(
        reps=3,
        small_files=10_000, small_size=64 * KiB, small_partitions=100,
        large_files=8, large_size=256 * MiB,
        sweep_objects=100_000, sweep_batch=1_000, sweep_size=4 * KiB,
        disk_needed=8 * GiB,
    ),
    "smoke": Scale(
        reps=1,
        small_files=200, small_size=4 * KiB, small_partitions=10,
        large_files=2, large_size=1 * MiB,
        sweep_objects=2_000, sweep_batch=500, sweep_size=1 * KiB,
        disk_needed=64 * MiB,
    ),
}


@dataclass
class Row(Medians):
    name: str
    label: str
    baseline_label: str
    goal: float  # the most cmroot / baseline may be
    cmroot: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    # 1-minute load average sampled right before each timed side.
    load: list[float] = field(default_factory=list)

    @property
    def met(self) -> bool:
        return self.ratio <= self.goal


# -- small helpers ----------------------------------------------------------------------------

def fmt_goal(goal: float) -> str:
    return f"<= {goal:g}x"


def run(cmd: str | Sequence[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    """Run a command (a string goes through sh); raise BenchError with its stderr on failure."""
    shell = isinstance(cmd, str)
    p = subprocess.run(cmd, shell=shell, capture_output=True, **kw)
    if p.returncode != 0:
        raise BenchError(f"{cmd!r} failed ({p.returncode}): {p.stderr.decode(errors='replace')}")
    return p


def copy_tree(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    run(["cp", "-a", str(src), str(dst)])


def warm(path: Path) -> None:
    """Read every file under `path` once, so the timed side finds its data in the page cache."""
    run(f"find '{path}' -type f -exec cat {{}} + > /dev/null")


def count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def timed(fn: Callable[[], Any], row: Row | None = None) -> tuple[float, Any]:
    if row is not None:
        row.load.append(loadavg())
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def store_config(store_root: Path, warehouse: Path) -> Config:
    return load(None, env={
        "CMROOT_STORE_ROOT": str(store_root),
        "CMROOT_STORE_WAREHOUSE_ROOTS": str(warehouse),
        "CMROOT_INDEX_PATH": str(store_root / "index.sqlite"),
    })


def check_tools() -> None:
    if shutil.which("xxhsum") is None:
        raise BenchError(XXHSUM_HINT)
    for tool in ("find", "mv", "cp", "cat"):
        if shutil.which(tool) is None:
            raise BenchError(f"{tool} not found: the baselines need coreutils and findutils")


# -- per-phase timing (--phases) -----------------------------------------------------------
@contextmanager
def recycle_phases(store: Store, enabled: bool) -> Iterator[Phases | None]:
    if not enabled:
        yield None
        return
    import cmroot.checksum

    ph = Phases()
    r = store.recycler
    ph.wrap(store.warehouse, "expand", "expand (walk + lstat)")
    ph.wrap(store.index, "journal_begin", "index.journal_begin")
    ph.wrap(r, "_stage_all", "stage all (thread pool, wall)")
    ph.wrap(os, "rename", "  os.rename [summed over threads]")
    ph.wrap(cmroot.checksum, "of_local_file", "  hash staged file [summed over threads]")
    ph.wrap(store.objects, "publish", "  objects.publish [summed over threads]")
    ph.wrap(store.layout, "make_shard", "    layout.make_shard [summed over threads]")
    ph.wrap(store.layout, "flush", "layout.flush (syncfs)")
    ph.wrap(r.journal, "commit", "journal.commit (index)")
    ph.wrap(store.objects, "release", "objects.release")
    ph.wrap(r, "_finish", "finish (rm staging, rmdir sources)")
    try:
        yield ph
    finally:
        ph.restore()


@contextmanager
def sweep_phases(store: Store, enabled: bool) -> Iterator[Phases | None]:
    if not enabled:
        yield None
        return
    ph = Phases()
    ph.wrap(store.index, "expired", "index.expired (page query)")
    ph.wrap(store.objects, "remove", "objects.remove (unlinks and forgets a page)")
    ph.wrap(store.index, "get_object", "  index.get_object [summed over threads]")
    ph.wrap(os, "unlink", "  os.unlink [summed over threads]")
    ph.wrap(store.index, "forget_expired", "  index.forget_expired")
    try:
        yield ph
    finally:
        ph.restore()


def add_phases(row: Row, ph: Phases | None) -> None:
    if ph is None:
        return
    for k, v in ph.totals.items():
        row.phases[k] = row.phases.get(k, 0.0) + v


# -- data generation ---------------------------------------------------------------------------
def make_table(root: Path, files: int, size: int, partitions: int) -> None:
    """A table directory of `files` distinct random files spread over partition directories.
    File names are unique across partitions (as Spark's part-NNNNN-<uuid> names are), so the
    baseline can move them all into one flat directory."""
    partitions = max(1, min(partitions, files))
    step = max(1, files // 10)
    for i in range(files):
        part = root / f"dt={i % partitions:05d}"
        if i < partitions:
            part.mkdir(parents=True)
        with open(part / f"part-{i:06d}.parquet", "wb") as f:
            left = size
            while left:
                chunk = min(left, 16 * MiB)
                f.write(os.urandom(chunk))
                left -= chunk
        if size >= 64 * MiB or (i + 1) % step == 0:
            log(f"  generated {i + 1:,}/{files:,} files")


def xxhsum_checksums(output: bytes) -> list[str]:
    return sorted(line.split(None, 1)[0].decode() for line in output.splitlines() if line.strip())


# -- benchmarks ----------------------------------------------------------------------------------
def recycle_cmroot(row: Row, rep: int, cfg: Config, table: Path, files: int, phases: bool,
                   sums: list[str]) -> None:
    with Store.open(cfg) as store, recycle_phases(store, phases) as ph:
        warm(table)
        sync()
        req = RecycleRequest(paths=[str(table)], mode="move", op="DROP_TABLE", db="db", table="t")
        dt, res = timed(lambda: store.recycle(req), row)
        add_phases(row, ph)
    if len(res.files) != files or table.exists():
        raise BenchError(f"cmroot recycled {len(res.files)} of {files} files")
    sums[:] = sorted(f.checksum for f in res.files)
    row.cmroot.append(dt)
    log(f"{row.name}: rep {rep + 1}: cmroot {fmt_seconds(dt)}")


def recycle_baseline(row: Row, rep: int, src: Path, dest: Path, files: int,
                     sums: list[str]) -> None:
    warm(src)
    sync()

    def baseline() -> bytes:
        out = run(["find", str(src), "-type", "f", "-exec", "xxhsum", "-H2", "{}", "+"]).stdout
        run(["find", str(src), "-type", "f", "-exec", "mv", "-t", str(dest), "{}", "+"])
        return out

    dt, out = timed(baseline, row)
    if count_files(dest) != files or count_files(src) != 0:
        raise BenchError(f"baseline moved {count_files(dest)} of {files} files")
    sums[:] = xxhsum_checksums(out)
    row.baseline.append(dt)
    log(f"{row.name}: rep {rep + 1}: baseline {fmt_seconds(dt)}")


def template_store(root: Path, warehouse: Path, master: Path) -> None:
    """An empty store whose shard directories for the master's files already exist, as they
    do in any store that has been in use for a while (a store that has held 100,000 objects
    has ~78% of its 65,536 shard directories; one that has held a million, all of them).
    Only the shards this recycle will use are made: creating (and later removing) all
    65,536 would cost the setup a minute for the same timed result."""
    with Store.open(store_config(root, warehouse)) as store:
        for dirpath, _, names in os.walk(master):
            for n in names:
                store.layout.make_shard(cks.of_local_file(os.path.join(dirpath, n)))


def bench_recycle(
    work: Path, row: Row, files: int, size: int, partitions: int, reps: int, phases: bool,
    new_store: bool = False,
) -> Row:
    """`new_store`: recycle into a brand-new store, which creates a shard directory for
    almost every object on the way; else into a store whose shard directories exist."""
    master = work / "master"
    log(f"{row.name}: generating the master table ({files:,} x {human_size(size)})")
    make_table(master, files, size, partitions)
    template = work / "template-store"
    if not new_store:
        log(f"{row.name}: making a store whose shard directories exist")
        template_store(template, work / "template-warehouse", master)
    sync()
    for rep in range(reps):
        d = work / f"rep{rep}"
        warehouse = d / "warehouse"
        table = warehouse / "db" / "t"
        base_src, base_dest = d / "baseline" / "t", d / "baseline" / "dest"
        log(f"{row.name}: rep {rep + 1}/{reps}: copying the master twice (cp -a)")
        copy_tree(master, table)
        copy_tree(master, base_src)
        base_dest.mkdir(parents=True)
        if not new_store:
            copy_tree(template, d / "store")
        cfg = store_config(d / "store", warehouse)
        cm_sums: list[str] = []
        base_sums: list[str] = []
        alternate(rep, [
            functools.partial(recycle_cmroot, row, rep, cfg, table, files, phases, cm_sums),
            functools.partial(recycle_baseline, row, rep, base_src, base_dest, files, base_sums),
        ])
        if cm_sums != base_sums:
            raise BenchError("cmroot's checksums differ from xxhsum -H2's on identical files")
        shutil.rmtree(d)
    shutil.rmtree(master)
    shutil.rmtree(template, ignore_errors=True)
    return row


def build_sweep_store(
    store_root: Path, warehouse: Path, objects: int, batch: int, size: int
) -> None:
    """A store holding `objects` distinct objects, all recycled at T0 (batches of `batch`
    paths per request)."""
    log(f"sweep: building a store of {objects:,} objects ({human_size(size)} each, "
        f"{batch:,}-path recycle requests)")
    cfg = store_config(store_root, warehouse)
    n = 0
    with Store.open(cfg, clock=lambda: T0) as store:
        b = 0
        while n < objects:
            d = warehouse / "db" / "s" / f"batch={b:05d}"
            d.mkdir(parents=True)
            paths = []
            for _ in range(min(batch, objects - n)):
                p = d / f"part-{n:07d}"
                p.write_bytes(struct.pack("<Q", n) * (size // 8))  # distinct content per object
                paths.append(str(p))
                n += 1
            store.recycle(RecycleRequest(
                paths=paths, mode="move", op="DROP_PARTITION", db="db", table="s",
                partitions=[{"batch": f"{b:05d}"}],
            ))
            b += 1
            if b % 10 == 0 or n == objects:
                log(f"  recycled {n:,}/{objects:,}")
        stored = store.index.stats()[0]
    if stored != objects:
        raise BenchError(f"sweep setup: the store holds {stored} objects, expected {objects}")


def sweep_cmroot(row: Row, rep: int, cfg: Config, objects: int, phases: bool) -> None:
    now = T0 + cfg.store.retain + 1
    with Store.open(cfg, clock=lambda: now) as store, sweep_phases(store, phases) as ph:
        sync()
        dt, report = timed(store.gc, row)
        add_phases(row, ph)
    left = count_files(Path(cfg.store.root) / "objects")
    if report.removed_objects != objects or report.failed or left:
        raise BenchError(
            f"gc removed {report.removed_objects} of {objects} objects, "
            f"{report.failed} failed, {left} files left"
        )
    row.cmroot.append(dt)
    log(f"sweep: rep {rep + 1}: cmroot {fmt_seconds(dt)}")


def sweep_baseline(row: Row, rep: int, objdir: Path) -> None:
    sync()
    dt, _ = timed(lambda: run(["find", str(objdir), "-type", "f", "-delete"]), row)
    if count_files(objdir):
        raise BenchError("find -delete left files behind")
    row.baseline.append(dt)
    log(f"sweep: rep {rep + 1}: baseline {fmt_seconds(dt)}")


def bench_sweep(
    work: Path, row: Row, objects: int, batch: int, size: int, reps: int, phases: bool
) -> Row:
    warehouse = work / "warehouse"
    master = work / "master-store"
    build_sweep_store(master, warehouse, objects, batch, size)
    sync()
    for rep in range(reps):
        d = work / f"rep{rep}"
        log(f"sweep: rep {rep + 1}/{reps}: copying the store and its objects tree (cp -a)")
        copy_tree(master, d / "store")
        copy_tree(master / "objects", d / "baseline-objects")
        cfg = store_config(d / "store", warehouse)
        alternate(rep, [
            functools.partial(sweep_cmroot, row, rep, cfg, objects, phases),
            functools.partial(sweep_baseline, row, rep, d / "baseline-objects"),
        ])
        shutil.rmtree(d)
    shutil.rmtree(master)
    shutil.rmtree(warehouse)
    return row


# -- driver ---------------------------------------------------------------------------------
def run_benchmarks(
    scale: str = "full", directory: str | os.PathLike[str] | None = None, reps: int | None = None,
    only: Sequence[str] | None = None, phases: bool = False,
) -> list[Row]:
    """Run the benchmarks at `scale` in a fresh directory under `directory` (default: the
    system temp dir) and return their rows. Raises BenchError if a tool is missing."""
    check_tools()
    s = SCALES[scale]
    reps = reps or s.reps
    names = list(only or BENCHMARKS)
    check_names(names, BENCHMARKS)
    work = make_work_dir("cmroot-benchcore-", directory, scale, reps, s.disk_needed)
    rows: list[Row] = []
    try:
        for name in names:
            sub = work / name
            sub.mkdir()
            if name == "recycle-small":
                row = Row(
                    name, f"recycle move {s.small_files:,} x {human_size(s.small_size)}",
                    "xxhsum -H2 + find -exec mv -t", 1.5,
                )
                rows.append(bench_recycle(
                    sub, row, s.small_files, s.small_size, s.small_partitions, reps, phases
                ))
            elif name == "recycle-small-new":
                row = Row(
                    name, f"recycle move {s.small_files:,} x {human_size(s.small_size)}, "
                    "new store (makes its shard dirs)",
                    "xxhsum -H2 + find -exec mv -t", 2.0,
                )
                rows.append(bench_recycle(
                    sub, row, s.small_files, s.small_size, s.small_partitions, reps, phases,
                    new_store=True,
                ))
            elif name == "recycle-large":
                row = Row(
                    name, f"recycle move {s.large_files:,} x {human_size(s.large_size)}",
                    "xxhsum -H2 + find -exec mv -t", 1.5,
                )
                rows.append(bench_recycle(sub, row, s.large_files, s.large_size, 1, reps, phases))
            else:
                row = Row(
                    name, f"sweep {s.sweep_objects:,} expired objects",
                    "find -type f -delete", 1.2,
                )
                rows.append(bench_sweep(
                    sub, row, s.sweep_objects, s.sweep_batch, s.sweep_size, reps, phases
                ))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    lines = list(TABLE_HEADER)
    for r in rows:
        verdict = " (met)" if r.met else " (MISSED)"
        lines.append(
            f"| {r.label} | {fmt_seconds(r.cmroot_median)} | "
            f"{fmt_seconds(r.baseline_median)} ({r.baseline_label}) | {r.ratio:.2f}x | "
            f"{fmt_goal(r.goal)}{verdict} |"
        )
    return "\n".join(lines)


def format_notes(rows: Sequence[Row], reps: int) -> str:
    def secs(ts: Sequence[float]) -> str:
        return ", ".join(f"{t:.3f}" for t in ts)

    def ratios(r: Row) -> str:
        return ", ".join(f"{c / b:.2f}" for c, b in zip(r.cmroot, r.baseline, strict=True))

    lines = [
        f"median of {reps} run(s) per side; ratio = median(cmroot) / median(baseline); "
        "cmroot and baseline alternate going first",
        CACHE_NOTE,
        "all runs (s):",
        *(
            f"  {r.name}: cmroot [{secs(r.cmroot)}] baseline [{secs(r.baseline)}] "
            f"per-run ratio [{ratios(r)}]"
            for r in rows
        ),
    ]
    cpus = os.cpu_count() or 1
    loads = [x for r in rows for x in r.load]
    if loads:
        lines.append(
            f"1-min load average before the timed runs (this bench's own setup included): "
            f"max {max(loads):.2f}, median {statistics.median(loads):.2f} on {cpus} CPU(s)"
        )
        if max(loads) > cpus:
            lines.append(
                "WARNING: other processes were competing for CPU/disk during this run; "
                "figures are noisy, rerun on a quiet machine before comparing them"
            )
    return "\n".join(lines)


def format_phases(rows: Sequence[Row], reps: int) -> str:
    out = []
    for r in rows:
        if not r.phases:
            continue
        mean = fmt_seconds(statistics.mean(r.cmroot))
        out.append(f"{r.name}: cmroot phases, mean per run (of {mean} mean wall, instrumented)")
        for k, v in r.phases.items():
            out.append(f"  {k:<48} {v / reps:8.3f} s")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = arg_parser(
        "python -m tests.bench.bench_core",
        "cmroot core store benchmarks, each against a shell baseline run alongside.",
        SCALES, BENCHMARKS, "repetitions per side (default: 3 full, 1 smoke)",
    )
    ap.add_argument("--phases", action="store_true",
                    help="also time cmroot's internal phases (adds a little overhead)")
    args, reps, only = parse_args(ap, argv, SCALES)
    try:
        rows = run_benchmarks(args.scale, args.dir, reps, only, args.phases)
    except BenchError as e:
        print(f"bench_core: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print()
    print(format_notes(rows, reps))
    if args.phases:
        print()
        print(format_phases(rows, reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

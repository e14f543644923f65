"""Replication load benchmark: `cmroot.repl.load.load` of a dump naming 10,000 files
(2 GiB) with Spark `local[2]`, against `cp -r` of the same files, in the same run.

    python -m tests.bench.bench_repl [--scale full|smoke] [--dir DIR] [--reps N]
                                     [--phases] [--spark-conf KEY=VALUE ...]

Rows:
  load vs cp -r            the goal row: cmroot's throughput relative to `cp -r` of the
                           source table directory (cp seconds / load seconds), goal >= 0.5x.
  load vs cp -r + xxhsum   information: `cp -r` followed by `xxhsum -H2` over the copies,
                           the same physical work as a verified copy (needs `xxhsum`).

Set-up, untimed: 10,000 files of random bytes (2 GiB in all; smoke: 40 x 4 KiB) under
<work>/src-warehouse/bench.db/t/p=<k>/part-<i>.bin over 10 partitions, their checksums
(`cmroot.checksum.of_local_file`), and a synthetic incremental dump (CREATE_DATABASE,
CREATE_TABLE of a parquet table partitioned by a string `p`, one INSERT listing every
file) written with `cmroot.repl.dumpdir.write`. No source Spark and no daemon: every
original is present. The destination is one Spark session (local[2], Hive support,
embedded Derby metastore, `tests.spark.sparklib.spark_builder`) in a worker subprocess,
started and warmed up (one small load) before anything is timed.

Each repetition loads the dump into a new database `bench_<rep>` (timed around the
`load()` call only), checks the result (file count and bytes, every destination file
present with its size, a sample re-hashed, the partitions registered) and drops the
database, untimed. The baselines copy the source table directory with `cp -r` into a
fresh directory, removed after each repetition. The page cache is warm for every side
(the source files are read once right before it), `sync` runs before each timed side,
and the sides alternate going first. Figures are medians of `--reps` (3 at full scale).

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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
    xxhsum_available,
)

REPO = Path(__file__).resolve().parents[2]
GOAL = 0.5  # load throughput / cp -r throughput
BENCHMARKS = ("load",)
DB, TABLE = "bench", "t"
SAMPLE = 100  # destination files re-hashed after each load
CACHE_NOTE = (
    "page cache: warm on every side (the source files are read once with `cat > /dev/null` "
    "right before each timed run); `sync` runs before each timed side"
)


@dataclass(frozen=True)
class Scale:
    reps: int
    files: int
    total: int  # bytes, spread evenly over the files
    partitions: int
    warmup_files: int  # the untimed warm-up load
    disk_needed: int  # source + one load + one copy, with room to spare


SCALES = {
    "full": Scale(reps=3, files=10_000, total=2 * GiB, partitions=10, warmup_files=20,
                  disk_needed=8 * GiB),
    "smoke": Scale(reps=1, files=40, total=40 * 4 * KiB, partitions=10, warmup_files=4,
                   disk_needed=64 * MiB),
}


@dataclass
class Row(Medians):
    """`cmroot`: load seconds; `baseline`: the shell side's seconds. `speed` (the printed
    ratio) is cmroot's throughput relative to the baseline: baseline / cmroot time."""

    name: str
    label: str
    baseline_label: str
    goal: float | None  # None: informational row
    cmroot: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-min load average before each side

    @property
    def speed(self) -> float:
        return self.baseline_median / self.cmroot_median

    @property
    def met(self) -> bool:
        return self.goal is None or self.speed >= self.goal


# -- small helpers ----------------------------------------------------------------------------
def run(cmd: str | Sequence[str]) -> subprocess.CompletedProcess[bytes]:
    """Run a command (a string goes through sh); raise BenchError with its stderr on failure."""
    p = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, check=False)
    if p.returncode != 0:
        raise BenchError(f"{cmd!r} failed ({p.returncode}): {p.stderr.decode(errors='replace')}")
    return p


def warm(path: Path) -> None:
    """Read every file under `path` once, so the timed side finds it in the page cache."""
    run(f"find '{path}' -type f -exec cat {{}} + > /dev/null")


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def fmt_speed(x: float) -> str:
    return f"{x:.2f}x" if x >= 0.01 else f"{x:.2g}x"


def file_sizes(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under `root`."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = os.stat(p).st_size
    return out


# -- the source side: files and a synthetic dump ------------------------------------------------
@dataclass
class Source:
    table_dir: Path
    files: list[dict[str, Any]]  # {"path", "checksum", "size"}, as in a dump's manifest

    @property
    def total(self) -> int:
        return sum(int(f["size"]) for f in self.files)

    def expected(self) -> dict[str, tuple[int, str]]:
        """Relative path below the table -> (size, checksum)."""
        base = str(self.table_dir) + "/"
        return {f["path"][len(base):]: (int(f["size"]), f["checksum"]) for f in self.files}


def make_source(work: Path, s: Scale) -> Source:
    from cmroot import checksum as cks

    table_dir = work / "src-warehouse" / f"{DB}.db" / TABLE
    rng = random.Random(20261122)
    base, extra = divmod(s.total, s.files)
    files = []
    step = max(1, s.files // 10)
    for i in range(s.files):
        d = table_dir / f"p={i % s.partitions}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"part-{i:05d}.bin"
        size = base + (1 if i < extra else 0)
        path.write_bytes(rng.randbytes(size))
        files.append({"path": str(path), "checksum": cks.of_local_file(str(path)), "size": size})
        if (i + 1) % step == 0:
            log(f"  generated {i + 1:,}/{s.files:,} files")
    return Source(table_dir, files)


def table_obj(location: Path) -> dict[str, Any]:
    """A parquet datasource table partitioned by a string `p`, as the Spark hook records it."""
    schema = {
        "type": "struct",
        "fields": [
            {"name": "a", "type": "integer", "nullable": True, "metadata": {}},
            {"name": "p", "type": "string", "nullable": True, "metadata": {}},
        ],
    }
    return {
        "db": DB, "table": TABLE, "tableType": "MANAGED_TABLE", "location": str(location),
        "columns": [], "partitionKeys": [{"name": "p", "type": "string"}],
        "parameters": {
            "spark.sql.sources.provider": "parquet",
            "spark.sql.sources.schema": json.dumps(schema),
            "spark.sql.sources.schema.numPartCols": "1",
            "spark.sql.sources.schema.partCol.0": "p",
        },
        "inputFormat": None, "outputFormat": None, "serde": None, "serdeParameters": {},
    }


def write_dump(url: Path, src: Source, files: list[dict[str, Any]]) -> None:
    """An incremental dump: CREATE_DATABASE, CREATE_TABLE, one INSERT of `files`."""
    from cmroot.repl import dumpdir
    from cmroot.repl.dumpdir import DumpEvent, Header

    now = time.time()
    loc = str(src.table_dir)
    parts = sorted({os.path.basename(os.path.dirname(f["path"])) for f in files})
    events = [
        DumpEvent(1, 0, "CREATE_DATABASE", DB, None, timestamp=now),
        DumpEvent(2, 0, "CREATE_TABLE", DB, TABLE, location=loc,
                  table_obj=table_obj(src.table_dir), timestamp=now),
        DumpEvent(3, 0, "INSERT", DB, TABLE, location=loc,
                  partitions=[{"p": p.partition("=")[2]} for p in parts],
                  timestamp=now, files=files),
    ]
    dumpdir.write(str(url), Header("incremental", DB, None, 0, events[-1].id, now, ""),
                  events, {})


# -- the destination: a Spark session in a worker subprocess ------------------------------------
def _phases(enabled: bool) -> Phases | None:
    if not enabled:
        return None
    from cmroot.repl.catalog import Destination

    # By module name: `cmroot.repl` re-exports a `load` function that shadows the module.
    load_mod = importlib.import_module("cmroot.repl.load")
    ph = Phases()
    ph.wrap(importlib.import_module("cmroot.repl.dumpdir"), "read", "read the dump")
    ph.wrap(load_mod.Loader, "_sweep_temporaries", "sweep temporaries")
    ph.wrap(load_mod.Loader, "_check_reachable", "stat every original (driver)")
    ph.wrap(load_mod.Loader, "_copy", "Spark copy job (parallelize + collect)")
    ph.wrap(load_mod, "publish", "publish: rename temporaries (driver)")
    ph.wrap(load_mod, "sync_filesystem", "syncfs")
    ph.wrap(Destination, "create_db", "SQL CREATE DATABASE")
    ph.wrap(Destination, "create_table", "SQL CREATE TABLE")
    ph.wrap(Destination, "add_partitions", "SQL ALTER TABLE ADD PARTITION")
    ph.wrap(Destination, "refresh", "SQL REFRESH TABLE")
    ph.wrap(Destination, "set_db_properties", "SQL ALTER DATABASE (repl.last.id)")
    ph.wrap(Destination, "has_db", "catalog: has_db")
    ph.wrap(Destination, "has_table", "catalog: has_table")
    ph.wrap(Destination, "db_properties", "catalog: db_properties")
    ph.wrap(Destination, "location", "catalog: location")
    return ph


def worker(base: Path, conf: list[str]) -> int:
    """Serve the parent over stdin/stdout, one JSON line per request and answer:
    {"op": "load", "dump", "target", "phases"} -> {"seconds", "result", "partitions",
    "location", "phases"}; {"op": "drop", "db"}; {"op": "quit"}."""
    out: IO[str] = os.fdopen(os.dup(1), "w")  # the answers; the JVM's stdout goes to stderr
    os.dup2(2, 1)
    sys.path.insert(0, str(REPO))
    from cmroot.repl import load
    from cmroot.repl.catalog import Destination
    from tests.spark.sparklib import spark_builder

    builder = spark_builder(base, base / "warehouse", app="cmroot-bench-repl")
    for kv in conf:
        k, _, v = kv.partition("=")
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    answer({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "load":
                ph = _phases(req.get("phases", False))
                try:
                    t = time.perf_counter()
                    res = load(spark, req["dump"], target=req["target"])
                    seconds = time.perf_counter() - t
                finally:
                    if ph is not None:
                        ph.restore()
                parts = [r[0] for r in spark.sql(f"SHOW PARTITIONS {req['target']}.{TABLE}")
                         .collect()]
                answer({"seconds": seconds, "result": res.to_json(), "partitions": parts,
                        "location": Destination(spark).location(req["target"], TABLE),
                        "phases": ph.totals if ph else {}})
            elif req["op"] == "drop":
                spark.sql(f"DROP DATABASE IF EXISTS {req['db']} CASCADE").collect()
                answer({})
            else:
                break
        except Exception as e:  # reported to the parent, which raises BenchError
            answer({"error": f"{type(e).__name__}: {e}"})
    spark.stop()
    return 0


class Worker:
    """The parent's handle on the destination session."""

    def __init__(self, work: Path, conf: Sequence[str]) -> None:
        self.base = work / "dst"
        self.base.mkdir()
        self.log_path = work / "spark-worker.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        }
        cmd = [sys.executable, "-m", "tests.bench.bench_repl", "--worker", str(self.base)]
        for kv in conf:
            cmd += ["--spark-conf", kv]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, cwd=self.base, env=env, text=True)
        self.call(None)  # wait for the session

    def call(self, req: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if req is not None:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"the Spark worker died:\n{self.tail()}")
        ans: dict[str, Any] = json.loads(line)
        if "error" in ans:
            raise BenchError(f"the Spark worker failed on {req}: {ans['error']}\n{self.tail()}")
        return ans

    def tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._log.close()


@contextmanager
def running_worker(work: Path, conf: Sequence[str]) -> Iterator[Worker]:
    w = Worker(work, conf)
    try:
        yield w
    finally:
        w.stop()


# -- checks ------------------------------------------------------------------------------------
def check_load(ans: dict[str, Any], src: Source, s: Scale, target: str) -> None:
    """Raise BenchError unless the load placed every file, intact, and its partitions."""
    from cmroot import checksum as cks

    res = ans["result"]
    n, total = len(src.files), src.total
    if res["files"] != n or res["bytes"] != total:
        raise BenchError(f"load into {target} copied {res['files']} files / {res['bytes']} "
                         f"bytes, expected {n} / {total}")
    if res["sources"] != {"original": n} or res["last_event_id"] != 3:
        raise BenchError(f"load into {target}: unexpected result {res}")
    want = {f"p={k}" for k in range(min(s.partitions, n))}
    if set(ans["partitions"]) != want:
        raise BenchError(f"{target}.{TABLE} has partitions {sorted(ans['partitions'])[:5]}..., "
                         f"expected {sorted(want)[:5]}...")
    dst = Path(ans["location"])
    expected = src.expected()
    got = file_sizes(dst)
    if got != {k: v[0] for k, v in expected.items()}:
        extra = sorted(set(got) - set(expected))[:3]
        missing = sorted(set(expected) - set(got))[:3]
        raise BenchError(f"{dst}: files differ from the source (extra {extra}, missing "
                         f"{missing}, or sizes differ)")
    for rel in sorted(expected)[:: max(1, n // SAMPLE)]:
        if cks.of_local_file(str(dst / rel)) != expected[rel][1]:
            raise BenchError(f"{dst / rel}: checksum differs from the source's")


def xxhsum_checksums(output: bytes) -> dict[str, str]:
    """Path -> checksum from `xxhsum -H2` output lines ("<hash>  <path>")."""
    out = {}
    for line in output.decode().splitlines():
        if line.strip():
            digest, _, path = line.partition("  ")
            out[path] = digest
    return out


# -- the benchmark -----------------------------------------------------------------------------
def bench_load(work: Path, s: Scale, reps: int, phases: bool, conf: Sequence[str]
               ) -> tuple[list[Row], dict[str, float]]:
    log(f"generating {s.files:,} files, {human_size(s.total)} in all")
    src = make_source(work, s)
    dump_url, warm_url = work / "dump", work / "dump-warmup"
    write_dump(dump_url, src, src.files)
    write_dump(warm_url, src, src.files[: s.warmup_files])
    label = f"load {s.files:,} files, {human_size(s.total)} (local[2])"
    main = Row("load", label, "cp -r", GOAL)
    rows = [main]
    verified = None
    if xxhsum_available():
        verified = Row("load-vs-verified-copy", label, "cp -r + xxhsum -H2", None)
        rows.append(verified)
    else:
        log(f"no xxhsum: the cp -r + xxhsum row is left out ({XXHSUM_HINT})")
    totals: dict[str, float] = {}
    sync()
    log("starting the destination Spark session (local[2], Hive, Derby)")
    with running_worker(work, conf) as w:
        w.call({"op": "load", "dump": str(warm_url), "target": "bench_warmup"})
        w.call({"op": "drop", "db": "bench_warmup"})
        log("Spark session up and warmed up (one untimed small load)")
        for rep in range(reps):
            def cmroot_side(rep: int = rep) -> None:
                target = f"bench_{rep}"
                warm(src.table_dir)
                sync()
                for r in rows:
                    r.load.append(loadavg())
                ans = w.call({"op": "load", "dump": str(dump_url), "target": target,
                              "phases": phases})
                for r in rows:
                    r.cmroot.append(ans["seconds"])
                for k, v in ans["phases"].items():
                    totals[k] = totals.get(k, 0.0) + v
                log(f"rep {rep + 1}: load {ans['seconds']:.2f} s")
                check_load(ans, src, s, target)
                w.call({"op": "drop", "db": target})
                if Path(ans["location"]).exists():
                    raise BenchError(f"DROP DATABASE {target} CASCADE left {ans['location']}")

            def cp_side(rep: int = rep) -> None:
                dst = work / f"cp-{rep}"
                warm(src.table_dir)
                sync()
                main.load.append(loadavg())
                t = time.perf_counter()
                run(["cp", "-r", str(src.table_dir), str(dst)])
                main.baseline.append(time.perf_counter() - t)
                log(f"rep {rep + 1}: cp -r {main.baseline[-1]:.2f} s")
                if file_sizes(dst) != {k: v[0] for k, v in src.expected().items()}:
                    raise BenchError(f"cp -r left a different tree in {dst}")
                shutil.rmtree(dst)

            def verified_side(rep: int = rep) -> None:
                assert verified is not None
                dst = work / f"cpx-{rep}"
                warm(src.table_dir)
                sync()
                verified.load.append(loadavg())
                t = time.perf_counter()
                run(["cp", "-r", str(src.table_dir), str(dst)])
                out = run(["find", str(dst), "-type", "f", "-exec", "xxhsum", "-H2", "{}",
                           "+"]).stdout
                verified.baseline.append(time.perf_counter() - t)
                log(f"rep {rep + 1}: cp -r + xxhsum -H2 {verified.baseline[-1]:.2f} s")
                sums = {os.path.relpath(p, dst): c for p, c in xxhsum_checksums(out).items()}
                if sums != {k: v[1] for k, v in src.expected().items()}:
                    raise BenchError("xxhsum -H2 of the copies differs from cmroot's checksums")
                shutil.rmtree(dst)

            sides: list[Callable[[], None]] = [cmroot_side, cp_side]
            if verified is not None:
                sides.append(verified_side)
            alternate(rep, sides)
    return rows, {k: v / reps for k, v in totals.items()}


def run_benchmarks(
    scale: str = "full", directory: str | os.PathLike[str] | None = None, reps: int | None = None,
    phases: bool = False, conf: Sequence[str] = (),
) -> tuple[list[Row], dict[str, float]]:
    """Run the load benchmark in a fresh scratch directory (removed at the end); returns
    the rows and, with `phases`, the mean seconds per load phase."""
    s = SCALES[scale]
    reps = reps or s.reps
    for tool in ("cp", "find", "cat", "java"):
        if shutil.which(tool) is None:
            raise BenchError(f"{tool} not found: the benchmark needs coreutils, findutils and "
                             "a Java runtime for Spark")
    work = make_work_dir("cmroot-benchrepl-", directory, scale, reps, s.disk_needed)
    try:
        return bench_load(work, s, reps, phases, conf)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def format_table(rows: Sequence[Row]) -> str:
    lines = list(TABLE_HEADER)
    for r in rows:
        goal = "- (info)" if r.goal is None else (
            f">= {r.goal:g}x ({'met' if r.met else 'MISSED'})")
        lines.append(
            f"| {r.label} | {fmt_seconds(r.cmroot_median)} | "
            f"{fmt_seconds(r.baseline_median)} ({r.baseline_label}) | {fmt_speed(r.speed)} | "
            f"{goal} |"
        )
    return "\n".join(lines)


def format_notes(rows: Sequence[Row], reps: int) -> str:
    def secs(ts: Sequence[float]) -> str:
        return ", ".join(f"{t:.3f}" for t in ts)

    lines = [
        f"median of {reps} run(s) per side; ratio = cmroot's throughput relative to the "
        "baseline = median(baseline s) / median(load s), higher is better; the sides "
        "alternate going first",
        "load is timed around `cmroot.repl.load.load()` in a warm Spark session (JVM start "
        "and one small warm-up load untimed); it includes the checksum of every byte, the "
        "publish renames, a syncfs and the metastore calls; `cp -r` does none of these",
        CACHE_NOTE,
        "all runs (s):",
        f"  load: [{secs(rows[0].cmroot)}]",
        *(f"  {r.baseline_label}: [{secs(r.baseline)}] per-run ratio "
          f"[{', '.join(fmt_speed(b / c) for c, b in zip(r.cmroot, r.baseline, strict=True))}]"
          for r in rows),
    ]
    cpus = os.cpu_count() or 1
    loads = [x for r in rows for x in r.load]
    if loads:
        lines.append(f"1-min load average before the timed runs: max {max(loads):.2f}, "
                     f"median {statistics.median(loads):.2f} on {cpus} CPU(s)")
        if max(loads) > cpus:
            lines.append("WARNING: other processes were competing for CPU/disk during this "
                         "run; figures are noisy, rerun on a quiet machine before comparing")
    return "\n".join(lines)


def format_phases(phases: dict[str, float], load_seconds: float) -> str:
    lines = [f"load phases, mean per run (of {load_seconds:.2f} s median wall, instrumented):"]
    for k, v in phases.items():
        lines.append(f"  {k:<48} {v:8.3f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        conf = [argv[i + 1] for i, a in enumerate(argv) if a == "--spark-conf"]
        return worker(Path(argv[1]), conf)
    ap = arg_parser(
        "python -m tests.bench.bench_repl",
        "cmroot repl load (Spark local[2]) of 10,000 files / 2 GiB against cp -r of the "
        "same files, in the same run.",
        SCALES, BENCHMARKS, "repetitions per side (default: 3 full, 1 smoke)",
    )
    ap.add_argument("--phases", action="store_true",
                    help="also time the load's phases (Spark job, renames, syncfs, SQL)")
    ap.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting for the destination session (repeatable)")
    args, reps, only = parse_args(ap, argv, SCALES)
    try:
        check_names(only or [], BENCHMARKS)
        rows, phases = run_benchmarks(args.scale, args.dir, reps, args.phases, args.spark_conf)
    except BenchError as e:
        print(f"bench_repl: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print()
    print(format_notes(rows, reps))
    if args.phases:
        print()
        print(format_phases(phases, rows[0].cmroot_median))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Daemon benchmarks: each `cmroot serve` figure beside a baseline measured in the same run.

    python -m tests.bench.bench_daemon [--scale full|smoke] [--dir DIR] [--reps N]
                                       [--only get-large,get-small,resolve,recycle,rss]
                                       [--rss-entries N]

Rows (full scale):
  get-large  GET of a 1 GiB recycled object (`GET /v1/files?path=&checksum=`, served from
             the store) vs nginx (sendfile on, one process) serving the same object file
             from the store's objects dir. wrk -t1 -c1 -d5s on both; MB/s (10^6 bytes).
  get-small  GET of 64 KiB objects, wrk -t2 -c16 -d5s, a Lua script picking among 1,000
             distinct recycled objects (same pseudo-random sequence on both sides); req/s.
  processes  get-small's load on a second daemon with server.processes = 2 (on a `cp -a`
             copy of the store) vs the one-process daemon; the goal is growth (> 1x).
  get-small-2  the same two-process runs vs nginx (>= 0.5x).
  resolve    POST /v1/resolve, 5 batches of 10,000 pairs (half still at their original
             path, half recycled), through `cmroot.client.Client`, vs the same batches
             resolved in-process by `Store.resolve` on the same index; pairs/s. The goal is
             absolute (the daemon at >= 200,000 pairs/s); the ratio is daemon / library.
  recycle    POST /v1/recycle of a table dir of 2,000 x 64 KiB files vs `Store.recycle`
             in-process on an identical tree (fresh random content every repetition, so no
             deduplication on either side); seconds, goal <= 1.3x.
  rss        peak RSS (VmHWM) of the daemon serving an index of 1,000,000 entries (filled
             directly with `Index.commit_recycle`, 10,000 synthetic entries per batch, plus a
             few real recycled objects) after a few resolve batches and GETs, vs the same
             daemon and the same requests on an index holding only the real objects; MiB,
             goal absolute (<= 150 MiB).

Fairness: both sides run on this machine at once-generated data with a warm page cache;
`sync` runs after data generation and before each timed recycle. Where a row has
repetitions the sides alternate going first, and each figure is the median. wrk is the
same binary with the same flags on both sides; its 8 KiB reads can cap the large-object
throughput of both servers alike (then the ratio tends to 1).

The daemon is started as `python -m cmroot.cli serve --config <temp toml>` with `CMROOT_*`
variables removed from its environment (no tokens: loopback, open). Progress goes to
stderr, the table to stdout.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import xxhash

from cmroot.client import Client
from cmroot.config import Config, load
from cmroot.index import Entry, Event, Index
from cmroot.store import RecycleRequest, Store
from cmroot.store.layout import shard_of

from .harness import (
    TABLE_HEADER,
    BenchError,
    GiB,
    KiB,
    Medians,
    MiB,
    alternate,
    arg_parser,
    check_names,
    human_size,
    log,
    make_work_dir,
    parse_args,
    sync,
)

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = ("get-large", "get-small", "processes", "get-small-2", "resolve", "recycle", "rss")
# The rows measured against a second daemon with server.processes = 2.
TWO_PROCESS_ROWS = ("processes", "get-small-2")
NGINX = "/usr/sbin/nginx"
HINTS = {
    "nginx": "nginx not found: install the Debian/Ubuntu package `nginx` (apt-get install nginx)",
    "wrk": "wrk not found: install the Debian/Ubuntu package `wrk` (apt-get install wrk)",
}


@dataclass(frozen=True)
class Scale:
    reps: int
    large_size: int
    small_objects: int
    small_size: int
    wrk_seconds: int
    resolve_batch: int
    resolve_batches: int
    resolve_file_size: int
    recycle_files: int
    recycle_size: int
    rss_entries: int
    rss_batch: int
    rss_real: int
    rss_resolves: int
    disk_needed: int


SCALES = {
    "full": Scale(
        reps=3,
        large_size=1 * GiB,
        small_objects=1_000, small_size=64 * KiB,
        wrk_seconds=5,
        resolve_batch=10_000, resolve_batches=5, resolve_file_size=1 * KiB,
        recycle_files=2_000, recycle_size=64 * KiB,
        rss_entries=1_000_000, rss_batch=10_000, rss_real=10, rss_resolves=5,
        disk_needed=6 * GiB,
    ),
    "smoke": Scale(
        reps=1,
        large_size=8 * MiB,
        small_objects=50, small_size=64 * KiB,
        wrk_seconds=1,
        resolve_batch=500, resolve_batches=2, resolve_file_size=1 * KiB,
        recycle_files=200, recycle_size=16 * KiB,
        rss_entries=10_000, rss_batch=5_000, rss_real=4, rss_resolves=1,
        disk_needed=256 * MiB,
    ),
}


@dataclass
class Row(Medians):
    """One benchmark: cmroot's figures and the baseline's, one per repetition.

    `higher` says whether a bigger number is better (throughput) or worse (time, memory).
    `goal_kind` is "ratio" (goal on cmroot/baseline) or "absolute" (goal on cmroot alone)."""

    name: str
    label: str
    baseline_label: str
    unit: str
    higher: bool
    goal_kind: str
    goal: float
    goal_text: str
    cmroot: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def met(self) -> bool:
        value = self.ratio if self.goal_kind == "ratio" else self.cmroot_median
        return value >= self.goal if self.higher else value <= self.goal


# -- small helpers ----------------------------------------------------------------------------
def fmt_value(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.2f} s" if v >= 0.1 else f"{v * 1000:.1f} ms"
    if unit == "MiB":
        return f"{v:.1f} MiB"
    return f"{v:,.0f} {unit}"


def run(cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    p = subprocess.run(list(cmd), capture_output=True, **kw)
    if p.returncode != 0:
        raise BenchError(
            f"{' '.join(cmd)!r} failed ({p.returncode}): {p.stderr.decode(errors='replace')}"
        )
    return p


def warm(path: Path) -> None:
    """Read every file under `path` once, so a timed side finds its data in the page cache."""
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while fh.read(4 * MiB):
                    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise BenchError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def stop_process(proc: subprocess.Popen[bytes], what: str, grace: float = 60.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        log(f"{what} (pid {proc.pid}) ignored SIGTERM for {grace:.0f} s: killing it")
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its children (a daemon's serving processes), from
    /proc/<pid>/stat."""
    total = 0
    for one in (pid, *child_pids(pid)):
        with suppress(OSError), open(f"/proc/{one}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with suppress(OSError), open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(name))
    return out


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in bytes, from /proc/<pid>/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * KiB
    return out


def write_config(path: Path, store_root: Path, warehouse: Path, port: int) -> Path:
    path.write_text(
        "[store]\n"
        f"root = {json.dumps(str(store_root))}\n"
        f"warehouse_roots = [{json.dumps(str(warehouse))}]\n"
        'retain = "7d"\n'
        'interval = "24h"\n'
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "[index]\n"
        f"path = {json.dumps(str(store_root / 'index.sqlite'))}\n"
    )
    return path


def load_config(path: Path) -> Config:
    return load(path, env={})  # exactly the file: no CMROOT_* overrides from this shell


def write_random_files(
    top: Path, count: int, size: int, partitions: int = 1, progress: bool = False
) -> list[tuple[str, str]]:
    """`count` distinct random files of `size` bytes under `top`/dt=NNNNN/; returns
    (path, xxh3-128) of each."""
    partitions = max(1, min(partitions, count))
    out = []
    step = max(1, count // 5)
    for i in range(count):
        part = top / f"dt={i % partitions:05d}" if partitions > 1 else top
        if i < partitions:
            part.mkdir(parents=True, exist_ok=True)
        p = part / f"part-{i:07d}.parquet"
        h = xxhash.xxh3_128()
        with open(p, "wb") as f:
            left = size
            while left:
                chunk = os.urandom(min(left, 16 * MiB))
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        out.append((str(p), h.hexdigest()))
        if progress and ((i + 1) % step == 0 or size >= 256 * MiB):
            log(f"  generated {i + 1:,}/{count:,} files under {top.name}")
    return out


def recycle_in_process(cfg: Config, paths: Sequence[str], table: str) -> list[tuple[str, str]]:
    """Recycle `paths` with the library (the daemon is not running); (path, checksum) each."""
    with Store.open(cfg) as store:
        res = store.recycle(
            RecycleRequest(paths=list(paths), mode="move", op="DROP_TABLE", db="db", table=table)
        )
    return [(f.path, f.checksum) for f in res.files]


def files_url(path: str, checksum: str) -> str:
    return "/v1/files?" + urlencode({"path": path, "checksum": checksum})


def object_url(checksum: str) -> str:
    """An object's URL on the nginx baseline, whose root is the store's `objects/` (the
    stores this bench makes are new, so one-level: see cmroot.store.layout.local)."""
    return f"/{shard_of(checksum, 1)}/{checksum}"


def fetch(port: int, url: str, expect_checksum: str | None = None) -> tuple[int, dict[str, str]]:
    """GET url and return (byte count, headers); verify status 200 and, if given, the hash."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("GET", url)
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"GET {url} on port {port}: HTTP {resp.status} {resp.read()[:300]!r}")
        h = xxhash.xxh3_128()
        n = 0
        while chunk := resp.read(4 * MiB):
            h.update(chunk)
            n += len(chunk)
        if expect_checksum is not None and h.hexdigest() != expect_checksum:
            raise BenchError(f"GET {url} on port {port}: wrong bytes (checksum {h.hexdigest()})")
        return n, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


# -- the daemon and nginx ---------------------------------------------------------------------
class Daemon:
    """`cmroot serve` on a store, as a subprocess; its log goes to <work>/<name>.log."""

    def __init__(self, work: Path, name: str, store_root: Path, warehouse: Path,
                 processes: int = 1) -> None:
        self.name = name
        self.processes = processes
        self.port = free_port()
        self.config = write_config(work / f"{name}.toml", store_root, warehouse, self.port)
        self.log_path = work / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 300.0) -> float:
        """Start and wait for /readyz; returns the seconds it took."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CMROOT_")}
        env.pop("AIOHTTP_NOSENDFILE", None)
        env["CMROOT_SERVER_PROCESSES"] = str(self.processes)
        t = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cmroot.cli", "serve", "--config", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env, cwd=REPO,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"cmroot serve ({self.name}) exited with {self.proc.returncode}: "
                    f"{self.log_tail()}"
                )
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/readyz")
                status = conn.getresponse().status
                conn.close()
                if status == 200 and self.serving():
                    return time.perf_counter() - t
            except OSError:
                pass
            time.sleep(0.05)
        raise BenchError(f"cmroot serve ({self.name}) not ready after {timeout:.0f} s")

    def serving(self) -> bool:
        """Whether it says it serves: then its serving processes listen too (before, wrk's
        connections would all land on the primary, and keep to it for the whole run)."""
        try:
            return '"msg": "serving"' in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, f"cmroot serve ({self.name})")
            if self.proc.returncode not in (0, -signal.SIGTERM):
                log(f"cmroot serve ({self.name}) exited with {self.proc.returncode}: "
                    f"{self.log_tail()}")


@contextmanager
def running_daemon(work: Path, name: str, store_root: Path, warehouse: Path,
                   processes: int = 1) -> Iterator[Daemon]:
    d = Daemon(work, name, store_root, warehouse, processes)
    try:
        took = d.start()
        log(f"cmroot serve ({name}) ready on port {d.port} (pid {d.pid}) in {took:.2f} s")
        yield d
    finally:
        d.stop()


NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 75s;
    keepalive_requests 1000000;
    default_type application/octet-stream;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


@contextmanager
def running_nginx(work: Path, root: Path) -> Iterator[tuple[int, int]]:
    """nginx in the foreground, one process (master_process off), serving `root`;
    yields (port, pid)."""
    tmp = work / "nginx"
    tmp.mkdir(exist_ok=True)
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, root=root))
    with open(tmp / "stderr.log", "ab") as logf:
        proc = subprocess.Popen(
            [NGINX, "-p", f"{tmp}/", "-c", str(conf), "-e", str(tmp / "error.log")],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
        )
    try:
        wait_port(port, proc, "nginx")
        log(f"nginx ready on port {port} (pid {proc.pid}), root {root}")
        yield port, proc.pid
    finally:
        stop_process(proc, "nginx", grace=10)


# -- wrk --------------------------------------------------------------------------------------
WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRKRESULT %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f\\n",
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""

WRK_PICK = """
local paths = {{
{paths}
}}
local n = #paths
local counter = 1
function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end
function init(args)
  math.randomseed(7919 * id)
end
request = function()
  return wrk.format("GET", paths[math.random(n)])
end
"""


@dataclass(frozen=True)
class WrkResult:
    seconds: float
    requests: int
    bytes: int
    cpu: float  # server CPU seconds used during the run

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds


def wrk_script(path: Path, urls: Sequence[str] | None) -> Path:
    body = ""
    if urls is not None:
        body = WRK_PICK.format(paths=",\n".join(json.dumps(u) for u in urls))
    path.write_text(body + WRK_DONE)
    return path


def run_wrk(
    port: int, url: str, script: Path, threads: int, conns: int, seconds: int, server_pid: int
) -> WrkResult:
    cmd = [
        "wrk", "-t", str(threads), "-c", str(conns), "-d", f"{seconds}s", "--timeout", "120s",
        "-s", str(script), f"http://127.0.0.1:{port}{url}",
    ]
    cpu0 = cpu_seconds(server_pid)
    p = run(cmd, timeout=seconds + 300)
    cpu = cpu_seconds(server_pid) - cpu0
    out = p.stdout.decode(errors="replace")
    line = next((x for x in out.splitlines() if x.startswith("WRKRESULT ")), None)
    if line is None:
        raise BenchError(f"no result from wrk: {out[-1000:]}")
    dur, reqs, nbytes, e_conn, e_read, e_write, e_status, e_timeout = (
        int(float(v)) for v in line.split()[1:]
    )
    if e_status or e_conn or e_timeout:
        raise BenchError(
            f"wrk on port {port}: {e_status} non-2xx answers, {e_conn} connect errors, "
            f"{e_timeout} timeouts (read {e_read}, write {e_write}): {out[-1000:]}"
        )
    if nbytes <= 0 or dur <= 0:
        raise BenchError(f"wrk on port {port} received nothing: {out[-1000:]}")
    return WrkResult(dur / 1e6, reqs, nbytes, cpu)


# -- benchmarks -------------------------------------------------------------------------------
@dataclass
class MainData:
    """What the shared daemon's store holds, recycled before the daemon started."""

    large: tuple[str, str] | None = None
    small: list[tuple[str, str]] = field(default_factory=list)
    resolve_batches: list[list[dict[str, str]]] = field(default_factory=list)
    resolve_expect: dict[str, int] = field(default_factory=dict)


def prepare_main(work: Path, warehouse: Path, cfg: Config, s: Scale, names: Sequence[str]
                 ) -> MainData:
    data = MainData()
    if "get-large" in names:
        log(f"get-large: generating one {human_size(s.large_size)} file")
        files = write_random_files(warehouse / "db" / "large", 1, s.large_size, progress=True)
        log("get-large: recycling it (in-process, before the daemon starts)")
        [data.large] = recycle_in_process(cfg, [files[0][0]], "large")
        if data.large[1] != files[0][1]:
            raise BenchError("the store's checksum of the large file differs from xxhash's")
    if {"get-small", *TWO_PROCESS_ROWS} & set(names):
        log(f"get-small: generating {s.small_objects:,} x {human_size(s.small_size)} files")
        files = write_random_files(warehouse / "db" / "small", s.small_objects, s.small_size, 10)
        data.small = recycle_in_process(cfg, [str(warehouse / "db" / "small")], "small")
        if sorted(c for _, c in data.small) != sorted(c for _, c in files):
            raise BenchError("the store's checksums of the small files differ from xxhash's")
    if "resolve" in names:
        total = s.resolve_batch * s.resolve_batches
        n_gone = total // 2
        log(f"resolve: generating {total:,} x {human_size(s.resolve_file_size)} files "
            f"({n_gone:,} to recycle, {total - n_gone:,} to stay)")
        live = write_random_files(
            warehouse / "db" / "resolve_live", total - n_gone, s.resolve_file_size, 100, True
        )
        write_random_files(warehouse / "db" / "resolve_gone", n_gone, s.resolve_file_size, 100,
                           True)
        log(f"resolve: recycling {n_gone:,} files (in-process)")
        gone = recycle_in_process(cfg, [str(warehouse / "db" / "resolve_gone")], "resolve_gone")
        pairs = [{"path": p, "checksum": c} for p, c in live + gone]
        random.Random(42).shuffle(pairs)
        data.resolve_batches = [
            pairs[i : i + s.resolve_batch] for i in range(0, len(pairs), s.resolve_batch)
        ]
        data.resolve_expect = {"original": len(live), "cmroot": len(gone)}
    sync()
    return data


def bench_get_large(work: Path, row: Row, daemon: Daemon, nginx: tuple[int, int],
                    data: MainData, s: Scale, reps: int) -> Row:
    assert data.large is not None
    path, checksum = data.large
    url, nurl = files_url(path, checksum), object_url(checksum)
    log("get-large: checking both servers return the object (length, bytes, status)")
    n, headers = fetch(daemon.port, url, checksum)
    if n != s.large_size or headers.get("x-cmroot-status") != "cmroot":
        raise BenchError(f"daemon served {n} bytes, status {headers.get('x-cmroot-status')}")
    n, _ = fetch(nginx[0], nurl)
    if n != s.large_size:
        raise BenchError(f"nginx served {n} bytes of {s.large_size}")
    script = wrk_script(work / "large.lua", None)
    cpu: dict[str, list[float]] = {"cmroot": [], "nginx": []}

    def side(which: str, rep: int) -> None:
        port, url_, pid = (
            (daemon.port, url, daemon.pid) if which == "cmroot" else (nginx[0], nurl, nginx[1])
        )
        r = run_wrk(port, url_, script, 1, 1, s.wrk_seconds, pid)
        (row.cmroot if which == "cmroot" else row.baseline).append(r.mb_per_s)
        cpu[which].append(r.cpu / r.seconds)
        log(f"get-large: rep {rep + 1}: {which} {r.mb_per_s:,.0f} MB/s "
            f"({r.requests} complete responses, server CPU {r.cpu / r.seconds:.0%})")

    for rep in range(reps):
        alternate(rep, [lambda rep=rep: side("cmroot", rep), lambda rep=rep: side("nginx", rep)])
    row.notes.append(server_cpu_note(row.name, cpu))
    return row


def server_cpu_note(name: str, cpu: dict[str, list[float]]) -> str:
    return f"{name}: server CPU during the runs (share of one core, median): " + ", ".join(
        f"{k} {statistics.median(v):.0%}" for k, v in cpu.items()
    )


def bench_get_small(work: Path, row: Row, daemon: Daemon, nginx: tuple[int, int],
                    data: MainData, s: Scale, reps: int) -> Row:
    log("get-small: checking a few objects through both servers")
    for path, checksum in data.small[:5]:
        fetch(daemon.port, files_url(path, checksum), checksum)
        fetch(nginx[0], object_url(checksum), checksum)
    cm_script = wrk_script(work / "small-cmroot.lua", [files_url(p, c) for p, c in data.small])
    ng_script = wrk_script(work / "small-nginx.lua", [object_url(c) for _, c in data.small])
    first_cm = files_url(*data.small[0])
    first_ng = object_url(data.small[0][1])
    cpu: dict[str, list[float]] = {"cmroot": [], "nginx": []}

    def side(which: str, rep: int) -> None:
        if which == "cmroot":
            r = run_wrk(daemon.port, first_cm, cm_script, 2, 16, s.wrk_seconds, daemon.pid)
            row.cmroot.append(r.req_per_s)
        else:
            r = run_wrk(nginx[0], first_ng, ng_script, 2, 16, s.wrk_seconds, nginx[1])
            row.baseline.append(r.req_per_s)
        cpu[which].append(r.cpu / r.seconds)
        log(f"get-small: rep {rep + 1}: {which} {r.req_per_s:,.0f} req/s "
            f"({r.mb_per_s:,.0f} MB/s, server CPU {r.cpu / r.seconds:.0%})")

    for rep in range(reps):
        alternate(rep, [lambda rep=rep: side("cmroot", rep), lambda rep=rep: side("nginx", rep)])
    row.notes.append(server_cpu_note(row.name, cpu))
    return row


def bench_processes(work: Path, rows: tuple[Row, Row], one: Daemon, two: Daemon,
                    nginx: tuple[int, int], data: MainData, s: Scale, reps: int) -> None:
    """get-small's load against a daemon with server.processes = 2 (on a copy of the
    store), beside the same daemon with one process and beside nginx, in turn: `rows` are
    (2 processes vs 1, 2 processes vs nginx)."""
    scaling, vs_nginx = rows
    for path, checksum in data.small[:5]:
        fetch(two.port, files_url(path, checksum), checksum)
    cm_script = wrk_script(work / "small-cmroot.lua", [files_url(p, c) for p, c in data.small])
    ng_script = wrk_script(work / "small-nginx.lua", [object_url(c) for _, c in data.small])
    first_cm = files_url(*data.small[0])
    first_ng = object_url(data.small[0][1])

    def side(which: str, rep: int) -> None:
        if which == "nginx":
            r = run_wrk(nginx[0], first_ng, ng_script, 2, 16, s.wrk_seconds, nginx[1])
            vs_nginx.baseline.append(r.req_per_s)
        else:
            d = two if which == "2 processes" else one
            r = run_wrk(d.port, first_cm, cm_script, 2, 16, s.wrk_seconds, d.pid)
            if d is two:
                scaling.cmroot.append(r.req_per_s)
                vs_nginx.cmroot.append(r.req_per_s)
            else:
                scaling.baseline.append(r.req_per_s)
        log(f"processes: rep {rep + 1}: {which} {r.req_per_s:,.0f} req/s "
            f"(server CPU {r.cpu / r.seconds:.0%} of one core)")

    for rep in range(reps):
        alternate(rep, [lambda rep=rep, w=w: side(w, rep)
                        for w in ("2 processes", "1 process", "nginx")])
    scaling.notes.append(
        f"processes: {os.cpu_count()} CPUs shared by the daemon's processes and wrk's 2 threads"
    )


def count_statuses(results: Sequence[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        status = r["status"] if isinstance(r, dict) else r.status
        out[status] = out.get(status, 0) + 1
    return out


def bench_resolve(row: Row, daemon: Daemon, cfg: Config, data: MainData, reps: int) -> Row:
    batches = data.resolve_batches
    pairs = sum(len(b) for b in batches)
    client = Client(daemon.url)
    log(f"resolve: warm-up pass through the daemon ({len(batches)} x {len(batches[0]):,} pairs;"
        " fills the checksum cache of the originals)")
    for b in batches:
        client.resolve(b)
    # The daemon holds the store's lock; a read-only Store reads the same index (and the
    # checksum cache the daemon just filled) without it.
    lib = Store(cfg.store, Index(cfg.index_path), readonly=True)
    try:
        want = data.resolve_expect

        def daemon_side(rep: int) -> None:
            got: dict[str, int] = {}
            t = time.perf_counter()
            for b in batches:
                for k, v in count_statuses(client.resolve(b)["files"]).items():
                    got[k] = got.get(k, 0) + v
            dt = time.perf_counter() - t
            if got != want:
                raise BenchError(f"daemon resolved {got}, expected {want}")
            row.cmroot.append(pairs / dt)
            log(f"resolve: rep {rep + 1}: daemon {pairs / dt:,.0f} pairs/s")

        def library_side(rep: int) -> None:
            got: dict[str, int] = {}
            t = time.perf_counter()
            for b in batches:
                for k, v in count_statuses(lib.resolve(b)).items():
                    got[k] = got.get(k, 0) + v
            dt = time.perf_counter() - t
            if got != want:
                raise BenchError(f"Store.resolve resolved {got}, expected {want}")
            row.baseline.append(pairs / dt)
            log(f"resolve: rep {rep + 1}: library {pairs / dt:,.0f} pairs/s")

        for rep in range(reps):
            alternate(rep, [lambda rep=rep: daemon_side(rep), lambda rep=rep: library_side(rep)])
    finally:
        lib.close()
        client.close()
    row.notes.append(
        f"resolve: {len(batches)} batches of {len(batches[0]):,} pairs per repetition, "
        f"{want['original']:,} original + {want['cmroot']:,} cmroot; checksum cache warm on "
        "both sides; the daemon figure includes the client's JSON encoding and decoding"
    )
    return row


def bench_recycle(work: Path, row: Row, daemon: Daemon, warehouse: Path, s: Scale,
                  reps: int) -> Row:
    lib_root = work / "store-lib"
    lib_cfg = load_config(write_config(work / "store-lib.toml", lib_root, warehouse, 0))
    client = Client(daemon.url)
    lib = Store.open(lib_cfg)
    n = s.recycle_files
    try:
        for rep in range(reps):
            api_tree = warehouse / "db" / f"recycle_api_{rep}"
            lib_tree = warehouse / "db" / f"recycle_lib_{rep}"
            log(f"recycle: rep {rep + 1}/{reps}: generating {n:,} x {human_size(s.recycle_size)}"
                " files (fresh content) and an identical copy (cp -a)")
            write_random_files(api_tree, n, s.recycle_size, 20)
            run(["cp", "-a", str(api_tree), str(lib_tree)])
            sync()

            def api_side(rep: int = rep, tree: Path = api_tree) -> None:
                warm(tree)
                sync()
                t = time.perf_counter()
                res = client.recycle([str(tree)], op="DROP_TABLE", db="db", table=tree.name)
                dt = time.perf_counter() - t
                if len(res["files"]) != n or tree.exists():
                    raise BenchError(f"the daemon recycled {len(res['files'])} of {n} files")
                row.cmroot.append(dt)
                log(f"recycle: rep {rep + 1}: daemon {fmt_value(dt, 's')}")

            def lib_side(rep: int = rep, tree: Path = lib_tree) -> None:
                warm(tree)
                sync()
                req = RecycleRequest(
                    paths=[str(tree)], mode="move", op="DROP_TABLE", db="db", table=tree.name
                )
                t = time.perf_counter()
                res = lib.recycle(req)
                dt = time.perf_counter() - t
                if len(res.files) != n or tree.exists():
                    raise BenchError(f"Store.recycle recycled {len(res.files)} of {n} files")
                row.baseline.append(dt)
                log(f"recycle: rep {rep + 1}: library {fmt_value(dt, 's')}")

            alternate(rep, [api_side, lib_side])
    finally:
        lib.close()
        client.close()
    row.notes.append(
        "recycle: daemon store and library store on the same filesystem, each opened once; "
        "the daemon figure is the whole HTTP round trip (client JSON included)"
    )
    return row


def build_rss_store(work: Path, name: str, warehouse: Path, s: Scale, synthetic: int,
                    real_master: Path) -> tuple[Path, list[tuple[str, str]]]:
    """A store holding the real objects (recycled from a copy of `real_master`) and
    `synthetic` extra entries written straight into its index."""
    root = work / name
    cfg = load_config(write_config(work / f"{name}-setup.toml", root, warehouse, 0))
    tree = warehouse / "db" / f"rss_{name}"
    tree.parent.mkdir(parents=True, exist_ok=True)  # `--only rss`: no other row made it
    run(["cp", "-a", str(real_master), str(tree)])
    real = recycle_in_process(cfg, [str(tree)], tree.name)
    if synthetic:
        log(f"rss: writing {synthetic:,} synthetic entries into {name}'s index "
            f"({s.rss_batch:,} per commit)")
        index = Index(cfg.index_path)
        try:
            now = time.time()
            step = max(1, synthetic // s.rss_batch // 10)
            for b, start in enumerate(range(0, synthetic, s.rss_batch)):
                entries = [synthetic_entry(warehouse, i, now) for i in
                           range(start, min(start + s.rss_batch, synthetic))]
                parts = sorted({json.dumps(e.partition, sort_keys=True) for e in entries})
                event = Event(
                    0, "DROP_PARTITION", "db", "big", [json.loads(p) for p in parts], now,
                    "bench", False,
                    [{"path": e.path, "checksum": e.checksum, "size": e.size} for e in entries],
                )
                index.commit_recycle(None, event, entries)
                if (b + 1) % step == 0:
                    log(f"  {start + len(entries):,}/{synthetic:,} entries")
        finally:
            index.close()
    sync()
    return root, real


def synthetic_entry(warehouse: Path, i: int, now: float) -> Entry:
    dt = f"{i // 1000:05d}"
    return Entry(
        path=f"{warehouse}/db/big/dt={dt}/part-{i:07d}-c000.snappy.parquet",
        checksum=synthetic_checksum(i),
        size=64 * KiB,
        recycled=now,
        expires=now + 7 * 86400,
        op="DROP_PARTITION",
        db="db",
        table="big",
        partition={"dt": dt},
        purge=False,
    )


def synthetic_checksum(i: int) -> str:
    return xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little"))


def rss_workload(daemon: Daemon, warehouse: Path, s: Scale, real: list[tuple[str, str]]
                 ) -> dict[str, int]:
    """A few resolve batches (synthetic pairs plus the real ones) and GETs of the real
    objects; then the daemon's memory."""
    client = Client(daemon.url)
    rng = random.Random(7)
    try:
        for _ in range(s.rss_resolves):
            ids = [rng.randrange(s.rss_entries) for _ in range(s.resolve_batch - len(real))]
            pairs = [
                {"path": synthetic_entry(warehouse, i, 0).path, "checksum": synthetic_checksum(i)}
                for i in ids
            ] + [{"path": p, "checksum": c} for p, c in real]
            got = count_statuses(client.resolve(pairs)["files"])
            if got.get("cmroot") != len(real):
                raise BenchError(f"rss: resolve found {got}, expected {len(real)} cmroot")
        for _ in range(2):
            for p, c in real:
                fetch(daemon.port, files_url(p, c), c)
        client.entries(limit=100)
    finally:
        client.close()
    time.sleep(0.2)
    return proc_memory(daemon.pid)


def bench_rss(work: Path, row: Row, warehouse: Path, s: Scale) -> Row:
    real_master = work / "rss-real-master"
    log(f"rss: generating {s.rss_real} real files of 64 KiB")
    write_random_files(real_master, s.rss_real, 64 * KiB)
    empty_root, empty_real = build_rss_store(work, "store-rss-empty", warehouse, s, 0,
                                             real_master)
    big_root, big_real = build_rss_store(work, "store-rss-big", warehouse, s, s.rss_entries,
                                         real_master)
    size = os.path.getsize(big_root / "index.sqlite")
    mem: dict[str, dict[str, int]] = {}
    for which, root, real in (("empty", empty_root, empty_real), ("big", big_root, big_real)):
        with running_daemon(work, f"daemon-rss-{which}", root, warehouse) as d:
            started = proc_memory(d.pid)
            mem[which] = rss_workload(d, warehouse, s, real)
            log(f"rss: {which} index: after start VmRSS {started['VmRSS'] / MiB:.1f} MiB; "
                f"after the requests VmRSS {mem[which]['VmRSS'] / MiB:.1f} MiB, "
                f"VmHWM {mem[which]['VmHWM'] / MiB:.1f} MiB")
    row.cmroot.append(mem["big"]["VmHWM"] / MiB)
    row.baseline.append(mem["empty"]["VmHWM"] / MiB)
    row.notes.append(
        f"rss: VmHWM (peak) after {s.rss_resolves} resolve batch(es) of {s.resolve_batch:,} "
        f"pairs, {2 * s.rss_real} GETs and one entries page; VmRSS then: "
        f"{mem['big']['VmRSS'] / MiB:.1f} MiB ({s.rss_entries:,} entries, index "
        f"{size / MiB:.0f} MiB on disk) vs {mem['empty']['VmRSS'] / MiB:.1f} MiB "
        f"({s.rss_real} entries)"
    )
    return row


# -- driver -----------------------------------------------------------------------------------
def check_tools() -> None:
    if not os.access(NGINX, os.X_OK) and shutil.which("nginx") is None:
        raise BenchError(HINTS["nginx"])
    if shutil.which("wrk") is None:
        raise BenchError(HINTS["wrk"])
    if shutil.which("cp") is None:
        raise BenchError("cp not found: the benchmarks need coreutils")


def missing_tools() -> list[str]:
    """Hints for the tools this benchmark needs that are not installed."""
    out = []
    if not os.access(NGINX, os.X_OK) and shutil.which("nginx") is None:
        out.append(HINTS["nginx"])
    if shutil.which("wrk") is None:
        out.append(HINTS["wrk"])
    return out


def make_rows(s: Scale) -> dict[str, Row]:
    d = f"-d{s.wrk_seconds}s"
    return {
        "get-large": Row(
            "get-large", f"GET {human_size(s.large_size)} object (wrk -t1 -c1 {d})",
            "nginx sendfile", "MB/s", True, "ratio", 0.9, ">= 0.9x nginx",
        ),
        "get-small": Row(
            "get-small",
            f"GET {human_size(s.small_size)} objects, {s.small_objects:,} distinct "
            f"(wrk -t2 -c16 {d})",
            "nginx sendfile", "req/s", True, "ratio", 0.5, ">= 0.5x nginx",
        ),
        "processes": Row(
            "processes",
            f"GET {human_size(s.small_size)} objects (as get-small), server.processes = 2",
            "server.processes = 1", "req/s", True, "ratio", 1.0, "> 1x (grows with processes)",
        ),
        "get-small-2": Row(
            "get-small-2",
            f"GET {human_size(s.small_size)} objects (as get-small), server.processes = 2",
            "nginx sendfile", "req/s", True, "ratio", 0.5, ">= 0.5x nginx",
        ),
        "resolve": Row(
            "resolve", f"POST /v1/resolve, batches of {s.resolve_batch:,} pairs",
            "Store.resolve in-process", "pairs/s", True, "absolute", 200_000,
            ">= 200,000 pairs/s",
        ),
        "recycle": Row(
            "recycle",
            f"POST /v1/recycle of {s.recycle_files:,} x {human_size(s.recycle_size)}",
            "Store.recycle in-process", "s", False, "ratio", 1.3, "<= 1.3x",
        ),
        "rss": Row(
            "rss", f"daemon peak RSS, {s.rss_entries:,} entries indexed",
            "same daemon, empty index", "MiB", False, "absolute", 150, "<= 150 MiB",
        ),
    }


def run_benchmarks(
    scale: str = "full", directory: str | os.PathLike[str] | None = None,
    reps: int | None = None, only: Sequence[str] | None = None,
    rss_entries: int | None = None,
) -> list[Row]:
    """Run the daemon benchmarks at `scale` in a fresh directory under `directory` (default:
    the system temp dir) and return their rows; `rss_entries` overrides the scale's index
    size for the rss row. Raises BenchError if a tool is missing."""
    check_tools()
    s = SCALES[scale]
    if rss_entries is not None:
        # ~820 bytes of index per entry
        s = replace(s, rss_entries=rss_entries,
                    disk_needed=s.disk_needed + rss_entries * KiB)
    reps = reps or s.reps
    names = list(only or BENCHMARKS)
    check_names(names, BENCHMARKS)
    work = make_work_dir("cmroot-bench-daemon-", directory, scale, reps, s.disk_needed)
    load_start = os.getloadavg()[0]
    all_rows = make_rows(s)
    rows: dict[str, Row] = {}
    warehouse = work / "warehouse"
    warehouse.mkdir()
    try:
        main_names = [n for n in names if n != "rss"]
        if main_names:
            store_root = work / "store"
            cfg = load_config(write_config(work / "store-setup.toml", store_root, warehouse, 0))
            data = prepare_main(work, warehouse, cfg, s, main_names)
            with ExitStack() as stack:
                daemon = stack.enter_context(running_daemon(work, "daemon", store_root,
                                                             warehouse))
                nginx = None
                if {"get-large", "get-small", *TWO_PROCESS_ROWS} & set(names):
                    nginx = stack.enter_context(running_nginx(work, store_root / "objects"))
                if "get-large" in names:
                    assert nginx is not None
                    rows["get-large"] = bench_get_large(
                        work, all_rows["get-large"], daemon, nginx, data, s, reps
                    )
                if "get-small" in names:
                    assert nginx is not None
                    rows["get-small"] = bench_get_small(
                        work, all_rows["get-small"], daemon, nginx, data, s, reps
                    )
                if set(TWO_PROCESS_ROWS) & set(names):
                    assert nginx is not None
                    # Its own copy of the store: one primary holds a store's lock.
                    run(["cp", "-a", str(store_root), str(work / "store-2")])
                    two = stack.enter_context(running_daemon(
                        work, "daemon-2", work / "store-2", warehouse, processes=2))
                    pair = (all_rows["processes"], all_rows["get-small-2"])
                    bench_processes(work, pair, daemon, two, nginx, data, s, reps)
                    rows.update((r.name, r) for r in pair if r.name in names)
                if "resolve" in names:
                    rows["resolve"] = bench_resolve(all_rows["resolve"], daemon, cfg, data, reps)
                if "recycle" in names:
                    rows["recycle"] = bench_recycle(
                        work, all_rows["recycle"], daemon, warehouse, s, reps
                    )
        if "rss" in names:
            rows["rss"] = bench_rss(work, all_rows["rss"], warehouse, s)
    finally:
        log(f"removing {work}")
        with suppress(OSError):
            shutil.rmtree(work)
    out = [rows[n] for n in BENCHMARKS if n in rows]
    if out:
        out[0].notes.insert(0, machine_note(load_start))
    return out


def machine_note(load_start: float) -> str:
    """CPUs, load around the run (other work on the machine skews both sides alike) and
    which cmroot sources were measured."""
    note = (
        f"machine: {os.cpu_count()} CPUs, 1-min load average {load_start:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end"
    )
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "cmroot"],
                               capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return note
    if sha:
        note += f"; cmroot sources: git {sha}"
        if dirty:
            note += f" + {len(dirty)} uncommitted file(s) under cmroot/"
    return note


def format_table(rows: Sequence[Row]) -> str:
    lines = list(TABLE_HEADER)
    for r in rows:
        verdict = "met" if r.met else "MISSED"
        lines.append(
            f"| {r.label} | {fmt_value(r.cmroot_median, r.unit)} | "
            f"{fmt_value(r.baseline_median, r.unit)} ({r.baseline_label}) | {r.ratio:.2f}x | "
            f"{r.goal_text} ({verdict}) |"
        )
    return "\n".join(lines)


def format_notes(rows: Sequence[Row], reps: int) -> str:
    lines = [
        f"median of {reps} run(s) per side where a row repeats (rss: one run per side); "
        "ratio = cmroot / baseline; the sides alternate going first",
    ]
    for r in rows:
        lines.extend(r.notes)
    lines.append("all runs: " + "; ".join(
        f"{r.name} cmroot [{', '.join(f'{v:,.3f}' for v in r.cmroot)}] "
        f"baseline [{', '.join(f'{v:,.3f}' for v in r.baseline)}] ({r.unit})"
        for r in rows
    ))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = arg_parser(
        "python -m tests.bench.bench_daemon",
        "cmroot daemon benchmarks, each against a baseline run alongside.",
        SCALES, BENCHMARKS, "repetitions per side (default: 3 full, 1 smoke; rss runs once)",
    )
    ap.add_argument("--rss-entries", type=int, metavar="N",
                    help="entries in the rss row's index (default: 1,000,000 full; the "
                         "issue's figure is 10,000,000: ~8 GB of index, ~30 min to fill)")
    args, reps, only = parse_args(ap, argv, SCALES)
    if args.rss_entries is not None and args.rss_entries < 1:
        ap.error("--rss-entries must be at least 1")
    try:
        rows = run_benchmarks(args.scale, args.dir, reps, only, args.rss_entries)
    except BenchError as e:
        print(f"bench_daemon: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print()
    print(format_notes(rows, reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmark modules share: sizes, errors, progress logging, the scratch directory,
median/ratio arithmetic for a row, the table header, the common command-line options, the
`xxhsum` check and per-phase timing (`--phases`).

Only the standard library is used here, so any bench module (or its worker subprocess) can
import it without pulling in cmroot.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TABLE_HEADER = (
    "| benchmark | cmroot | baseline | ratio | goal |",
    "|---|---|---|---|---|",
)


class BenchError(RuntimeError):
    """The benchmark cannot run or produced a wrong result (not a slow one)."""


class Medians:
    """Median and ratio of a row's per-repetition figures; mixed into each module's `Row`
    dataclass, which declares the `cmroot` and `baseline` lists."""

    cmroot: list[float]
    baseline: list[float]

    @property
    def cmroot_median(self) -> float:
        return statistics.median(self.cmroot)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)

    @property
    def ratio(self) -> float:
        return self.cmroot_median / self.baseline_median


_started = time.monotonic()


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since the benchmarks started."""
    print(f"[{time.monotonic() - _started:7.1f}s] {msg}", file=sys.stderr, flush=True)


def human_size(n: int) -> str:
    """`n` bytes as e.g. "64 KiB" when it is a whole number of a unit, else "n B"."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def sync() -> None:
    """Flush dirty pages, so a timed side does not pay for earlier writeback."""
    os.sync()


def alternate(rep: int, sides: Sequence[Callable[[], None]]) -> None:
    """Run the sides, swapping who goes first on every other repetition, so neither side
    always inherits the other's aftermath."""
    for side in sides if rep % 2 == 0 else list(reversed(sides)):
        side()


def check_names(names: Sequence[str], known: Sequence[str]) -> None:
    """Raise BenchError if a requested benchmark name is not one of `known`."""
    unknown = set(names) - set(known)
    if unknown:
        raise BenchError(
            f"unknown benchmark(s) {', '.join(sorted(unknown))}: use {', '.join(known)}"
        )


def make_work_dir(
    prefix: str, directory: str | os.PathLike[str] | None, scale: str, reps: int,
    disk_needed: int,
) -> Path:
    """A fresh scratch directory under `directory` (default: the system temp dir), checked
    for `disk_needed` free bytes (else removed again and BenchError)."""
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    free = shutil.disk_usage(work).free
    if free < disk_needed:
        shutil.rmtree(work)
        raise BenchError(
            f"{work} has {free / GiB:.1f} GiB free; the {scale} scale needs about "
            f"{disk_needed / GiB:.1f} GiB: pass --dir on a bigger filesystem"
        )
    log(f"working in {work} (scale {scale}, {reps} rep(s), {os.cpu_count()} CPUs)")
    return work


def arg_parser(
    prog: str, description: str, scales: Mapping[str, Any], benchmarks: Sequence[str],
    reps_help: str,
) -> argparse.ArgumentParser:
    """The options every bench CLI has: --scale, --dir, --reps and --only."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--scale", choices=sorted(scales), default="full",
                    help="full: the reference sizes (several minutes); smoke: tiny, seconds")
    ap.add_argument("--dir", help="where to create the scratch directory (default: $TMPDIR)")
    ap.add_argument("--reps", type=int, help=reps_help)
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(benchmarks)}")
    return ap


def parse_args(
    ap: argparse.ArgumentParser, argv: Sequence[str] | None, scales: Mapping[str, Any]
) -> tuple[argparse.Namespace, int, list[str] | None]:
    """Parse `argv`; returns (args, repetitions, --only names or None)."""
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    reps = args.reps or scales[args.scale].reps
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    return args, reps, only


XXHSUM_HINT = (
    "xxhsum not found: install the Debian/Ubuntu package `xxhash` (apt-get install xxhash)"
)


def fmt_seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 0.1 else f"{t * 1000:.1f} ms"


def xxhsum_available() -> bool:
    return shutil.which("xxhsum") is not None


# -- per-phase timing (--phases) -----------------------------------------------------------
class Phases:
    """Wall time per named phase, summed over calls and threads. Instruments by wrapping
    attributes of live objects (or module functions) for the duration of a `with` block;
    the cmroot code itself is untouched."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, name: str | None = None) -> None:
        original = getattr(owner, attr, None)
        if not callable(original):
            log(f"--phases: {attr} not found on {owner!r}; not timed (the code changed?)")
            return
        name = name or attr

        @functools.wraps(original)
        def timed_call(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                with self._lock:
                    self.totals[name] = self.totals.get(name, 0.0) + dt
                    self.calls[name] = self.calls.get(name, 0) + 1

        had_own = isinstance(owner, type) or attr in getattr(owner, "__dict__", {})
        self._undo.append((owner, attr, original if had_own else None))
        setattr(owner, attr, timed_call)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo.clear()

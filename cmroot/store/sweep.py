"""The retention sweep: remove (or trash) every object whose newest entry has expired, then,
if the store is still over its byte budget, evict the oldest objects until it is not.

It reads only expired rows (an index on expiry), pages through them, and skips objects an
in-flight recycle has claimed and objects a hold keeps. Eviction (`store.max_bytes`) goes
oldest first by last recycle and never takes an object recycled less than `min_retain`
ago: a budget that those alone exceed leaves the store over it, said in the report, the
log and `cmroot_store_over_budget_bytes`. A failure on one object is reported and the
sweep goes on.

A sweep of millions of objects keeps counts, not lists: the report holds the totals and
the first `REPORT_ROWS` objects removed and failures met (in expiry order), with flags
saying when there were more. Its size, and the API answer built from it, stay bounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cmroot.index import Index, StoredObject
from cmroot.store.objects import Objects

log = logging.getLogger(__name__)

BATCH = 2000
REPORT_ROWS = 1000  # removed objects (and failures) a report lists; the rest are counted
GROUPS = 100_000  # tables and partitions a dry run tells apart
ERROR_CHARS = 500  # of one failure's message


@dataclass(frozen=True)
class Budget:
    """The store's byte budget: `max_bytes` (0: none), and the age below which no object is
    evicted to meet it."""

    max_bytes: int = 0
    min_retain: float = 3600.0


@dataclass
class SweepReport:
    dry_run: bool
    now: float
    removed_objects: int = 0
    removed_bytes: int = 0
    removed: list[dict[str, Any]] = field(default_factory=list)  # the first `rows` only
    failed: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first `rows` only
    skipped: int = 0
    duration: float = 0.0
    rows: int = field(default_factory=lambda: REPORT_ROWS)
    evicted_objects: int = 0  # of removed_objects, those taken before expiry (the budget)
    evicted_bytes: int = 0
    held_objects: int = 0  # expired, kept by a hold
    held_bytes: int = 0
    budget_bytes: int = 0  # 0: no budget
    over_budget_bytes: int = 0  # after the sweep (would be, for a dry run)
    # A dry run's names: files and bytes per (db, table, partition), and with `list_files`
    # the first `rows` files themselves; housekeeping files only with `housekeeping`.
    list_files: bool = False
    housekeeping: bool = False
    tables: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    files_count: int = 0

    @property
    def removed_truncated(self) -> bool:
        return self.removed_objects > len(self.removed)

    @property
    def failures_truncated(self) -> bool:
        return self.failed > len(self.failures)

    def add_removed(self, o: StoredObject, action: str, evicted: bool = False) -> None:
        self.removed_objects += 1
        self.removed_bytes += o.size
        if evicted:
            self.evicted_objects += 1
            self.evicted_bytes += o.size
        if len(self.removed) < self.rows:
            self.removed.append(
                {"checksum": o.checksum, "size": o.size, "expires": o.expires, "action": action,
                 "reason": "budget" if evicted else "expired"}
            )

    def name(self, index: Index, objs: list[StoredObject]) -> None:
        """Say which tables, partitions (and files) the objects a dry run would remove
        belong to, from their entries: each path once per object (a path recycled twice
        with the same bytes is one file), at most GROUPS tables and partitions (the rest
        counted under one "..." group)."""
        seen: set[tuple[str, str]] = set()
        for e in index.entries_of([o.checksum for o in objs], self.housekeeping):
            if (e.path, e.checksum) in seen:
                continue
            seen.add((e.path, e.checksum))
            part = ",".join(f"{k}={v}" for k, v in (e.partition or {}).items())
            key = (e.db or "", e.table or "", part)
            if key not in self.tables and len(self.tables) >= GROUPS:
                key = ("...", "", "")  # bounded memory: a dry run of 10^6 partitions
            group = self.tables.setdefault(key, [0, 0])
            group[0] += 1
            group[1] += e.size
            self.files_count += 1
            if self.list_files and len(self.files) < self.rows:
                self.files.append({"path": e.path, "checksum": e.checksum, "size": e.size,
                                   "db": e.db, "table": e.table, "partition": e.partition})

    def add_failure(self, checksum: str, error: str) -> None:
        self.failed += 1
        if len(self.failures) < self.rows:
            if len(error) > ERROR_CHARS:
                error = error[: ERROR_CHARS - 3] + "..."
            self.failures.append({"checksum": checksum, "error": error})

    def to_json(self) -> dict[str, Any]:
        """The answer of POST /v1/gc and of `cmroot gc --json`."""
        return {
            "dry_run": self.dry_run,
            "now": self.now,
            "removed_objects": self.removed_objects,
            "removed_bytes": self.removed_bytes,
            "removed": self.removed,
            "removed_truncated": self.removed_truncated,
            "failed": self.failed,
            "failures": self.failures,
            "failures_truncated": self.failures_truncated,
            "skipped": self.skipped,
            "duration": self.duration,
            "evicted_objects": self.evicted_objects,
            "evicted_bytes": self.evicted_bytes,
            "held_objects": self.held_objects,
            "held_bytes": self.held_bytes,
            "budget_bytes": self.budget_bytes,
            "over_budget_bytes": self.over_budget_bytes,
            **(self._names() if self.dry_run else {}),
        }

    def _names(self) -> dict[str, Any]:
        """A dry run's tables, largest first (the first `rows`), and files if asked."""
        groups = sorted(self.tables.items(), key=lambda kv: (-kv[1][1], kv[0]))
        out: dict[str, Any] = {
            "tables": [
                {"db": db or None, "table": table or None, "partition": part or None,
                 "files": n, "bytes": size}
                for (db, table, part), (n, size) in groups[: self.rows]
            ],
            "tables_truncated": len(groups) > self.rows,
        }
        if self.list_files:
            out["files"] = self.files
            out["files_truncated"] = self.files_count > len(self.files)
        return out


def sweep(
    index: Index,
    objects: Objects,
    now: float,
    trash: bool,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    rows: int | None = None,
    budget: Budget | None = None,
    list_files: bool = False,
    housekeeping: bool = False,
) -> SweepReport:
    """Sweep what expired at `now`, then evict down to `budget`; the report lists at most
    `rows` (default REPORT_ROWS) removed objects and failures. A dry run also names the
    tables and partitions (with `list_files`, the files; housekeeping files only with
    `housekeeping`) whose files would go."""
    started = time.monotonic()
    budget = budget or Budget()
    report = SweepReport(dry_run, now, rows=REPORT_ROWS if rows is None else rows,
                         list_files=list_files, housekeeping=housekeeping)
    report.budget_bytes = budget.max_bytes
    _expire(index, objects, now, trash, dry_run, progress, report)
    report.held_objects, report.held_bytes = index.held_totals(now)
    if budget.max_bytes:
        stored = index.stats()[1] - (report.removed_bytes if dry_run else 0)
        if stored > budget.max_bytes:
            stored = _evict(index, objects, now, trash, dry_run, progress, report, budget, stored)
        report.over_budget_bytes = max(0, stored - budget.max_bytes)
        if report.over_budget_bytes:
            log.warning(
                "store over its byte budget: what is left is younger than store.min_retain"
                " or held",
                extra={"bytes": stored, "budget": budget.max_bytes,
                       "over": report.over_budget_bytes, "min_retain": budget.min_retain,
                       "fix": "raise store.max_bytes, lower store.min_retain, or release"
                              " holds (cmroot hold ls)"},
            )
    report.duration = time.monotonic() - started
    return report


def _expire(
    index: Index, objects: Objects, now: float, trash: bool, dry_run: bool,
    progress: Callable[[int], None] | None, report: SweepReport,
) -> None:
    after: tuple[float, str] | None = None
    while page := index.expired(now, BATCH, after):
        after = (page[-1].expires, page[-1].checksum)
        if dry_run:
            going = []
            for o in page:
                if objects.claimed(o.checksum):
                    report.skipped += 1
                else:
                    report.add_removed(o, "trashed" if trash and o.keep else "deleted")
                    going.append(o)
            report.name(index, going)
        else:
            _remove(objects, page, lambda cs: index.still_expired(cs, now),
                    lambda cs: index.forget_expired(cs, now), now, trash, report, evicted=False)
        if progress:
            progress(report.removed_objects)


def _evict(
    index: Index, objects: Objects, now: float, trash: bool, dry_run: bool,
    progress: Callable[[int], None] | None, report: SweepReport, budget: Budget, stored: int,
) -> int:
    """Evict the oldest objects until `stored` bytes fit the budget; returns what is left."""
    cutoff = now - budget.min_retain
    before = report.evicted_objects
    after: tuple[float, str] | None = None
    while stored > budget.max_bytes and (page := index.evictable(cutoff, now, BATCH, after)):
        # Only as many as the excess needs, oldest first; the next page starts after the
        # last one looked at.
        take: list[StoredObject] = []
        excess = stored - budget.max_bytes
        for o in page:
            after = (o.last, o.checksum)
            if o.expires <= now or (dry_run and objects.claimed(o.checksum)):
                continue  # the expiry pass's (held, claimed or failed), or in use
            take.append(o)
            excess -= o.size
            if excess <= 0:
                break
        if dry_run:
            for o in take:
                report.add_removed(o, "trashed" if trash and o.keep else "deleted", evicted=True)
                stored -= o.size
            report.name(index, take)
        else:
            gone = _remove(
                objects, take, lambda cs: index.still_evictable(cs, cutoff, now),
                lambda cs: index.forget_evicted(cs, cutoff), now, trash, report, evicted=True,
            )
            removed = set(gone)
            stored -= sum(o.size for o in take if o.checksum in removed)
        if progress:
            progress(report.removed_objects)
    if report.evicted_objects > before:
        log.warning(
            "store over its byte budget: evicted the oldest objects before their expiry",
            extra={"objects": report.evicted_objects - before, "bytes": report.evicted_bytes,
                   "budget": budget.max_bytes, "dry_run": dry_run},
        )
    return stored


def _remove(
    objects: Objects, page: list[StoredObject], still: Callable[[list[str]], set[str]],
    forget: Callable[[list[str]], None], now: float, trash: bool, report: SweepReport,
    evicted: bool,
) -> list[str]:
    gone = []
    for o, outcome in objects.remove(page, still, now, trash, forget):
        if outcome is None:
            report.skipped += 1
        elif outcome in ("deleted", "trashed"):
            report.add_removed(o, outcome, evicted)
            gone.append(o.checksum)
        else:
            report.add_failure(o.checksum, outcome)
    return gone

"""The retention sweep: remove (or trash) every object whose newest entry has expired.

It reads only expired rows (an index on expiry), pages through them, and skips objects an
in-flight recycle has claimed. A failure on one object is reported and the sweep goes on.

A sweep of millions of objects keeps counts, not lists: the report holds the totals and
the first `REPORT_ROWS` objects removed and failures met (in expiry order), with flags
saying when there were more. Its size, and the API answer built from it, stay bounded."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cmroot.index import Index, StoredObject
from cmroot.store.objects import Objects

BATCH = 2000
REPORT_ROWS = 1000  # removed objects (and failures) a report lists; the rest are counted
ERROR_CHARS = 500  # of one failure's message


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

    @property
    def removed_truncated(self) -> bool:
        return self.removed_objects > len(self.removed)

    @property
    def failures_truncated(self) -> bool:
        return self.failed > len(self.failures)

    def add_removed(self, o: StoredObject, action: str) -> None:
        self.removed_objects += 1
        self.removed_bytes += o.size
        if len(self.removed) < self.rows:
            self.removed.append(
                {"checksum": o.checksum, "size": o.size, "expires": o.expires, "action": action}
            )

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
        }


def sweep(
    index: Index,
    objects: Objects,
    now: float,
    trash: bool,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    rows: int | None = None,
) -> SweepReport:
    """Sweep what expired at `now`; the report lists at most `rows` (default REPORT_ROWS)
    removed objects and failures."""
    started = time.monotonic()
    report = SweepReport(dry_run, now, rows=REPORT_ROWS if rows is None else rows)
    after: tuple[float, str] | None = None
    while page := index.expired(now, BATCH, after):
        after = (page[-1].expires, page[-1].checksum)
        if dry_run:
            for o in page:
                if objects.claimed(o.checksum):
                    report.skipped += 1
                else:
                    report.add_removed(o, "trashed" if trash and o.keep else "deleted")
        else:
            gone = []
            for o, outcome in objects.remove_expired(page, now, trash):
                if outcome is None:
                    report.skipped += 1
                elif outcome in ("deleted", "trashed"):
                    report.add_removed(o, outcome)
                    gone.append(o.checksum)
                else:
                    report.add_failure(o.checksum, outcome)
            index.forget_expired(gone, now)
        if progress:
            progress(report.removed_objects)
    report.duration = time.monotonic() - started
    return report

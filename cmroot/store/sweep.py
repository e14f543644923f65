"""The retention sweep: remove (or trash) every object whose newest entry has expired.

It reads only expired rows (an index on expiry), pages through them, and skips objects an
in-flight recycle has claimed. A failure on one object is reported and the sweep goes on."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cmroot.index import Index, StoredObject
from cmroot.store.objects import Objects

BATCH = 2000


@dataclass
class SweepReport:
    dry_run: bool
    now: float
    removed: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    duration: float = 0.0

    @property
    def removed_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.removed)

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "now": self.now,
            "removed": self.removed,
            "removed_objects": len(self.removed),
            "removed_bytes": self.removed_bytes,
            "failed": self.failed,
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
) -> SweepReport:
    started = time.monotonic()
    report = SweepReport(dry_run, now)
    after: tuple[float, str] | None = None
    while page := index.expired(now, BATCH, after):
        after = (page[-1].expires, page[-1].checksum)
        if dry_run:
            for o in page:
                if objects.claimed(o.checksum):
                    report.skipped += 1
                else:
                    report.removed.append(_row(o, "trashed" if trash and o.keep else "deleted"))
            continue
        gone = []
        for o, outcome in objects.remove_expired(page, now, trash):
            if outcome is None:
                report.skipped += 1
            elif outcome in ("deleted", "trashed"):
                report.removed.append(_row(o, outcome))
                gone.append(o.checksum)
            else:
                report.failed.append({"checksum": o.checksum, "error": outcome})
        index.forget_expired(gone, now)
        if progress:
            progress(len(report.removed))
    report.duration = time.monotonic() - started
    return report


def _row(o: StoredObject, action: str) -> dict[str, Any]:
    return {"checksum": o.checksum, "size": o.size, "expires": o.expires, "action": action}

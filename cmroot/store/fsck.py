"""fsck: check that the objects on disk and the index agree, and that every object's bytes
hash to its name. Objects the index lacks are re-registered (never deleted); corrupt ones
are quarantined; index rows whose object vanished are reported, and forgotten on repair."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cmroot import checksum as cks
from cmroot.index import Index, StoredObject
from cmroot.store.layout import Layout

_NAME = re.compile(r"[0-9a-f]{32}")


@dataclass
class FsckReport:
    repair: bool
    checked: int = 0
    unindexed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.unindexed or self.missing or self.corrupt or self.stray)

    def to_json(self) -> dict[str, Any]:
        return {
            "repair": self.repair,
            "checked": self.checked,
            "clean": self.clean,
            "unindexed": self.unindexed,
            "missing": self.missing,
            "corrupt": self.corrupt,
            "stray": self.stray,
        }


def fsck(
    layout: Layout,
    index: Index,
    now: float,
    retain: float,
    repair: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> FsckReport:
    report = FsckReport(repair)
    indexed = index.all_checksums()
    on_disk = list(_walk(layout.objects, report))
    for path, c in cks.many(
        lambda p: cks.of_local_file(p, private=True),
        [p for p, _ in on_disk],
        progress=lambda i: progress and progress(i, len(on_disk)),
    ):
        name = os.path.basename(path)
        report.checked += 1
        if c != name or path != layout.object_path(name):
            report.corrupt.append(name)
            if repair:
                os.makedirs(layout.quarantine, exist_ok=True)
                os.rename(path, os.path.join(layout.quarantine, name))
                index.forget([name])
        elif name not in indexed:
            report.unindexed.append(name)
            if repair:
                st = os.stat(path)
                index.register_object(
                    StoredObject(name, st.st_size, st.st_mtime, now + retain, True)
                )
    seen = {os.path.basename(p) for p, _ in on_disk}
    report.missing = sorted(indexed - seen)
    if repair and report.missing:
        index.forget(report.missing)
    return report


def _walk(top: str, report: FsckReport) -> Any:
    for dirpath, _, names in os.walk(top):
        for n in names:
            path = os.path.join(dirpath, n)
            if _NAME.fullmatch(n):
                yield path, n
            else:
                report.stray.append(path)

"""fsck of a store on an object store (see cmroot.store.fsck for the local one)."""

from __future__ import annotations

from collections.abc import Callable

from cmroot.exceptions import BadRequest
from cmroot.index import Index
from cmroot.store.fsck import FsckReport
from cmroot.store.layout import Layout
from cmroot.store.objects import Objects


def fsck_remote(
    layout: Layout, index: Index, now: float, retain: float, repair: bool,
    progress: Callable[[int, int], None] | None, limit: int, guard: Objects | None,
    online: bool,
) -> FsckReport:
    raise BadRequest("fsck of a remote store", "not written yet")

"""Publishing and removing objects safely while recycles, rollbacks and sweeps overlap.

A recycle *claims* each checksum it publishes until its index commit (or its rollback)
is done. A rollback and a sweep only remove an object that nobody claims and that the
index does not (or, for a sweep, no longer) keep. That is what makes deduplication safe:
an in-flight recycle never loses the object it deduplicated against.
"""

from __future__ import annotations

import os
import threading
import time

from cmroot.exceptions import Conflict
from cmroot.index import Index
from cmroot.store.layout import Layout, same_bytes


class Objects:
    def __init__(self, layout: Layout, index: Index) -> None:
        self.layout = layout
        self.index = index
        self._lock = threading.Lock()
        self._claims: dict[str, set[str]] = {}

    def publish(self, txid: str, checksum: str, staged: str) -> bool:
        """Make `staged` available as object `checksum`; True if this created the object.
        The staged name stays (it is the journal's handle) until the recycle ends."""
        obj = os.path.join(self.layout.shard_for(checksum), checksum)
        with self._lock:
            self._claims.setdefault(checksum, set()).add(txid)
            try:
                # A hard link publishes atomically and, unlike rename, never replaces
                # an object that is already there.
                os.link(staged, obj)
                return True
            except FileExistsError:
                pass
        # Our claim keeps the object in place while we compare.
        if not same_bytes(staged, obj):
            raise Conflict(
                "checksum collision",
                f"{staged} and object {checksum} differ in content; nothing was merged",
            )
        return False

    def release(self, txid: str, checksums: set[str]) -> None:
        with self._lock:
            for c in checksums:
                self._drop_claim(txid, c)

    def discard_unindexed(self, txid: str, checksum: str) -> None:
        """Undo a publish: drop the claim and, if no one else claims the object and the
        index does not know it, remove it (its bytes are back at their source)."""
        with self._lock:
            self._drop_claim(txid, checksum)
            if checksum not in self._claims and self.index.get_object(checksum) is None:
                try:
                    os.unlink(self.layout.object_path(checksum))
                except FileNotFoundError:
                    pass

    def remove_expired(self, checksum: str, now: float, trash: bool) -> str | None:
        """Delete or trash an expired object; None if it is claimed or no longer expired."""
        with self._lock:
            if checksum in self._claims:
                return None
            obj = self.index.get_object(checksum)
            if obj is not None and obj.expires > now:
                return None
            path = self.layout.object_path(checksum)
            try:
                if trash:
                    day = time.strftime("%Y-%m-%d", time.gmtime(now))
                    dest = os.path.join(self.layout.trash, day, checksum[:2])
                    os.makedirs(dest, exist_ok=True)
                    os.rename(path, os.path.join(dest, checksum))
                    return "trashed"
                os.unlink(path)
            except FileNotFoundError:
                pass
            return "deleted"

    def claimed(self, checksum: str) -> bool:
        with self._lock:
            return checksum in self._claims

    def _drop_claim(self, txid: str, checksum: str) -> None:
        owners = self._claims.get(checksum)
        if owners is not None:
            owners.discard(txid)
            if not owners:
                del self._claims[checksum]

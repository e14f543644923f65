"""Publishing and removing objects safely while recycles, rollbacks and sweeps overlap.

A recycle *claims* each checksum it publishes until its index commit (or its rollback)
is done. A rollback and a sweep only remove an object that nobody claims and that the
index does not (or, for a sweep, no longer) keep. That is what makes deduplication safe:
an in-flight recycle never loses the object it deduplicated against.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from cmroot.exceptions import Conflict
from cmroot.index import Index, StoredObject
from cmroot.store.layout import Layout

log = logging.getLogger(__name__)

REMOVERS = 4  # threads unlinking one page of a sweep
_NOT_OWNED = "not removed: the store's OWNER marker does not name this index"


class Objects:
    def __init__(
        self, layout: Layout, index: Index, clock: Callable[[], float] = time.time
    ) -> None:
        self.layout = layout
        self.index = index
        self.clock = clock  # the store's: quarantined copies are named by its time
        self._lock = threading.Lock()
        self._claims: dict[str, set[str]] = {}
        # Objects a publish made that some recycle still claims: not yet indexed, so a
        # rollback may remove one it only deduplicated against once nobody claims it.
        self._made: set[str] = set()

    def publish(self, txid: str, checksum: str, staged: str, private: bool = False) -> bool:
        """Make `staged` available as object `checksum`; True if this created the object.
        The staged name stays (it is the journal's handle) until the recycle ends. With
        `private`, the object gets a copy of the bytes rather than the staged inode."""
        if private:
            staged = self.layout.private_copy(staged, checksum)
        with self._lock:
            self._claims.setdefault(checksum, set()).add(txid)
            if self.layout.link(staged, checksum):
                self._made.add(checksum)
                return True
        # Our claim keeps the object in place while we compare.
        if self.layout.same_content(staged, checksum):
            return False
        if self.layout.hash_object(checksum) == checksum:
            raise Conflict(
                "checksum collision",
                f"{staged} and object {checksum} differ in content; nothing was merged",
            )
        # The object's bytes no longer hash to its name (bit rot, or a writer that held the
        # inode open across its recycle), while the staged file does: the bad bytes are
        # kept in quarantine for inspection and the good ones put in place.
        bad = self.layout.heal(checksum, staged, self.clock())
        log.error(
            "stored object was corrupt: replaced by the same content recycled again",
            extra={"checksum": checksum, "quarantined": bad},
        )
        return True

    def claim(self, txid: str, checksum: str) -> None:
        """Claim an object `txid` published before a restart (claims live in memory)."""
        with self._lock:
            self._claims.setdefault(checksum, set()).add(txid)

    def release(self, txid: str, checksums: set[str]) -> None:
        with self._lock:
            for c in checksums:
                self._drop_claim(txid, c)

    def discard_unindexed(self, txid: str, checksum: str, made_only: bool = False) -> bool:
        """Undo a publish: drop the claim and, if no one else claims the object and the
        index does not know it, remove it (its bytes are back at their source). False if
        the object stays because someone else uses it. `made_only`: remove it only if a
        publish of a recycle still in flight made it (a rollback of a file deduplicated
        against it), never an unindexed object of unknown origin (fsck's to judge)."""
        with self._lock:
            made = checksum in self._made
            self._drop_claim(txid, checksum)
            if made_only and not made:
                return False
            if checksum in self._claims or self.index.get_object(checksum) is not None:
                return False
            if not self.layout.owned():
                return False  # another index may have deduplicated against it: fsck's
            self.layout.unlink_object(checksum)
            return True

    def remove(
        self, objs: Sequence[StoredObject], still: Callable[[list[str]], set[str]],
        now: float, trash: bool, forget: Callable[[list[str]], None],
    ) -> list[tuple[StoredObject, str | None]]:
        """Delete (or, when `trash` and the object was not purged, trash) objects the sweep
        picked, those of them `still` confirms (still expired, or still evictable, and not
        held), checked under the lock that publishes and claims; then `forget` the removed
        ones' rows under the same lock, so that nobody who takes it (an online fsck) ever
        sees a row whose object a sweep is between removing and forgetting. Each comes
        back with "deleted", "trashed", None if it is claimed, recycled again or held since
        it was picked, or the error that kept it. Nothing is removed unless the store is
        this index's (Layout.owned): another index's entries may need any object."""
        out: list[tuple[StoredObject, str | None]] = []
        with self._lock:
            free = still([o.checksum for o in objs if o.checksum not in self._claims])
            if free and not self.layout.owned():
                log.error(
                    "retention sweep refused: the store's OWNER marker does not name this"
                    " index, so another one may need these objects",
                    extra={"store": self.layout.root, "objects": len(free),
                           "fix": "stop every daemon using the store but the one whose index"
                                  " keeps it, delete OWNER (that one writes it again), and"
                                  " run `cmroot fsck` there for the others' objects"},
                )
                return [(o, _NOT_OWNED if o.checksum in free else None) for o in objs]
            going = [o for o in objs if o.checksum in free]
            out.extend((o, None) for o in objs if o.checksum not in free)
            done, error = self._remove_all(going, trash, now)
            out.extend((o, outcome) for o, outcome in zip(going, done, strict=True)
                       if outcome is not None)
            # What was removed is forgotten even when a worker met the unexpected: a row
            # left for an unlinked object would make the index claim what is gone.
            forget([o.checksum for o, outcome in out if outcome in ("deleted", "trashed")])
            if error is not None:
                raise error
        return out

    def _remove_all(self, objs: list[StoredObject], trash: bool, now: float
                    ) -> tuple[list[str | None], BaseException | None]:
        """Each object's outcome (None: not attempted), up to REMOVERS at once, and the
        first unexpected error met. Unlinks are the kernel's work and release the GIL:
        a page goes in well under the time one after another takes (measured: 100,000
        objects 2.3x faster with 4 than with 1; `find -delete` goes one by one). The
        calling thread works too, so a process that cannot start threads (pids.max)
        still sweeps, one by one."""
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        outcomes: list[str | None] = [None] * len(objs)
        errors: list[BaseException] = []
        todo = iter(range(len(objs)))  # next() of one iterator is atomic under the GIL

        def work() -> None:
            for i in todo:
                if errors:
                    return
                try:
                    outcomes[i] = self._remove_one(objs[i], trash, day)
                except BaseException as e:
                    errors.append(e)
                    return

        helpers = []
        for _ in range(min(REMOVERS, len(objs)) - 1):
            t = threading.Thread(target=work, name="cmroot-sweep", daemon=True)
            try:
                t.start()
            except RuntimeError:
                break  # no thread to be had: fewer hands
            helpers.append(t)
        work()
        for t in helpers:
            t.join()
        return outcomes, errors[0] if errors else None

    def _remove_one(self, o: StoredObject, trash: bool, day: str) -> str:
        """"deleted" or "trashed", or the error that kept the object."""
        try:
            if trash and o.keep:
                self.layout.trash_object(o.checksum, day)
                return "trashed"
            self.layout.unlink_object(o.checksum)
        except FileNotFoundError:
            pass
        except OSError as e:
            return f"{e.strerror or e}: {e.filename or self.layout.object_path(o.checksum)}"
        return "deleted"

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock publishes, rollbacks and sweeps take (a hold is added under it)."""
        with self._lock:
            yield

    @contextlib.contextmanager
    def settled(self, checksum: str) -> Iterator[bool]:
        """Hold the lock that publishes, rollbacks and sweeps take, and say whether no
        recycle in flight claims `checksum`: a repair that moves, registers or forgets an
        object decides and acts inside this, so no recycle can be between its publish and
        its index commit meanwhile."""
        with self._lock:
            yield checksum not in self._claims

    def claimed(self, checksum: str) -> bool:
        with self._lock:
            return checksum in self._claims

    def _drop_claim(self, txid: str, checksum: str) -> None:
        owners = self._claims.get(checksum)
        if owners is not None:
            owners.discard(txid)
            if not owners:
                del self._claims[checksum]
                self._made.discard(checksum)

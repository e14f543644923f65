"""Review 45: commit 2b48f3a, `LocalLayout._bring_home` (cmroot/store/layout/local.py).
Publish (`link`, under `Objects._lock`) and journal recovery (`published`) first move an
object at the other layout's place (put there by a release that knew no LAYOUT file) to
its own place: a hard link at home, an fsync of the home shard, an unlink of the other
name. Sweeps and trash remove both copies, resolve answers the other place's path, the
reader goes on to the other place after quarantining a corrupt copy.

Attacked with real stores (the `env` fixture), real files and the `old_release` writer
of review 44 (objects at ab/cd/<c> of a one-level store). Races are run as deterministic
interleavings: the racing call runs at the point where a concurrent thread or process
(a serving process, the daemon's sweep and lease timers, another recycle) may run.

BREAKs (`test_break_*`, strict xfails on 2b48f3a; all six fixed since):
- the reader looks at home, then at the other place; `_bring_home` links home, then
  unlinks the other name: a read between the two looks finds the object at neither and
  answers NotFound (404) for a recycled file whose valid object is in the store;
- `find_object` (resolve) runs the same race: `missing` for an object in the store;
- `published()` calls `_bring_home` outside `Objects._lock`: the lease timer's rollback
  of a prepared recycle (after a restart) racing the retention sweep of the old
  release's expired object gets FileNotFoundError from `_bring_home`'s unlink; the
  rollback takes it for "the way back is gone" and keeps the file in the store as
  displaced (logging "source re-created") instead of putting it back; `expire_prepared`
  reports the rollback done;
- the same unlocked `_bring_home` in a prepared commit (after a restart, `observe`)
  racing an ordinary recycle of the same bytes: the other recycle moved the object home
  first, the commit's stale link fails with ENOENT (retried after `make_shard`, raised),
  and the prepared statement's commit is rolled back (Conflict);
- a publish racing a reader that quarantines the corrupt copy at the other place: the
  same stale link, the recycle fails and is rolled back (Conflict), though nothing was
  wrong with the file or with home;
- the old release crashes after publishing F at the other place while home already
  holds the same content: `_bring_home` leaves both (home taken), `published` compares
  the staged inode with home only, F is put back and the other place stays a hard link
  of the live warehouse file; once home rots (quarantined by a read), a recycle brings
  that inode home and deduplicates against it: an in-place write of F destroys the
  recycled file (and the first one).

Attacks that held (normal tests): a crash between `_bring_home`'s link and unlink (two
names of one inode) followed by recovery, a recycle of the same bytes, fsck --repair
and the sweep (delete and trash); the same crash inside recovery's `published`, then a
second recovery; an old-release crash with a deduplicated partner (recovery's
break_link after bringing the staged inode home); eight concurrent recycles of bytes at
the other place; prepared recycles (hard-linked warehouse file, private copy) whose
object sits at the other place, committed or aborted, with and without a restart or a
crash before publishing ahead."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import Env, index_counts, objects_sharing_inodes, on_point, write_file

import cmroot.store.layout.local as local_layout
from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import NotFound
from cmroot.store import RecycleRequest, Store
from cmroot.store.layout.local import LocalLayout
from cmroot.store.read import Reader
from tests.adversarial.test_review44_layout_mixed import (
    close,
    downgraded_drop,
    drop,
    new_store,
    old_release,
    one,
    rels,
    served,
    two,
)

DAY = 24 * 3600


# -- helpers -------------------------------------------------------------------------------


def delete(store: Store, path: Path) -> None:
    store.recycle(RecycleRequest(paths=[str(path)], op="DELETE"))


def at_other_place(monkeypatch: pytest.MonkeyPatch, work: Callable[[], object]) -> None:
    """Run `work` once, the first time `_other_place` has found the object (between its
    look and what its caller then does with the name)."""
    real = LocalLayout._other_place
    fired: list[bool] = []

    @contextlib.contextmanager
    def racing(self: LocalLayout, checksum: str) -> Iterator[Any]:
        with real(self, checksum) as found:
            if found is not None and not fired:
                fired.append(True)
                work()
            yield found

    monkeypatch.setattr(LocalLayout, "_other_place", racing)


def crash_in_bring_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Die once right after `_bring_home`'s link (its fsync of the home shard), before
    its unlink of the other name."""
    real = local_layout.fsync_dir

    def fsync_dir(path: str) -> None:
        monkeypatch.setattr(local_layout, "fsync_dir", real)
        raise faults.Crash("between _bring_home's link and unlink")

    monkeypatch.setattr(local_layout, "fsync_dir", fsync_dir)


def prepared_then_restart(env: Env, f: Path, lease: float) -> tuple[Store, str]:
    """A prepared recycle of `f` whose process died before its objects were published
    ahead (fault point recycle.prepared); the store opened again within the lease."""
    store = env.open()
    faults.arm("recycle.prepared", crash=True)
    with pytest.raises(faults.Crash):
        store.prepare(RecycleRequest(paths=[str(f)], op="DELETE"), lease=lease)
    env.close_all()
    store = env.open()  # recovery leaves it: its statement may still commit
    [txid] = store.index.pending_txids()
    return store, txid


# -- BREAKs --------------------------------------------------------------------------------


def test_break_a_read_racing_bring_home_finds_the_object_nowhere(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariants 1 and 3. `Reader._object` opens `object_rels(c)` in order: home (absent:
    the object is the old release's, at ab/cd/<c>), then the other place. Between the
    two opens a recycle of the same bytes (another thread of the daemon, or the primary
    while a serving process reads) publishes: `_bring_home` links home and unlinks the
    other name. The read then finds the other place empty, returns None, and
    `open_verified` raises NotFound: a GET of a recycled file answers 404 while its
    valid object is in the store. (Looking at the other place first, then home, cannot
    miss a link-then-unlink move.)"""
    new_store(env)
    data = b"pi" * 300
    c = cks.of_bytes(data)
    [old] = downgraded_drop(env, "old", [data])
    store = env.open()
    g = write_file(env.warehouse / "db.db" / "u" / "g", data)
    real = Reader._open_object
    fired: list[bool] = []

    def racing(self: Reader, rel: str) -> int | None:
        fd = real(self, rel)
        if rel == one(c) and not fired:  # home looked at: nothing there yet
            fired.append(True)
            delete(store, g)
        return fd

    monkeypatch.setattr(Reader, "_open_object", racing)
    assert served(store, old, c) == data


def test_break_resolve_racing_bring_home_answers_missing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 1 (resolve answers where a recycled file is). `find_object` asks
    `os.path.exists(home)` (no), then `_other_place`; a publish of the same bytes in
    between moves the object home: `missing`, with the object valid at home."""
    new_store(env)
    data = b"phi" * 300
    c = cks.of_bytes(data)
    [old] = downgraded_drop(env, "old", [data])
    store = env.open()
    g = write_file(env.warehouse / "db.db" / "u" / "g", data)
    real = LocalLayout._other_place
    fired: list[bool] = []

    def racing(self: LocalLayout, checksum: str) -> Any:
        if not fired:  # home looked at by find_object: not there yet
            fired.append(True)
            delete(store, g)
        return real(self, checksum)

    monkeypatch.setattr(LocalLayout, "_other_place", racing)
    [r] = store.resolve([{"path": old, "checksum": c}])
    monkeypatch.undo()
    assert rels(env) == [one(c)]
    assert r.status == "cmroot", r


def test_break_lease_rollback_racing_the_sweep_does_not_put_the_file_back(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two-phase rollback (an aborted or expired statement puts every file back). The old
    release recycled X (bytes D, at ab/cd/<c>). Later a prepared recycle of F (bytes D)
    dies before publishing ahead; the daemon restarts within the lease; the statement
    never commits. The lease passes after X's retention: the daemon's lease timer
    (`expire_prepared`) and its sweep run at once. Rollback -> `observe` -> `published`
    -> `_bring_home`, under no lock (the sweep's lock is `Objects._lock`; the prepared
    recycle's claim died with the restart): it links the object home; the sweep's
    `unlink_object` (home first: nothing there yet; then the other place) removes the
    other name and forgets the row; `_bring_home`'s unlink raises FileNotFoundError.
    `Journal.rollback` takes any OSError of `_undo` for "its way back is gone": F is kept
    in the store as displaced ("source re-created during a failed recycle", false), its
    path stays empty, and `expire_prepared` counts the rollback as done."""
    new_store(env)
    data = b"tau" * 300
    downgraded_drop(env, "old", [data])
    env.clock.advance(DAY - 1800)
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    store, _ = prepared_then_restart(env, f, lease=3600)
    env.clock.advance(3601)  # X expired, and the prepared recycle's lease passed
    linked, swept = threading.Event(), threading.Event()
    real_fsync, real_other = local_layout.fsync_dir, LocalLayout._unlink_other
    results: dict[str, Any] = {}

    def expirer() -> None:
        try:
            results["expired"] = store.expire_prepared()
        except BaseException as e:
            results["error"] = e

    timer = threading.Thread(target=expirer, name="lease-timer")

    def fsync_dir(path: str) -> None:  # in the timer: _bring_home linked home
        if threading.current_thread() is timer and not linked.is_set():
            linked.set()
            swept.wait(10)
        real_fsync(path)

    def unlink_other(self: LocalLayout, checksum: str) -> None:  # in the sweep
        if threading.current_thread() is not timer and not linked.is_set():
            timer.start()
            linked.wait(10)
            try:
                return real_other(self, checksum)
            finally:
                swept.set()
        return real_other(self, checksum)

    monkeypatch.setattr(local_layout, "fsync_dir", fsync_dir)
    monkeypatch.setattr(LocalLayout, "_unlink_other", unlink_other)
    assert store.gc().removed_objects == 1
    timer.join(20)
    monkeypatch.undo()
    assert results == {"expired": 1}, results
    assert f.exists() and f.read_bytes() == data, "the rolled-back file is not back"


def test_break_prepared_commit_racing_a_recycle_of_the_same_bytes_is_rolled_back(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two-phase commit (a prepared statement commits). After a restart between prepare
    and publishing ahead, `commit` claims c and asks `observe` -> `published` ->
    `_bring_home` (no lock): it found the old release's object at ab/cd/<c>; meanwhile a
    recycle of G with the same bytes publishes (`link` -> `_bring_home`, under the lock)
    and moves it home. The commit's link of the stale name fails with ENOENT, is taken
    for a missing shard, retried after `make_shard`, fails again and is raised: the
    commit is rolled back (Conflict "a file changed"), F is put back into a table its
    statement dropped. Nothing changed F; the object it deduplicates against is home."""
    new_store(env)
    data = b"sigma" * 300
    c = cks.of_bytes(data)
    downgraded_drop(env, "old", [data])
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    g = write_file(env.warehouse / "db.db" / "u" / "g", data)
    store, txid = prepared_then_restart(env, f, lease=3600)
    assert rels(env) == [two(c)]
    at_other_place(monkeypatch, lambda: delete(store, g))
    store.commit(txid)
    monkeypatch.undo()
    assert not f.exists()
    assert served(store, str(f), c) == data and served(store, str(g), c) == data


def test_break_publish_racing_a_reader_quarantining_the_other_copy_fails(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old release's object at ab/cd/<c> rotted. A recycle of G (bytes D, valid) runs
    `link` -> `_bring_home` under `Objects._lock`; the reader (a serving process, or a
    reader thread: no lock) hashes the rotten copy and quarantines it between
    `_other_place`'s look and the link. The stale link fails with ENOENT (twice: after
    `make_shard`), the recycle is rolled back as "a file changed while it was recycled".
    Home was free and G's bytes valid: the recycle should simply publish them."""
    new_store(env)
    data = b"rho" * 300
    c = cks.of_bytes(data)
    [old] = downgraded_drop(env, "old", [data])
    (env.objects_dir / two(c)).write_bytes(b"R" * 900)
    store = env.open()
    g = write_file(env.warehouse / "db.db" / "u" / "g", data)

    def read() -> None:
        with pytest.raises(NotFound):  # Quarantined
            served(store, old, c)

    at_other_place(monkeypatch, read)
    delete(store, g)
    monkeypatch.undo()
    assert not g.exists() and served(store, str(g), c) == data


def test_break_old_release_crash_with_home_taken_leaves_the_warehouse_inode_in_the_store(
    env: Env,
) -> None:
    """Invariants 1 and 2 (review 44's recovery break, fixed only for a free home). This
    release recycled G0 (bytes D: home). After a downgrade the old release recycles F
    (bytes D) and dies after publishing at ab/cd/<c> (a hard link of F's staged inode).
    Recovery: `published` -> `_bring_home` finds home taken and leaves both; the staged
    inode is compared with home only: "not published", F is put back, and ab/cd/<c>
    stays a second name of the live warehouse file (nlink 2), which nothing reports
    (fsck: a duplicate of home). Home rots; a read quarantines it and serves the other
    place (F's bytes, unchanged so far). A recycle of H (bytes D): `_bring_home` moves
    F's inode home, H deduplicates against it, H's inode goes. F is written in place: H's
    and G0's only copy is F's inode."""
    new_store(env)
    data = b"upsilon" * 100
    c = cks.of_bytes(data)
    store = env.open()
    [g0] = drop(env, store, "g0", [data])
    close(env, store)
    old = old_release(env)
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    faults.arm("recycle.flushed", crash=True)
    with pytest.raises(faults.Crash):
        delete(old, f)
    env.close_all()
    store = env.open()  # recovery: F put back
    assert f.read_bytes() == data
    # (fixed: the recovery removes the other place's name of F's staged inode, so no
    # store name is left on the live warehouse file)
    assert not (env.objects_dir / two(c)).exists() and os.stat(f).st_nlink == 1
    h = write_file(env.warehouse / "db.db" / "u" / "h", data)
    delete(store, h)
    with open(f, "r+b") as fh:  # the warehouse file F, written in place
        fh.write(b"EDIT")
    assert served(store, str(h), c) == data and served(store, g0, c) == data


# -- attacks that held ---------------------------------------------------------------------


@pytest.mark.parametrize("on_expire", ["delete", "trash"])
def test_held_crash_between_bring_homes_link_and_unlink_then_recovery_fsck_sweep(
    env: Env, monkeypatch: pytest.MonkeyPatch, on_expire: str
) -> None:
    """A recycle of F (bytes D) brings the old release's object home and dies before
    unlinking the other name: two names of one inode. Recovery puts F back; reads, a
    recycle of G, fsck --repair (a duplicate removed) and the sweep lose nothing and
    leave nothing."""
    env.overrides["CMROOT_STORE_ON_EXPIRE"] = on_expire
    new_store(env)
    data = b"chi" * 300
    c = cks.of_bytes(data)
    [old] = downgraded_drop(env, "old", [data])
    store = env.open()
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    crash_in_bring_home(monkeypatch)
    with pytest.raises(faults.Crash):
        delete(store, f)
    env.close_all()
    home, other = env.objects_dir / one(c), env.objects_dir / two(c)
    assert home.stat().st_ino == other.stat().st_ino
    store = env.open()
    assert f.read_bytes() == data and not objects_sharing_inodes(env)
    assert served(store, old, c) == data
    g = write_file(env.warehouse / "db.db" / "u" / "g", data)
    delete(store, g)
    report = store.fsck(repair=True)
    assert report.counts["misplaced"] == 1 and not report.missing, report.to_json()
    assert rels(env) == [one(c)]
    assert served(store, old, c) == data and served(store, str(g), c) == data
    assert store.fsck().clean
    env.clock.advance(3 * DAY)
    store.gc()
    assert rels(env) == [] and index_counts(env)["objects"] == 0


def test_held_crash_inside_recoverys_bring_home_then_recovery_again(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old release dies after publishing F at ab/cd/<c>; this release's recovery
    dies between `_bring_home`'s link and unlink; the next recovery finds the staged
    inode at home (and still at the other place), removes both and puts F back."""
    new_store(env)
    old = old_release(env)
    data = b"psi" * 300
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    faults.arm("recycle.flushed", crash=True)
    with pytest.raises(faults.Crash):
        delete(old, f)
    env.close_all()
    crash_in_bring_home(monkeypatch)
    with pytest.raises(faults.Crash):
        env.open()
    key = os.path.realpath(env.store_root)
    local_layout.release_lock(key, local_layout._HELD[key])  # died: its lock went with it
    assert len(rels(env)) == 2
    store = env.open()
    assert f.read_bytes() == data and rels(env) == [] and not objects_sharing_inodes(env)
    assert store.fsck().clean


def test_held_old_release_crash_with_a_deduplicated_partner_breaks_the_link(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old release publishes F (ab/cd/<c>, F's inode), G with the same bytes is
    recycled and deduplicated against it meanwhile, and the process dies before F's
    commit. Recovery brings F's inode home, finds it published and needed (G's row):
    `break_link` gives the object bytes of its own and F goes back. F written in place
    then leaves G's bytes alone."""
    new_store(env)
    old = old_release(env)
    data = b"omega" * 300
    c = cks.of_bytes(data)
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    g = write_file(env.warehouse / "db.db" / "u" / "g", data)
    on_point(monkeypatch, "recycle.file_published", lambda: delete(old, g))
    faults.arm("recycle.flushed", k=2, crash=True)  # (G's commit passes it first)
    with pytest.raises(faults.Crash):
        delete(old, f)
    monkeypatch.undo()
    env.close_all()
    assert rels(env) == [two(c)]
    store = env.open()
    assert f.read_bytes() == data and not objects_sharing_inodes(env)
    with open(f, "r+b") as fh:
        fh.write(b"EDIT")
    assert served(store, str(g), c) == data
    assert rels(env) == [one(c)]
    assert store.fsck().clean


def test_held_concurrent_recycles_of_bytes_at_the_other_place(env: Env) -> None:
    new_store(env)
    data = b"alef" * 300
    c = cks.of_bytes(data)
    [old] = downgraded_drop(env, "old", [data])
    store = env.open()
    paths = [write_file(env.warehouse / "db.db" / f"t{i}" / "f", data) for i in range(8)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(paths))

    def run(p: Path) -> None:
        try:
            barrier.wait(10)
            delete(store, p)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert rels(env) == [one(c)]
    for p in [old, *map(str, paths)]:
        assert served(store, p, c) == data
    assert store.fsck().clean


@pytest.mark.parametrize("end", ["commit", "abort"])
@pytest.mark.parametrize("how", ["live", "restart", "crash-before-ahead"])
def test_held_prepared_recycle_of_a_hard_linked_file_whose_bytes_sit_at_the_other_place(
    env: Env, end: str, how: str
) -> None:
    """F has a second warehouse name F2 (a private copy is published); the old release's
    object of the same bytes is at ab/cd/<c>. Committed or aborted, live, after a
    restart, or after a crash before publishing ahead: one object at home, nothing
    sharing a warehouse inode, the old file served, F back on abort, F2's in-place
    write harmless."""
    new_store(env)
    data = b"bet" * 300
    c = cks.of_bytes(data)
    [old] = downgraded_drop(env, "old", [data])
    f = write_file(env.warehouse / "db.db" / "t" / "f", data)
    f2 = env.warehouse / "db.db" / "t2" / "f2"
    f2.parent.mkdir(parents=True)
    os.link(f, f2)
    if how == "crash-before-ahead":
        store, txid = prepared_then_restart(env, f, lease=600)
    else:
        store = env.open()
        txid = store.prepare(RecycleRequest(paths=[str(f)], op="DELETE"), lease=600).txid
        if how == "restart":
            env.close_all()
            store = env.open()
    if end == "commit":
        store.commit(txid)
    else:
        store.abort(txid)
        assert f.read_bytes() == data
    with open(f2, "r+b") as fh:
        fh.write(b"EDIT")
    assert rels(env) == [one(c)] and not objects_sharing_inodes(env)
    assert served(store, old, c) == data
    if end == "commit":
        assert served(store, str(f), c) == data
    assert store.fsck().clean


@pytest.fixture(autouse=True)
def _disarm() -> Iterator[None]:
    yield
    faults.disarm()

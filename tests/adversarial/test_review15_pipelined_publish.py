"""Hostile review 15: a prepared recycle's objects were published while it staged
(56e788f: `_stage_prepared` submitted `_publish_ahead` before staging and `_stage` fed it
each staged file; `commit` takes a transaction's files from memory when its first part
was prepared in this process).

The four tests before the guards failed on 56e788f and pass since its publishing while
staging was withdrawn (the publish ahead starts once the part is prepared, its checksums
journaled; the commit from memory stays): one statement's staging held the one publisher
thread, so every other statement's commit, abort, renew and expiry waited for it (a
renew sent in time lost its statement); and an object linked before its checksum was
journaled could not be found again by a recovery after a straggler write and a crash.
Every test states its sequence, what was lost or wrong, and the invariant it breaks.
Races are driven by fault-point hooks and events, never by sleeps (a hang is detected by
a bounded join). The guards at the end are sequences that held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cmroot_testlib import Clock, Env, object_files, objects_sharing_inodes, tables_of

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError, NotFound
from cmroot.store import RecycleRequest, Store

REPO = str(Path(__file__).resolve().parents[2])
HANG = 8.0  # seconds an operation may take before it counts as hung (it takes ms)


# -- helpers ------------------------------------------------------------------------------



def _drop(env: Env, name: str, mode: str = "move") -> RecycleRequest:
    return RecycleRequest([str(env.warehouse / "db.db" / name)], mode=mode, op="DROP_TABLE",
                          db="db", table=name)


def _part(env: Env, table: str, p: str, mode: str = "move") -> RecycleRequest:
    return RecycleRequest([str(env.warehouse / "db.db" / table / f"p={p}")], mode=mode,
                          op="DROP_PARTITION", db="db", table=table, partitions=[{"p": p}])




def _publisher() -> bool:
    return threading.current_thread().name.startswith("cmroot-publish")


def _hook(monkeypatch: pytest.MonkeyPatch, fn: Callable[[str], None]) -> None:
    """Run fn(name) at every fault point, before the real point."""
    real = faults.point

    def point(name: str) -> None:
        fn(name)
        real(name)

    monkeypatch.setattr(faults, "point", point)


def _served(store: Store, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        with store.open_verified(path, cks.of_bytes(data)) as v:
            assert os.pread(v.fd, len(data) + 1, 0) == data, path


def _back(files: dict[str, bytes]) -> None:
    assert {p: Path(p).read_bytes() for p in files if os.path.lexists(p)} == files


def _clean(env: Env, store: Store) -> None:
    """Nothing in staging, no object sharing a warehouse inode, objects match names, fsck
    clean."""
    assert os.listdir(env.staging_dir) == []
    assert objects_sharing_inodes(env) == []
    bad = [p.name for p in object_files(env) if cks.of_local_file(str(p)) != p.name]
    assert bad == [], f"objects that do not hash to their name: {bad}"
    report = store.fsck()
    assert report.clean, {k: v for k, v in report.counts.items() if v}


class _Run(threading.Thread):
    """A store call in a thread of its own; `.out` is its result or exception."""

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.out: object = None

    def run(self) -> None:
        try:
            self.out = self.fn()
        except BaseException as e:  # reported by the test
            self.out = e


def _held_prepare(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch, table: str,
    then: Callable[[], None] | None = None,
) -> tuple[_Run, threading.Event, threading.Event]:
    """Start statement A's prepare of DROP TABLE `table` in thread "stmt-A", held in its
    staging (after its first file is staged and published ahead) until `release` is set;
    `then` runs there once released. Returns (thread, published, release): `published`
    is set once A's publish ahead linked A's first object (so it runs, and, A being
    held, waits on A's queue)."""
    held, release, published = threading.Event(), threading.Event(), threading.Event()
    seen = {"staged": 0}

    def fn(name: str) -> None:
        if name == "recycle.file_published" and _publisher() and not held.is_set():
            published.set()  # only A publishes before A is held
        if name == "recycle.file_staged" and threading.current_thread().name == "stmt-A":
            seen["staged"] += 1
            if seen["staged"] == 2:
                published.wait(1)  # A's first object linked, were it published while staging
                held.set()
                assert release.wait(60), "never released"
                if then is not None:
                    then()

    _hook(monkeypatch, fn)
    run = _Run("stmt-A", lambda: store.prepare(_drop(env, table), lease=600))
    run.start()
    assert held.wait(30), "statement A never reached its second file"
    return run, published, release


# == failing: one statement's staging holds every other statement's commit ==============


def test_commit_abort_and_expiry_of_other_statements_wait_for_an_unrelated_prepare(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: statement A (a large DROP TABLE: hours of hashing, a slow or hung
    source) is staging; here it is held between two files. Meanwhile four small
    statements prepare (each returns at once): B, C, D (its first part) and E, whose
    lease then passes. B commits, C aborts, D joins its second part, and the daemon's
    expiry timer runs (`expire_prepared`).
    Observed: all four block until A's staging ends. A's `_publish_ahead` occupies the
    one `cmroot-publish` thread from before A stages its first file until A is prepared
    (it waits on A's queue); B's, C's, D's and E's publishes ahead are queued behind
    it, and commit/abort/join/expiry wait for their part's publish under the transaction lock
    (`_tx_lock`). Before 56e788f the publisher was only handed a part once it was
    prepared, so it was idle while A staged. A Hive INSERT OVERWRITE commit, any abort,
    and the expiry of every dead statement now wait for the slowest prepare in flight
    (the expiry job, max_instances=1, stalls altogether).
    Broken: "the daemon never hangs (commit/abort/renew/expire while the publisher is
    busy)".
    Responsible: cmroot/store/recycle.py Recycler._stage_prepared (submits
    `_publish_ahead` before `_stage_all`: a whole statement's staging now runs inside a
    task of the single-thread publisher) with `_tx_lock`'s wait."""
    contents = [os.urandom(300 + i) for i in range(3)]
    tables_of(env, ("a", "b", "c", "e"), contents)
    for p in ("1", "2"):
        d = env.warehouse / "db.db" / "d" / f"p={p}"
        d.mkdir(parents=True)
        (d / "f").write_bytes(os.urandom(222))
    run_a, _, release = _held_prepare(env, store, monkeypatch, "a")
    b = store.prepare(_drop(env, "b"), lease=600)
    c = store.prepare(_drop(env, "c"), lease=600)
    d1 = store.prepare(_part(env, "d", "1"), lease=600)
    store.prepare(_drop(env, "e"), lease=1)
    env.clock.advance(2)  # E's lease has passed: the expiry job rolls it back
    ops = [
        _Run("commit-B", lambda: store.commit(b.txid)),
        _Run("abort-C", lambda: store.abort(c.txid)),
        _Run("join-D", lambda: store.prepare(_part(env, "d", "2"), lease=600, txid=d1.txid)),
        _Run("expire", store.expire_prepared),
    ]
    for op in ops:
        op.start()
    deadline = time.monotonic() + HANG
    for op in ops:
        op.join(max(0.0, deadline - time.monotonic()))
    hung = [op.name for op in ops if op.is_alive()]
    release.set()
    run_a.join(30)
    for op in ops:
        op.join(30)
    assert hung == [], (
        f"{hung} still waiting after {HANG:.0f} s, for nothing but statement A's staging"
        " (A's publish ahead holds the one publisher thread while A stages)"
    )


def test_a_renew_sent_in_time_loses_the_statement_while_another_prepare_stages(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: statement A is staging (held between two files). Statement B prepares
    (lease 60 s) and, 30 s later, well within its lease, renews it. The renew blocks in
    `_tx_lock` behind B's publish ahead, queued behind A's (see the test above); A's
    staging takes another 40 s (a large table).
    Observed: when A finishes, B's renew goes on, finds B's lease passed (70 s > 60 s)
    and rolls the statement back: the client that renewed in time gets 404, its files
    are put back and the statement fails. Before 56e788f the renew answered at once.
    Broken: invariant 2 from the client's side (a live statement that renewed in time
    is rolled back) and "the daemon never hangs (renew while the publisher is busy)".
    Responsible: cmroot/store/recycle.py Recycler._stage_prepared (publisher held for
    the whole staging of another statement) with `renew` waiting under `_tx_lock`."""
    contents = [os.urandom(400 + i) for i in range(3)]
    tables = tables_of(env, ("a", "b"), contents)
    run_a, a_publishing, release = _held_prepare(env, store, monkeypatch, "a")
    b = store.prepare(_drop(env, "b"), lease=60)
    env.clock.advance(30)
    renew = _Run("renew-B", lambda: store.renew(b.txid, 60))
    renew.start()
    deadline = time.monotonic() + HANG
    lock = store.recycler._locks

    def waiting() -> bool:
        # Inside B's lock while the one publisher thread runs A's publish ahead, which
        # waits on held A's queue: B's publish (queued behind it) cannot finish.
        return a_publishing.is_set() and b.txid in lock and lock[b.txid].locked()

    # A poll of state (done, or blocked in B's lock?), not the synchronisation itself.
    while renew.is_alive() and not waiting():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    env.clock.advance(40)  # A's staging goes on
    release.set()
    run_a.join(30)
    renew.join(30)
    assert not isinstance(renew.out, Exception), (
        f"renew sent at +30 s of a 60 s lease answered {renew.out!r}: statement B was"
        " rolled back while it waited for statement A's staging"
    )
    res = store.commit(b.txid)
    assert {f.path for f in res.files} == set(tables["b"])


# == failing: a crash mid-prepare leaves objects recovery cannot find =====================

CHILD_STRAGGLER = r"""
import json, os, signal, sys, threading
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config, faults
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))
# A straggler writer (a speculative task, a late append) holds part-0 open.
fd = os.open(args["straggler"], os.O_WRONLY)
published = threading.Event()
seen = {"staged": 0}
real = faults.point

def point(name):
    if name == "recycle.file_published" and threading.current_thread().name.startswith(
            "cmroot-publish"):
        published.set()
    if name == "recycle.file_staged" and threading.current_thread() is threading.main_thread():
        seen["staged"] += 1
        if seen["staged"] == 2:
            published.wait(1)                  # part-0's object, were it linked ahead
            os.pwrite(fd, b"the straggler's late bytes", 0)
            os.kill(os.getpid(), signal.SIGKILL)   # power cut / OOM kill mid-prepare
    real(name)

faults.point = point
store.prepare(RecycleRequest([args["table"]], op="DROP_TABLE", db="db", table="t"),
              lease=600)
"""


@pytest.mark.timeout(120)
def test_kill_9_mid_prepare_after_a_straggler_write_leaves_an_object_on_the_warehouse_inode(
    tmp_path: Path,
) -> None:
    """Sequence: a writer still holds db/t/part-0 open (a straggler task). Statement S
    prepares DROP TABLE t: part-0 is staged (renamed: the same inode), hashed (C) and,
    since 56e788f, at once published ahead: object C is a hard link of that inode. The
    straggler writes through its descriptor; the daemon is killed (kill -9) while S is
    still staging part-1, before `journal_prepared` recorded C. Restart: recovery rolls
    S back from journal rows that have no checksum, so `Journal.observe` hashes the
    staged file again (now C'), finds no object C' and treats part-0 as merely staged:
    it puts the inode back at db/t/part-0 and never looks at object C.
    Observed: objects/ keeps C, a hard link of the live warehouse file db/t/part-0 (every
    later write to the table changes it), whose bytes no longer hash to C, unknown to the
    index and claimed by no one; fsck reports it corrupt.
    Broken: "crash recovery ... leaves no object behind that nobody indexes or claims,
    and no store object sharing an inode with a warehouse file".
    Responsible: cmroot/store/recycle.py Recycler._stage_prepared/_stage (objects are
    linked before the journal knows their checksum); cmroot/store/journal.py
    Journal.observe can then only find an object by the staged bytes' current hash.
    Before 56e788f nothing of a prepare was published until `journal_prepared` had
    recorded every checksum."""
    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir(parents=True)
    e.outside.mkdir()
    tables = tables_of(e, ("t",), [os.urandom(700), os.urandom(800), os.urandom(900)])
    first = min(tables["t"])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_STRAGGLER, REPO,
         json.dumps({"env": e.env(), "table": str(e.warehouse / "db.db" / "t"),
                     "straggler": first})],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    e.clock.set(time.time())
    store = e.open()
    try:
        assert store.events() == []
        assert all(os.path.exists(p) for p in tables["t"])
        shared = objects_sharing_inodes(e)
        left = [p.name for p in object_files(e)]
        report = store.fsck()
        assert shared == [], (
            f"after recovery, store object(s) {shared} are hard links of the warehouse file"
            f" {first}"
        )
        assert left == [], f"object(s) left by a rolled-back prepare: {left}"
        assert report.clean, {k: v for k, v in report.counts.items() if v}
    finally:
        store.close()


def test_crash_mid_prepare_after_a_write_through_another_hard_link_leaks_the_private_object(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: db/t/part-0 has a second name db/u/g (a `cp -al` snapshot). Statement S
    prepares DROP TABLE t: part-0 is staged and hashed (C); having two names it gets a
    private copy, which the publisher links at once as object C. The other table's
    writer then rewrites g in place (legitimately: it is u's file), and the process dies
    (an injected crash, as kill -9) while S stages part-1, before `journal_prepared`.
    Restart: recovery rolls S back from rows without checksums; `Journal.observe`
    hashes the staged inode (now C', g's new bytes), finds no object C' (nor the private
    copy under C') and only puts part-0 back; the private copy goes with the staging
    directory, but object C stays.
    Observed: objects/ keeps C: no entry names it, the index does not know it, no one
    claims it, no sweep ever removes it; fsck reports it "unindexed" (and --repair would
    keep it for a whole retention).
    Broken: "a failed prepare / crash recovery ... leaves no object behind that nobody
    indexes or claims".
    Responsible: cmroot/store/recycle.py Recycler._stage (queues the private copy for
    publication before the journal has C) / `_stage_prepared`; recovery
    (cmroot/store/journal.py Journal.observe) can only find it by the current hash."""
    t = env.warehouse / "db.db" / "t"
    u = env.warehouse / "db.db" / "u"
    t.mkdir(parents=True)
    u.mkdir(parents=True)
    (t / "part-0").write_bytes(os.urandom(4096))
    (t / "part-1").write_bytes(os.urandom(4096))
    (t / "part-2").write_bytes(os.urandom(4096))
    os.link(t / "part-0", u / "g")
    published = threading.Event()
    seen = {"staged": 0}
    main = threading.current_thread()

    def fn(name: str) -> None:
        if name == "recycle.file_published" and _publisher():
            published.set()
        if name == "recycle.file_staged" and threading.current_thread() is main:
            seen["staged"] += 1
            if seen["staged"] == 2:
                published.wait(1)  # part-0's private copy, were it linked while staging
                with open(u / "g", "r+b") as fh:  # table u's writer
                    fh.write(b"u's new bytes")
                raise faults.Crash("recycle.file_staged")

    _hook(monkeypatch, fn)
    with pytest.raises(faults.Crash):
        store.prepare(_drop(env, "t"), lease=600)
    store.close()
    monkeypatch.undo()
    store = env.open()
    assert store.events() == []
    assert sorted(os.listdir(t)) == ["part-0", "part-1", "part-2"]
    left = [p.name for p in object_files(env)]
    report = store.fsck()
    assert left == [], (
        f"object(s) {left} left after recovery rolled the prepare back: no entry names"
        f" them and nothing will remove them (fsck: "
        f"{ {k: v for k, v in report.counts.items() if v} })"
    )
    assert report.clean


# == guards: sequences that held =========================================================


def test_guard_two_statements_of_identical_bytes_one_failing_mid_prepare(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard. A and B hold identical bytes. A is held mid-staging after its first object
    was published ahead; B prepares meanwhile (its publish queued behind A's); A then
    fails (a later file vanished) and is rolled back; B commits. B's bytes are served,
    A's files are back, one object per content, none on a warehouse inode."""
    contents = [os.urandom(600), os.urandom(700), os.urandom(800)]
    tables = tables_of(env, ("a", "b"), contents)

    def fail_a() -> None:
        gone.append(max(p for p in tables["a"] if os.path.exists(p)))
        os.unlink(gone[-1])

    gone: list[str] = []
    run_a, _, release = _held_prepare(env, store, monkeypatch, "a", then=fail_a)
    b = _Run("stmt-B", lambda: store.prepare(_drop(env, "b"), lease=600))
    b.start()
    b.join(HANG)
    release.set()
    run_a.join(30)
    b.join(30)
    assert isinstance(run_a.out, CmrootError), run_a.out
    res = store.commit(b.out.txid)  # type: ignore[attr-defined]
    assert sorted(f.path for f in res.files) == sorted(tables["b"])
    _back({p: d for p, d in tables["a"].items() if p not in gone})
    _served(store, tables["b"])
    assert sorted(p.name for p in object_files(env)) == sorted(cks.of_bytes(c) for c in contents)
    _clean(env, store)


def test_guard_join_failing_after_the_first_parts_publisher_ran(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard. Part 1 (p=1) prepared and published ahead; the join of part 2 (p=2) fails
    midway (a later file swapped for a symlink): every file of both parts is back, no
    object, the transaction is gone."""
    files = {}
    for p in ("1", "2"):
        d = env.warehouse / "db.db" / "t" / f"p={p}"
        d.mkdir(parents=True)
        for i in range(3):
            (d / f"f{i}").write_bytes(os.urandom(300 + 10 * i + int(p)))
            files[str(d / f"f{i}")] = (d / f"f{i}").read_bytes()
    tx = store.prepare(_part(env, "t", "1"), lease=600)
    store.renew(tx.txid, 600)  # part 1's publish ahead is done
    assert len(object_files(env)) == 3
    published = threading.Event()
    seen = {"staged": 0}
    main = threading.current_thread()
    p2 = sorted(k for k in files if "/p=2/" in k)

    def fn(name: str) -> None:
        if name == "recycle.file_published" and _publisher():
            published.set()
        if name == "recycle.file_staged" and threading.current_thread() is main:
            seen["staged"] += 1
            if seen["staged"] == 2:
                victim = max(p for p in p2 if os.path.exists(p))
                gone.append(victim)
                os.unlink(victim)
                os.symlink(env.outside / "x", victim)

    gone: list[str] = []
    _hook(monkeypatch, fn)
    with pytest.raises(CmrootError):
        store.prepare(_part(env, "t", "2"), lease=600, txid=tx.txid)
    _back({k: v for k, v in files.items() if k not in gone})
    assert object_files(env) == []
    assert store.events() == []
    with pytest.raises(NotFound):
        store.commit(tx.txid)
    _clean(env, store)


def test_guard_commit_after_joins_includes_every_part_once_with_a_hard_linked_file(
    env: Env, store: Store
) -> None:
    """Guard. Three parts prepared in this process (the commit takes the files from
    memory); part 1 holds a file hard-linked from another table. One event naming every
    file once; right bytes served; the hard-linked file's object is a private copy
    (a later write through the other name does not change it); nothing staged."""
    files = {}
    for p in ("1", "2", "3"):
        d = env.warehouse / "db.db" / "t" / f"p={p}"
        d.mkdir(parents=True)
        for i in range(2):
            (d / f"f{i}").write_bytes(os.urandom(200 + 10 * i + int(p)))
            files[str(d / f"f{i}")] = (d / f"f{i}").read_bytes()
    other = env.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    hl = str(env.warehouse / "db.db" / "t" / "p=1" / "f0")
    os.link(hl, other)
    tx = store.prepare(_part(env, "t", "1"), lease=600)
    store.prepare(_part(env, "t", "2"), lease=600, txid=tx.txid)
    store.prepare(_part(env, "t", "3"), lease=600, txid=tx.txid)
    res = store.commit(tx.txid)
    assert sorted(f.path for f in res.files) == sorted(files)
    [ev] = store.events()
    assert sorted(f["path"] for f in ev.files) == sorted(files)
    with open(other, "r+b") as fh:
        fh.write(b"u's own later write")
    _served(store, files)
    _clean(env, store)


def test_guard_copy_mode_join_naming_a_file_twice_commits_it_once(
    env: Env, store: Store
) -> None:
    """Guard. Copy mode: part 2 names part 1's partition again; the commit (from memory)
    records each file exactly once."""
    files = {}
    for p in ("1", "2"):
        d = env.warehouse / "db.db" / "t" / f"p={p}"
        d.mkdir(parents=True)
        (d / "f").write_bytes(os.urandom(500 + int(p)))
        files[str(d / "f")] = (d / "f").read_bytes()
    tx = store.prepare(_part(env, "t", "1", "copy"), lease=600)
    req = RecycleRequest([str(env.warehouse / "db.db" / "t" / "p=1"),
                          str(env.warehouse / "db.db" / "t" / "p=2")], mode="copy",
                         op="DROP_PARTITION", db="db", table="t",
                         partitions=[{"p": "1"}, {"p": "2"}])
    store.prepare(req, lease=600, txid=tx.txid)
    res = store.commit(tx.txid)
    assert sorted(f.path for f in res.files) == sorted(files)
    _served(store, files)
    _clean(env, store)


@pytest.mark.parametrize("restart", ["between parts", "before commit"])
def test_guard_restart_between_parts_or_before_commit(env: Env, restart: str) -> None:
    """Guard. Part 1 (with a hard-linked file) prepared in one process; the store
    restarts between the parts (the commit reads the journal, the last part's objects
    from memory) or after both (all from the journal). Every file once, right bytes,
    private object for the hard-linked file, nothing staged, fsck clean."""
    files = {}
    for p in ("1", "2"):
        d = env.warehouse / "db.db" / "t" / f"p={p}"
        d.mkdir(parents=True)
        for i in range(2):
            (d / f"f{i}").write_bytes(os.urandom(200 + 10 * i + int(p)))
            files[str(d / f"f{i}")] = (d / f"f{i}").read_bytes()
    other = env.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    os.link(env.warehouse / "db.db" / "t" / "p=1" / "f0", other)
    store = env.open()
    tx = store.prepare(_part(env, "t", "1"), lease=600)
    if restart == "between parts":
        store.close()
        store = env.open()
    store.prepare(_part(env, "t", "2"), lease=600, txid=tx.txid)
    if restart == "before commit":
        store.close()
        store = env.open()
    res = store.commit(tx.txid)
    assert sorted(f.path for f in res.files) == sorted(files)
    with open(other, "r+b") as fh:
        fh.write(b"u's own later write")
    _served(store, files)
    _clean(env, store)
    store.close()


def test_guard_expiry_of_a_part_whose_publisher_is_queued(
    env: Env, store: Store
) -> None:
    """Guard. The publisher is held (another task); a statement prepares (its publish
    queued) and its lease passes; the expiry job waits for the publish and then rolls
    it back: files back, no object, nothing staged."""
    tables = tables_of(env, ("t",), [os.urandom(400), os.urandom(500)])
    go = threading.Event()
    store.recycler._publisher.submit(go.wait)
    store.prepare(_drop(env, "t"), lease=5)
    env.clock.advance(10)
    expire = _Run("expire", store.expire_prepared)
    expire.start()
    go.set()
    expire.join(30)
    assert expire.out == 1
    _back(tables["t"])
    assert object_files(env) == []
    _clean(env, store)


def test_guard_abort_racing_the_queued_publisher(env: Env, store: Store) -> None:
    """Guard. The publisher is held; a statement prepares and aborts in another thread;
    the hold is released: the abort completes, every file back, no object."""
    tables = tables_of(env, ("t",), [os.urandom(400), os.urandom(500)])
    go = threading.Event()
    store.recycler._publisher.submit(go.wait)
    p = store.prepare(_drop(env, "t"), lease=600)
    abort = _Run("abort", lambda: store.abort(p.txid))
    abort.start()
    go.set()
    abort.join(30)
    assert abort.out == []
    _back(tables["t"])
    assert object_files(env) == []
    _clean(env, store)


def test_guard_injected_crash_mid_prepare_then_recovery(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard. An injected crash while staging the 2nd file (hard-linked file included,
    no writer): nothing was published; recovery puts every file back."""
    tables = tables_of(env, ("t",), [os.urandom(400 + i) for i in range(3)])
    other = env.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    os.link(min(tables["t"]), other)
    published = threading.Event()
    seen = {"staged": 0}

    def fn(name: str) -> None:
        if name == "recycle.file_published" and _publisher():
            published.set()
        if name == "recycle.file_staged" and not _publisher():
            seen["staged"] += 1
            if seen["staged"] == 2:
                raise faults.Crash(name)

    _hook(monkeypatch, fn)
    with pytest.raises(faults.Crash):
        store.prepare(_drop(env, "t"), lease=600)
    assert not published.is_set() and object_files(env) == []
    store.close()
    monkeypatch.undo()
    store = env.open()
    _back(tables["t"])
    assert object_files(env) == []
    assert store.events() == []
    _clean(env, store)


CHILD_KILL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))
store.prepare(RecycleRequest([args["table"]], op="DROP_TABLE", db="db", table="t"),
              lease=600)
store.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,then", [
    ("recycle.file_staged@3", "recover"),
    ("recycle.file_published@2", "commit"),
    ("recycle.prepared", "abort"),
])
def test_guard_kill_9_during_a_prepare_or_its_publish_ahead(
    tmp_path: Path, point: str, then: str
) -> None:
    """Guard. kill -9 in a half-staged prepare (recovery rolls it back), in its publish
    ahead or right after it (within the lease: the restarted daemon commits or aborts
    it, from the journal). Right bytes served or every file back; no object left over;
    nothing staged; fsck clean."""
    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir(parents=True)
    e.outside.mkdir()
    tables = tables_of(e, ("t",), [os.urandom(500 + 100 * i) for i in range(4)])
    other = e.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    os.link(sorted(tables["t"])[1], other)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_KILL, REPO,
         json.dumps({"env": e.env(), "table": str(e.warehouse / "db.db" / "t"),
                     })],
        env={**os.environ, "CMROOT_FAULTS": point}, capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    e.clock.set(time.time())
    store = e.open()
    try:
        if then == "recover":
            _back(tables["t"])
            assert object_files(e) == []
        else:
            [txid] = store.index.pending_txids()
            if then == "commit":
                res = store.commit(txid)
                assert sorted(f.path for f in res.files) == sorted(tables["t"])
                with open(other, "r+b") as fh:
                    fh.write(b"u's own later write")
                _served(store, tables["t"])
            else:
                store.abort(txid)
                _back(tables["t"])
                assert object_files(e) == []
        _clean(e, store)
    finally:
        store.close()


def test_guard_multithreaded_staging_failing_midway(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard. Files of over 1 MiB are staged by several threads; one file vanishes
    midway. Everything back, no object, nothing staged."""
    store.recycler.workers = 3
    tables = tables_of(env, ("t",), [os.urandom((1 << 20) + 1000 * i) for i in range(6)])
    published = threading.Event()
    gone: list[str] = []
    lock = threading.Lock()

    def fn(name: str) -> None:
        if name == "recycle.file_published" and _publisher():
            published.set()
        if name == "recycle.file_staged" and not _publisher():
            with lock:
                if gone:
                    return
                left = [p for p in tables["t"] if os.path.exists(p)]
                if left:
                    gone.append(max(left))
                    os.unlink(gone[-1])

    _hook(monkeypatch, fn)
    with pytest.raises(CmrootError):
        store.prepare(_drop(env, "t"), lease=600)
    assert gone
    _back({p: d for p, d in tables["t"].items() if p not in gone})
    assert object_files(env) == []
    assert store.events() == []
    _clean(env, store)


def test_guard_close_during_a_prepare_waits_for_it_and_loses_nothing(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard. store.close() while a prepare stages (its publisher waiting on its queue):
    close waits for the prepare rather than hang or cut it; after a restart the prepared
    statement aborts and every file is back, no object left."""
    tables = tables_of(env, ("a",), [os.urandom(500 + i) for i in range(3)])
    run_a, _, release = _held_prepare(env, store, monkeypatch, "a")
    close = _Run("close", store.close)
    close.start()
    release.set()
    run_a.join(30)
    close.join(30)
    assert not run_a.is_alive() and not close.is_alive(), "prepare or close hangs"
    monkeypatch.undo()
    store = env.open()
    for txid in store.index.pending_txids():
        store.abort(txid)
    _back(tables["a"])
    assert object_files(env) == []
    _clean(env, store)

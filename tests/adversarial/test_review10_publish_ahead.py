"""Hostile review 10: a prepared recycle publishes its objects ahead of its commit
(caea196: `Recycler._publish_ahead` on one `cmroot-publish` thread; the commit waits for
it under the transaction's lock, publishes what was not published ahead and, after a
restart, re-claims what it finds linked through `Journal.observe`).

Every failing test states its sequence, what is lost or wrong, and the invariant it
breaks. Checked against caea196^: the deduplication leak (store and HTTP), fsck, the
sweep/re-claim race and the skipped heal are new in caea196 (the HTTP leak and the heal
pass on caea196^); the two hard-link tests fail on caea196^ as well (older flaws that
the publish ahead now runs through on every prepared statement). All fixed with this file:
a rolled-back deduplicated file discards an object nobody claims or indexes, fsck leaves a
journaled transaction's objects alone, a commit claims before it looks, only objects the
publish ahead made are settled (a deduplicated one is compared again at commit), and a
file copied privately at prepare (or displaced with other names) never publishes its own
inode. Races are driven by fault points and hooks, never by sleeps. The last tests are
passing guards (kill -9 in the background publish with two statements deduplicating,
and commit/abort racing the background publish over HTTP)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cmroot_testlib import (
    Clock,
    Env,
    object_files,
    objects_sharing_inodes,
    on_point,
    snapshot,
    tables_of,
)

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest, Store
from cmroot.vocab import FileState

REPO = str(Path(__file__).resolve().parents[2])



def _drop(env: Env, name: str) -> RecycleRequest:
    return RecycleRequest([str(env.warehouse / "db.db" / name)], op="DROP_TABLE", db="db",
                          table=name)




# -- 1. deduplication between two prepared statements -----------------------------------


@pytest.mark.parametrize("first_ends", ["abort", "lease", "failed commit"])
def test_two_statements_of_identical_bytes_both_rolled_back_leave_no_object(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch, first_ends: str
) -> None:
    """Sequence: db.t and db.u hold files with identical bytes (common: empty or
    same-schema files, a table and its copy). Statement A prepares DROP TABLE t; its
    objects are published ahead (hard links of t's staged inodes). Statement B prepares
    DROP TABLE u; its publish ahead deduplicates against A's objects (claims them). A then
    ends first (abort / its lease passes / its commit fails at the flush): A's rollback
    finds B's claim, so `_break_link` replaces each object by a private copy and keeps
    it. Then B aborts.
    Observed: B's rollback sees its staged files are not the objects' inodes
    (FileState.STAGED_BY_RENAME), so it only releases its claim: the private copies stay
    in objects/ for ever, named by no entry, claimed by no one, unknown to the index (so
    no sweep ever removes them; fsck reports them "unindexed").
    Broken: "abort, lease expiry, a failed commit ... leave no object file that no entry
    names"; the store grows with every pair of rolled-back statements.
    Responsible: cmroot/store/journal.py Journal._undo (a file deduplicated against an
    object no one keeps any more only releases its claim; the object is never
    discarded), made common by Recycler._publish_ahead (objects now exist for the whole
    statement, not just inside a commit)."""
    contents = [os.urandom(700), os.urandom(900)]
    tables = tables_of(env, ("t", "u"), contents)
    before = snapshot(env)
    a = store.prepare(_drop(env, "t"), lease=60)
    b = store.prepare(_drop(env, "u"), lease=600)
    store.renew(b.txid, 600)  # waits for both parts' publish ahead (one thread, in order)
    assert len(object_files(env)) == len(contents)
    if first_ends == "abort":
        store.abort(a.txid)
    elif first_ends == "lease":
        env.clock.advance(61)
        assert store.expire_prepared() == 1
    else:
        def fail() -> None:
            raise OSError(5, "injected failure while flushing the commit")

        on_point(monkeypatch, "recycle.flushed", fail)
        with pytest.raises(CmrootError):
            store.commit(a.txid)
    store.abort(b.txid)
    for files in tables.values():
        assert {p: Path(p).read_bytes() for p in files} == files
    assert store.events() == []
    leaked = object_files(env)
    assert leaked == [], (
        f"{len(leaked)} object(s) left in the store after both statements were rolled "
        f"back (no entry names them): {[p.name for p in leaked]}"
    )
    assert snapshot(env)["index"] == before["index"]


def test_over_http_two_aborted_statements_of_identical_bytes_leave_no_object(
    make_daemon,
) -> None:
    """The same sequence against the real daemon: POST /v1/recycle {"prepare": true} for
    DROP TABLE t, then for DROP TABLE u (same bytes), then abort t, then abort u.
    Observed: 200s everywhere, every file back, no event, but objects/ keeps one file
    per content (the private copies `_break_link` made while u still claimed them), and
    the index has no object row for them: nothing ever removes them.
    Responsible: cmroot/store/journal.py Journal._undo (see the store-level test)."""
    d = make_daemon()
    data = [os.urandom(333), os.urandom(444)]
    files = {}
    for t in ("t", "u"):
        for i, x in enumerate(data):
            p = d.warehouse / "db.db" / t / f"f{i}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(x)
            files[str(p)] = x
    txids = []
    for t in ("t", "u"):
        r = d.request("POST", "/v1/recycle", {
            "paths": [str(d.warehouse / "db.db" / t)], "op": "DROP_TABLE", "db": "db",
            "table": t, "prepare": True, "lease": 600}, scope="write")
        assert r.status == 200, r
        txids.append(r.json()["txid"])
    # Both publishes ahead are done once a renew of the later one answers.
    assert d.request("POST", f"/v1/transactions/{txids[1]}/renew", {"lease": 600},
                     scope="write").status == 200
    for txid in txids:
        r = d.request("POST", f"/v1/transactions/{txid}/abort", scope="write")
        assert r.status == 200, r
    assert {p: Path(p).read_bytes() for p in files} == files
    assert d.index_counts()["events"] == 0
    left = sorted(str(p) for p in (d.store / "objects").rglob("*") if p.is_file())
    assert left == [], f"objects left after both statements aborted: {left}"


# -- 2. fsck with a prepared transaction -------------------------------------------------


def test_fsck_leaves_a_prepared_transactions_objects_alone(env: Env) -> None:
    """Sequence: prepare DROP TABLE t (lease 600 s): its objects are published ahead,
    named by no entry. The daemon is stopped (the publish ahead had finished) and the
    operator runs `cmroot fsck`, then `cmroot fsck --repair` (both open the store, whose
    recovery keeps the transaction: its lease runs). The daemon restarts and the
    statement aborts.
    Observed: fsck reports each prepared object as "unindexed" (exit 1, a finding the
    operator is told to repair); --repair registers them in the index for a full
    retention; after the abort, `discard_unindexed` sees the index row and keeps the
    object (a `_break_link` copy): an object no entry names stays in the store for the
    whole retention, and an expired-looking row for bytes nobody recycled.
    Broken: "fsck on a store with a prepared transaction does not report or repair its
    objects into something wrong" and "abort leaves no object no entry names".
    Responsible: cmroot/store/fsck.py fsck/_Walk.shard (objects of journaled prepared
    transactions are not known to it; before caea196 they did not exist until the
    commit), with Recycler._publish_ahead."""
    data = os.urandom(2048)
    tables = tables_of(env, ("t",), [data])
    before = snapshot(env)
    store = env.open()
    p = store.prepare(_drop(env, "t"), lease=600)
    store.close()  # waits for the publish ahead
    assert len(object_files(env)) == 1
    store = env.open()
    report = store.fsck()
    found = {k: v for k, v in report.counts.items() if v}
    repaired = store.fsck(repair=True)
    store.close()
    store = env.open()
    store.abort(p.txid)
    after = snapshot(env)
    left = object_files(env)
    store.close()
    assert {q: Path(q).read_bytes() for q in tables["t"]} == tables["t"]
    assert found == {}, f"fsck reports a prepared transaction's objects: {found}"
    assert repaired.clean
    assert left == [], f"object(s) left after the abort: {[q.name for q in left]}"
    assert after["index"] == before["index"]


# -- 3. re-claiming after a restart races the sweep ---------------------------------------


def test_a_sweep_between_observe_and_claim_loses_a_committed_file(env: Env) -> None:
    """Sequence (retain 1 h): statement S prepares DROP TABLE t (lease 2 h); t/f's object
    X is published ahead (X is f's inode). A one-phase DROP TABLE u of a file with the
    same bytes deduplicates against X and commits (X is indexed, expiring in 1 h). The
    daemon restarts (claims live in memory: X is claimed by no one). 61 min later S
    commits: `commit.publish` calls `Journal.observe(f)` -> PUBLISHED, and only then
    `Objects.claim`. The retention sweep (a timer thread of the daemon, here run in that
    gap) removes X: expired by u's entry, unclaimed.
    Observed: the commit records DROP_TABLE t and the entry (t/f, X) with no object
    behind it; the staged name, the only other copy, is removed by the clean-up.
    (t/f, X) resolves "missing": the bytes are gone.
    Broken: invariant 1 (no loss) and "the sweep never deletes an object an in-flight
    transaction needs".
    Responsible: cmroot/store/recycle.py Recycler.commit (observe, then claim: the
    claim must be taken first, or the object re-checked after it)."""
    data = os.urandom(4096)
    tables = tables_of(env, ("t", "u"), [data])
    c = cks.of_bytes(data)
    store = env.open(CMROOT_STORE_RETAIN="1h")
    s = store.prepare(_drop(env, "t"), lease=7200)
    store.renew(s.txid, 7200)  # the publish ahead is done
    store.recycle(_drop(env, "u"))
    store.close()
    env.clock.advance(3660)
    store = env.open(CMROOT_STORE_RETAIN="1h")
    journal = store.recycler.journal
    real = journal.observe
    swept = []

    def observe_then_sweep(it):  # type: ignore[no-untyped-def]
        state = real(it)
        if state == FileState.PUBLISHED and not swept:
            swept.append(store.gc().removed_objects)
        return state

    journal.observe = observe_then_sweep  # type: ignore[method-assign]
    res = store.commit(s.txid)
    [f] = [k for k in tables["t"]]
    assert [x.path for x in res.files] == [f]
    status = store.resolve([{"path": f, "checksum": c}])[0].status
    store.close()
    assert swept, "the commit did not re-claim a published-ahead object"
    assert status == "cmroot", (
        f"committed (t/f, {c}) resolves {status!r}: the sweep removed its object while the"
        f" commit re-claimed it ({swept[0]} removed)"
    )


def test_an_object_corrupted_after_the_publish_ahead_is_healed_by_the_commit(
    env: Env, store: Store
) -> None:
    """Sequence: DROP TABLE u (one phase) stores object X for u/g (bytes D). Statement S
    prepares DROP TABLE t, whose t/f has the same bytes D: the publish ahead compares
    t/f with X byte for byte and deduplicates (S's file counts as published). While the
    statement runs, X rots on disk (a few bytes flip; a replica reading (u/g, X) would
    now quarantine it). S commits.
    Observed: the commit skips t/f (published ahead) and only records: the entry
    (t/f, X) names the rotten object; the staged t/f, the one good copy of D, is
    deleted by the clean-up. (t/f, X) is not served (Quarantined), nor is (u/g, X).
    Before caea196 the commit's own publish found X differing, hashed it and healed it
    from the staged file (`Objects._heal`): both pairs stayed retrievable.
    Broken: invariant 1 (bytes the commit held are lost) and "a committed transaction
    serves exactly the recycled bytes for every file".
    Responsible: cmroot/store/recycle.py Recycler.commit (`done` trusts a comparison
    made a whole statement earlier; it should re-check what it skips, e.g. same inode
    or a size/hash check, and fall back to `_publish`)."""
    data = os.urandom(4096)
    tables = tables_of(env, ("t", "u"), [data])
    c = cks.of_bytes(data)
    store.recycle(_drop(env, "u"))
    s = store.prepare(_drop(env, "t"), lease=600)
    store.renew(s.txid, 600)  # the publish ahead (a deduplication) is done
    [obj] = object_files(env)
    with open(obj, "r+b") as fh:  # bit rot in the stored object
        fh.seek(100)
        fh.write(b"\0\1\2\3")
    store.commit(s.txid)
    [f] = list(tables["t"])
    with store.open_verified(f, c) as v:
        assert os.pread(v.fd, 8192, 0) == data


# -- 4. hard-linked sources --------------------------------------------------------------


def test_hard_linked_file_unlinked_elsewhere_before_the_publish_ahead_keeps_its_bytes(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: db/t/f has a second name db/u/g. Prepare DROP TABLE t: f is staged and
    hashed (checksum C) and, as it has two names, its private copy (C's bytes) is made.
    Before the background publish runs, the other table's writer rewrites g in place
    and then drops it (g's name goes: nlink is back to 1). The statement commits.
    Observed: `_publish_ahead` re-reads nlink (1), so it publishes the staged inode
    itself (the rewritten bytes) as object C instead of the private copy; the commit
    records (f, C); the object does not hash to C and is quarantined when read:
    (f, C) is not retrievable, and the good private copy was deleted by the clean-up.
    Broken: invariants 1 and 3 (the bytes prepare reported are lost).
    Responsible: cmroot/store/recycle.py Recycler._publish_ahead / _publish (choose the
    private copy when prepare made one, not by the link count at publish time); the
    commit's publish after a restart has the same flaw."""
    t = env.warehouse / "db.db" / "t"
    u = env.warehouse / "db.db" / "u"
    t.mkdir(parents=True)
    u.mkdir(parents=True)
    data = os.urandom(4096)
    (t / "f").write_bytes(data)
    os.link(t / "f", u / "g")
    c = cks.of_bytes(data)

    def other_writer() -> None:  # runs in prepare, before the publish ahead is queued
        with open(u / "g", "r+b") as fh:
            fh.write(b"X" * 4096)
        os.unlink(u / "g")

    on_point(monkeypatch, "recycle.prepared", other_writer)
    p = store.prepare(_drop(env, "t"), lease=600)
    assert [f.checksum for f in p.files] == [c]
    store.commit(p.txid)
    bad = [q.name for q in object_files(env) if cks.of_local_file(str(q)) != q.name]
    assert bad == [], f"object(s) that do not hash to their name: {bad}"
    with store.open_verified(str(t / "f"), c) as v:
        assert os.pread(v.fd, 8192, 0) == data


def test_a_displaced_hard_linked_file_kept_in_the_store_shares_no_warehouse_inode(
    env: Env, store: Store
) -> None:
    """Sequence: db/t/f has a second name db/u/g. Prepare DROP TABLE t (f's private copy
    is published ahead as the object); a writer re-creates t/f; abort. f cannot go back
    (its path is taken), so its old bytes are kept in the store as a displaced entry.
    Observed: the rollback first discards the published private copy, then
    `_keep_displaced` publishes the staged inode itself: the object is the inode of the
    live warehouse file u/g, so every later write to u/g changes the stored bytes of
    (t/f, C) (and the object stops hashing to its name).
    Broken: "hard-linked source files never make a store object share the warehouse
    file's inode" (invariants 1 and 3). Not new in caea196 (the same path runs for a
    failed commit before it), but every abort of a statement with a hard-linked file
    now goes through it.
    Responsible: cmroot/store/journal.py Journal._keep_displaced (publishes without
    `private=` for a file with other names)."""
    t = env.warehouse / "db.db" / "t"
    u = env.warehouse / "db.db" / "u"
    t.mkdir(parents=True)
    u.mkdir(parents=True)
    data = os.urandom(4096)
    (t / "f").write_bytes(data)
    os.link(t / "f", u / "g")
    c = cks.of_bytes(data)
    p = store.prepare(_drop(env, "t"), lease=600)
    (t / "f").write_bytes(b"the statement's new file")
    assert store.abort(p.txid) == [str(t / "f")]
    shared = objects_sharing_inodes(env)
    assert shared == [], f"store object(s) share the inode of a warehouse file: {shared}"
    with open(u / "g", "r+b") as fh:  # the other table's legitimate write
        fh.write(b"Y" * 10)
    with store.open_verified(str(t / "f"), c) as v:
        assert os.pread(v.fd, 8192, 0) == data


# -- guards -------------------------------------------------------------------------------

CHILD = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))
def drop(t):
    return RecycleRequest([f"{args['db']}/{t}"], op="DROP_TABLE", db="db", table=t)
# Hold the one publisher until both statements are prepared, so the k-th publish is
# always the same file: t's files are publishes 1 and 2, u's 3 and 4.
go = threading.Event()
store.recycler._publisher.submit(go.wait)
a = store.prepare(drop("t"), lease=600)
b = store.prepare(drop("u"), lease=600)
go.set()
store.renew(b.txid, 600)  # waits while the background publishes (and dies in it)
store.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,order", [
    ("recycle.file_published@3", "commit u, abort t"),  # u's first dedup done, then death
    ("recycle.file_published@3", "abort t, commit u"),
    ("recycle.file_published@2", "abort t, commit u"),  # t's objects half published
])
def test_guard_kill_9_in_the_publish_ahead_of_deduplicating_statements(
    tmp_path: Path, point: str, order: str
) -> None:
    """Guard. kill -9 in the background publish while two prepared statements share
    identical bytes; restart within the lease; then the two statements end in either
    order. t's files are back, u's are served with the right bytes, one object per
    content, none sharing an inode with a warehouse file, nothing in staging."""
    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir(parents=True)
    e.outside.mkdir()
    contents = [os.urandom(500), os.urandom(600)]
    tables = tables_of(e, ("t", "u"), contents)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, REPO,
         json.dumps({"env": e.env(), "db": str(e.warehouse / "db.db")})],
        env={**os.environ, "CMROOT_FAULTS": point}, capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    e.clock.set(time.time())
    store = e.open()
    by_table = {store.index.pending(x)[0].request["table"]: x
                for x in store.index.pending_txids()}
    ta, tb = by_table["t"], by_table["u"]
    try:
        if order.startswith("commit"):
            res = store.commit(tb)
            store.abort(ta)
        else:
            store.abort(ta)
            res = store.commit(tb)
        assert {f.path for f in res.files} == set(tables["u"])
        assert {p: Path(p).read_bytes() for p in tables["t"]} == tables["t"]
        for path, data in tables["u"].items():
            assert not Path(path).exists()
            with store.open_verified(path, cks.of_bytes(data)) as v:
                assert os.pread(v.fd, len(data) + 1, 0) == data
        assert sorted(p.name for p in object_files(e)) == sorted(
            cks.of_bytes(x) for x in contents)
        assert objects_sharing_inodes(e) == []
        assert os.listdir(e.staging_dir) == []
        assert [r.status for r in store.resolve(
            [{"path": p, "checksum": cks.of_bytes(x)} for p, x in tables["t"].items()]
        )] == ["original"] * len(contents)
    finally:
        store.close()


def test_guard_commit_and_abort_racing_the_publish_ahead_do_not_hang(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard. The background publish of statement A is held at its first file (a fault
    point hook waits on an event) while other threads commit A and abort B (same bytes,
    published after A's); the hold is released only once both hold their transaction
    locks (waiting for the publish inside them). Everything completes, A is committed and served,
    B's files are back, and nothing is served for B's paths."""
    contents = [os.urandom(800)]
    tables = tables_of(env, ("t", "u"), contents)
    release = threading.Event()
    held = threading.Event()
    real = faults.point

    def point(name: str) -> None:
        if name == "recycle.file_published" and threading.current_thread().name.startswith(
            "cmroot-publish"
        ) and not held.is_set():
            held.set()
            assert release.wait(30), "never released"
        real(name)

    monkeypatch.setattr(faults, "point", point)
    a = store.prepare(_drop(env, "t"), lease=600)
    b = store.prepare(_drop(env, "u"), lease=600)
    assert held.wait(30)
    # B's files are not resolvable while prepared (and A's object exists already).
    assert {r.status for r in store.resolve(
        [{"path": p, "checksum": cks.of_bytes(x)} for p, x in tables["u"].items()])} == {
        "missing"}
    out: dict[str, object] = {}

    def run(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            out[name] = fn()
        except Exception as ex:
            out[name] = ex

    threads = [
        threading.Thread(target=run, args=("commit", lambda: store.commit(a.txid))),
        threading.Thread(target=run, args=("abort", lambda: store.abort(b.txid))),
    ]
    for th in threads:
        th.start()
    locks = store.recycler._locks
    deadline = time.monotonic() + 30
    while not all(t in locks and locks[t].locked() for t in (a.txid, b.txid)):
        assert time.monotonic() < deadline, "commit/abort never took their locks"
        time.sleep(0.001)  # a poll of state, not the synchronisation itself
    release.set()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a commit or abort hangs"
    assert not isinstance(out["commit"], Exception), out["commit"]
    assert out["abort"] == [], out["abort"]
    assert {p: Path(p).read_bytes() for p in tables["u"]} == tables["u"]
    for path, data in tables["t"].items():
        with store.open_verified(path, cks.of_bytes(data)) as v:
            assert os.pread(v.fd, len(data) + 1, 0) == data
    assert objects_sharing_inodes(env) == []

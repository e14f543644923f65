"""Hostile review of the two-phase recycle (prepare / join / commit / abort / renew /
expiry). Every test here failed on the code it was written against."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cmroot_testlib import Env, assert_objects_match_names

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError, NotFound
from cmroot.store import RecycleRequest, Store


def _write(fs, path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)


def test_remote_move_prepare_commit_removes_the_sources(remote) -> None:
    """Sequence: a warehouse on an object store (fsspec memory://, so files are staged by
    copy); prepare DROP_TABLE memory://b/db/t in move mode, then commit.
    Observed: the commit records a DROP_TABLE event and entries, but every source file
    is still in the bucket: prepare never journals the copied sources' identities
    (journal_prepared stores checksum and size only), so commit/finish skip their removal.
    Broken: invariant 2 (an event claims a drop whose files are still at their source;
    a replica drops them, the source keeps them) and the move semantics.
    Expected: as with a one-phase move, the sources are gone after the commit."""
    store, fs, bucket = remote
    files = {f"/{bucket}/db/t/p=1/part-{i}": os.urandom(3000 + i) for i in range(3)}
    for path, data in files.items():
        _write(fs, path, data)
    p = store.prepare(
        RecycleRequest([f"memory://{bucket}/db/t"], op="DROP_TABLE", db="db", table="t"),
        lease=600,
    )
    res = store.commit(p.txid)
    assert len(res.files) == 3 and len(store.events()) == 1
    assert not fs.find(f"/{bucket}/db/t"), "committed DROP_TABLE left its sources in place"


def test_hard_linked_file_changed_between_prepare_and_commit_keeps_its_bytes(
    env: Env, store: Store
) -> None:
    """Sequence: db/t/f has a second name db/u/g (a hard link, e.g. a Hive table that
    shares files); prepare DROP_TABLE db/t (f is renamed into staging; its checksum C is
    returned to the client); a writer then rewrites db/u/g in place (legitimate: it is a
    live file of another table); commit.
    Observed: commit makes the object's private copy only now, from the changed inode,
    and publishes it under C without re-hashing: the object does not hash to its name,
    and (f, C) is no longer retrievable anywhere.
    Broken: invariants 1 and 3 (the one-phase path copies a hard-linked file right after
    hashing it; the two-phase path defers the copy across the whole lease).
    Expected: the private copy is taken when the file is hashed (at prepare), or commit
    re-verifies and refuses, so (f, C) stays retrievable with the prepared bytes."""
    t = env.warehouse / "db" / "t"
    u = env.warehouse / "db" / "u"
    t.mkdir(parents=True)
    u.mkdir(parents=True)
    data = os.urandom(4096)
    (t / "f").write_bytes(data)
    os.link(t / "f", u / "g")
    c = cks.of_bytes(data)
    p = store.prepare(RecycleRequest([str(t)], op="DROP_TABLE", db="db", table="t"), lease=600)
    assert [f.checksum for f in p.files] == [c]
    with open(u / "g", "r+b") as fh:  # the other table's writer, in place
        fh.write(b"X" * 4096)
    store.commit(p.txid)
    assert_objects_match_names(env)
    with store.open_verified(str(t / "f"), c) as v:
        assert os.pread(v.fd, 8192, 0) == data


def _two_partitions(env: Env) -> tuple[Path, dict[str, bytes]]:
    from cmroot_testlib import make_table, table_dir

    files = make_table(env.warehouse, "db", "t", [{"p": str(i)} for i in range(3)],
                       files_per_partition=2, size=(10, 500))
    return table_dir(env.warehouse, "db", "t"), files


def _part(tdir: Path, i: int) -> RecycleRequest:
    return RecycleRequest([str(tdir / f"p={i}")], op="DROP_PARTITION", db="db", table="t",
                          partitions=[{"p": str(i)}])


def test_an_abort_interrupted_by_a_crash_is_finished_at_restart(env: Env) -> None:
    """Sequence: prepare p=0 and join p=1 (4 files, lease 600 s); abort; the daemon dies
    (kill -9, here an injected Crash) after the first file went back; restart within
    the lease.
    Observed: recovery leaves the transaction PREPARED (abort never marks it as rolling
    back), so one file is back at its source and the other three stay in staging,
    neither at their source nor retrievable through the store, until the lease passes
    (up to 24 h); the statement that aborted sees its table half gone meanwhile.
    Broken: the contract "a request interrupted by a crash is rolled back on restart:
    files go back to their source"; a file left in staging unreachable.
    Expected: an interrupted abort is finished by recovery: every file back, nothing
    left in the journal or in staging."""
    from cmroot import faults

    tdir, files = _two_partitions(env)
    store = env.open()
    p = store.prepare(_part(tdir, 0), lease=600)
    p = store.prepare(_part(tdir, 1), lease=600, txid=p.txid)
    faults.arm("journal.rolled_back_file", 1, crash=True)
    with pytest.raises(faults.Crash):
        store.abort(p.txid)
    store.close()
    store = env.open()  # the restart, well within the lease
    try:
        missing = sorted(k for k, d in files.items()
                         if not Path(k).exists() or Path(k).read_bytes() != d)
        assert missing == [], f"{len(missing)} files neither back nor resolvable: {missing}"
        assert store.index.pending() == []
        assert os.listdir(env.staging_dir) == []
    finally:
        store.close()


def test_commit_after_a_crash_mid_abort_records_no_drop_of_files_at_their_source(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: prepare p=0 (2 files, lease 600 s); abort; the daemon dies right after
    put_back linked the first file back to its source (before it unlinked the staged
    name); restart within the lease; the statement's (retried) commit.
    Observed: the transaction is still PREPARED after the restart, so the commit goes
    through: a DROP_PARTITION event and entries for both files, while the first file is
    back at its source (the staged name was a second link of it, copied privately).
    Broken: invariant 2 (an event claims a drop of a file that is at its source; a
    replica deletes it) and "a request interrupted by a crash is rolled back on restart".
    Expected: the interrupted abort is finished at restart and the commit is a 404."""
    from cmroot import faults
    from cmroot.store.source.local import LocalSession

    tdir, _files = _two_partitions(env)
    store = env.open()
    p = store.prepare(_part(tdir, 0), lease=600)
    real = LocalSession.put_back

    def put_back_then_die(self, rel: str, staged: str) -> bool:
        pfd, name = self._parent(rel, create=True)
        os.link(staged, name, dst_dir_fd=pfd, follow_symlinks=False)
        raise faults.Crash("killed between the link and the unlink")

    monkeypatch.setattr(LocalSession, "put_back", put_back_then_die)
    with pytest.raises(faults.Crash):
        store.abort(p.txid)
    monkeypatch.setattr(LocalSession, "put_back", real)
    store.close()
    store = env.open()
    try:
        try:
            res = store.commit(p.txid)
        except NotFound:
            res = None
        dropped = {f["path"] for e in store.events() for f in e.files}
        at_source = {k for k in dropped if Path(k).exists()}
        assert at_source == set(), (
            f"event {res and res.event_id} drops files that are at their source: {at_source}"
        )
    finally:
        store.close()


def test_a_commit_after_the_lease_passed_is_refused(env: Env, store: Store) -> None:
    """Sequence: prepare p=0 with a 60 s lease; 120 s pass (the expiry job, every 5 s,
    has not run yet, or is busy rolling back another transaction); commit.
    Observed: the commit publishes and records the DROP_PARTITION event: commit (and
    renew, and a join) never look at the lease, only at the state. The outcome of the
    same commit depends on a timer: the same sequence with a restart in between, or the
    job running first, rolls the files back and answers 404.
    Broken: the API row "a prepared transaction neither committed nor aborted before its
    lease expires is rolled back by the daemon" (the statement that gave up on its lease
    may already have reported failure).
    Expected: a commit once the lease has passed is a 404 and the files go back."""
    tdir, files = _two_partitions(env)
    p = store.prepare(_part(tdir, 0), lease=60)
    env.clock.advance(120)
    with pytest.raises(NotFound):
        store.commit(p.txid)
    assert store.events() == []
    assert all(Path(k).read_bytes() == d for k, d in files.items())


def test_a_join_never_shortens_the_statements_lease(env: Env, store: Store) -> None:
    """Sequence: prepare p=0 with a 3600 s lease (a long multi-partition statement); join
    p=1 with a 1 s lease (or, over HTTP, with no lease: the 5 min default); 2 s pass; the
    expiry job runs.
    Observed: the join overwrote the lease with its own (journal_prepared sets it), so
    the whole statement, p=0 included, is rolled back after 2 s although its holder
    asked for an hour; renew takes the max of the two, a join does not.
    Broken: the lease the statement holds (API row "renew extends the lease"); the
    statement's commit later fails with 404.
    Expected: a join keeps the later of the transaction's lease and its own."""
    tdir, _files = _two_partitions(env)
    p = store.prepare(_part(tdir, 0), lease=3600)
    q = store.prepare(_part(tdir, 1), lease=1, txid=p.txid)
    assert q.expires >= p.expires
    env.clock.advance(2)
    assert store.expire_prepared() == 0
    assert len(store.commit(p.txid).files) == 4


def test_a_copy_statement_naming_a_path_in_two_parts_records_it_once(
    env: Env, store: Store
) -> None:
    """Sequence: a copy-mode INSERT_OVERWRITE statement whose two parts both name p=0
    (or a partition and then its table): prepare, join, commit.
    Observed: the event lists each of p=0's files twice and two entries are recorded per
    file; a one-phase recycle of the same path given twice lists each file once.
    Broken: a join of the same path twice is not refused nor merged: the event is not
    what the statement recycled (a replica replays every file twice).
    Expected: the files of a path already in the transaction are not added again (or the
    join is refused with 409 and the statement rolled back)."""
    tdir, _files = _two_partitions(env)
    req = RecycleRequest([str(tdir / "p=0")], mode="copy", op="INSERT_OVERWRITE", db="db",
                         table="t")
    p = store.prepare(req, lease=600)
    try:
        p = store.prepare(req, lease=600, txid=p.txid)
    except CmrootError:
        return  # refused: fine, as long as nothing was recorded
    res = store.commit(p.txid)
    paths = [f.path for f in res.files]
    assert len(paths) == len(set(paths)), f"files recorded twice: {sorted(paths)}"
    [event] = store.events()
    assert len(event.files) == len({f["path"] for f in event.files})


def test_a_lease_without_prepare_is_refused_not_recycled_at_once(daemon) -> None:
    """Sequence: POST /v1/recycle {"paths": [p=0], "op": "DROP_PARTITION", "lease": 30}
    (a two-phase hook that lost its "prepare": true, e.g. a client built on a library
    that drops false-y fields) over HTTP.
    Observed: 200 with an event_id: the lease is silently ignored and the drop is
    recorded and published at once, with no chance to abort; "txid" without "prepare"
    is a 400, "lease" without it is not.
    Broken: a two-phase field outside a two-phase request is accepted and turns a
    statement that meant to commit later into an immediate destructive event.
    Expected: 400 ("lease without prepare"), nothing moved, no event."""
    d = daemon
    path = d.warehouse / "db.db" / "t" / "p=0" / "f0"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * 100)
    body = {"paths": [str(path.parent)], "op": "DROP_PARTITION", "db": "db", "table": "t",
            "lease": 30}
    r = d.request("POST", "/v1/recycle", body, scope="write")
    assert r.status == 400, r
    assert path.read_bytes() == b"x" * 100
    assert d.index_counts()["events"] == 0


def test_cross_device_move_prepare_commit_removes_the_sources(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: a local warehouse whose rename into staging is refused with EXDEV (a
    bind mount or another filesystem: the file is copied instead, Method.COPY under
    mode move); prepare DROP_PARTITION p=0; commit.
    Observed: the event and entries are recorded but both source files are still in the
    warehouse: the copied sources' identities taken at prepare are never journaled
    (journal_prepared writes checksum and size only), so Journal.finish has no ident
    and skips their removal. The one-phase recycle of the same files removes them.
    Broken: invariant 2 (a DROP event for files that are at their source) and move
    semantics.
    Expected: after the commit the sources are gone, as after a one-phase move."""
    import errno

    tdir, _files = _two_partitions(env)
    staging = str(env.staging_dir)
    real_rename = os.rename

    def exdev(src, dst, *a, **kw):
        if str(dst).startswith(staging):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", exdev)
    p = store.prepare(_part(tdir, 0), lease=600)
    res = store.commit(p.txid)
    assert len(res.files) == 2 and len(store.events()) == 1
    left = sorted(f.path for f in res.files if Path(f.path).exists())
    assert left == [], f"committed DROP_PARTITION left its sources in place: {left}"

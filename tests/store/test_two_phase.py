"""Two-phase recycles (invariant 2: a statement is one unit): `prepare` stages files
unseen, `commit` publishes them with one event, `abort` or an expired lease puts every
part back, and a failed part of a statement rolls back all of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cmroot_testlib import Env, make_table, object_files, on_point, snapshot, table_dir

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, CmrootError, Conflict, NotFound
from cmroot.store import RecycleRequest, Store


def _table(env: Env, parts: int = 3) -> tuple[Path, dict[str, bytes]]:
    files = make_table(env.warehouse, "db", "t", [{"p": str(i)} for i in range(parts)],
                       files_per_partition=2, size=(10, 500))
    return table_dir(env.warehouse, "db", "t"), files


def _part(tdir: Path, i: int) -> RecycleRequest:
    return RecycleRequest(paths=[str(tdir / f"p={i}")], op="DROP_PARTITION", db="db",
                          table="t", partitions=[{"p": str(i)}])


def _untouched(env: Env, before: dict[str, object], files: dict[str, bytes]) -> None:
    after = snapshot(env)
    assert after["warehouse"] == before["warehouse"], "the warehouse changed"
    assert after["index"] == before["index"], "the index changed"
    assert {p: Path(p).read_bytes() for p in files} == files
    assert object_files(env) == []
    assert os.listdir(env.staging_dir) == []


def test_prepared_files_are_unseen_until_commit_then_one_event(env: Env, store: Store) -> None:
    tdir, files = _table(env)
    first = store.prepare(_part(tdir, 0))
    p = store.prepare(_part(tdir, 1), txid=first.txid)
    # Each part is answered with its own files, and the count the transaction holds.
    assert {f.path for f in p.files} == {k for k in files if "/p=1/" in k}
    moved = {f.path for f in first.files} | {f.path for f in p.files}
    assert moved == {k for k in files if "/p=0/" in k or "/p=1/" in k}
    assert p.staged == len(moved)
    assert all(not Path(k).exists() for k in moved)
    assert store.events() == []
    assert [r.status for r in store.resolve(
        [{"path": k, "checksum": cks.of_bytes(files[k])} for k in sorted(moved)]
    )] == ["missing"] * len(moved)

    res = store.commit(p.txid)
    [event] = store.events()
    assert event.id == res.event_id and event.type == "DROP_PARTITION"
    assert sorted(event.partitions, key=str) == [{"p": "0"}, {"p": "1"}]
    assert {f["path"] for f in event.files} == moved
    assert [r.status for r in store.resolve(
        [{"path": k, "checksum": cks.of_bytes(files[k])} for k in sorted(moved)]
    )] == ["cmroot"] * len(moved)
    assert not (tdir / "p=0").exists() and (tdir / "p=2").is_dir()
    assert os.listdir(env.staging_dir) == []
    assert store.commit(p.txid).event_id == res.event_id  # the same answer, nothing more
    assert len(store.events()) == 1
    with pytest.raises(Conflict, match="already committed"):
        store.abort(p.txid)


def test_abort_puts_every_part_back(env: Env, store: Store) -> None:
    tdir, files = _table(env)
    before = snapshot(env)
    p = store.prepare(_part(tdir, 0))
    store.prepare(_part(tdir, 1), txid=p.txid)
    assert store.abort(p.txid) == []
    _untouched(env, before, files)
    assert store.events() == []


def test_a_refused_part_rolls_back_the_whole_statement(env: Env, store: Store) -> None:
    """A multi-partition DROP PARTITION whose second partition holds a symlink escaping
    the roots: that part is refused, and the first partition (already staged) is back."""
    tdir, files = _table(env)
    (env.outside / "secret").write_bytes(b"s")
    os.symlink(env.outside / "secret", tdir / "p=1" / "link")
    before = snapshot(env)
    p = store.prepare(_part(tdir, 0))
    with pytest.raises(CmrootError):
        store.prepare(_part(tdir, 1), txid=p.txid)
    _untouched(env, before, files)
    with pytest.raises(NotFound):
        store.commit(p.txid)
    assert store.events() == []


def test_a_part_of_another_statement_cannot_join(env: Env, store: Store) -> None:
    tdir, files = _table(env)
    before = snapshot(env)
    p = store.prepare(_part(tdir, 0))
    other = RecycleRequest(paths=[str(tdir / "p=1")], op="TRUNCATE", db="db", table="t")
    with pytest.raises(Conflict):
        store.prepare(other, txid=p.txid)
    _untouched(env, before, files)


def test_expired_lease_rolls_back_and_renew_keeps_it(env: Env, store: Store) -> None:
    tdir, files = _table(env)
    before = snapshot(env)
    p = store.prepare(_part(tdir, 0), lease=60)
    env.clock.advance(50)
    assert store.renew(p.txid, 60) == env.clock() + 60
    env.clock.advance(50)
    assert store.expire_prepared() == 0
    env.clock.advance(20)
    assert store.expire_prepared() == 1
    _untouched(env, before, files)
    with pytest.raises(NotFound):
        store.commit(p.txid)
    with pytest.raises(NotFound):
        store.renew(p.txid, 60)


def test_a_prepared_transaction_survives_a_restart_within_its_lease(env: Env) -> None:
    tdir, files = _table(env)
    store = env.open()
    p = store.prepare(_part(tdir, 0), lease=600)
    store.close()
    store = env.open()  # recovery leaves it: its statement may still commit
    res = store.commit(p.txid)
    assert {f.path for f in res.files} == {k for k in files if "/p=0/" in k}
    assert len(store.events()) == 1
    assert os.listdir(env.staging_dir) == []
    store.close()


def test_recovery_rolls_back_a_prepared_transaction_whose_lease_passed(env: Env) -> None:
    tdir, files = _table(env)
    before = snapshot(env)
    store = env.open()
    store.prepare(_part(tdir, 0), lease=60)
    store.close()
    env.clock.advance(61)
    store = env.open()
    _untouched(env, before, files)
    assert store.events() == []
    store.close()


def test_a_failure_at_commit_puts_every_file_back(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tdir, files = _table(env)
    before = snapshot(env)
    p = store.prepare(_part(tdir, 0))
    p = store.prepare(_part(tdir, 1), txid=p.txid)

    def fail() -> None:
        raise OSError(5, "injected failure while flushing")

    on_point(monkeypatch, "recycle.flushed", fail)
    with pytest.raises(CmrootError):
        store.commit(p.txid)
    _untouched(env, before, files)
    assert store.events() == []


def test_objects_not_published_ahead_are_published_by_the_commit(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared part's objects are published in the background while its statement
    runs; one that fails there (here the second file's) is left to the commit, which
    publishes it and records every file."""
    tdir, files = _table(env)

    def fail() -> None:
        raise OSError(28, "injected: no space left while publishing ahead")

    on_point(monkeypatch, "recycle.file_published", fail, k=2)
    p = store.prepare(_part(tdir, 0))
    res = store.commit(p.txid)
    moved = {k for k in files if "/p=0/" in k}
    assert {f.path for f in res.files} == moved
    assert [r.status for r in store.resolve(
        [{"path": k, "checksum": cks.of_bytes(files[k])} for k in sorted(moved)]
    )] == ["cmroot"] * len(moved)
    assert os.listdir(env.staging_dir) == []


def test_bad_lease_and_unknown_txid_are_refused(env: Env, store: Store) -> None:
    tdir, files = _table(env)
    before = snapshot(env)
    for lease in (0, -1, 10**9, True):
        with pytest.raises(BadRequest):
            store.prepare(_part(tdir, 0), lease=lease)
    for txid in ("0" * 32, "nope", "../../etc", ""):
        with pytest.raises(NotFound):
            store.commit(txid)
        with pytest.raises(NotFound):
            store.prepare(_part(tdir, 0), txid=txid)
    _untouched(env, before, files)


# -- SIGKILL between and inside the phases -------------------------------------------------

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))
def part(i):
    return RecycleRequest(paths=[f"{args['table']}/p={i}"], op="DROP_PARTITION", db="db",
                          table="t", partitions=[{"p": str(i)}])
p = store.prepare(part(0), lease=600)
print(p.txid, flush=True)
store.prepare(part(1), txid=p.txid)
store.commit(p.txid)
store.close()
"""

REPO = str(Path(__file__).resolve().parents[2])
TWO_PHASE_KILL_POINTS = (
    "journal.begun",
    "recycle.file_staged@2",
    "recycle.prepared",  # first part prepared
    "recycle.file_staged@3",  # inside the second part (the join)
    "recycle.prepared@2",  # both parts prepared
    "recycle.file_published@3",  # publishing the second part ahead, the commit waiting
    "recycle.flushed",
    "journal.committed",
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", TWO_PHASE_KILL_POINTS)
def test_sigkill_anywhere_in_a_two_phase_recycle(tmp_path: Path, point: str) -> None:
    """kill -9 at each point of prepare, join and commit. After a restart the statement
    is all or nothing: a prepared transaction can still be committed within its lease
    (or is rolled back when it passes); anything not yet prepared is rolled back."""
    import json
    import signal
    import subprocess
    import sys

    from cmroot_testlib import Clock

    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir(parents=True)
    tdir, files = _table(e)
    before = snapshot(e)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, REPO,
         json.dumps({"env": e.env(), "table": str(tdir)})],
        env={**os.environ, "CMROOT_FAULTS": point}, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    txid = proc.stdout.split()[0] if proc.stdout.strip() else None
    in_parts = {k for k in files if "/p=0/" in k or "/p=1/" in k}

    # The child's clock is the real one; ours starts where the lease is still running.
    import time

    e.clock.set(time.time())
    store = e.open()
    try:
        if point == "journal.committed":
            [event] = store.events()
            assert {f["path"] for f in event.files} == in_parts
            assert os.listdir(e.staging_dir) == []
            return
        if point in ("recycle.prepared@2", "recycle.file_published@3", "recycle.flushed"):
            assert txid is not None
            res = store.commit(txid)  # the statement's commit, retried after the restart
            assert {f.path for f in res.files} == in_parts
            [event] = store.events()
            assert all(not Path(k).exists() for k in in_parts)
            assert [r.status for r in store.resolve(
                [{"path": k, "checksum": cks.of_bytes(files[k])} for k in sorted(in_parts)]
            )] == ["cmroot"] * len(in_parts)
            return
        if point == "recycle.prepared":
            # Only the first part was prepared; its statement died: the lease decides.
            e.clock.advance(601)
            assert store.expire_prepared() == 1
        _untouched(e, before, files)
        assert store.events() == []
    finally:
        store.close()


# -- a prepare of many small files is staged by several threads ----------------------------

MANY = 2 * 160  # over the part size from which a prepare stages on several threads


def _many(env: Env) -> tuple[Path, dict[str, bytes]]:
    files = make_table(env.warehouse, "db", "t", [{"p": "0"}, {"p": "1"}],
                       files_per_partition=MANY // 2, size=(10, 300))
    return table_dir(env.warehouse, "db", "t"), files


def _drop(tdir: Path) -> RecycleRequest:
    return RecycleRequest(paths=[str(tdir)], op="DROP_TABLE", db="db", table="t")


def test_a_failure_inside_a_threaded_prepare_rolls_back_every_file(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare of 320 small files (staged by several threads) fails at its 150th file
    (the disk fills): every file is back, nothing staged, published or recorded."""
    import errno
    import threading

    from cmroot import faults

    tdir, files = _many(env)
    before = snapshot(env)
    threads: set[str] = set()
    seen = {"n": 0}
    lock = threading.Lock()
    real = faults.point

    def point(name: str) -> None:
        if name == "recycle.file_staged":
            with lock:
                threads.add(threading.current_thread().name)
                seen["n"] += 1
                n = seen["n"]
            if n == 150:
                raise OSError(errno.ENOSPC, "No space left on device")
        real(name)

    monkeypatch.setattr(faults, "point", point)
    with pytest.raises(CmrootError, match="out of space"):
        store.prepare(_drop(tdir))
    monkeypatch.undo()
    assert len(threads) > 1, threads
    _untouched(env, before, files)
    assert store.events() == []


def test_a_threaded_prepare_keeps_a_hard_linked_files_bytes(env: Env, store: Store) -> None:
    """Among 320 small files staged by several threads, one has another name in another
    table. After the commit that table rewrites it through its own name: the recycled
    bytes are still served for (path, old checksum), and no object shares an inode with
    a warehouse file."""
    tdir, files = _many(env)
    linked = sorted(files)[MANY // 2]
    other = env.warehouse / "db.db" / "u" / "g"
    other.parent.mkdir(parents=True)
    os.link(linked, other)
    p = store.prepare(_drop(tdir))
    res = store.commit(p.txid)
    assert {f.path for f in res.files} == set(files)
    with open(other, "r+b") as fh:
        fh.write(b"u's own later write")
    for path, data in files.items():
        with store.open_verified(path, cks.of_bytes(data)) as v:
            assert os.pread(v.fd, len(data) + 1, 0) == data, path
    inodes = {(os.stat(p).st_dev, os.stat(p).st_ino) for p in object_files(env)}
    assert (os.stat(other).st_dev, os.stat(other).st_ino) not in inodes
    assert os.listdir(env.staging_dir) == []


CHILD_MANY = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store

store = Store.open(config.load(None, env=args["env"]))
store.prepare(RecycleRequest(paths=[args["table"]], op="DROP_TABLE", db="db", table="t"),
              lease=600)
store.close()
"""


@pytest.mark.timeout(120)
def test_sigkill_inside_a_threaded_prepare_puts_every_file_back(tmp_path: Path) -> None:
    """kill -9 while several threads stage a 320-file prepare (at its 150th file): after
    a restart every file is back, nothing staged, published or recorded."""
    import json
    import signal
    import subprocess
    import sys

    from cmroot_testlib import Clock

    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir(parents=True)
    tdir, files = _many(e)
    before = snapshot(e)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_MANY, REPO, json.dumps({"env": e.env(), "table": str(tdir)})],
        env={**os.environ, "CMROOT_FAULTS": "recycle.file_staged@150"}, capture_output=True,
        text=True, timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = e.open()
    try:
        _untouched(e, before, files)
        assert store.events() == []
    finally:
        store.close()

"""Review 37: commit f1e68f9, the take's deterministic aside name.

A take (a move onto a warehouse whose rename into the store says EXDEV: a bind mount)
copies each file into staging, journals the copy, then `LocalSession.remove_if_unchanged`
renames the source aside to `.cmroot-take-<txid>-<seq>`, checks it there (`_same_file`)
and unlinks it. After a crash in between, the rollback (`Journal._undo` ->
`LocalSession.take_back`) or a resumed take (`_settle_aside`) finds the aside by that name.

Attacked, on a real `mount --bind` warehouse (rename really gives EXDEV) with in-process
crashes (faults.Crash) and real kill -9 children:
- a writer's own file (regular file, symlink out of the root, directory, FIFO, a hard
  link of the source) at `.cmroot-take-<txid>-<seq>`: the txid of a two-phase recycle is
  the client's, and the seq of a joined part is the count of the files before it; met by
  an abort, by the recovery after a lease expiry, and by the forward path of a join;
- the partition directory moved, or swapped for a symlink out of the root, between the
  crash and the recovery;
- a source with another hard link in the warehouse;
- an INSERT_OVERWRITE writer re-creating the path while the file is aside (other bytes,
  the same bytes), before the recovery and during it (at journal.rolled_back_file);
- a partitioned table crashed at the k-th take, then a crash during the recovery, then
  recovery again (in-process and with kill -9), reopened once more (idempotent), fsck;
- a prepared (two-phase) recycle killed with a take aside, and one expired after it.

`test_break_*` are the breaks found (the comment above each says what broke, where, and
the fix): the four planted-name ones are fixed (the aside's name is now keyed, see
Journal.take_tag; the tests plant at the old guessable name and hold); so is the moved
partition directory (the aside now goes to the top of the root, which no writer can
move: LocalSession._rename_aside). The others are attacks that held."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cmroot_testlib import (
    Clock,
    Env,
    assert_retrievable,
    index_counts,
    make_table,
    on_point,
    table_dir,
)

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest, Store
from cmroot.store.layout.local import _HELD

REPO = str(Path(__file__).resolve().parents[2])


def _hidden(env: Env) -> list[str]:
    """Every name cmroot may leave in the warehouse (asides, put-back temporaries,
    conflict names), files and directories."""
    return sorted(os.path.join(d, n) for d, dirs, names in os.walk(env.warehouse)
                  for n in [*names, *dirs] if ".cmroot-" in n)


def _crash_aside(env: Env, files: dict[str, bytes], k: int = 1) -> str:
    """A DROP_TABLE of `files` killed (in-process) at the k-th take, with that take's
    source aside. Returns the aside's path."""
    store = env.open()
    store.recycler.workers = 1
    faults.arm("source.taken_aside", k, crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    store.close()
    env.close_all()
    [aside] = _hidden(env)
    return aside


def _all_back(env: Env, files: dict[str, bytes]) -> None:
    for p, data in files.items():
        assert not os.path.islink(p) and Path(p).read_bytes() == data, p
    assert _hidden(env) == []
    counts = index_counts(env)
    assert counts["events"] == counts["entries"] == counts["txs"] == counts["journal"] == 0
    assert os.listdir(env.staging_dir) == []


# -- breaks -----------------------------------------------------------------------------------

# BREAK (data loss, invariants 1 and 4). A prepared INSERT_OVERWRITE takes its files at
# prepare; its txid is the client's (Prepared.txid) and seq 0 is the first file. A writer
# creates its own file named `.cmroot-take-<txid>-0` in the partition, then the statement
# aborts. Journal._undo calls LocalSession.take_back, which finds "an aside", sees it is
# not the file copied (`not _same_file`) and, taking it for a writer's file the take had
# moved aside, renames it onto the table file's path (`_return_beside`) and returns True;
# _undo then drops the staged copy (`layout.unlink_staged`). The old bytes are gone (not
# at the path, no entry, no object) and the writer's file was moved off its name onto a
# path it never wrote. The same happens at recovery after any crash once a take finished
# (recycle.source_taken .. recycle.flushed). Fix: never trust a name alone. Journal a
# random nonce with the copy (journal.copied, the step before the rename aside) and put it
# in the tag, so no writer can name the aside; and in take_back act only on a regular file:
# one that is not the file copied is returned but take_back must then return False (the
# caller keeps its copy, put back or displaced), never True.
# Fixed: the aside's name is keyed (Journal.take_tag: an HMAC of txid and seq under a
# random key of the index), so no writer can plant a file at it; take_back returns False
# for an aside that is not the file copied, and only a resumed take looks for a leftover.
def test_break_abort_with_a_writers_file_at_the_take_name_loses_the_old_bytes(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    first = sorted(files)[0]
    store = env.open()
    p = store.prepare(RecycleRequest(paths=sorted(files), op="INSERT_OVERWRITE", db="db",
                                     table="t"), lease=600)
    assert not any(os.path.exists(f) for f in files)  # taken: a prepared delete
    mine = Path(first).with_name(f".cmroot-take-{p.txid}-0")
    mine.write_bytes(b"a writer's own file")
    store.abort(p.txid)
    assert store.events(0, 10) == []
    broken = []
    [r] = store.resolve([{"path": first, "checksum": cks.of_bytes(files[first])}])
    if r.status == "missing":
        broken.append(f"old bytes lost: at the path now {Path(first).read_bytes()!r}")
    if not mine.exists():
        broken.append("the writer's file was moved onto the table file's path")
    assert broken == []


# BREAK (data loss; invariants 1, 4, and a symlink planted at a table file's path). The
# same as above, met by the recovery at the next open: the statement's process died after
# prepare, its lease expired, and meanwhile a writer put a symlink pointing out of the root
# (or a directory) at `.cmroot-take-<txid>-0`. Journal.recover -> rollback -> _undo ->
# take_back renames that symlink (or directory) onto the table file's path and returns
# True, so the staged copy is dropped: the path is now a symlink to an outside file (or a
# directory) and the old bytes are nowhere. Nothing outside is written (rename moves the
# link itself). Where and fix: as above (cmroot/store/source/local.py take_back; journaled
# nonce in the tag; an aside that is not a regular file with the copied identity is not
# ours: leave it, return False so put_back keeps or displaces the copy).
# Fixed: the aside's name is keyed (Journal.take_tag: an HMAC of txid and seq under a
# random key of the index), so no writer can plant a file at it; take_back returns False
# for an aside that is not the file copied, and only a resumed take looks for a leftover.
@pytest.mark.parametrize("kind", ["symlink", "dir"])
def test_break_recovery_after_lease_expiry_moves_a_planted_name_onto_the_path(
    bind_mounted_warehouse: Env, kind: str,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    first = sorted(files)[0]
    secret = env.outside / "secret"
    secret.write_bytes(b"outside the warehouse")
    store = env.open()
    p = store.prepare(RecycleRequest(paths=sorted(files), op="INSERT_OVERWRITE", db="db",
                                     table="t"), lease=60)
    store.close()  # the statement's process dies; its lease runs out
    env.close_all()
    planted = Path(first).with_name(f".cmroot-take-{p.txid}-0")
    if kind == "symlink":
        os.symlink(secret, planted)
    else:
        planted.mkdir()
    env.clock.advance(3600)
    reopened = env.open()  # recovery rolls the expired prepare back
    assert secret.read_bytes() == b"outside the warehouse"  # holds: nothing outside
    assert os.listdir(env.outside) == ["secret"]
    assert reopened.events(0, 10) == []
    broken = []
    at_path = os.path.isfile(first) and not os.path.islink(first) and Path(
        first).read_bytes() == files[first]
    if not at_path and index_counts(env)["entries"] == 0:
        broken.append("old bytes lost: not at the path, no entry in the store")
    if os.path.islink(first) or os.path.isdir(first):
        broken.append(f"the table file's path is now a {kind}")
    if not os.path.lexists(planted):
        broken.append("the writer's name was moved")
    assert broken == []


# BREAK (invariant 4: a writer's file moved off its name). A statement prepares a second
# part that joins its transaction: the txid is the client's and the part's first seq is
# the number of files before it. A writer's file already named `.cmroot-take-<txid>-<seq>`
# in that partition is taken by LocalSession.remove_if_unchanged for "an earlier try that
# died with it aside" (`if _lstat(aside, pfd) is not None`), although this is the first
# try: `_settle_aside` sees another file and `_return_beside` renames the writer's file (a
# regular file or a FIFO) to `<name>.cmroot-conflict-<txid>-<seq>` (the source holds the
# name); the join then fails with Conflict and the whole statement is rolled back. Fix:
# only a resumed take (journal.finish) may look for a leftover aside; the forward path
# (Recycler._take) must not, and a name no writer can predict (a journaled nonce) keeps
# both from meeting a writer's file at all.
# Fixed: the aside's name is keyed (Journal.take_tag: an HMAC of txid and seq under a
# random key of the index), so no writer can plant a file at it; take_back returns False
# for an aside that is not the file copied, and only a resumed take looks for a leftover.
@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_break_a_joined_take_moves_a_writers_file_at_its_take_name(
    bind_mounted_warehouse: Env, kind: str,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}],
                       files_per_partition=2)
    part1 = sorted(f for f in files if "/p=1/" in f)
    part2 = sorted(f for f in files if "/p=2/" in f)
    store = env.open()
    p = store.prepare(RecycleRequest(paths=part1, op="INSERT_OVERWRITE", db="db", table="t"),
                      lease=600)
    mine = Path(part2[0]).with_name(f".cmroot-take-{p.txid}-{len(part1)}")
    if kind == "file":
        mine.write_bytes(b"a writer's own file")
    else:
        os.mkfifo(mine)
    with contextlib.suppress(CmrootError):  # (it failed with Conflict before the fix)
        store.prepare(RecycleRequest(paths=part2, op="INSERT_OVERWRITE", db="db", table="t"),
                      lease=600, txid=p.txid)
    assert os.path.lexists(mine), f"the writer's file was moved: {_hidden(env)}"
    store.abort(p.txid)
    assert {f: Path(f).read_bytes() for f in files} == files  # nothing lost
    assert os.path.lexists(mine) and store.events(0, 10) == []


# BREAK (invariant 4: a writer's name deleted; and a prepared delete that deletes
# nothing). As above, but the writer's `.cmroot-take-<txid>-<seq>` is a hard link of the
# source itself (`ln part-00000.parquet .cmroot-take-...`, a snapshot tool's link). The
# join's take finds it "aside", `_same_file` says it is the file copied (same dev, ino,
# size, mtime) and unlinks it: the take reports the source removed while the source is
# still at its path, and the writer's name is gone. Fix: as above (no leftover-aside look
# on the forward path; a journaled nonce in the name); `_settle_aside` could also insist
# that `rel` itself no longer exists before it trusts an aside.
# Fixed: the aside's name is keyed (Journal.take_tag: an HMAC of txid and seq under a
# random key of the index), so no writer can plant a file at it; take_back returns False
# for an aside that is not the file copied, and only a resumed take looks for a leftover.
def test_break_a_joined_take_with_a_hard_link_at_its_take_name(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}],
                       files_per_partition=2)
    part1 = sorted(f for f in files if "/p=1/" in f)
    part2 = sorted(f for f in files if "/p=2/" in f)
    store = env.open()
    p = store.prepare(RecycleRequest(paths=part1, op="INSERT_OVERWRITE", db="db", table="t"),
                      lease=600)
    link = Path(part2[0]).with_name(f".cmroot-take-{p.txid}-{len(part1)}")
    os.link(part2[0], link)
    store.prepare(RecycleRequest(paths=part2, op="INSERT_OVERWRITE", db="db", table="t"),
                  lease=600, txid=p.txid)
    still = [f for f in part2 if os.path.exists(f)]
    store.abort(p.txid)
    assert {f: Path(f).read_bytes() for f in files} == files  # no bytes lost: holds
    assert os.path.exists(link), "the writer's hard link was unlinked"
    assert still == [], f"a prepared delete left {still} at their paths"


# BREAK (invariant 2, low severity: a hidden duplicate of the old bytes left forever).
# Killed with a take's source aside in `p=1/`; before the restart a writer moves the
# partition directory (`mv p=1 p=1.moved`: a partition rename, a move to a trash). The
# recovery's take_back looks for the aside below `rel`'s parent only, finds nothing, and
# put_back re-creates `p=1/` from the staged copy; `p=1.moved/.cmroot-take-<txid>-<seq>`
# stays, a hidden file nothing will ever settle (fsck says clean). Where:
# LocalSession.take_back / Journal._undo. Fix: journal the parent directory's handle
# (name_to_handle_at) or (st_dev, st_ino) with the copy and, when the aside is not under
# the path's parent, reach the moved directory by open_by_handle_at (or a walk of the root
# for that inode) and settle the aside there (unlink it: the copy is put back).
# FIXED: the aside goes to the top of the root (LocalSession._rename_aside), which a
# writer cannot move; take_back looks there first and puts it back in the re-made `p=1/`.
def test_break_partition_moved_after_the_crash_keeps_the_aside_hidden(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    _crash_aside(env, files, 2)
    pdir = Path(sorted(files)[0]).parent
    moved = pdir.with_name("p=1.moved")
    os.rename(pdir, moved)
    store = env.open()
    assert store.events(0, 10) == [] and store.fsck().clean
    # no bytes lost: each file is at its path (re-created p=1/) or in the moved directory
    for f, data in files.items():
        there = Path(f) if os.path.exists(f) else moved / Path(f).name
        assert there.read_bytes() == data
    assert _hidden(env) == []


# -- attacks that held ------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "j"), [(1, 1), (5, 3), (12, 12)])
def test_crash_at_the_kth_take_then_in_recovery_then_recovery_again(
    bind_mounted_warehouse: Env, k: int, j: int,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}, {"p": "3"}],
                       files_per_partition=4)
    store = env.open()
    store.recycler.workers = 1
    faults.arm("source.taken_aside", k, crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))],
                                     op="DROP_TABLE", db="db", table="t"))
    store.close()
    env.close_all()
    assert len(_hidden(env)) == 1
    faults.arm("journal.rolled_back_file", j, crash=True)
    with pytest.raises(faults.Crash):
        Store.open(env.config(), clock=env.clock)
    for fd in _HELD.values():  # the crashed open's lock dies with its "process"
        os.close(fd)
    _HELD.clear()
    faults.disarm()
    store = env.open()
    _all_back(env, files)
    assert store.fsck().clean
    env.close_all()
    env.open()  # idempotent
    _all_back(env, files)


@pytest.mark.parametrize("same", [False, True])
def test_path_re_created_before_recovery_by_an_overwrite(
    bind_mounted_warehouse: Env, same: bool,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    _crash_aside(env, files, 2)
    victim = sorted(files)[1]  # the one aside
    new = files[victim] if same else b"INSERT OVERWRITE's new file"
    tmp = Path(victim).with_name("_tmp")
    tmp.write_bytes(new)
    os.replace(tmp, victim)
    writers = os.stat(victim).st_ino
    store = env.open()
    assert Path(victim).read_bytes() == new and os.stat(victim).st_ino == writers
    assert _hidden(env) == [] and store.events(0, 10) == []
    assert os.listdir(env.staging_dir) == []
    for f in files:
        if f != victim:
            assert Path(f).read_bytes() == files[f]
    if same:
        assert index_counts(env)["entries"] == 0
    else:
        assert [e.path for e in store.entries(limit=10)] == [victim]
        assert_retrievable(store, {victim: files[victim]}, status="cmroot")
    assert store.fsck().clean


def test_path_re_created_during_recovery(
    bind_mounted_warehouse: Env, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seq 0 was taken, seq 1 is aside: the recovery puts seq 0 back, then (at
    journal.rolled_back_file) a writer creates seq 1's path before its take_back runs."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    _crash_aside(env, files, 2)
    victim = sorted(files)[1]
    on_point(monkeypatch, "journal.rolled_back_file",
             lambda: Path(victim).write_bytes(b"written during the recovery"), 1)
    store = env.open()
    monkeypatch.undo()
    assert Path(victim).read_bytes() == b"written during the recovery"
    assert _hidden(env) == [] and store.events(0, 10) == []
    assert_retrievable(store, {victim: files[victim]}, status="cmroot")
    assert_retrievable(store, {f: d for f, d in files.items() if f != victim},
                       status="original")
    assert store.fsck().clean


def test_parent_swapped_for_a_symlink_out_before_recovery(bind_mounted_warehouse: Env) -> None:
    """Nothing outside is touched; the transaction is kept (quarantined, bytes in staging)
    while the symlink is there, and settled once the directory is back."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    _crash_aside(env, files, 2)
    pdir = Path(sorted(files)[0]).parent
    moved = pdir.with_name("p=1.moved")
    os.rename(pdir, moved)
    os.symlink(env.outside, pdir)
    store = env.open()
    assert os.listdir(env.outside) == []
    assert store.events(0, 10) == [] and index_counts(env)["txs"] == 1
    env.close_all()
    os.unlink(pdir)
    os.rename(moved, pdir)
    store = env.open()
    _all_back(env, files)
    assert store.fsck().clean


def test_parent_swapped_for_a_symlink_between_the_rename_aside_and_the_check(
    bind_mounted_warehouse: Env, monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    pdir = Path(sorted(files)[0]).parent
    moved = pdir.with_name("p=1.moved")
    decoy = env.outside / ".cmroot-take-x"
    decoy.write_bytes(b"outside")

    def swap() -> None:
        os.rename(pdir, moved)
        os.symlink(env.outside, pdir)

    on_point(monkeypatch, "source.taken_aside", swap, 1)
    store = env.open()
    store.recycle(RecycleRequest(paths=sorted(files), op="DROP_TABLE", db="db", table="t"))
    monkeypatch.undo()
    assert sorted(os.listdir(env.outside)) == [".cmroot-take-x"]
    assert decoy.read_bytes() == b"outside"
    assert [n for n in os.listdir(moved) if n.startswith(".cmroot")] == []
    assert_retrievable(store, files)


def test_a_source_with_another_hard_link_in_the_warehouse(bind_mounted_warehouse: Env) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    other = env.warehouse / "db.db" / "other"
    other.mkdir()
    for i, f in enumerate(sorted(files)):
        os.link(f, other / f"l{i}")
    _crash_aside(env, files, 2)
    store = env.open()
    _all_back(env, files)
    for i, f in enumerate(sorted(files)):
        assert (other / f"l{i}").read_bytes() == files[f]
    assert store.fsck().clean


def test_a_prepare_killed_with_a_take_aside_then_one_that_expires(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}],
                       files_per_partition=3)
    store = env.open()
    store.recycler.workers = 1
    faults.arm("source.taken_aside", 4, crash=True)
    with pytest.raises(faults.Crash):
        store.prepare(RecycleRequest(paths=sorted(files), op="INSERT_OVERWRITE", db="db",
                                     table="t"), lease=600)
    store.close()
    env.close_all()
    faults.disarm()
    assert len(_hidden(env)) == 1
    store = env.open()  # not prepared yet: rolled back, lease or not
    _all_back(env, files)
    store.prepare(RecycleRequest(paths=sorted(files), op="INSERT_OVERWRITE", db="db",
                                 table="t"), lease=60)
    env.close_all()
    env.clock.advance(3600)
    store = env.open()
    _all_back(env, files)
    assert store.fsck().clean


_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from cmroot import config
from cmroot.store import RecycleRequest, Store
store = Store.open(config.load(None, env=args["env"]))
if args["path"]:
    store.recycle(RecycleRequest(paths=[args["path"]], op="DROP_TABLE", db="db", table="t"))
store.close()
"""


def _child(e: Env, path: str | None, fault: str) -> int:
    args = {"env": e.env(), "path": path}
    return subprocess.run(
        [sys.executable, "-c", _CHILD, REPO, json.dumps(args)],
        env={**os.environ, "CMROOT_FAULTS": fault}, capture_output=True, text=True,
        timeout=120,
    ).returncode


@pytest.mark.timeout(120)
def test_kill_9_at_a_take_aside_then_kill_9_in_recovery(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root (mount --bind)")
    e = Env(base=tmp_path, warehouse=tmp_path / "wh", store_root=tmp_path / "cmroot",
            outside=tmp_path / "outside", clock=Clock())
    e.warehouse.mkdir()
    real = tmp_path / "real"
    real.mkdir()
    if subprocess.run(["mount", "--bind", str(real), str(e.warehouse)]).returncode != 0:
        pytest.skip("mount --bind refused")
    try:
        files = make_table(e.warehouse, "db", "t", [{"p": str(i)} for i in range(4)],
                           files_per_partition=10, size=(1, 512))
        path = str(table_dir(e.warehouse, "db", "t"))
        assert _child(e, path, "source.taken_aside@23") == -signal.SIGKILL
        assert len(_hidden(e)) == 1
        # the writer re-creates one file that was fully taken before the recovery
        victim = sorted(f for f in files if not os.path.exists(f))[0]
        Path(victim).write_bytes(b"new")
        assert _child(e, None, "journal.rolled_back_file@10") == -signal.SIGKILL
        assert _child(e, None, "") == 0
        store = e.open()
        try:
            assert Path(victim).read_bytes() == b"new"
            assert {f: Path(f).read_bytes() for f in files if f != victim} == {
                f: d for f, d in files.items() if f != victim}
            assert _hidden(e) == [] and store.events(0, 10) == []
            assert_retrievable(store, {victim: files[victim]}, status="cmroot")
            assert store.fsck().clean
        finally:
            e.close_all()
    finally:
        subprocess.run(["umount", "-l", str(e.warehouse)], check=False)

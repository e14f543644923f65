"""Review 43: commit 27ee429, one-level local stores (`objects/ab/<checksum>`, said by a
LAYOUT file written before `objects/` exists; a store with `objects/` and no LAYOUT stays
two-level). `shard_levels` (cmroot/store/layout/local.py) decides, once per open; every
reader, writer, sweep and fsck of that open then uses the one answer.

Attacked with real stores, the real CLI and the real daemon (server.processes = 2):

BREAKs (`test_break_*`; all six fixed, each test failing on 27ee429):
- a store written by the release before (it ignores LAYOUT: objects at ab/cd/<c>, a
  downgrade then an upgrade): resolve answers `missing`, fsck reports the valid objects
  `missing` (their directories `stray`), never `misplaced`, and `fsck --repair` FORGETS
  their rows and entries; the bytes stay orphaned under "stray" directories for good
  (`_Walk.plan`/`shard` never look below `objects/ab/` in a one-level store; `settle`);
- the same store swept past retention: the rows go, the expired bytes stay for ever;
- a one-level store whose LAYOUT is lost (a restore that skipped it, an operator's
  clean-up) is read as two-level, and `fsck --repair` forgets every recycled file
  although every object is in the store and valid (`plan` reports them `stray`);
- TOCTOU in `shard_levels`: a writer (the daemon starting) whose `open(LAYOUT)` fails
  just before another opener (`cmroot fsck`) writes LAYOUT and makes `objects/` then
  sees `objects/` and settles on TWO levels in a store whose LAYOUT says one: all it
  recycles is `missing` after its restart;
- `os.path.lexists` answers False on any error: one transient EIO on `lstat(objects)` of
  a legacy (two-level, no LAYOUT) store writes LAYOUT = one level, for ever: every
  legacy object is `missing` from then on;
- a FIFO at LAYOUT: `open(LAYOUT, "rb")` blocks for ever (a daemon, a serving process or
  the CLI hangs where a one-line error was due).

Attacks that held (normal tests): a legacy store upgraded (served, swept, fsck-clean, no
LAYOUT written); a one-level object in the wrong top shard (found misplaced, moved home);
a LAYOUT with CRLF / a symlink to /dev/zero / a directory / 1 MiB of text / a BOM;
`objects` a regular file or a dangling symlink (one-line CLI error, nothing written); the
temporary of a crashed `_write_layout` left in the root; fsck read-only beside a writer
on a one-level store; an unreadable-as-directory shard (`objects/ab` a file) keeps its
rows; the daemon with server.processes = 2 on a new store (both processes serve the
one-level objects, cached fast path included, and a serving process killed and started
again still does)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from cmroot_testlib import (
    Env,
    assert_retrievable,
    index_counts,
    make_table,
    object_file,
    object_files,
    pairs_of,
    table_dir,
)

import cmroot.store.layout.local as local
from cmroot import checksum as cks
from cmroot.exceptions import ConfigError
from cmroot.store import RecycleRequest, Store
from cmroot.store.layout.local import LAYOUT_FILE, shard_levels
from tests.server.cmroot_daemon import Daemon
from tests.server.test_processes import TWO, _recycled, children, started, wait_for
from tests.test_cli import cmroot

DAY = 24 * 3600


def drop(env: Env, store: Store, table: str, n: int = 4) -> dict[str, bytes]:
    files = make_table(env.warehouse, "db", table, [{"p": "1"}], files_per_partition=n)
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", table))],
                                 op="DROP_TABLE", db="db", table=table))
    return files


def rels(env: Env) -> list[str]:
    return [str(p.relative_to(env.objects_dir)) for p in object_files(env)]


def downgraded_drop(env: Env, table: str) -> dict[str, bytes]:
    """Recycle as the release before 27ee429 does on this store: it knows no LAYOUT file,
    so its LocalLayout puts every object at `objects/ab/cd/<checksum>` (checked by hand
    with `git archive 27ee429^ cmroot`: its `cmroot recycle` on a LAYOUT store writes
    `objects/6b/ba/6bba...`, and this fsck then reports `missing` + `stray` and forgets
    the row on --repair)."""
    old = env.open()
    old.layout.shard_levels = 2  # the parent commit's LocalLayout, exactly
    try:
        return drop(env, old, table)
    finally:
        old.close()
        env._open.remove(old)


def statuses(store: Store, files: dict[str, bytes]) -> set[str]:
    return {r.status for r in store.resolve(pairs_of(files))}


# -- BREAKs ------------------------------------------------------------------------------
# FIXED: reads, existence checks and removals look at the other layout's place too
# (Layout.object_rels, LocalLayout.find_object/unlink_object/trash_object, Reader._open_object);
# fsck walks the other layout's directories and reports their objects misplaced (moved
# to their place on --repair); `shard_levels` reads LAYOUT again once `objects/` is seen,
# tells a lost LAYOUT by the objects themselves (`_levels_held`), takes an error to look
# at `objects/` for an error (not absence), and opens LAYOUT without blocking.


def test_break_fsck_forgets_two_level_leftovers_in_a_one_level_store(env: Env) -> None:
    """Invariants 1 and 5, and fsck's own rule ("rows are forgotten only when ... no
    valid copy of it was found anywhere in the store"). `_Walk.plan` adds only the top
    `ab` directories of a one-level store; `_Walk.shard("ab")` reports `ab/cd` as a
    stray and never looks inside, so the object's row is `missing`, and `settle` on
    --repair runs `Index.forget` (entries too): the recycled file is gone from the
    catalog, its bytes orphaned under a directory fsck promises never to touch."""
    store = env.open()
    new = drop(env, store, "new")
    store.close()
    legacy = downgraded_drop(env, "old")
    assert sum(len(r.split("/")) == 3 for r in rels(env)) == len(legacy)
    store = env.open()
    report = store.fsck()
    # Valid objects in the store, in the wrong place: misplaced, never "missing".
    assert report.counts["missing"] == 0, report.to_json()
    assert {m["checksum"] for m in report.misplaced} == {cks.of_bytes(b) for b in
                                                        legacy.values()}
    repaired = store.fsck(repair=True)
    assert repaired.counts["missing"] == 0, repaired.to_json()
    assert_retrievable(store, {**new, **legacy}, status="cmroot")
    assert store.fsck().clean


def test_break_sweep_leaves_expired_two_level_leftovers_for_ever(env: Env) -> None:
    """Invariant 4 (expired objects are swept). `Objects`' expiry calls
    `LocalLayout.unlink_object(object_path(c))`, which takes FileNotFoundError for "gone
    already", then forgets the row: the object at `ab/cd/<c>` is never removed, nor ever
    found again (fsck calls its directory a stray, never touched)."""
    env.open().close()
    env._open.clear()
    downgraded_drop(env, "old")
    store = env.open()
    env.clock.advance(2 * DAY)
    report = store.gc()
    assert report.removed_objects == 4
    assert rels(env) == [], f"expired objects left on disk: {rels(env)}"


def test_break_a_lost_layout_makes_fsck_repair_forget_every_file(env: Env) -> None:
    """`shard_levels`: no LAYOUT + `objects/` = two-level, whatever `objects/` holds (one
    look at it shows files right below `objects/ab/`). `_Walk.plan` then reports every
    `objects/ab/<c>` a stray and `settle` forgets every row: the whole catalog, for a
    store whose every object is present and hashes to its name."""
    store = env.open()
    files = drop(env, store, "t", 6)
    store.close()
    (env.store_root / LAYOUT_FILE).unlink()  # a restore that skipped it; a clean-up
    before = index_counts(env)
    store = env.open()
    report = store.fsck(repair=True)
    assert index_counts(env)["entries"] == before["entries"] == len(files), report.to_json()
    assert_retrievable(store, files, status="cmroot")


def test_break_a_writer_racing_another_opener_of_a_new_store_is_two_level(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shard_levels` opens LAYOUT (absent), then asks `lexists(objects)`. Between the
    two, another process opening the same new store (here the real `cmroot fsck`, run
    the moment the daemon's open found no LAYOUT) writes LAYOUT (one level) and makes
    `objects/`: the writer sees `objects/`, takes the store for a legacy one and writes
    every object at ab/cd. Its next start reads LAYOUT: all of them `missing`
    (invariant 1), and `fsck --repair` forgets them (see the first break)."""
    real = local._read_layout
    raced: list[str] = []

    def racing_read(path: str) -> str | None:
        said = real(path)
        if said is None and not raced:
            p = cmroot("fsck", env=env.env())  # another process opens the store
            raced.append(p.stdout.decode() + p.stderr.decode())
        return said

    monkeypatch.setattr(local, "_read_layout", racing_read)
    daemon = env.open()
    monkeypatch.undo()
    assert raced and "clean" in raced[0], raced
    assert (env.store_root / LAYOUT_FILE).read_text() == "objects/ab/<checksum>\n"
    files = drop(env, daemon, "t")
    daemon.close()
    env._open.clear()
    restarted = env.open()
    assert statuses(restarted, files) == {"cmroot"}


def test_break_an_io_error_on_objects_turns_a_legacy_store_one_level(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`os.path.lexists` swallows every OSError as "absent": an EIO (or ENOMEM) on the
    lstat of `objects/` of a two-level store with no LAYOUT makes `shard_levels` write
    LAYOUT = one level, durably, after which the store IS one-level: every object at
    ab/cd is unreachable (invariant 1) and fsck --repair forgets them all. An
    irreversible marker written on an uncertain look."""
    env.store_root.mkdir()
    env.objects_dir.mkdir()  # a store made before LAYOUT files (as store_backends binds)
    store = env.open()
    files = drop(env, store, "t")
    store.close()
    env._open.clear()
    assert all(len(r.split("/")) == 3 for r in rels(env))
    real_lstat = os.lstat
    target = str(env.objects_dir)

    def flaky_lstat(p: object, *a: object, **k: object) -> os.stat_result:
        if str(p) == target:
            monkeypatch.setattr(os, "lstat", real_lstat)  # once
            raise OSError(errno.EIO, "Input/output error", str(p))
        return real_lstat(p, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", flaky_lstat)
    # Refused or opened: either is fine here; a layout changed for ever is not.
    with contextlib.suppress(Exception):
        env.open().close()
    monkeypatch.undo()
    env._open.clear()
    store = env.open()
    assert statuses(store, files) == {"cmroot"}


def test_break_a_fifo_layout_hangs_the_open(env: Env) -> None:
    """Bad input gets a clear one-line error: `open(LAYOUT, "rb")` on a FIFO waits for a
    writer that never comes (the daemon at start, a serving process at each restart
    until START_TIMEOUT kills it, `cmroot fsck`). The open is released here by opening
    the FIFO's other end, after the test has seen it hang."""
    env.store_root.mkdir()
    fifo = env.store_root / LAYOUT_FILE
    os.mkfifo(fifo)
    got: list[object] = []

    def open_it() -> None:
        try:
            got.append(shard_levels(str(env.store_root)))
        except BaseException as e:  # looked at below
            got.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(3)
    hung = t.is_alive()
    if hung:  # unblock it: a writer opens and closes the other end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
    assert not hung, "shard_levels blocked on a FIFO at LAYOUT"
    assert len(got) == 1 and isinstance(got[0], ConfigError), got


# -- attacks that held --------------------------------------------------------------------


def test_held_a_legacy_store_upgraded_is_served_swept_and_fsck_clean(env: Env) -> None:
    env.store_root.mkdir()
    env.objects_dir.mkdir()  # made before LAYOUT files
    (env.objects_dir / "00" / "11").mkdir(parents=True)  # an empty old shard
    store = env.open()
    keep = drop(env, store, "keep")
    env.clock.advance(DAY / 2)
    late = drop(env, store, "late")
    assert not (env.store_root / LAYOUT_FILE).exists()
    assert all(len(r.split("/")) == 3 for r in rels(env))
    assert_retrievable(store, {**keep, **late}, status="cmroot")
    assert store.fsck().clean
    env.clock.advance(DAY * 0.75)  # `keep` expired, `late` not
    assert store.gc().removed_objects == len(keep)
    assert sorted(p.name for p in object_files(env)) == sorted(cks.of_bytes(b) for b in
                                                               late.values())
    assert store.fsck().clean
    assert_retrievable(store, late, status="cmroot")
    assert not (env.store_root / LAYOUT_FILE).exists()


def test_held_a_one_level_object_in_the_wrong_shard_is_moved_home(env: Env) -> None:
    store = env.open()
    files = drop(env, store, "t", 6)
    c = sorted(cks.of_bytes(b) for b in files.values())[0]
    wrong = "ff" if c[:2] != "ff" else "fe"
    (env.objects_dir / wrong).mkdir(exist_ok=True)
    object_file(env.store_root, c).rename(env.objects_dir / wrong / c)
    assert statuses(store, files) == {"cmroot", "missing"}
    report = store.fsck()
    assert [m["checksum"] for m in report.misplaced] == [c] and not report.missing
    store.fsck(repair=True)
    assert store.fsck().clean
    assert object_file(env.store_root, c).exists()
    assert_retrievable(store, files, status="cmroot")


@pytest.mark.parametrize("said", [b"objects/ab/<checksum>\r\n", b"objects/ab/<checksum>"])
def test_held_layout_text_variants_are_one_level(env: Env, said: bytes) -> None:
    env.store_root.mkdir()
    (env.store_root / LAYOUT_FILE).write_bytes(said)
    store = env.open()
    files = drop(env, store, "t")
    assert all(len(r.split("/")) == 2 for r in rels(env))
    assert_retrievable(store, files, status="cmroot")


def _bom(p: Path) -> None:
    p.write_bytes(b"\xef\xbb\xbfobjects/ab/<checksum>\n")


def _zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _dir(p: Path) -> None:
    p.mkdir()


def _huge(p: Path) -> None:
    p.write_bytes(b"x" * (1 << 20))


@pytest.mark.parametrize("make", [_bom, _zero, _dir, _huge], ids=["bom", "dev-zero",
                                                                  "directory", "huge"])
def test_held_a_bad_layout_is_a_one_line_error_and_nothing_is_made(
    env: Env, make: Callable[[Path], None]
) -> None:
    env.store_root.mkdir()
    make(env.store_root / LAYOUT_FILE)
    p = cmroot("fsck", env=env.env())
    err = p.stderr.decode()
    assert p.returncode != 0 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and LAYOUT_FILE in err, err
    assert not {"objects", "staging"} & set(os.listdir(env.store_root))


@pytest.mark.parametrize("kind", ["file", "dangling-symlink"])
def test_held_objects_not_a_directory_is_a_one_line_error(env: Env, kind: str) -> None:
    env.store_root.mkdir()
    if kind == "file":
        env.objects_dir.write_bytes(b"")
    else:
        env.objects_dir.symlink_to(env.base / "nowhere")
    p = cmroot("fsck", env=env.env())
    err = p.stderr.decode()
    assert p.returncode != 0 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (env.store_root / LAYOUT_FILE).exists()


def test_held_a_crashed_layout_write_leaves_a_temporary_that_harms_nothing(env: Env) -> None:
    env.store_root.mkdir()
    (env.store_root / f"{LAYOUT_FILE}.4242.1.tmp").write_text("objects/ab/cd/<checks")
    store = env.open()
    files = drop(env, store, "t")
    assert shard_levels(str(env.store_root)) == 1
    assert all(len(r.split("/")) == 2 for r in rels(env))
    assert store.fsck().clean
    assert_retrievable(store, files, status="cmroot")


def test_held_readonly_fsck_beside_a_writer_of_a_one_level_store(env: Env) -> None:
    writer = env.open()
    files = drop(env, writer, "t", 20)
    beside = env.open(readonly=True)
    assert beside.layout.shard_levels == 1
    assert beside.fsck().clean
    assert_retrievable(beside, files, status="cmroot")


def test_held_a_shard_that_is_a_file_keeps_its_rows(env: Env) -> None:
    store = env.open()
    files = drop(env, store, "t", 6)
    c = sorted(cks.of_bytes(b) for b in files.values())[0]
    shard = env.objects_dir / c[:2]
    moved = env.base / "aside"
    shard.rename(moved)
    shard.write_bytes(b"not a directory")
    report = store.fsck(repair=True)
    assert report.counts["unreadable"] == 1 and not report.missing, report.to_json()
    shard.unlink()
    moved.rename(shard)
    assert store.fsck().clean
    assert_retrievable(store, files, status="cmroot")


def test_held_the_daemon_with_two_processes_serves_a_new_one_level_store(
    tmp_path: Path,
) -> None:
    d = Daemon(tmp_path / "d", env=TWO)
    with d.serving(check_errors=False):
        worker = started(d)
        assert (d.store / LAYOUT_FILE).read_text() == "objects/ab/<checksum>\n"
        recycled = _recycled(d, "t", {f"f{i}": os.urandom(500 + i) for i in range(8)})
        for _, c, _ in recycled:
            assert object_file(d.store, c).is_file()
            assert object_file(d.store, c).parent.parent == d.store / "objects"

        def all_served() -> None:
            for _ in range(3):
                for p, c, data in recycled:
                    r = d.request("GET", d.files_url(p, c), scope="read")
                    assert (r.status, r.headers["X-Cmroot-Status"], r.body) == (
                        200, "cmroot", data)
            body = [{"path": p, "checksum": c} for p, c, _ in recycled]
            r = d.request("POST", "/v1/resolve", {"files": body}, scope="read")
            assert {f["status"] for f in r.json()["files"]} == {"cmroot"}

        all_served()
        os.kill(worker, signal.SIGKILL)  # its successor opens the store read-only again
        wait_for(lambda: children(d.proc.pid) not in ([], [worker]))  # type: ignore[union-attr]
        all_served()
        r = d.request("POST", "/v1/fsck", {}, scope="admin")
        assert r.status == 200 and r.json()["clean"], r
        assert d.stop() == 0, d.log()

"""Review 41: commit ae3edcf, where a take's aside is placed and where it is looked for.

A take (the warehouse file cannot be renamed into the store: EXDEV, a bind mount) copies
the file into staging, journals it, then `LocalSession.remove_if_unchanged` renames the
source to `.cmroot-take-<tag>` (`_rename_aside`: since ae3edcf the top of the OUTERMOST
configured local root that holds it first, then inner roots' tops, then the file's own
directory, passing over sticky/append-only/immutable tops and moving on after
EXDEV/EACCES/EPERM/EROFS), checks it there and unlinks it. A crash may leave it; the
rollback's `take_back` finds it (`_find_aside` over `_ancestors`: every directory from the
outermost top down to the file's parent) and returns it, or settles it where it lies.

Attacked, on real `mount --bind` warehouses, tmpfs and chattr, with in-process crashes
(faults.Crash):
- the OUTER root removed from `store.warehouse_roots` during the outage while the aside
  (a writer's file, or the file copied) is at its top (BREAKs);
- a writer who can list the partition sees the aside's name and plants its own file
  of that name in a directory ABOVE it (since ae3edcf every ancestor is searched, first
  hit wins): the rollback moves the planted file onto the table path and leaves the
  table's own file hidden for good (BREAK);
- a FIFO made at the table path during the outage (the file being aside): the recovery's
  put_back blocks for ever opening it (BREAK; `_holds` is older, reached through
  take_back's re-created-path branch);
- a race on a three-level configuration (a writer of the outer root renames the middle
  root between `open_root` and `_outer_tops` in `LocalSource.session`): the inner root's
  descriptor leaks (BREAK);
- attacks that held: a nested root on a mount of its own (the aside falls back to its
  top), three levels of nested roots (crash, recovery under the same configuration and
  with the middle root removed), an outer root whose top is append-only while the inner
  is not, a tmpfs warehouse with a nested root and several staging threads sharing one
  session (crash, recovery), descriptors counted across many sessions of nested roots,
  `_ancestors` meeting a partition swapped for a symlink out of the root with a decoy of
  the aside's name outside, a middle root swapped for a symlink out of the root (the take
  fails cleanly, nothing outside touched), the aside replaced by a directory or a symlink
  out of the root before the recovery (no traceback, idempotent), a writer's
  hard link of the aside in a lower ancestor (no byte lost), a partition directory
  replaced by a regular file during the outage (the rollback waits, quarantined, and
  completes once the path is clear), a resumed take whose aside is at the outer top
  with the partition moved, resolve after a crash with asides at the outer top.

`test_break_*` fail on ae3edcf; the comment above each says what broke (invariant),
where, how severe, and a fix. All five are fixed since (FIXED above each): the aside is
at the top of the file's own root again (an outer top can leave the configuration), the
file copied is looked for in every directory that holds the path but anything else of
its name only where a take puts one, the session closes its root when an outer top
fails, and `_holds` opens with O_NONBLOCK. (Placement asserts were moved to the own
root's top.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from cmroot_testlib import (
    Env,
    assert_retrievable,
    bind_mount,
    index_counts,
    make_table,
    on_point,
    table_dir,
)

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.store.source import RootUnavailable
from cmroot.store.source.local import LocalSource, identity
from tests.adversarial.test_review37_take_aside import _all_back, _hidden
from tests.adversarial.test_review39_take_root import (
    _at_paths,
    _chattr,
    _drop,
    _quarantined,
)


def _fds() -> dict[int, str]:
    """The open descriptors, with what each names (the listing's own left out)."""
    out = {}
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
    return out


def _opened_since(before: dict[int, str]) -> dict[int, str]:
    return {fd: what for fd, what in _fds().items() if before.get(fd) != what}


def _crash_at_aside(env: Env, files: dict[str, bytes], roots: str, k: int = 1,
                    workers: int = 1) -> list[str]:
    """A DROP_TABLE of `files` under `roots`, killed (in-process) at the k-th take with its
    source aside. Returns the hidden names left."""
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    store.recycler.workers = workers
    faults.arm("source.taken_aside", k, crash=True)
    with pytest.raises(faults.Crash):
        _drop(store, files)
    store.close()
    env.close_all()
    faults.disarm()
    return _hidden(env)


def _writer_over(path: str, data: bytes) -> None:
    """A writer's new file renamed over `path` (as INSERT OVERWRITE's commit does)."""
    tmp = Path(path).with_name("_writer.tmp")
    tmp.write_bytes(data)
    os.rename(tmp, path)


def _visible(top: Path) -> dict[str, bytes]:
    """Every regular file under `top` not under a cmroot hidden name, with its bytes."""
    return {os.path.join(d, n): Path(d, n).read_bytes()
            for d, _, names in os.walk(top) for n in names
            if ".cmroot-take-" not in n and not os.path.islink(os.path.join(d, n))}


# -- breaks -----------------------------------------------------------------------------------

# BREAK (invariant 4, medium: a writer's newer file is hidden for good under a cmroot name
# and the table path gets the OLD bytes back, with no event and nothing in the log about
# that path). Nested roots `W/ext,W`: a take of a file under `W/ext` puts its aside at the
# top of `W` (new in ae3edcf). An INSERT OVERWRITE writer renames its new file over the
# path after the take's check, the take moves that (the writer's file) aside to `W/` and
# the daemon dies there. During the outage the administrator narrows the configuration to
# `W/ext` (the outer root dropped: a common clean-up). The recovery's take_back looks only
# below the roots it now knows (`_find_aside` -> `_ancestors`: `W/ext` down), finds
# nothing, returns False, and put_back links the staged copy of the OLD bytes at the path
# (free: the writer's file is aside). The writer's file stays at `W/.cmroot-take-<tag>`,
# which no later recovery looks at (the transaction is closed). Before ae3edcf the aside
# was at the top of the file's own root (`W/ext`) and was found. Where:
# LocalSession._rename_aside (places the aside outside the file's own root) together with
# LocalSession.take_back/_find_aside (finds it only under the roots of the recovery's
# configuration). Fix: journal where the aside went (the top's root path and its st_dev/
# st_ino, written with the copy before the rename) and, when that directory is no longer
# under a configured root, keep the transaction quarantined with an error that names it
# instead of putting the old bytes back; or never place the aside above the file's own
# root (and handle a moved nested root another way, e.g. by its st_ino journaled).
# FIXED: the aside goes to the top of the file's own root (LocalSession._rename_aside).
def test_break_outer_root_dropped_from_config_hides_a_writers_file(
    bind_mounted_warehouse: Env, monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=2)
    victim = sorted(files)[0]
    mine = b"the writer's INSERT OVERWRITE output, newer than the table's file"
    on_point(monkeypatch, "source.take_checked", lambda: _writer_over(victim, mine), 1)
    hidden = _crash_at_aside(env, files, f"{ext},{env.warehouse}")
    monkeypatch.undo()
    # (at the outer top on ae3edcf; at its own root's top since the fix)
    assert [os.path.dirname(h) for h in hidden] == [str(ext)]
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=str(ext))  # the outer root dropped
    assert store.events(0, 10) == []
    visible = _visible(ext)
    broken = []
    if mine not in visible.values():
        broken.append(f"the writer's file is nowhere under {ext} (at its path: "
                      f"{Path(victim).read_bytes()[:20]!r}...)")
    if left := _hidden(env):
        broken.append(f"hidden names left: {left}")
    assert broken == [], "; ".join(broken)


# BREAK (invariant 2, low: a hidden copy of a table file left for good in what was the
# warehouse, its space never freed, fsck clean). As above, without a writer: the aside is
# the file copied. The recovery under `W/ext` alone puts the staged copy back (nothing
# lost) but never sees the aside at the top of `W`. Where and fix: as above.
# FIXED: as above.
def test_break_outer_root_dropped_from_config_leaves_the_aside_hidden(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=3)
    hidden = _crash_at_aside(env, files, f"{ext},{env.warehouse}", 2)
    assert [os.path.dirname(h) for h in hidden] == [str(ext)]  # its own root's top (fix)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=str(ext))
    assert store.events(0, 10) == [] and _at_paths(files) == files  # nothing lost
    assert index_counts(env)["txs"] == 0 and store.fsck().clean
    assert _hidden(env) == [], "the take's aside is left hidden at the old outer top"


# BREAK (invariants 2 and 4, medium). Since ae3edcf `_find_aside` takes the FIRST
# directory holding the aside's name among every directory from the outermost top down
# to the file's parent. The name is secret only until the aside exists: a crash leaves it
# in a directory any reader of the partition can list. Here the warehouse root is sticky
# (1777, shared), so the aside goes beside the file; during the outage a writer who can
# write the database directory `W/db.db` (but need not be able to write the partition)
# plants its own file of that name there. The recovery finds the planted one first, takes
# it for "a writer's file the take moved aside" and moves it onto the TABLE PATH
# (`_return_aside`, as root, into a directory the writer may not write); put_back finds
# the path taken and keeps the table's bytes only as a displaced store entry; the table's
# own file (the original inode) stays hidden in the partition for good. Before ae3edcf
# only the root's top and the file's directory were searched. Where: LocalSession.
# _find_aside / take_back (first name found wins, though the name is public by then).
# Fix: journal which directory the aside went to (with the copy, before the rename) and
# look there only (the search remains for journals of earlier versions); at least, among
# several candidates prefer the one that is the file copied (`_same_file`), and return a
# non-matching file only from the directory the aside was put in.
# FIXED: only the file copied is taken from any directory holding the path; another
# file of the aside's name only from a top that holds asides or the file's own directory.
def test_break_a_planted_name_above_the_aside_is_put_on_the_table_path(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
    victim = sorted(files)[0]
    os.chmod(env.warehouse, 0o1777)
    [aside] = _crash_at_aside(env, files, str(env.warehouse))
    assert os.path.dirname(aside) == os.path.dirname(victim)  # sticky top: beside the file
    planted = env.warehouse / "db.db" / os.path.basename(aside)
    planted.write_bytes(b"a writer's planted file, named after the aside it listed")
    store = env.open()
    assert store.events(0, 10) == []
    broken = []
    if Path(victim).read_bytes() != files[victim]:
        broken.append(f"the table path holds {Path(victim).read_bytes()[:26]!r}...")
    if os.path.exists(aside):
        broken.append("the table's own file is left hidden in the partition")
    assert broken == [], "; ".join(broken)


# BREAK (resource leak, low-medium: one directory descriptor per hit, for the life of the
# daemon; a writer toggling a directory's name can keep hitting it, up to EMFILE).
# `LocalSource.session` evaluates `LocalSession(self.open_root(), self._outer_tops())`:
# when `_outer_tops` raises after `open_root` succeeded, nobody closes the root's
# descriptor. With three levels `W, W/a, W/a/b`, a writer of `W` (who may rename `W/a`, a
# directory of its root) renames `W/a` between the two calls: `open_root` of `W/a/b` has
# succeeded, `_outer_tops` fails opening `W/a` (RootUnavailable). The test makes that
# interleaving deterministic by doing the writer's rename as `_outer_tops` is entered.
# Where: LocalSource.session. Fix: open the outer tops first, or close the root's
# descriptor when `_outer_tops` raises (try/except around it).
# FIXED: LocalSource.session closes the root's descriptor when an outer top fails.
def test_break_session_leaks_the_root_descriptor_when_an_outer_top_fails(
    env: Env, monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = env.warehouse / "a"
    b = a / "b"
    b.mkdir(parents=True)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{env.warehouse},{a},{b}")
    [inner] = [r for r in store.warehouse.roots if r.url == str(b)]
    real = LocalSource._outer_tops

    def racing(self: LocalSource) -> list[tuple[int, str]]:
        os.rename(a, env.warehouse / "a.moved")  # the writer of W, just then
        return real(self)

    monkeypatch.setattr(LocalSource, "_outer_tops", racing)
    before = _fds()
    with pytest.raises(RootUnavailable), inner.source.session():
        pass
    leaked = _opened_since(before)
    for fd in leaked:
        os.close(fd)
    assert leaked == {}, f"descriptors left open: {leaked}"


# BREAK (invariant 5, high: the daemon's start never ends, so nothing is served and no
# recycle runs, until someone finds and opens the FIFO; a live rollback hangs the same
# way, holding its transaction). Killed with a take's source aside (at the outer top);
# during the outage a writer of the partition makes a FIFO at the table path, free since
# the file is aside (no secret needed). The recovery's take_back finds the aside, cannot
# rename it back over the FIFO (FileExistsError), removes it and returns False; put_back
# then links the staged copy, meets the name taken and asks `_holds` whether it already
# holds the staged bytes: `_holds` opens the name O_RDONLY without O_NONBLOCK, and an
# open of a FIFO with no writer blocks for ever. (`_holds` is older than ae3edcf; this
# change's take_back leads every take whose path was re-created to it.) Where:
# LocalSession._holds (put_back). Fix: open with O_NONBLOCK (as copy_out does) and
# refuse anything but a regular file (fstat) before reading; the displaced copy is then
# kept in the store as for any other re-created path.
# FIXED: LocalSession._holds opens with O_NONBLOCK (and fstat refuses a non-file).
def test_break_a_fifo_at_the_path_hangs_the_recovery(bind_mounted_warehouse: Env) -> None:
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=2)
    victim = sorted(files)[0]
    roots = f"{ext},{env.warehouse}"
    _crash_at_aside(env, files, roots)
    os.mkfifo(victim)
    done = threading.Event()
    failed: list[BaseException] = []

    def recover() -> None:
        try:
            env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
        except BaseException as e:
            failed.append(e)
        finally:
            done.set()

    t = threading.Thread(target=recover, daemon=True)
    t.start()
    hung = not done.wait(10)
    if hung:  # release it: a writer end opened and closed gives the reader EOF
        os.close(os.open(victim, os.O_WRONLY))
        done.wait(30)
    t.join(30)
    assert not hung, "the recovery blocked opening the FIFO at the table path"
    assert failed == []
    assert stat.S_ISFIFO(os.lstat(victim).st_mode) and _hidden(env) == []
    assert index_counts(env)["entries"] == 1  # the old bytes kept, displaced


# -- attacks that held ------------------------------------------------------------------------


def test_nested_root_on_a_mount_of_its_own_puts_the_aside_at_its_top(
    bind_mounted_warehouse: Env, tmp_path: Path,
) -> None:
    """`W/ext` is another mount: the rename to `W`'s top says EXDEV, the aside goes to
    `W/ext`'s top; the recovery finds it there; a drop then completes."""
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    with bind_mount(tmp_path / "ext-disk", ext):
        files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=3)
        roots = f"{ext},{env.warehouse}"
        hidden = _crash_at_aside(env, files, roots, 2)
        assert [os.path.dirname(h) for h in hidden] == [str(ext)]
        store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
        _all_back(env, files)
        _drop(store, files)
        assert _at_paths(files) == dict.fromkeys(files) and _hidden(env) == []
        assert_retrievable(store, files, status="cmroot")
        env.close_all()


@pytest.mark.parametrize("after", ["same", "middle removed", "outermost added"])
def test_three_levels_of_nested_roots(bind_mounted_warehouse: Env, after: str) -> None:
    env = bind_mounted_warehouse
    a = env.warehouse / "a"
    b = a / "b"
    b.mkdir(parents=True)
    files = make_table(b, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=2)
    three = f"{b},{a},{env.warehouse}"
    before = f"{b},{a}" if after == "outermost added" else three
    hidden = _crash_at_aside(env, files, before, 3)
    assert [os.path.dirname(h) for h in hidden] == [str(b)]  # its own root's top
    roots = {"same": three, "middle removed": f"{b},{env.warehouse}",
             "outermost added": three}[after]
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    _all_back(env, files)
    assert store.fsck().clean
    _drop(store, files)
    assert _at_paths(files) == dict.fromkeys(files) and _hidden(env) == []
    assert_retrievable(store, files, status="cmroot")


def test_an_append_only_outer_top_passes_the_aside_to_the_inner_top(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=3)
    roots = f"{ext},{env.warehouse}"
    with _chattr(env.warehouse, "a"):
        hidden = _crash_at_aside(env, files, roots, 2)
        assert [os.path.dirname(h) for h in hidden] == [str(ext)]
        store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
        _all_back(env, files)
        _drop(store, files)
        assert _at_paths(files) == dict.fromkeys(files) and _hidden(env) == []
        assert os.listdir(env.warehouse) == ["ext"]
        assert_retrievable(store, files, status="cmroot")
        env.close_all()


def test_tmpfs_warehouse_with_a_nested_root_and_staging_threads(env: Env) -> None:
    """A tmpfs warehouse (every file a take), `W/ext` nested, four staging threads sharing
    the sessions: crashed at the 5th aside (others in flight), recovered, dropped."""
    if os.geteuid() != 0:
        pytest.skip("mount needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(env.warehouse)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"tmpfs mount refused: {r.stderr.strip()}")
    try:
        os.chmod(env.warehouse, 0o755)  # a tmpfs top is 1777 (sticky) by default
        ext = env.warehouse / "ext"
        ext.mkdir()
        files = make_table(ext, "db", "t", [{"p": str(i)} for i in range(6)],
                           files_per_partition=5)
        roots = f"{ext},{env.warehouse}"
        hidden = _crash_at_aside(env, files, roots, 5, workers=4)
        assert hidden and {os.path.dirname(h) for h in hidden} == {str(ext)}
        store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
        _all_back(env, files)
        store.recycler.workers = 4
        before = _fds()
        _drop(store, files)
        assert _opened_since(before) == {}
        assert _at_paths(files) == dict.fromkeys(files) and _hidden(env) == []
        assert_retrievable(store, files, status="cmroot")
        env.close_all()
    finally:
        subprocess.run(["umount", "-l", str(env.warehouse)], check=False)


def test_no_descriptor_leaks_across_many_sessions_of_nested_roots(env: Env) -> None:
    a = env.warehouse / "a"
    b = a / "b"
    files = make_table(b, "db", "t", [{"p": "1"}], files_per_partition=1)
    [f] = files
    rel = str(Path(f).relative_to(b))
    ident = identity(os.stat(f))
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{b},{a},{env.warehouse}")
    [inner] = [r for r in store.warehouse.roots if r.url == str(b)]
    before = _fds()
    for i in range(300):
        with inner.source.session() as s:
            tag = f"{i:032x}"
            assert s.take_back(rel, ident, tag) is False
            assert s.take_back("db.db/gone/p=9/x", ident, tag) is False
            assert s.remove_if_unchanged("db.db/t/nope/x", ident, tag, resumed=True) is False
    assert _opened_since(before) == {}
    assert Path(f).read_bytes() == files[f]


def test_ancestors_never_walk_into_a_partition_swapped_for_a_symlink(
    bind_mounted_warehouse: Env,
) -> None:
    """Sticky top: the aside is beside the file. During the outage the partition is moved
    and replaced by a symlink to a directory outside, holding a decoy of the aside's name
    (which any lister of the partition could see). Nothing outside is read, moved or
    removed; the transaction waits; with the partition back, everything is back."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    os.chmod(env.warehouse, 0o1777)
    [aside] = _crash_at_aside(env, files, str(env.warehouse), 2)
    pdir = Path(sorted(files)[0]).parent
    assert os.path.dirname(aside) == str(pdir)
    moved = pdir.with_name("p=1.moved")
    os.rename(pdir, moved)
    decoy = env.outside / os.path.basename(aside)
    decoy.write_bytes(b"outside, never to be touched")
    for f in files:
        (env.outside / Path(f).name).write_bytes(b"outside too")
    outside = {p: (p.read_bytes(), p.stat().st_ino) for p in env.outside.iterdir()}
    os.symlink(env.outside, pdir)
    store = env.open()
    assert {p: (p.read_bytes(), p.stat().st_ino) for p in env.outside.iterdir()} == outside
    assert store.events(0, 10) == []
    env.close_all()
    os.unlink(pdir)
    os.rename(moved, pdir)
    store = env.open()
    _all_back(env, files)
    assert {p: (p.read_bytes(), p.stat().st_ino) for p in env.outside.iterdir()} == outside


def test_a_middle_root_swapped_for_a_symlink_fails_the_take_cleanly(
    bind_mounted_warehouse: Env,
) -> None:
    """`W, W/a, W/a/b`: a writer of `W` swaps `W/a` for a symlink to a copy outside. A drop
    under `W/a/b` is refused; nothing outside is touched, nothing hidden is left; with `W/a`
    back, the drop completes."""
    env = bind_mounted_warehouse
    a = env.warehouse / "a"
    b = a / "b"
    files = make_table(b, "db", "t", [{"p": "1"}], files_per_partition=2)
    roots = f"{b},{a},{env.warehouse}"
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    shutil.copytree(a, env.outside / "a")
    outside = {p: p.read_bytes() for p in env.outside.rglob("*") if p.is_file()}
    os.rename(a, env.warehouse / "a.moved")
    os.symlink(env.outside / "a", a)
    with pytest.raises(CmrootError):
        _drop(store, files)
    assert {p: p.read_bytes() for p in env.outside.rglob("*") if p.is_file()} == outside
    assert _hidden(env) == [] and store.events(0, 10) == []
    os.unlink(a)
    os.rename(env.warehouse / "a.moved", a)
    assert _at_paths(files) == files
    _drop(store, files)
    assert _at_paths(files) == dict.fromkeys(files) and _hidden(env) == []
    assert_retrievable(store, files, status="cmroot")


@pytest.mark.parametrize("odd", ["directory", "symlink out"])
def test_the_aside_replaced_by_something_odd_before_recovery(
    bind_mounted_warehouse: Env, odd: str,
) -> None:
    """Nested roots, the aside (the file copied) at the outer top; during the outage a
    writer who listed it replaces it by a directory or a symlink out of the roots. The
    recovery raises nothing, keeps the table file's bytes in the store (displaced), reads
    and moves nothing outside, and is idempotent."""
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=2)
    victim = sorted(files)[0]
    roots = f"{ext},{env.warehouse}"
    [aside] = _crash_at_aside(env, files, roots)
    os.unlink(aside)
    (env.outside / "target").write_bytes(b"outside")
    if odd == "directory":
        os.mkdir(aside)
        Path(aside, "inside").write_bytes(b"a writer's file in it")
    else:
        os.symlink(env.outside / "target", aside)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    assert store.events(0, 10) == [] and index_counts(env)["txs"] == 0
    assert (env.outside / "target").read_bytes() == b"outside"
    assert os.listdir(env.outside) == ["target"]
    others = {f: d for f, d in files.items() if f != victim}
    assert _at_paths(others) == others
    st = os.lstat(victim)  # what the writer left at the aside went back to the path
    assert (stat.S_ISDIR if odd == "directory" else stat.S_ISLNK)(st.st_mode)
    assert index_counts(env)["entries"] == 1  # the victim's bytes: kept, displaced
    assert store.fsck().clean
    env.close_all()
    snapshot = sorted(str(p) for p in env.warehouse.rglob("*"))
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    assert sorted(str(p) for p in env.warehouse.rglob("*")) == snapshot
    assert index_counts(env)["txs"] == 0 and index_counts(env)["entries"] == 1


def test_a_writers_hard_link_of_the_aside_in_a_lower_ancestor(
    bind_mounted_warehouse: Env,
) -> None:
    """The aside at the outer top; a writer hard-links it into the table directory under
    the same name. The recovery returns the one at the top (found first); every file is
    back with its bytes, the writer's link untouched."""
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=2)
    roots = f"{ext},{env.warehouse}"
    [aside] = _crash_at_aside(env, files, roots)
    link = table_dir(ext, "db", "t") / os.path.basename(aside)
    os.link(aside, link)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    assert store.events(0, 10) == [] and _at_paths(files) == files
    assert index_counts(env)["txs"] == 0 and not os.path.exists(aside)
    assert link.read_bytes() == files[sorted(files)[0]]  # the writer's, left as it is


def test_partition_replaced_by_a_file_during_the_outage(
    bind_mounted_warehouse: Env,
) -> None:
    """The aside at the top; a writer removes the partition and makes a regular file of
    that name. The rollback cannot put the file back: it waits, quarantined (the staged
    copy kept); with the path clear again it completes, every byte back."""
    env = bind_mounted_warehouse
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    assert len(_crash_at_aside(env, files, str(env.warehouse), 2)) == 1
    pdir = Path(sorted(files)[0]).parent
    keep = env.base / "kept-partition"
    shutil.copytree(pdir, keep)
    shutil.rmtree(pdir)
    pdir.write_bytes(b"a writer's file where the partition was")
    store = env.open()
    assert store.events(0, 10) == []
    assert pdir.read_bytes() == b"a writer's file where the partition was"
    env.close_all()
    pdir.unlink()
    shutil.copytree(keep, pdir)
    store = env.open()
    assert _at_paths(files) == files and store.events(0, 10) == []
    assert _hidden(env) == [] and index_counts(env)["txs"] == 0


def test_concurrent_takes_sharing_one_session_on_nested_roots(
    bind_mounted_warehouse: Env,
) -> None:
    """Eight staging threads share the sessions of `W/ext` and `W` (files in both roots):
    a drop of both completes, nothing hidden, no descriptor left."""
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    inner = make_table(ext, "db", "t", [{"p": str(i)} for i in range(8)], files_per_partition=6)
    outer = make_table(env.warehouse, "db", "u", [{"p": str(i)} for i in range(4)],
                       files_per_partition=6)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{ext},{env.warehouse}")
    store.recycler.workers = 8
    before = _fds()
    errors: list[BaseException] = []

    def run(files: dict[str, bytes], table: str) -> None:
        try:
            _drop(store, files, table)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(inner, "t")),
               threading.Thread(target=run, args=(outer, "u"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert _opened_since(before) == {}
    both = {**inner, **outer}
    assert _at_paths(both) == dict.fromkeys(both) and _hidden(env) == []
    assert_retrievable(store, both, status="cmroot")


def test_resumed_take_finds_its_aside_at_the_outer_top(bind_mounted_warehouse: Env) -> None:
    """A resumed take (Journal.finish of an old journal) of a file under `W/ext` whose
    aside is at `W`'s top, the partition moved since: the aside (the file copied) is
    removed, nothing else touched."""
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=2)
    victim = sorted(files)[0]
    rel = str(Path(victim).relative_to(ext))
    ident = identity(os.stat(victim))
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{ext},{env.warehouse}")
    [root] = [r for r in store.warehouse.roots if r.url == str(ext)]
    tag = "0123456789abcdef0123456789abcdef"
    faults.arm("source.taken_aside", 1, crash=True)
    with root.source.session() as s, pytest.raises(faults.Crash):
        s.remove_if_unchanged(rel, ident, tag)
    faults.disarm()
    assert [os.path.dirname(h) for h in _hidden(env)] == [str(ext)]  # own root's top
    pdir = Path(victim).parent
    os.rename(pdir, pdir.with_name("p=1.moved"))
    with root.source.session() as s:
        assert s.remove_if_unchanged(rel, ident, tag, resumed=True) is True
    assert _hidden(env) == []
    other = sorted(files)[1]
    assert (pdir.with_name("p=1.moved") / Path(other).name).read_bytes() == files[other]


def test_resolve_of_a_drop_crashed_with_asides_at_the_outer_top(
    bind_mounted_warehouse: Env,
) -> None:
    env = bind_mounted_warehouse
    ext = env.warehouse / "ext"
    ext.mkdir()
    files = make_table(ext, "db", "t", [{"p": "1"}], files_per_partition=3)
    roots = f"{ext},{env.warehouse}"
    _crash_at_aside(env, files, roots, 3)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=roots)
    r = store.resolve([{"path": p, "checksum": cks.of_bytes(d)} for p, d in files.items()])
    assert [x.status for x in r] == ["original"] * 3
    assert _quarantined(env) == []
    with contextlib.suppress(FileNotFoundError):
        assert os.listdir(env.staging_dir) == []

"""Hostile review of the fsspec hook (`cmroot.hooks.fsspec.CmrootFileSystem`). Every test
here is a finding: it failed on the code it was written against. Real daemon subprocess,
real files under pytest's tmp dirs; nothing outside a tmp dir is ever named.

The recurring root causes:
- the hook decides on a path *as it spells it* (`os.path.normpath`, its own
  `_strip_protocol`), while the target resolves it differently (`..` after a symlink is
  physical to the kernel, `file:`/`local:`/`~` are stripped or expanded by
  `LocalFileSystem._strip_protocol`), so the check and the action name different files;
- a symlink *file* outside the roots, or a symlinked directory whose name looks like a
  Spark/Hive staging directory, is never resolved, but writes and deletes go through it;
- calls forwarded untouched (`get_file`, `open(..., "r+b")`) write warehouse files;
- check-then-act on names (lexists, then rename; realpath, then rmtree) is raced.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import tree

from cmroot.exceptions import CmrootError
from tests.adversarial.fsspeclib import attempt, hook, lost, status, table
from tests.server.cmroot_daemon import Daemon, MakeDaemon, write_files

pytestmark = pytest.mark.timeout(600)


# -- helpers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that cannot wipe its warehouse."""
    with Daemon(tmp_path_factory.mktemp("rvfs") / "lake").serving(check_errors=False) as d:
        yield d


def events_since(d: Daemon, since: int) -> list[dict[str, Any]]:
    return d.client().events(since + 1, 1000)


# -- 1. `..` after a symlink: the hook normalises it away, the kernel does not -----------------
def test_dotdot_after_a_symlink_removes_the_root_contents_unrecycled(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """`<tmp>/x/deep -> <root>/db.db`, then `fs.rm("<tmp>/x/deep/..", recursive=True)`.
    The hook normalises the name to `<tmp>/x` (outside every root, and `realpath` is taken
    of the *normalised* name), so neither the ancestor guard nor the recycle sees the root;
    the target's rmtree resolves `deep/..` physically to the warehouse root and empties it.
    Broken: invariant 5 (a root is never removed) and invariant 1 (nothing recycled).
    Expected: Forbidden (the path is the warehouse root), nothing touched."""
    d = make_daemon("d")
    files = table(d)
    x = tmp_path / "x"
    x.mkdir()
    (x / "deep").symlink_to(d.warehouse / "db.db")
    before = tree(d.warehouse)
    err = attempt(lambda: hook(d).rm(f"{x / 'deep'}/..", recursive=True))
    assert lost(d, files) == [], f"files lost, root emptied (call raised {err!r})"
    assert tree(d.warehouse) == before


def test_dotdot_after_a_symlink_moves_the_root_contents_out(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """`fs.mv("<tmp>/x/deep/..", "<tmp>/elsewhere", recursive=True)` with
    `deep -> <root>/db.db`: the directory fast path's guard sees `<tmp>/x`; shutil.move
    cannot rename `..`, so it copies the warehouse root to `elsewhere` and rmtree's it.
    Broken: invariant 5 (a root is never moved) and invariant 1 (no recycle, no event:
    every table's files left the warehouse). Expected: Forbidden, warehouse unchanged."""
    d = make_daemon("d")
    files = table(d)
    x = tmp_path / "x"
    x.mkdir()
    (x / "deep").symlink_to(d.warehouse / "db.db")
    before = tree(d.warehouse)
    err = attempt(
        lambda: hook(d).mv(f"{x / 'deep'}/..", str(tmp_path / "elsewhere"), recursive=True)
    )
    assert tree(d.warehouse) == before, f"warehouse contents moved out (call raised {err!r})"
    assert lost(d, files) == []


@pytest.mark.parametrize(
    "verb", ["rm_file", "rm", "pipe_file", "open-wb", "rm-table-dot", "rm-table-dotdot"]
)
def test_dotdot_or_dot_after_a_symlink_loses_warehouse_files(
    wh: Daemon, tmp_path: Path, verb: str
) -> None:
    """A path outside the roots that the kernel resolves into one: `<tmp>/x/deep/../<rel>`
    with `deep -> <root>/db.db` (normalised by the hook to `<tmp>/x/<rel>`, whose parent
    does not exist, so `_key` finds no root), or `<tmp>/x/tbl/.` / `tbl/p=0/..` with
    `tbl -> <root>/db.db/t` (normalised to the symlink's own name, which `_key`
    deliberately does not follow). The file is deleted or overwritten, or the table's
    directory rmtree'd, with nothing recycled. Broken: invariant 1 (no loss) and 5
    (confinement by real path). Expected: recycled (by its real path) or refused."""
    files = table(wh)
    first = sorted(files)[0]
    tdir = Path(first).parent.parent
    x = tmp_path / "x"
    x.mkdir()
    (x / "deep").symlink_to(wh.warehouse / "db.db")
    (x / "tbl").symlink_to(tdir)
    via = f"{x / 'deep'}/../db.db/{Path(first).relative_to(wh.warehouse / 'db.db')}"
    fs = hook(wh)

    def write() -> None:
        with fs.open(via, "wb") as f:
            f.write(b"new bytes")

    calls: dict[str, Callable[[], Any]] = {
        "rm_file": lambda: fs.rm_file(via),
        "rm": lambda: fs.rm(via),
        "pipe_file": lambda: fs.pipe_file(via, b"new bytes"),
        "open-wb": write,
        "rm-table-dot": lambda: fs.rm(f"{x / 'tbl'}/.", recursive=True),
        "rm-table-dotdot": lambda: fs.rm(f"{x / 'tbl'}/p=0/..", recursive=True),
    }
    err = attempt(calls[verb])
    assert lost(wh, files) == [], f"{verb}: lost, not recycled (call raised {err!r})"


# -- 2. spellings the target strips and the hook does not ---------------------------------------
PREFIXES = ["file:", "local://", "local:", "~/"]
VERBS = ["rm_file", "open-wb", "pipe_file", "touch", "cp_file", "mv"]


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_protocol_spellings_the_target_strips_bypass_the_hook(
    wh: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: str, verb: str
) -> None:
    """`fs.rm_file("file:/<root>/db.db/t/p=0/part-0.parquet")` (also `local://`, `local:`,
    and `~/...` with $HOME above the root): `CmrootFileSystem._strip_protocol` removes only
    `file://`, so `_norm` makes the name `<cwd>/file:/<root>/...` (outside every root) and
    the file is not recycled; `LocalFileSystem._strip_protocol` removes `file:`/`local:`
    (and `make_path_posix` expands `~`), so the real warehouse file is deleted or
    overwritten. Broken: invariant 1. Expected: the same as for the plain path (recycled)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(wh.base))
    files = table(wh, 1)
    [path] = files
    spelled = "~/" + str(Path(path).relative_to(wh.base)) if prefix == "~/" else prefix + path
    src = tmp_path / "src.bin"
    src.write_bytes(b"src bytes")
    fs = hook(wh)

    def write() -> None:
        with fs.open(spelled, "wb") as f:
            f.write(b"new bytes")

    calls: dict[str, Callable[[], Any]] = {
        "rm_file": lambda: fs.rm_file(spelled),
        "open-wb": write,
        "pipe_file": lambda: fs.pipe_file(spelled, b"new bytes"),
        "touch": lambda: fs.touch(spelled),
        "cp_file": lambda: fs.cp_file(str(src), spelled),
        "mv": lambda: fs.mv(str(src), spelled),
    }
    err = attempt(calls[verb])
    assert lost(wh, files) == [], f"{prefix}{verb}: old bytes gone unrecycled ({err!r})"


def test_rmdir_of_an_empty_root_spelled_file_colon_removes_it(wh: Daemon) -> None:
    """`fs.rmdir("file:" + empty_root)`: the ancestor guard compares `<cwd>/file:/...`
    with the root and lets it through; the target strips `file:` and removes the root.
    Broken: invariant 5 (a warehouse root is never removed; `rmdir` of an empty root is
    refused when spelled plainly). Expected: Forbidden, the root still there."""
    empty = wh.base.parent / f"empty-root-{os.urandom(3).hex()}"
    empty.mkdir()
    fs = hook(wh, [str(wh.warehouse), str(empty)])
    err = attempt(lambda: fs.rmdir(f"file:{empty}"))
    assert empty.is_dir(), f"the empty warehouse root was removed (call raised {err!r})"


# -- 3. symlinks the hook does not resolve, that writes and deletes go through -----------------
WRITES = ["open-wb", "open-ab", "pipe_file", "put_file", "cp_file", "touch"]


@pytest.mark.parametrize("how", WRITES)
def test_a_write_through_a_symlink_outside_the_roots_overwrites_unrecycled(
    wh: Daemon, tmp_path: Path, how: str
) -> None:
    """`<tmp>/link -> <root>/db.db/t/p=0/part-0.parquet`, then `fs.pipe_file(link, b"new")`
    (or open wb/ab, put_file, cp_file, touch). `_key` resolves only the parent's real path
    ("the file itself, if a symlink, is the daemon's to refuse"), so the link is not under a
    root and the write goes straight to the target, which opens (or truncates) through the
    link: the warehouse file is rewritten in place, its old bytes recycled nowhere.
    Broken: invariant 1. Expected: the old bytes recycled (or the write refused)."""
    files = table(wh, 1)
    [path] = files
    link = tmp_path / "link"
    link.symlink_to(path)
    src = tmp_path / "src.bin"
    src.write_bytes(b"src bytes")
    fs = hook(wh)

    def open_(mode: str) -> Callable[[], None]:
        def go() -> None:
            with fs.open(str(link), mode) as f:
                f.write(b"new bytes")

        return go

    calls: dict[str, Callable[[], Any]] = {
        "open-wb": open_("wb"),
        "open-ab": open_("ab"),
        "pipe_file": lambda: fs.pipe_file(str(link), b"new bytes"),
        "put_file": lambda: fs.put_file(str(src), str(link)),
        "cp_file": lambda: fs.cp_file(str(src), str(link)),
        "touch": lambda: fs.touch(str(link)),
    }
    err = attempt(calls[how])
    assert lost(wh, files) == [], f"{how} through a symlink: old bytes lost ({err!r})"


@pytest.mark.parametrize("staging", ["_temporary", ".hive-staging_hive_1", ".spark-staging-1"])
@pytest.mark.parametrize("verb", ["rm_file", "rm", "pipe_file"])
def test_a_staging_named_symlink_into_a_table_is_not_recycled(
    wh: Daemon, tmp_path: Path, staging: str, verb: str
) -> None:
    """`<tmp>/job/_temporary -> <root>/db.db/t/p=0` (a name Spark's committer uses), then
    `fs.rm_file("<tmp>/job/_temporary/part-0.parquet")`: `_key` returns None as soon as a
    segment of the *spelled* name looks like a staging directory, before it resolves the
    parent's real path, so the real table file is deleted (or overwritten) unrecycled.
    Broken: invariant 1. Expected: the exemption applies to the real path (which is an
    ordinary partition): the file is recycled."""
    files = table(wh, 1)
    [path] = files
    job = tmp_path / "job"
    job.mkdir()
    (job / staging).symlink_to(Path(path).parent)
    via = str(job / staging / Path(path).name)
    fs = hook(wh)
    calls: dict[str, Callable[[], Any]] = {
        "rm_file": lambda: fs.rm_file(via),
        "rm": lambda: fs.rm(via),
        "pipe_file": lambda: fs.pipe_file(via, b"new bytes"),
    }
    err = attempt(calls[verb])
    assert lost(wh, files) == [], f"{verb} via {staging}: lost ({err!r})"


# -- 4. calls forwarded untouched that write warehouse files -------------------------------------
@pytest.mark.parametrize("mode", ["r+b", "rb+"])
def test_open_read_plus_writes_a_warehouse_file_in_place(wh: Daemon, mode: str) -> None:
    """`fs.open(part, "r+b").write(b"XX")`: `_open` forwards every mode containing "r" to
    the target unchanged, and `LocalFileOpener` opens "r+b" writable: the warehouse file
    is modified in place, its old bytes recycled nowhere. Broken: invariant 1.
    Expected: the old bytes recycled first (or "+" modes refused under a root)."""
    files = table(wh, 1)
    [path] = files
    fs = hook(wh)

    def go() -> None:
        with fs.open(path, mode) as f:
            f.write(b"XX")

    err = attempt(go)
    assert lost(wh, files) == [], f"{mode}: modified in place unrecycled ({err!r})"


@pytest.mark.parametrize("verb", ["get_file", "get", "download"])
def test_get_onto_a_warehouse_file_overwrites_unrecycled(
    wh: Daemon, tmp_path: Path, verb: str
) -> None:
    """`fs.get_file(src, <root>/db.db/t/p=0/part-0.parquet)`: with the local target the
    "local" destination is as much a warehouse file as any; `get_file` is forwarded
    straight to the target's `cp_file`, which overwrites it. Broken: invariant 1.
    Expected: recycled like `put_file`/`cp_file` onto the same path."""
    files = table(wh, 1)
    [path] = files
    src = tmp_path / "src.bin"
    src.write_bytes(b"src bytes")
    fs = hook(wh)
    err = attempt(lambda: getattr(fs, verb)(str(src), path))
    assert lost(wh, files) == [], f"{verb}: overwritten unrecycled ({err!r})"


# -- 5. wrappers that close (or not) the hook's replacing file ---------------------------------
def test_a_compressed_overwrite_is_silently_dropped(wh: Daemon) -> None:
    """`with fs.open(part, "wb", compression="gzip") as f: f.write(data)` returns without
    error, but GzipFile does not close the file object it wraps, so `_ReplacingFile.close`
    (the swap-in) never runs: the old file stays, the new bytes sit in a hidden
    `.part.cmroot-*.tmp` beside it. The plain target writes the file.
    Broken: right bytes (the new bytes are missing after a call that reported success).
    Expected: the file decompresses to the new bytes, old bytes recycled, no temporary."""
    files = table(wh, 1)
    [path] = files
    with hook(wh).open(path, "wb", compression="gzip") as f:
        f.write(b"new bytes")
    data = Path(path).read_bytes()
    assert data.startswith(b"\x1f\x8b") and gzip.decompress(data) == b"new bytes", data
    assert [n for n in os.listdir(Path(path).parent) if n.startswith(".")] == []


def test_a_failed_text_mode_write_publishes_partial_bytes_and_an_event(wh: Daemon) -> None:
    """`with fs.open(part, "w") as f: f.write("partial"); raise ...`: fsspec wraps the
    hook's file in a TextIOWrapper, whose __exit__ calls close() (never discard()) whatever
    the outcome, so the half-written file is swapped in and committed as an overwrite.
    Broken: invariant 2 (a destructive operation that fails leaves the data as it was and
    no event) and the hook's own "a failed write leaves the old file untouched".
    Expected: the old file in place, no event."""
    files = table(wh, 1)
    [path] = files
    since = wh.client().current_event()
    with pytest.raises(RuntimeError, match="writer failed"), hook(wh).open(path, "w") as f:
        f.write("partial")
        raise RuntimeError("writer failed")
    assert Path(path).read_bytes() == files[path]
    assert events_since(wh, since) == []


@pytest.mark.parametrize("outcome", ["block-raises", "clean"])
def test_an_fsspec_transaction_is_not_one_unit(wh: Daemon, outcome: str) -> None:
    """`with fs.transaction: open(a, "wb")...; open(b, "wb")...; raise`: fsspec defers
    every write of a transaction to its end and discards them on error (the local target
    does), but the hook ignores `autocommit` and swaps each file in, with its own event, on
    close. A raising block leaves both files replaced and two events; a clean one raises
    `RuntimeError: Can only commit if not already set to autocommit` (a non-CmrootError)
    after both changes were committed. Broken: invariant 2 / issue 11 item 3 (one unit per
    call; all or nothing). Expected: raising -> both old files, no event; clean -> no error,
    both new files."""
    files = table(wh, 2)
    a, b = sorted(files)
    fs = hook(wh)
    since = wh.client().current_event()

    def run() -> None:
        with fs.transaction:
            for p in (a, b):
                with fs.open(p, "wb") as f:
                    f.write(b"new " + p.encode())
            if outcome == "block-raises":
                raise RuntimeError("job failed")

    err = attempt(run)
    if outcome == "block-raises":
        assert isinstance(err, RuntimeError) and "job failed" in str(err), err
        assert {p: Path(p).read_bytes() for p in files} == files, "half of a failed transaction"
        assert events_since(wh, since) == []
    else:
        assert err is None, f"a clean transaction raised {err!r} after committing"
        assert Path(a).read_bytes() == b"new " + a.encode()


# -- 6. phantom events -----------------------------------------------------------------------
def test_a_lost_one_phase_answer_says_nothing_was_deleted_but_it_was(
    make_daemon: MakeDaemon,
) -> None:
    """`fs.rm(part)` of warehouse files only uses the one-phase `POST /v1/recycle`; the
    daemon commits, then dies before answering (`CMROOT_FAULTS=journal.committed`). The
    hook raises "cmroot could not recycle 1 path(s) ...; nothing was deleted", yet after
    the restart the file is gone and its DELETE event is in `GET /v1/events`. Broken:
    invariant 2 / issue 11 item 3 (a timeout or lost answer must abort or be found
    committed: the two-phase `_commit` looks the entry up, this path does not).
    Expected: either the call succeeds (the commit found) or the file is back, no event."""
    d = make_daemon("d", start=False)
    d.start(env={"CMROOT_FAULTS": "journal.committed"})
    files = table(d, 1)
    [path] = files
    err = attempt(lambda: hook(d).rm(path))
    assert d.proc is not None
    d.proc.wait(30)
    d.start()
    events = events_since(d, 0)
    if err is not None:
        assert "nothing was deleted" not in str(err) or (Path(path).exists() and events == []), (
            f"told 'nothing was deleted'; file present={Path(path).exists()}, events={events}"
        )
    else:
        assert not Path(path).exists() and len(events) == 1


def test_writing_one_new_path_twice_records_an_overwrite_of_the_calls_own_output(
    wh: Daemon, tmp_path: Path
) -> None:
    """`fs.put([n1, n2], [p, p])` where p does not exist: the first write creates p, the
    second sees a file there and swaps it, so one prepare/commit recycles the call's *own*
    first output, and the event says an existing file p (checksum of n1) was overwritten.
    Nothing existed at p before the call: a replica replays a recycle of a file it never
    had. Broken: invariant 2 (no phantom) / issue 11 item 1 (never recycle the call's own
    output). Expected: p holds n2 and no event (a create)."""
    local = write_files(tmp_path, {"n1": b"new one", "n2": b"new two"})
    p = str(wh.warehouse / "db.db" / f"t{os.urandom(4).hex()}" / "part-0.parquet")
    os.makedirs(os.path.dirname(p))
    since = wh.client().current_event()
    hook(wh).put(sorted(local), [p, p])
    assert Path(p).read_bytes() == b"new two"
    assert events_since(wh, since) == [], "an event recycling the call's own output"


@pytest.mark.parametrize("how", ["cp_file-onto-itself", "cp_file-of-a-directory"])
def test_a_call_the_target_refuses_becomes_a_recorded_overwrite(
    wh: Daemon, tmp_path: Path, how: str
) -> None:
    """`fs.cp_file(part, part)`: the target raises SameFileError; the hook copies beside
    it, recycles the file and commits a DELETE event while the very same bytes are back in
    place (a recycle event for a change that did not happen). `fs.cp_file(<dir>, part)`:
    the target raises FileExistsError; the hook recycles the file and puts an empty
    directory where it was. Broken: invariant 2 (no phantom; a failing operation leaves no
    event). Expected: the target's error, the file untouched, no event."""
    files = table(wh, 1)
    [path] = files
    srcdir = tmp_path / "srcdir"
    srcdir.mkdir()
    since = wh.client().current_event()
    if how == "cp_file-onto-itself":
        err = attempt(lambda: hook(wh).cp_file(path, path))
    else:
        err = attempt(lambda: hook(wh).cp_file(str(srcdir), path))
    assert Path(path).is_file() and Path(path).read_bytes() == files[path], (
        f"{how}: the file was replaced (call raised {err!r})"
    )
    assert events_since(wh, since) == [], f"{how}: event recorded (call raised {err!r})"


# -- 7. half applied --------------------------------------------------------------------------
def test_an_rm_failing_midway_deletes_some_named_paths(wh: Daemon, tmp_path: Path) -> None:
    """`fs.rm([part, <tmp>/s/a, <tmp>/s/dir])` (no recursive): the warehouse file is
    prepared, the target deletes `a`, then refuses `dir` ("Cannot delete directory"), the
    hook aborts: the warehouse file comes back but `a` is gone and the call raised.
    Broken: "a multi-file ... operation is all or nothing" (the hook promises the call is
    one step). Expected: the directory is found before anything is deleted (it is known
    from the listing the hook already made) and nothing is removed."""
    files = table(wh, 1)
    scratch = write_files(tmp_path / "s", {"a": b"scratch"})
    (tmp_path / "s" / "dir").mkdir()
    err = attempt(lambda: hook(wh).rm([*files, *scratch, str(tmp_path / "s" / "dir")]))
    assert isinstance(err, ValueError), err
    assert lost(wh, files) == []
    assert all(Path(p).exists() for p in scratch), "half applied: a named path deleted"


# -- 8. races: check on a name, act on a name -----------------------------------------------------
RACER = r"""
import os, sys, random, time
path, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for r in range(rounds):
    while not os.path.exists(f"{out}.go{r}"):
        time.sleep(0.0005)
    result = "none"
    deadline = time.monotonic() + 5
    while os.path.lexists(path):          # the old file leaves for the daemon's staging
        if time.monotonic() > deadline:
            break
    else:
        for _ in range(random.randint(0, 100000)):  # land anywhere in the next few ms
            pass
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            result = "late"
        else:
            os.write(fd, f"racer {r}".encode())
            os.close(fd)
            result = "created"
    with open(f"{out}.r{r}", "w") as f:
        f.write(result)
    if os.path.exists(f"{out}.stop"):
        break
"""


def test_move_in_race_clobbers_a_racing_writers_file(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Overwrite a warehouse file with `pipe_file` in a loop while another process, once
    the old file has left for staging, creates the path exclusively (O_CREAT|O_EXCL) a
    random moment later. `_move_in` checks `lexists(path)` and then renames the new file
    over the name (shutil.move -> os.rename, which replaces): when the writer lands in
    between, its file is silently replaced, its bytes recycled nowhere, and the overwrite
    is committed. Broken: invariant 1 and the hook's promise "never over anything that
    appeared there meanwhile (a racing writer's file stays, and this call fails)".
    Expected: every file the racer created is still there or retrievable (rename with
    RENAME_NOREPLACE, or link+unlink)."""
    d = make_daemon("d")
    path = d.warehouse / "db.db" / "t" / "part-0.parquet"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"old 0")
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    out = str(tmp_path / "racer")
    rounds = 800
    proc = subprocess.Popen([sys.executable, str(script), str(path), out, str(rounds)])
    fs = hook(d)
    clobbered: list[str] = []
    try:
        for r in range(rounds):
            Path(f"{out}.go{r}").touch()
            time.sleep(0.002)  # let the racer start watching (not a timing assertion)
            new = f"new {r}".encode()
            attempt(partial(fs.pipe_file, str(path), new))
            while not os.path.exists(f"{out}.r{r}"):
                assert proc.poll() is None, "racer died"
                time.sleep(0.0005)
            racer = f"racer {r}".encode()
            if Path(f"{out}.r{r}").read_text() == "created":
                here = path.is_file() and path.read_bytes() == racer
                if not here and status(d, str(path), racer) != "cmroot":
                    clobbered.append(f"round {r}: path holds {path.read_bytes()!r}")
                    break
            if path.is_dir():
                path.rmdir()
            path.write_bytes(f"old {r + 1}".encode())
    finally:
        Path(f"{out}.stop").touch()
        for r in range(rounds):
            Path(f"{out}.go{r}").touch()
            if proc.poll() is not None:
                break
        proc.wait(60)
    assert clobbered == [], f"a racing writer's file was replaced unrecycled: {clobbered}"


@pytest.mark.parametrize("what", ["root", "file"])
def test_swapping_a_parent_for_a_symlink_races_past_the_checks(
    make_daemon: MakeDaemon, what: str
) -> None:
    """`<base>/alias` flips (atomic rename of a fresh symlink) between `<base>/decoy` and
    the lake (`<base>/lake`, holding the root `warehouse`) while the hook, in a loop,
    removes `alias/warehouse` recursively (`root`) or `alias/warehouse/db.db/t/part-0`
    (`file`). The guard and `_key` resolve the path when alias -> decoy (a scratch copy,
    not a root); the target's rmtree / os.remove then resolves it through alias -> lake.
    `root`: the warehouse root and everything in it is deleted; `file`: a warehouse file
    is deleted unrecycled. Broken: invariant 5 (`root`) and 1 (`file`). Expected: the
    action is bound to what was checked (operate via dir fds / O_NOFOLLOW at each step,
    or re-verify after opening): no root removed, nothing lost."""
    d = make_daemon("d")
    base = d.base.parent
    decoy = base / "decoy"
    alias = base / "alias"
    rel = Path("warehouse/db.db/t/part-0.parquet")
    alias.symlink_to(decoy)
    fs = hook(d)
    stop = threading.Event()

    def flip() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            tmp = base / f".alias.{n}"
            os.symlink(d.base if n % 2 else decoy, tmp)
            os.replace(tmp, alias)

    losses: list[str] = []
    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        for i in range(3000):
            real = d.warehouse / rel.relative_to("warehouse")
            if what == "file" and not real.exists():
                real.parent.mkdir(parents=True, exist_ok=True)
                real.write_bytes(f"precious {i}".encode())
            data = real.read_bytes() if real.exists() else b""
            (decoy / rel).parent.mkdir(parents=True, exist_ok=True)
            (decoy / rel).write_bytes(b"decoy")
            if what == "root":
                attempt(lambda: fs.rm(str(alias / "warehouse"), recursive=True))
                if not d.warehouse.is_dir():
                    losses.append(f"iteration {i}: the warehouse root was deleted")
                    break
            else:
                attempt(lambda: fs.rm_file(str(alias / rel)))
                if data and not real.exists() and status(d, str(real), data) != "cmroot":
                    losses.append(f"iteration {i}: {real} deleted unrecycled")
                    break
    finally:
        stop.set()
        flipper.join()
    assert not losses, losses[0]


# -- 9. input the target accepts, or plain bad input --------------------------------------------
@pytest.mark.parametrize("verb", ["rm_file", "rm", "open-wb", "pipe_file"])
def test_pathlike_paths_raise_attribute_error(wh: Daemon, verb: str) -> None:
    """`fs.rm_file(Path(part))`: fsspec and the local target take os.PathLike paths
    (`stringify_path`); the hook's `_strip_protocol` calls `.startswith` on it and raises
    `AttributeError: 'PosixPath' object has no attribute 'startswith'`. Broken: a
    traceback-y non-CmrootError. Expected: treated as the string path (recycled)."""
    files = table(wh, 1)
    [path] = files
    fs = hook(wh)
    pathlike: Any = Path(path)  # typed str by the hook; fsspec takes os.PathLike
    calls: dict[str, Callable[[], Any]] = {
        "rm_file": lambda: fs.rm_file(pathlike),
        "rm": lambda: fs.rm(pathlike),
        "open-wb": lambda: fs.open(pathlike, "wb").close(),
        "pipe_file": lambda: fs.pipe_file(pathlike, b"new bytes"),
    }
    err = attempt(calls[verb])
    assert err is None, f"{verb}(Path): {err!r}"
    assert status(wh, path, files[path]) == "cmroot"


@pytest.mark.parametrize("bad", [None, 42, b"/x"], ids=["None", "int", "bytes"])
def test_bad_path_types_raise_a_traceback_not_a_cmroot_error(wh: Daemon, bad: Any) -> None:
    """`fs.rm(None)` / `fs.rm(42)` / `fs.rm(b"/x")` raise AttributeError/TypeError from
    inside `_strip_protocol` (`'NoneType' object has no attribute 'startswith'`).
    Broken: bad input gives a traceback-y non-CmrootError. Expected: a CmrootError naming
    the bad path."""
    err = attempt(lambda: hook(wh).rm(bad))
    assert isinstance(err, CmrootError), repr(err)


def test_mv_of_a_glob_onto_a_list_uses_the_lists_repr_as_a_path(
    wh: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fs.mv("<tmp>/src/*", [<root>/x1, <root>/x2])` (fsspec's copy/mv pair a glob's
    matches with a list of destinations): `_pairs` does `str(path2)` and moves to
    `<cwd>/['<root>/x1', '<root>/x2']/n1`, failing with a FileNotFoundError on that
    invented path. Broken: wrong destination / a traceback-y non-CmrootError.
    Expected: the files land at x1 and x2 (as fsspec's generic mv does), or a CmrootError."""
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path / "src", {"n1": b"one", "n2": b"two"})
    t = wh.warehouse / "db.db" / f"t{os.urandom(4).hex()}"
    t.mkdir(parents=True)
    dests = [str(t / "x1"), str(t / "x2")]
    err = attempt(lambda: hook(wh).mv(f"{tmp_path / 'src'}/*", dests))
    assert err is None or isinstance(err, CmrootError), repr(err)
    if err is None:
        assert sorted(Path(p).read_bytes() for p in dests) == [b"one", b"two"]

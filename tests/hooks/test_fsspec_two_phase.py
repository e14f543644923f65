"""The fsspec hook makes each call one transaction (DESIGN invariant 2): an overwrite is
prepare (old file into staging) -> move the new file in -> commit, so a move-in that
fails leaves the old file in place and no event; a call that recycles several paths
commits them together or not at all; a daemon that dies between prepare and commit never
loses the old bytes. Real daemon, real files; failures are real ones, placed between the
steps with the hook's fault points (`fsspec.prepared`, `fsspec.moved_in`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import on_point, tree

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("two-phase")).serving() as d:
        yield d


@pytest.fixture
def lease2(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of its own, whose prepared transactions have a 2 s lease (killed and
    restarted by the test)."""
    d = Daemon(tmp_path / "d", env={"CMROOT_STORE_PREPARE_LEASE": "2s"})
    try:
        yield d.start()
    finally:
        d.close()


def hook(d: Daemon, **kw: Any) -> CmrootFileSystem:
    return CmrootFileSystem(
        target_protocol="file",
        url=d.url,
        token=d.tokens["write"],
        warehouse_roots=[str(d.warehouse)],
        **kw,
    )


def table(d: Daemon, n: int = 2) -> dict[str, bytes]:
    name = os.urandom(4).hex()
    return write_files(
        d.warehouse,
        {f"db.db/t{name}/p={i}/part-0.parquet": f"old {i} {name}".encode() for i in range(n)},
    )


def events_after(d: Daemon, since: int) -> list[dict[str, Any]]:
    return d.client().events(since + 1, 1000)


def status(d: Daemon, path: str, data: bytes) -> str:
    [r] = d.client("read").resolve([{"path": path, "checksum": cks.of_bytes(data)}]).files
    return r.status


def unchanged(files: dict[str, bytes]) -> bool:
    """Every file holds its bytes, and no temporary file is left beside any."""
    return all(Path(p).read_bytes() == b for p, b in files.items()) and all(
        not n.startswith(".") for p in files for n in os.listdir(Path(p).parent)
    )


def drop_temporaries(path: str) -> Callable[[], None]:
    """A fault: the new bytes written beside `path` vanish (a cleaner swept them)."""
    parent, name = os.path.split(path)

    def sweep() -> None:
        for n in os.listdir(parent):
            if n.startswith(f".{name}.cmroot-"):
                os.unlink(os.path.join(parent, n))

    return sweep


def overwrite(fs: CmrootFileSystem, path: str, tmp: Path, how: str) -> None:
    src = tmp / f"src-{os.urandom(4).hex()}"
    src.write_bytes(b"new bytes")
    if how == "open-wb":
        with fs.open(path, "wb") as f:
            f.write(b"new bytes")
    elif how == "open-ab":
        with fs.open(path, "ab") as f:
            f.write(b" appended")
    elif how == "pipe_file":
        fs.pipe_file(path, b"new bytes")
    elif how == "put_file":
        fs.put_file(str(src), path)
    elif how == "put":
        fs.put(str(src), path)
    elif how == "cp_file":
        fs.cp_file(str(src), path)
    elif how == "touch":
        fs.touch(path)
    else:
        raise AssertionError(how)


WRITES = ["open-wb", "open-ab", "pipe_file", "put_file", "put", "cp_file", "touch"]


@pytest.mark.parametrize("how", WRITES)
def test_a_failed_move_in_leaves_the_old_file_and_no_event(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    files = table(daemon, 1)
    [path] = files
    since = daemon.client().current_event()
    on_point(monkeypatch, "fsspec.prepared", drop_temporaries(path))
    with pytest.raises(FileNotFoundError):
        overwrite(hook(daemon), path, tmp_path, how)
    assert unchanged(files)
    assert events_after(daemon, since) == []
    assert status(daemon, path, files[path]) == "original"
    assert tree(daemon.store / "staging") == {}


@pytest.mark.parametrize("how", ["open-wb", "mv"])
def test_a_path_taken_meanwhile_is_never_overwritten(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A racing writer makes a directory where the old file was (it is in staging): the
    new file is not moved over it, the writer's directory stays, the old bytes are kept
    (displaced, retrievable by path and checksum), a moved source goes back, no event."""
    files = table(daemon, 1)
    [path] = files
    src = tmp_path / "src.parquet"
    src.write_bytes(b"moved bytes")
    since = daemon.client().current_event()
    on_point(monkeypatch, "fsspec.prepared", lambda: os.mkdir(path))
    with pytest.raises(FileExistsError):
        if how == "mv":
            hook(daemon).mv(str(src), path)
        else:
            overwrite(hook(daemon), path, tmp_path, how)
    assert os.path.isdir(path) and os.listdir(path) == []
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert src.read_bytes() == b"moved bytes"
    assert events_after(daemon, since) == []
    assert status(daemon, path, files[path]) == "cmroot"


def test_several_overwrites_in_one_call_are_one_event(daemon: Daemon, tmp_path: Path) -> None:
    files = table(daemon, 3)
    paths = sorted(files)
    local = write_files(tmp_path, {f"new-{i}": f"new {i}".encode() for i in range(3)})
    since = daemon.client().current_event()
    hook(daemon).put(sorted(local), paths)
    [event] = events_after(daemon, since)
    assert sorted(f["path"] for f in event["files"]) == paths
    assert [Path(p).read_bytes() for p in paths] == [b"new 0", b"new 1", b"new 2"]
    assert all(status(daemon, p, b) == "cmroot" for p, b in files.items())


def test_mv_of_several_files_onto_existing_ones_is_one_event(
    daemon: Daemon, tmp_path: Path
) -> None:
    files = table(daemon, 2)
    paths = sorted(files)
    local = write_files(tmp_path, {f"new-{i}": f"moved {i}".encode() for i in range(2)})
    since = daemon.client().current_event()
    hook(daemon).mv(sorted(local), paths)
    [event] = events_after(daemon, since)
    assert sorted(f["path"] for f in event["files"]) == paths
    assert [Path(p).read_bytes() for p in paths] == [b"moved 0", b"moved 1"]
    assert not any(Path(p).exists() for p in local)


def test_rm_with_a_depth_limit_recycles_what_it_removes_and_nothing_more(
    daemon: Daemon,
) -> None:
    """The local target's rm ignores maxdepth (it removes a directory whole): files down to
    the depth are recycled in one event, a deeper one stays, emptied directories go."""
    files = table(daemon, 2)
    t = Path(sorted(files)[0]).parent.parent
    deep = write_files(t, {"p=0/sub/deeper.parquet": b"deeper"})
    since = daemon.client().current_event()
    hook(daemon).rm(str(t), recursive=True, maxdepth=2)
    [event] = events_after(daemon, since)
    assert sorted(f["path"] for f in event["files"]) == sorted(files)
    assert unchanged(deep)
    assert sorted(os.listdir(t)) == ["p=0"] and os.listdir(t / "p=0") == ["sub"]


def escaping(d: Daemon, files: dict[str, bytes], name: str) -> str:
    """A symlink under the root to a file outside it: the daemon refuses to recycle it."""
    outside = d.outside / f"{name}-{os.urandom(4).hex()}"
    outside.write_bytes(b"outside")
    link = Path(sorted(files)[-1]).parent / name
    link.symlink_to(outside)
    return str(link)


@pytest.mark.parametrize("how", ["put", "pipe", "copy", "mv"])
def test_a_call_whose_one_destination_is_refused_changes_nothing(
    daemon: Daemon, tmp_path: Path, how: str
) -> None:
    files = table(daemon, 2)
    link = escaping(daemon, files, "part-1.parquet")
    dests = [*sorted(files), link]
    local = write_files(tmp_path, {f"part-{i}.parquet": b"new" for i in range(3)})
    before = {**tree(daemon.warehouse), **tree(daemon.outside)}
    since = daemon.client().current_event()
    fs = hook(daemon)
    with pytest.raises(CmrootError, match="could not recycle 3 path"):
        if how == "put":
            fs.put(sorted(local), dests)
        elif how == "pipe":
            fs.pipe({d: b"new" for d in dests})
        elif how == "copy":
            fs.copy(sorted(local), dests)
        else:
            fs.mv(sorted(local), dests)
    assert {**tree(daemon.warehouse), **tree(daemon.outside)} == before
    assert all(Path(p).read_bytes() == b"new" for p in local)  # moved sources are back
    assert events_after(daemon, since) == []


def test_a_multi_path_rm_with_one_refused_part_changes_nothing(daemon: Daemon) -> None:
    """Two partitions, a symlink escaping the root inside the second: one request, refused
    whole, so the first partition is intact too."""
    files = table(daemon, 2)
    escaping(daemon, files, "escape")
    parts = sorted({str(Path(p).parent) for p in files})
    before = tree(daemon.warehouse)
    since = daemon.client().current_event()
    with pytest.raises(CmrootError, match="could not recycle 2 path"):
        hook(daemon).rm(parts, recursive=True)
    assert tree(daemon.warehouse) == before
    assert events_after(daemon, since) == []


def test_an_rm_that_fails_past_the_recycle_puts_every_file_back(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Files under the root and a directory the target refuses to delete without
    recursive=True, in one rm: the files are prepared, the target fails, all come back."""
    files = table(daemon, 2)
    stubborn = tmp_path / "dir"
    stubborn.mkdir()
    since = daemon.client().current_event()
    with pytest.raises(ValueError, match="Cannot delete directory"):
        hook(daemon).rm([*sorted(files), str(stubborn)])
    assert unchanged(files) and stubborn.is_dir()
    assert events_after(daemon, since) == []


def test_an_rm_inside_and_outside_the_roots_is_one_event(daemon: Daemon, tmp_path: Path) -> None:
    files = table(daemon, 2)
    scratch = write_files(tmp_path, {"scratch.bin": b"scratch"})
    since = daemon.client().current_event()
    hook(daemon).rm([*sorted(files), *scratch])
    [event] = events_after(daemon, since)
    assert sorted(f["path"] for f in event["files"]) == sorted(files)
    assert not any(Path(p).exists() for p in [*files, *scratch])


def test_a_long_move_in_renews_the_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 s lease and move-ins that take longer in all (as server-side copies of big
    objects would): the hook renews as it goes, and the commit finds its transaction."""
    with Daemon(tmp_path / "d", env={"CMROOT_STORE_PREPARE_LEASE": "3s"}).serving() as d:
        _renews(d, tmp_path, monkeypatch)


def _renews(d: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = table(d, 2)
    local = write_files(tmp_path, {f"n{i}": f"new {i}".encode() for i in range(2)})
    on_point(monkeypatch, "fsspec.moved_in", lambda: time.sleep(1.2), k=1)
    on_point(monkeypatch, "fsspec.moved_in", lambda: time.sleep(2.5), k=2)
    hook(d).put(sorted(local), sorted(files))
    [event] = events_after(d, 0)
    assert len(event["files"]) == 2


def wait_past_lease(started: float, lease: float) -> None:
    """The prepare began before `started`: its lease has passed once our clock (the
    daemon's, on this host) is past started + lease."""
    while time.time() <= started + lease + 0.1:
        time.sleep(0.05)


def test_daemon_killed_between_prepare_and_commit_of_an_overwrite(
    lease2: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new file is in place when the daemon dies: the commit cannot be made, and the
    call says the change was applied but not recorded. Once the lease has passed the
    daemon (restarted) rolls back: the path holds the new file, so the old bytes are kept
    as a displaced entry, retrievable, with no event."""
    d = lease2
    files = table(d, 1)
    [path] = files
    killed: list[float] = []
    on_point(monkeypatch, "fsspec.moved_in", lambda: (killed.append(time.time()), d.kill()))
    with pytest.raises(CmrootError, match="applied but not recorded") as e:
        hook(d, retry_delays=(0.0, 0.0)).pipe_file(path, b"new bytes")
    assert "displaced" in str(e.value) and "bootstrap" in str(e.value)
    assert Path(path).read_bytes() == b"new bytes"
    wait_past_lease(killed[0], 2.0)
    d.start()
    assert Path(path).read_bytes() == b"new bytes"
    assert status(d, path, files[path]) == "cmroot"
    got = d.request("GET", d.files_url(path, cks.of_bytes(files[path])), scope="read")
    assert got.status == 200 and got.body == files[path]
    assert events_after(d, 0) == []
    assert [e["event_id"] for e in d.client().entries()["entries"]] == [None]
    assert tree(d.store / "staging") == {}


def test_daemon_killed_between_prepare_and_commit_of_a_delete(
    lease2: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An rm of files under the root and outside it: the daemon dies once the files under
    the root are prepared. The call fails; after the lease the files are back."""
    d = lease2
    files = table(d, 2)
    scratch = write_files(tmp_path, {"scratch.bin": b"scratch"})
    killed: list[float] = []
    on_point(monkeypatch, "fsspec.prepared", lambda: (killed.append(time.time()), d.kill()))
    with pytest.raises(CmrootError, match="could not be recorded"):
        hook(d, retry_delays=(0.0,)).rm([*sorted(files), *scratch])
    assert not any(Path(p).exists() for p in files)  # in the daemon's staging meanwhile
    wait_past_lease(killed[0], 2.0)
    d.start()
    assert unchanged(files)
    assert events_after(d, 0) == []


def test_a_commit_whose_answer_was_lost_is_found_committed(tmp_path: Path) -> None:
    """The daemon dies right after committing, before it answers (its own fault point);
    it is restarted while the hook retries, the retry finds the transaction gone, and the
    entries show it was committed: the call succeeds, with its one event."""
    d = Daemon(tmp_path / "d")
    try:
        _lost_answer(d.start(env={"CMROOT_FAULTS": "journal.committed"}))
    finally:
        d.close()


def _lost_answer(d: Daemon) -> None:
    files = table(d, 1)
    [path] = files

    done = threading.Event()

    def restart() -> None:
        assert d.proc is not None
        d.proc.wait()
        d.start()
        # The daemon dies with the thread that started it (PR_SET_PDEATHSIG): this one
        # lives until the test is over.
        done.wait()

    restarter = threading.Thread(target=restart)
    restarter.start()
    try:
        hook(d, retry_delays=(1.0, 2.0, 4.0, 8.0)).pipe_file(path, b"new bytes")
        assert Path(path).read_bytes() == b"new bytes"
        [event] = events_after(d, 0)
        assert [f["path"] for f in event["files"]] == [path]
        assert status(d, path, files[path]) == "cmroot"
    finally:
        done.set()
        restarter.join()

"""`fs.transaction` on the fsspec hook is one unit (DESIGN invariant 2): the replacements
made inside it wait for its end, an `rm` inside it joins its two-phase transaction at
once, files it creates under a root are taken back if it fails, files opened for writing
elsewhere are deferred by the target as fsspec defers them. A clean block commits all of
it as one event; a block that raises (or a part the daemon refuses) leaves every path as
it was, with no event. Real daemon, real files."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import tree

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("fs-tx")).serving() as d:
        yield d


def hook(d: Daemon) -> CmrootFileSystem:
    return CmrootFileSystem(
        target_protocol="file",
        url=d.url,
        token=d.tokens["write"],
        warehouse_roots=[str(d.warehouse)],
    )


def table(d: Daemon, n: int) -> dict[str, bytes]:
    name = os.urandom(4).hex()
    return write_files(
        d.warehouse,
        {f"db.db/t{name}/p={i}/part-0.parquet": f"old {i} {name}".encode() for i in range(n)},
    )


def events_after(d: Daemon, since: int) -> list[dict[str, Any]]:
    return d.client().events(since + 1, 1000)


def status(d: Daemon, path: str, data: bytes) -> str:
    [r] = d.client("read").resolve([{"path": path, "checksum": cks.of_bytes(data)}]).files
    return str(r.status)


@pytest.mark.parametrize("outcome", ["clean", "raises"])
def test_rm_and_writes_inside_a_transaction_are_one_unit(
    daemon: Daemon, tmp_path: Path, outcome: str
) -> None:
    files = table(daemon, 3)
    a, b, c = sorted(files)
    created = Path(a).parent / "new.parquet"
    scratch, piped = tmp_path / "scratch.txt", tmp_path / "piped.bin"
    fs = hook(daemon)
    since = daemon.client().current_event()

    def run() -> None:
        with fs.transaction:
            fs.rm(a)
            with fs.open(b, "wb") as f:
                f.write(b"new b")
            fs.pipe_file(c, b"new c")
            with fs.open(str(created), "wb") as f:
                f.write(b"created")
            with fs.open(str(scratch), "w") as t:
                t.write("scratch")
            fs.pipe_file(str(piped), b"piped")
            # The deletes are prepared at once; the replacements and the files outside the
            # roots wait for the end.
            assert not Path(a).exists() and Path(b).read_bytes() == files[b]
            assert not scratch.exists() and not piped.exists()
            if outcome == "raises":
                raise RuntimeError("job failed")

    if outcome == "raises":
        with pytest.raises(RuntimeError, match="job failed"):
            run()
        assert {p: Path(p).read_bytes() for p in files} == files
        assert not created.exists() and not scratch.exists() and not piped.exists()
        assert events_after(daemon, since) == []
        assert tree(daemon.store / "staging") == {}
        return
    run()
    [event] = events_after(daemon, since)
    assert sorted(f["path"] for f in event["files"]) == [a, b, c]
    assert not Path(a).exists()
    assert (Path(b).read_bytes(), Path(c).read_bytes()) == (b"new b", b"new c")
    assert created.read_bytes() == b"created" and scratch.read_text() == "scratch"
    assert piped.read_bytes() == b"piped"
    assert all(status(daemon, p, data) == "cmroot" for p, data in files.items())


def test_a_refused_part_leaves_the_whole_transaction_undone(daemon: Daemon) -> None:
    """The second rm names a partition holding a symlink out of the root: the daemon
    refuses it, so it rolls back the transaction the first rm began. The block goes on
    (the error was caught); its end commits nothing and says so."""
    files = table(daemon, 2)
    a, b = sorted(files)
    outside = daemon.outside / f"target-{os.urandom(4).hex()}"
    outside.write_bytes(b"outside")
    escaping = Path(b).parent / "escape"
    escaping.symlink_to(outside)
    fs = hook(daemon)
    since = daemon.client().current_event()
    with pytest.raises(CmrootError, match="not committed"), fs.transaction:
        fs.rm(a)
        with pytest.raises(CmrootError, match="as part of transaction"):
            fs.rm(str(Path(b).parent), recursive=True)
        fs.pipe_file(b, b"new b")
    assert {p: Path(p).read_bytes() for p in files} == files
    assert escaping.is_symlink() and outside.read_bytes() == b"outside"
    assert events_after(daemon, since) == []
    assert tree(daemon.store / "staging") == {}


@pytest.mark.parametrize("outcome", ["clean", "raises"])
def test_rm_file_outside_the_roots_waits_for_the_end(
    daemon: Daemon, tmp_path: Path, outcome: str
) -> None:
    """`rm_file` of a path outside the roots inside `fs.transaction` is deleted at the end,
    with the rest: a block that raises leaves it in place."""
    [(inside, data)] = table(daemon, 1).items()
    outside = tmp_path / "keep-me"
    outside.write_bytes(b"outside")
    fs = hook(daemon)
    expect = pytest.raises(RuntimeError) if outcome == "raises" else contextlib.nullcontext()
    with expect, fs.transaction:
        fs.rm_file(str(outside))
        fs.rm_file(inside)
        assert outside.exists()  # deleted at the end, not before
        if outcome == "raises":
            raise RuntimeError("the block fails")
    if outcome == "raises":
        assert outside.read_bytes() == b"outside" and Path(inside).read_bytes() == data
    else:
        assert not outside.exists() and not Path(inside).exists()
        assert status(daemon, inside, data) == "cmroot"

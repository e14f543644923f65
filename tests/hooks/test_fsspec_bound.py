"""The fsspec hook acts on the path it checked (DESIGN invariant 5): on the local
filesystem what it removes itself is removed relative to a directory opened without
following a symlink, so a directory on the way that becomes a symlink after the check
(here, between the prepare and the delete, at the hook's own fault point) makes the call
fail with nothing removed through it. A move *into* a root's parent stays allowed, and a
move to another filesystem is copied, then removed bound likewise. Real daemon, real
files."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cmroot_testlib import on_point, tree

from cmroot.exceptions import Conflict
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("bound") / "lake").serving() as d:
        yield d


def hook(d: Daemon) -> CmrootFileSystem:
    return CmrootFileSystem(
        target_protocol="file",
        url=d.url,
        token=d.tokens["write"],
        warehouse_roots=[str(d.warehouse)],
    )


def test_a_directory_that_becomes_a_symlink_after_the_check_loses_nothing(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rm([<root file>, <tmp>/decoy/warehouse], recursive=True)`: `decoy` is a real
    directory when the hook resolves the paths; once the root file is prepared, `decoy`
    is swapped for a symlink to the lake. Removing `decoy/warehouse` by name would now
    remove the warehouse root; bound to the checked directory, the call fails (Conflict),
    the prepared file is put back and no event is recorded."""
    files = write_files(daemon.warehouse, {f"db.db/t{os.urandom(4).hex()}/part-0": b"keep"})
    decoy = tmp_path / "decoy"
    write_files(decoy / "warehouse", {"db.db/t/part-0": b"decoy"})
    moved = tmp_path / "decoy.real"

    def swap() -> None:
        os.rename(decoy, moved)
        os.symlink(daemon.base, decoy)

    on_point(monkeypatch, "fsspec.prepared", swap)
    before = tree(daemon.warehouse)
    since = daemon.client().current_event()
    with pytest.raises(Conflict, match="a directory changed"):
        hook(daemon).rm([*files, str(decoy / "warehouse")], recursive=True)
    assert tree(daemon.warehouse) == before  # the prepared file is back, nothing else went
    assert (moved / "warehouse" / "db.db" / "t" / "part-0").read_bytes() == b"decoy"
    assert daemon.client().events(since + 1) == []


def test_a_directory_moves_into_a_roots_parent(daemon: Daemon, tmp_path: Path) -> None:
    """Only a root or a directory holding one is refused as the destination's *name*;
    moving a directory into the lake (beside the root) is an ordinary move."""
    src = tmp_path / f"incoming-{os.urandom(4).hex()}"
    write_files(src, {"f": b"x"})
    hook(daemon).mv(str(src), str(daemon.base))
    landed = daemon.base / src.name
    try:
        assert (landed / "f").read_bytes() == b"x" and not src.exists()
    finally:
        shutil.rmtree(landed, ignore_errors=True)


def test_a_directory_moved_to_another_filesystem_is_copied_then_removed(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Across filesystems a rename fails (EXDEV): the tree is copied as shutil.move copies
    it (a symlink stays a symlink), then the source is removed bound to its checked
    directory."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    other = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cmroot-test-"))
    try:
        src = other / "incoming"
        write_files(src, {"a/f": b"x"})
        (src / "link").symlink_to(src / "a" / "f")
        hook(daemon).mv(str(src), str(tmp_path / "moved"))
        moved = tmp_path / "moved"
        assert (moved / "a" / "f").read_bytes() == b"x" and not src.exists()
        assert (moved / "link").is_symlink()
    finally:
        shutil.rmtree(other, ignore_errors=True)

"""The fsspec hook never removes, moves or writes over a warehouse root or a directory that
contains one (DESIGN invariant 5), however the path is spelled, whether the daemon is up
or not: the call raises Forbidden naming the root, and nothing is touched.

The warehouse is `<tmp>/grand/lake/warehouse` (a real daemon's root), so its parent and
grandparent are real directories in the test's own tree. `/` is tried only against a
target filesystem that refuses every destructive call (`NoDeletes`): without the guard
that test fails without a file being touched."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from cmroot_testlib import tree
from fsspec.implementations.local import LocalFileSystem

from cmroot import checksum as cks
from cmroot.exceptions import Forbidden
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, free_port, write_files

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("anc") / "grand" / "lake").serving() as d:
        yield d


@pytest.fixture
def table(daemon: Daemon) -> dict[str, bytes]:
    """A table under the root, fresh for each test (files of earlier tests stay too)."""
    name = os.urandom(4).hex()
    return write_files(
        daemon.warehouse,
        {
            f"db.db/t{name}/p=1/part-0.parquet": b"p1 " + name.encode(),
            f"db.db/t{name}/p=2/part-0.parquet": b"p2 " + name.encode(),
        },
    )


def hook(d: Daemon, roots: list[str] | None = None, **kw: Any) -> CmrootFileSystem:
    return CmrootFileSystem(
        target_protocol="file",
        url=d.url,
        token=d.tokens["write"],
        warehouse_roots=roots or [str(d.warehouse)],
        **kw,
    )


def state(d: Daemon) -> dict[str, Any]:
    """Everything a refused call must leave as it was: the lake (the warehouse, the
    daemon's store and config beside it), the directory outside, and the event log."""
    return {
        "lake": {p: v for p, v in tree(d.base).items() if not p.endswith("daemon.log")},
        "grand": sorted(os.listdir(d.base.parent)),
        "events": d.client().current_event(),
    }


def refused(d: Daemon, e: pytest.ExceptionInfo[Forbidden], root: Path | None = None) -> None:
    text = str(e.value)
    assert f"warehouse root {root or d.warehouse}" in text, text
    assert "nothing was changed" in text and "warehouse_roots" in text, text


SPELLINGS = [
    pytest.param(lambda p: str(p), id="plain"),
    pytest.param(lambda p: f"{p}/", id="trailing-slash"),
    pytest.param(lambda p: str(p).replace("/", "//"), id="double-slashes"),
    pytest.param(lambda p: f"{p}/../{p.name}/.", id="dot-segments"),
    pytest.param(lambda p: f"cmroot::file://{p}", id="chained-url"),
    pytest.param(lambda p: f"cmroot://{p}", id="cmroot-url"),
]


@pytest.mark.parametrize("spell", SPELLINGS)
@pytest.mark.parametrize("up", [0, 1, 2], ids=["root", "parent", "grandparent"])
def test_recursive_rm_of_the_root_or_an_ancestor_is_refused(
    daemon: Daemon, table: dict[str, bytes], up: int, spell: Any
) -> None:
    target = daemon.warehouse.parents[up - 1] if up else daemon.warehouse
    before = state(daemon)
    with pytest.raises(Forbidden) as e:
        hook(daemon).rm(spell(target), recursive=True)
    refused(daemon, e)
    assert state(daemon) == before
    assert all(Path(p).read_bytes() == b for p, b in table.items())


def test_refused_with_the_daemon_unreachable_and_fail_open(
    daemon: Daemon, table: dict[str, bytes]
) -> None:
    """The guard is the hook's own: fail_open (delete without a copy when the daemon is
    down) never reaches a root."""
    loose = CmrootFileSystem(
        url=f"http://127.0.0.1:{free_port()}",
        fail_open=True,
        warehouse_roots=[str(daemon.warehouse)],
    )
    before = state(daemon)
    for target in (daemon.warehouse, daemon.base):
        with pytest.raises(Forbidden) as e:
            loose.rm(str(target), recursive=True)
        refused(daemon, e)
    assert state(daemon) == before


def test_every_destructive_verb_on_an_ancestor_is_refused(
    daemon: Daemon, table: dict[str, bytes], tmp_path: Path
) -> None:
    empty_root = daemon.base.parent / "empty-root"  # an empty root: rmdir would take it
    empty_root.mkdir(exist_ok=True)
    unborn = daemon.base.parent / "unborn-root"  # a root not created yet
    fs = hook(daemon, [str(daemon.warehouse), str(empty_root), str(unborn)])
    local = tmp_path / "new.bin"
    local.write_bytes(b"new")
    part = next(iter(table))
    wh, lake = str(daemon.warehouse), str(daemon.base)
    calls = {
        "rm non-recursive of the parent": lambda: fs.rm(lake),
        "rm_file of the parent": lambda: fs.rm_file(lake),
        "delete of the root": lambda: fs.delete(wh, recursive=True),
        "rmdir of an empty root": lambda: fs.rmdir(str(empty_root)),
        "mv of the root": lambda: fs.mv(wh, str(tmp_path / "moved"), recursive=True),
        "rename of the parent": lambda: fs.rename(lake, str(tmp_path / "moved")),
        "mv of a list holding the parent": lambda: fs.mv([part, lake], str(tmp_path)),
        "pipe_file onto the root": lambda: fs.pipe_file(wh, b"x"),
        "open wb onto the parent": lambda: fs.open(lake, "wb"),
        "touch of the root": lambda: fs.touch(wh),
        "put_file onto the parent": lambda: fs.put_file(str(local), lake),
        "cp_file onto the root": lambda: fs.cp_file(part, wh),
        "mv of a file onto a root's name": lambda: fs.mv(str(local), str(unborn)),
    }
    roots = {"rmdir of an empty root": empty_root, "mv of a file onto a root's name": unborn}
    before = state(daemon)
    for what, call in calls.items():
        with pytest.raises(Forbidden) as e:
            call()
        refused(daemon, e, roots.get(what))
        assert state(daemon) == before, what
    assert empty_root.is_dir() and not unborn.exists() and local.read_bytes() == b"new"


def test_a_glob_matching_an_ancestor_is_refused_whole(
    daemon: Daemon, table: dict[str, bytes], tmp_path: Path
) -> None:
    """`grand/*` matches the lake and a scratch directory: the scratch one is not removed
    either (refused before anything goes)."""
    scratch = daemon.base.parent / "scratch"
    write_files(scratch, {"f": b"scratch"})
    before = state(daemon)
    with pytest.raises(Forbidden) as e:
        hook(daemon).rm(f"{daemon.base.parent}/*", recursive=True)
    refused(daemon, e)
    assert state(daemon) == before and (scratch / "f").read_bytes() == b"scratch"


def test_symlinked_ancestors_are_compared_by_real_path(
    daemon: Daemon, table: dict[str, bytes], tmp_path: Path
) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(daemon.base)  # alias/warehouse is the root, by another name
    before = state(daemon)
    with pytest.raises(Forbidden) as e:
        hook(daemon).rm(str(alias / "warehouse"), recursive=True)
    refused(daemon, e)
    # A root configured through the symlink: its real parent is refused just the same.
    via = alias / "warehouse"
    with pytest.raises(Forbidden) as e:
        hook(daemon, [str(via)]).rm(str(daemon.base), recursive=True)
    refused(daemon, e, via)
    assert state(daemon) == before


def test_a_file_reached_through_a_symlinked_directory_is_recycled(
    daemon: Daemon, table: dict[str, bytes], tmp_path: Path
) -> None:
    """Under the root by its real path: recycled under the root's name, not just deleted."""
    alias = tmp_path / "alias"
    alias.symlink_to(daemon.base)
    path = next(iter(table))
    via = str(alias / Path(path).relative_to(daemon.base))
    since = daemon.client().current_event()
    hook(daemon).rm(via)
    assert not Path(path).exists()
    [event] = daemon.client().events(since + 1)
    assert [f["path"] for f in event["files"]] == [path]
    [r] = (
        daemon.client("read").resolve([{"path": path, "checksum": cks.of_bytes(table[path])}]).files
    )
    assert r.status == "cmroot"


def test_url_chaining_to_an_ancestor_is_refused(daemon: Daemon, table: dict[str, bytes]) -> None:
    opts = {
        "url": daemon.url,
        "token": daemon.tokens["write"],
        "warehouse_roots": [str(daemon.warehouse)],
    }
    fs, path = fsspec.core.url_to_fs(f"cmroot::file://{daemon.base}", cmroot=opts)
    assert isinstance(fs, CmrootFileSystem)
    before = state(daemon)
    with pytest.raises(Forbidden) as e:
        fs.rm(path, recursive=True)
    refused(daemon, e)
    assert state(daemon) == before


class NoDeletes(LocalFileSystem):  # type: ignore[misc]
    """The one target that is not real, for `/`: reads work, and every destructive call is
    recorded and refused, so a missing guard fails the test with nothing touched."""

    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def _refuse(self, name: str, *args: Any) -> None:
        self.calls.append(f"{name}{args}")
        raise AssertionError(f"{name}{args} reached the target filesystem")

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        self._refuse("rm", path, recursive)

    def rm_file(self, path: Any) -> None:
        self._refuse("rm_file", path)

    def _rm(self, path: Any) -> None:
        self._refuse("_rm", path)

    def rmdir(self, path: Any) -> None:
        self._refuse("rmdir", path)

    def mv(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> None:
        self._refuse("mv", path1, path2)

    def cp_file(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        self._refuse("cp_file", path1, path2)

    def put_file(self, lpath: Any, rpath: Any, **kwargs: Any) -> None:
        self._refuse("put_file", lpath, rpath)

    def pipe_file(self, path: Any, value: Any, **kwargs: Any) -> None:
        self._refuse("pipe_file", path)

    def touch(self, path: Any, truncate: bool = True, **kwargs: Any) -> None:
        self._refuse("touch", path)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" not in mode:
            self._refuse("open", path, mode)
        return super()._open(path, mode, **kwargs)


def test_the_filesystem_root_is_refused_before_the_target_is_asked(daemon: Daemon) -> None:
    target = NoDeletes()
    fs = CmrootFileSystem(
        fs=target,
        url=daemon.url,
        token=daemon.tokens["write"],
        warehouse_roots=[str(daemon.warehouse)],
    )
    up = "/".join([str(daemon.warehouse), *[".."] * len(daemon.warehouse.parts)])
    calls = [
        lambda: fs.rm("/", recursive=True),
        lambda: fs.rm("//", recursive=True),
        lambda: fs.rm("cmroot::file:///", recursive=True),
        lambda: fs.rm(up, recursive=True),
        lambda: fs.rm("/*", recursive=True),  # matches the top directory holding the root
        lambda: fs.rm(["/", str(daemon.outside)], recursive=True),
        lambda: fs.rm("/"),
        lambda: fs.rm_file("/"),
        lambda: fs.rmdir("/"),
        lambda: fs.mv("/", "/elsewhere", recursive=True),
        lambda: fs.pipe_file("/", b""),
        lambda: fs.open("/", "wb"),
    ]
    since = daemon.client().current_event()
    for call in calls:
        with pytest.raises(Forbidden) as e:
            call()
        refused(daemon, e)
    assert target.calls == []
    assert daemon.client().current_event() == since

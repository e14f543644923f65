"""The `cmroot` fsspec wrapper against a real daemon on loopback: `rm` and overwriting
`open(..., "wb")` of files under a warehouse root recycle them (op DELETE) before they go;
a failed write leaves the old file; the daemon down fails closed unless fail_open."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.spark.sparklib import Daemon, assert_retrievable

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("fsspec")).start()
    yield d
    d.stop()


@pytest.fixture
def fs(daemon: Daemon) -> CmrootFileSystem:
    return CmrootFileSystem(
        target_protocol="file", url=daemon.url, warehouse_roots=[str(daemon.warehouse)]
    )


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_registered_through_the_entry_point(daemon: Daemon) -> None:
    assert fsspec.get_filesystem_class("cmroot") is CmrootFileSystem
    fs = fsspec.filesystem("cmroot", url=daemon.url, warehouse_roots=str(daemon.warehouse))
    assert isinstance(fs, CmrootFileSystem) and fs.roots == [str(daemon.warehouse)]


def test_rm_file_recycles(daemon: Daemon, fs: CmrootFileSystem) -> None:
    f = put(daemon.warehouse / "db1.db" / "t" / "p=1" / "part-0.parquet", b"old bytes 1")
    since = daemon.current()
    fs.rm(str(f))
    assert not f.exists()
    [ev] = daemon.events_after(since)
    assert ev["eventType"] == "DELETE" and [x["path"] for x in ev["files"]] == [str(f)]
    assert_retrievable(daemon.client, {str(f): b"old bytes 1"})


def test_rm_recursive_directory_recycles_all_or_nothing(
    daemon: Daemon, fs: CmrootFileSystem
) -> None:
    d = daemon.warehouse / "db1.db" / "t2" / "p=2"
    files = {str(put(d / f"part-{i}.parquet", f"file {i}".encode())): f"file {i}".encode()
             for i in range(5)}
    since = daemon.current()
    fs.rm("cmroot://" + str(d), recursive=True)
    assert not d.exists()
    [ev] = daemon.events_after(since)
    assert {x["path"] for x in ev["files"]} == set(files)
    assert_retrievable(daemon.client, files)


def test_overwriting_open_wb_recycles_the_old_bytes(daemon: Daemon, fs: CmrootFileSystem) -> None:
    f = put(daemon.warehouse / "db1.db" / "t3" / "data.csv", b"a,b\n1,2\n")
    since = daemon.current()
    with fs.open(str(f), "wb") as out:
        out.write(b"a,b\n3,4\n")
    assert f.read_bytes() == b"a,b\n3,4\n"
    [ev] = daemon.events_after(since)
    assert ev["eventType"] == "DELETE"
    assert_retrievable(daemon.client, {str(f): b"a,b\n1,2\n"})
    assert sorted(p.name for p in f.parent.iterdir()) == ["data.csv"]  # no temp left
    # text mode and pipe go the same way
    since = daemon.current()
    with fs.open(str(f), "w") as text:
        text.write("a,b\n5,6\n")
    fs.pipe_file(str(f), b"a,b\n7,8\n")
    assert f.read_bytes() == b"a,b\n7,8\n"
    assert len(daemon.events_after(since)) == 2
    assert_retrievable(daemon.client, {str(f) + "": b"a,b\n3,4\n"})


def test_new_file_and_paths_outside_the_roots_are_not_recycled(
    daemon: Daemon, fs: CmrootFileSystem, tmp_path: Path
) -> None:
    since = daemon.current()
    new = daemon.warehouse / "db1.db" / "t4" / "new.bin"
    new.parent.mkdir(parents=True)
    with fs.open(str(new), "wb") as out:
        out.write(b"fresh")
    outside = put(tmp_path / "scratch.bin", b"scratch")
    with fs.open(str(outside), "wb") as out:
        out.write(b"over")
    fs.rm(str(outside))
    assert new.read_bytes() == b"fresh" and not outside.exists()
    assert daemon.events_after(since) == []


def test_failed_write_leaves_the_old_file(daemon: Daemon, fs: CmrootFileSystem) -> None:
    f = put(daemon.warehouse / "db1.db" / "t5" / "part-0.parquet", b"keep me")
    since = daemon.current()
    with pytest.raises(RuntimeError), fs.open(str(f), "wb") as out:
        out.write(b"half")
        raise RuntimeError("writer died")
    assert f.read_bytes() == b"keep me"
    assert sorted(p.name for p in f.parent.iterdir()) == ["part-0.parquet"]
    assert daemon.events_after(since) == []


def test_pyarrow_overwrite_through_the_wrapper(daemon: Daemon, fs: CmrootFileSystem) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = daemon.warehouse / "db1.db" / "t6" / "part-0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"x": [1, 2]}), str(path), filesystem=fs)
    old = path.read_bytes()
    since = daemon.current()
    pq.write_table(pa.table({"x": [3]}), str(path), filesystem=fs)
    assert pq.read_table(str(path)).column("x").to_pylist() == [3]
    assert len(daemon.events_after(since)) == 1
    assert_retrievable(daemon.client, {str(path): old})


def test_url_chaining(daemon: Daemon) -> None:
    f = put(daemon.warehouse / "db1.db" / "t7" / "x.txt", b"one")
    since = daemon.current()
    opts = {"cmroot": {"url": daemon.url, "warehouse_roots": [str(daemon.warehouse)]}}
    with fsspec.open(f"cmroot::file://{f}", "wb", **opts) as out:
        out.write(b"two")
    assert f.read_bytes() == b"two"
    assert len(daemon.events_after(since)) == 1
    buf = io.BytesIO()
    daemon.client.get(str(f), cks.of_bytes(b"one"), buf)
    assert buf.getvalue() == b"one"


def test_daemon_down_fails_closed_then_fail_open(daemon: Daemon, fs: CmrootFileSystem) -> None:
    f = put(daemon.warehouse / "db1.db" / "t8" / "part-0.parquet", b"precious")
    with daemon.down():
        with pytest.raises(CmrootError, match="cmroot could not recycle"):
            fs.rm(str(f))
        with pytest.raises(CmrootError, match="cmroot"), fs.open(str(f), "wb") as out:
            out.write(b"new")
        assert f.read_bytes() == b"precious"
        assert sorted(p.name for p in f.parent.iterdir()) == ["part-0.parquet"]
        loose = CmrootFileSystem(url=daemon.url, warehouse_roots=[str(daemon.warehouse)],
                                 fail_open=True)
        n = CmrootFileSystem.fail_open_count
        loose.rm(str(f))
        assert not f.exists() and CmrootFileSystem.fail_open_count == n + 1


def test_a_recycle_says_who_asked(daemon: Daemon, fs: CmrootFileSystem) -> None:
    import getpass
    import socket

    f = put(daemon.warehouse / "audit.db" / "t" / "part-0.parquet", b"whose bytes")
    since = daemon.current()
    fs.rm(str(f))
    [ev] = daemon.events_after(since)
    assert ev["audit"]["user"] == getpass.getuser()
    assert ev["audit"]["host"] == socket.gethostname()
    assert ev["audit"]["app"]  # the program's name

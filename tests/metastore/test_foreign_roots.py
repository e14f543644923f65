"""A warehouse root on a file system other than the local one (an object store, HDFS;
here `disk://`, a second Hadoop scheme over the local disk): the plugin cannot keep files
there yet, so a drop that would delete data under it is refused, saying so, and changes
nothing; drops under the local roots are kept as before, and fail-open lets them through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jvm import DISK_FS, disk_fs_jar
from tests.metastore.conftest import Hms, start_hms
from tests.metastore.test_metastore_plugin import COLUMNS, files_of, partitioned
from tests.metastore.thrift_client import HmsClient, MetaException, NoSuchObjectException

pytestmark = pytest.mark.timeout(300)


def start(base: Path, *args: str) -> Hms:
    lake = base / "lake"
    lake.mkdir()
    local = base / "warehouse"  # the daemon's warehouse root (tests.server.cmroot_daemon)
    return start_hms(base, "--warehouse-root", str(local), "--warehouse-root",
                     f"disk://{lake}", *args, site={"fs.disk.impl": DISK_FS},
                     classpath=[disk_fs_jar()])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hms]:
    pytest.importorskip("pyspark")
    h = start(tmp_path_factory.mktemp("foreign"))
    try:
        yield h
    finally:
        h.metastore.stop()
        h.daemon.stop()


def on_disk(c: HmsClient, h: Hms, db: str) -> Path:
    """A database and a partitioned managed table under the `disk://` root, a file in each
    of two partitions and one in the table's directory."""
    lake = h.base / "lake"
    c.create_database(db, f"disk://{lake}/{db}.db")
    top = lake / f"{db}.db" / "t"
    c.create_table(db, "t", f"disk://{top}", COLUMNS, partition_keys=[("p", "string")],
                   file_format="text")
    for v in ("1", "2"):
        c.add_partition(db, "t", [v])
        (top / f"p={v}" / "data.txt").write_text(f"row of {v}\n")
    return top


def test_drops_under_a_foreign_root_are_refused_and_change_nothing(foreign: Hms) -> None:
    with foreign.client() as c:
        top = on_disk(c, foreign, "far")
        before = files_of(top)
        since = foreign.current()
        for drop in (lambda: c.drop_partition("far", "t", ["1"]),
                     lambda: c.drop_partitions("far", "t", ["p=1", "p=2"]),
                     lambda: c.drop_table("far", "t"),
                     lambda: c.drop_table("far", "t", purge=True)):
            with pytest.raises(MetaException, match=r"cmroot refuses .* on a file system cmroot"
                               r" cannot keep files of yet"):
                drop()
        assert c.list_partition_names("far", "t") == ["p=1", "p=2"]
        with pytest.raises(MetaException, match="cmroot refuses DROP DATABASE far"):
            c.drop_database("far", delete_data=True, cascade=False)
        assert c.get_database("far").name == "far"
        # What deletes nothing goes ahead: a drop that keeps the data.
        c.drop_partition("far", "t", ["2"], delete_data=False)
        assert c.list_partition_names("far", "t") == ["p=1"]
    assert files_of(top) == before
    assert foreign.events(since) == []  # nothing there is kept, nor replicated


def test_local_roots_are_kept_as_before(foreign: Hms) -> None:
    with foreign.client() as c:
        top = partitioned(c, foreign, "near", "t", ["1"])
        before = files_of(top)
        since = foreign.current()
        c.drop_table("near", "t")
        with pytest.raises(NoSuchObjectException):
            c.get_table("near", "t")
    (event,) = foreign.events(since)
    assert sorted(f["path"] for f in event["files"]) == sorted(before)


def test_fail_open_drops_under_a_foreign_root_unkept(tmp_path: Path) -> None:
    h = start(tmp_path, "--fail-open")
    try:
        with h.client() as c:
            top = on_disk(c, h, "open")
            c.drop_table("open", "t")
            with pytest.raises(NoSuchObjectException):
                c.get_table("open", "t")
        assert not top.exists()
        assert "going ahead unprotected" in h.metastore.log.read_text()
    finally:
        h.metastore.stop()
        h.daemon.stop()

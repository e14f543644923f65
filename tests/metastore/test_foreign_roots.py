"""A warehouse root on a file system other than the local one (an object store, HDFS; here
`disk://`, a second Hadoop scheme over the local disk, which the daemon reads through its
fsspec twin as it reads S3 through s3fs): drops through the metastore keep their files
there as on a local root (the daemon copies each file into the store, then takes it away),
record their events, and fail closed when the daemon cannot keep them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.metastore.conftest import Hms, start_disk_hms
from tests.metastore.test_metastore_plugin import COLUMNS, files_of, partitioned
from tests.metastore.thrift_client import HmsClient, MetaException, NoSuchObjectException

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hms]:
    pytest.importorskip("pyspark")
    base = tmp_path_factory.mktemp("foreign")
    h = start_disk_hms(base, base / "lake")
    try:
        yield h
    finally:
        h.metastore.stop()
        h.daemon.stop()


def on_disk(c: HmsClient, h: Hms, db: str, parts: tuple[str, ...] = ("1", "2")) -> Path:
    """A database and a managed table partitioned by p under the `disk://` root, a data
    file in each partition."""
    lake = h.base / "lake"
    c.create_database(db, f"disk://{lake}/{db}.db")
    top = lake / f"{db}.db" / "t"
    c.create_table(db, "t", f"disk://{top}", COLUMNS, partition_keys=[("p", "string")],
                   file_format="text")
    for v in parts:
        c.add_partition(db, "t", [v])
        (top / f"p={v}" / "data.txt").write_text(f"row of {v}\n")
    return top


def uri(path: str) -> str:
    return f"disk://{path}"


def test_drops_under_a_root_on_another_file_system_keep_their_files(foreign: Hms) -> None:
    with foreign.client() as c:
        top = on_disk(c, foreign, "far", ("1", "2", "3"))
        before = files_of(top)
        since = foreign.current()
        c.drop_partitions("far", "t", ["p=1", "p=2"])
        assert c.list_partition_names("far", "t") == ["p=3"]
        c.drop_table("far", "t", purge=True)
        with pytest.raises(NoSuchObjectException):
            c.get_table("far", "t")
    assert files_of(top) == {}
    events = foreign.events(since)
    assert [(e["eventType"], e["partitions"], e["purge"]) for e in events] == [
        ("DROP_PARTITION", [{"p": "1"}, {"p": "2"}], False), ("DROP_TABLE", [], True)]
    kept = {f["path"]: f for e in events for f in e["files"]}
    assert sorted(kept) == sorted(uri(p) for p in before)
    for path, data in before.items():
        assert foreign.served(uri(path), kept[uri(path)]["checksum"]) == data
    assert events[1]["location"] == uri(str(top))


def test_the_daemon_down_fails_a_drop_on_another_file_system(foreign: Hms) -> None:
    with foreign.client() as c:
        top = on_disk(c, foreign, "down")
        before = files_of(top)
        foreign.daemon.stop()
        try:
            with pytest.raises(MetaException, match="unreachable"):
                c.drop_table("down", "t")
            with pytest.raises(MetaException, match="unreachable"):
                c.drop_partition("down", "t", ["1"])
            assert c.list_partition_names("down", "t") == ["p=1", "p=2"]
        finally:
            foreign.daemon.start()
    assert files_of(top) == before


def test_local_roots_are_kept_as_before(foreign: Hms) -> None:
    with foreign.client() as c:
        top = partitioned(c, foreign, "near", "t", ["1"])
        before = files_of(top)
        since = foreign.current()
        c.drop_table("near", "t")
    (event,) = foreign.events(since)
    assert sorted(f["path"] for f in event["files"]) == sorted(before)


def test_a_root_without_a_scheme_is_on_the_default_file_system(tmp_path: Path) -> None:
    """hive.metastore.warehouse.dir=/user/hive/warehouse on an HDFS cluster is
    hdfs://namenode/user/hive/warehouse: a root written without a scheme is on fs.defaultFS,
    not on the local disk (every table would be outside it, dropped unkept)."""
    lake = tmp_path / "lake"
    h = start_disk_hms(tmp_path, lake, plugin_roots=[str(lake)],
                       daemon_roots=f"disk://{lake}", site={"fs.defaultFS": "disk:///"})
    try:
        with h.client() as c:
            top = lake / "t"
            c.create_table("default", "t", f"disk://{top}", COLUMNS, file_format="text")
            (top / "data.txt").write_text("a row\n")
            since = h.current()
            c.drop_table("default", "t")
        (event,) = h.events(since)
        assert [f["path"] for f in event["files"]] == [uri(str(top / "data.txt"))]
        assert not top.exists()
    finally:
        h.metastore.stop()
        h.daemon.stop()

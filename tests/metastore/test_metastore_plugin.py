"""The cmroot metastore plugin in a real standalone Hive metastore, driven by a bare Thrift
client (no Spark): drops through the metastore keep their files and record their events,
one recycle per call; a refusal or an unreachable daemon fails the call and changes nothing
(fail-closed), unless the plugin is set to fail open."""

from __future__ import annotations

import getpass
import os
import stat
import zipfile
from pathlib import Path

import pytest

from tests.metastore.conftest import Hms, metastore_conf, start_hms
from tests.metastore.thrift_client import HmsClient, MetaException, NoSuchObjectException

pytestmark = pytest.mark.timeout(300)

COLUMNS = [("a", "string")]


def files_of(top: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


def partitioned(c: HmsClient, hms: Hms, db: str, table: str, parts: list[str]) -> Path:
    """A managed table partitioned by p, a data file in each partition."""
    try:
        c.get_database(db)
    except NoSuchObjectException:
        c.create_database(db, hms.warehouse / f"{db}.db")
    c.create_table(db, table, hms.warehouse / f"{db}.db" / table, COLUMNS,
                   partition_keys=[("p", "string")], file_format="text")
    top = hms.warehouse / f"{db}.db" / table
    for v in parts:
        c.add_partition(db, table, [v])
        (top / f"p={v}" / "data.txt").write_text(f"row of {v}\n")
    return top


def test_metastore_conf_prints_the_plugin_for_hive_site() -> None:
    conf = metastore_conf("--url", "http://10.0.0.5:9750/")
    (jar,) = conf["classpath"]
    props = conf["properties"]
    assert props["cmroot.url"] == "http://10.0.0.5:9750"
    assert props["cmroot.failOpen"] == "false"
    assert props["hive.metastore.pre.event.listeners"].endswith("CmrootPreEventListener")
    assert props["hive.metastore.transactional.event.listeners"].endswith(
        "CmrootTransactionalListener")
    assert props["hive.metastore.end.function.listeners"].endswith("CmrootEndFunctionListener")
    # What a Hive 2.3/3.x metastore on Java 8 loads: Java 8 classes, no Spark in them.
    with zipfile.ZipFile(jar) as z:
        classes = [n for n in z.namelist() if n.endswith(".class")]
        assert classes and all(n.startswith(("io/cmroot/core/", "io/cmroot/metastore/"))
                               for n in classes)
        for n in classes:
            data = z.read(n)
            assert int.from_bytes(data[6:8], "big") == 52, n  # class file major 52: Java 8
            assert b"org/apache/spark" not in data, n


def test_a_dropped_table_keeps_its_files(hms: Hms) -> None:
    with hms.client() as c:
        top = partitioned(c, hms, "plain", "t", ["1", "2"])
        flat = hms.warehouse / "plain.db" / "flat"
        c.create_table("plain", "flat", flat, COLUMNS, file_format="text")
        (flat / "x.txt").write_text("flat row\n")
        before = files_of(top) | files_of(flat)
        since = hms.current()
        c.drop_table("plain", "t")
        c.drop_table("plain", "flat", purge=True)
        with pytest.raises(NoSuchObjectException):
            c.get_table("plain", "t")
    assert not top.exists() and not flat.exists()
    events = hms.events(since)
    assert [(e["eventType"], e["table"], e["purge"]) for e in events] == [
        ("DROP_TABLE", "t", False), ("DROP_TABLE", "flat", True)]
    kept = {f["path"]: f for e in events for f in e["files"]}
    assert sorted(kept) == sorted(before)
    for path, data in before.items():
        assert hms.served(path, kept[path]["checksum"]) == data
    # Who asked: the user the metastore ran the call as, and the Thrift client's address.
    assert {(e["audit"]["user"], e["audit"]["host"]) for e in events} == {
        (getpass.getuser(), "127.0.0.1")}


def test_a_drop_of_many_partitions_in_one_call_is_one_recycle(hms: Hms) -> None:
    with hms.client() as c:
        top = partitioned(c, hms, "many", "t", ["1", "2", "3"])
        before = files_of(top)
        since = hms.current()
        c.drop_partitions("many", "t", ["p=1", "p=2"])
        assert c.list_partition_names("many", "t") == ["p=3"]
    (event,) = hms.events(since)
    assert event["eventType"] == "DROP_PARTITION"
    assert event["partitions"] == [{"p": "1"}, {"p": "2"}]
    assert sorted(f["path"] for f in event["files"]) == sorted(
        p for p in before if "/p=3/" not in p)
    assert not (top / "p=1").exists() and (top / "p=3" / "data.txt").exists()
    # The next call on the metastore's threads starts afresh: a partition re-added empty
    # and dropped again is a drop of its own, recorded without files.
    with hms.client() as c:
        c.add_partition("many", "t", ["1"])
        since = hms.current()
        c.drop_partitions("many", "t", ["p=1"])
        c.drop_partition("many", "t", ["3"])
    assert [(e["eventType"], e["partitions"], len(e["files"])) for e in hms.events(since)] == [
        ("DROP_PARTITION", [{"p": "1"}], 0), ("DROP_PARTITION", [{"p": "3"}], 1)]


def test_a_refused_drop_changes_nothing(hms: Hms) -> None:
    """The daemon refuses a special file in the second partition: the call fails with
    cmroot's message, both partitions stay in the catalog, every file in place."""
    with hms.client() as c:
        top = partitioned(c, hms, "refused", "t", ["1", "2"])
        os.mkfifo(top / "p=2" / "pipe")
        before = files_of(top / "p=1") | files_of(top / "p=2" / "data.txt")
        since = hms.current()
        with pytest.raises(MetaException, match="cmroot"):
            c.drop_partitions("refused", "t", ["p=1", "p=2"])
        assert c.list_partition_names("refused", "t") == ["p=1", "p=2"]
        with pytest.raises(MetaException, match="cmroot"):
            c.drop_table("refused", "t")
        assert c.get_table("refused", "t").tableName == "t"
        assert c.list_partition_names("refused", "t") == ["p=1", "p=2"]
    assert all(Path(p).read_bytes() == data for p, data in before.items())
    assert stat.S_ISFIFO(os.lstat(top / "p=2" / "pipe").st_mode)
    assert hms.events(since) == []


def test_a_database_drop_is_refused_while_it_holds_tables(hms: Hms) -> None:
    with hms.client() as c:
        top = partitioned(c, hms, "whole", "t", ["1"])
        with pytest.raises(MetaException, match="Drop the tables first"):
            c.drop_database("whole", delete_data=True, cascade=True)
        assert c.get_tables("whole") == ["t"]
        assert (top / "p=1" / "data.txt").exists()
        c.drop_table("whole", "t")
        c.drop_database("whole", delete_data=True, cascade=True)


def test_the_daemon_down_fails_the_drop(hms: Hms) -> None:
    with hms.client() as c:
        top = partitioned(c, hms, "down", "t", ["1"])
        before = files_of(top)
        hms.daemon.stop()
        try:
            with pytest.raises(MetaException, match="unreachable"):
                c.drop_table("down", "t")
            with pytest.raises(MetaException, match="unreachable"):
                c.drop_partition("down", "t", ["1"])
            assert c.list_partition_names("down", "t") == ["p=1"]
        finally:
            hms.daemon.start()
    assert files_of(top) == before


def test_fail_open_drops_without_the_daemon(tmp_path: Path) -> None:
    h = start_hms(tmp_path, "--fail-open")
    try:
        with h.client() as c:
            top = partitioned(c, h, "open", "t", ["1"])
            h.daemon.stop()
            c.drop_table("open", "t")
            with pytest.raises(NoSuchObjectException):
                c.get_table("open", "t")
        assert not top.exists()
        assert "failOpen=true" in h.metastore.log.read_text()
    finally:
        h.metastore.stop()
        h.daemon.stop()


def test_a_refused_call_leaves_nothing_for_the_next_call_on_its_thread(hms: Hms) -> None:
    """A drop of p=1 and p=2 refused before anything moved (p=2 is located at the warehouse
    root), then, on the same connection (the same metastore thread), a drop of p=3: only
    p=3's files are taken; p=1, still in the catalog, keeps every file."""
    with hms.client() as c:
        top = partitioned(c, hms, "stale", "t", ["1", "3"])
        c.add_partition("stale", "t", ["2"], location=hms.warehouse)
        kept = files_of(top / "p=1")
        with pytest.raises(MetaException, match="warehouse root"):
            c.drop_partitions("stale", "t", ["p=1", "p=2"])
        since = hms.current()
        c.drop_partitions("stale", "t", ["p=3"])
        assert c.list_partition_names("stale", "t") == ["p=1", "p=2"]
    (event,) = hms.events(since)
    assert event["partitions"] == [{"p": "3"}]
    assert [f["path"] for f in event["files"]] == [str(top / "p=3" / "data.txt")]
    assert files_of(top / "p=1") == kept

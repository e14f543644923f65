"""Review 20: a hostile review of the cmroot Hive metastore plugin, in a real standalone Hive
2.3 metastore (the pyspark wheel's) driven by a bare Thrift client, against a real daemon.

Each test names the invariant it attacks and the sequence of metastore calls. Calls made on
one HmsClient go over one connection, which the metastore serves on one handler thread: that
is how the tests reach the plugin's per-thread Call state."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hmsclient.genthrift.hive_metastore.ttypes import (
    DropPartitionsRequest,
    EnvironmentContext,
    RequestPartsSpec,
)

from tests.metastore.conftest import Hms, metastore_conf, start_hms
from tests.metastore.hms import start_metastore
from tests.metastore.thrift_client import HmsClient, MetaException, NoSuchObjectException
from tests.server.cmroot_daemon import Daemon

pytestmark = pytest.mark.timeout(300)

COLUMNS = [("a", "string")]


@pytest.fixture(scope="module")
def hms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hms]:
    pytest.importorskip("pyspark")
    h = start_hms(tmp_path_factory.mktemp("review20"))
    try:
        yield h
    finally:
        h.metastore.stop()
        h.daemon.stop()


def files_of(top: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


def database(c: HmsClient, hms: Hms, db: str, location: Path | None = None) -> Path:
    loc = location or hms.warehouse / f"{db}.db"
    try:
        c.get_database(db)
    except NoSuchObjectException:
        c.create_database(db, loc)
    return loc


def table(c: HmsClient, hms: Hms, db: str, name: str, keys: list[str] | None = None,
          location: Path | None = None) -> Path:
    """A managed text table (partitioned by `keys`), in `db` (made under the warehouse)."""
    dbdir = database(c, hms, db)
    top = location or dbdir / name
    c.create_table(db, name, top, COLUMNS,
                   partition_keys=[(k, "string") for k in keys or []], file_format="text")
    return top


def add(c: HmsClient, db: str, name: str, values: list[str], text: str,
        location: Path | None = None) -> Path:
    """Add a partition and write one data file into the directory the metastore gave it."""
    part = c.add_partition(db, name, values, location)
    loc = part.sd.location
    d = Path(loc[len("file:"):] if loc.startswith("file:") else loc)
    if location is not None:
        d = location
    d.mkdir(parents=True, exist_ok=True)
    (d / "data.txt").write_text(text)
    return d


def drop_partitions_req(c: HmsClient, db: str, name: str, names: list[str],
                        delete_data: bool = True) -> Any:
    return c.client.drop_partitions_req(DropPartitionsRequest(
        dbName=db, tblName=name, parts=RequestPartsSpec(names=names),
        deleteData=delete_data, ifExists=False, needResult=True))


def kept(hms: Hms, events: list[dict[str, Any]]) -> dict[str, bytes]:
    """Every file the events carry, as the daemon serves it back."""
    return {f["path"]: hms.served(f["path"], f["checksum"])
            for e in events for f in e.get("files", [])}


def assert_kept_or_untouched(hms: Hms, before: dict[str, bytes], since: int) -> None:
    """Invariant 1: each file is where it was, or served back byte-identical by an event."""
    stored = kept(hms, hms.events(since))
    lost = {p for p, data in before.items()
            if not (Path(p).is_file() and Path(p).read_bytes() == data)
            and stored.get(p) != data}
    assert not lost, f"deleted and not kept: {sorted(lost)}; events {hms.events(since)}"


# -- findings -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["50%", "x=y"])
def test_a_partition_value_hive_escapes_is_kept(hms: Hms, value: str) -> None:
    """Invariant 1 (and 6). add_partition(value with '%' or '='), a data file in the
    directory the metastore made for it (p=50%25, p=x%3Dy), then drop_partition: the file is
    deleted by the metastore, so it must be in the store (or the drop refused)."""
    db = "esc"
    name = "pct" if "%" in value else "eq"
    with hms.client() as c:
        table(c, hms, db, name, ["p"])
        d = add(c, db, name, [value], f"row of {value}\n")
        assert d.is_dir() and "%" in d.name, d
        before = files_of(d)
        since = hms.current()
        try:
            c.drop_partition(db, name, [value])
        except MetaException:
            assert c.list_partition_names(db, name), "refused, yet the partition is gone"
    assert_kept_or_untouched(hms, before, since)


def test_two_partitions_whose_values_join_alike_are_both_kept(hms: Hms) -> None:
    """Invariant 1/2. A table partitioned by (k1, k2) with partitions ['a/b', 'c'] and
    ['a', 'b/c'] (each at its own plain directory), a file in each, dropped by ONE
    drop_partitions_req: the metastore deletes both directories, so both files must be kept
    and the recycle event must name both partitions."""
    db, name = "joins", "t"
    with hms.client() as c:
        top = table(c, hms, db, name, ["k1", "k2"])
        one = add(c, db, name, ["a/b", "c"], "first\n", top / "one")
        two = add(c, db, name, ["a", "b/c"], "second\n", top / "two")
        before = files_of(one) | files_of(two)
        since = hms.current()
        drop_partitions_req(c, db, name, ["k1=a%2Fb/k2=c", "k1=a/k2=b%2Fc"])
        assert c.list_partition_names(db, name) == []
    assert_kept_or_untouched(hms, before, since)
    parts = [p for e in hms.events(since) for p in e["partitions"]]
    assert sorted(map(str, parts)) == sorted(map(str, [
        {"k1": "a/b", "k2": "c"}, {"k1": "a", "k2": "b/c"}])), hms.events(since)


def test_a_metadata_only_drop_after_drop_partitions_req_is_recorded(hms: Hms) -> None:
    """Invariants 3, 5. On one connection: drop_partitions_req(p=1) with data (succeeds; its
    Call stays on the thread, settled, as drop_partitions_req has no end function), the
    partition added again, then drop_partition(p=1, deleteData=false). That second drop
    succeeded and must have its DROP_PARTITION event."""
    db, name = "meta", "t"
    with hms.client() as c:
        table(c, hms, db, name, ["p"])
        add(c, db, name, ["1"], "one\n")
        drop_partitions_req(c, db, name, ["p=1"])
        c.add_partition(db, name, ["1"])
        since = hms.current()
        assert c.drop_partition(db, name, ["1"], delete_data=False)
        assert c.list_partition_names(db, name) == []
    events = hms.events(since)
    assert [(e["eventType"], e["partitions"]) for e in events] == [
        ("DROP_PARTITION", [{"p": "1"}])], events


def test_drop_database_cascade_outside_the_roots_keeps_a_table_inside(
        hms: Hms, tmp_path: Path) -> None:
    """Invariant 1. A database located outside the warehouse roots holds a managed table
    located under a root, with data. drop_database(cascade, deleteData): the metastore drops
    the table without its data events and then deletes the table's directory (not below the
    database's); its files must be kept (or the drop refused)."""
    db = "outdb"
    with hms.client() as c:
        c.create_database(db, tmp_path / "outdb")
        top = hms.warehouse / "elsewhere" / "t"
        c.create_table(db, "t", top, COLUMNS, file_format="text")
        (top / "data.txt").write_text("inside the roots\n")
        before = files_of(top)
        since = hms.current()
        try:
            c.drop_database(db, delete_data=True, cascade=True)
        except MetaException:
            assert c.get_tables(db) == ["t"]
    assert_kept_or_untouched(hms, before, since)


def test_drop_database_keeps_another_databases_table_in_its_directory(hms: Hms) -> None:
    """Invariant 1. Database `hold` (no tables of its own) at <wh>/hold.db; database `guest`
    has a managed table located at <wh>/hold.db/g, with data. drop_database(hold,
    deleteData) deletes hold.db recursively: guest.g's file must be kept (or the drop
    refused)."""
    with hms.client() as c:
        database(c, hms, "hold")
        top = table(c, hms, "guest", "g", location=hms.warehouse / "hold.db" / "g")
        (top / "data.txt").write_text("a guest's row\n")
        before = files_of(top)
        since = hms.current()
        try:
            c.drop_database("hold", delete_data=True, cascade=False)
        except MetaException:
            assert c.get_database("hold").name == "hold"
        assert c.get_tables("guest") == ["g"]
    assert_kept_or_untouched(hms, before, since)


def test_a_slash_value_drop_leaves_the_partition_it_names_alike_alone(hms: Hms) -> None:
    """Invariants 1, 2, 6. Partition p='a' holds a file in a subdirectory b/ (p=a/b/x.txt);
    partition p='a/b' lives at the directory Hive escapes for it (p=a%2Fb). drop_partition of
    'a/b' deletes p=a%2Fb only: p='a' (still in the catalog) must keep p=a/b/x.txt in place,
    and p='a/b''s own file must be kept."""
    db, name = "slash", "t"
    with hms.client() as c:
        table(c, hms, db, name, ["p"])
        live = add(c, db, name, ["a"], "top of a\n")
        (live / "b").mkdir()
        (live / "b" / "x.txt").write_text("a row of partition a\n")
        gone = add(c, db, name, ["a/b"], "row of a/b\n")
        assert gone.name == "p=a%2Fb", gone
        live_before = files_of(live)
        before = files_of(gone)
        since = hms.current()
        c.drop_partition(db, name, ["a/b"])
        assert c.list_partition_names(db, name) == ["p=a"]
    events = hms.events(since)
    assert files_of(live) == live_before, f"a live partition's files were taken: {events}"
    assert_kept_or_untouched(hms, before, since)


def test_the_purge_flag_of_a_drop_partitions_req_and_of_auto_purge(hms: Hms) -> None:
    """Invariant 4. drop_partitions_req with EnvironmentContext {"ifPurge": "True"} (Hive
    reads it with Boolean.parseBoolean) records purge=true; a drop_partition without one of
    a table whose auto.purge is "TRUE" records purge=true; the same call on a plain table
    purge=false."""
    db = "purges"
    with hms.client() as c:
        database(c, hms, db)
        for name, params in (("req", {}), ("auto", {"auto.purge": "TRUE"}), ("plain", {})):
            c.create_table(db, name, hms.warehouse / f"{db}.db" / name, COLUMNS,
                           partition_keys=[("p", "string")], file_format="text",
                           parameters=params)
            add(c, db, name, ["1"], f"row of {name}\n")
        since = hms.current()
        c.client.drop_partitions_req(DropPartitionsRequest(
            dbName=db, tblName="req", parts=RequestPartsSpec(names=["p=1"]), deleteData=True,
            ifExists=False, needResult=True,
            environmentContext=EnvironmentContext(properties={"ifPurge": "True"})))
        c.drop_partition(db, "auto", ["1"])
        c.drop_partition(db, "plain", ["1"])
    assert [(e["table"], e["purge"], len(e["files"])) for e in hms.events(since)] == [
        ("req", True, 1), ("auto", True, 1), ("plain", False, 1)]


# -- faults between prepare and commit ------------------------------------------------------


class Paused:
    """A second daemon + metastore whose plugin pauses after each prepare (DIR/reached, then
    waits for DIR/go), with a short lease."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "pause"
        self.dir.mkdir(parents=True)
        (self.dir / "go").touch()  # not paused until a test asks for it
        self.base = base

    def start(self) -> Hms:
        daemon = Daemon(self.base).start()
        token = self.base / "plugin.token"
        token.write_text(daemon.tokens["write"] + "\n")
        conf = metastore_conf("--url", daemon.url, "--token-file", str(token))
        props = {**conf["properties"], "cmroot.lease": "5s",
                 "cmroot.test.pauseAfterPrepare": str(self.dir)}
        try:
            ms = start_metastore(self.base / "hms", daemon.warehouse, props, conf["classpath"])
        except BaseException:
            daemon.stop()
            raise
        return Hms(self.base, daemon, ms)

    def arm(self) -> None:
        for f in ("go", "reached"):
            (self.dir / f).unlink(missing_ok=True)

    def wait_reached(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not (self.dir / "reached").exists():
            assert time.monotonic() < deadline, "the plugin never reached its pause point"
            time.sleep(0.05)

    def go(self) -> None:
        (self.dir / "go").touch()


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Paused, Hms]]:
    pytest.importorskip("pyspark")
    p = Paused(tmp_path_factory.mktemp("review20-paused"))
    h = p.start()
    try:
        yield p, h
    finally:
        p.go()
        h.metastore.stop()
        h.daemon.stop()


def call_in_thread(fn: Any) -> tuple[Any, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_daemon_restarting_between_prepare_and_commit_loses_nothing(
        paused: tuple[Paused, Hms]) -> None:
    """Invariants 2, 7. drop_table pauses after its prepare; the daemon restarts (a second or
    two, well inside the 5 s lease); the call goes on. Either it completes (table gone, its
    file kept and served, one DROP_TABLE event) or it fails with the table and its file
    exactly as before. Never the table gone and its file back outside the catalog."""
    p, h = paused
    with h.client() as c:
        top = table(c, h, "rst", "t")
        (top / "data.txt").write_text("kept across a daemon restart\n")
        before = files_of(top)
        since = h.current()
        p.arm()
        with h.client() as dropper:
            t, out = call_in_thread(lambda: dropper.drop_table("rst", "t"))
            p.wait_reached()
            h.daemon.restart()
            p.go()
            t.join(120)
        assert not t.is_alive()
        try:
            c.get_table("rst", "t")
            present = True
        except NoSuchObjectException:
            present = False
    events = h.events(since)
    if present:
        assert "error" in out and files_of(top) == before, (out, events)
        assert events == []
    else:
        assert [e["eventType"] for e in events] == ["DROP_TABLE"], (out, events)
        assert_kept_or_untouched(h, before, since)
        assert not top.exists() or files_of(top) == {}, (
            f"table dropped but its files are back outside the catalog: {files_of(top)}")


def test_the_metastore_killed_after_prepare_gets_every_file_back(
        paused: tuple[Paused, Hms]) -> None:
    """Invariant 7. drop_partition pauses after its prepare; the metastore JVM is killed
    (kill -9) and restarted; once the 5 s lease passed, the daemon has put the files back:
    the partition is still in the catalog with its file, no event; a new drop then works and
    keeps the file."""
    p, h = paused
    with h.client() as c:
        table(c, h, "kill", "t", ["p"])
        d = add(c, "kill", "t", ["1"], "survives a crash\n")
    before = files_of(d)
    since = h.current()
    p.arm()
    dropper = h.client()
    t, _ = call_in_thread(lambda: dropper.drop_partition("kill", "t", ["1"]))
    p.wait_reached()
    h.metastore.kill()
    t.join(30)
    dropper.close()
    p.go()
    deadline = time.monotonic() + 60
    while files_of(d) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert files_of(d) == before, "the daemon did not put the staged file back"
    h.metastore.restart()
    with h.client() as c:
        assert c.list_partition_names("kill", "t") == ["p=1"]
        assert h.events(since) == []
        c.drop_partition("kill", "t", ["1"])
    (event,) = h.events(since)
    assert event["eventType"] == "DROP_PARTITION"
    assert_kept_or_untouched(h, before, since)

"""Review 20: a hostile review of the cmroot Hive metastore plugin, in a real standalone Hive
2.3 metastore (the pyspark wheel's) driven by a bare Thrift client, against a real daemon.

Each test names the invariant it attacks and the sequence of metastore calls. Calls made on
one HmsClient go over one connection, which the metastore serves on one handler thread: that
is how the tests reach the plugin's per-thread Call state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hmsclient.genthrift.hive_metastore.ttypes import DropPartitionsRequest, RequestPartsSpec

from tests.metastore.conftest import Hms, start_hms
from tests.metastore.thrift_client import HmsClient, MetaException, NoSuchObjectException

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


def test_a_refused_drop_partitions_req_leaks_its_plan_into_the_next_call(hms: Hms) -> None:
    """Invariants 5, 2, 3. On one connection: drop_partitions_req(p=1, p=9) where p=9 is
    located at the warehouse root, so cmroot's pre-event refuses it after p=1's pre-event
    planned p=1 (drop_partitions_req has no end function to clear that); then
    drop_partition(p=3). Only p=3 is dropped: p=1 must keep its file in its directory, and
    the event must name p=3 alone."""
    db, name = "leak", "t"
    with hms.client() as c:
        table(c, hms, db, name, ["p"])
        one = add(c, db, name, ["1"], "one\n")
        three = add(c, db, name, ["3"], "three\n")
        c.add_partition(db, name, ["9"], hms.warehouse)
        with pytest.raises(MetaException, match="cmroot refuses"):
            drop_partitions_req(c, db, name, ["p=1", "p=9"])
        assert c.list_partition_names(db, name) == ["p=1", "p=3", "p=9"]
        since = hms.current()
        c.drop_partition(db, name, ["3"])
        assert c.list_partition_names(db, name) == ["p=1", "p=9"]
    assert not three.exists()
    events = hms.events(since)
    assert [e["partitions"] for e in events] == [[{"p": "3"}]], events
    assert (one / "data.txt").read_text() == "one\n", "p=1 is in the catalog, its file gone"


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

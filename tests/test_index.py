"""The SQLite index on its own: journal, atomic recycle commits, object expiry upserts,
lookups, paging, retention queries, fsck helpers, the checksum cache, durability."""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot.index import Entry, Event, Index, StoredObject


def c(n: int) -> str:
    return cks.of_bytes(str(n).encode())


def entry(
    path: str,
    checksum: str,
    t: float = 100.0,
    retain: float = 50.0,
    size: int = 10,
    purge: bool = False,
    db: str | None = "db",
    table: str | None = "t",
    partition: dict[str, str] | None = None,
    op: str = "DROP_TABLE",
) -> Entry:
    return Entry(
        path=path,
        checksum=checksum,
        size=size,
        recycled=t,
        expires=t + retain,
        op=op,
        db=db,
        table=table,
        partition=partition,
        purge=purge,
    )


def event(op: str = "DROP_TABLE", t: float = 100.0, **kw) -> Event:
    return Event(
        id=0,
        type=op,
        db=kw.get("db", "db"),
        table=kw.get("table", "t"),
        partitions=kw.get("partitions", []),
        timestamp=t,
        server="host",
        purge=kw.get("purge", False),
        files=kw.get("files", []),
    )


@pytest.fixture
def index(tmp_path: Path):
    ix = Index(str(tmp_path / "index.sqlite"))
    yield ix
    ix.close()


def counts(ix: Index) -> dict[str, int]:
    return {
        t: ix._query(f"SELECT count(*) FROM {t}")[0][0]
        for t in ("objects", "entries", "events", "txs", "journal")
    }


def test_wal_and_full_sync(index: Index) -> None:
    assert index._query("PRAGMA journal_mode")[0][0] == "wal"
    assert index._query("PRAGMA synchronous")[0][0] == 2  # FULL


def test_journal_begin_pending_end(index: Index) -> None:
    rows = [(0, "/wh/a", "/st/staging/tx1/0", "rename"), (1, "/wh/b", "/st/staging/tx1/1", "copy")]
    index.journal_begin("tx1", 5.0, "move", {"paths": ["/wh"], "op": "DROP_TABLE"}, ["/wh"], rows)
    index.journal_begin(
        "tx0", 4.0, "copy", {"paths": ["/wh/c"]}, [], [(0, "/wh/c", "/s/0", "copy")]
    )
    pending = index.pending()
    assert [p.txid for p in pending] == ["tx0", "tx1"]  # oldest first
    p = pending[1]
    assert p.mode == "move" and p.started == 5.0 and p.state == "open" and p.dirs == ["/wh"]
    assert p.request == {"paths": ["/wh"], "op": "DROP_TABLE"}
    assert [(r.seq, r.source, r.staged, r.method) for r in p.rows] == rows
    index.journal_set_method("tx1", 0, "copy")
    assert [r.method for r in index.pending("tx1")[0].rows] == ["copy", "copy"]
    index.journal_end("tx1")
    index.journal_end("tx0")
    assert index.pending() == []
    assert counts(index)["journal"] == 0


def test_journal_begin_is_atomic(index: Index) -> None:
    # A duplicate seq fails the whole insert: no tx row without its journal rows.
    with pytest.raises(sqlite3.IntegrityError):
        index.journal_begin(
            "tx", 1.0, "move", {}, [], [(0, "/a", "/s/0", "rename"), (0, "/b", "/s/1", "rename")]
        )
    assert index.pending() == []


def test_commit_recycle_records_event_entries_objects_and_closes_journal(index: Index) -> None:
    index.journal_begin(
        "tx", 100.0, "move", {}, [], [(0, "/wh/a", "/s/0", "rename"), (1, "/wh/b", "/s/1", "copy")]
    )
    es = [entry("/wh/a", c(1), partition={"p": "1"}), entry("/wh/b", c(2), purge=True)]
    ev = event(partitions=[{"p": "1"}], files=[{"path": "/wh/a", "checksum": c(1), "size": 10}])
    eid = index.commit_recycle("tx", ev, es)
    assert eid == 1
    # Committed, with what clean-up needs, until the clean-up closes the record.
    [tx] = index.pending()
    assert tx.state == "committed"
    index.journal_end("tx")
    assert index.pending() == []
    got = index.entries()
    assert [e.path for e in got] == ["/wh/b", "/wh/a"]  # newest first
    a = got[1]
    assert (
        a.checksum,
        a.size,
        a.recycled,
        a.expires,
        a.op,
        a.db,
        a.table,
        a.partition,
        a.purge,
        a.event_id,
    ) == (c(1), 10, 100.0, 150.0, "DROP_TABLE", "db", "t", {"p": "1"}, False, eid)
    assert got[0].partition is None and got[0].purge is True
    o = index.get_object(c(1))
    assert o == StoredObject(c(1), 10, 100.0, 150.0, True, 100.0)
    assert index.get_object(c(2)).keep is False  # only purged entries: delete at expiry
    [e] = index.events()
    assert (e.id, e.type, e.partitions, e.files[0]["path"]) == (
        eid,
        "DROP_TABLE",
        [{"p": "1"}],
        "/wh/a",
    )
    assert e.to_json()["eventType"] == "DROP_TABLE"


def test_commit_recycle_is_atomic(index: Index) -> None:
    index.journal_begin("tx", 1.0, "move", {}, [], [(0, "/wh/a", "/s/0", "rename")])
    bad = entry("/wh/a", c(1))
    bad = Entry(**{**bad.__dict__, "size": None})  # NOT NULL violation mid-commit
    with pytest.raises(sqlite3.IntegrityError):
        index.commit_recycle("tx", event(), [entry("/wh/z", c(9)), bad])
    assert counts(index) == {"objects": 0, "entries": 0, "events": 0, "txs": 1, "journal": 1}


def test_object_expiry_is_the_newest_entry_and_keep_is_sticky(index: Index) -> None:
    index.commit_recycle(None, event(), [entry("/wh/a", c(1), t=100, retain=50, purge=False)])
    index.commit_recycle(None, event(), [entry("/wh/b", c(1), t=200, retain=50, purge=True)])
    o = index.get_object(c(1))
    assert (o.created, o.expires, o.keep) == (100, 250, True)
    # an older, shorter-retained recycle never shortens the expiry
    index.commit_recycle(None, event(), [entry("/wh/c", c(1), t=210, retain=1)])
    assert index.get_object(c(1)).expires == 250
    assert len(index.entries(checksum=c(1))) == 3
    assert index.stats()[0] == 1


def test_event_ids_strictly_increase_and_page(index: Index) -> None:
    ids = [index.add_event(event("CREATE_TABLE", t=i)) for i in range(5)]
    ids.append(index.commit_recycle(None, event(), [entry("/wh/a", c(1))]))
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert index.current_event_id() == ids[-1]
    assert [e.id for e in index.events(start=ids[2], limit=2)] == ids[2:4]
    assert [e.id for e in index.events(start=ids[-1] + 1)] == []


def test_event_ids_are_not_reused_after_deletion(tmp_path: Path) -> None:
    ix = Index(str(tmp_path / "i.sqlite"))
    last = ix.add_event(event())
    ix._db.execute("DELETE FROM events")
    assert ix.add_event(event()) > last  # AUTOINCREMENT: a reader never sees an id twice
    ix.close()


def test_recorded_needs_the_path_the_checksum_and_the_object(index: Index) -> None:
    index.commit_recycle(None, event(), [entry("/wh/a", c(1), size=7)])
    got = index.recorded([("/wh/a", c(1)), ("/wh/a", c(2)), ("/wh/other", c(1))])
    assert got == {("/wh/a", c(1)): 7}
    index.forget([c(1)])
    assert index.recorded([("/wh/a", c(1))]) == {}


def test_entries_filters_and_cursor_paging(index: Index) -> None:
    for i in range(25):
        index.commit_recycle(
            None,
            event(),
            [entry(f"/wh/{i}", c(i), db="a" if i % 2 else "b", table="t1" if i % 3 else "t2")],
        )
    all_ids = [e.id for e in index.entries(limit=1000)]
    assert all_ids == sorted(all_ids, reverse=True) and len(all_ids) == 25
    pages, cursor = [], None
    while page := index.entries(limit=10, cursor=cursor):
        pages.append([e.id for e in page])
        cursor = page[-1].id
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [i for page in pages for i in page] == all_ids
    a = index.entries(db="a", limit=1000)
    assert {e.db for e in a} == {"a"} and len(a) == 12
    at2 = index.entries(db="a", table="t2", limit=1000)
    assert {(e.db, e.table) for e in at2} == {("a", "t2")}
    assert {e.path for e in at2} == {f"/wh/{i}" for i in range(25) if i % 2 and not i % 3}
    assert [e.path for e in index.entries(checksum=c(3))] == ["/wh/3"]


def test_expired_pages_in_expiry_order_and_forget_expired_spares_reextended(index: Index) -> None:
    for i in range(7):
        index.commit_recycle(None, event(), [entry(f"/wh/{i}", c(i), t=100 + i, retain=10)])
    assert index.expired(now=109, limit=100) == []
    got = index.expired(now=112, limit=2)
    assert [o.checksum for o in got] == [c(0), c(1)]
    rest = index.expired(now=112, limit=100, after=(got[-1].expires, got[-1].checksum))
    assert [o.checksum for o in rest] == [c(2)]
    # c(1) is recycled again (a new entry extends it) after the sweep picked it
    index.commit_recycle(None, event(), [entry("/wh/again", c(1), t=300, retain=10)])
    index.forget_expired([c(0), c(1), c(2)], now=112)
    assert index.get_object(c(0)) is None and index.get_object(c(2)) is None
    assert index.get_object(c(1)).expires == 310
    assert {e.path for e in index.entries(checksum=c(1))} == {"/wh/1", "/wh/again"}
    assert index.entries(checksum=c(0)) == []


def test_expired_ties_on_expiry_page_by_checksum(index: Index) -> None:
    sums = sorted(c(i) for i in range(5))
    index.commit_recycle(
        None, event(), [entry(f"/wh/{i}", c(i), t=100, retain=1) for i in range(5)]
    )
    seen, after = [], None
    while page := index.expired(now=200, limit=2, after=after):
        seen += [o.checksum for o in page]
        after = (page[-1].expires, page[-1].checksum)
    assert seen == sums


def test_register_object_never_overwrites(index: Index) -> None:
    index.commit_recycle(None, event(), [entry("/wh/a", c(1), t=100, retain=50)])
    index.register_object(StoredObject(c(1), 99, 0.0, 1.0, False))
    assert index.get_object(c(1)).expires == 150
    index.register_object(StoredObject(c(2), 3, 5.0, 6.0, True))
    assert index.get_object(c(2)) == StoredObject(c(2), 3, 5.0, 6.0, True, 5.0)  # last: created
    assert set(index.objects_between("0", "g")) == {c(1), c(2)}


def test_stats_follow_inserts_upserts_and_deletes(index: Index) -> None:
    def truth() -> tuple[int, int]:
        n, b = index._query("SELECT count(*), coalesce(sum(size), 0) FROM objects")[0]
        return n, b

    index.commit_recycle(
        None, event(), [entry("/wh/a", c(1), size=10, t=50), entry("/wh/b", c(2), size=20, t=40)]
    )
    index.commit_recycle(None, event(), [entry("/wh/c", c(1), size=10)])  # upsert, not a new object
    index.register_object(StoredObject(c(3), 5, 30.0, 99.0, True))
    index.register_object(StoredObject(c(3), 5, 30.0, 99.0, True))  # ignored
    n, b, oldest = index.stats()
    assert (n, b) == truth() == (3, 35)
    assert oldest == 30.0
    index.forget([c(2)])
    index.forget_expired([c(3)], now=1000)
    assert index.stats()[:2] == truth() == (1, 10)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(
    st.tuples(st.just("recycle"), st.lists(st.tuples(st.integers(0, 12), st.integers(0, 9)),
                                           min_size=1, max_size=8)),
    st.tuples(st.just("register"), st.integers(0, 12)),
    st.tuples(st.just("forget"), st.lists(st.integers(0, 12), max_size=4)),
), max_size=12))
def test_stats_equal_a_count_after_any_sequence(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, object]]
) -> None:
    """Whatever mix of recycles (one object from several paths, objects already indexed),
    registrations and removals: the running totals are what counting would give."""
    index = Index(str(tmp_path_factory.mktemp("stats") / "i.sqlite"))
    try:
        for i, (kind, arg) in enumerate(steps):
            if kind == "recycle":
                index.commit_recycle(None, event(), [
                    entry(f"/wh/{i}/{j}", c(n), size=n + 1) for j, (n, _) in enumerate(arg)])
            elif kind == "register":
                index.register_object(StoredObject(c(arg), arg + 1, 1.0, 2.0, True))
            else:
                index.forget([c(n) for n in arg])
            assert index.stats()[:2] == tuple(index._query(
                "SELECT count(*), coalesce(sum(size), 0) FROM objects")[0])
    finally:
        index.close()


def test_checksum_cache(index: Index) -> None:
    assert "/wh/a" not in index.cached_checksums([("/wh/a", "1:2:3:1000:1000")])
    index.cache_checksums([("/wh/a", "1:2:3:1000:1000", c(1))])
    assert index.cached_checksums([("/wh/a", "1:2:3:1000:1000")]) == {"/wh/a": c(1)}
    # Any change of identity (here: ctime, which a writer cannot restore) misses.
    assert "/wh/a" not in index.cached_checksums([("/wh/a", "1:2:3:1000:1001")])
    index.cache_checksums([("/wh/a", "1:2:4:2000:2000", c(2))])  # replaced, not added
    assert index.cached_checksums([("/wh/a", "1:2:4:2000:2000")]) == {"/wh/a": c(2)}
    assert index._query("SELECT count(*) FROM checksums")[0][0] == 1
    index.cache_checksums([])


def test_checksum_cache_is_bounded(index: Index) -> None:
    index.cache_rows = 100
    for i in range(10):
        index.cache_checksums((f"/wh/{i}/{j}", "id", c(1)) for j in range(50))
    n = index._query("SELECT count(*) FROM checksums")[0][0]
    assert n <= 100
    # the newest rows are the ones kept
    assert index.cached_checksums([("/wh/9/49", "id")]) == {"/wh/9/49": c(1)}


def test_transaction_rolls_back_on_error(index: Index) -> None:
    with pytest.raises(RuntimeError), index.transaction() as db:
        db.execute("INSERT INTO objects VALUES (?, 1, 1, 1, 1, 1)", (c(1),))
        raise RuntimeError("boom")
    assert index.get_object(c(1)) is None
    # and the connection is usable afterwards
    index.register_object(StoredObject(c(1), 1, 1.0, 1.0, True))
    assert index.get_object(c(1)) is not None


def test_survives_reopen(tmp_path: Path) -> None:
    p = str(tmp_path / "i.sqlite")
    ix = Index(p)
    ix.journal_begin("tx", 1.0, "move", {"paths": ["/wh/x"]}, [], [(0, "/wh/x", "/s/0", "rename")])
    eid = ix.commit_recycle(
        None,
        event(partitions=[{"d": "2024-01-01"}]),
        [entry("/wh/a", c(1), partition={"d": "2024-01-01"})],
    )
    ix.close()
    ix = Index(p)
    assert [t.txid for t in ix.pending()] == ["tx"]
    assert ix.entries()[0].partition == {"d": "2024-01-01"}
    assert ix.events()[0].id == eid
    assert ix.get_object(c(1)) is not None
    ix.close()


def test_concurrent_commits_from_threads(index: Index) -> None:
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(30):
                index.commit_recycle(None, event(), [entry(f"/wh/{k}/{i}", c(i))])
                index.recorded([(f"/wh/{k}/{i}", c(i))])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert counts(index)["entries"] == 120
    assert counts(index)["events"] == 120
    assert counts(index)["objects"] == 30


def test_event_location_and_table_obj_round_trip(index: Index) -> None:
    obj = {"db": "db", "table": "t", "columns": [{"name": "a", "type": "int", "comment": None}]}
    plain = index.add_event(event("CREATE_DATABASE"))
    rich = index.add_event(
        Event(0, "CREATE_TABLE", "db", "t", [], 1.0, "host", location="/wh/db.db/t", table_obj=obj)
    )
    by_id = {e.id: e for e in index.events()}
    assert (by_id[plain].location, by_id[plain].table_obj) == (None, None)
    assert (by_id[rich].location, by_id[rich].table_obj) == ("/wh/db.db/t", obj)
    assert by_id[rich].to_json()["location"] == "/wh/db.db/t"
    assert by_id[rich].to_json()["tableObj"] == obj
    assert by_id[plain].to_json()["tableObj"] is None


def test_an_index_from_before_event_meta_is_migrated(tmp_path: Path) -> None:
    """An index written before events had a `meta` column opens, keeps its events and
    records the new fields."""
    p = str(tmp_path / "old.sqlite")
    old = sqlite3.connect(p)
    old.executescript(
        "CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, type TEXT NOT NULL,"
        " db TEXT, tbl TEXT, partitions TEXT NOT NULL, timestamp REAL NOT NULL,"
        " server TEXT NOT NULL, purge INTEGER NOT NULL, files TEXT NOT NULL);"
        "INSERT INTO events (type, db, tbl, partitions, timestamp, server, purge, files)"
        " VALUES ('DROP_TABLE', 'db', 't', '[]', 1.0, 'host', 0, '[]');"
    )
    old.commit()
    old.close()
    ix = Index(p)
    try:
        [before] = ix.events()
        assert (before.type, before.location, before.table_obj) == ("DROP_TABLE", None, None)
        new = ix.add_event(
            Event(0, "INSERT", "db", "t", [], 2.0, "host", location="/wh/t", table_obj={"a": 1})
        )
        assert [(e.id, e.location, e.table_obj) for e in ix.events()] == [
            (before.id, None, None),
            (new, "/wh/t", {"a": 1}),
        ]
    finally:
        ix.close()
    Index(p).close()  # a second open finds the column there and leaves it


def test_partition_locations_survive_a_table_obj_too_large_to_serve(index: Index) -> None:
    """A stored meta over the served limit is split without building its tableObj: the
    partition locations beside it come back whole, the tableObj as the omitted marker."""
    from cmroot.index.events import MAX_TABLE_OBJ, OMITTED

    places: list[str | None] = ["/w/db.db/t/p=1", "/w/landing/p2", None]
    big = {"blob": "x" * (MAX_TABLE_OBJ + 1)}
    parts = [{"p": "1"}, {"p": "2"}, {"p": "3"}]
    base = event("ADD_PARTITION", partitions=parts)
    small = index.add_event(replace(base, partition_locations=places))
    large = index.add_event(replace(base, partition_locations=places, table_obj=big,
                                    location="/w/db.db/t"))
    got = {e.id: e for e in index.events(small, 2)}
    assert got[small].partition_locations == places and got[small].table_obj is None
    assert got[large].partition_locations == places and got[large].location == "/w/db.db/t"
    assert got[large].table_obj is not None and set(got[large].table_obj) == {OMITTED}

"""Holds and the byte budget, on a real store with the daemon's clock injected.

A hold keeps everything recycled from a database (or one table) past its expiry and out of
the budget's evictions until it lapses or is released. The budget (`store.max_bytes`)
evicts the oldest objects first, never one recycled less than `store.min_retain` ago and
never a held one; a dry run names exactly what the real sweep then removes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from cmroot_testlib import Clock, Env, make_table, object_files, table_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, NotFound
from cmroot.store import RecycleRequest, Store

HOUR = 3600.0
DAY = 24 * HOUR


def drop(env: Env, store: Store, db: str, table: str, n: int = 2, size: int = 1000,
         seed: str | None = None) -> dict[str, bytes]:
    files = make_table(env.warehouse, db, table, [], files_per_partition=n, size=size,
                       rng=random.Random(seed or f"{db}.{table}.{env.clock()}"))
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, db, table))],
                                 op="DROP_TABLE", db=db, table=table))
    return files


def kept(store: Store, files: dict[str, bytes]) -> bool:
    """Whether every file is still served from the store, bytes verified."""
    res = store.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])
    return all(r.status == "cmroot" for r in res)


def gone(store: Store, files: dict[str, bytes]) -> bool:
    res = store.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])
    return all(r.status == "missing" for r in res)


# -- holds ------------------------------------------------------------------------------
def test_a_hold_keeps_a_table_past_expiry_until_released(env: Env, store: Store,
                                                         clock: Clock) -> None:
    held = drop(env, store, "sales", "orders")
    other_table = drop(env, store, "sales", "items")
    other_db = drop(env, store, "hr", "staff")
    hold = store.add_hold("Sales", "ORDERS", clock() + 7 * DAY, "incident 42")
    assert (hold.db, hold.table) == ("sales", "orders")  # names as the metastore keeps them
    clock.advance(2 * DAY)
    report = store.gc()
    assert kept(store, held)
    assert gone(store, other_table) and gone(store, other_db)
    assert (report.held_objects, report.held_bytes) == (2, 2000)
    assert report.removed_objects == 4
    assert store.gc().removed_objects == 0  # still held: a second sweep takes nothing
    store.remove_hold(hold.id)
    assert store.gc().removed_objects == 2 and gone(store, held)
    assert object_files(env) == []


def test_a_database_hold_covers_every_table_and_lapses_at_its_time(
    env: Env, store: Store, clock: Clock
) -> None:
    a = drop(env, store, "sales", "a")
    b = drop(env, store, "sales", "b")
    store.add_hold("sales", None, clock() + 3 * DAY, "audit")
    clock.advance(2 * DAY)
    store.gc()
    assert kept(store, a) and kept(store, b)
    clock.advance(DAY + 1)  # the hold lapsed
    assert store.holds() == [] and len(store.holds(everything=True)) == 1
    store.gc()
    assert gone(store, a) and gone(store, b)


def test_a_hold_keeps_an_object_shared_with_an_unheld_table(
    env: Env, store: Store, clock: Clock
) -> None:
    """Identical bytes recycled from a held and an unheld table are one object: it stays
    (a hold only ever keeps more), for both paths."""
    data = [b"same bytes in two tables" * 40]
    held = make_table(env.warehouse, "s", "held", [], 1, contents=data)
    loose = make_table(env.warehouse, "s", "loose", [], 1, contents=data)
    for t in ("held", "loose"):
        store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "s", t))],
                                     op="DROP_TABLE", db="s", table=t))
    store.add_hold("s", "held", clock() + 5 * DAY, "keep")
    clock.advance(2 * DAY)
    store.gc()
    assert kept(store, held) and kept(store, loose)


def test_entries_say_until_when_they_are_held(env: Env, store: Store, clock: Clock) -> None:
    drop(env, store, "sales", "orders")
    drop(env, store, "hr", "staff")
    until = clock() + 2 * DAY
    store.add_hold("sales", None, until - DAY, "short")
    store.add_hold("sales", "orders", until, "long")
    rows = store.listing()
    assert {(e["db"], e["held_until"]) for e in rows} == {("sales", until), ("hr", None)}


@pytest.mark.parametrize(
    ("db", "table", "until", "reason", "word"),
    [
        ("", None, DAY, "r", "bad db"),
        ("a.b", None, DAY, "r", "bad db"),
        ("a", "t/../x", DAY, "r", "bad table"),
        ("a", None, -1.0, "r", "bad until"),  # the past
        ("a", None, float("inf"), "r", "bad until"),
        ("a", None, float("nan"), "r", "bad until"),
        ("a", None, True, "r", "bad until"),
        ("a", None, DAY, "  ", "bad reason"),
        ("a", None, DAY, "x" * 1001, "bad reason"),
        (None, None, DAY, "r", "bad db"),
    ],
)
def test_bad_holds_are_refused_and_change_nothing(
    store: Store, clock: Clock, db: object, table: object, until: object, reason: str, word: str
) -> None:
    when = until if isinstance(until, bool) else clock() + float(until)  # type: ignore[arg-type]
    with pytest.raises(BadRequest) as e:
        store.add_hold(db, table, when, reason)
    assert e.value.message == word
    assert store.holds(everything=True) == []


def test_removing_an_unknown_hold_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.remove_hold(12345)


# -- the byte budget --------------------------------------------------------------------
def budget_store(env: Env, max_bytes: int, min_retain: str = "1h") -> Store:
    return env.open(CMROOT_STORE_MAX_BYTES=str(max_bytes), CMROOT_STORE_MIN_RETAIN=min_retain,
                    CMROOT_STORE_RETAIN="30d")


def test_over_budget_the_oldest_go_first_and_only_as_many_as_needed(
    env: Env, clock: Clock
) -> None:
    store = budget_store(env, 4000)
    tables = []
    for i in range(4):  # 4 tables of 2 x 1000 bytes, a day apart: 8000 bytes
        tables.append(drop(env, store, "db", f"t{i}"))
        clock.advance(DAY)
    dry = store.gc(dry_run=True)
    assert (dry.evicted_objects, dry.evicted_bytes, dry.over_budget_bytes) == (4, 4000, 0)
    report = store.gc()
    assert {r["checksum"] for r in report.removed} == {r["checksum"] for r in dry.removed}
    assert all(r["reason"] == "budget" for r in report.removed)
    assert (report.evicted_objects, report.over_budget_bytes) == (4, 0)
    assert gone(store, tables[0]) and gone(store, tables[1])
    assert kept(store, tables[2]) and kept(store, tables[3])
    assert store.index.stats()[1] == 4000


def test_the_budget_never_takes_what_is_younger_than_min_retain_or_held(
    env: Env, clock: Clock
) -> None:
    store = budget_store(env, 1000, min_retain="2d")
    old = drop(env, store, "db", "old")
    held = drop(env, store, "keep", "held")
    store.add_hold("keep", None, clock() + 30 * DAY, "legal")
    clock.advance(3 * DAY)
    young = drop(env, store, "db", "young")
    report = store.gc()
    assert gone(store, old) and kept(store, held) and kept(store, young)
    assert report.evicted_objects == 2
    assert report.over_budget_bytes == 4000 - 1000  # said, not silently exceeded
    assert store.gc(dry_run=True).over_budget_bytes == 3000


def test_no_budget_evicts_nothing(env: Env, store: Store, clock: Clock) -> None:
    drop(env, store, "db", "t", n=5)
    clock.advance(HOUR * 23)
    r = store.gc()
    assert (r.removed_objects, r.evicted_objects, r.budget_bytes, r.over_budget_bytes) == (
        0, 0, 0, 0)


# A recycle: (table number, file count, size, hours before the next step).
Step = tuple[int, int, int, int]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3), st.integers(1, 3000),
                             st.integers(0, 30)), min_size=1, max_size=10),
    budget=st.integers(1, 20_000),
    min_retain_h=st.integers(1, 48),
    held=st.sets(st.integers(0, 5), max_size=2),
)
def test_budget_invariants(
    tmp_path_factory: pytest.TempPathFactory, steps: list[Step], budget: int,
    min_retain_h: int, held: set[int],
) -> None:
    """Whatever was recycled when: nothing younger than min_retain goes, nothing held
    goes, what goes is older than anything evictable that stays, the store ends within
    budget unless only young or held objects are left, and the dry run named exactly what
    the sweep removed."""
    base = Path(tmp_path_factory.mktemp("budget"))
    clock = Clock()
    env = Env(base, base / "wh", base / "cmroot", base / "out", clock)
    env.warehouse.mkdir()
    store = budget_store(env, budget, f"{min_retain_h}h")
    try:
        when: dict[str, float] = {}  # checksum -> newest recycle
        tables: dict[str, int] = {}
        for n, (t, files, size, hours) in enumerate(steps):
            got = drop(env, store, "db", f"t{t}", n=files, size=size, seed=f"{n}")
            for b in got.values():
                when[cks.of_bytes(b)] = clock()
                tables.setdefault(cks.of_bytes(b), t)
            clock.advance(hours * HOUR)
        for t in held:
            store.add_hold("db", f"t{t}", clock() + 99 * DAY, "prop")
        held_sums = {c for c, t in tables.items() if t in held}
        dry = store.gc(dry_run=True)
        report = store.gc()
        removed = {r["checksum"] for r in report.removed}
        assert removed == {r["checksum"] for r in dry.removed}
        cutoff = clock() - min_retain_h * HOUR
        assert all(when[c] <= cutoff for c in removed)
        assert not removed & held_sums
        left = set(when) - removed
        evictable_left = [c for c in left if when[c] <= cutoff and c not in held_sums]
        if removed and evictable_left:
            assert max(when[c] for c in removed) <= min(when[c] for c in evictable_left)
        stored = store.index.stats()[1]
        assert report.over_budget_bytes == max(0, stored - budget)
        if stored > budget:
            assert not evictable_left
    finally:
        env.close_all()


# -- dry runs that name things ----------------------------------------------------------
def test_a_dry_run_names_tables_partitions_and_files(env: Env, store: Store, clock: Clock
                                                     ) -> None:
    files = make_table(env.warehouse, "sales", "orders", [{"day": "1"}, {"day": "2"}], 2,
                       size=100)
    marker = table_dir(env.warehouse, "sales", "orders") / "day=1" / "_SUCCESS"
    marker.write_bytes(b"")
    store.recycle(RecycleRequest(
        paths=[str(table_dir(env.warehouse, "sales", "orders"))], op="DROP_PARTITION",
        db="sales", table="orders", partitions=[{"day": "1"}, {"day": "2"}]))
    drop(env, store, "hr", "staff", n=1, size=50)
    clock.advance(2 * DAY)
    named = store.gc(dry_run=True, files=True).to_json()
    assert named["tables"] == [
        {"db": "sales", "table": "orders", "partition": "day=1", "files": 2, "bytes": 200},
        {"db": "sales", "table": "orders", "partition": "day=2", "files": 2, "bytes": 200},
        {"db": "hr", "table": "staff", "partition": None, "files": 1, "bytes": 50},
    ]
    assert sorted(f["path"] for f in named["files"]) == sorted(
        [*files, str(env.warehouse / "hr.db" / "staff" / "part-00000.parquet")])
    assert not named["files_truncated"] and not named["tables_truncated"]
    every = store.gc(dry_run=True, files=True, housekeeping=True).to_json()
    assert str(marker) in {f["path"] for f in every["files"]}
    assert every["tables"][0]["files"] == 3  # day=1 with its _SUCCESS
    assert "tables" not in store.gc().to_json()  # a real sweep reports counts only


@pytest.mark.parametrize("size", ["0.5B", "9" * 400, "inf", "-1", "1e3", "12 apples"])
def test_a_bad_budget_stops_the_start_naming_the_key(env: Env, size: str) -> None:
    from cmroot.exceptions import ConfigError

    with pytest.raises(ConfigError) as e:
        env.config(CMROOT_STORE_MAX_BYTES=size)
    assert "store.max_bytes" in e.value.message


def test_a_table_hold_covers_files_recycled_there_without_names(
    env: Env, store: Store, clock: Clock
) -> None:
    """A file system hook recycles with no db or table: a hold of the table still keeps
    what was under the table's directory, and a database hold what was under its own."""
    orders = make_table(env.warehouse, "sales", "orders", [{"p": "1"}], 1, size=10)
    items = make_table(env.warehouse, "sales", "items", [], 1, size=10)
    other = make_table(env.warehouse, "hr", "staff", [], 1, size=10)
    for f in (*orders, *items, *other):
        store.recycle(RecycleRequest(paths=[f], op="DELETE"))
    store.add_hold("sales", "orders", clock() + 5 * DAY, "by table")
    clock.advance(2 * DAY)
    store.gc()
    assert kept(store, orders) and gone(store, items) and gone(store, other)
    assert [e["held_until"] is not None for e in store.listing()] == [True]

"""Hostile review 25: holds and the byte budget (issue 15, commit 5bada72).

Every attack goes through a public surface: the Store API with the daemon's clock injected,
the real daemon over HTTP, or the CLI as a subprocess. A test that fails on 5bada72 shows a
break of the contract; one that passes is an attack the code held against.

Contract (from the brief): 1 no loss (expiry after `retain`, the budget never takes young,
held, or more than needed, oldest first); 2 holds (db or db.table, case-insensitive) keep
every object with an entry of a held table, and an object recycled again after a sweep
picked it is not removed by that sweep; 3 dry runs name exactly what the sweep removes;
4 bad input gets a clear 4xx / one-line exit-2 error and changes nothing; 5 reports and
metrics tell the truth; 6 the 5 -> 6 migration keeps everything and computes `last`;
7 sweeps racing recycles, dedups and holds remove nothing that should stay."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import Clock, Env, object_files, table_dir, write_file
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cmroot.store.layout.local as local_layout
from cmroot import checksum as cks
from cmroot.index import schema as index_schema
from cmroot.metrics import StoreCollector
from cmroot.store import RecycleRequest, Store
from tests.server.cmroot_daemon import Daemon, MakeDaemon, assert_error, clean_env, write_files
from tests.server.test_holds_api import metric, served

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0
DAY = 24 * HOUR


# -- helpers ------------------------------------------------------------------------------
def new_env(base: Path) -> Env:
    env = Env(base, base / "warehouse", base / "cmroot", base / "outside", Clock())
    env.warehouse.mkdir(parents=True)
    env.outside.mkdir(parents=True)
    return env


def drop_bytes(
    store: Store, env: Env, db: str, table: str, files: dict[str, bytes], **req: Any
) -> dict[str, bytes]:
    """Write {name: bytes} into <warehouse>/<lower db>.db/<lower table>/ and recycle the
    table's directory as DROP_TABLE of (db, table) as given (any case)."""
    tdir = table_dir(env.warehouse, db.lower(), table.lower())
    out = {str(write_file(tdir / name, data)): data for name, data in files.items()}
    store.recycle(RecycleRequest(paths=[str(tdir)], op="DROP_TABLE", db=db, table=table, **req))
    return out


def statuses(store: Store, files: dict[str, bytes]) -> list[str]:
    res = store.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])
    return [r.status for r in res]


def served_from_store(store: Store, files: dict[str, bytes]) -> bool:
    return all(s == "cmroot" for s in statuses(store, files))


def index_objects(env: Env) -> dict[str, tuple[int, float, float]]:
    con = sqlite3.connect(f"file:{env.index_path}?mode=ro", uri=True)
    try:
        return {
            c: (s, e, last)
            for c, s, e, last in con.execute("SELECT checksum, size, expires, last FROM objects")
        }
    finally:
        con.close()


def gauges(store: Store) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in StoreCollector(store).collect()}


# == 1. The sweep against a model of the contract =========================================
# Content pool: identical bytes recycled from several tables, or the same table again,
# are one object (dedup); sizes differ so that "only as many as needed" is visible.
POOL = [random.Random(i).randbytes(100 * (i + 1)) for i in range(6)]
TABLES = [("d0", "t0"), ("d0", "t1"), ("d1", "t2"), ("d1", "t3")]
OVERRIDE = ("d1.t3", 4 * HOUR)  # retain_overrides: a per-table retention
RETAIN = 12 * HOUR

Op = tuple[Any, ...]
_drop = st.tuples(
    st.just("drop"),
    st.integers(0, 3),
    st.sets(st.integers(0, 5), min_size=1, max_size=3),
    st.booleans(),
)
_advance = st.tuples(st.just("advance"), st.integers(1, 10))
_hold = st.tuples(
    st.just("hold"), st.integers(0, 3), st.booleans(), st.integers(4, 60), st.booleans()
)
ops = st.one_of(
    _drop,
    _drop,
    _drop,
    _advance,
    _advance,
    _advance,
    _hold,
    _hold,
    st.tuples(st.just("unhold"), st.integers(0, 5)),
    st.tuples(
        st.just("sweep"),
    ),
)


class Model:
    """What the contract says the store holds, per object: size, newest recycle, expiry,
    and the (db, table) pairs of its entries (lowercased)."""

    def __init__(self, budget: int, min_retain: float) -> None:
        self.budget = budget
        self.min_retain = min_retain
        self.objects: dict[str, dict[str, Any]] = {}
        self.holds: dict[int, tuple[str, str | None, float]] = {}

    def recycled(self, checksum: str, size: int, db: str, table: str, now: float) -> None:
        """`db`, `table` as the request gave them: retain_overrides and holds both match
        them case-insensitively (see test_retain_override_is_case_sensitive_unlike_holds)."""
        retain = OVERRIDE[1] if f"{db}.{table}".lower() == OVERRIDE[0] else RETAIN
        o = self.objects.setdefault(
            checksum, {"size": size, "last": now, "expires": 0.0, "tables": set()}
        )
        o["last"] = max(o["last"], now)
        o["expires"] = max(o["expires"], now + retain)
        o["tables"].add((db.lower(), table.lower()))

    def held(self, checksum: str, now: float) -> bool:
        return any(
            until > now
            and any(
                d == hdb and (ht is None or t == ht) for d, t in self.objects[checksum]["tables"]
            )
            for hdb, ht, until in self.holds.values()
        )

    def sweep(self, now: float) -> dict[str, Any]:
        objs = self.objects
        expired = {c for c, o in objs.items() if o["expires"] <= now and not self.held(c, now)}
        stored = sum(o["size"] for c, o in objs.items() if c not in expired)
        evicted: list[str] = []
        if self.budget and stored > self.budget:
            cutoff = now - self.min_retain
            cands = sorted(
                (o["last"], c)
                for c, o in objs.items()
                if c not in expired
                and o["last"] <= cutoff
                and o["expires"] > now
                and not self.held(c, now)
            )
            for _, c in cands:
                if stored <= self.budget:
                    break
                evicted.append(c)
                stored -= objs[c]["size"]
        held = [c for c, o in objs.items() if o["expires"] <= now and self.held(c, now)]
        out = {
            "removed": expired | set(evicted),
            "evicted": set(evicted),
            "removed_bytes": sum(objs[c]["size"] for c in expired | set(evicted)),
            "evicted_bytes": sum(objs[c]["size"] for c in evicted),
            "held": (len(held), sum(objs[c]["size"] for c in held)),
            "over": max(0, stored - self.budget) if self.budget else 0,
        }
        return out

    def forget(self, checksums: set[str]) -> None:
        for c in checksums:
            del self.objects[c]


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    steps=st.lists(ops, min_size=15, max_size=40),
    budget=st.sampled_from([0, 150, 400, 900, 1500]),
    min_retain_h=st.sampled_from([1, 2, 6]),
)
def test_sweeps_match_the_contract_model(
    tmp_path_factory: pytest.TempPathFactory, steps: list[Op], budget: int, min_retain_h: int
) -> None:
    """Drops (with dedup across tables and of the same path again), clock steps, holds
    (db or table, mixed case, lapsing, removed) and sweeps in any order: every sweep
    removes exactly the model's set (expired and unheld, then the oldest evictable until
    within budget), its dry run names the same set, its report's counts, bytes, held and
    over-budget figures and the store gauges agree, and the objects on disk are the
    model's."""
    env = new_env(Path(tmp_path_factory.mktemp("model")))
    store = env.open(
        CMROOT_STORE_MAX_BYTES=str(budget),
        CMROOT_STORE_MIN_RETAIN=f"{min_retain_h}h",
        CMROOT_STORE_RETAIN=f"{RETAIN / HOUR:g}h",
        CMROOT_STORE_RETAIN_OVERRIDES=f"{OVERRIDE[0]}={OVERRIDE[1] / HOUR:g}h",
    )
    model = Model(budget, min_retain_h * HOUR)
    try:
        for step in [*steps, ("sweep",)]:
            kind = step[0]
            if kind == "drop":
                _, t, contents, upper = step
                db, table = TABLES[t]
                asked = db.upper() if upper else db
                got = drop_bytes(
                    store,
                    env,
                    asked,
                    table,
                    {f"part-{i}.parquet": POOL[i] for i in sorted(contents)},
                )
                for data in got.values():
                    model.recycled(cks.of_bytes(data), len(data), asked, table, env.clock())
            elif kind == "advance":
                env.clock.advance(step[1] * HOUR)
            elif kind == "hold":
                _, t, whole_db, hours, upper = step
                db, table = TABLES[t]
                h = store.add_hold(
                    db.upper() if upper else db,
                    None if whole_db else (table.upper() if upper else table),
                    env.clock() + hours * HOUR,
                    "model",
                )
                model.holds[h.id] = (db, None if whole_db else table, h.until)
            elif kind == "unhold":
                ids = sorted(model.holds)
                if ids:
                    hid = ids[step[1] % len(ids)]
                    store.remove_hold(hid)
                    del model.holds[hid]
            else:
                now = env.clock()
                want = model.sweep(now)
                dry = store.gc(dry_run=True)
                real = store.gc()
                for name, r in (("dry run", dry), ("sweep", real)):
                    got = {x["checksum"] for x in r.removed}
                    assert got == want["removed"], (name, step)
                    assert {x["checksum"] for x in r.removed if x["reason"] == "budget"} == want[
                        "evicted"
                    ], name
                    assert (r.removed_objects, r.removed_bytes) == (
                        len(want["removed"]),
                        want["removed_bytes"],
                    ), name
                    assert (r.evicted_objects, r.evicted_bytes) == (
                        len(want["evicted"]),
                        want["evicted_bytes"],
                    ), name
                    assert (r.held_objects, r.held_bytes) == want["held"], name
                    assert r.over_budget_bytes == want["over"], name
                    assert r.budget_bytes == budget and r.failed == 0 and r.skipped == 0
                event(f"evicted>0: {bool(want['evicted'])}")
                event(f"held>0: {bool(want['held'][0])}")
                event(f"over>0: {bool(want['over'])}")
                model.forget(want["removed"])
                on_disk = {p.name for p in object_files(env)}
                assert on_disk == set(model.objects), "objects on disk are not the model's"
                assert set(index_objects(env)) == set(model.objects)
                for e in store.listing(limit=1000):
                    active = [
                        u
                        for hdb, ht, u in model.holds.values()
                        if u > now
                        and hdb == (e["db"] or "").lower()
                        and (ht is None or ht == (e["table"] or "").lower())
                    ]
                    assert e["held_until"] == (max(active) if active else None), e
                g = gauges(store)
                assert g["cmroot_store_bytes"] == sum(o["size"] for o in model.objects.values())
                assert g["cmroot_store_over_budget_bytes"] == want["over"]
                assert (g["cmroot_held_objects"], g["cmroot_held_bytes"]) == want["held"]
                assert g["cmroot_holds"] == sum(1 for *_, u in model.holds.values() if u > now)
    finally:
        env.close_all()


# == 2. Holds that do not keep what they say =============================================
def test_a_hold_added_while_a_sweep_removes_its_page_binds_the_rest_of_the_sweep(
    env: Env, store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 2/7. A sweep checks holds once per page, then unlinks up to 2000 objects.
    A hold asked for while that loop runs must not be acknowledged while the page still
    deletes what it covers: once `add_hold` returns, nothing it holds goes. Sequence: s.a
    and s.b expire; the sweep starts unlinking; after its first unlink another thread asks
    for a hold on s (given half a second to be granted); every unlink is logged, and none
    of s's objects may be unlinked after the hold was acknowledged."""
    drop_bytes(store, env, "s", "a", {"part-0": b"a" * 100})
    drop_bytes(store, env, "s", "b", {"part-0": b"b" * 100})
    clock.advance(2 * DAY)
    real_unlink = os.unlink
    log: list[str] = []
    threads: list[threading.Thread] = []

    def hold() -> None:
        store.add_hold("s", None, clock() + 7 * DAY, "legal hold")
        log.append("hold acknowledged")

    def unlink(path: Any, *args: Any, **kw: Any) -> None:
        real_unlink(path, *args, **kw)
        if str(env.objects_dir) in str(path):
            log.append("unlinked")
            if not threads:
                threads.append(threading.Thread(target=hold))
                threads[0].start()
                threads[0].join(0.5)  # the old code acknowledged it here, mid-page

    with monkeypatch.context() as m:
        m.setattr(local_layout.os, "unlink", unlink)
        store.gc()
    threads[0].join(30)
    assert "hold acknowledged" in log
    assert "unlinked" not in log[log.index("hold acknowledged"):], log


def test_table_hold_keeps_files_recycled_from_the_tables_directory_without_names(
    env: Env, store: Store, clock: Clock
) -> None:
    """Invariant 2 (gap). The fsspec hook (cmroot/hooks/fsspec.py `_prepare`: op only) and
    `cmroot recycle` without --db/--table record entries with db and table NULL, even for
    files under <warehouse>/sales.db/orders/. `cmroot hold add sales.orders` (or `sales`)
    matches entries by their db/tbl columns only (`_HELD`), so those files of the held
    table expire and are deleted while the hold is in force; `cmroot ls` shows them with
    no `held to`, and `hold add` gives no warning."""
    tdir = table_dir(env.warehouse, "sales", "orders") / "p=1"
    files = {str(write_file(tdir / "part-0.parquet", b"orders p=1" * 50)): b"orders p=1" * 50}
    store.recycle(RecycleRequest(paths=[str(tdir)], op="DELETE"))  # as the fsspec hook
    store.add_hold("sales", "orders", clock() + 30 * DAY, "incident 99: keep orders")
    store.add_hold("sales", None, clock() + 30 * DAY, "and the whole database")
    clock.advance(2 * DAY)
    report = store.gc()
    assert served_from_store(store, files), (
        f"a file recycled from {tdir} was swept (removed {report.removed_objects}) while"
        " holds on sales.orders and sales were in force"
    )


# == 3. Reports that lie ==================================================================
def test_dry_run_counts_one_file_recycled_twice_as_two(
    env: Env, store: Store, clock: Clock
) -> None:
    """Invariant 5. One file, recycled twice with the same bytes (restored and dropped
    again; every empty `_SUCCESS` is the same object too), is one object of 1000 bytes.
    A dry run names 'sales.orders: 2 files, 2000 bytes' (and lists the path twice with
    --files): `SweepReport.name` counts entries (cmroot/store/sweep.py `name`), not files,
    so per-table bytes exceed what the sweep frees."""
    path = table_dir(env.warehouse, "sales", "orders") / "part-0.parquet"
    for _ in range(2):
        write_file(path, b"x" * 1000)
        store.recycle(
            RecycleRequest(paths=[str(path.parent)], op="DROP_TABLE", db="sales", table="orders")
        )
        clock.advance(60)
    clock.advance(2 * DAY)
    named = store.gc(dry_run=True, files=True).to_json()
    assert named["removed_bytes"] == 1000
    assert named["tables"] == [
        {"db": "sales", "table": "orders", "partition": None, "files": 1, "bytes": 1000}
    ], named["tables"]
    assert [f["path"] for f in named["files"]] == [str(path)]


def test_retain_override_is_case_sensitive_unlike_holds(env: Env, clock: Clock) -> None:
    """Invariant 1 (pre-existing: `StoreConfig.retain_for`, not changed by 5bada72, but
    now beside holds that match names case-insensitively). With retain_overrides
    `finance.*=30d` and retain 24h, a recycle that names the database `FINANCE` gets 24h:
    two days later the sweep deletes it, 28 days early. A hold on `finance` would have
    matched it; the override does not."""
    store = env.open(CMROOT_STORE_RETAIN_OVERRIDES="finance.*=30d")
    files = drop_bytes(store, env, "FINANCE", "Ledger", {"part-0": b"ledger" * 100})
    clock.advance(2 * DAY)
    report = store.gc()
    assert served_from_store(store, files), (
        f"finance.ledger (recycled as FINANCE.Ledger) swept after 2 days despite"
        f" finance.*=30d (removed {report.removed_objects})"
    )


# == 4. Races: sweeps against recycles, dedups and holds ==================================
def test_sweeps_racing_rerecycles_of_identical_bytes_keep_every_new_recycle(
    env: Env, clock: Clock
) -> None:
    """Invariant 7. Old objects (expired ones and budget-evictable ones) are recycled again
    (identical bytes, other tables: dedup) by 3 threads, plain and two-phase (prepare,
    whose publish-ahead claims, then commit), while a thread sweeps in a loop, the clock
    fixed: every recycle made during the race is newer than every sweep's cutoff and
    expiry, so each must end served from the store, and the index and the objects on
    disk must agree."""
    store = env.open(
        CMROOT_STORE_MAX_BYTES="1",
        CMROOT_STORE_MIN_RETAIN="1h",
        CMROOT_STORE_RETAIN="2d",
        CMROOT_STORE_RETAIN_OVERRIDES="old.exp=2h",
    )
    contents = [random.Random(f"race{i}").randbytes(200 + i) for i in range(12)]
    drop_bytes(store, env, "old", "exp", {f"p{i}": c for i, c in enumerate(contents[:6])})
    drop_bytes(store, env, "old", "ev", {f"p{i}": c for i, c in enumerate(contents[6:])})
    clock.advance(3 * HOUR)  # the first 6 expired, the last 6 evictable (over budget)
    again: list[dict[str, bytes]] = []
    errors: list[BaseException] = []
    removed = [0]
    stop = threading.Event()

    def recycler(n: int) -> None:
        try:
            for k in range(6):
                table = f"r{n}_{k}"
                files = {f"p{i}": contents[(n * 5 + k * 7 + i) % 12] for i in range(3)}
                if n == 2:  # two-phase
                    tdir = table_dir(env.warehouse, "new", table)
                    got = {str(write_file(tdir / name, b)): b for name, b in files.items()}
                    tx = store.prepare(
                        RecycleRequest(paths=[str(tdir)], op="DROP_TABLE", db="new", table=table)
                    )
                    store.commit(tx.txid)
                else:
                    got = drop_bytes(store, env, "new", table, files)
                again.append(got)
        except BaseException as e:
            errors.append(e)

    def sweeper() -> None:
        try:
            while not stop.is_set():
                removed[0] += store.gc().removed_objects
        except BaseException as e:
            errors.append(e)

    sweep_thread = threading.Thread(target=sweeper)
    recyclers = [threading.Thread(target=recycler, args=(n,)) for n in range(3)]
    sweep_thread.start()
    for t in recyclers:
        t.start()
    for t in recyclers:
        t.join()
    stop.set()
    sweep_thread.join()
    assert not errors, errors
    removed[0] += store.gc().removed_objects  # same clock: nothing recycled since may go
    assert removed[0] >= 1  # the sweeps did take old objects meanwhile
    lost = [
        p for got in again for p, s in zip(got, statuses(store, got), strict=True) if s != "cmroot"
    ]
    assert not lost, f"recycled during the race, then swept: {lost[:3]}"
    assert {p.name for p in object_files(env)} == set(index_objects(env))


def test_sweep_racing_hold_additions_keeps_what_held_before_it_expired(
    env: Env, store: Store, clock: Clock
) -> None:
    """Invariant 7 (what the README promises: a hold binds every sweep that starts after
    it is added). Tables h.t<i> and their unheld twins u.t<i> are recycled an hour apart;
    while a thread sweeps in a loop, the main thread grants a hold on h.t<i> (mixed case)
    and then moves the clock an hour on, so that t<i> expires: any sweep that sees it
    expired started after its hold. Every held table stays; every twin goes."""
    n = 10
    held, loose = {}, {}
    for i in range(n):
        held[i] = drop_bytes(store, env, "h", f"t{i}", {"p": f"h{i}".encode() * 40})
        loose[i] = drop_bytes(store, env, "u", f"t{i}", {"p": f"u{i}".encode() * 40})
        clock.advance(HOUR)
    t0 = clock() - n * HOUR
    clock.set(t0 + DAY - HOUR / 2)  # nothing expired yet; t0 expires at the next step
    stop = threading.Event()
    errors: list[BaseException] = []
    sweeps = [0]

    def sweeper() -> None:
        try:
            while not stop.is_set():
                store.gc()
                sweeps[0] += 1
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=sweeper)
    th.start()
    try:
        for i in range(n):
            store.add_hold("H", f"T{i}", clock() + 30 * DAY, "race")
            clock.advance(HOUR)
            t = time.monotonic()
            while sweeps[0] < 2 * (i + 1) and time.monotonic() - t < 5:
                time.sleep(0.001)  # let the sweeper run against this step
    finally:
        stop.set()
        th.join()
    assert not errors, errors
    store.gc()
    lost = [i for i in range(n) if not served_from_store(store, held[i])]
    assert not lost, f"held before they expired, then swept: h.t{lost}"
    assert all(statuses(store, loose[i]) == ["missing"] for i in range(n))


# == 5. Migration: an index written by the schema 5 code =================================
OLD_WRITER = r"""
import os, sys
from pathlib import Path
from cmroot import config as cfgmod
from cmroot.store import RecycleRequest, Store
from cmroot.index import schema
assert schema.VERSION == 5, schema.VERSION
wh = Path(sys.argv[1])
t = [1_700_000_000.0]
store = Store.open(cfgmod.load(None, env=dict(os.environ)), clock=lambda: t[0])
def drop(table, files):
    d = wh / "db.db" / table
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    store.recycle(RecycleRequest(paths=[str(d)], op="DROP_TABLE", db="db", table=table))
X, Y, Z = b"x" * 300, b"y" * 400, b"z" * 500
drop("a", {"x": X, "z": Z})   # t0
t[0] += 3600
drop("b", {"y": Y})           # t0 + 1h
t[0] += 3600
drop("c", {"x": X})           # t0 + 2h: X again (dedup): created t0, last t0 + 2h
store.close()
"""


def test_schema5_index_written_by_the_previous_release_migrates(tmp_path: Path) -> None:
    """Invariant 6. The parent commit's own code writes a schema-5 index (an object
    recycled at t0 and again at t0+2h); this code opens it: the current version, every object and
    entry kept, `last` the newest recycle (not the creation), and the budget then evicts
    by `last`: Z (t0) and Y (t0+1h) go before X (created t0, last t0+2h)."""
    old = tmp_path / "old"
    old.mkdir()
    got = subprocess.run(
        ["git", "-C", str(REPO), "archive", "5bada72^", "cmroot"], capture_output=True
    )
    if got.returncode:
        pytest.skip("needs the repository's history (commit 5bada72^: the schema-5 code)")
    archive = got.stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    env = new_env(tmp_path / "lake")
    envvars = {**clean_env(), **env.env(CMROOT_STORE_RETAIN="30d"), "PYTHONPATH": str(old)}
    r = subprocess.run(
        [sys.executable, "-c", OLD_WRITER, str(env.warehouse)],
        env=envvars,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=old,
    )
    assert r.returncode == 0, r.stderr
    con = sqlite3.connect(env.index_path)
    before = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("objects", "entries", "events")
    }
    assert con.execute("PRAGMA user_version").fetchone()[0] == 5
    con.close()
    t0 = 1_700_000_000.0
    env.clock.set(t0 + 5 * HOUR)
    store = env.open(
        CMROOT_STORE_RETAIN="30d", CMROOT_STORE_MAX_BYTES="400", CMROOT_STORE_MIN_RETAIN="1h"
    )
    con = sqlite3.connect(env.index_path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == index_schema.VERSION
    after = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("objects", "entries", "events")
    }
    con.close()
    assert after == before
    x, y, z = (cks.of_bytes(b) for b in (b"x" * 300, b"y" * 400, b"z" * 500))
    objs = index_objects(env)
    assert {c: o[2] for c, o in objs.items()} == {x: t0 + 2 * HOUR, y: t0 + HOUR, z: t0}
    report = store.gc()
    assert {r["checksum"] for r in report.removed} == {z, y}
    assert set(index_objects(env)) == {x} and report.over_budget_bytes == 0


# == 6. The daemon: reload, ids, auth, bad input ==========================================
def _config_with(d: Daemon, store_keys: str) -> None:
    """The daemon's config file with `store_keys` added to its [store] section."""
    d.write_config()
    text = d.config_path.read_text()
    head, tail = text.split("[auth]\n", 1)
    d.config_path.write_text(head + store_keys + "[auth]\n" + tail)


def _drop_http(d: Daemon, db: str, table: str, size: int = 600) -> dict[str, bytes]:
    tdir = d.warehouse / f"{db}.db" / table
    files = write_files(tdir, {"part-0.parquet": f"{db}.{table}".encode().ljust(size)})
    r = d.request(
        "POST", "/v1/recycle", {"paths": [str(tdir)], "op": "DROP_TABLE", "db": db, "table": table}
    )
    assert r.status == 200, r
    return files


def _wait_reloaded(d: Daemon, before: int) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        recs = [
            r
            for r in d.log_records()
            if r.get("msg") in ("reloaded", "reload failed; keeping the current settings")
        ]
        if len(recs) > before:
            assert recs[-1]["msg"] == "reloaded", recs[-1]
            return
        time.sleep(0.05)
    raise AssertionError("no reload logged")


def test_sighup_reload_applies_the_byte_budget_settings(make_daemon: MakeDaemon) -> None:
    """Invariant 1 (and the README: `systemctl reload cmrootd` re-reads retention settings).
    The operator raises store.min_retain to 30d (and max_bytes to 2000) and reloads; the
    daemon logs 'reloaded', yet `_reload` (cmroot/server/main.py) copies only retain,
    interval, on_expire and retain_overrides into the store: the next sweep still uses
    max_bytes 1000 and min_retain 1s and evicts a file recycled seconds ago."""
    d = make_daemon(start=False)
    _config_with(d, 'retain = "30d"\nmax_bytes = 1000\nmin_retain = "1s"\n')
    d.start()
    first = _drop_http(d, "db", "first")
    second = _drop_http(d, "db", "second")
    _config_with(d, 'retain = "30d"\nmax_bytes = 2000\nmin_retain = "30d"\n')
    d.signal(signal.SIGHUP)
    _wait_reloaded(d, 0)
    time.sleep(1.3)  # older than the old min_retain, far younger than the new one
    report = d.request("POST", "/v1/gc").json()
    budget_metric = metric(d, "cmroot_store_budget_bytes")
    assert (report["budget_bytes"], budget_metric) == (2000, 2000), (report, budget_metric)
    assert report["evicted_objects"] == 0, report
    assert served(d, first) and served(d, second)


def test_delete_hold_with_a_non_ascii_digit_id_is_a_500(daemon: Daemon) -> None:
    """Invariant 4. `remove_hold` (cmroot/server/app.py) checks `raw.isdigit()`, which is
    true for '²' or '①', then calls int(raw): ValueError, answered 500 'internal error'
    with a traceback in the log."""
    r = daemon.request("POST", "/v1/holds", {"db": "a", "until": time.time() + 3600, "reason": "r"})
    assert r.status == 200, r
    for raw in ("%C2%B2", "%E2%91%A0"):  # '²', '①'
        assert_error(daemon.request("DELETE", f"/v1/holds/{raw}"), 400, "hold id")
    assert len(daemon.request("GET", "/v1/holds", scope="read").json()["holds"]) == 1
    assert daemon.errors() == []


def test_delete_hold_with_arabic_indic_digits_releases_a_hold(daemon: Daemon) -> None:
    """Invariant 4. DELETE /v1/holds/%D9%A1 (ARABIC-INDIC DIGIT ONE, U+0661) passes the
    same isdigit() check and int() of it is 1: a malformed id releases hold 1 (200)
    instead of a 400; a legal hold is gone."""
    r = daemon.request(
        "POST", "/v1/holds", {"db": "legal", "until": time.time() + 3600, "reason": "litigation"}
    )
    assert r.status == 200 and r.json()["id"] == 1, r
    assert_error(daemon.request("DELETE", "/v1/holds/%D9%A1"), 400, "hold id")
    assert [h["id"] for h in daemon.request("GET", "/v1/holds", scope="read").json()["holds"]] == [
        1
    ]


def test_hold_routes_refuse_bad_scopes_and_input_and_change_nothing(
    make_daemon: MakeDaemon,
) -> None:
    """Invariant 4 (held). Scopes: listing needs read, adding and removing admin; bad
    bodies, ids and queries are 4xx; a real sweep asked with names is refused before it
    removes anything; nothing changes and no error is logged."""
    d = make_daemon(env={"CMROOT_STORE_RETAIN": "1s"})
    files = _drop_http(d, "db", "t")
    ok = {"db": "keep", "until": time.time() + 3600, "reason": "r"}
    hold = d.request("POST", "/v1/holds", ok).json()
    time.sleep(1.2)  # db.t expired
    before = d.request("GET", "/v1/holds?all=true", scope="read").json()
    assert d.request("GET", "/v1/holds", scope=None).status == 401
    assert d.request("POST", "/v1/holds", ok, scope="read").status == 403
    assert d.request("POST", "/v1/holds", ok, scope="write").status == 403
    assert d.request("DELETE", f"/v1/holds/{hold['id']}", scope="write").status == 403
    assert d.request("DELETE", f"/v1/holds/{hold['id']}", scope="read").status == 403
    for body in [
        {**ok, "until": time.time() - 1},
        {**ok, "until": 1e11 + 1},
        {**ok, "db": "a b"},
        {**ok, "db": "x" * 129},
        {**ok, "table": "t.u"},
        {**ok, "table": 7},
        {**ok, "reason": ""},
        {**ok, "reason": "\n\t "},
        {**ok, "reason": "r" * 1001},
        {**ok, "until": None},
        {**ok, "until": True},
        {"db": "a"},
        "x",
        None,
    ]:
        r = (
            d.request("POST", "/v1/holds", body)
            if body is not None
            else d.request("POST", "/v1/holds", raw=b"")
        )
        assert 400 <= r.status < 500, (body, r)
    for raw in (
        b'{"db":"a","until":1e400,"reason":"r"}',
        b'{"db":"a","until":NaN}',
        b'{"db":"a","until":2e9,"reason":"\\ud800"}',
        b"\xff\xfe",
    ):
        assert 400 <= d.request("POST", "/v1/holds", raw=raw).status < 500, raw
    for path in (
        "/v1/holds/0",
        "/v1/holds/1?x=1",
        "/v1/holds/-1",
        "/v1/holds/1e3",
        "/v1/holds/" + "9" * 19,
    ):
        assert 400 <= d.request("DELETE", path).status < 500, path
    for path in (
        "/v1/holds?all=2",
        "/v1/holds?all=true&all=false",
        "/v1/holds?x=1",
        "/v1/entries?all=maybe",
    ):
        assert 400 <= d.request("GET", path, scope="read").status < 500, path
    for q in ("files=true", "all=true", "dry_run=false&files=1", "dry_run=yes"):
        assert 400 <= d.request("POST", f"/v1/gc?{q}").status < 500, q
    assert d.request("GET", "/v1/holds?all=true", scope="read").json() == before
    assert served(d, files)  # the refused sweeps removed nothing
    assert d.errors() == []


# == 7. The CLI: one-line errors, exit 2, nothing changed ================================
def _cli_direct(
    base: Path, *args: str, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`cmroot ARGS` on a store of its own (no daemon: the verb opens the store)."""
    (base / "wh").mkdir(parents=True, exist_ok=True)
    env = clean_env(
        {
            "CMROOT_STORE_ROOT": str(base / "store"),
            "CMROOT_STORE_WAREHOUSE_ROOTS": str(base / "wh"),
            "CMROOT_SERVER_PORT": "1",
            **(extra or {}),
        }
    )
    return subprocess.run(
        [sys.executable, "-m", "cmroot.cli", *args],
        env=env,
        capture_output=True,
        timeout=120,
        cwd=str(base),
    )


def _assert_clear_refusal(r: subprocess.CompletedProcess[bytes], *words: str) -> None:
    err = r.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert "unexpected" not in err, f"a bug path, not a clear refusal: {err.strip()}"
    assert r.returncode == 2, (r.returncode, err)
    for w in words:
        assert w in err, err


def test_cli_hold_rm_of_a_huge_id_without_a_daemon(tmp_path: Path) -> None:
    """Invariant 4. `cmroot hold rm 99999999999999999999` through the daemon is a 400
    (exit 2); on the store directly it reaches SQLite with an int beyond 64 bits:
    'unexpected OverflowError ... report it', exit 1 (`_count` has no upper bound,
    `Store.remove_hold` passes it to SQLite)."""
    assert (
        _cli_direct(tmp_path, "hold", "add", "db", "--until", "1d", "--reason", "x").returncode == 0
    )
    r = _cli_direct(tmp_path, "hold", "rm", "9" * 20)
    _assert_clear_refusal(r, "hold")
    assert len(json.loads(_cli_direct(tmp_path, "hold", "ls", "--json").stdout)["holds"]) == 1


def test_cli_hold_add_with_an_undecodable_reason_without_a_daemon(tmp_path: Path) -> None:
    """Invariant 4. A reason argument that is not UTF-8 (bytes 0xff from a Latin-1
    terminal or a script) becomes a lone surrogate in argv; `Store.add_hold` accepts it
    and SQLite refuses to encode it: 'unexpected UnicodeEncodeError ... report it', exit 1.
    Through the daemon the same input is a 400."""
    r = _cli_direct(
        tmp_path, "hold", "add", "db", "--until", "1d", "--reason", os.fsdecode(b"caf\xe9")
    )
    _assert_clear_refusal(r, "reason")


@pytest.mark.parametrize("value", ["1" * 400, "1" * 400 + "PiB"])
def test_a_max_bytes_too_large_for_a_float_is_a_config_error(tmp_path: Path, value: str) -> None:
    """Invariants 4/config. `parse_size` turns 400 digits into float('inf') and int() of it
    raises OverflowError: every verb (and `cmroot serve`) stops with 'unexpected
    OverflowError: cannot convert float infinity to integer ... report it' instead of
    'bad size for store.max_bytes' (what 'abc' gets)."""
    r = _cli_direct(tmp_path, "gc", "--dry-run", extra={"CMROOT_STORE_MAX_BYTES": value})
    err = r.stderr.decode(errors="replace")
    assert "Traceback" not in err
    assert "store.max_bytes" in err and "unexpected" not in err, err.strip()


def test_cli_hold_verbs_refuse_bad_input_through_the_daemon(daemon: Daemon) -> None:
    """Invariant 4 (held). Through the daemon: names, times and ids the server refuses
    are one line, exit 2, and no hold is made."""
    token = daemon.base / "token-admin"
    token.write_text(daemon.tokens["admin"])
    token.chmod(0o600)

    def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "cmroot.cli",
                *args,
                "--url",
                daemon.url,
                "--token-file",
                str(token),
            ],
            capture_output=True,
            timeout=120,
            env=clean_env(),
        )

    for args in (
        ["hold", "add", "a", "--until", "9" * 400 + "d", "--reason", "r"],
        ["hold", "add", "a", "--until", "9999-12-31", "--reason", "r"],
        ["hold", "add", "a", "--until", "1970-01-01T00:00+14:00", "--reason", "r"],
        ["hold", "add", "a", "--until", "1d", "--reason", os.fsdecode(b"\xff")],
        ["hold", "add", "a/b", "--until", "1d", "--reason", "r"],
        ["hold", "rm", "9" * 20],
        ["gc", "--all"],
    ):
        r = cli(*args)
        err = r.stderr.decode(errors="replace")
        assert r.returncode == 2 and "Traceback" not in err and "unexpected" not in err, (
            args,
            r.returncode,
            err,
        )
    assert daemon.request("GET", "/v1/holds?all=true", scope="read").json() == {"holds": []}
    assert daemon.errors() == []

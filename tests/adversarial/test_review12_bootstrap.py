"""Review 12: bootstrap consolidation (3c2e97f), attacked with statements that run at the
dump's fault points (dump.tables_listed / dump.defined / dump.files_listed) or while a
table's partitions are listed, then loaded on a destination of its own.

Invariant: after loading a bootstrap dump the destination equals the source as of the
dump's last event id (same tables under the same names, same rows, partitions and data
files, no phantom, none lost), a load SIGKILLed at any event and rerun converges on that
state, a table-level bootstrap follows its table, and an incremental dump from the
bootstrap's last id applies on top. The dump terminates and refuses only with a ReplError.

Cost: every scenario is dumped in the one source session, and all the loads run in ONE
destination process (`world`); the kill test reloads one of those dumps into a second
destination a few times. The destination process is this module run as a script, which
turns any non-cmroot exception of a load into a ReplError marked UNEXPECTED, so that one
crash does not take the other scenarios' answers with it."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from cmroot import faults
from cmroot.exceptions import ReplError
from cmroot.repl import dumpdir, tabledef
from tests.cmroot_testlib import on_point
from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)
dump_mod = importlib.import_module("cmroot.repl.dump")  # the package's `dump` is the function

Statement = str | Callable[[Source, str], None]


# -- the destination, in a process of its own ------------------------------------------------
class _Dest(Destination):
    """tests.repl.destination, run through this module (see `_main`)."""

    def run(self, *steps: dict[str, Any], faults: str | None = None) -> list[dict[str, Any]]:
        self.plans += 1
        plan = self.base / f"plan-{self.plans}.json"
        plan.write_text(json.dumps({"base": str(self.base), "steps": list(steps)}))
        env = self.env() | ({"CMROOT_FAULTS": faults} if faults else {})
        res = subprocess.run(
            [sys.executable, "-m", "tests.adversarial.test_review12_bootstrap", str(plan)],
            capture_output=True,
            text=True,
            env=env,
            cwd=self.base,
            timeout=600,
        )
        if faults:
            assert res.returncode == -signal.SIGKILL, (res.returncode, res.stderr[-3000:])
            return []
        assert res.returncode == 0, res.stderr[-5000:]
        answers: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
        return answers


def _main(plan: str) -> int:
    import cmroot.repl as repl
    from cmroot.exceptions import CmrootError

    real = repl.load

    def guarded(*a: Any, **kw: Any) -> Any:
        try:
            return real(*a, **kw)
        except CmrootError:
            raise
        except Exception as e:
            raise ReplError(
                f"UNEXPECTED {type(e).__name__}", traceback.format_exc()[-4000:]
            ) from None

    repl.load = guarded  # type: ignore[assignment]
    from tests.repl import destination

    return destination.main(plan)


# -- the source's state ------------------------------------------------------------------------
def _tables(src: Source, db: str) -> list[str]:
    try:
        return sorted(
            t.name.lower()
            for t in src.spark.catalog.listTables(db)
            if not t.isTemporary and t.tableType != "VIEW"
        )
    except Exception:
        return []  # no such database


def _visible(rel: str) -> bool:
    return not any(part.startswith((".", "_")) for part in rel.split("/"))


def _files_under(root: str) -> list[str]:
    return sorted(
        r
        for r in (
            os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
        )
        if _visible(r)
    )


def _state(src: Source, db: str, table: str) -> dict[str, Any]:
    obj = dump_mod.table_obj(src.spark, db, table)
    parts = None
    if tabledef.partition_columns(obj):
        parts = sorted(r[0] for r in src.sql(f"SHOW PARTITIONS {db}.{table}"))
    return {
        "rows": src.rows(f"SELECT * FROM {db}.{table}"),
        "partitions": parts,
        "files": _files_under(str(tabledef.location(obj))),
    }


def across(table: str, to: str = "{db}_o", back: bool = False) -> Statement:
    def go(src: Source, db: str) -> None:
        other = to.format(db=db)
        if back:
            src.rename_across(other, table, db)
        else:
            src.rename_across(db, table, other)

    return go


# -- the scenarios -----------------------------------------------------------------------------
@dataclass
class Case:
    name: str  # the database is rv12_<name>
    point: str | None  # the dump's fault point `during` runs at
    setup: list[Statement]
    during: list[Statement]
    table: str | None = None  # a table-level bootstrap of rv12_<name>.<table>
    after: list[Statement] = field(default_factory=list)  # then an incremental dump
    partitions_hook: str | None = None  # run `during` as this table's partitions are listed

    @property
    def db(self) -> str:
        return f"rv12_{self.name}"

    @property
    def scope(self) -> str:
        return self.db if self.table is None else f"{self.db}.{self.table}"


def _t(
    name: str, *values: str, cols: str = "x INT", db: str = "{db}", using: str = "USING parquet"
) -> list[Statement]:
    out: list[Statement] = [f"CREATE TABLE {db}.{name} ({cols}) {using}"]
    if values:
        out.append(f"INSERT INTO {db}.{name} VALUES {', '.join(values)}")
    return out


HIVE = "STORED AS PARQUET"  # a metastore rename across databases moves a Hive table's files


def _p(name: str, *values: str) -> list[Statement]:
    out: list[Statement] = [
        f"CREATE TABLE {{db}}.{name} (x INT, k INT) USING parquet PARTITIONED BY (k)"
    ]
    if values:
        out.append(f"INSERT INTO {{db}}.{name} VALUES {', '.join(values)}")
    return out


MIX_SETUP = [
    *_t("a", "(1)", "(2)"),
    *_p("p", "(1, 1)", "(2, 2)"),
    *_t("s", "(7)", "(8)"),
    *_t("h", "(1)"),
    *_t("i", "(1)"),
    *_t("o", "(1)", "(2)"),
    *_t("r", "(5)"),
    *_t("keep", "(3)"),
]
MIX_DURING: list[Statement] = [
    "ALTER TABLE {db}.a RENAME TO a2",
    "INSERT INTO {db}.a2 VALUES (3)",
    "CREATE TABLE {db}.s_new USING parquet AS SELECT x + 10 AS x FROM {db}.s",
    "DROP TABLE {db}.s",
    "ALTER TABLE {db}.s_new RENAME TO s",
    "ALTER TABLE {db}.h RENAME TO h2",
    "ALTER TABLE {db}.h2 RENAME TO h3",
    "ALTER TABLE {db}.i RENAME TO i2",
    "INSERT INTO {db}.i2 VALUES (2)",
    "ALTER TABLE {db}.i2 RENAME TO i",
    "INSERT OVERWRITE TABLE {db}.o VALUES (9)",
    "ALTER TABLE {db}.p DROP PARTITION (k=1)",
    "INSERT INTO {db}.p VALUES (3, 3)",
    "DROP TABLE {db}.r",
    "CREATE TABLE {db}.r (y STRING) USING parquet",
    "INSERT INTO {db}.r VALUES ('new')",
]

CASES = [
    # Two tables that existed when the dump started swap names (a -> tmp, b -> a, tmp -> b).
    Case(
        "swap",
        "dump.defined",
        [*_t("a", "(1)", "(2)"), *_t("b", "(10)")],
        [
            "ALTER TABLE {db}.a RENAME TO tmp",
            "ALTER TABLE {db}.b RENAME TO a",
            "ALTER TABLE {db}.tmp RENAME TO b",
        ],
        after=["INSERT INTO {db}.a VALUES (11)", "INSERT INTO {db}.b VALUES (3)"],
    ),
    # A name vacated by a rename is taken by another existing table (c -> d, e -> c).
    Case(
        "vacated",
        "dump.tables_listed",
        [*_t("c", "(1)"), *_t("e", "(5)")],
        ["ALTER TABLE {db}.c RENAME TO d", "ALTER TABLE {db}.e RENAME TO c"],
    ),
    # ETL swap with a staging table that existed before the dump: DROP g; f -> g.
    Case(
        "dropped_into",
        "dump.defined",
        [*_t("f", "(1)"), *_t("g", "(9)"), *_t("keep", "(3)")],
        ["DROP TABLE {db}.g", "ALTER TABLE {db}.f RENAME TO g"],
        after=["INSERT INTO {db}.g VALUES (2)"],
    ),
    # Rows inserted into a table that is then dropped, both while the dump reads.
    Case(
        "insert_then_drop",
        "dump.tables_listed",
        [*_t("x", "(1)"), *_t("keep", "(3)")],
        ["INSERT INTO {db}.x VALUES (2)", "DROP TABLE {db}.x"],
    ),
    # A table dropped and a view made under its name after the tables were listed.
    Case(
        "view_replaces",
        "dump.tables_listed",
        [*_t("t", "(1)"), *_t("keep", "(3)")],
        ["DROP TABLE {db}.t", "CREATE VIEW {db}.t AS SELECT x FROM {db}.keep"],
    ),
    # A table renamed away and a view renamed into its name while the dump reads.
    Case(
        "view_renamed_into",
        "dump.defined",
        [*_t("u", "(1)"), "CREATE VIEW {db}.v AS SELECT 1 AS one"],
        ["ALTER TABLE {db}.u RENAME TO u2", "ALTER VIEW {db}.v RENAME TO u"],
    ),
    # Renamed twice while the files were listed.
    Case(
        "twice",
        "dump.files_listed",
        [*_t("h", "(1)")],
        [
            "ALTER TABLE {db}.h RENAME TO h2",
            "ALTER TABLE {db}.h2 RENAME TO h3",
            "INSERT INTO {db}.h3 VALUES (2)",
        ],
        after=[*_t("h", "(7)"), "INSERT INTO {db}.h3 VALUES (3)"],
    ),
    # String partition values Hive escapes in paths, one written while the files were listed.
    Case(
        "odd_partitions",
        "dump.files_listed",
        [
            "CREATE TABLE {db}.sp (x INT, k STRING) USING parquet PARTITIONED BY (k)",
            "INSERT INTO {db}.sp VALUES (1, 'a b'), (2, 'x:y'), (3, 'p%q'), (4, 'a=b/c')",
        ],
        ["INSERT INTO {db}.sp VALUES (5, 'é#?'), (6, '%41')"],
    ),
    # Renamed, written, and renamed back to its old name.
    Case(
        "back",
        "dump.defined",
        [*_t("i", "(1)")],
        [
            "ALTER TABLE {db}.i RENAME TO i2",
            "INSERT INTO {db}.i2 VALUES (2)",
            "ALTER TABLE {db}.i2 RENAME TO i",
        ],
    ),
    # INSERT OVERWRITE (a table, and one partition) after the files were listed.
    Case(
        "overwrite",
        "dump.files_listed",
        [*_t("o", "(1)", "(2)"), *_p("q", "(1, 1)", "(2, 2)")],
        [
            "INSERT OVERWRITE TABLE {db}.o VALUES (3)",
            "INSERT OVERWRITE TABLE {db}.q PARTITION (k=1) SELECT 10",
        ],
    ),
    # Partitions dropped, added and renamed after the files were listed.
    Case(
        "partitions",
        "dump.files_listed",
        [*_p("p", "(1, 1)", "(2, 2)")],
        [
            "ALTER TABLE {db}.p DROP PARTITION (k=1)",
            "INSERT INTO {db}.p VALUES (3, 3)",
            "ALTER TABLE {db}.p PARTITION (k=2) RENAME TO PARTITION (k=4)",
        ],
        after=["INSERT INTO {db}.p VALUES (5, 5)"],
    ),
    # SET LOCATION (to an empty directory under the warehouse), then an insert.
    Case(
        "set_location",
        "dump.files_listed",
        [*_t("sl", "(1)"), *_t("keep", "(3)")],
        [
            "ALTER TABLE {db}.sl SET LOCATION '{wh}/{db}.db/sl_moved'",
            "INSERT INTO {db}.sl VALUES (7)",
        ],
    ),
    # Tables created (plain, partitioned, CTAS) and one of them renamed during the read.
    Case(
        "created",
        "dump.defined",
        [*_t("keep", "(3)")],
        [
            *_t("n", "(1)"),
            *_p("np", "(1, 1)"),
            "CREATE TABLE {db}.c2 USING parquet AS SELECT 5 AS x",
            "ALTER TABLE {db}.n RENAME TO n2",
        ],
    ),
    # A table dropped, another renamed, while their partitions are listed (SHOW PARTITIONS).
    Case(
        "drop_in_partitions",
        None,
        [*_p("pp", "(1, 1)"), *_p("pr", "(2, 2)"), *_t("keep", "(3)")],
        ["DROP TABLE {db}.pp", "ALTER TABLE {db}.pr RENAME TO pr2"],
        partitions_hook="pp",
    ),
    # One table renamed out to another database, one renamed in from it (the metastore's
    # rename, as another engine does it), while the dump reads.
    Case(
        "across",
        "dump.defined",
        [
            "CREATE DATABASE {db}_o",
            *_t("t", "(1)", using=HIVE),
            *_t("w", "(4)", db="{db}_o", using=HIVE),
            *_t("keep", "(3)"),
        ],
        [across("t"), across("w", back=True), "INSERT INTO {db}.w VALUES (5)"],
        after=["INSERT INTO {db}.w VALUES (6)"],
    ),
    # The mix the kill test reloads (each piece also in the change's own tests).
    Case("mix", "dump.defined", MIX_SETUP, MIX_DURING),
    # -- table-level bootstraps --
    Case(
        "tl_rename",
        "dump.defined",
        [*_t("a", "(1)", "(2)")],
        [
            "ALTER TABLE {db}.a RENAME TO a2",
            "INSERT INTO {db}.a2 VALUES (3)",
            *_t("a", "('z')", cols="y STRING"),
        ],
        table="a",
        after=["INSERT INTO {db}.a2 VALUES (4)", "INSERT INTO {db}.a VALUES ('w')"],
    ),
    Case(
        "tl_swap",
        "dump.tables_listed",
        [*_t("a", "(1)"), *_t("b", "(10)")],
        [
            "ALTER TABLE {db}.a RENAME TO tmp",
            "ALTER TABLE {db}.b RENAME TO a",
            "ALTER TABLE {db}.tmp RENAME TO b",
        ],
        table="a",
        after=["INSERT INTO {db}.b VALUES (2)", "INSERT INTO {db}.a VALUES (11)"],
    ),
    Case(
        "tl_back",
        "dump.files_listed",
        [*_t("a", "(1)")],
        [
            "ALTER TABLE {db}.a RENAME TO a2",
            "INSERT INTO {db}.a2 VALUES (2)",
            "ALTER TABLE {db}.a2 RENAME TO a",
        ],
        table="a",
    ),
    Case(
        "tl_recreated",
        "dump.defined",
        [*_t("a", "(1)")],
        ["DROP TABLE {db}.a", *_t("a", "(5)")],
        table="a",
    ),
    # The followed table renamed into another database while the dump reads it.
    Case(
        "tl_across",
        "dump.tables_listed",
        ["CREATE DATABASE {db}_o", *_t("a", "(1)", "(2)", using=HIVE)],
        [across("a")],
        table="a",
        after=["INSERT INTO {db}_o.a VALUES (3)"],
    ),
]
BY_NAME = {c.name: c for c in CASES}


def _run(src: Source, case: Case, stmts: list[Statement]) -> None:
    for s in stmts:
        if callable(s):
            s(src, case.db)
        else:
            src.sql(s.format(db=case.db, wh=src.warehouse))


def _want(src: Source, case: Case, header: dumpdir.Header) -> dict[str, Any]:
    """The source as the dump ended: its tables and each one's state (a table-level scope:
    the table it follows, under the name it has now)."""
    if case.table is None:
        names = _tables(src, case.db)
        return {"tables": names, "state": {t: _state(src, case.db, t) for t in names}}
    now = header.table_now or case.scope
    ndb, _, nt = now.partition(".")
    return {"now": now, "state": {case.table: _state(src, ndb, nt)}}


def _step(case: Case, url: str, want: dict[str, Any], db: str | None = None) -> dict[str, Any]:
    """Load `url` (a database dump: into `db` if given) and read back what `want` holds."""
    db = db or case.db
    names = sorted(want["state"])
    return {
        "load": {"dump": url, "target": db if db != case.db else None},
        "queries": {
            **{t: f"SELECT * FROM {db}.{t}" for t in names},
            "__tables__": f"SHOW TABLES IN {db}",
        },
        "status": [db if case.table is None else f"{db}.{case.table}"],
        "partitions": [f"{db}.{t}" for t in names if want["state"][t]["partitions"]],
        "files": [f"{db}.{t}" for t in names],
    }


@dataclass
class Outcome:
    case: Case
    error: str | None = None  # the dump's own failure (traceback)
    error_obj: BaseException | None = None
    during_error: str | None = None
    url: str | None = None
    header: Any = None
    want: dict[str, Any] | None = None
    got: dict[str, Any] | None = None
    inc_url: str | None = None
    inc_header: Any = None
    inc_want: dict[str, Any] | None = None
    inc_got: dict[str, Any] | None = None
    kill_ks: list[int] = field(default_factory=list)  # the mix: load.applied@K kills
    kill_error: str | None = None
    kill_got: dict[str, Any] | None = None
    events: list[str] = field(default_factory=list)


def _bootstrap(src: Source, case: Case, out: Outcome) -> None:
    _run(src, case, ["CREATE DATABASE {db}", *case.setup])

    def during() -> None:
        try:
            _run(src, case, case.during)
        except Exception:
            out.during_error = traceback.format_exc()
            raise

    with pytest.MonkeyPatch.context() as m:
        if case.partitions_hook:
            real = dump_mod._partitions
            fired = {"n": 0}

            def partitions(spark: Any, db: str, table: str) -> list[dict[str, str]]:
                if table == case.partitions_hook and not fired["n"]:
                    fired["n"] += 1
                    during()
                return real(spark, db, table)

            m.setattr(dump_mod, "_partitions", partitions)
        else:
            assert case.point
            on_point(m, case.point, during)
        try:
            out.url, out.header = src.dump(case.scope)
        except BaseException as e:
            out.error, out.error_obj = traceback.format_exc(), e
            return
    out.events = [f"{e.id}:{e.type}:{e.table}" for e in dumpdir.read(out.url).events]
    out.want = _want(src, case, out.header)


def _incremental(src: Source, case: Case, out: Outcome) -> None:
    _run(src, case, case.after)
    try:
        after = getattr(dump_mod, "after", None)
        if after is not None:
            out.inc_url, out.inc_header = after(src.daemon.client, out.url, str(src.base / "dumps"))
        else:
            out.inc_url, out.inc_header = src.dump(case.scope, from_id=out.header.last_event_id)
    except BaseException:
        out.error = "incremental: " + traceback.format_exc()
        return
    out.inc_want = _want(src, case, out.inc_header)


@pytest.fixture(scope="module")
def world(source: Source, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    outs = {c.name: Outcome(c) for c in CASES}
    for c in CASES:
        _bootstrap(source, c, outs[c.name])
    for c in CASES:
        if c.after and outs[c.name].url:
            _incremental(source, c, outs[c.name])
    steps: list[tuple[str, str, dict[str, Any]]] = []
    for c in CASES:
        o = outs[c.name]
        if o.url and o.want:
            steps.append((c.name, "boot", _step(c, o.url, o.want)))
    for c in CASES:
        o = outs[c.name]
        if o.inc_url and o.inc_want:
            steps.append((c.name, "inc", _step(c, o.inc_url, o.inc_want)))
    dest = _Dest(tmp_path_factory.mktemp("rv12") / "destination")
    mix = outs["mix"]
    if mix.url and mix.want:  # the kills, then the rerun in the big run below
        mix.kill_ks = _kill_points(mix)
        try:
            for k in mix.kill_ks:
                dest.run({"load": {"dump": mix.url, "target": KILLED}}, faults=f"load.applied@{k}")
            steps.append(("mix", "kill", _step(mix.case, mix.url, mix.want, KILLED)))
        except AssertionError:
            mix.kill_error = traceback.format_exc()
    answers = dest.run(*(s for _, _, s in steps))
    for (name, kind, _), got in zip(steps, answers, strict=True):
        setattr(outs[name], {"boot": "got", "inc": "inc_got", "kill": "kill_got"}[kind], got)
    return outs


KILLED = "rv12_killed"  # where the kill test loads the mix's dump


def _kill_points(o: Outcome) -> list[int]:
    """load.applied@K for the mix: after the rename i -> i2 (the rerun then finds i2 and
    drops the snapshot's i), and after the drop of s (the CTAS table s_new waits to be
    renamed into its name); each kill's rerun starts over on what the killed run left."""
    events = dumpdir.read(str(o.url)).events
    k_i = next(
        i + 1
        for i, e in enumerate(events)
        if e.type == "ALTER_TABLE" and e.table == "i" and e.id > o.header.first_event_id
    )
    k_s = next(i + 1 for i, e in enumerate(events) if e.type == "DROP_TABLE" and e.table == "s")
    return [k_i, k_s]


# -- checks ------------------------------------------------------------------------------------
def _dest_files(got: dict[str, Any], key: str) -> list[str]:
    return sorted(f for f in got["files"][key] if _visible(f))


def _check(
    case: Case,
    want: dict[str, Any],
    got: dict[str, Any],
    header: Any,
    what: str,
    events: list[str],
    db: str | None = None,
) -> None:
    db = db or case.db
    scope = db if case.table is None else f"{db}.{case.table}"
    ctx = f"{case.scope} -> {scope} ({what}); dump events {events}"
    assert "error" not in got["load"], (ctx, got["load"])
    if case.table is None:
        tables = got["rows"]["__tables__"]
        assert not isinstance(tables, dict), (ctx, tables)
        assert sorted(r[1] for r in tables if not r[2]) == want["tables"], (
            ctx,
            "tables differ",
            tables,
        )
    for t, st in want["state"].items():
        key = f"{db}.{t}"
        assert got["rows"][t] == st["rows"], (ctx, t, "rows differ")
        if st["partitions"] is not None:
            assert got["partitions"][key] == st["partitions"], (ctx, t, "partitions differ")
        assert _dest_files(got, key) == st["files"], (ctx, t, "data files differ")
    assert got["status"][scope] == header.last_event_id, (ctx, got["status"])


def _outcome(world: dict[str, Outcome], name: str) -> Outcome:
    o = world[name]
    assert o.during_error is None, f"the racing statements failed:\n{o.during_error}"
    if o.error is not None:
        assert isinstance(o.error_obj, ReplError) or o.error.startswith("incremental"), (
            f"the dump crashed (not a ReplError):\n{o.error}"
        )
        pytest.fail(f"the dump of {o.case.scope} was refused:\n{o.error[-2500:]}")
    return o


def _check_case(world: dict[str, Outcome], name: str) -> Outcome:
    o = _outcome(world, name)
    assert o.want is not None and o.got is not None
    _check(o.case, o.want, o.got, o.header, "bootstrap", o.events)
    if o.case.after:
        assert o.inc_want is not None and o.inc_got is not None
        _check(o.case, o.inc_want, o.inc_got, o.inc_header, "incremental after it", o.events)
    return o


def test_swap_of_two_existing_tables_during_bootstrap(world: dict[str, Outcome]) -> None:
    """a -> tmp, b -> a, tmp -> b while the dump reads: the source ends with a = old b and
    b = old a; the replica must too (and the incremental after it)."""
    o = _check_case(world, "swap")
    assert o.want and o.want["state"]["a"]["rows"] == [[10]]


def test_rename_into_a_name_vacated_by_a_rename(world: dict[str, Outcome]) -> None:
    """c -> d, then e -> c (c and e both existed): the replica has c (old e) and d (old c)."""
    o = _check_case(world, "vacated")
    assert o.want and o.want["tables"] == ["c", "d"]


def test_rename_into_a_name_just_dropped(world: dict[str, Outcome]) -> None:
    """DROP g; f -> g, with f existing before the dump: g must hold f's rows."""
    o = _check_case(world, "dropped_into")
    assert o.want and o.want["state"]["g"]["rows"] == [[1]]


def test_insert_then_drop_during_bootstrap(world: dict[str, Outcome]) -> None:
    """INSERT INTO x; DROP TABLE x after the tables were listed: the load must not refuse
    the dump (the table is simply gone at the end)."""
    _check_case(world, "insert_then_drop")


def test_table_replaced_by_a_view_during_bootstrap(world: dict[str, Outcome]) -> None:
    """DROP TABLE t; CREATE VIEW t after the tables were listed: views are not replicated,
    the dump goes on."""
    _check_case(world, "view_replaces")


def test_view_renamed_into_a_renamed_tables_name(world: dict[str, Outcome]) -> None:
    """u -> u2, then ALTER VIEW v RENAME TO u while the dump reads."""
    _check_case(world, "view_renamed_into")


def test_table_renamed_twice(world: dict[str, Outcome]) -> None:
    _check_case(world, "twice")


def test_table_renamed_back_to_its_old_name(world: dict[str, Outcome]) -> None:
    _check_case(world, "back")


def test_escaped_partition_values(world: dict[str, Outcome]) -> None:
    o = _check_case(world, "odd_partitions")
    assert o.want and len(o.want["state"]["sp"]["rows"]) == 6


def test_insert_overwrite_while_files_are_listed(world: dict[str, Outcome]) -> None:
    _check_case(world, "overwrite")


def test_partitions_dropped_added_renamed_while_listed(world: dict[str, Outcome]) -> None:
    _check_case(world, "partitions")


def test_set_location_while_files_are_listed(world: dict[str, Outcome]) -> None:
    _check_case(world, "set_location")


def test_tables_created_during_bootstrap(world: dict[str, Outcome]) -> None:
    _check_case(world, "created")


def test_table_dropped_while_its_partitions_are_listed(world: dict[str, Outcome]) -> None:
    _check_case(world, "drop_in_partitions")


def test_tables_renamed_across_databases_during_bootstrap(world: dict[str, Outcome]) -> None:
    o = _check_case(world, "across")
    assert o.want and o.want["tables"] == ["keep", "w"]


def test_the_mix(world: dict[str, Outcome]) -> None:
    _check_case(world, "mix")


def test_table_level_rename_and_new_table_under_old_name(world: dict[str, Outcome]) -> None:
    o = _check_case(world, "tl_rename")
    assert o.header.table_now == f"{o.case.db}.a2"


def test_table_level_swap(world: dict[str, Outcome]) -> None:
    o = _check_case(world, "tl_swap")
    assert o.want and o.want["state"]["a"]["rows"] == [[1]]


def test_table_level_renamed_back(world: dict[str, Outcome]) -> None:
    _check_case(world, "tl_back")


def test_table_level_dropped_and_recreated(world: dict[str, Outcome]) -> None:
    _check_case(world, "tl_recreated")


def test_table_level_followed_into_another_database(world: dict[str, Outcome]) -> None:
    """The followed table is renamed into another database as the dump starts reading: the
    replica must hold its rows (the dump's header already says where it is now)."""
    o = _outcome(world, "tl_across")
    assert o.header.table_now == f"{o.case.db}_o.a"
    assert o.want and o.want["state"]["a"]["rows"] == [[1], [2]]
    _check_case(world, "tl_across")


def test_killed_load_of_the_mix_converges(world: dict[str, Outcome]) -> None:
    """The mix's dump loaded (as rv12_killed) into the world's destination, SIGKILLed after
    each of the events `_kill_points` picks, then run to the end: the same state as the
    source when the dump ended."""
    o = _outcome(world, "mix")
    assert o.kill_error is None, o.kill_error
    assert o.want and o.kill_got is not None
    _check(
        o.case,
        o.want,
        o.kill_got,
        o.header,
        f"rerun after kills at {o.kill_ks}",
        o.events,
        db=KILLED,
    )


def test_a_table_renamed_in_every_round_is_refused_not_looped(
    source: Source,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """t0 -> t1 in the first round's read, t1 -> t2 in the second's, ...: the dump ends, with
    a ReplError, after its bounded number of rounds."""
    db = "rv12_spin"
    source.sql(f"CREATE DATABASE {db}")
    source.sql(f"CREATE TABLE {db}.t0 (x INT) USING parquet")
    source.sql(f"INSERT INTO {db}.t0 VALUES (1)")
    n = {"i": 0}
    real = faults.point

    def point(name: str) -> None:
        if name == "dump.defined" and n["i"] < 50:
            source.sql(f"ALTER TABLE {db}.t{n['i']} RENAME TO t{n['i'] + 1}")
            n["i"] += 1
        real(name)

    monkeypatch.setattr(faults, "point", point)
    with pytest.raises(ReplError, match="kept moving"):
        source.dump(db)
    assert n["i"] < 50


def test_bootstrap_of_a_missing_table_says_so(source: Source) -> None:
    """A table-level bootstrap of a table that does not exist (a typo) is refused as such,
    not as tables that "kept moving" through ten rounds of renames and drops."""
    source.sql("CREATE DATABASE IF NOT EXISTS rv12_missing")
    with pytest.raises(ReplError) as e:
        source.dump("rv12_missing.nosuch")
    assert "kept moving" not in str(e.value), str(e.value)


def test_bootstrap_of_a_missing_database_is_a_repl_error(source: Source) -> None:
    with pytest.raises(ReplError):
        source.dump("rv12_nosuchdb")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))

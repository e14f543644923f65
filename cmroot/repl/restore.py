"""`cmroot restore`: undo one destructive event, or bring a table back to its state at an
earlier event, in place or under another name (`--as`).

A restore first works out a `Target`: the table's definition (the newest the event log holds
for it), its partitions, and the exact files each of its places must hold, by (original
path, checksum). Before anything changes it checks that each of those files can be had (at
its path with that checksum, or in the cmroot) and that it would replace no live data it
was not told to (`--replace`); a failed check names the file or the table, and nothing
changes. It then converges on the target with the load's own code: files copied verified
into hidden temporaries (`transfer`, on Spark), what must go recycled in one call (so a
restore is itself undoable), the temporaries published, the catalog changed through
`Destination`. Every step starts from the state it finds, so a rerun after a crash
finishes the job.

Events: the session carries the cmroot hook, which records the catalog changes as it does
any statement's (CREATE_TABLE listing the files already back, ADD_PARTITION,
DROP_PARTITION); the recycle records an INSERT_OVERWRITE; the files the log does not yet
show in place (put back into a table or partition that already existed) are recorded
here as an INSERT. A replica replays them as it would the statements."""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from cmroot import checksum as cks
from cmroot import faults
from cmroot.client import Client
from cmroot.exceptions import BadRequest, ConfigError, FileLost, NotFound, ReplError
from cmroot.repl import tabledef
from cmroot.repl.catalog import Destination, spec_key
from cmroot.repl.transfer import (
    TEMP_PREFIX,
    Copy,
    copy_on_spark,
    daemon_error,
    discard,
    publish,
    resolve,
    sweep,
)
from cmroot.vocab import EventType

log = logging.getLogger(__name__)

Report = Callable[[str, int, int | None], None]
Name = tuple[str, str]
Spec = dict[str, str]

UNDOES = frozenset({"DROP_TABLE", "DROP_PARTITION", "INSERT_OVERWRITE", "TRUNCATE",
                    "DROP_DATABASE"})
_REMOVES = frozenset({"INSERT_OVERWRITE", "TRUNCATE", "DELETE"})
# What a writer leaves below a table while it works: never data, never touched here.
_IN_FLIGHT = (TEMP_PREFIX, ".spark-staging", "_temporary", ".hive-staging")
_PAGE = 1000
_EXTENSIONS = "io.cmroot.spark.CmrootExtensions"


@dataclass(frozen=True)
class FileRow:
    path: str  # where the file was at the source (the event's path)
    checksum: str
    size: int
    event: int  # the event that listed it: named when it cannot be had


@dataclass
class Target:
    """What one table must look like once restored."""

    op: str  # the event type undone, or "AS_OF"
    event: int
    src: Name  # the table's name at the event
    dst: Name  # where it comes back
    table_obj: dict[str, Any] | None  # None: the live table's definition is kept
    location: str  # the source table's location (the files' paths are below it)
    partitions: list[tuple[Spec, str | None]]  # (spec, source directory; None: default)
    files: list[FileRow]
    whole: bool  # the whole table is made exact (else only `partitions` and `drop`)
    drop: list[Spec] = field(default_factory=list)  # partitions made since, to drop
    alive: bool = False  # the table must exist (an overwrite undone in place)


@dataclass
class TableResult:
    db: str
    table: str
    op: str
    event: int
    created: bool = False
    partitions_added: list[Spec] = field(default_factory=list)
    partitions_dropped: list[Spec] = field(default_factory=list)
    files: int = 0  # files the target holds
    bytes: int = 0
    copied: int = 0  # of which put back by this run
    copied_bytes: int = 0
    recycled: int = 0  # live files that went to the cmroot first
    recycled_bytes: int = 0
    replaced: bool = False  # the live table was dropped first (--replace)
    events: list[int] = field(default_factory=list)  # recorded here (the hook's aside)


@dataclass
class RestoreResult:
    dry_run: bool
    tables: list[TableResult]
    databases: list[str] = field(default_factory=list)  # made again (DROP_DATABASE)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def restore(
    spark: Any,
    client: Client,
    event_id: int | None = None,
    *,
    db: str | None = None,
    table: str | None = None,
    partition: Spec | None = None,
    as_of: str | None = None,
    as_name: str | None = None,
    dry_run: bool = False,
    replace: bool = False,
    progress: Report | None = None,
) -> RestoreResult:
    """Undo event `event_id`, or (`db`, `table`, `as_of`) rebuild a table as it was then."""
    _check_hooked(spark)
    log_ = Log(client)
    dst = _name(as_name, "--as") if as_name else None
    if event_id is not None:
        if as_of is not None or db or table or partition:
            raise BadRequest("give an event id, or --db/--table with --as-of, not both",
                             "cmroot restore EVENT_ID, or cmroot restore --db D --table T"
                             " --as-of EVENT_ID|TIME")
        event = log_.event(event_id)
        targets = _event_targets(log_, event, dst)
        # A database comes back even when it held no table.
        dbs = ([str(event["db"]).lower()]
               if event["eventType"] == "DROP_DATABASE" and event.get("db") else [])
    else:
        if not (db and table and as_of):
            raise BadRequest("nothing to restore",
                             "give an event id, or --db, --table and --as-of")
        targets = [_as_of_target(log_, (db.lower(), table.lower()), _point(log_, as_of),
                                 partition, dst)]
        dbs = []
    r = Restorer(spark, client, log_, replace, progress or (lambda what, done, total: None))
    plans = [r.plan(t) for t in targets]  # every check before the first change
    made = [d for d in sorted({p.target.dst[0] for p in plans} | set(dbs))
            if not r.dest.has_db(d)]
    if not dry_run:
        for d in made:
            r.dest.create_db(d)
        for p in plans:
            r.apply(p)
    return RestoreResult(dry_run, [p.result for p in plans], made)


def _check_hooked(spark: Any) -> None:
    if _EXTENSIONS not in str(spark.conf.get("spark.sql.extensions", "") or ""):
        raise ConfigError(
            "the Spark session has no cmroot hook",
            "a restore records its catalog changes through the hook: run it with `cmroot"
            " restore` (which configures it), or start spark-submit with the settings"
            " `cmroot spark-conf` prints",
        )


def _name(text: str, what: str) -> Name:
    db, dot, table = text.strip().lower().partition(".")
    if not dot or not db or not table or "." in table:
        raise BadRequest(f"bad {what}", f"{text!r}: write DB.TABLE")
    return db, table


def _point(log_: Log, text: str) -> int:
    """--as-of: an event id, or a time (the last event recorded at or before it)."""
    if text.strip().isascii() and text.strip().isdigit():
        return int(text)
    t = text.strip()
    if t[-1:] in ("Z", "z"):
        t = t[:-1] + "+00:00"
    try:
        when = datetime.datetime.fromisoformat(t)
    except ValueError:
        raise BadRequest("bad --as-of", f"{text!r}: give an event id (cmroot ls shows them) or"
                         " a time (2026-11-24T10:00Z; UTC unless it says)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    stamp = when.timestamp()
    last = 0
    for e in log_.scan(1):
        if float(e.get("timestamp") or 0) > stamp:
            break
        last = int(e["id"])
    if not last:
        raise NotFound("no event at or before --as-of", f"{text}: the event log starts later")
    return last


class Log:
    """The daemon's event log, read in pages."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def event(self, event_id: int) -> dict[str, Any]:
        found = self.client.events(event_id, 1)
        if not found or int(found[0]["id"]) != event_id:
            raise NotFound(f"no event {event_id}",
                           "give the id of a recorded event (cmroot ls shows the events"
                           " that recycled files)")
        return found[0]

    def scan(self, start: int, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """The events from `start` to `stop` (inclusive; None: the end), in order."""
        nxt = start
        while True:
            page = self.client.events(nxt, _PAGE)
            for e in page:
                if stop is not None and int(e["id"]) > stop:
                    return
                yield e
            if len(page) < _PAGE:
                return
            nxt = int(page[-1]["id"]) + 1


def _about(e: dict[str, Any], name: Name) -> bool:
    """Is `e` about table `name`: by its own names, or by the definition it carries (a
    rename into `name`)?"""
    if (str(e.get("db") or "").lower(), str(e.get("table") or "").lower()) == name:
        return True
    return _defines(e) == name


def _defines(e: dict[str, Any]) -> Name | None:
    obj = e.get("tableObj")
    if not isinstance(obj, dict) or "_cmroot" in obj:
        return None
    return str(obj.get("db") or "").lower(), str(obj.get("table") or "").lower()


def _rows(e: dict[str, Any]) -> list[FileRow]:
    return [FileRow(str(f["path"]), str(f["checksum"]), int(f["size"]), int(e["id"]))
            for f in e.get("files") or [] if f.get("checksum")]


def _places(e: dict[str, Any]) -> list[tuple[Spec, str | None]]:
    specs = [dict(s) for s in e.get("partitions") or []]
    where = e.get("partitionLocations")
    if not isinstance(where, list) or len(where) != len(specs):
        return [(s, None) for s in specs]
    return [(s, str(w).rstrip("/") if w else None) for s, w in zip(specs, where, strict=True)]


# -- the history of one table, replayed ------------------------------------------------------
@dataclass
class State:
    """A table as the log describes it after some events."""

    name: Name
    exists: bool = False
    obj: dict[str, Any] | None = None
    location: str | None = None
    files: dict[str, FileRow] = field(default_factory=dict)
    partitions: dict[str, tuple[Spec, str | None]] = field(default_factory=dict)
    gap: str | None = None  # why what the log holds does not describe the table

    def apply(self, e: dict[str, Any]) -> None:
        if not _about(e, self.name):
            if e["eventType"] == "DROP_DATABASE" and str(e.get("db") or "").lower() == \
                    self.name[0]:
                self._gone()
            return
        kind, eid = str(e["eventType"]), int(e["id"])
        own = (str(e.get("db") or "").lower(), str(e.get("table") or "").lower()) == self.name
        if kind == "CREATE_TABLE":
            self._gone()
            self.exists, self.obj = True, e.get("tableObj")
            self.location = str(e.get("location") or tabledef.location(self.obj or {}) or "")
            self._add(e)
            return
        if not self.exists and self.gap is None and kind != "DROP_TABLE":
            self.gap = (f"event {eid} ({kind}) is the first the event log holds of"
                        f" {'.'.join(self.name)}, and no CREATE_TABLE of it comes before")
        if kind == "ALTER_TABLE":
            into = _defines(e)
            if own and into is not None and into != self.name:
                self._gone()  # renamed away: a later CREATE_TABLE may take the name
            elif not own and self.gap is None:
                self.gap = (f"event {eid} renamed {e.get('db')}.{e.get('table')} into"
                            f" {'.'.join(self.name)}: a restore does not follow a table"
                            " through its renames")
            else:
                self.obj = e.get("tableObj") or self.obj
        elif kind == "ALTER_LOCATION":
            self.gap = self.gap or (f"event {eid} moved {'.'.join(self.name)} to another"
                                    " location: a restore does not follow that")
        elif kind in ("INSERT", "ADD_PARTITION"):
            self._add(e)
        elif kind in _REMOVES:
            for f in e.get("files") or []:
                self.files.pop(str(f["path"]), None)
        elif kind == "DROP_PARTITION":
            for spec, _ in _places(e):
                self.partitions.pop(spec_key(spec), None)
            for f in e.get("files") or []:
                self.files.pop(str(f["path"]), None)
        elif kind == "DROP_TABLE":
            self._gone()

    def _gone(self) -> None:
        self.exists, self.files, self.partitions = False, {}, {}

    def _add(self, e: dict[str, Any]) -> None:
        for spec, where in _places(e):
            if spec:
                key = spec_key(spec)
                if where is not None or key not in self.partitions:
                    self.partitions[key] = (spec, where)
        for row in _rows(e):
            self.files[row.path] = row


def _definitions(log_: Log, before: int) -> dict[Name, dict[str, Any]]:
    """The newest definition of every table the log holds before event `before`: one
    pass, however many tables a DROP DATABASE brings back."""
    out: dict[Name, dict[str, Any]] = {}
    for e in log_.scan(1, before - 1):
        name = _defines(e)
        if name is not None and e["eventType"] in ("CREATE_TABLE", "ALTER_TABLE",
                                                   "ALTER_LOCATION"):
            out[name] = e["tableObj"]
    return out


def _definition(defs: dict[Name, dict[str, Any]], name: Name, before: int,
                required: bool = True) -> dict[str, Any] | None:
    """`name`'s definition in `defs` (those before event `before`); None, when not
    `required`, if there is none."""
    obj = defs.get(name)
    if obj is None and required:
        raise ReplError(
            f"no definition of {'.'.join(name)} in the event log",
            f"the log holds no CREATE_TABLE or ALTER_TABLE of it before event {before} (it"
            " was created before cmroot recorded events, or the log was cut): the files can"
            " still be fetched one by one (cmroot get)",
        )
    return obj


# -- targets ---------------------------------------------------------------------------------
def _event_targets(log_: Log, e: dict[str, Any], dst: Name | None) -> list[Target]:
    kind, event_id = str(e["eventType"]), int(e["id"])
    if kind not in UNDOES:
        raise BadRequest(
            f"event {event_id} is a {kind}: nothing to undo",
            "give a DROP_TABLE, DROP_PARTITION, INSERT_OVERWRITE, TRUNCATE or DROP_DATABASE"
            " event (cmroot ls shows the events that recycled files), or rebuild a table as"
            " it was with --db, --table and --as-of",
        )
    if kind == "DROP_DATABASE":
        if dst is not None:
            raise BadRequest("--as renames one table", "a database comes back under its name")
        defs = _definitions(log_, event_id)
        return [_event_target(log_, d, None, defs) for d in _cascade(log_, e)]
    return [_event_target(log_, e, dst, _definitions(log_, event_id))]


def _cascade(log_: Log, e: dict[str, Any]) -> list[dict[str, Any]]:
    """The DROP_TABLE events of a DROP DATABASE ... CASCADE: those of its database right
    before it (by the same statement, when the log says who asked)."""
    db, eid = str(e.get("db") or "").lower(), int(e["id"])
    window = list(log_.scan(max(1, eid - _PAGE), eid - 1))
    out = []
    for x in reversed(window):
        if str(x.get("db") or "").lower() != db:
            continue
        if x["eventType"] != "DROP_TABLE" or (e.get("audit") and x.get("audit") != e["audit"]):
            break
        out.append(x)
    return list(reversed(out))


def _event_target(log_: Log, e: dict[str, Any], dst: Name | None,
                  defs: dict[Name, dict[str, Any]]) -> Target:
    kind, eid = str(e["eventType"]), int(e["id"])
    src: Name = (str(e.get("db") or "").lower(), str(e.get("table") or "").lower())
    if not all(src):
        raise ReplError(f"event {eid} names no table", f"a {kind} without db and table")
    location = str(e.get("location") or "").rstrip("/")
    if not location:
        raise ReplError(f"event {eid} does not say where {'.'.join(src)} was",
                        "recorded by an older cmroot: fetch its files with cmroot get")
    files = _rows(e)
    if kind == "DROP_TABLE":
        return Target(kind, eid, src, dst or src, _definition(defs, src, eid), location,
                      _places(e), files, whole=True)
    if kind == "DROP_PARTITION":
        return Target(kind, eid, src, dst or src, _definition(defs, src, eid, dst is not None),
                      location, _places(e), files, whole=dst is not None)
    # An overwrite or truncate: undone in place, the partitions its statement made go too.
    drop: list[Spec] = []
    if dst is None:
        listed = {spec_key(s) for s, _ in _places(e)}
        for x in _statement(log_, e, src):
            for spec, _ in _places(x):
                if spec and spec_key(spec) not in listed and x["eventType"] != "DROP_PARTITION":
                    listed.add(spec_key(spec))
                    drop.append(spec)
    return Target(kind, eid, src, dst or src, _definition(defs, src, eid, dst is not None),
                  location, _places(e), files, whole=dst is not None, drop=drop,
                  alive=dst is None)


def _statement(log_: Log, e: dict[str, Any], name: Name) -> list[dict[str, Any]]:
    """The events the statement of `e` recorded on `name` after it (an overwrite's INSERT,
    ADD_PARTITION and DROP_PARTITION): the next ones on that table, asked by the same
    application and statement."""
    if not e.get("audit"):
        return []
    out = []
    for x in log_.scan(int(e["id"]) + 1):
        if not _about(x, name):
            continue
        if x["eventType"] not in ("INSERT", "ADD_PARTITION", "DROP_PARTITION") \
                or x.get("audit") != e["audit"]:
            break
        out.append(x)
    return out


def _as_of_target(log_: Log, name: Name, upto: int, partition: Spec | None,
                  dst: Name | None) -> Target:
    state = State(name)
    for e in log_.scan(1, upto):
        state.apply(e)
    if state.gap is not None:
        raise ReplError(f"the event log does not cover {'.'.join(name)} up to event {upto}",
                        f"{state.gap}; nothing was changed")
    if not state.exists or state.obj is None:
        raise NotFound(f"{'.'.join(name)} did not exist at event {upto}",
                       "give a later --as-of, or another table")
    places = list(state.partitions.values())
    files = list(state.files.values())
    if partition is not None:
        key = spec_key(partition)
        places = [p for p in places if spec_key(p[0]) == key]
        if not places:
            raise NotFound(f"{'.'.join(name)} had no partition {partition} at event {upto}",
                           "give a partition it had (SHOW PARTITIONS at the time)")
        where = places[0][1] or os.path.join(
            state.location or "", tabledef.partition_dir(partition,
                                                         tabledef.partition_columns(state.obj)))
        files = [f for f in files if f.path.startswith(where.rstrip("/") + "/")]
    return Target("AS_OF", upto, name, dst or name, state.obj, (state.location or "").rstrip("/"),
                  places, files, whole=partition is None)


# -- planning and applying -------------------------------------------------------------------
@dataclass
class Plan:
    target: Target
    result: TableResult
    replace_table: bool  # drop the live table first
    location: str  # the restored table's directory
    keys: list[str]
    want: dict[str, FileRow]  # destination path -> the file it must hold
    copies: list[Copy]
    recycle: list[str]
    add: list[tuple[Spec, str]]  # partitions to register, at these directories
    drop: list[Spec]
    roots: list[str]  # the directories made exact


class Restorer:
    def __init__(self, spark: Any, client: Client, log_: Log, replace: bool,
                 report: Report) -> None:
        self.spark = spark
        self.dest = Destination(spark)
        self.client = client
        self.log = log_
        self.replace = replace
        self.report = report

    def plan(self, t: Target) -> Plan:
        db, table = t.dst
        name = f"{db}.{table}"
        exists = self.dest.has_table(db, table)
        if t.alive and not exists:
            raise NotFound(f"{name} does not exist",
                           f"event {t.event} changed a table that is gone since: restore its"
                           " DROP_TABLE first, or this event's files under another name (--as)")
        obj = t.table_obj
        keys = (tabledef.partition_columns(obj) if obj is not None
                else self.dest.partition_columns(db, table))
        replace_table = False
        if exists and obj is not None and not self._same_shape(db, table, obj, keys):
            if not self.replace or t.alive:
                raise ReplError(f"{name} exists with another definition",
                                "restore under another name (--as DB.TABLE), or give --replace"
                                " to drop it first (its files go to the cmroot, as a DROP TABLE"
                                " would)")
            replace_table = True
        location = self._location(t, obj, exists and not replace_table)
        want = {self._dst_path(t, location, f.path): f for f in t.files}
        places = self._place_dirs(t, location, keys)
        live_specs = (self._live_specs(db, table)
                      if exists and not replace_table and keys else {})
        roots: list[str]
        if t.whole or not keys:
            roots = [location] + [d for d, _ in live_specs.values()]
            roots += [d for d, _ in places]
        else:
            roots = [d for d, _ in places]
            roots += [live_specs[spec_key(s)][0] for s in t.drop if spec_key(s) in live_specs]
        live = _listing(roots)
        # An external table's drop leaves its files where they are (its event lists none):
        # they are the table's own, and it comes back over them.
        adopt = ((not exists or replace_table) and obj is not None
                 and tabledef.is_external(obj) and t.op in ("DROP_TABLE", "DROP_DATABASE"))
        recycle, copies = [], []
        for path in sorted(live):
            f = want.get(path)
            if f is None and adopt:
                continue
            if f is None or not _holds(path, f):
                recycle.append(path)
        for d, spec in places:
            have = live_specs.get(spec_key(spec))
            if have is not None and have[0] != d:
                raise ReplError(
                    f"partition {spec} of {name} exists elsewhere",
                    f"it lies at {have[0]}, not at {d} where event {t.event} had it: drop"
                    " it (its files go to the cmroot), or restore under another name (--as)",
                )
        if (not exists or replace_table) and obj is not None and not tabledef.is_external(obj):
            left = _leftovers(location)
            if left:
                raise ReplError(
                    f"{location} holds what a writer left: {left}",
                    f"Spark makes no managed table {name} over a directory that is not"
                    " empty: remove it (no table reads it), then run the restore again",
                )
        for path, f in want.items():
            if path in live and path not in recycle and not replace_table:
                continue  # (a dropped table's directory goes with it: all are copied)
            copies.append(Copy(f.path, path, f.checksum, f.size))
        if recycle and not t.alive and not self.replace and not replace_table:
            more = f" (and {len(recycle) - 1} more)" if len(recycle) > 1 else ""
            raise ReplError(
                f"{name} holds data the restore would replace",
                f"{recycle[0]}{more} is not what event {t.event} restores: restore under"
                " another name (--as DB.TABLE), or give --replace to move what is there to"
                " the cmroot first (recorded as an INSERT_OVERWRITE, so it can be undone too)",
            )
        self._check_reachable(copies, t)
        if keys:
            specs: dict[str, tuple[Spec, str]] = {}
            for d, spec in places:
                specs[spec_key(spec)] = (spec, d)
            for path in list(want) + (sorted(live) if adopt else []):
                spec = tabledef.spec_of(os.path.relpath(os.path.dirname(path), location), keys)
                if spec and spec_key(spec) not in specs and path.startswith(location + "/"):
                    specs[spec_key(spec)] = (spec, os.path.join(location,
                                                                tabledef.partition_dir(spec, keys)))
            add = [(s, d) for k, (s, d) in specs.items() if k not in live_specs]
            drop = [s for s in t.drop if spec_key(s) in live_specs]
            if t.whole:
                drop += [s for k, (_, s) in live_specs.items()
                         if k not in specs and s not in drop]
        else:
            add, drop = [], []
        result = TableResult(db, table, t.op, t.event, created=not exists or replace_table,
                             partitions_added=[s for s, _ in add], partitions_dropped=drop,
                             files=len(want), bytes=sum(f.size for f in want.values()),
                             copied=len(copies), copied_bytes=sum(c.size for c in copies),
                             recycled=len(recycle), replaced=replace_table)
        result.recycled_bytes = sum(_size(p) for p in recycle)
        return Plan(t, result, replace_table, location, keys, want, copies, recycle,
                    add, drop, roots)

    def _same_shape(self, db: str, table: str, obj: dict[str, Any], keys: list[str]) -> bool:
        """Does the live table read the restored files as the definition does (same
        partition columns, same data columns)?"""
        live = [k.lower() for k in self.dest.partition_columns(db, table)]
        if live != [k.lower() for k in keys]:
            return False
        if (tabledef.provider(obj) or "hive").lower() != \
                (self.dest.provider(db, table) or "hive").lower():
            return False  # the files are read in another format
        want = [(n.lower(), t.replace(" ", "").lower()) for n, t in tabledef.columns(obj)
                if n.lower() not in live]
        have = [(n.lower(), t.replace(" ", "").lower())
                for n, t in self.dest.data_schema(db, table)]
        return want == have

    def _location(self, t: Target, obj: dict[str, Any] | None, keep: bool) -> str:
        """Where the restored table lives: the live table's directory, the definition's for
        an external table, else the catalog's default place for a managed one."""
        db, table = t.dst
        if keep:
            return self.dest.location(db, table)
        if obj is not None and tabledef.is_external(obj):
            if t.dst != t.src:
                raise BadRequest(
                    f"{'.'.join(t.src)} is an external table",
                    "an external table comes back at its own location: restore it without"
                    " --as",
                )
            return (tabledef.location(obj) or t.location).rstrip("/")
        base = (self.dest.db_location(db) if self.dest.has_db(db)
                else os.path.join(self.dest.warehouse(), f"{db}.db"))
        return os.path.join(base, table)

    def _dst_path(self, t: Target, location: str, path: str) -> str:
        if path.startswith(t.location + "/"):
            dst = os.path.normpath(os.path.join(location, path[len(t.location) + 1:]))
            if not dst.startswith(location + "/"):
                raise ReplError("bad path in the event log", f"event {t.event}: {path}")
            return dst
        if location == t.location and any(
                w is not None and path.startswith(w.rstrip("/") + "/") for _, w in t.partitions):
            return path  # a partition at its own place, restored where it was
        raise BadRequest(
            f"{path} lies outside {'.'.join(t.src)}'s directory",
            f"only a file of a partition at its own location lies outside its table, and"
            f" such a partition comes back there only (restore event {t.event} without --as)",
        )

    def _dst_dir(self, t: Target, location: str, src: str) -> str:
        """Where a directory of the source table comes back."""
        return location if src == t.location else os.path.dirname(
            self._dst_path(t, location, os.path.join(src, "_")))

    def _place_dirs(self, t: Target, location: str, keys: list[str]) -> list[tuple[str, Spec]]:
        out = []
        for spec, where in t.partitions:
            if not spec or not keys or not all(k in spec for k in keys):
                continue
            src = where or os.path.join(t.location, tabledef.partition_dir(spec, keys))
            out.append((self._dst_dir(t, location, src), spec))
        return out

    def _live_specs(self, db: str, table: str) -> dict[str, tuple[str, Spec]]:
        """The live table's partitions: spec_key -> (directory, spec)."""
        return {spec_key(spec): (d, spec) for spec, d in self.dest.partitions(db, table)}

    def _check_reachable(self, copies: list[Copy], t: Target) -> None:
        """Fail before anything changes when a file is neither at its path nor in the
        cmroot."""
        scope = ".".join(t.dst)
        for i in range(0, len(copies), 5000):
            batch = copies[i:i + 5000]
            answer = resolve(self.client, [{"path": c.src, "checksum": c.checksum}
                                           for c in batch], scope)
            for c, a in zip(batch, answer, strict=True):
                if a.status == "missing":
                    raise FileLost(
                        f"file lost: {c.src}",
                        f"{c.src} (checksum {c.checksum}, event {t.event}) is neither at its"
                        f" path nor in the cmroot: it expired (store.retain) or was never"
                        f" recycled. Nothing of {scope} was changed",
                    )

    def apply(self, p: Plan) -> None:
        """Converge on the plan. A table that must be made is made first, while its
        directory is empty (Spark refuses a managed table over data), so a rerun after a
        crash finds it and goes on; files arrive in hidden temporaries, what is in their
        way goes to the cmroot in one recycle, then they are renamed into place."""
        _t, (db, table) = p.target, p.target.dst
        if p.replace_table:
            self.dest.drop_table(db, table)  # recorded and recycled by the hook
            p.recycle = [path for path in p.recycle if os.path.lexists(path)]
        sweep(p.roots)
        if not self.dest.has_table(db, table):
            self._recycle(p)  # what lies where the table is made (--replace)
            self._create(p)
        faults.point("restore.created")
        done = []
        if p.copies:
            done = copy_on_spark(self.spark, p.copies, self.client.url, self.client.token,
                                 self.report, f"cmroot restore {db}.{table}")
            bad = [c for c in done if c.source in ("failed", "lost")]
            if bad:
                discard(done)
                if bad[0].fault is not None:
                    raise daemon_error(bad[0].fault, bad[0].error or "", self.client.url,
                                       f"{db}.{table}")
                raise ReplError(f"cannot put back {bad[0].dst}",
                                f"{bad[0].error}. No file was put back: mend that (space,"
                                " permissions, the daemon) and run the restore again")
        try:
            self._recycle(p)
        except Exception:  # refused: no file was put back (a crash leaves temporaries: swept)
            discard(done)
            raise
        faults.point("restore.recycled")
        publish(done)
        faults.point("restore.published")
        if p.keys:
            default = {spec_key(s) for s, d in p.add
                       if d == os.path.join(p.location, tabledef.partition_dir(s, p.keys))}
            places = {spec_key(s): d for s, d in p.add if spec_key(s) not in default}
            self.dest.add_partitions(db, table, [s for s, _ in p.add], p.keys, places)
            self.dest.drop_partitions(db, table, p.drop, p.keys)
        self.dest.refresh(db, table)
        self._record(p)

    def _create(self, p: Plan) -> None:
        t, (db, table) = p.target, p.target.dst
        obj = t.table_obj
        if obj is None:  # planned only for a table that exists
            raise ReplError(f"{db}.{table} disappeared during the restore",
                            "run the restore again")
        if not self.dest.has_db(db):
            self.dest.create_db(db)
        external = p.location if tabledef.is_external(obj) else None
        self.dest.create_table(obj, db, table, None, external)
        made = self.dest.location(db, table)
        if made != p.location:
            self.dest.drop_table(db, table)  # empty: nothing of it is lost
            raise ReplError(f"{db}.{table} would be made at {made}, not at {p.location}",
                            "its database's location changed since: restore under another"
                            " name (--as DB.TABLE)")

    def _recycle(self, p: Plan) -> None:
        """Move what is in the restore's way to the cmroot, as one INSERT_OVERWRITE."""
        if not p.recycle:
            return
        t, (db, table) = p.target, p.target.dst
        specs = sorted({spec_key(s) for s, _ in t.partitions} | {spec_key(s) for s in t.drop})
        rec = self.client.recycle(
            p.recycle, op=EventType.INSERT_OVERWRITE.value, db=db, table=table,
            partitions=[json.loads(k) for k in specs] or None, location=p.location,
        )
        p.recycle = []
        p.result.events.append(rec.event_id)

    def _record(self, p: Plan) -> None:
        """INSERT the files the log does not show in place: what came back into a table or
        partition that existed (the hook lists the files of what it saw created)."""
        t, (db, table) = p.target, p.target.dst
        view = State((db, table), exists=True)
        for e in self.log.scan(t.event + 1):
            view.apply(e)
        shown = {path: f.checksum for path, f in view.files.items()}
        # Hidden and housekeeping names (.crc, _SUCCESS) are never data a replica reads,
        # and the hook lists none: they are put back, not recorded.
        todo = sorted(path for path, f in p.want.items() if shown.get(path) != f.checksum
                      and not os.path.basename(path).startswith((".", "_")))
        if not todo:
            return
        specs: dict[str, Spec] = {}
        for path in todo:
            spec = tabledef.spec_of(os.path.relpath(os.path.dirname(path), p.location), p.keys)
            if spec:
                specs[spec_key(spec)] = spec
        p.result.events.append(self.client.add_event(
            "INSERT", db=db, table=table, partitions=list(specs.values()), location=p.location,
            files=[{"path": path} for path in todo],
        ))


def _listing(roots: Iterable[str]) -> set[str]:
    """The files below `roots`, leaving out what a writer has in flight."""
    out: set[str] = set()
    for top in sorted(set(roots)):
        for d, dirs, files in os.walk(top):
            dirs[:] = [n for n in dirs if not n.startswith(_IN_FLIGHT)]
            out.update(os.path.join(d, f) for f in files if not f.startswith(_IN_FLIGHT))
    return out


def _leftovers(top: str) -> str | None:
    """The first entry in flight (a writer's temporary) below `top`, if any."""
    for d, dirs, names in os.walk(top):
        for n in dirs + names:
            if n.startswith(_IN_FLIGHT):
                return os.path.join(d, n)
    return None


def _holds(path: str, f: FileRow) -> bool:
    try:
        return os.path.getsize(path) == f.size and cks.of_local_file(path) == f.checksum
    except OSError:
        return False


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0

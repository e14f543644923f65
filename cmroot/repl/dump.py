"""`cmroot repl dump`: write a dump directory for a database or one table.

Incremental (`from_id` given): the events after `from_id` that concern the scope, read
from the daemon; no Spark needed. Bootstrap: the scope's tables, partitions and files as
they are now, listed through Spark and hashed on the executors, written as snapshot events
sharing the event id the dump started at; the events that happened while listing follow,
so replaying the dump gives the source as of its last event id."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cmroot import checksum as cks
from cmroot import faults
from cmroot.client import Client
from cmroot.exceptions import BadRequest, ReplError
from cmroot.repl import dumpdir, tabledef
from cmroot.repl.catalog import scala_map, spec_key
from cmroot.repl.dumpdir import DumpEvent, Header, Name

log = logging.getLogger(__name__)

PAGE = 1000  # the daemon's largest page of events
_ROUNDS = 10  # snapshot rounds before a bootstrap gives up on tables that keep moving
_WAIT = 0.2  # seconds between rounds waiting for a vanished table's event
_ALL = "*"  # not a table name: the whole database was dropped
# Names Spark, Hive and cmroot write beside data files and never read as data.
_HIDDEN = (".", "_")


def dump(
    client: Client,
    db: str,
    table: str | None,
    to_dir: str,
    from_id: int | None = None,
    to_id: int | None = None,
    limit: int | None = None,
    spark: Any = None,
    progress: Callable[[str, int, int | None], None] | None = None,
    name_now: str | None = None,
) -> tuple[str, Header]:
    """Write a dump under `to_dir`; returns its directory and header. `name_now`: for an
    incremental dump of one table, the "db.table" the source calls it at `from_id` when
    renames moved it since the scope was named (the previous dump's `table_now`)."""
    db = db.lower()
    table = table.lower() if table else None
    src_db, src_table = db, table
    if name_now is not None and table is not None:
        src_db, _, src_table = name_now.lower().partition(".")
    if limit is not None and limit < 1:
        raise BadRequest("bad --limit", f"{limit}: give a positive number of events")
    if from_id is None and (to_id is not None or limit is not None):
        raise BadRequest("--to and --limit need --from", "a bootstrap dumps everything up to now")
    report = progress or (lambda what, done, total: None)
    if from_id is None:
        if spark is None:
            raise ReplError("a bootstrap dump needs Spark", "pip install 'cmroot[spark]'")
        kind = "bootstrap"
        start = client.current_event()
        events, read_after = _snapshot(spark, client, src_db, src_table, start, report)
        tail, last = _events(client, src_db, src_table, start, None, None, report)
        events += tail
        first = start
    else:
        kind = "incremental"
        events, last = _events(client, src_db, src_table, from_id, to_id, limit, report)
        first, read_after = from_id, {}
    tables = _table_metadata(events)
    for (tdb, name), after in read_after.items():
        tables[f"{tdb}.{name}"]["read_after"] = after
    header = Header(kind, db, table, first, last, time.time(), client.url,
                    source=client.log_id(),
                    table_now=_name_at_end(src_db, src_table, events))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(header.created))
    url = posixpath.join(to_dir.rstrip("/"), f"{header.scope}-{kind}-{first}-{last}-{stamp}")
    dumpdir.write(url, header, events, tables)
    return url, header


def _events(
    client: Client,
    db: str,
    table: str | None,
    after: int,
    to_id: int | None,
    limit: int | None,
    report: Callable[[str, int, int | None], None],
) -> tuple[list[DumpEvent], int]:
    """Events after `after` (up to `to_id`, at most `limit` in scope) and the id the dump is
    consistent as of: the last event read, in scope or not."""
    end = client.current_event() if to_id is None else min(to_id, client.current_event())
    picked: list[DumpEvent] = []
    last = end if end > after else after
    for e, relevant in dumpdir.in_scope(_scan(client, after, end, report), db, table):
        if relevant:
            if limit is not None and len(picked) == limit:
                last = picked[-1].id  # the rest waits for the next dump
                break
            picked.append(DumpEvent.from_api(e))
    return picked, last


def _name_at_end(db: str, table: str | None, events: list[DumpEvent]) -> str | None:
    """A table-level dump's table as "db.table" after the dump's renames of it."""
    if table is None:
        return None
    now = (db, table)
    for e in events:
        if (names := e.renamed()) is not None and names[0] == now:
            now = names[1]
    return ".".join(now)


def after(
    client: Client, previous: str, to_dir: str, to_id: int | None = None,
    limit: int | None = None, progress: Callable[[str, int, int | None], None] | None = None,
) -> tuple[str, Header]:
    """The incremental dump that continues the dump at `previous`: the same scope, from its
    last event id, the table followed to the name it had then."""
    prev = dumpdir.read(previous).header
    if prev.source and prev.source != client.log_id():
        raise ReplError(
            "the previous dump is of another source",
            f"{previous} was taken of event log {prev.source} ({prev.daemon_url}); this daemon"
            f" ({client.url}) keeps another: dump from the daemon the replica follows",
        )
    return dump(client, prev.db, prev.table, to_dir, prev.last_event_id, to_id, limit,
                progress=progress, name_now=prev.table_now)


def _table_metadata(events: list[DumpEvent]) -> dict[str, dict[str, Any]]:
    """The newest definition of every table the dump touches (keyed `db.table`)."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.table_obj is not None:
            name = f"{e.table_obj.get('db', e.db)}.{e.table_obj.get('table', e.table)}"
            meta = out.setdefault(name.lower(), {"partitions": None})
            meta["tableObj"] = e.table_obj
    return out


# -- bootstrap ---------------------------------------------------------------------------


def table_obj(spark: Any, db: str, table: str) -> dict[str, Any]:
    """The table's definition in the shape the hook records (needs the shim jar)."""
    jvm = spark.sparkContext._jvm
    raw = (
        spark._jsparkSession.sharedState()
        .externalCatalog()
        .unwrapped()
        .client()
        .getRawHiveTable(db, table)
        .rawTable()
    )
    try:
        text = jvm.io.cmroot.core.Cmroot.tableJson(raw)
    except Exception as e:
        raise ReplError(
            "cannot read table definitions",
            f"{db}.{table}: {e}; run the dump on a session configured with the cmroot hook "
            "(cmroot.spark.configure, or `cmroot repl dump` which does it)",
        ) from None
    return dict(json.loads(text))


def _recorded(spark: Any, location: str) -> bool:
    """Does the hook record the events of a table at `location`?"""
    jvm = spark.sparkContext._jvm
    hconf = spark.sparkContext._jsc.hadoopConfiguration()
    return bool(jvm.io.cmroot.core.Cmroot.recordsAt(location, hconf))


def _partitions(spark: Any, db: str, table: str) -> list[dict[str, str]]:
    from urllib.parse import unquote

    rows = spark.sql(f"SHOW PARTITIONS {tabledef.qualified(db, table)}").collect()
    out = []
    for r in rows:
        spec = {}
        for seg in r[0].split("/"):
            k, _, v = seg.partition("=")
            spec[unquote(k)] = unquote(v)
        out.append(spec)
    return out


def _own_locations(spark: Any, db: str, table: str, defaults: set[str]) -> dict[str, str]:
    """The partitions of the table away from their default places (`defaults`): spec (as
    `spec_key`) -> local path. Only those have their spec read: that costs a call each."""
    jvm = spark.sparkContext._jvm
    parts = spark._jsparkSession.sharedState().externalCatalog().listPartitions(
        db, table, jvm.scala.Option.empty()
    )
    out = {}
    it = parts.iterator()
    while it.hasNext():
        p = it.next()
        where = str(p.location().getPath()).rstrip("/")
        if where not in defaults:
            out[spec_key(scala_map(p.spec()))] = where
    return out


@dataclass
class _Taken:
    """One table as the snapshot read it: its definition, partitions and files (by
    partition spec as JSON)."""

    obj: dict[str, Any]
    specs: list[dict[str, str]]
    places: dict[str, str] = field(default_factory=dict)  # spec_key -> its directory
    files: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _snapshot(
    spark: Any,
    client: Client,
    db: str,
    table: str | None,
    start: int,
    report: Callable[[str, int, int | None], None],
) -> tuple[list[DumpEvent], dict[Name, int]]:
    """The scope's tables as snapshot events at `start`, consolidated with what ran while
    they were read (the Hive v2 design's consolidation at the source), and for each table
    the event id its read began after.

    The load replays every event after `start` on top of the snapshot, and each replayed
    event sets what it touches, so a table read at any moment after `start` ends right,
    with one exception: a rename carries the table's state along. A table a rename touched
    while it was read may have been read half before and half after (its definition at
    the old place, no files), or not at all (gone when its definition was asked). Such a
    table is read again, in rounds, under the names the renames left, until a round reads
    no table that a rename touched meanwhile. A table read in a later round holds every
    event on its name up to where that round began: the load skips those (a replayed
    rename or drop would undo the newer read). A table that vanished unexplained (its
    event not yet in the log) is waited for."""
    if not spark.catalog.databaseExists(db):
        raise ReplError("no such database", f"{db}: check the name (cmroot repl dump DB)")
    pending: list[Name] = [(db, table)] if table else sorted(
        (db, t.name.lower()) for t in spark.catalog.listTables(db)
        if not t.isTemporary and t.tableType != "VIEW"
    )
    faults.point("dump.tables_listed")
    taken: dict[Name, tuple[_Taken, int]] = {}
    since = start
    explained: set[Name] = set()
    for first in (i == 0 for i in range(_ROUNDS)):
        got, unstable = _take(spark, pending, report)
        upto = client.current_event()
        moved, gone = _moves(_scan(client, since, upto))
        if table is None:  # the database: renames of its tables (either end)
            moved = {n for n in moved if n[0] == db}
        else:  # one table: only its own renames, into other databases too
            chain = _follow((db, table), _scan(client, start, upto))
            moved &= set(chain)
        explained |= gone | moved
        for n in moved | unstable:
            taken.pop(n, None)
        taken.update((n, (t, since)) for n, t in got.items() if n not in moved | unstable)
        missing = {n for n in pending if n not in got or n in unstable}
        waiting = {n for n in missing if n not in explained and (n[0], _ALL) not in explained}
        if first and table is not None and (db, table) in waiting:
            raise ReplError(
                "no such table",
                f"{db}.{table} does not exist (and the log holds no rename or drop of it):"
                " check the name (cmroot repl dump DB.TABLE)",
            )
        pending = sorted(moved | unstable | waiting)
        if table is not None and pending:
            pending = [chain[-1]]  # read it under the name it has now
        since = upto
        if not pending:
            break
        if waiting:
            time.sleep(_WAIT)  # a rename or drop on its way into the log
    else:
        raise ReplError(
            "tables kept moving while the bootstrap read them",
            f"{', '.join('.'.join(n) for n in pending)} were renamed, dropped, moved or had"
            f" partitions added in each of {_ROUNDS} rounds: dump again when they settle",
        )
    events: list[DumpEvent] = []
    if table is None:
        events.append(DumpEvent(start, 0, "CREATE_DATABASE", db, None))
    for (tdb, name), (t, _) in sorted(taken.items()):
        loc = tabledef.location(t.obj)
        events.append(DumpEvent(start, len(events), "CREATE_TABLE", tdb, name, location=loc,
                                table_obj=t.obj))
        for spec in t.specs:
            got_files = sorted(t.files.get(spec_key(spec), []), key=lambda f: str(f["path"]))
            kind = "ADD_PARTITION" if spec else "INSERT"
            if spec or got_files:
                events.append(DumpEvent(
                    start, len(events), kind, tdb, name, [spec] if spec else [], loc,
                    files=got_files,
                    partition_locations=[t.places[spec_key(spec)]] if spec else None))
    return events, {n: after for n, (_, after) in taken.items() if after > start}


def _take(
    spark: Any, names: list[Name], report: Callable[[str, int, int | None], None]
) -> tuple[dict[Name, _Taken], set[Name]]:
    """Read each table (definition, partitions, then every file listed and hashed on the
    executors in one batch): the tables read, and those that changed while they were read
    (their definition gone or moved, or a partition added between the reads of partition
    names and places: to be read again). A name that is a view now is not read."""
    got: dict[Name, _Taken] = {}
    changed: set[Name] = set()  # partitions added between reading their names and places
    # (table as "db.table", spec_key, directory, its subdirectories that are other
    # partitions' and not listed with it)
    dirs: list[tuple[str, str, str, tuple[str, ...]]] = []
    for db, name in names:
        try:
            obj = table_obj(spark, db, name)
            if obj.get("tableType") == "VIRTUAL_VIEW":
                continue  # a view took the name: views are not replicated
            keys = tabledef.partition_columns(obj)
            specs = _partitions(spark, db, name) if keys else [{}]
            faults.point("dump.partitions_listed")
            loc = tabledef.location(obj)
            places = {spec_key(spec): f"{loc}/{tabledef.partition_dir(spec, keys)}"
                      for spec in specs} if keys else {spec_key({}): str(loc)}
            own = _own_locations(spark, db, name, set(places.values())) if keys else {}
        except ReplError:
            raise
        except Exception as e:  # dropped or renamed while we looked: its event follows
            log.info("table gone during bootstrap", extra={"table": f"{db}.{name}", "err": str(e)})
            continue
        if loc is None or not loc.startswith("/"):
            raise ReplError(
                "table location not on the local filesystem",
                f"{db}.{name} at {loc}: only local warehouses are replicated by this version",
            )
        if not _recorded(spark, loc):
            raise ReplError(
                "table outside the warehouse roots",
                f"{db}.{name} is at {loc}, where the cmroot hook records nothing: its replica"
                " would never change again. Move it under a root (ALTER TABLE ... SET"
                " LOCATION), add its directory to the roots (spark.cmroot.warehouseRoots and"
                " the daemon's store.warehouse_roots), or replicate the other tables one by"
                " one",
            )
        if not own.keys() <= places.keys():
            # A partition the names did not have: added between the two reads. The table
            # is read again in the next round, as one a rename touched.
            log.info("partitions changed during bootstrap", extra={"table": f"{db}.{name}"})
            changed.add((db, name))
            continue
        for key, where in own.items():
            if (f"{loc}/").startswith(where + "/"):
                raise ReplError(
                    "partition at its table's own directory",
                    f"{db}.{name} has partition {key} at {where}, which holds the table's"
                    f" directory {loc} (and so every other partition): such a partition is"
                    " not replicated; give it a directory of its own (ALTER TABLE ..."
                    " PARTITION (...) SET LOCATION)",
                )
            if not _recorded(spark, where):
                raise ReplError(
                    "partition outside the warehouse roots",
                    f"{db}.{name} has partition {key} at {where}, where the cmroot hook"
                    " records nothing: its replica would never change again. Move it under a"
                    " root (ALTER TABLE ... PARTITION (...) SET LOCATION), or add its"
                    " directory to the roots",
                )
            places[key] = where
        got[(db, name)] = _Taken(obj, specs, places)
        nested = _nested(list(places.values())) if own else {}
        for key, where in places.items():
            dirs.append((f"{db}.{name}", key, where, nested.get(where, ())))
    faults.point("dump.defined")
    listed = _list_files(spark, dirs)
    faults.point("dump.files_listed")
    for key, spec, path, checksum, size in _hash_files(spark, listed, report):
        tdb, _, name = key.partition(".")
        got[(tdb, name)].files.setdefault(spec, []).append(
            {"path": path, "checksum": checksum, "size": size}
        )
    unstable = changed
    for (db, name), t in got.items():
        try:
            now = tabledef.location(table_obj(spark, db, name))
        except ReplError:
            raise
        except Exception:
            now = None
        if now != tabledef.location(t.obj):
            unstable.add((db, name))
    return got, unstable


def _scan(
    client: Client, after: int, end: int,
    report: Callable[[str, int, int | None], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The daemon's events in (after, end], page by page."""
    nxt, read = after + 1, 0
    while nxt <= end:
        page = [e for e in client.events(nxt, PAGE) if e["id"] <= end]
        if not page:
            return
        yield from page
        read += len(page)
        nxt = page[-1]["id"] + 1
        if report is not None:
            report("events read", read, end - after)


def _moves(events: Iterator[dict[str, Any]]) -> tuple[set[Name], set[Name]]:
    """The names renames touched (either end), and the names events dropped (explaining why
    a table vanished; (db, `_ALL`) when the database was)."""
    moved: set[Name] = set()
    gone: set[Name] = set()
    for e in events:
        e_db, e_table = e.get("db"), e.get("table")
        if not isinstance(e_db, str):
            continue
        if e.get("eventType") == "DROP_DATABASE":
            gone.add((e_db.lower(), _ALL))
        elif e.get("eventType") == "DROP_TABLE" and isinstance(e_table, str):
            gone.add((e_db.lower(), e_table.lower()))
        elif (r := dumpdir.renamed(e)) is not None:
            moved |= set(r)
    return moved, gone


def _follow(name: Name, events: Iterator[dict[str, Any]]) -> list[Name]:
    """The names a table took through the renames among `events`, in order: the last is
    its name now."""
    chain = [name]
    for e in events:
        r = dumpdir.renamed(e)
        if r is not None and r[0] == chain[-1]:
            chain.append(r[1])
    return chain


def _nested(dirs: list[str]) -> dict[str, tuple[str, ...]]:
    """For each of a table's partition directories, the others inside it: a file belongs
    to the deepest partition directory holding it."""
    ordered = sorted(set(dirs), key=lambda d: d + "/")
    out: dict[str, tuple[str, ...]] = {}
    for i, d in enumerate(ordered):
        inside = []
        for other in ordered[i + 1:]:
            if not other.startswith(d + "/"):
                break
            inside.append(other)
        if inside:
            out[d] = tuple(inside)
    return out


def _list_files(
    spark: Any, dirs: list[tuple[str, str, str, tuple[str, ...]]]
) -> list[tuple[str, str, str, int]]:
    """(table, spec, path, size) of every data file under each directory (but not under
    the other partitions' directories inside it), listed on the executors."""
    if not dirs:
        return []

    def walk(
        rows: Iterator[tuple[str, str, str, tuple[str, ...]]],
    ) -> Iterator[tuple[str, str, str, int]]:
        for name, spec, d, others in rows:
            for root, subdirs, fnames in os.walk(d):
                subdirs[:] = sorted(s for s in subdirs if not s.startswith(_HIDDEN)
                                    and os.path.join(root, s) not in others)
                for f in sorted(fnames):
                    if f.startswith(_HIDDEN):
                        continue
                    p = os.path.join(root, f)
                    try:
                        yield name, spec, p, os.stat(p).st_size
                    except FileNotFoundError:
                        pass  # dropped while listed: its event is in the dump

    slices = max(1, min(len(dirs), spark.sparkContext.defaultParallelism * 4))
    return list(spark.sparkContext.parallelize(dirs, slices).mapPartitions(walk).collect())


def _hash_files(
    spark: Any,
    files: list[tuple[str, str, str, int]],
    report: Callable[[str, int, int | None], None],
) -> list[tuple[str, str, str, str, int]]:
    """(table, spec, path, checksum, size), hashed on the executors, in batches so the
    progress line moves; a file gone meanwhile is left out (its drop is in the dump)."""
    if not files:
        return []

    def hash_rows(
        rows: Iterator[tuple[str, str, str, int]],
    ) -> Iterator[tuple[str, str, str, str, int]]:
        for name, spec, path, _ in rows:
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    digest = cks.of_stream(f)
            except FileNotFoundError:
                continue
            yield name, spec, path, digest, size

    sc = spark.sparkContext
    per_task = max(1, min(2000, len(files) // (sc.defaultParallelism * 4) or 1))
    out: list[tuple[str, str, str, str, int]] = []
    total = len(files)
    batch = per_task * sc.defaultParallelism * 8
    for i in range(0, total, batch):
        chunk = files[i : i + batch]
        out += sc.parallelize(chunk, max(1, len(chunk) // per_task)).mapPartitions(
            hash_rows
        ).collect()
        report("files hashed", min(i + batch, total), total)
    return out

"""`cmroot repl load`: replay a dump on the destination, in event order.

Metadata changes run on the driver as Spark SQL. Files are copied by the executors
(`transfer.copy_all`), each verified against its checksum; runs of events that only add
files are copied as one Spark job, and any event that removes something first waits for
the copies before it. A batch becomes visible only when all its files arrived (temporaries
renamed into place), so a file lost from both the source and the cmroot changes nothing.

Every step is idempotent (IF [NOT] EXISTS, files already present with their checksum are
kept), so a rerun, or a rerun after the driver was killed, converges on the same state.
The last event applied is kept in the destination's properties (`repl.last.id`, as Hive
does): on the database, or on the table for a one-table replication."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cmroot import faults
from cmroot.client import Client
from cmroot.durable import sync_filesystem
from cmroot.exceptions import CmrootError, FileLost, ReplError
from cmroot.repl import dumpdir, tabledef
from cmroot.repl.catalog import BOOTSTRAP, LAST_ID, SCOPE, SOURCE, Destination, spec_key
from cmroot.repl.dumpdir import Dump, DumpEvent
from cmroot.repl.transfer import (
    Copied,
    Copy,
    copy_on_spark,
    daemon_error,
    discard,
    publish,
    resolve,
    sweep,
)

log = logging.getLogger(__name__)

Report = Callable[[str, int, int | None], None]
REMOVES = frozenset({"INSERT_OVERWRITE", "TRUNCATE", "DELETE", "ALTER_LOCATION"})
# The one key of what GET /v1/events serves in place of a stored tableObj over today's
# limits (cmroot.index.events.OMITTED): the definition is unknown, not empty.
OMITTED = "_cmroot"
_RESOLVE_BATCH = 5000
# Under the destination warehouse, then the destination database: what a replica keeps
# outside its tables' own directories (external tables, partitions with their own
# locations), each at its source path below it.
EXTERNAL_DIR = "_external"


@dataclass
class LoadResult:
    db: str
    table: str | None
    dump: str
    events: int = 0
    last_event_id: int | None = None
    files: int = 0
    bytes: int = 0
    # Files by where they came from: original, cmroot, present; *_http: over the daemon.
    sources: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load(
    spark: Any,
    dump_url: str,
    target: str | None = None,
    daemon_url: str | None = None,
    token: str | None = None,
    progress: Report | None = None,
) -> LoadResult:
    """Apply the dump at `dump_url`; `target` ("db" or "db.table") renames on load."""
    return Loader(spark, dumpdir.read(dump_url), target, daemon_url, token, progress).run()


def status(spark: Any, db: str, table: str | None = None) -> int | None:
    """The last source event applied to `db` (or `db.table`); None if never replicated."""
    return _last_applied(Destination(spark), db.lower(), table.lower() if table else None)


def _known(table_obj: dict[str, Any] | None, e: DumpEvent) -> dict[str, Any] | None:
    """`table_obj`, unless the source omitted it (too large for its event log): asked for
    only where the load needs the definition, so it fails for that table alone."""
    if table_obj is not None and OMITTED in table_obj:
        raise ReplError(
            "table definition missing from the source's event log",
            f"event {e.id} ({e.db}.{e.table}): {table_obj[OMITTED]}: replicate "
            f"{e.db}.{e.table} from a bootstrap (cmroot repl dump {e.db}.{e.table} without "
            "--from, then load it)",
        )
    return table_obj


def _last_applied(dest: Destination, db: str, table: str | None) -> int | None:
    value = _properties(dest, db, table).get(LAST_ID)
    return int(value) if value else None


def _properties(dest: Destination, db: str, table: str | None) -> dict[str, str]:
    """The replication properties of `db` (or `db.table`): empty if it does not exist."""
    if table is None:
        return dest.db_properties(db) if dest.has_db(db) else {}
    return dest.table_properties(db, table) if dest.has_table(db, table) else {}


class Loader:
    def __init__(
        self,
        spark: Any,
        dump: Dump,
        target: str | None,
        daemon_url: str | None,
        token: str | None,
        progress: Report | None,
    ) -> None:
        self.spark = spark
        self.dump = dump
        self.dest = Destination(spark)
        h = dump.header
        tdb, _, ttable = (target or "").partition(".")
        if ttable and h.table is None:
            raise ReplError(
                "a database dump loads into a database",
                f"{target}: give a database name (the dump holds all of {h.db})",
            )
        self.db = (tdb or h.db).lower()
        self.table = (ttable or h.table or "").lower() or None  # one-table replication
        self.daemon_url = daemon_url or h.daemon_url or None
        self.token = token
        self.report: Report = progress or (lambda what, done, total: None)
        self.result = LoadResult(self.db, self.table, dump.url)
        self._defs: dict[str, dict[str, Any]] = {}  # source table -> newest definition
        self._tables: set[str] = set()  # destination tables known to exist
        self._copies: dict[str, Copy] = {}  # by destination: an ADD_PARTITION repeats an INSERT
        self._origin: dict[str, tuple[int, str, str]] = {}  # dst -> (event, path, checksum)
        self._partitions: dict[str, list[dict[str, str]]] = {}
        # dst table -> spec_key -> directory, for partitions away from their default place
        self._places: dict[str, dict[str, str]] = {}
        self._outside: str | None = None  # _outside_root(), once asked
        self._swept: set[str] = set()  # directories outside the tables swept of temporaries
        self._client: Client | None = Client(self.daemon_url, token) if self.daemon_url else None
        # A bootstrap's tables read in a later round of its snapshot: the event id each
        # read began after (it holds every event on that name up to there).
        self._read_after: dict[str, int] = {}
        for name, meta in dump.tables.items():
            db_name, _, table_name = name.partition(".")
            if meta.get("tableObj") and db_name == h.db.lower():  # not another database's
                self._defs[table_name] = meta["tableObj"]
            after = meta.get("read_after")
            # A database's snapshot reads its own tables only (a one-table one follows its
            # table anywhere).
            ours = h.table is not None or db_name == h.db.lower()
            if h.kind == "bootstrap" and ours and isinstance(after, int) \
                    and not isinstance(after, bool) and h.first_event_id < after <= h.last_event_id:
                self._read_after[name.lower()] = after
        # A table renamed into a name read later was that table before: the events on its
        # older name, up to the rename, are held by that read as well.
        for e in reversed(dump.events):
            if (names := _rename_names(e)) is not None:
                old, new = names
                if self._read_after.get(new, 0) >= e.id:
                    self._read_after[old] = max(self._read_after.get(old, 0), e.id)

    # -- the run --------------------------------------------------------------------------
    def run(self) -> LoadResult:
        try:
            return self._run()
        finally:
            if self._client is not None:
                self._client.close()

    def _run(self) -> LoadResult:
        h = self.dump.header
        # Where the replica is written, checked before anything changes.
        self.dest.warehouse()
        if self.dest.has_db(self.db):
            self.dest.db_location(self.db)
        self._check_replica()
        applied = _last_applied(self.dest, self.db, self.table)
        if applied is not None and applied >= h.last_event_id:
            log.info("dump already applied", extra={"dump": self.dump.url, "applied": applied})
            self.result.last_event_id = applied
            return self.result
        if h.kind == "bootstrap":
            self._claim_bootstrap()
            todo = self.dump.events
        else:
            # A destination that never saw this scope takes any dump that creates it.
            if applied is not None and h.first_event_id > applied:
                raise ReplError(
                    "this dump starts after events the destination has not seen",
                    f"{self._scope()} is at event {applied} but the dump holds events "
                    f"after {h.first_event_id}: dump with --from {applied}, or load the "
                    "dumps in order",
                )
            todo = [e for e in self.dump.events if e.id > (applied or 0)]
        self._sweep_temporaries()
        total = len(todo)
        for i, e in enumerate(todo, 1):
            try:
                self._apply(e)
            except CmrootError:
                raise
            except Exception as err:  # Spark refused a statement: name the event, no trace
                raise ReplError(
                    f"cannot apply event {e.id} ({e.type} of {e.db}.{e.table})",
                    f"{(str(err).strip().splitlines() or [type(err).__name__])[0][:300]}:"
                    f" the load of {self._scope()}"
                    " stopped there; a rerun goes on from the status it recorded",
                ) from err
            faults.point("load.applied")
            self.result.events += 1
            self.report("events applied", i, total)
        self._flush(checkpoint=None)
        self._set_status(h.last_event_id)
        self.result.last_event_id = h.last_event_id
        return self.result

    def _scope(self) -> str:
        return self.db if self.table is None else f"{self.db}.{self.table}"

    def _check_replica(self) -> None:
        """Refuse what would corrupt a replica: a dump of another source's event log (its
        event ids mean nothing here), and an incremental dump into a target whose bootstrap
        never finished (it holds part of a snapshot, and no id to continue from)."""
        h = self.dump.header
        props = _properties(self.dest, self.db, self.table)
        have = props.get(SOURCE)
        if have and h.source and have != h.source:
            raise ReplError(
                "the target is a replica of another source",
                f"{self._scope()} replicates event log {have}; this dump is of event log"
                f" {h.source} ({h.daemon_url}): load it under another name, or drop"
                f" {self._scope()} and bootstrap it from this source",
            )
        scope = props.get(SCOPE)
        if scope and scope != h.scope:
            raise ReplError(
                "the target is a replica of something else",
                f"{self._scope()} replicates {scope} of its source; this dump is of {h.scope}:"
                f" load it under another name (cmroot repl load NAME --from-dir ...)",
            )
        if h.kind == "incremental" and props.get(BOOTSTRAP) and not props.get(LAST_ID):
            raise ReplError(
                "the target's bootstrap did not finish",
                f"{self._scope()} holds an interrupted bootstrap (event"
                f" {props[BOOTSTRAP].split('@')[0]}) and no {LAST_ID}: load that bootstrap"
                " dump again to finish it, then the incremental dumps after it",
            )
        if h.kind == "incremental" and self._foreign(props):
            raise ReplError(
                "the target is not a replica",
                f"{self._scope()} exists and was never loaded from a dump (no {LAST_ID}):"
                " an incremental dump is applied only to its own replica; load it under"
                " another name, or drop the target and start from a bootstrap",
            )
        if self.table is not None and self.dest.has_db(self.db):
            whole = self.dest.db_properties(self.db)
            # Only a database-level load marks a database (a one-table load's is bare).
            if whole.get(LAST_ID) or whole.get(BOOTSTRAP) or whole.get(SOURCE):
                raise ReplError(
                    "the target database is a replica of a whole database",
                    f"{self.db} replicates database {h.db}'s dumps: a one-table dump loaded"
                    f" into it would change a table its own dumps own; load {h.scope} into"
                    " another database",
                )

    def _foreign(self, props: dict[str, str]) -> bool:
        """Does the target exist, hold data, and bear none of this replication's marks (an
        id applied, a bootstrap, this source)?"""
        if props.get(LAST_ID) or props.get(BOOTSTRAP):
            return False
        if self.dump.header.source and props.get(SOURCE) == self.dump.header.source:
            return False  # made by an earlier run of this load, stopped before its first id
        if self.table is None:
            return self.dest.has_db(self.db) and bool(self.dest.tables(self.db))
        return self.dest.has_table(self.db, self.table)

    def _marker(self) -> str:
        """The bootstrap this replica comes from: its event id, and the source's log."""
        h = self.dump.header
        return f"{h.first_event_id}@{h.source}" if h.source else str(h.first_event_id)

    def _set_status(self, event_id: int) -> None:
        props = {LAST_ID: str(event_id), SCOPE: self.dump.header.scope}
        if self.dump.header.source:
            props[SOURCE] = self.dump.header.source
        if self.table is None:
            if self.dest.has_db(self.db):
                self.dest.set_db_properties(self.db, props)
        elif self.dest.has_table(self.db, self.table):
            self.dest.set_table_properties(self.db, self.table, props)

    def _claim_bootstrap(self) -> None:
        """A bootstrap goes into a new database (or table), or into the one an interrupted
        run of this same bootstrap left; never over someone else's data."""
        marker = self._marker()
        if not self.dest.has_db(self.db):
            self._create_db()
            return
        if self.table is None:
            props = self.dest.db_properties(self.db)
            if props.get(BOOTSTRAP) != marker and self.dest.tables(self.db):
                raise ReplError(
                    "the target database already exists",
                    f"{self.db} holds tables and is not a replica of this bootstrap: drop it, "
                    "or load into another name (cmroot repl load NEWDB --from-dir ...)",
                )
            self.dest.set_db_properties(self.db, {BOOTSTRAP: marker})
        elif self.dest.has_table(self.db, self.table):
            props = self.dest.table_properties(self.db, self.table)
            if props.get(BOOTSTRAP) != marker:
                raise ReplError(
                    "the target table already exists",
                    f"{self.db}.{self.table} is not a replica of this bootstrap: drop it, or "
                    "load into another name (cmroot repl load DB.NEWTABLE --from-dir ...)",
                )

    def _sweep_temporaries(self) -> None:
        """Remove what a killed load left half-copied (hidden, never read as data)."""
        if not self.dest.has_db(self.db):
            return
        tables = [self.table] if self.table else self.dest.data_tables(self.db)
        for t in tables:
            if not self.dest.has_table(self.db, t):
                continue
            sweep([self.dest.location(self.db, t)])

    def _sweep_outside(self, copies: list[Copy]) -> None:
        """Sweep what a killed load left in the directories outside the tables' own that
        this batch writes to (they are not walked up front: finding them means listing
        every partition)."""
        root = self._outside_root()
        for d in {os.path.dirname(c.dst) for c in copies}:
            if d.startswith(root + "/") and d not in self._swept:
                self._swept.add(d)
                sweep([d])

    # -- events ---------------------------------------------------------------------------
    def _held(self, e: DumpEvent) -> bool:
        """Does the snapshot hold `e` already: a table it read after `e`, named by `e`
        (either name of a rename)? Replaying it would undo the newer read."""
        if not self._read_after or e.id <= self.dump.header.first_event_id:
            return False
        names = set(_rename_names(e) or ())
        if e.db and e.table:
            names.add(f"{e.db}.{e.table}".lower())
        return any(self._read_after.get(n, 0) >= e.id for n in names)

    def _apply(self, e: DumpEvent) -> None:
        if self._held(e):
            return
        kind = e.type
        if e.table_obj is not None and e.table:
            # Filed under the name it defines, within the event's database: a rename's
            # definition is its new name's (one into another database is that one's).
            obj_db = str(e.table_obj.get("db") or e.db or "").lower()
            if obj_db == (e.db or "").lower():
                self._defs[str(e.table_obj.get("table") or e.table).lower()] = e.table_obj
        if kind == "CREATE_DATABASE":
            if self.table is None:
                self._create_db()
        elif kind == "DROP_DATABASE":
            if self.table is None:
                self._flush(e.id)
                newer = {n.partition(".")[2] for n, after in self._read_after.items()
                         if after >= e.id and n.partition(".")[0] == self.dump.header.db}
                if newer:  # read after the drop: the database came back; keep those
                    for t in self.dest.tables(self.db):
                        if t.lower() not in newer:
                            self._drop_table(replace(e, table=t))
                else:
                    self.dest.drop_db(self.db)
                    self._tables.clear()
                    shutil.rmtree(self._outside_root(), ignore_errors=True)
        elif kind == "CREATE_TABLE":
            self._ensure_table(e)
            if e.files:  # created over a directory that already held data
                self._add(e)
        elif kind == "ALTER_LOCATION" and e.table_obj is not None:
            self._flush(e.id)
            self._relocate(e)
        elif kind == "ALTER_TABLE":
            self._flush(e.id)
            self._alter(e)
        elif kind == "DROP_TABLE":
            self._flush(e.id)
            if self.dest.has_table(self.db, self._dst_table(e)):
                self._unlink(e, self._dst_table(e))
            self._drop_table(e)
        elif kind == "DROP_PARTITION":
            self._flush(e.id)
            self._drop_partitions(e)
        elif kind in ("INSERT", "ADD_PARTITION"):
            self._add(e)
        elif kind in REMOVES:
            self._flush(e.id)
            self._remove(e)
        else:
            raise ReplError("unknown event type in the dump", f"event {e.id}: {kind}")

    def _marks(self) -> dict[str, str]:
        """What the load marks the target it creates with, in the statement creating it: the
        source it replicates, and for a bootstrap which one. A rerun after a crash goes on in
        a target so marked (a bootstrap's database even when its own events dropped and
        re-created it); one without them is someone else's."""
        h = self.dump.header
        marks = {SOURCE: h.source} if h.source else {}
        marks[SCOPE] = h.scope
        if h.kind == "bootstrap":
            marks[BOOTSTRAP] = self._marker()
        return marks

    def _create_db(self) -> None:
        self.dest.create_db(self.db, self._marks() if self.table is None else None)

    def _dst_table(self, e: DumpEvent) -> str:
        if self.table is not None:
            return self.table
        if not e.table:
            raise ReplError("event without a table", f"event {e.id} ({e.type})")
        return e.table.lower()

    def _definition(self, e: DumpEvent) -> dict[str, Any] | None:
        src = (e.table or "").lower()
        obj = e.table_obj if e.table_obj is not None else self._defs.get(src)
        if obj is None:
            # A CTAS writes its files before its table is created; a table a bootstrap read
            # under its new name has only the rename's definition under its old one.
            for later in self.dump.events:
                if later.type in ("CREATE_TABLE", "ALTER_TABLE") and (
                    later.table or ""
                ).lower() == src and later.table_obj is not None:
                    obj = later.table_obj
                    break
        return _known(obj, e)

    def _ensure_table(self, e: DumpEvent) -> str:
        dst = self._dst_table(e)
        if dst in self._tables:
            return dst
        if not self.dest.has_db(self.db):
            self._create_db()
        if not self.dest.has_table(self.db, dst):
            obj = self._definition(e)
            if obj is None:
                raise ReplError(
                    "table missing at the destination",
                    f"{self.db}.{dst} (event {e.id}) does not exist and the dump has no "
                    "definition for it: load a bootstrap first (cmroot repl dump without --from)",
                )
            self.dest.create_table(obj, self.db, dst,
                                   self._marks() if self.table is not None else None,
                                   self._external_place(obj, e))
            faults.point("load.table_created")
        self._tables.add(dst)
        return dst

    def _external_place(self, obj: dict[str, Any], e: DumpEvent) -> str | None:
        """Where the replica of an external table lives: the source's location under
        `<destination warehouse>/_external/` (None: a managed table, placed by the
        catalog). A replica stays external, so dropping it leaves its files as the source's
        drop does (the load removes its own copy)."""
        if not tabledef.is_external(obj):
            return None
        src = tabledef.location(obj)
        if not src or not src.startswith("/"):
            raise ReplError("external table without a local location",
                            f"event {e.id}: {e.db}.{e.table} at {src}")
        return self._mapped(e, src)

    def _outside_root(self) -> str:
        """`<destination warehouse>/_external/<database>` (a one-table replica's:
        `.../_external/<database>.<table>`; a database name has no dot): where this replica
        keeps what lies outside its tables' own directories. Per replica, so two replicas
        of one source in one warehouse never share a directory."""
        if self._outside is None:
            scope = self.db if self.table is None else f"{self.db}.{self.table}"
            self._outside = os.path.join(self.dest.warehouse(), EXTERNAL_DIR, scope)
        return self._outside

    def _mapped(self, e: DumpEvent, path: str) -> str:
        """Where the replica keeps source `path` that lies outside its table's location:
        at that path below `_outside_root()`."""
        root = self._outside_root()
        place = os.path.normpath(os.path.join(root, path.lstrip("/")))
        if not path.startswith("/") or not place.startswith(root + "/"):
            raise ReplError("bad path in the dump", f"event {e.id}: {path}")
        return place

    def _keys(self, e: DumpEvent) -> list[str]:
        """The table's partition columns: the destination's, else the dump's definition."""
        dst = self._dst_table(e)
        if self.dest.has_table(self.db, dst):
            return self.dest.partition_columns(self.db, dst)
        obj = self._definition(e)
        return tabledef.partition_columns(obj) if obj else []

    def _src_location(self, e: DumpEvent) -> str:
        loc = e.location or tabledef.location(self._definition(e) or {})
        if not loc:
            raise ReplError(
                "no source location for a table", f"event {e.id}: {e.db}.{e.table}"
            )
        return loc.rstrip("/")

    def _dst_path(self, e: DumpEvent, dst_table: str, path: str) -> str:
        """Where the replica keeps source `path` (a file or a partition's directory): at
        its place below the replica table's location, or, outside the source table's
        location (a partition at its own location), below `_outside_root()`."""
        src_loc = self._src_location(e)
        base = self.dest.location(self.db, dst_table)
        if not path.startswith(src_loc + "/"):
            return self._mapped(e, path)
        dst = os.path.normpath(os.path.join(base, path[len(src_loc) + 1 :]))
        if not dst.startswith(base + "/"):
            raise ReplError("bad path in the dump", f"event {e.id}: {path}")
        return dst

    def _own_places(self, e: DumpEvent, dst_table: str,
                    keys: list[str]) -> list[tuple[str, dict[str, str]]]:
        """(source directory, spec) of each partition the event places, deepest first (a
        partition's location may lie inside another's); those away from their default
        place are registered there (`_places`). A partition outside the source's roots
        is refused: the source records nothing of it, so its replica would stand still."""
        if e.partition_locations is None:
            return []
        base = self.dest.location(self.db, dst_table)
        src_loc = self._src_location(e)
        out = []
        for spec, src in zip(e.partitions, e.partition_locations, strict=True):
            if src is not None and (src_loc + "/").startswith(src.rstrip("/") + "/"):
                raise ReplError(
                    "partition at its table's own directory",
                    f"event {e.id}: partition {spec} of {e.db}.{e.table} lies at {src}, which"
                    f" holds the table's directory {src_loc} (and so every other partition):"
                    " such a partition is not replicated; give it a directory of its own at"
                    " the source (nothing of this event was applied)",
                )
            if src is None:
                raise ReplError(
                    "partition outside the warehouse roots",
                    f"event {e.id}: partition {spec} of {e.db}.{e.table} lies where the"
                    " source's hook records nothing, so its replica could not follow it: move"
                    " it under a root at the source (ALTER TABLE ... PARTITION (...) SET"
                    " LOCATION), or add its directory to the roots (nothing of this event was"
                    " applied)",
                )
            dst = self._dst_path(e, dst_table, src)
            default = (os.path.join(base, tabledef.partition_dir(spec, keys))
                       if keys and all(k in spec for k in keys) else None)
            if dst != default:
                self._places.setdefault(dst_table, {})[spec_key(spec)] = dst
            out.append((src.rstrip("/"), spec))
        return sorted(out, key=lambda p: len(p[0]), reverse=True)

    def _dropped_unknown(self, e: DumpEvent) -> bool:
        """Is `e` about a table the destination lacks, the dump has no definition of, and a
        later event of the dump drops (a bootstrap that never saw a table written and
        dropped while it read)? Then `e` has nothing to change."""
        dst = self._dst_table(e)
        if dst in self._tables or self.dest.has_table(self.db, dst):
            return False
        src = (e.table or "").lower()
        if self._definition(e) is not None:
            return False
        pos = next((i for i, x in enumerate(self.dump.events) if x is e), None)
        if pos is None:  # made by the load itself (a table entering from another database)
            return False
        later = self.dump.events[pos + 1:]
        return any(x.type == "DROP_DATABASE" or (x.type == "DROP_TABLE"
                   and (x.table or "").lower() == src) for x in later)

    def _add(self, e: DumpEvent) -> None:
        if self._dropped_unknown(e):
            return
        dst_table = self._ensure_table(e)
        keys = self._keys(e)
        specs = self._partitions.setdefault(dst_table, [])
        for spec in e.partitions:
            if keys and spec and spec not in specs:
                specs.append(spec)
        base = self.dest.location(self.db, dst_table)
        places = self._own_places(e, dst_table, keys)
        src_loc = self._src_location(e)
        for f in e.files:
            path = f["path"]
            dst = self._dst_path(e, dst_table, path)
            held = next((spec for d, spec in places if path.startswith(d + "/")), None)
            if held is None and not path.startswith(src_loc + "/"):
                raise ReplError(
                    "file outside its table's location",
                    f"event {e.id}: {path} is not under {src_loc}, and the event does not say"
                    " which partition holds it (recorded by an older cmroot): take a"
                    f" bootstrap of {e.db}.{e.table}",
                )
            if keys:
                spec = held or tabledef.spec_of(os.path.relpath(os.path.dirname(dst), base), keys)
                if spec and spec not in specs:
                    specs.append(spec)
            self._copies[dst] = Copy(path, dst, f["checksum"], int(f["size"]))
            self._origin[dst] = (e.id, path, f["checksum"])

    def _remove(self, e: DumpEvent) -> None:
        dst_table = self._dst_table(e)
        if not self.dest.has_table(self.db, dst_table):
            return
        self._unlink(e, dst_table)
        self.dest.refresh(self.db, dst_table)

    def _unlink(self, e: DumpEvent, dst_table: str) -> None:
        """Remove the replica's copies of what the source removed (the event's files):
        below the table, and where the replica keeps that source path for another table
        (one whose partition lay inside this table's directory: its place is mapped)."""
        for f in e.files:
            for copy in {self._dst_path(e, dst_table, f["path"]), self._mapped(e, f["path"])}:
                with suppress(FileNotFoundError):
                    os.unlink(copy)

    # A drop removes on the replica what it removed at the source, nothing more: a managed
    # table's (or partition's) directory goes with it in the replica's catalog as at the
    # source (a managed drop's files are in its event too); an external one's files stay
    # where they are, as the source's do, with whatever else lies inside them (another
    # table's partitions, a partition renamed into the same place). A place taken again
    # later holds exactly what that event lists (`_make_exact`).
    def _drop_table(self, e: DumpEvent) -> None:
        dst_table = self._dst_table(e)
        if self.dest.has_table(self.db, dst_table):
            self.dest.drop_table(self.db, dst_table)
        self._tables.discard(dst_table)

    def _drop_partitions(self, e: DumpEvent) -> None:
        dst_table = self._dst_table(e)
        if not self.dest.has_table(self.db, dst_table):
            return
        self._unlink(e, dst_table)
        specs = [s for s in e.partitions if s]
        self.dest.drop_partitions(self.db, dst_table, specs, self._keys(e))

    def _make_exact(self, top: str, dst_table: str, e: DumpEvent,
                    moving: frozenset[str] | set[str] = frozenset()) -> None:
        """Make the replica's `top`, a place `e` (re)assigns, hold no data file the event
        does not list there, leaving alone the places inside it that something else of the
        replica still occupies (the table's other partitions and, below `_outside_root()`,
        the one place where directories of different tables meet, every table's), other
        than those `moving` away."""
        root = self._outside_root()
        shared = self.table is None and top.startswith(root + "/")
        tables = self.dest.data_tables(self.db) if shared else [dst_table]
        keep = {p for t in tables for p in self._placed(t)} - moving - {top}
        listed = {self._dst_path(e, dst_table, f["path"]) for f in e.files}
        _clear(top, keep, listed)

    def _placed(self, table: str) -> set[str]:
        """The directories a table of the replica occupies: its own, its partitions'."""
        out = {self.dest.location(self.db, table)}
        if self.dest.partition_columns(self.db, table):
            out |= set(self.dest.partition_locations(self.db, table))
        return out

    def _alter(self, e: DumpEvent) -> None:
        new = _known(e.table_obj, e)
        if new is None:
            return
        old_name = new_name = (e.table or "").lower()
        if (moved := e.renamed()) is not None:
            (old_db, old_name), (new_db, new_name) = moved
            if self.table is None and new_db != old_db:
                self._across(e, new, new_db, new_name)
                return
        self._defs[new_name] = new
        dst = self._dst_table(e)
        if self.table is None and new_name != old_name:
            if self.dest.has_table(self.db, new_name):
                # The source had no `new_name` before this rename: the replica's is a
                # bootstrap's newer read of the renamed table, and `old_name` is stale.
                self._drop_table(replace(e, table=old_name))
            elif self.dest.has_table(self.db, old_name):
                self.dest.rename_table(self.db, old_name, new_name)
            self._tables.discard(old_name)
            dst = new_name
        if not self.dest.has_table(self.db, dst):
            return
        self._columns(new, dst)
        want = tabledef.user_properties(new)
        cur = tabledef.user_properties({"parameters": self.dest.table_properties(self.db, dst)})
        changed = {k: v for k, v in want.items() if cur.get(k) != v}
        if changed:
            self.dest.set_table_properties(self.db, dst, changed)
        gone = [k for k in cur if k not in want]
        if gone:
            self.dest.unset_table_properties(self.db, dst, gone)

    def _columns(self, new: dict[str, Any], dst: str) -> None:
        """Give the replica the source's data columns: appended ones by ADD COLUMNS, any
        other change (a column dropped, renamed, retyped, reordered) by replacing the data
        schema, so the replica reads its files as the source does."""
        keys = {k.lower() for k in self.dest.partition_columns(self.db, dst)}
        if keys != {k.lower() for k in tabledef.partition_columns(new)}:
            raise ReplError(
                "table definition changes the partitioning",
                f"{self.db}.{dst} is partitioned by {sorted(keys)}, its new definition by"
                f" {tabledef.partition_columns(new)}: a replica cannot follow that; take a"
                " bootstrap of it",
            )
        want = [(n, t) for n, t in tabledef.columns(new) if n.lower() not in keys]
        have = self.dest.data_schema(self.db, dst)
        if _same_columns(want[: len(have)], have):
            if len(want) > len(have):
                self.dest.add_columns(self.db, dst, want[len(have):])
            return
        self.dest.replace_data_schema(self.db, dst, want)

    def _across(self, e: DumpEvent, new: dict[str, Any], new_db: str, new_name: str) -> None:
        """A table renamed into another database: gone from the one it left; in the one it
        entered, made from the event alone (its definition, and its files as listed at
        their new place), unless a bootstrap's newer read of it is there already."""
        if (e.db or "").lower() == self.dump.header.db.lower():
            self._drop_table(e)
            return
        if self.dest.has_table(self.db, new_name):
            return
        entered = replace(e, type="CREATE_TABLE", db=new_db, table=new_name,
                          location=tabledef.location(new), table_obj=new)
        self._defs[new_name] = new
        self._ensure_table(entered)
        self._add(entered)

    def _relocate(self, e: DumpEvent) -> None:
        """A table given a new location at the source (the recorded ALTER_LOCATION, with its
        new definition): the replica of a managed table keeps its own location, that of an
        external one moves to where the new location maps (what later takes the old place
        at the source takes it on the replica too); either then holds what the new one
        holds (`e.files`, paths under `e.location`). The old place stays as it was, as at
        the source."""
        if e.location is None and not e.partitions:
            # The hook names the new location only when it records what happens there.
            raise ReplError(
                "table moved outside the warehouse roots",
                f"event {e.id}: {e.db}.{e.table} now lives at"
                f" {tabledef.location(e.table_obj or {})}, where the source's hook records"
                " nothing, so its replica could not follow it: move it back under a root at"
                " the source, or replicate it another way (nothing of this event was applied)",
            )
        self._alter(e)
        dst_table = self._dst_table(e)
        if not self.dest.has_table(self.db, dst_table):
            return
        if e.partitions:
            self._move_partitions(e, dst_table)
            return
        obj = self._definition(e) or {}
        place = self._external_place(obj, e)
        if place is not None and place != self.dest.location(self.db, dst_table):
            os.makedirs(place, exist_ok=True)
            self.dest.set_location(self.db, dst_table, place)
        base = self.dest.location(self.db, dst_table)
        if tabledef.partition_columns(obj):
            return  # the partitions keep their locations: nothing moved with the table
        self._make_exact(base, dst_table, e)
        self._add(e)
        self.dest.refresh(self.db, dst_table)

    def _move_partitions(self, e: DumpEvent, dst_table: str) -> None:
        """Partitions given new locations at the source (ALTER_LOCATION with partitions): on
        the replica each moves to where its new location maps, holding exactly what the
        event lists there. What was at the old place stays, as it does at the source."""
        if e.partition_locations is None:
            raise ReplError(
                "partition moved without its location",
                f"event {e.id}: a partition of {e.db}.{e.table} was given a new location,"
                " recorded by an older cmroot that did not say where: take a bootstrap of"
                f" {e.db}.{e.table}",
            )
        keys = self.dest.partition_columns(self.db, dst_table)
        self._own_places(e, dst_table, keys)  # refuses a place outside the roots first
        base = self.dest.location(self.db, dst_table)
        moves = []
        for spec in e.partitions:
            new = self._places.get(dst_table, {}).get(
                spec_key(spec), os.path.join(base, tabledef.partition_dir(spec, keys)))
            moves.append((spec, self.dest.partition_location(self.db, dst_table, spec), new))
        olds = {old for _, old, _ in moves if old}
        for new in {new for _, _, new in moves}:
            self._make_exact(new, dst_table, e, olds)
        for spec, old, new in moves:
            os.makedirs(new, exist_ok=True)
            if old is None:
                self.dest.add_partitions(self.db, dst_table, [spec], keys, {spec_key(spec): new})
            elif old != new:
                self.dest.set_partition_location(self.db, dst_table, spec, keys, new)
        self._add(e)
        self.dest.refresh(self.db, dst_table)

    # -- files ----------------------------------------------------------------------------
    def _flush(self, checkpoint: int | None) -> None:
        """Copy every queued file, publish them, register their partitions; then, for an
        incremental load, record how far the destination got (the event before
        `checkpoint`)."""
        copies, self._copies = list(self._copies.values()), {}
        partitions, self._partitions = self._partitions, {}
        places, self._places = self._places, {}
        if copies:
            self._check_reachable(copies)
            self._sweep_outside(copies)
            done = self._copy(copies)
            unasked = [(c.fault, c.error or "") for c in done if c.fault is not None]
            failed = [c for c in done if c.source == "failed"]
            lost = [c for c in done if c.source == "lost"]
            if failed or lost:
                discard(done)
            if unasked:
                # The daemon could not be asked: that, not a lost file, stopped the batch.
                raise daemon_error(*unasked[0], self.daemon_url, self._scope())
            if failed:
                c = failed[0]
                event_id, src, _ = self._origin.get(c.dst, (0, c.dst, "?"))
                more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
                raise ReplError(
                    f"cannot copy {src}",
                    f"{c.error}{more}. Nothing of event {event_id} was placed in"
                    f" {self._scope()} and its status was not advanced: mend that (space,"
                    " permissions, the daemon) and run the load again",
                )
            if lost:
                raise self._lost(lost, lost[0].error or "neither at its path nor in the cmroot")
            publish(done)
            _sync({os.path.dirname(c.dst) for c in copies})
            for c in done:
                self.result.sources[c.kind] = self.result.sources.get(c.kind, 0) + 1
            self.result.files += len(done)
            self.result.bytes += sum(c.size for c in done)
        for dst_table, specs in partitions.items():
            if specs and self.dest.has_table(self.db, dst_table):
                keys = self.dest.partition_columns(self.db, dst_table)
                self.dest.add_partitions(self.db, dst_table, specs, keys, places.get(dst_table))
        for dst_table in partitions:
            if self.dest.has_table(self.db, dst_table):
                self.dest.refresh(self.db, dst_table)
        self._origin.clear()
        if copies and checkpoint is not None and self.dump.header.kind == "incremental":
            self._set_status(checkpoint - 1)

    def _check_reachable(self, copies: list[Copy]) -> None:
        """Fail before copying anything when a file is in neither place: those whose
        original is gone or changed size are asked of the daemon up front."""
        doubtful = [c for c in copies if _size(c.src) != c.size]
        if not doubtful:
            return
        if self._client is None:
            raise self._lost(doubtful, "its original is gone and no daemon URL is known")
        missing: list[Copy] = []
        for i in range(0, len(doubtful), _RESOLVE_BATCH):
            batch = doubtful[i : i + _RESOLVE_BATCH]
            answer = resolve(
                self._client, [{"path": c.src, "checksum": c.checksum} for c in batch],
                self._scope(),
            )
            missing += [c for c, a in zip(batch, answer, strict=True) if a.status == "missing"]
        if missing:
            raise self._lost(missing)

    def _lost(
        self, lost: list[Copy] | list[Copied], why: str = "neither at its path nor in the cmroot"
    ) -> FileLost:
        event_id, src, checksum = self._origin.get(lost[0].dst, (0, lost[0].dst, "?"))
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        return FileLost(
            f"file lost: {src}",
            f"{src} (checksum {checksum}, event {event_id}){more} is {why}: the cmroot "
            "retention (store.retain) was shorter than this replication's lag. Nothing of "
            f"event {event_id} was applied to {self._scope()}. Take a fresh bootstrap: "
            f"cmroot repl dump {self.dump.header.scope} --to-dir DIR (without --from), then "
            "load it into a new name",
        )

    def _copy(self, copies: list[Copy]) -> list[Copied]:
        return copy_on_spark(self.spark, copies, self.daemon_url, self.token, self.report,
                             "cmroot repl load")


def _rename_names(e: DumpEvent) -> tuple[str, str] | None:
    """("db.old", "db.new") of a table rename event, else None."""
    names = e.renamed()
    return None if names is None else (".".join(names[0]), ".".join(names[1]))


def _same_columns(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> bool:
    """Do two column lists name the same columns with the same types (names compared as
    the catalog does, without case; types as Spark writes them, quoting aside)?"""
    def norm(cols: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(n.lower(), t.replace("`", "").replace(" ", "").lower()) for n, t in cols]

    return norm(a) == norm(b)


def _sync(dirs: set[str]) -> None:
    """One syncfs per filesystem the batch wrote to."""
    seen: set[int] = set()
    for d in sorted(dirs):
        dev = os.stat(d).st_dev
        if dev not in seen:
            seen.add(dev)
            sync_filesystem(d)


def _clear(top: str, keep: set[str], listed: set[str]) -> None:
    """Remove the data files below `top` that are not `listed`, leaving alone the
    directories in `keep` and hidden names (temporaries are swept on their own)."""
    if top in keep:
        return
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        path = os.path.join(top, name)
        if name.startswith((".", "_")):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            _clear(path, keep, listed)
        elif path not in listed:
            with suppress(FileNotFoundError):
                os.unlink(path)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size if path.startswith("/") else -1
    except OSError:
        return -1

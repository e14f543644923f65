"""The ordered event log a replica replays. An event's files live in `event_files`, one
row each, so any event can be read a page at a time.

Ids come from an AUTOINCREMENT key assigned inside the writer's IMMEDIATE transaction, so
they are strictly increasing in commit order and a reader never sees a gap: an event and
all its files become visible together, after every event with a smaller id.

Pages for the API (`events_page`, `event_files_page`) are capped in bytes as well as in
count: their compact JSON never exceeds `PAGE_BYTES` (unless one event's own fields,
without files, are larger than that). Events come whole, except the first of a page,
which, if its files do not fit, comes with the files that do and `filesNext`, the cursor
to page the rest with `event_files_page`.

A stored `tableObj` over the limits requests are held to today (an index written by an
older version, or by hand) is never served: the event comes with the marker
`{"_cmroot": "tableObj omitted: <why>"}` in its place and everything else intact, so
every page still answers and fits its cap, and a replication loader sees that the
definition is missing (it needs a bootstrap of that table) instead of a wrong one."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgspec

from cmroot.index.base import Base, chunks
from cmroot.index.records import Event

PAGE_BYTES = 4 << 20  # the most a page's JSON may take; read at call time (tests lower it)
FILES_FETCH = 2000  # file rows read from SQLite per step while filling a page

_EVENT_COLUMNS = "id, type, db, tbl, partitions, timestamp, server, purge, meta, audit"
# The largest tableObj POST /v1/events accepts (cmroot.server.schemas checks it), in bytes
# of JSON, and in levels of nesting (a Hive table definition is under 10 levels deep).
ACCEPTED_TABLE_OBJ = 1 << 20
MAX_TABLE_OBJ_DEPTH = 32
# The largest served, in bytes of stored JSON: json.dumps escapes non-ASCII characters, so
# an accepted one takes at most three times its size. One this large still fits a page
# (PAGE_BYTES); a stored one beyond either limit is served as the OMITTED marker.
MAX_TABLE_OBJ = 3 * ACCEPTED_TABLE_OBJ
OMITTED = "_cmroot"  # the one key of the marker served in place of such a tableObj
_LOCATION_FIRST = '{"location": '  # how _insert_event's json.dumps starts a meta
_MAX_NAME = 4096  # the longest name or location an omitted tableObj's marker keeps
_BIG_INT = 2**63  # the widest integer a cursor field can hold
# What a page holds besides its events: the envelope with the widest numbers, plus room
# for the one `filesNext` a page can carry.
_EVENTS_ENVELOPE = len(json.dumps({"events": [], "next": _BIG_INT, "more": False},
                                  separators=(",", ":")))
_FILES_NEXT = len(',"filesNext":') + len(str(-_BIG_INT))
_FILES_ENVELOPE = len(json.dumps({"id": _BIG_INT, "files": [], "filesNext": -_BIG_INT},
                                 separators=(",", ":")))


def dumps(data: Any) -> str:
    """The compact JSON the API writes (and the sizes pages are measured in)."""
    return json.dumps(data, separators=(",", ":"))


class EventLog(Base):
    def audits(self, event_ids: Iterable[int]) -> dict[int, dict[str, str]]:
        """The audit of each of these events that has one."""
        out: dict[int, dict[str, str]] = {}
        for chunk in chunks(sorted({i for i in event_ids if i})):
            for event_id, text in self._query(
                f"SELECT id, audit FROM events WHERE id IN ({','.join('?' * len(chunk))})"
                " AND audit IS NOT NULL",
                chunk,
            ):
                audit = _audit(text)
                if audit is not None:
                    out[event_id] = audit
        return out

    def add_event(self, event: Event) -> int:
        with self.transaction() as db:
            return self._insert_event(db, event)

    def _insert_event(self, db: sqlite3.Connection, e: Event, txid: str | None = None) -> int:
        meta = None
        if e.location is not None or e.table_obj is not None or e.partition_locations:
            fields: dict[str, Any] = {"location": e.location}
            if e.partition_locations:
                fields["partitionLocations"] = e.partition_locations
            fields["tableObj"] = e.table_obj
            meta = json.dumps(fields)
        # `files` is written explicitly: in an index migrated from before version 2 the
        # column is still NOT NULL without a default.
        cur = db.execute(
            "INSERT INTO events (type, db, tbl, partitions, timestamp, server, purge, files,"
            " meta, txid, audit) VALUES (?, ?, ?, ?, ?, ?, ?, '[]', ?, ?, ?)",
            (
                str(e.type),
                e.db,
                e.table,
                json.dumps(e.partitions),
                e.timestamp,
                e.server,
                int(e.purge),
                meta,
                txid,
                json.dumps(e.audit) if e.audit else None,
            ),
        )
        assert cur.lastrowid is not None
        event_id = cur.lastrowid
        db.executemany(
            "INSERT INTO event_files (event_id, seq, path, checksum, size) VALUES (?, ?, ?, ?, ?)",
            (
                (event_id, seq, f["path"], f["checksum"], int(f.get("size") or 0))
                for seq, f in enumerate(e.files)
            ),
        )
        return event_id

    def events(self, start: int = 0, limit: int = 100) -> list[Event]:
        """Whole events with id >= `start`, files included (unbounded: for small logs and
        tests; the API pages with `events_page`)."""
        rows = self._query(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE id >= ? ORDER BY id LIMIT ?",
            (start, limit),
        )
        return [_event(r, self.event_files(r[0])) for r in rows]

    def event_of_tx(self, txid: str) -> int | None:
        """The id of the event recycle transaction `txid` recorded, if it committed one."""
        rows = self._query("SELECT id FROM events WHERE txid = ?", (txid,))
        return int(rows[0][0]) if rows else None

    def event_files(
        self, event_id: int, after: int = -1, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """The files of one event in order, those with seq > `after`, at most `limit`."""
        rows = self._query(
            "SELECT path, checksum, size FROM event_files WHERE event_id = ? AND seq > ?"
            " ORDER BY seq LIMIT ?",
            (event_id, after, -1 if limit is None else limit),
        )
        return [{"path": p, "checksum": c, "size": s} for p, c, s in rows]

    def events_page(
        self, start: int, limit: int, max_bytes: int | None = None
    ) -> dict[str, Any]:
        """`{"events": [...], "next": N, "more": bool}`: at most `limit` events with
        id >= `start` whose JSON fits in `max_bytes` (default PAGE_BYTES). The page ends
        before the first event that does not fit whole, except that the first event is
        always there (so paging makes progress): if its files do not all fit it comes with
        those that do and `"filesNext": S` (pass S as `after` to `event_files_page`).
        `next` is where the following page starts; `more` says events at or past it were
        already committed."""
        cap = PAGE_BYTES if max_bytes is None else max_bytes
        conn = self._reader()
        fetched = conn.execute(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE id >= ? ORDER BY id LIMIT ?",
            (start, limit + 1),
        ).fetchall()
        rows = fetched[:limit]
        out: list[dict[str, Any]] = []
        if not rows:
            return {"events": out, "next": start, "more": False}
        used = _EVENTS_ENVELOPE + _FILES_NEXT
        files = _FileRows(conn, rows[0][0], rows[-1][0])
        try:
            for r in rows:
                event = _event(r, []).to_json()
                cost = len(dumps(event)) + (1 if out else 0)
                if out and used + cost > cap:
                    break
                listed, filled, complete = _fill(event["files"], files.of(r[0]), used + cost, cap)
                if not complete and out:
                    break  # only the first event of a page is split: the rest come whole
                out.append(event)
                used = filled
                if not complete:
                    event["filesNext"] = listed
                    break
        finally:
            files.close()
        nxt = int(out[-1]["id"]) + 1
        return {"events": out, "next": nxt, "more": fetched[-1][0] >= nxt}

    def event_files_page(
        self, event_id: int, after: int = -1, limit: int = 10_000, max_bytes: int | None = None
    ) -> dict[str, Any] | None:
        """`{"id", "files": [...], "filesNext": S | None}`: the files of one event with
        seq > `after`, at most `limit` and within `max_bytes` of JSON (at least one file);
        `filesNext` is the `after` of the next page, None once the last file is listed.
        None if there is no such event."""
        cap = PAGE_BYTES if max_bytes is None else max_bytes
        conn = self._reader()
        if not conn.execute("SELECT 1 FROM events WHERE id = ?", (event_id,)).fetchone():
            return None
        cur = conn.execute(
            "SELECT seq, path, checksum, size FROM event_files WHERE event_id = ? AND seq > ?"
            " ORDER BY seq LIMIT ?",
            (event_id, after, limit + 1),
        )
        out: list[dict[str, Any]] = []
        try:
            rows = _rows(cur)
            listed, _, complete = _fill(out, _limited(rows, limit), _FILES_ENVELOPE, cap,
                                        at_least_one=True)
            if complete and next(rows, None) is not None:  # stopped by `limit`
                complete = False
        finally:
            cur.close()
        return {"id": event_id, "files": out, "filesNext": None if complete else listed}

    def current_event_id(self) -> int:
        return int(self._query("SELECT coalesce(max(id), 0) FROM events")[0][0])

    def relocations(self, after: int = 0) -> list[tuple[int, str, str]]:
        """(event id, old location, new location) of the table renames the log records
        after event `after`, oldest first: where a renamed table's files went (ALTER_TABLE
        events whose `location` is where the table was and whose tableObj says where it
        is). The log only grows: a caller keeps what it read and asks for what follows."""
        out = []
        for event_id, meta in self._query(
            "SELECT id, meta FROM events WHERE id > ? AND type = 'ALTER_TABLE'"
            " AND meta IS NOT NULL ORDER BY id", (after,)
        ):
            old, obj, _ = _meta(meta)
            new = (obj or {}).get("location")
            if old and isinstance(new, str) and new.rstrip("/") != old.rstrip("/"):
                out.append((int(event_id), old.rstrip("/"), new.rstrip("/")))
        return out

    def log_id(self) -> str:
        """The identity of this event log (random at the index's creation)."""
        return str(self._query("SELECT value FROM settings WHERE key = 'log_id'", ())[0][0])


class _FileRows:
    """The files of a range of events, one cursor in (event_id, seq) order, read lazily:
    a page that stops inside a million-file event has read only what it lists."""

    def __init__(self, conn: sqlite3.Connection, first: int, last: int) -> None:
        self._cur = conn.execute(
            "SELECT event_id, seq, path, checksum, size FROM event_files"
            " WHERE event_id BETWEEN ? AND ? ORDER BY event_id, seq",
            (first, last),
        )
        self._pending: tuple[Any, ...] | None = None
        self._done = False

    def of(self, event_id: int) -> Iterator[tuple[Any, ...]]:
        """(seq, path, checksum, size) of `event_id`'s files; events are asked in order."""
        while True:
            row = self._pending if self._pending is not None else self._fetch()
            self._pending = None
            if row is None:
                return
            if row[0] < event_id:  # a file of an event the page skipped: cannot happen
                continue
            if row[0] > event_id:
                self._pending = row
                return
            yield row[1:]

    def _fetch(self) -> tuple[Any, ...] | None:
        if self._done:
            return None
        row: tuple[Any, ...] | None = self._cur.fetchone()
        if row is None:
            self._done = True
        return row

    def close(self) -> None:
        self._cur.close()


def _rows(cur: sqlite3.Cursor) -> Iterator[tuple[Any, ...]]:
    while batch := cur.fetchmany(FILES_FETCH):
        yield from batch


def _limited(rows: Iterator[tuple[Any, ...]], limit: int) -> Iterator[tuple[Any, ...]]:
    for i, row in enumerate(rows):
        yield row
        if i + 1 >= limit:
            return


def _fill(
    out: list[dict[str, Any]],
    rows: Iterator[tuple[Any, ...]],
    used: int,
    cap: int,
    at_least_one: bool = False,
) -> tuple[int, int, bool]:
    """Append (seq, path, checksum, size) rows to `out` as files while the JSON fits in
    `cap`. Returns the last seq listed (-1: none), the bytes used and whether `rows` ran
    out (False: a row did not fit)."""
    last = -1
    for seq, path, checksum, size in rows:
        f = {"path": path, "checksum": checksum, "size": size}
        cost = len(dumps(f)) + (1 if out else 0)
        if used + cost > cap and not (at_least_one and not out):
            return last, used, False
        out.append(f)
        used += cost
        last = seq
    return last, used, True


def _event(r: Sequence[Any], files: list[dict[str, Any]]) -> Event:
    location, table_obj, partition_locations = _meta(r[8])
    return Event(
        r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], bool(r[7]), files, location,
        table_obj, partition_locations, _audit(r[9]),
    )


def _audit(text: str | None) -> dict[str, str] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class _SplitMeta(msgspec.Struct, rename={"table_obj": "tableObj",
                                         "partition_locations": "partitionLocations"}):
    location: Any = None
    partition_locations: Any = None
    table_obj: msgspec.Raw = msgspec.Raw(b"null")


_SPLIT_META = msgspec.json.Decoder(_SplitMeta)


Meta = tuple[str | None, dict[str, Any] | None, list[str | None] | None]


def _meta(text: str | None) -> Meta:
    """The location, tableObj and partition locations of a meta column; a tableObj over
    the limits (or one that cannot be read) comes back as the OMITTED marker."""
    if text is None:
        return None, None, None
    try:
        if len(text) > MAX_TABLE_OBJ:
            # msgspec skips the tableObj as raw bytes: measured without being built.
            split = _SPLIT_META.decode(text)
            meta: Any = {"location": split.location, "tableObj": split.table_obj,
                         "partitionLocations": split.partition_locations}
        else:
            meta = json.loads(text)
    except RecursionError:
        why = f"nested over {MAX_TABLE_OBJ_DEPTH} levels deep"
        return _location_of(text), _omitted(why, _names_in_meta(text)), None
    except (ValueError, msgspec.DecodeError):
        return _location_of(text), _omitted("its stored JSON cannot be read"), None
    if not isinstance(meta, dict):
        return None, _omitted("its stored JSON cannot be read"), None
    location = meta.get("location")
    places = meta.get("partitionLocations")
    return (location if isinstance(location, str) else None, _table_obj(meta.get("tableObj")),
            places if isinstance(places, list) else None)


def _table_obj(value: Any) -> dict[str, Any] | None:
    if isinstance(value, msgspec.Raw):
        if len(value) > MAX_TABLE_OBJ:
            why = f"{len(value)} bytes of JSON, over the {MAX_TABLE_OBJ}-byte limit"
            return _omitted(why, _names(value))
        try:
            value = json.loads(bytes(value))
        except RecursionError:
            return _omitted(f"nested over {MAX_TABLE_OBJ_DEPTH} levels deep", _names(value))
    if value is None:
        return None
    if not isinstance(value, dict):
        return _omitted(f"a JSON {type(value).__name__}, not an object")
    if json_depth(value) > MAX_TABLE_OBJ_DEPTH:
        return _omitted(f"nested over {MAX_TABLE_OBJ_DEPTH} levels deep", _named(value))
    return value


class _Names(msgspec.Struct):
    """What an omitted tableObj keeps: which table it defines, and where (a rename into
    another database is recognised by them; a renamed table's files are found by them)."""

    db: Any = None
    table: Any = None
    location: Any = None


class _MetaNames(msgspec.Struct, rename={"table_obj": "tableObj"}):
    table_obj: _Names | None = None


_NAMES = msgspec.json.Decoder(_Names)
_NAMES_IN_META = msgspec.json.Decoder(_MetaNames)


def _names(raw: msgspec.Raw) -> dict[str, str]:
    """The names of a tableObj read without building the rest of it (none if even that
    cannot be read: nesting too deep to skip)."""
    try:
        return _named(msgspec.structs.asdict(_NAMES.decode(raw)))
    except (msgspec.DecodeError, RecursionError):
        return {}


def _names_in_meta(text: str) -> dict[str, str]:
    """The names of the tableObj of a meta too deep to parse whole."""
    try:
        found = _NAMES_IN_META.decode(text).table_obj
    except (msgspec.DecodeError, RecursionError):
        return {}
    return _named(msgspec.structs.asdict(found)) if found is not None else {}


def _named(obj: dict[str, Any]) -> dict[str, str]:
    return {k: v for k in ("db", "table", "location")
            if isinstance(v := obj.get(k), str) and len(v) <= _MAX_NAME}


def _omitted(why: str, names: dict[str, str] | None = None) -> dict[str, Any]:
    return {OMITTED: f"tableObj omitted: {why}; a replica of this table needs a bootstrap",
            **(names or {})}


def _location_of(text: str) -> str | None:
    """The location of a meta too deep to parse whole: _insert_event writes it first."""
    if not text.startswith(_LOCATION_FIRST):
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text, len(_LOCATION_FIRST))
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def json_depth(value: Any) -> int:
    """Nesting depth of decoded JSON (at most MAX_TABLE_OBJ_DEPTH + 1), walked without
    recursion."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > MAX_TABLE_OBJ_DEPTH:
            break
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return deepest

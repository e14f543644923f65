"""The dump directory: what `cmroot repl dump` writes and `cmroot repl load` reads.

    <dump>/events.parquet       one row per event, in replay order (id, then seq)
    <dump>/files.parquet        the manifest: (event_id, seq, path, checksum, size)
    <dump>/tables/<db>.<t>.json a table's definition and partitions as of the dump
    <dump>/_dump.json           the header, written last: a dump without it is incomplete

No data is copied: the manifest names each file by (original path, checksum), which the
loader resolves to the original or to its copy in the cmroot. Every field and column is
described in docs/dump-format.md. Paths inside the dump are
fsspec URLs or local paths, so a dump can live on any filesystem fsspec reaches."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import fsspec
import msgspec

from cmroot.exceptions import ReplError

# The major version of the format (docs/dump-format.md): a reader refuses another major
# and ignores fields it does not know. 2: events.parquet names its type column eventType
# (HCatalog's name; 1 said event_type, still read) and the header names the source's log.
FORMAT = 2
READS = (1, 2)
HEADER = "_dump.json"
EVENTS = "events.parquet"
FILES = "files.parquet"
KINDS = ("bootstrap", "incremental")

# (name, pyarrow type) of each column; pyarrow is imported only where a dump is read or
# written, because executors import this package and each fresh worker would pay for it.
EVENT_COLUMNS = (
    ("id", "int64"),
    ("seq", "int32"),
    ("eventType", "string"),
    ("db", "string"),
    ("table", "string"),
    ("partitions", "string"),  # JSON list of {key: value}
    ("partitionLocations", "string"),  # JSON list, one per partition (null: not recorded)
    ("location", "string"),
    ("table_obj", "string"),  # JSON object, or null
    ("purge", "bool_"),
    ("timestamp", "float64"),
)
FILE_COLUMNS = (
    ("event_id", "int64"),
    ("seq", "int32"),
    ("path", "string"),
    ("checksum", "string"),
    ("size", "int64"),
)


def _schema(columns: tuple[tuple[str, str], ...]) -> Any:
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, kind)()) for name, kind in columns])


@dataclass
class DumpEvent:
    """One event to replay. Bootstrap snapshots are events too (CREATE_TABLE, ADD_PARTITION,
    INSERT) sharing the id the dump started at, ordered by `seq`."""

    id: int
    seq: int
    type: str
    db: str | None
    table: str | None
    partitions: list[dict[str, str]] = field(default_factory=list)
    location: str | None = None
    table_obj: dict[str, Any] | None = None
    purge: bool = False
    timestamp: float = 0.0
    files: list[dict[str, Any]] = field(default_factory=list)
    # Where each of `partitions` lives (None: outside the source's roots); None when the
    # recorder did not say, and each partition is where its files' paths put it.
    partition_locations: list[str | None] | None = None

    def renamed(self) -> tuple[Name, Name] | None:
        """(old, new) name when this event renames a table, else None (`renamed`)."""
        return renamed({"eventType": self.type, "db": self.db, "table": self.table,
                        "tableObj": self.table_obj})

    @classmethod
    def from_api(cls, e: dict[str, Any], seq: int = 0) -> DumpEvent:
        """An event as `GET /v1/events` returns it."""
        return cls(
            id=int(e["id"]),
            seq=seq,
            type=e["eventType"],
            db=e.get("db"),
            table=e.get("table"),
            partitions=list(e.get("partitions") or []),
            location=e.get("location"),
            table_obj=e.get("tableObj"),
            purge=bool(e.get("purge")),
            timestamp=float(e.get("timestamp") or 0.0),
            files=list(e.get("files") or []),
            partition_locations=e.get("partitionLocations"),
        )


@dataclass
class Header:
    kind: str  # "bootstrap" or "incremental"
    db: str
    table: str | None
    first_event_id: int  # events after this id (a bootstrap: its snapshot's id)
    last_event_id: int  # the dump is consistent as of this event
    created: float
    daemon_url: str
    events: int = 0
    files: int = 0
    bytes: int = 0
    format: int = FORMAT
    source: str = ""  # the identity of the source's event log (GET /v1/events/current)
    # A table-level dump: "db.table", the table's name at `last_event_id` (renames followed),
    # which the next dump of it names (`cmroot repl dump --after`).
    table_now: str | None = None

    @property
    def scope(self) -> str:
        return self.db if self.table is None else f"{self.db}.{self.table}"


def write(
    url: str, header: Header, events: list[DumpEvent], tables: dict[str, dict[str, Any]]
) -> None:
    """Write a complete dump directory at `url` (which must not hold one yet)."""
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(posixpath.join(root, HEADER)):
        raise ReplError("dump directory already holds a dump", f"{url}: choose another --to-dir")
    fs.makedirs(posixpath.join(root, "tables"), exist_ok=True)
    header.events = len(events)
    header.files = sum(len(e.files) for e in events)
    header.bytes = sum(int(f["size"]) for e in events for f in e.files)
    import pyarrow as pa
    import pyarrow.parquet as pq

    ev_rows: dict[str, list[Any]] = {name: [] for name, _ in EVENT_COLUMNS}
    file_rows: dict[str, list[Any]] = {name: [] for name, _ in FILE_COLUMNS}
    for e in events:
        for name, value in (
            ("id", e.id),
            ("seq", e.seq),
            ("eventType", e.type),
            ("db", e.db),
            ("table", e.table),
            ("partitions", json.dumps(e.partitions)),
            ("partitionLocations", None if e.partition_locations is None
             else json.dumps(e.partition_locations)),
            ("location", e.location),
            ("table_obj", None if e.table_obj is None else json.dumps(e.table_obj)),
            ("purge", e.purge),
            ("timestamp", e.timestamp),
        ):
            ev_rows[name].append(value)
        for f in e.files:
            file_rows["event_id"].append(e.id)
            file_rows["seq"].append(e.seq)
            file_rows["path"].append(f["path"])
            file_rows["checksum"].append(f["checksum"])
            file_rows["size"].append(int(f["size"]))
    with fs.open(posixpath.join(root, EVENTS), "wb") as out:
        pq.write_table(pa.table(ev_rows, schema=_schema(EVENT_COLUMNS)), out)
    with fs.open(posixpath.join(root, FILES), "wb") as out:
        pq.write_table(pa.table(file_rows, schema=_schema(FILE_COLUMNS)), out)
    for name, meta in tables.items():
        with fs.open(posixpath.join(root, "tables", f"{name}.json"), "w") as out:
            json.dump(meta, out, indent=1, sort_keys=True)
    with fs.open(posixpath.join(root, HEADER), "w") as out:
        json.dump(asdict(header), out, indent=1)


@dataclass
class Dump:
    url: str
    header: Header
    events: list[DumpEvent]
    tables: dict[str, dict[str, Any]]

    def files(self) -> Iterator[dict[str, Any]]:
        for e in self.events:
            yield from e.files


class _EventRow(msgspec.Struct, rename={"type": "eventType"}):
    """A row of events.parquet, checked before it becomes a DumpEvent."""

    id: int
    seq: int
    type: str
    db: str | None
    table: str | None
    partitions: str  # JSON: decoded as _PARTITIONS
    location: str | None
    table_obj: str | None  # JSON: decoded as _TABLE_OBJ
    purge: bool
    timestamp: float
    # JSON, decoded as _PLACES; absent from dumps written before it (format 2 still).
    partitionLocations: str | None = None


class _FileRow(msgspec.Struct):
    """A row of files.parquet."""

    event_id: int
    seq: int
    path: str
    checksum: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    size: Annotated[int, msgspec.Meta(ge=0)]


_PARTITIONS = msgspec.json.Decoder(list[dict[str, str]])
_PLACES = msgspec.json.Decoder(list[str | None])
_TABLE_OBJ = msgspec.json.Decoder(dict[str, Any] | None)
_OBJECT = msgspec.json.Decoder(dict[str, Any])


def read(url: str) -> Dump:
    """Read a dump directory. A missing header, another format or a damaged file (a field
    of the wrong type, a file that does not parse) is a ReplError naming the file and what
    is wrong: a dump is read before anything is applied, so a bad one changes nothing."""
    fs, root = fsspec.core.url_to_fs(url)
    header = _header(url, fs, root)
    by_key: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for i, r in enumerate(_rows(url, fs, root, FILES)):
        try:
            file = msgspec.convert(r, _FileRow)
        except msgspec.ValidationError as e:
            raise _damaged(url, FILES, f"row {i}: {e}") from None
        by_key.setdefault((file.event_id, file.seq), []).append(
            {"path": file.path, "checksum": file.checksum, "size": file.size}
        )
    events = []
    for i, r in enumerate(_rows(url, fs, root, EVENTS)):
        if "eventType" not in r and "event_type" in r:  # format 1's name
            r["eventType"] = r.pop("event_type")
        try:
            row = msgspec.convert(r, _EventRow)
        except msgspec.ValidationError as e:
            raise _damaged(url, EVENTS, f"row {i}: {e}") from None
        partitions = _decode(_PARTITIONS, row.partitions, url, EVENTS,
                             f"row {i}: partitions is not a JSON list of string maps")
        events.append(DumpEvent(
            id=row.id,
            seq=row.seq,
            type=row.type,
            db=row.db,
            table=row.table,
            partitions=partitions,
            location=row.location,
            table_obj=None if row.table_obj is None else _decode(
                _TABLE_OBJ, row.table_obj, url, EVENTS, f"row {i}: table_obj is not a JSON object"),
            purge=row.purge,
            timestamp=row.timestamp,
            files=by_key.get((row.id, row.seq), []),
            partition_locations=_places(row, len(partitions), url, i),
        ))
    events.sort(key=lambda e: (e.id, e.seq))
    tables = {}
    for path in fs.glob(posixpath.join(root, "tables", "*.json")):
        name = f"tables/{posixpath.basename(path)}"
        with fs.open(path, "rb") as f:
            meta = _decode(_OBJECT, f.read(), url, name, "not a JSON object")
        if meta.get("tableObj") is not None and not isinstance(meta["tableObj"], dict):
            raise _damaged(url, name, "tableObj is not a JSON object")
        tables[posixpath.basename(path)[: -len(".json")]] = meta
    return Dump(url, header, events, tables)


def _places(row: _EventRow, partitions: int, url: str, i: int) -> list[str | None] | None:
    """The row's partition locations, one per partition, or None."""
    if row.partitionLocations is None:
        return None
    places: list[str | None] = _decode(_PLACES, row.partitionLocations, url, EVENTS,
                                       f"row {i}: partitionLocations is not a JSON list")
    if len(places) != partitions:
        raise _damaged(url, EVENTS, f"row {i}: partitionLocations does not match partitions")
    return places


def _header(url: str, fs: Any, root: str) -> Header:
    """The header, checked: its format first, as another format may have other fields."""
    try:
        with fs.open(posixpath.join(root, HEADER), "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise ReplError(
            "not a complete dump",
            f"{url} has no {HEADER}: point --from-dir at the directory `cmroot repl dump` "
            "printed; an interrupted dump must be taken again",
        ) from None
    except OSError as e:  # a file where the dump's directory should be, unreadable, ...
        raise ReplError(
            "cannot read the dump",
            f"{url.rstrip('/')}/{HEADER}: {e.strerror or e}: give the directory `cmroot"
            " repl dump` printed",
        ) from None
    raw = _decode(_OBJECT, text, url, HEADER, "not a JSON object")
    if "format" not in raw:
        raise _damaged(url, HEADER, "no format")
    fmt = raw["format"]
    if type(fmt) is int and fmt not in READS:  # not a bool (True == 1): refused below
        raise ReplError(
            "unsupported dump format",
            f"{url.rstrip('/')}/{HEADER}: format {fmt}, this cmroot reads "
            f"{', '.join(map(str, READS))}; load it with the cmroot version that wrote it",
        )
    # Fields a later release of this format adds are ignored: readers skip what they lack.
    try:
        header = msgspec.convert(raw, Header)
    except msgspec.ValidationError as e:
        raise _damaged(url, HEADER, str(e)) from None
    if header.kind not in KINDS:
        raise _damaged(url, HEADER, f"kind {header.kind[:40]!r} is not one of {', '.join(KINDS)}")
    return header


def _rows(url: str, fs: Any, root: str, name: str) -> list[dict[str, Any]]:
    """The rows of a Parquet file of the dump, each as a dict."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fs.open(posixpath.join(root, name), "rb") as f:
            rows: list[dict[str, Any]] = pq.read_table(f).to_pylist()
    except (OSError, pa.ArrowException) as e:
        # pyarrow says OSError for corrupt pages as well as for a failed read.
        raise _damaged(url, name, f"cannot be read ({str(e)[:200]}; if the filesystem "
                                  "failed, retry)") from None
    return rows


def _decode(decoder: msgspec.json.Decoder[Any], text: str | bytes, url: str, name: str,
            what: str) -> Any:
    """JSON from a file of the dump, as `decoder`'s type; else `what` is wrong."""
    try:
        return decoder.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise _damaged(url, name, f"{what} ({str(e)[:200]})") from None


def _damaged(url: str, name: str, what: str) -> ReplError:
    return ReplError(
        "damaged dump",
        f"{url.rstrip('/')}/{name}: {what}: the dump is damaged or was not written by cmroot;"
        " take it again",
    )


Name = tuple[str, str]  # (database, table), lower case


def renamed(e: dict[str, Any]) -> tuple[Name, Name] | None:
    """(old, new) name of an API event that renames a table (within or across databases),
    else None (also for an omitted or foreign `tableObj`: no rename is known)."""
    obj = e.get("tableObj")
    if e.get("eventType") != "ALTER_TABLE" or not isinstance(obj, dict):
        return None
    was = (_name(e.get("db")), _name(e.get("table")))
    now = (_name(obj.get("db")) or was[0], _name(obj.get("table")))
    return None if not all(was + now) or was == now else (was, now)


def in_scope(
    events: Iterable[dict[str, Any]], db: str, table: str | None
) -> Iterator[tuple[dict[str, Any], bool]]:
    """Each API event with whether it concerns `db` (or one table of it, followed through
    renames, into other databases too). A table renamed into `db` concerns it: the rename
    brings the table (its event lists the files)."""
    db_now, current = db.lower(), table.lower() if table else None
    for e in events:
        e_db, moved = _name(e.get("db")), renamed(e)
        if current is None:
            yield e, e_db == db_now or (moved is not None and moved[1][0] == db_now)
        elif e_db != db_now:
            yield e, False
        elif e.get("eventType") in ("CREATE_DATABASE", "DROP_DATABASE"):
            yield e, True
        elif _name(e.get("table")) == current:
            if moved is not None:
                db_now, current = moved[1]
            yield e, True
        else:
            yield e, False


def _name(value: Any) -> str:
    """A database or table name of an event, lower case; "" when it is none (or not a
    string: an event of another producer is out of scope, not a crash)."""
    return value.lower() if isinstance(value, str) else ""

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
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import fsspec

from cmroot.exceptions import ReplError

# The major version of the format (docs/dump-format.md): a reader refuses another major
# and ignores fields it does not know. 2: events.parquet names its type column eventType
# (HCatalog's name; 1 said event_type, still read) and the header names the source's log.
FORMAT = 2
READS = (1, 2)
HEADER = "_dump.json"

# (name, pyarrow type) of each column; pyarrow is imported only where a dump is read or
# written, because executors import this package and each fresh worker would pay for it.
EVENT_COLUMNS = (
    ("id", "int64"),
    ("seq", "int32"),
    ("eventType", "string"),
    ("db", "string"),
    ("table", "string"),
    ("partitions", "string"),  # JSON list of {key: value}
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
    with fs.open(posixpath.join(root, "events.parquet"), "wb") as out:
        pq.write_table(pa.table(ev_rows, schema=_schema(EVENT_COLUMNS)), out)
    with fs.open(posixpath.join(root, "files.parquet"), "wb") as out:
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


def read(url: str) -> Dump:
    """Read a dump directory; a missing header or another format is a clear error."""
    import pyarrow.parquet as pq

    fs, root = fsspec.core.url_to_fs(url)
    try:
        with fs.open(posixpath.join(root, HEADER), "r") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ReplError(
            "not a complete dump",
            f"{url} has no {HEADER}: point --from-dir at the directory `cmroot repl dump` "
            "printed; an interrupted dump must be taken again",
        ) from None
    if raw.get("format") not in READS:
        raise ReplError(
            "unsupported dump format", f"{url}: format {raw.get('format')}, this cmroot reads "
            f"{', '.join(map(str, READS))}; load it with the cmroot version that wrote it"
        )
    # Fields a later release of this format adds are ignored: readers skip what they lack.
    known = {f.name for f in fields(Header)}
    header = Header(**{k: v for k, v in raw.items() if k in known})
    with fs.open(posixpath.join(root, "events.parquet"), "rb") as f:
        ev = pq.read_table(f).to_pylist()
    with fs.open(posixpath.join(root, "files.parquet"), "rb") as f:
        files = pq.read_table(f).to_pylist()
    by_key: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in files:
        by_key.setdefault((r["event_id"], r["seq"]), []).append(
            {"path": r["path"], "checksum": r["checksum"], "size": r["size"]}
        )
    events = [
        DumpEvent(
            id=r["id"],
            seq=r["seq"],
            type=r["eventType"] if "eventType" in r else r["event_type"],
            db=r["db"],
            table=r["table"],
            partitions=json.loads(r["partitions"]),
            location=r["location"],
            table_obj=None if r["table_obj"] is None else json.loads(r["table_obj"]),
            purge=r["purge"],
            timestamp=r["timestamp"],
            files=by_key.get((r["id"], r["seq"]), []),
        )
        for r in sorted(ev, key=lambda r: (r["id"], r["seq"]))
    ]
    tables = {}
    for path in fs.glob(posixpath.join(root, "tables", "*.json")):
        with fs.open(path, "r") as f:
            tables[posixpath.basename(path)[: -len(".json")]] = json.load(f)
    return Dump(url, header, events, tables)


def in_scope(
    events: Iterable[dict[str, Any]], db: str, table: str | None
) -> Iterator[tuple[dict[str, Any], bool]]:
    """Each API event with whether it concerns `db` (or one table of it, followed through
    renames)."""
    db, current = db.lower(), table.lower() if table else None
    for e in events:
        if (e.get("db") or "").lower() != db:
            yield e, False
        elif current is None or e["eventType"] in ("CREATE_DATABASE", "DROP_DATABASE"):
            yield e, True
        elif (e.get("table") or "").lower() == current:
            new = (e.get("tableObj") or {}).get("table")
            if e["eventType"] == "ALTER_TABLE" and new:
                current = new.lower()
            yield e, True
        else:
            yield e, False

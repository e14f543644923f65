"""Typed schemas of every request body and query string of the HTTP API, and the decoders
the handlers go through. Lengths, integer ranges, nesting depth and the size of `tableObj`
are checked here, before any store call, so bad input is a 400 naming the field and the
fix, never a 5xx: a body nested 100,000 deep, a 5000-digit integer or a 60 MiB `tableObj`
(which would make every page of the event log holding it fail) is refused up front.

The store keeps its own checks (RecycleRequest.validate, paths confined to the roots):
these schemas only make sure what reaches it has the right shape and bounded size."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from cmroot.exceptions import BadRequest
from cmroot.index.events import ACCEPTED_TABLE_OBJ, MAX_TABLE_OBJ_DEPTH, json_depth
from cmroot.store import RecycleRequest
from cmroot.vocab import DESTRUCTIVE, RECORDABLE, EventType, Mode

MAX_NAME = 1024  # db, table, server, partition keys: the store refuses longer names too
MAX_VALUE = 4096  # a partition value
MAX_PATH = 4096  # = store.warehouse.MAX_PATH, in characters
MAX_ITEMS = 100_000  # paths, partitions or resolve pairs in one request (= MAX_PAIRS)
MAX_EVENT_FILES = 1_000_000  # files of one recorded event (the body size caps them first)
MAX_PARTITION_KEYS = 256
MAX_INT = 2**63 - 1  # SQLite's integers
MAX_TIMESTAMP = 1e11  # seconds since the epoch: year 5138
_ECHO = 200  # characters of a refused value echoed back in a detail
MAX_AUDIT = 1 << 16  # characters of an audit field accepted (the store keeps fewer)

Name = Annotated[str, Meta(max_length=MAX_NAME)]
PathStr = Annotated[str, Meta(min_length=1, max_length=MAX_PATH)]
Checksum = Annotated[str, Meta(pattern="^[0-9a-f]{32}$")]
Size = Annotated[int, Meta(ge=0, le=MAX_INT)]
Partition = Annotated[
    dict[Name, Annotated[str, Meta(max_length=MAX_VALUE)]], Meta(max_length=MAX_PARTITION_KEYS)
]
Partitions = Annotated[list[Partition], Meta(max_length=MAX_ITEMS)]
TxId = Annotated[str, Meta(pattern="^[0-9a-f]{32}$")]
Lease = Annotated[float, Meta(ge=1, le=86400)]  # seconds (= store.recycle.MAX_LEASE)


class Audit(Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """Who and what asked (cmroot.audit): long values are cut there, not refused here."""

    user: Annotated[str, Meta(max_length=MAX_AUDIT)] | None = None
    host: Annotated[str, Meta(max_length=MAX_AUDIT)] | None = None
    app: Annotated[str, Meta(max_length=MAX_AUDIT)] | None = None
    statement: Annotated[str, Meta(max_length=MAX_AUDIT)] | None = None

    def to_dict(self) -> dict[str, str]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class RecycleBody(Struct, forbid_unknown_fields=True, frozen=True):
    """POST /v1/recycle."""

    paths: Annotated[list[PathStr], Meta(min_length=1, max_length=MAX_ITEMS)]
    op: EventType
    mode: Mode = Mode.MOVE
    purge: bool = False
    db: Name | None = None
    table: Name | None = None
    partitions: Partitions | None = None
    location: PathStr | None = None
    # The table's partitions' own locations outside its directory (its files there are the
    # table's too).
    partitionLocations: Annotated[list[PathStr], Meta(max_length=MAX_ITEMS)] | None = None
    # Two-phase: stage the files unseen (commit or abort them through /v1/transactions);
    # `txid` adds them to a prepared transaction of the same statement.
    prepare: bool = False
    txid: TxId | None = None
    lease: Lease | None = None
    audit: Audit | None = None

    def request(self) -> RecycleRequest:
        """The store's request, checked by its own rules (a destructive op, ...)."""
        req = RecycleRequest(
            paths=self.paths,
            mode=self.mode,
            purge=self.purge,
            op=self.op,
            db=self.db,
            table=self.table,
            partitions=self.partitions or [],
            location=self.location,
            partition_locations=self.partitionLocations or [],
            audit=self.audit.to_dict() if self.audit is not None else None,
        )
        req.validate()
        return req


class RenewBody(Struct, forbid_unknown_fields=True, frozen=True):
    """POST /v1/transactions/{txid}/renew (the body is optional)."""

    lease: Lease | None = None


class Pair(Struct, forbid_unknown_fields=True, frozen=True):
    path: PathStr
    checksum: Checksum


class ResolveBody(Struct, forbid_unknown_fields=True, frozen=True):
    """POST /v1/resolve."""

    files: Annotated[list[Pair], Meta(max_length=MAX_ITEMS)]

    def pairs(self) -> list[dict[str, str]]:
        return [{"path": p.path, "checksum": p.checksum} for p in self.files]


class EventFile(Struct, forbid_unknown_fields=True, frozen=True):
    """A file of a recorded event; without checksum and size the store hashes it."""

    path: PathStr
    checksum: Checksum | UnsetType = UNSET
    size: Size | UnsetType = UNSET

    def to_dict(self) -> dict[str, Any]:
        # Only the keys given: the store tells "hash it for me" from "size 0" by them.
        out: dict[str, Any] = {"path": self.path}
        if self.checksum is not UNSET:
            out["checksum"] = self.checksum
        if self.size is not UNSET:
            out["size"] = self.size
        return out


class EventBody(
    Struct,
    forbid_unknown_fields=True,
    frozen=True,
    rename={"type": "eventType", "table_json": "tableObj"},
):
    """POST /v1/events."""

    type: EventType
    db: Name | None = None
    table: Name | None = None
    partitions: Partitions | None = None
    files: Annotated[list[EventFile], Meta(max_length=MAX_EVENT_FILES)] | None = None
    server: Name | None = None
    # Accepted because HCatalog messages carry it; the daemon stamps events with its clock.
    timestamp: Annotated[float, Meta(ge=0, le=MAX_TIMESTAMP)] | None = None
    location: PathStr | None = None
    # Where each of `partitions` lives, in order; null for one outside the warehouse roots.
    partitionLocations: Annotated[list[PathStr | None], Meta(max_length=MAX_ITEMS)] | None = None
    table_json: Raw = Raw(b"null")  # decoded by table_obj(), once its size is known
    audit: Audit | None = None

    def table_obj(self) -> dict[str, Any] | None:
        """The table definition, refused when over ACCEPTED_TABLE_OBJ bytes or
        MAX_TABLE_OBJ_DEPTH levels: the event log must be able to page every event."""
        raw = bytes(self.table_json)
        if len(raw) > ACCEPTED_TABLE_OBJ:
            raise BadRequest(
                "bad tableObj",
                f"{len(raw)} bytes of JSON: {_HINTS['tableObj']}",
            )
        try:
            obj: dict[str, Any] | None = _TABLE_OBJ.decode(raw)
        except (msgspec.ValidationError, RecursionError) as e:
            raise BadRequest("bad tableObj", f"{_reason(e)}: {_HINTS['tableObj']}") from None
        if obj is not None and json_depth(obj) > MAX_TABLE_OBJ_DEPTH:
            raise BadRequest("bad tableObj", f"nested too deep: {_HINTS['tableObj']}")
        return obj


_TABLE_OBJ = msgspec.json.Decoder(dict[str, Any] | None)


# -- query strings -----------------------------------------------------------------------

Page = Annotated[int, Meta(ge=1, le=1000)]
EventId = Annotated[int, Meta(ge=0, le=2**62)]


class FilesQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """GET /v1/files."""

    path: PathStr
    checksum: Checksum


class EntriesQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """GET /v1/entries; cursor 0 is the first page."""

    db: Name | None = None
    table: Name | None = None
    limit: Page = 100
    cursor: EventId = 0
    all: bool = True  # false: leave out housekeeping files (_SUCCESS, .*.crc)


class EventsQuery(Struct, forbid_unknown_fields=True, frozen=True, rename={"start": "from"}):
    """GET /v1/events."""

    start: EventId = 0
    limit: Page = 100


class EventFilesQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """GET /v1/events/{id}/files; after -1 is the first page."""

    after: Annotated[int, Meta(ge=-1, le=2**62)] = -1
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 100_000


class HoldBody(Struct, forbid_unknown_fields=True, frozen=True):
    """POST /v1/holds (the store checks the names and that `until` is ahead)."""

    db: Name
    until: Annotated[float, Meta(ge=0, le=MAX_TIMESTAMP)]
    reason: Annotated[str, Meta(min_length=1, max_length=1000)]
    table: Name | None = None


class HoldsQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """GET /v1/holds: `all` lists holds past their `until` too."""

    all: bool = False


class GcQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """POST /v1/gc; `files` and `all` shape a dry run's names."""

    dry_run: bool = False
    files: bool = False
    all: bool = False


class FsckQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """POST /v1/fsck."""

    repair: bool = False


class NoQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """Routes that take no parameters."""


# -- decoding ----------------------------------------------------------------------------

S = TypeVar("S", bound=Struct)
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    cls: msgspec.json.Decoder(cls)
    for cls in (RecycleBody, ResolveBody, EventBody, RenewBody, HoldBody)
}
_INT = re.compile(r"-?[0-9]{1,19}")
_BOOLS = {"true": True, "1": True, "false": False, "0": False}

# The fix for each field, by its name (the last name in the field's path).
_HINTS = {
    "paths": f"give a non-empty list of absolute paths or URLs (at most {MAX_ITEMS})",
    "path": f"give an absolute path or URL of at most {MAX_PATH} characters",
    "op": f"use one of {', '.join(sorted(DESTRUCTIVE))}",
    "eventType": f"use one of {', '.join(sorted(RECORDABLE))}",
    "mode": 'use "move" or "copy"',
    "purge": "use true or false",
    "dry_run": "use true or false",
    "db": f"give a name of at most {MAX_NAME} characters, or null",
    "table": f"give a name of at most {MAX_NAME} characters, or null",
    "server": f"give a name of at most {MAX_NAME} characters, or null",
    "partitions": 'give a list of {"key": "value"} objects of strings',
    "location": "give the table's location as an absolute path or URL, or null",
    "partitionLocations": (
        "give a list of absolute paths or URLs (partition directories); an event gives one"
        " per partition, null for one outside the warehouse roots"
    ),
    "checksum": "give an xxh3-128 checksum: 32 lowercase hex digits",
    "size": f"give the size in bytes as a non-negative integer (at most {MAX_INT})",
    "timestamp": "give seconds since the epoch, or leave it out (the daemon stamps events)",
    "tableObj": (
        f"give the table definition as a JSON object of at most {ACCEPTED_TABLE_OBJ} bytes and "
        f"{MAX_TABLE_OBJ_DEPTH} levels, integers within 64 bits"
    ),
    "limit": "give an integer within the range",
    "cursor": "give the integer cursor of the previous page, or leave it out",
    "from": "give an integer event id (0 for the start of the log)",
    "after": "give the integer filesNext of the previous page, or leave it out",
}
# What the store calls an item of `files` in its own refusals.
_ITEM_WORDS: dict[type[Any], str] = {ResolveBody: "pair", EventBody: "file"}
# Fixes that depend on the body: the files of a resolve and of an event differ.
_BODY_HINTS: dict[type[Any], dict[str, str]] = {
    ResolveBody: {"files": f'give a list of {{"path", "checksum"}} objects, at most {MAX_ITEMS}'},
    EventBody: {
        "files": 'give a list of {"path", "checksum", "size"} objects (or {"path"} alone to '
        "have the daemon hash the file)"
    },
}


def decode(raw: bytes, cls: type[S]) -> S:
    """The body as `cls`, or BadRequest naming the field at fault and the fix."""
    try:
        out: S = _DECODERS[cls].decode(raw)
    except msgspec.ValidationError as e:
        raise _refusal(str(e), cls) from None
    except msgspec.DecodeError as e:
        raise _surrogate(raw, cls) or BadRequest(
            "malformed JSON", f"{e}: send one JSON object") from None
    except UnicodeDecodeError as e:
        raise BadRequest("malformed JSON", f"{e}: send UTF-8 encoded JSON") from None
    except RecursionError:
        raise BadRequest("JSON nested too deeply", "send a flat request body") from None
    return out


def _surrogate(raw: bytes, cls: type[Any]) -> BadRequest | None:
    """The refusal naming the item of `files` that holds a lone surrogate escape
    ("\\ud800"): JSON that msgspec refuses whole ("Input data was truncated"), as no
    UTF-8 text holds it, where a bad path is a bad item (DESIGN: the 400 names the pair).
    None when the body is malformed otherwise. Only ever a refusal: nothing the stdlib
    reads here is taken."""
    word = _ITEM_WORDS.get(cls)
    if word is None or b"\\u" not in raw:
        return None
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    files = body.get("files") if isinstance(body, dict) else None
    for i, item in enumerate(files if isinstance(files, list) else ()):
        try:
            json.dumps(item, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return BadRequest(
                f"bad {word} #{i}",
                f"files[{i}] holds a lone surrogate (\\ud800-\\udfff), which names no file: "
                "send the path as UTF-8 text",
            )
        except (ValueError, RecursionError):
            return None
    return None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def decode_query(query: Iterable[tuple[str, str]], cls: type[S]) -> S:
    """A query string's (name, value) pairs as `cls`: each parameter at most once, an
    empty value means the default, integers in plain decimal (no `1e3`), booleans
    true/false/1/0."""
    types = _field_types(cls)
    values: dict[str, Any] = {}
    seen: set[str] = set()
    for key, value in query:
        if key in seen:
            raise BadRequest(f"bad {key[:_ECHO]}", "give each query parameter once")
        seen.add(key)
        if value == "":
            continue
        kind = types.get(key)
        if isinstance(kind, msgspec.inspect.IntType) and _INT.fullmatch(value):
            values[key] = int(value)
        elif isinstance(kind, msgspec.inspect.BoolType) and value.lower() in _BOOLS:
            values[key] = _BOOLS[value.lower()]
        else:
            values[key] = value
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as e:
        raise _refusal(str(e), cls) from None


@functools.cache
def _field_types(cls: type[Struct]) -> dict[str, msgspec.inspect.Type]:
    """A query struct's field types by name, inspected once: `type_info` evaluates the
    annotations anew on every call (a third of a small GET's time when done per request)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.encode_name: f.type for f in info.fields}


def _reason(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "nested too deep"
    return str(e).replace("`$", "`tableObj")


def _refusal(text: str, cls: type[Struct]) -> BadRequest:
    """BadRequest from a msgspec message like "Expected `int` >= 0 - at `$.files[0].size`":
    the message names the field (an item of `files` as the store does: "bad pair #0",
    "bad file #0"), the detail its full path, what is wrong and the fix."""
    hints = {**_HINTS, **_BODY_HINTS.get(cls, {})}
    reason, _, where = text.partition(" - at `")
    field = where.rstrip("`").removeprefix("$").removeprefix(".")
    reason = reason if len(reason) <= _ECHO else reason[:_ECHO] + "..."
    named = re.search(r"(unknown|missing required) field `(.*)`", reason)
    known = ", ".join(f.encode_name for f in msgspec.structs.fields(cls))
    if named is not None and named.group(1) == "unknown":
        fix = hints.get(_last_name(field), "remove it") if field else f"known fields: {known}"
        word, field = "unknown field", f"{field}.{named.group(2)}".strip(".")
    elif named is not None:
        word, field = "missing", f"{field}.{named.group(2)}".strip(".")
        fix = hints.get(named.group(2), "")
    elif not field:
        return BadRequest("bad request body", f"{reason}: send a JSON object with {known}")
    else:
        # "unknown op", "unknown eventType": the store's words for a name outside the
        # vocabulary.
        word = "unknown" if reason.startswith("Invalid enum value") else "bad"
        fix = hints.get(_last_name(field), "see the API")
    item = re.match(r"files\[(\d+)\]", field)
    if item is not None and cls in _ITEM_WORDS:
        return BadRequest(
            f"bad {_ITEM_WORDS[cls]} #{item.group(1)}", f"{word} {field}: {reason}: {fix}"
        )
    return BadRequest(f"{word} {field[:_ECHO]}", f"{reason}: {fix}")


def _last_name(field: str) -> str:
    names = re.findall(r"[A-Za-z_]+", field)
    return names[-1] if names else ""

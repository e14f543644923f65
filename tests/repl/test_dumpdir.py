"""The dump directory round-trips exactly, refuses to be written twice or read half-done,
and the scope filter follows a table through renames."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmroot.exceptions import ReplError
from cmroot.repl import dumpdir
from cmroot.repl.dumpdir import DumpEvent, Header

names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
files = st.lists(
    st.fixed_dictionaries(
        {
            "path": names.map(lambda s: "/wh/t/" + s.replace("/", "_")),
            "checksum": st.text("0123456789abcdef", min_size=32, max_size=32),
            "size": st.integers(0, 2**40),
        }
    ),
    max_size=5,
)
partitions = st.lists(st.dictionaries(names, names, max_size=2), max_size=2)


@st.composite
def placed(draw: st.DrawFn) -> tuple[list[dict[str, str]], list[str | None] | None]:
    """Partitions, and none or one location (or null) for each."""
    specs = draw(partitions)
    where = st.lists(st.none() | names.map(lambda s: "/wh/" + s), min_size=len(specs),
                     max_size=len(specs))
    return specs, draw(st.none() | where)


events = st.lists(
    st.builds(
        lambda where, **kw: DumpEvent(partitions=where[0], partition_locations=where[1], **kw),
        where=placed(),
        id=st.integers(0, 2**40),
        seq=st.integers(0, 1000),
        type=st.sampled_from(["CREATE_TABLE", "INSERT", "DROP_PARTITION", "INSERT_OVERWRITE"]),
        db=names,
        table=st.none() | names,
        location=st.none() | names,
        table_obj=st.none() | st.dictionaries(names, names, max_size=3),
        purge=st.booleans(),
        timestamp=st.floats(0, 2e9),
        files=files,
    ),
    max_size=6,
    unique_by=lambda e: (e.id, e.seq),
)


def header(**kw: Any) -> Header:
    return Header(**{"kind": "incremental", "db": "s", "table": None, "first_event_id": 0,
                     "last_event_id": 9, "created": time.time(), "daemon_url": "", **kw})


@settings(max_examples=40, deadline=None)
@given(evs=events)
def test_round_trip(tmp_path_factory: pytest.TempPathFactory, evs: list[DumpEvent]) -> None:
    url = str(tmp_path_factory.mktemp("dump") / "d")
    tables = {"s.t": {"tableObj": {"table": "t"}, "partitions": None}}
    dumpdir.write(url, header(), evs, tables)
    got = dumpdir.read(url)
    assert got.events == sorted(evs, key=lambda e: (e.id, e.seq))
    assert got.tables == tables
    assert got.header.files == sum(len(e.files) for e in evs)
    assert got.header.bytes == sum(f["size"] for e in evs for f in e.files)


def test_written_once(tmp_path: Path) -> None:
    url = str(tmp_path / "d")
    dumpdir.write(url, header(), [], {})
    before = sorted(p.name for p in (tmp_path / "d").iterdir())
    with pytest.raises(ReplError, match="already holds a dump"):
        dumpdir.write(url, header(last_event_id=10), [], {})
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == before
    assert dumpdir.read(url).header.last_event_id == 9


def test_incomplete_or_foreign_dump_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "d")
    dumpdir.write(url, header(), [], {})
    (tmp_path / "d" / dumpdir.HEADER).unlink()
    with pytest.raises(ReplError, match="not a complete dump") as e:
        dumpdir.read(url)
    assert url in e.value.detail
    (tmp_path / "d" / dumpdir.HEADER).write_text(json.dumps({"format": 99}))
    with pytest.raises(ReplError, match="unsupported dump format"):
        dumpdir.read(url)


def test_the_format_reads_version_1_and_ignores_fields_it_does_not_know(tmp_path: Path) -> None:
    """docs/dump-format.md: events.parquet uses HCatalog's column name (eventType; format 1
    said event_type and is still read), the header names the source's event log, and a
    reader ignores header fields a later minor release adds."""
    import pyarrow.parquet as pq

    url = str(tmp_path / "d")
    dumpdir.write(url, header(source="a" * 32), [DumpEvent(3, 0, "INSERT", "s", "t")], {})
    assert "eventType" in pq.read_schema(tmp_path / "d" / "events.parquet").names
    raw = json.loads((tmp_path / "d" / dumpdir.HEADER).read_text())
    assert raw["format"] == dumpdir.FORMAT == 2 and raw["source"] == "a" * 32
    raw["added_by_a_later_release"] = {"x": 1}
    (tmp_path / "d" / dumpdir.HEADER).write_text(json.dumps(raw))
    assert dumpdir.read(url).header.source == "a" * 32

    table = pq.read_table(tmp_path / "d" / "events.parquet")
    old = table.rename_columns(
        ["event_type" if n == "eventType" else n for n in table.column_names])
    pq.write_table(old, tmp_path / "d" / "events.parquet")
    del raw["source"]
    raw["format"] = 1
    (tmp_path / "d" / dumpdir.HEADER).write_text(json.dumps(raw))
    got = dumpdir.read(url)
    assert got.header.source == "" and [e.type for e in got.events] == ["INSERT"]


def test_dump_on_another_filesystem() -> None:
    url = "memory://dumps/one"
    dumpdir.write(url, header(), [DumpEvent(3, 0, "INSERT", "s", "t", files=[
        {"path": "/wh/t/a", "checksum": "0" * 32, "size": 1}])], {})
    assert dumpdir.read(url).events[0].files == [{"path": "/wh/t/a", "checksum": "0" * 32,
                                                  "size": 1}]


def ev(i: int, kind: str, db: str, table: str | None, new: str | None = None) -> dict[str, Any]:
    return {"id": i, "eventType": kind, "db": db, "table": table,
            "tableObj": {"db": db, "table": new} if new else None}


def test_scope_follows_renames() -> None:
    log = [
        ev(1, "CREATE_DATABASE", "s", None),
        ev(2, "CREATE_TABLE", "s", "t", "t"),
        ev(3, "INSERT", "s", "u"),
        ev(4, "ALTER_TABLE", "s", "t", "t2"),
        ev(5, "INSERT", "s", "t2"),
        ev(6, "INSERT", "S", "T2"),
        ev(7, "INSERT", "other", "t2"),
        ev(8, "INSERT", "s", "t"),
    ]
    picked = [e["id"] for e, ok in dumpdir.in_scope(log, "s", "t") if ok]
    assert picked == [1, 2, 4, 5, 6]
    assert [e["id"] for e, ok in dumpdir.in_scope(log, "S", None) if ok] == [1, 2, 3, 4, 5, 6, 8]


# -- a damaged dump is a ReplError naming the file and what is wrong ----------------------------


def good_dump(root: Path) -> str:
    """A dump with one event of each part (partitions, a definition, a file) and a table."""
    url = str(root / "d")
    obj = {"db": "s", "table": "t"}
    dumpdir.write(url, header(source="a" * 32), [
        DumpEvent(3, 0, "INSERT", "s", "t", [{"p": "1"}], "/wh/t", obj, timestamp=1.5,
                  files=[{"path": "/wh/t/p=1/a", "checksum": "0" * 32, "size": 1}],
                  partition_locations=["/wh/t/p=1"])],
        {"s.t": {"tableObj": obj, "partitions": None}})
    return url


def rewrite_header(url: str, change: Any) -> None:
    path = Path(url) / dumpdir.HEADER
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def rewrite_parquet(url: str, name: str, change: Any) -> None:
    """Rewrite `name` (events.parquet, files.parquet) with `change` applied to its one row:
    each column's type is what its value makes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(url) / name
    rows = pq.read_table(path).to_pylist()
    change(rows[0])
    pq.write_table(pa.Table.from_pylist(rows), path)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_json(v: object, ok: Any) -> bool:
    try:
        return isinstance(v, str) and bool(ok(json.loads(v)))
    except ValueError:
        return False


# What each header field, event column and manifest column may hold (docs/dump-format.md).
HEADER_OK: dict[str, Any] = {
    "format": lambda v: is_int(v) and v in dumpdir.READS,
    "kind": lambda v: v in ("bootstrap", "incremental"),
    "db": lambda v: isinstance(v, str),
    "table": lambda v: v is None or isinstance(v, str),
    "first_event_id": is_int,
    "last_event_id": is_int,
    "created": lambda v: is_int(v) or isinstance(v, float),
    "daemon_url": lambda v: isinstance(v, str),
    "source": lambda v: isinstance(v, str),
    "events": is_int,
    "files": is_int,
    "bytes": is_int,
}
EVENT_OK: dict[str, Any] = {
    "id": is_int,
    "seq": is_int,
    "eventType": lambda v: isinstance(v, str),
    "db": lambda v: v is None or isinstance(v, str),
    "table": lambda v: v is None or isinstance(v, str),
    "partitions": lambda v: is_json(v, lambda p: isinstance(p, list) and all(
        isinstance(s, dict) and all(isinstance(x, str) for x in s.values()) for s in p)),
    "partitionLocations": lambda v: v is None or is_json(v, lambda p: isinstance(p, list) and len(
        p) == 1 and all(x is None or isinstance(x, str) for x in p)),
    "location": lambda v: v is None or isinstance(v, str),
    "table_obj": lambda v: v is None or is_json(v, lambda o: o is None or isinstance(o, dict)),
    "purge": lambda v: isinstance(v, bool),
    "timestamp": lambda v: is_int(v) or isinstance(v, float),
}
FILE_OK: dict[str, Any] = {
    "event_id": is_int,
    "seq": is_int,
    "path": lambda v: isinstance(v, str),
    "checksum": lambda v: isinstance(v, str) and len(v) == 32 and set(v) <= set(
        "0123456789abcdef"),
    "size": lambda v: is_int(v) and v >= 0,
}
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has no NaN or infinity
    st.text(max_size=8),
    st.lists(st.integers(-5, 5), max_size=2),
    st.dictionaries(st.text("abc", min_size=1, max_size=2), st.integers(-5, 5), min_size=1,
                    max_size=2),
)
values = scalars | scalars.map(json.dumps) | st.sampled_from(
    ["[]", "[{}]", '[{"p": "1"}]', '[{"p": 1}]', '[["p", "1"]]', '{"p": "1"}', "{}", "null",
     "A" * 32, "0" * 31, "0" * 33])


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_header_field_of_a_wrong_type_is_refused(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    url = good_dump(tmp_path_factory.mktemp("dump"))
    name = data.draw(st.sampled_from(sorted(HEADER_OK)))
    value = data.draw(values.filter(lambda v: not HEADER_OK[name](v)))
    rewrite_header(url, lambda raw: raw.__setitem__(name, value))
    with pytest.raises(ReplError) as e:
        dumpdir.read(url)
    assert dumpdir.HEADER in e.value.detail and name in e.value.detail, e.value


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_any_event_or_file_field_of_a_wrong_type_is_refused(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    url = good_dump(tmp_path_factory.mktemp("dump"))
    assert dumpdir.read(url).events[0].files  # the dump is good until changed
    file, ok = data.draw(st.sampled_from([("events.parquet", EVENT_OK),
                                          ("files.parquet", FILE_OK)]))
    name = data.draw(st.sampled_from(sorted(ok)))
    value = data.draw(values.filter(lambda v: not ok[name](v)))
    rewrite_parquet(url, file, lambda row: row.__setitem__(name, value))
    with pytest.raises(ReplError) as e:
        dumpdir.read(url)
    assert file in e.value.detail and name in e.value.detail, e.value


@pytest.mark.parametrize(("name", "value"), [
    ("last_event_id", "10"), ("first_event_id", None), ("db", 5), ("source", 5),
    ("format", True), ("kind", "full"), ("kind", None), ("table", ["t"]), ("created", "now"),
])
def test_a_header_field_of_the_wrong_type_is_refused(tmp_path: Path, name: str,
                                                     value: object) -> None:
    url = good_dump(tmp_path)
    rewrite_header(url, lambda raw: raw.__setitem__(name, value))
    with pytest.raises(ReplError, match="damaged dump") as e:
        dumpdir.read(url)
    assert dumpdir.HEADER in e.value.detail and name in e.value.detail, e.value


@pytest.mark.parametrize("name", ["format", "kind", "db", "table", "first_event_id",
                                  "last_event_id", "created", "daemon_url"])
def test_a_header_without_a_required_field_is_refused(tmp_path: Path, name: str) -> None:
    url = good_dump(tmp_path)
    rewrite_header(url, lambda raw: raw.pop(name))
    with pytest.raises(ReplError, match="damaged dump") as e:
        dumpdir.read(url)
    assert dumpdir.HEADER in e.value.detail and name in e.value.detail, e.value


@pytest.mark.parametrize(("file", "name", "value"), [
    ("events.parquet", "id", "10"),
    ("events.parquet", "id", None),
    ("events.parquet", "purge", "no"),
    ("events.parquet", "partitions", '[{"p": 1}]'),
    ("events.parquet", "partitions", '{"p": "1"}'),
    ("events.parquet", "partitions", "p=1"),
    ("events.parquet", "table_obj", "[1]"),
    ("events.parquet", "table_obj", "{"),
    ("events.parquet", "partitionLocations", "[]"),
    ("events.parquet", "partitionLocations", '["/a", "/b"]'),
    ("events.parquet", "partitionLocations", "[1]"),
    ("events.parquet", "partitionLocations", '"/a"'),
    ("files.parquet", "size", "1"),
    ("files.parquet", "size", -1),
    ("files.parquet", "path", None),
    ("files.parquet", "checksum", "not a checksum"),
])
def test_an_event_field_of_the_wrong_type_is_refused(tmp_path: Path, file: str, name: str,
                                                     value: object) -> None:
    url = good_dump(tmp_path)
    rewrite_parquet(url, file, lambda row: row.__setitem__(name, value))
    with pytest.raises(ReplError, match="damaged dump") as e:
        dumpdir.read(url)
    assert file in e.value.detail and name in e.value.detail, e.value


@pytest.mark.parametrize(("file", "name"), [
    ("events.parquet", "id"), ("events.parquet", "eventType"), ("events.parquet", "partitions"),
    ("files.parquet", "checksum"), ("files.parquet", "event_id"),
])
def test_an_event_without_a_column_is_refused(tmp_path: Path, file: str, name: str) -> None:
    url = good_dump(tmp_path)
    rewrite_parquet(url, file, lambda row: row.pop(name))
    with pytest.raises(ReplError, match="damaged dump") as e:
        dumpdir.read(url)
    assert file in e.value.detail and name in e.value.detail, e.value


DAMAGED_FILES: dict[str, tuple[str, bytes | None]] = {
    "header not JSON": (dumpdir.HEADER, b'{"format": 2,'),
    "header not UTF-8": (dumpdir.HEADER, b'{"format": "\xff"}'),
    "header a list": (dumpdir.HEADER, b"[2]"),
    "events not Parquet": ("events.parquet", b"PAR1 but no more"),
    "events missing": ("events.parquet", None),
    "files missing": ("files.parquet", None),
    "table not JSON": ("tables/s.t.json", b'{"tableObj": '),
    "table a list": ("tables/s.t.json", b"[]"),
    "tableObj a list": ("tables/s.t.json", b'{"tableObj": [], "partitions": null}'),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_FILES))
def test_a_damaged_file_of_a_dump_is_refused(tmp_path: Path, case: str) -> None:
    url = good_dump(tmp_path)
    name, content = DAMAGED_FILES[case]
    if content is None:
        (Path(url) / name).unlink()
    else:
        (Path(url) / name).write_bytes(content)
    with pytest.raises(ReplError, match="damaged dump") as e:
        dumpdir.read(url)
    assert name in e.value.detail, e.value

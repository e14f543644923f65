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
events = st.lists(
    st.builds(
        DumpEvent,
        id=st.integers(0, 2**40),
        seq=st.integers(0, 1000),
        type=st.sampled_from(["CREATE_TABLE", "INSERT", "DROP_PARTITION", "INSERT_OVERWRITE"]),
        db=names,
        table=st.none() | names,
        partitions=st.lists(st.dictionaries(names, names, max_size=2), max_size=2),
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

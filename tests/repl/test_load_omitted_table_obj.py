"""A table definition the source's event log cannot serve (a tableObj an older daemon
stored over today's limits, served as `{"_cmroot": "tableObj omitted: ..."}`): an
incremental load fails for the table that needs the definition, naming a bootstrap as
the fix, while the events that do not need it load as before."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from cmroot import checksum as cks
from cmroot.index.events import MAX_TABLE_OBJ
from cmroot.repl import dump
from tests.repl.conftest import Destination
from tests.spark.sparklib import Daemon

pytestmark = pytest.mark.timeout(600)


def _insert_legacy(index: Path, kind: str, table: str, location: str,
                   files: list[tuple[str, str, int]]) -> None:
    """An event as an older daemon stored it, with a tableObj over what the index serves."""
    table_obj = {"db": "s", "table": table, "location": location,
                 "columns": [{"name": "x", "type": "bigint"}],
                 "parameters": {"spark.sql.sources.provider": "parquet",
                                "blob": "x" * MAX_TABLE_OBJ}}
    meta = json.dumps({"location": location, "tableObj": table_obj})
    con = sqlite3.connect(index, timeout=30)
    try:
        with con:
            cur = con.execute(
                "INSERT INTO events (type, db, tbl, partitions, timestamp, server, purge, files,"
                " meta) VALUES (?, 's', ?, '[]', 1700000000.0, 'old', 0, '[]', ?)",
                (kind, table, meta),
            )
            con.executemany(
                "INSERT INTO event_files (event_id, seq, path, checksum, size)"
                " VALUES (?, ?, ?, ?, ?)",
                [(cur.lastrowid, i, *f) for i, f in enumerate(files)],
            )
    finally:
        con.close()


def test_a_load_that_needs_an_omitted_definition_names_a_bootstrap(
    tmp_path: Path, destination: Destination
) -> None:
    pytest.importorskip("pyspark")
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = Daemon(tmp_path / "source").start()
    try:
        loc_t, loc_u = str(d.warehouse / "s.db/t"), str(d.warehouse / "s.db/u")
        good = {"db": "s", "table": "t", "location": loc_t,
                "columns": [{"name": "x", "type": "bigint"}],
                "parameters": {"spark.sql.sources.provider": "parquet"}}
        d.client.add_event("CREATE_DATABASE", db="s")
        d.client.add_event("CREATE_TABLE", db="s", table="t", location=loc_t, tableObj=good)
        data = Path(loc_t) / "part-0.parquet"
        data.parent.mkdir(parents=True)
        pq.write_table(pa.table({"x": [1, 2, 3]}), data)
        d.stop()
        index = d.store / "index.sqlite"
        # t exists at the destination by then: its INSERT needs no definition.
        _insert_legacy(index, "INSERT", "t", loc_t,
                       [(str(data), cks.of_bytes(data.read_bytes()), data.stat().st_size)])
        _insert_legacy(index, "CREATE_TABLE", "u", loc_u, [])
        d.start()
        dumps = str(tmp_path / "dumps")
        first, h1 = dump(d.client, "s", None, dumps, from_id=0, to_id=3)
        second, h2 = dump(d.client, "s", None, dumps, from_id=h1.last_event_id)
        assert (h1.last_event_id, h2.last_event_id) == (3, 4)
    finally:
        d.stop()

    q = {"t": "SELECT x FROM s.t"}
    loaded, refused = destination.run(
        {"load": {"dump": first}, "queries": q, "status": ["s"]},
        {"load": {"dump": second}, "queries": q, "status": ["s"]},
    )
    assert "error" not in loaded["load"], loaded
    assert loaded["rows"]["t"] == [[1], [2], [3]]
    assert refused["load"]["kind"] == "ReplError", refused
    detail = refused["load"]["detail"]
    assert "s.u" in detail and "bootstrap" in detail and "omitted" in detail, detail
    assert refused["rows"]["t"] == [[1], [2], [3]]
    assert refused["status"]["s"] == 3

"""A replica follows a restore: the events `cmroot restore` records (the hook's CREATE_TABLE
and ADD_PARTITION, its INSERT_OVERWRITE and INSERT) replay on a destination into the
rows the source holds after it."""

from __future__ import annotations

import pytest

from cmroot.repl.restore import restore
from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)


def _id(source: Source, since: int, kind: str) -> int:
    [e] = [e for e in source.daemon.events_after(since) if e["eventType"] == kind]
    return int(e["id"])


def test_replica_follows_undrop_and_undone_overwrite(
    source: Source, destination: Destination
) -> None:
    start = source.daemon.current()
    source.sql("CREATE DATABASE rr")
    source.sql("CREATE TABLE rr.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO rr.t VALUES (1, 1), (2, 2)")
    source.sql("CREATE TABLE rr.flat USING parquet AS SELECT id AS a FROM range(4)")
    since = source.daemon.current()
    source.sql("DROP TABLE rr.t")
    restore(source.spark, source.daemon.client, _id(source, since, "DROP_TABLE"))
    since = source.daemon.current()
    source.sql("INSERT OVERWRITE rr.flat SELECT 9")
    restore(source.spark, source.daemon.client, _id(source, since, "INSERT_OVERWRITE"))
    since = source.daemon.current()
    source.sql("ALTER TABLE rr.t DROP PARTITION (p=1)")
    restore(source.spark, source.daemon.client, _id(source, since, "DROP_PARTITION"))
    want = {"t": source.rows("SELECT a, p FROM rr.t"), "flat": source.rows("SELECT a FROM rr.flat")}
    assert want == {"t": [[1, 1], [2, 2]], "flat": [[0], [1], [2], [3]]}
    url, _ = source.dump("rr", from_id=start)
    [step] = destination.run({"load": {"dump": url},
                              "queries": {"t": "SELECT a, p FROM rr.t",
                                          "flat": "SELECT a FROM rr.flat"},
                              "files": ["rr.t", "rr.flat"]})
    assert "error" not in step["load"], step["load"]
    assert step["rows"] == want
    assert step["files"]["rr.t"] == source.data_files("rr", "t")
    assert step["files"]["rr.flat"] == source.data_files("rr", "flat")

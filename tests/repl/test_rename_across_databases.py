"""A table renamed into another database (issue 12: cross-database renames): the replica
of the database it left drops it, the replica of the database it entered takes it with
its rows and partitions, and later statements on it replicate there.

Spark refuses a rename across databases, but the metastore does it for any other engine
(Hive, Trino, Impala): the test renames through the metastore client of the source's own
session, so the source's hook records it as it would any engine's."""

from __future__ import annotations

import pytest

from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)


def test_a_rename_across_databases_replicates(source: Source, destination: Destination) -> None:
    start = source.daemon.current()
    for db in ("xa", "xb"):
        source.sql(f"CREATE DATABASE {db}")
    source.sql("CREATE TABLE xa.t (x INT) STORED AS PARQUET")
    source.sql("INSERT INTO xa.t VALUES (1), (2)")
    source.sql("CREATE TABLE xa.p (x INT) PARTITIONED BY (k INT) STORED AS PARQUET")
    source.sql("INSERT INTO xa.p PARTITION (k=1) VALUES (1)")
    source.sql("INSERT INTO xa.p PARTITION (k=2) VALUES (2)")
    source.sql("CREATE TABLE xb.u (x INT) STORED AS PARQUET")
    source.sql("INSERT INTO xb.u VALUES (9)")
    url_a, ha = source.dump("xa", from_id=start)
    url_b, hb = source.dump("xb", from_id=start)

    source.rename_across("xa", "t", "xb")
    source.rename_across("xa", "p", "xb")
    source.sql("INSERT INTO xb.t VALUES (3)")
    assert source.rows("SHOW TABLES IN xa") == []
    url_a2, ha2 = source.dump("xa", from_id=ha.last_event_id)
    url_b2, hb2 = source.dump("xb", from_id=hb.last_event_id)

    q = {"a.t": "SELECT * FROM xa.t", "b.t": "SELECT * FROM xb.t", "b.p": "SELECT * FROM xb.p",
         "b.u": "SELECT * FROM xb.u"}
    tables = {"a": "SHOW TABLES IN xa", "b": "SHOW TABLES IN xb"}
    before, after = destination.run(
        {"load": {"dump": url_a}},
        {"load": {"dump": url_b}, "queries": {**q, **tables}},
        {"load": {"dump": url_a2}},
        {"load": {"dump": url_b2}, "queries": {**q, **tables}, "status": ["xa", "xb"],
         "partitions": ["xb.p"]},
    )[1::2]
    assert before["rows"]["a.t"] == [[1], [2]] and before["rows"]["b.u"] == [[9]]
    assert "error" not in after["load"], after["load"]
    assert [r[1] for r in after["rows"]["a"]] == []
    assert sorted(r[1] for r in after["rows"]["b"]) == ["p", "t", "u"]
    assert after["rows"]["b.t"] == source.rows(q["b.t"]) == [[1], [2], [3]]
    assert after["rows"]["b.p"] == source.rows(q["b.p"]) == [[1, 1], [2, 2]]
    assert after["partitions"]["xb.p"] == ["k=1", "k=2"]
    assert after["status"] == {"xa": ha2.last_event_id, "xb": hb2.last_event_id}

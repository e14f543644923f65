"""The event log replication replays, over HTTP against the real daemon: `location` and
`tableObj` on events written by POST /v1/events and POST /v1/recycle, files sent as paths
only and hashed by the daemon, metadata-only drops. Every refusal is a 4xx naming the
problem and records no event."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, assert_error, write_files

pytestmark = pytest.mark.timeout(120)

TABLE_OBJ = {
    "db": "sales",
    "table": "orders",
    "tableType": "MANAGED_TABLE",
    "location": "/somewhere",
    "columns": [{"name": "a", "type": "int", "comment": None}],
    "partitionKeys": [{"name": "p", "type": "int", "comment": None}],
    "parameters": {"spark.sql.sources.provider": "parquet"},
    "inputFormat": None,
    "outputFormat": None,
    "serde": None,
    "serdeParameters": {},
}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("events"))
    write_files(
        d.warehouse,
        {
            "sales.db/orders/p=1/part-00000-x.parquet": b"one" * 100,
            "sales.db/orders/p=2/part-00000-x.parquet": b"two" * 70,
            "sales.db/old/part-00000.parquet": b"old bytes",
        },
    )
    write_files(d.outside, {"secret": b"outside"})
    with d.serving():
        yield d


def _event(d: Daemon, event_id: int) -> dict[str, Any]:
    [e] = d.client().events(event_id, 1)
    assert e["id"] == event_id
    return e


def _refused(d: Daemon, path: str, body: dict[str, Any], status: int, *words: str) -> None:
    before = d.snapshot()
    assert_error(d.request("POST", path, body, scope="write"), status, *words)
    assert d.snapshot() == before, body


def test_new_fields_round_trip_and_files_are_hashed_by_the_daemon(lake: Daemon) -> None:
    d = lake
    c = d.client("write")
    tdir = d.warehouse / "sales.db" / "orders"
    files = sorted(str(p) for p in tdir.rglob("*.parquet"))
    eid = c.add_event(
        "INSERT",
        db="sales",
        table="orders",
        partitions=[{"p": "1"}, {"p": "2"}],
        files=[{"path": f"file://{p}"} for p in files],
        location=f"{tdir}/",
        tableObj=TABLE_OBJ,
    )
    e = _event(d, eid)
    assert (e["eventType"], e["db"], e["table"], e["partitions"]) == (
        "INSERT", "sales", "orders", [{"p": "1"}, {"p": "2"}])
    assert e["location"] == str(tdir)
    assert e["tableObj"] == TABLE_OBJ
    assert e["files"] == [
        {"path": p, "checksum": cks.of_local_file(p), "size": os.path.getsize(p)}
        for p in files
    ]
    # An event without the new fields shows them as null.
    plain = _event(d, c.add_event("CREATE_DATABASE", db="plain"))
    assert (plain["location"], plain["tableObj"], plain["files"]) == (None, None, [])


def test_partition_locations_round_trip(lake: Daemon) -> None:
    """`partitionLocations`: one place per partition, canonical, null for one outside the
    roots; an event without them shows none (its partitions are at their default places)."""
    d = lake
    c = d.client("write")
    tdir = d.warehouse / "sales.db" / "orders"
    elsewhere = d.warehouse / "landing" / "p2"
    eid = c.add_event("ADD_PARTITION", db="sales", table="orders",
                      partitions=[{"p": "1"}, {"p": "2"}, {"p": "3"}], location=str(tdir),
                      partitionLocations=[f"file://{tdir}/p=1/", str(elsewhere), None])
    e = _event(d, eid)
    assert e["partitionLocations"] == [f"{tdir}/p=1", str(elsewhere), None]
    plain = _event(d, c.add_event("ADD_PARTITION", db="sales", table="orders",
                                  partitions=[{"p": "1"}]))
    assert "partitionLocations" not in plain


def test_recycle_records_the_location(lake: Daemon) -> None:
    d = lake
    tdir = d.warehouse / "sales.db" / "old"
    res = d.client("write").recycle(
        [str(tdir / "part-00000.parquet")], op="DROP_TABLE", db="sales", table="old",
        location=f"file://{tdir}",
    )
    e = _event(d, res["event_id"])
    assert (e["eventType"], e["location"], e["tableObj"]) == ("DROP_TABLE", str(tdir), None)
    assert [f["checksum"] for f in e["files"]] == [cks.of_bytes(b"old bytes")]


def test_metadata_only_drop(lake: Daemon) -> None:
    d = lake
    eid = d.client("write").add_event(
        "DROP_TABLE", db="sales", table="empty", location=str(d.warehouse / "sales.db" / "empty")
    )
    e = _event(d, eid)
    assert (e["eventType"], e["table"], e["files"], e["purge"]) == (
        "DROP_TABLE", "empty", [], False)


def test_refusals_record_nothing(lake: Daemon) -> None:
    d = lake
    tdir = d.warehouse / "sales.db" / "orders"
    here = str(tdir / "p=1" / "part-00000-x.parquet")
    missing = str(tdir / "p=3" / "part-00000-x.parquet")
    base = {"eventType": "INSERT", "db": "sales", "table": "orders"}
    for body, status, words in [
        ({**base, "files": [{"path": here}, {"path": missing}]}, 404, [missing]),
        ({**base, "files": [{"path": str(d.outside / "secret")}]}, 403, ["outside"]),
        ({**base, "location": str(d.outside)}, 403, ["outside"]),
        ({**base, "location": "sales.db/orders"}, 400, ["relative"]),
        ({**base, "location": ["x"]}, 400, ["path"]),
        ({**base, "tableObj": "{}"}, 400, ["tableObj"]),
        ({**base, "tableObj": [TABLE_OBJ]}, 400, ["tableObj"]),
        ({**base, "files": [{"path": here, "size": 3}]}, 400, ["checksum"]),
        ({**base, "eventType": "DROP_TABLE", "files": [{"path": here}]}, 400, ["/v1/recycle"]),
        ({**base, "partitions": [{"p": "1"}], "partitionLocations": []}, 400,
         ["partitionLocations", "1 partitions"]),
        ({**base, "partitionLocations": [str(tdir)]}, 400, ["partitionLocations"]),
        ({**base, "partitions": [{"p": "1"}], "partitionLocations": [str(d.outside)]}, 403,
         ["outside"]),
        ({**base, "partitions": [{"p": "1"}], "partitionLocations": ["p=1"]}, 400,
         ["relative"]),
        ({**base, "partitions": [{"p": "1"}], "partitionLocations": [1]}, 400,
         ["partitionLocations"]),
        ({**base, "partitions": [{"p": "1"}], "partitionLocations": str(tdir)}, 400,
         ["partitionLocations"]),
        ({**base, "eventType": "DROP_PARTITION", "partitions": [{"p": "1"}],
          "files": [{"path": here}]}, 400, ["/v1/recycle"]),
    ]:
        _refused(d, "/v1/events", body, status, *words)
    _refused(
        d,
        "/v1/recycle",
        {"paths": [here], "op": "DROP_PARTITION", "location": str(d.outside)},
        403,
        "outside",
    )
    bad = {"paths": [here], "op": "DROP_PARTITION", "location": 1}
    _refused(d, "/v1/recycle", bad, 400, "path")

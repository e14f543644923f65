"""External tables stay external on the replica (issue 12, locations): at the source's
location under `<destination warehouse>/_external/<database>/`, with the source's rows; dropping the
replica's table goes as the source's drop (its copy removed by the load)."""

from __future__ import annotations

import pytest

from tests.repl.conftest import Destination, Source

pytestmark = pytest.mark.timeout(900)


def test_an_external_table_replicates_as_an_external_table(
    source: Source, destination: Destination
) -> None:
    start = source.daemon.current()
    landing = source.warehouse / "landing" / "ext_t"
    source.sql("CREATE DATABASE ex")
    source.sql(f"CREATE TABLE ex.t (a INT) USING parquet LOCATION '{landing}'")
    source.sql("INSERT INTO ex.t VALUES (1), (2)")
    source.sql(f"CREATE TABLE ex.h (a INT) STORED AS PARQUET LOCATION '{landing}_h'")
    source.sql("INSERT INTO ex.h VALUES (3)")
    inc, hi = source.dump("ex", from_id=start)
    boot, _ = source.dump("ex")
    source.sql("INSERT INTO ex.t VALUES (4)")
    inc2, _ = source.dump("ex", from_id=hi.last_event_id)
    q = {"t": "SELECT * FROM ex.t", "h": "SELECT * FROM ex.h",
         "t type": "DESCRIBE TABLE EXTENDED ex.t", "h type": "DESCRIBE TABLE EXTENDED ex.h",
         "b": "SELECT * FROM exb.t", "b type": "DESCRIBE TABLE EXTENDED exb.t"}
    first, booted, second = destination.run(
        {"load": {"dump": inc}, "queries": q},
        {"load": {"dump": boot, "target": "exb"}, "queries": q},
        {"load": {"dump": inc2}, "queries": q},
    )
    for step in (first, booted, second):
        assert "error" not in step["load"], step["load"]
    assert first["rows"]["t"] == [[1], [2]] and first["rows"]["h"] == [[3]]
    assert booted["rows"]["b"] == [[1], [2]] and second["rows"]["t"] == [[1], [2], [4]]
    for key, step, db in (("t type", first, "ex"), ("h type", first, "ex"),
                          ("b type", booted, "exb")):
        info = {r[0]: r[1] for r in step["rows"][key]}
        assert info["Type"] == "EXTERNAL", (key, info)
        place = f"/_external/{db}{landing}" + ("_h" if key[0] == "h" else "")
        assert info["Location"].endswith(place), (key, info)

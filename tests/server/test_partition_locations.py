"""A table's partitions at their own locations (`ALTER TABLE t ADD PARTITION ... LOCATION`)
are the table's: a recycle labelled with the table may name files there when it declares
those directories in `partitionLocations`, so a statement that empties the table (TRUNCATE,
DROP TABLE, an overwrite) is one event of that table. Undeclared, such a path is another
table's by the warehouse layout and the recycle is refused whole; a declared location is
confined like any path and can never be a root or contain one."""

from __future__ import annotations

from pathlib import Path

from tests.server.cmroot_daemon import Daemon


def _layout(d: Daemon) -> tuple[Path, Path]:
    table = d.warehouse / "db.db" / "t"
    custom = d.warehouse / "custom_parts" / "t9"
    for path in (table / "p=1" / "a", table / "p=2" / "b", custom / "c"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(path.name.encode() * 100)
    return table, custom


def _body(table: Path, custom: Path, **extra: object) -> dict[str, object]:
    return {"paths": [str(table / "p=1"), str(table / "p=2"), str(custom)], "op": "TRUNCATE",
            "db": "db", "table": "t", "location": str(table),
            "partitions": [{"p": "1"}, {"p": "2"}, {"p": "9"}], **extra}


def _snapshot(*dirs: Path) -> list[str]:
    return sorted(str(p) for d in dirs for p in d.rglob("*") if p.is_file())


def test_declared_partition_locations_make_one_event(daemon: Daemon) -> None:
    d = daemon
    table, custom = _layout(d)
    r = d.request("POST", "/v1/recycle",
                  _body(table, custom, partitionLocations=[str(custom)]), scope="write")
    assert r.status == 200, r
    assert sorted(f["path"] for f in r.json()["files"]) == sorted(
        [str(table / "p=1" / "a"), str(table / "p=2" / "b"), str(custom / "c")])
    [e] = d.request("GET", "/v1/events?from=0&limit=10").json()["events"]
    assert (e["eventType"], e["table"], len(e["files"])) == ("TRUNCATE", "t", 3)


def test_a_joined_part_may_declare_its_own(daemon: Daemon) -> None:
    d = daemon
    table, custom = _layout(d)
    first = {"paths": [str(table / "p=1")], "op": "TRUNCATE", "db": "db", "table": "t",
             "prepare": True}
    r = d.request("POST", "/v1/recycle", first, scope="write")
    assert r.status == 200, r
    txid = r.json()["txid"]
    more = {**first, "paths": [str(custom)], "txid": txid, "partitionLocations": [str(custom)]}
    r = d.request("POST", "/v1/recycle", more, scope="write")
    assert r.status == 200, r
    r = d.request("POST", f"/v1/transactions/{txid}/commit", {}, scope="write")
    assert r.status == 200, r
    assert len(r.json()["files"]) == 2


def test_undeclared_is_refused_whole(daemon: Daemon) -> None:
    d = daemon
    table, custom = _layout(d)
    before = _snapshot(table, custom)
    r = d.request("POST", "/v1/recycle", _body(table, custom), scope="write")
    assert r.status == 400 and r.json()["error"] == "one table per recycle", r
    assert _snapshot(table, custom) == before


def test_bad_declarations_change_nothing(daemon: Daemon, tmp_path: Path) -> None:
    d = daemon
    table, custom = _layout(d)
    before = _snapshot(table, custom)
    cases: list[tuple[object, int, str]] = [
        ([str(d.warehouse)], 403, "a warehouse root is not a partition"),
        ([str(d.warehouse.parent)], 403, ""),
        ([str(tmp_path)], 403, ""),
        ("not-a-list", 400, ""),
        ([7], 400, ""),
        (["relative/dir"], 400, ""),
    ]
    for dirs, status, error in cases:
        r = d.request("POST", "/v1/recycle", _body(table, custom, partitionLocations=dirs),
                      scope="write")
        assert r.status == status, (dirs, r)
        assert not error or r.json()["error"] == error, (dirs, r.json())
    no_table = {**_body(table, custom, partitionLocations=[str(custom)]), "table": None}
    r = d.request("POST", "/v1/recycle", no_table, scope="write")
    assert r.status == 400 and "without a table" in r.json()["error"], r
    assert _snapshot(table, custom) == before
    assert d.request("GET", "/v1/events?from=0&limit=10").json()["events"] == []

"""Non-destructive events and the fields replication replays: the table location and
definition on an event, files hashed by the store when the hook sends paths only, and
metadata-only drops. A refused event records nothing."""

from __future__ import annotations

import pytest
from cmroot_testlib import Env, make_table, snapshot, table_dir, write_file

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, CmrootError, NotFound, OutsideRoots
from cmroot.store import RecycleRequest, Store

TABLE_OBJ = {"db": "db", "table": "t", "tableType": "MANAGED_TABLE", "parameters": {}}


def refused(env: Env, call, error: type[CmrootError], *words: str) -> None:
    before = snapshot(env)
    with pytest.raises(error) as ei:
        call()
    for w in words:
        assert w.lower() in str(ei.value).lower(), f"{w!r} not in {ei.value}"
    assert snapshot(env) == before, "a refused event changed something"


def test_files_without_checksums_are_hashed_from_disk(env: Env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=2)
    loc = table_dir(env.warehouse, "db", "t")
    eid = store.add_event(
        "INSERT",
        "db",
        "t",
        [{"p": "1"}, {"p": "2"}],
        [{"path": p} for p in files],
        location=f"file://{loc}/",
        table_obj=TABLE_OBJ,
    )
    [e] = [e for e in store.events() if e.id == eid]
    assert e.files == [
        {"path": p, "checksum": cks.of_local_file(p), "size": len(b)} for p, b in files.items()
    ]
    assert (e.location, e.table_obj) == (str(loc), TABLE_OBJ)
    # The same files again give the same checksums (from the identity-keyed cache once
    # their ctime has settled; hashed again before that).
    again = store.add_event("INSERT", "db", "t", files=[{"path": p} for p in files])
    [e2] = [e for e in store.events() if e.id == again]
    assert e2.files == e.files


def test_given_and_computed_checksums_mix(env: Env, store: Store) -> None:
    a = write_file(env.warehouse / "t" / "a", b"a bytes")
    b = write_file(env.warehouse / "t" / "b", b"b bytes!")
    given = {"path": str(a), "checksum": cks.of_bytes(b"declared"), "size": 8}
    eid = store.add_event("INSERT", files=[given, {"path": str(b)}])
    [e] = [e for e in store.events() if e.id == eid]
    assert e.files == [given, {"path": str(b), "checksum": cks.of_bytes(b"b bytes!"), "size": 8}]


def test_a_missing_file_refuses_the_event_naming_it(env: Env, store: Store) -> None:
    present = write_file(env.warehouse / "t" / "here", b"x")
    missing = env.warehouse / "t" / "gone"
    refused(
        env,
        lambda: store.add_event("INSERT", files=[{"path": str(present)}, {"path": str(missing)}]),
        NotFound,
        str(missing),
    )
    (env.warehouse / "t" / "dir").mkdir()
    a_dir = str(env.warehouse / "t" / "dir")
    refused(env, lambda: store.add_event("INSERT", files=[{"path": a_dir}]), NotFound, a_dir)


def test_location_is_confined(env: Env, store: Store) -> None:
    refused(env, lambda: store.add_event("CREATE_TABLE", location=str(env.outside)), OutsideRoots)
    refused(
        env, lambda: store.add_event("CREATE_TABLE", location="rel/path"), BadRequest, "relative"
    )
    refused(env, lambda: store.add_event("CREATE_TABLE", location=7), BadRequest, "path")
    f = str(write_file(env.warehouse / "x", b"x"))
    refused(
        env,
        lambda: store.recycle(
            RecycleRequest(paths=[f], op="DROP_TABLE", location=str(env.outside))
        ),
        OutsideRoots,
    )


def test_table_obj_must_be_an_object(env: Env, store: Store) -> None:
    for bad in ("{}", ["db"], 3):
        refused(env, lambda bad=bad: store.add_event("CREATE_TABLE", table_obj=bad), BadRequest,
                "tableObj")


def test_metadata_only_drops(env: Env, store: Store) -> None:
    f = write_file(env.warehouse / "t" / "f", b"x")
    for kind in ("DROP_TABLE", "DROP_PARTITION"):
        refused(env, lambda kind=kind: store.add_event(kind, "db", "t", files=[{"path": str(f)}]),
                BadRequest, "POST /v1/recycle")
    loc = str(env.warehouse / "t")
    eid = store.add_event("DROP_PARTITION", "db", "t", [{"p": "1"}], location=loc)
    [e] = [e for e in store.events() if e.id == eid]
    assert (e.type, e.partitions, e.files, e.purge) == ("DROP_PARTITION", [{"p": "1"}], [], False)


def test_recycle_records_the_location_as_a_path_key(env: Env, store: Store) -> None:
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=2)
    loc = table_dir(env.warehouse, "db", "t")
    res = store.recycle(
        RecycleRequest(paths=list(files), op="TRUNCATE", db="db", table="t", location=f"file://{loc}")
    )
    [e] = [e for e in store.events() if e.id == res.event_id]
    assert (e.type, e.location, e.table_obj) == ("TRUNCATE", str(loc), None)

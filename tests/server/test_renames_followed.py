"""A renamed table's files are found at their new place: the table swap every ETL framework
does (CTAS t_new, DROP t, RENAME t_new TO t) moves the files an earlier INSERT named, and a
replica loading that INSERT asks for them by their old path. The rename's ALTER_TABLE event
says where the table was (`location`) and where it is (tableObj.location); `POST
/v1/resolve` follows the log's renames, in order, to the path that now holds those bytes
(or to their cmroot copy there) and says where; the bytes are read like any pair. Only the
daemon's own log decides where to look, always confined and verified by checksum."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon


def _rename(d: Daemon, db: str, old: Path, new: Path, name: str, new_db: str | None = None
            ) -> None:
    """What the hook records for ALTER TABLE old RENAME TO new, after moving the directory."""
    new.parent.mkdir(parents=True, exist_ok=True)
    os.rename(old, new)
    r = d.request("POST", "/v1/events", {
        "eventType": "ALTER_TABLE", "db": db, "table": old.name, "location": str(old),
        "tableObj": {"db": new_db or db, "table": name, "location": str(new)},
    }, scope="write")
    assert r.status == 200, r


def _resolve(d: Daemon, path: Path, data: bytes) -> dict[str, Any]:
    r = d.request("POST", "/v1/resolve",
                  {"files": [{"path": str(path), "checksum": cks.of_bytes(data)}]}, scope="read")
    assert r.status == 200, r
    [answer] = r.json()["files"]
    return dict(answer)


def _fetch(d: Daemon, path: str, data: bytes) -> bytes:
    r = d.request("GET", d.files_url(path, cks.of_bytes(data)), scope="read")
    assert r.status == 200, r
    return bytes(r.body)


def test_a_table_swap_is_followed_to_the_new_place_and_its_cmroot_copy(daemon: Daemon) -> None:
    d = daemon
    wdb = d.warehouse / "db.db"
    old_t, new_t = wdb / "t", wdb / "t_new"
    (old_t).mkdir(parents=True)
    (old_t / "a").write_bytes(b"old t" * 100)
    new_t.mkdir()
    data = b"swapped in" * 100
    (new_t / "part-0").write_bytes(data)
    # DROP TABLE t, then ALTER TABLE t_new RENAME TO t.
    r = d.request("POST", "/v1/recycle", {"paths": [str(old_t)], "op": "DROP_TABLE",
                                          "db": "db", "table": "t"}, scope="write")
    assert r.status == 200, r
    _rename(d, "db", new_t, old_t, "t")
    answer = _resolve(d, new_t / "part-0", data)
    assert (answer["status"], answer["location"]) == ("original", str(old_t / "part-0"))
    assert answer["path"] == str(new_t / "part-0")
    assert _fetch(d, answer["location"], data) == data

    # Renamed again (t -> t_old, across databases) and then dropped: its cmroot copy.
    other = d.warehouse / "arch.db" / "t_old"
    _rename(d, "db", old_t, other, "t_old", "arch")
    r = d.request("POST", "/v1/recycle", {"paths": [str(other)], "op": "DROP_TABLE",
                                          "db": "arch", "table": "t_old"}, scope="write")
    assert r.status == 200, r
    answer = _resolve(d, new_t / "part-0", data)
    assert answer["status"] == "cmroot", answer
    # Other bytes at the old or new path are never taken for the asked ones.
    assert _resolve(d, new_t / "part-0", b"something else")["status"] == "missing"


def test_a_rename_out_of_the_roots_is_not_followed(daemon: Daemon, tmp_path: Path) -> None:
    d = daemon
    t = d.warehouse / "db.db" / "x"
    t.mkdir(parents=True)
    data = b"x" * 100
    (t / "f").write_bytes(data)
    outside = tmp_path / "elsewhere" / "x"
    _rename(d, "db", t, outside, "x")
    assert (outside / "f").read_bytes() == data
    assert _resolve(d, t / "f", data)["status"] == "missing"


def test_unrelated_alters_move_nothing(daemon: Daemon) -> None:
    """An ALTER_TABLE that is not a rename (its location is where it stays) is no move."""
    d = daemon
    t = d.warehouse / "db.db" / "y"
    t.mkdir(parents=True)
    r = d.request("POST", "/v1/events", {
        "eventType": "ALTER_TABLE", "db": "db", "table": "y", "location": str(t),
        "tableObj": {"db": "db", "table": "y", "location": str(t)},
    }, scope="write")
    assert r.status == 200, r
    assert _resolve(d, t / "gone", b"z")["status"] == "missing"

"""Adversarial reproducers against the daemon's HTTP API: a 5xx from client input."""

from __future__ import annotations

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon


def test_deeply_nested_json_body_is_a_400_not_a_500(daemon: Daemon) -> None:
    """Sequence: POST /v1/resolve (read scope) with a 200 KB body `[[[[...]]]]`, 100,000
    levels deep (well under server.max_body, 64 MiB). json.loads raises RecursionError,
    which `_body` does not catch (only UnicodeDecodeError/JSONDecodeError): the
    middleware answers 500 "internal error" and logs a traceback.
    Breaks "never a 5xx for bad input". Expected: 400 malformed JSON. Every POST route
    (recycle, events, resolve) shares `_body`."""
    raw = b"[" * 100_000 + b"]" * 100_000
    r = daemon.request("POST", "/v1/resolve", raw=raw, scope="read",
                       headers={"Content-Type": "application/json"})
    assert r.status == 400, r


def test_event_file_size_beyond_sqlite_integer_is_a_400(daemon: Daemon) -> None:
    """Sequence: POST /v1/events {"eventType": "INSERT", "files": [{"path": "<wh>/t/f",
    "checksum": <valid>, "size": 10**30}]}. `_event_files` only checks
    isinstance(size, int); SQLite cannot bind it (OverflowError) -> 500.
    Breaks "never a 5xx for bad input". Expected: 400."""
    body = {
        "eventType": "INSERT",
        "db": "d",
        "table": "t",
        "files": [{"path": str(daemon.warehouse / "t" / "f"),
                   "checksum": cks.of_bytes(b"x"), "size": 10**30}],
    }
    r = daemon.request("POST", "/v1/events", body=body, scope="write")
    assert r.status == 400, r


def test_two_phase_recycle_exists(daemon: Daemon) -> None:
    """DESIGN's API table: POST /v1/recycle with "prepare": true stages without
    publishing and returns a txid; POST /v1/transactions/{txid}/commit|abort|renew. It is
    what makes "a statement is one unit" (invariant 2) possible for a statement that
    issues several recycles (INSERT OVERWRITE of several partitions, a multi-table
    DROP CASCADE). Observed: 400 "unknown fields: prepare" and no /v1/transactions route,
    so every recycle of a statement commits on its own and a statement that fails
    after its first recycle is left half applied, with events a replica replays."""
    f = daemon.warehouse / "t" / "f"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"x")
    r = daemon.request("POST", "/v1/recycle", scope="write",
                       body={"paths": [str(f)], "op": "DELETE", "prepare": True})
    assert r.status == 200, r
    assert "txid" in r.json()

"""Who and what asked for each recycle and event (`audit`): recorded on the event, shown
with its entries by GET /v1/entries and `cmroot ls`; long values cut, bad ones refused
before anything moves."""

from __future__ import annotations

import getpass
import socket
import subprocess
import sys
from pathlib import Path

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, assert_error, write_files

WHO = {"user": "etl", "host": "worker-7", "app": "nightly app-1", "statement": "DROP TABLE t"}


def one_file(d: Daemon, name: str) -> str:
    return next(iter(write_files(d.warehouse / name, {"f": name.encode() * 20})))


def test_a_recycle_and_an_event_keep_their_audit(daemon: Daemon) -> None:
    path = one_file(daemon, "a")
    r = daemon.request("POST", "/v1/recycle", {"paths": [path], "op": "DROP_TABLE",
                                               "db": "db", "table": "t", "audit": WHO})
    assert r.status == 200, r
    [entry] = daemon.request("GET", "/v1/entries", scope="read").json()["entries"]
    assert entry["audit"] == WHO
    ev = daemon.request("POST", "/v1/events", {"eventType": "CREATE_TABLE", "db": "db",
                                               "table": "u", "audit": {"user": "etl"}})
    assert ev.status == 200, ev
    events = daemon.client().events(0, 10)
    assert [e.get("audit") for e in events] == [WHO, {"user": "etl"}]


def test_two_phase_keeps_the_first_parts_audit(daemon: Daemon) -> None:
    a, b = one_file(daemon, "p1"), one_file(daemon, "p2")
    r = daemon.request("POST", "/v1/recycle", {"paths": [a], "op": "DELETE", "prepare": True,
                                               "audit": WHO})
    txid = r.json()["txid"]
    r = daemon.request("POST", "/v1/recycle", {"paths": [b], "op": "DELETE", "prepare": True,
                                               "txid": txid, "audit": {"user": "other"}})
    assert r.status == 200, r
    assert daemon.request("POST", f"/v1/transactions/{txid}/commit").status == 200
    [event] = daemon.client().events(0, 10)
    assert event["audit"] == WHO


def test_long_values_are_cut_and_bad_audits_refused(daemon: Daemon) -> None:
    path = one_file(daemon, "long")
    long = {"user": "u\0x", "statement": "SELECT " + "x" * 5000, "host": ""}
    r = daemon.request("POST", "/v1/recycle", {"paths": [path], "op": "DELETE", "audit": long})
    assert r.status == 200, r
    [entry] = daemon.request("GET", "/v1/entries", scope="read").json()["entries"]
    assert entry["audit"]["user"] == "ux"  # a NUL is dropped
    assert len(entry["audit"]["statement"]) == 1000
    assert entry["audit"]["statement"].endswith("\u2026") and "host" not in entry["audit"]
    kept = one_file(daemon, "kept")
    for audit, word in [("me", "audit"), ({"who": "x"}, "who"), ({"user": 5}, "user"),
                        ({"statement": "x" * 70_000}, "statement"), ([], "audit")]:
        bad = daemon.request("POST", "/v1/recycle",
                             {"paths": [kept], "op": "DELETE", "audit": audit})
        assert_error(bad, 400, word)
        bad = daemon.request("POST", "/v1/events", {"eventType": "INSERT", "audit": audit})
        assert_error(bad, 400, word)
    assert Path(kept).read_bytes() == b"kept" * 20  # nothing moved
    assert len(daemon.request("GET", "/v1/entries", scope="read").json()["entries"]) == 1
    assert daemon.errors() == []


def test_the_cli_says_who_it_is_and_ls_shows_it(daemon: Daemon) -> None:
    path = one_file(daemon, "cli")
    token = daemon.base / "token"
    token.write_text(daemon.tokens["admin"])
    token.chmod(0o600)
    common = ["--url", daemon.url, "--token-file", str(token)]
    run = [sys.executable, "-m", "cmroot.cli"]
    done = subprocess.run([*run, "recycle", path, "--op", "DELETE", *common],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    [entry] = daemon.request("GET", "/v1/entries", scope="read").json()["entries"]
    assert entry["audit"] == {"user": getpass.getuser(), "host": socket.gethostname(),
                              "app": "cmroot"}
    assert entry["checksum"] == cks.of_bytes(b"cli" * 20)
    ls = subprocess.run([*run, "ls", *common], capture_output=True, text=True, timeout=60)
    header, row = ls.stdout.splitlines()
    assert "BY" in header.split() and f"{getpass.getuser()}@{socket.gethostname()}" in row

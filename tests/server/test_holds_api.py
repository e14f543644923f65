"""Holds and the byte budget through the real daemon: `cmroot hold add|ls|rm` and
`cmroot ls`/`gc` over HTTP, /v1/holds, metrics, and bad input (a clear 4xx or one-line CLI
error, nothing changed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, MakeDaemon, assert_error, write_files

RETAIN = 1.0  # seconds: the daemon's real clock decides expiry here


def cli(d: Daemon, *args: str, scope: str = "admin") -> subprocess.CompletedProcess[str]:
    token = d.base / f"token-{scope}"
    token.write_text(d.tokens[scope])
    token.chmod(0o600)
    return subprocess.run(
        [sys.executable, "-m", "cmroot.cli", *args, "--url", d.url, "--token-file", str(token)],
        capture_output=True, text=True, timeout=120,
    )


def drop(d: Daemon, db: str, table: str, extra: dict[str, bytes] | None = None
         ) -> dict[str, bytes]:
    """Recycle table db.table: one data file of 600 bytes (and `extra` files)."""
    tdir = d.warehouse / f"{db}.db" / table
    files = write_files(tdir, {"part-0.parquet": f"{db}.{table} rows".encode().ljust(600),
                               **(extra or {})})
    r = d.request("POST", "/v1/recycle", {"paths": [str(tdir)], "op": "DROP_TABLE",
                                           "db": db, "table": table})
    assert r.status == 200, r
    return files


def served(d: Daemon, files: dict[str, bytes]) -> bool:
    for path, data in files.items():
        r = d.request("GET", d.files_url(path, cks.of_bytes(data)), scope="read")
        if r.status != 200 or r.body != data:
            return False
    return True


def metric(d: Daemon, name: str) -> float:
    for line in d.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def wait_expired() -> None:
    time.sleep(RETAIN + 0.2)


def test_hold_keeps_a_table_through_a_sweep_until_released(make_daemon: MakeDaemon) -> None:
    d = make_daemon(env={"CMROOT_STORE_RETAIN": f"{RETAIN:g}s"})
    held = drop(d, "sales", "orders")
    loose = drop(d, "sales", "items")
    whole_db = drop(d, "hr", "staff")
    r = cli(d, "hold", "add", "Sales.Orders", "--until", "7d", "--reason", "incident 42")
    assert r.returncode == 0, r.stderr
    assert "sales.orders" in r.stdout
    api = d.request("POST", "/v1/holds", {"db": "hr", "until": time.time() + 3600,
                                          "reason": "audit"})
    assert api.status == 200, api
    listed = json.loads(cli(d, "hold", "ls", "--json").stdout)["holds"]
    assert [(h["db"], h["table"], h["reason"]) for h in listed] == [
        ("sales", "orders", "incident 42"), ("hr", None, "audit")]
    wait_expired()
    report = d.request("POST", "/v1/gc").json()
    assert (report["removed_objects"], report["held_objects"]) == (1, 2)
    assert served(d, held) and served(d, whole_db) and not served(d, loose)
    assert metric(d, "cmroot_holds") == 2 and metric(d, "cmroot_held_objects") == 2
    text = cli(d, "ls").stdout
    assert text.splitlines()[0].split()[:3] == ["RECYCLED", "(UTC)", "OP"]
    assert "held to" in text and "sales.orders" in text
    human = cli(d, "gc", "--dry-run").stdout
    assert "for holds" in human
    hold_id = listed[0]["id"]
    r = cli(d, "hold", "rm", str(hold_id))
    assert r.returncode == 0 and f"hold {hold_id} released" in r.stdout, r.stderr
    assert d.request("POST", "/v1/gc").json()["removed_objects"] == 1
    assert not served(d, held) and served(d, whole_db)
    assert d.errors() == []


def test_ls_hides_housekeeping_files_unless_all(daemon: Daemon) -> None:
    drop(daemon, "db", "t", {"_SUCCESS": b"", ".part-0.parquet.crc": b"crc"})
    short = cli(daemon, "ls", "--json")
    paths = [e["path"] for e in json.loads(short.stdout)["entries"]]
    assert [Path(p).name for p in paths] == ["part-0.parquet"]
    every = json.loads(cli(daemon, "ls", "--json", "--all").stdout)["entries"]
    assert {Path(e["path"]).name for e in every} == {
        "part-0.parquet", "_SUCCESS", ".part-0.parquet.crc"}
    api = daemon.request("GET", "/v1/entries", scope="read").json()["entries"]
    assert len(api) == 3  # the API lists everything unless asked (all=false)


def test_bad_hold_requests_are_clear_and_change_nothing(daemon: Daemon) -> None:
    future = time.time() + 3600
    bad: list[tuple[Any, str]] = [
        ({"db": "a.b", "until": future, "reason": "r"}, "bad db"),
        ({"db": "a", "table": "", "until": future, "reason": "r"}, "bad table"),
        ({"db": "a", "until": 5, "reason": "r"}, "bad until"),
        ({"db": "a", "until": future}, "reason"),
        ({"db": "a", "until": "tomorrow", "reason": "r"}, "until"),
        ({"db": "a", "until": future, "reason": "r", "extra": 1}, "extra"),
        ([], ""),
    ]
    for body, word in bad:
        assert_error(daemon.request("POST", "/v1/holds", body), 400, word)
    assert_error(daemon.request("DELETE", "/v1/holds/abc"), 400, "hold id")
    assert_error(daemon.request("DELETE", "/v1/holds/99999999999999999999"), 400, "hold id")
    assert_error(daemon.request("DELETE", "/v1/holds/42"), 404, "no such hold")
    assert_error(daemon.request("GET", "/v1/holds?all=maybe", scope="read"), 400, "all")
    ok = {"db": "a", "until": future, "reason": "r"}
    assert daemon.request("POST", "/v1/holds", ok, scope="write").status == 403
    assert daemon.request("POST", "/v1/holds", ok, scope=None).status == 401
    assert daemon.request("GET", "/v1/holds", scope="read").json() == {"holds": []}
    for args, word in [
        (["hold", "add", "a", "--until", "someday", "--reason", "r"], "someday"),
        (["hold", "add", "a", "--until", "2001-01-01", "--reason", "r"], "bad until"),
        (["hold", "add", "a.b.c", "--until", "1d", "--reason", "r"], "bad table"),
        (["hold", "add", "a.", "--until", "1d", "--reason", "r"], "bad table"),
        (["hold", "rm", "99999999999999999999"], "hold ls"),
        (["hold", "add", "a", "--until", "1d"], "--reason"),
        (["hold", "rm", "7"], "no such hold"),
        (["hold", "rm", "x"], "x"),
    ]:
        r = cli(daemon, *args)
        assert r.returncode == 2, (args, r)
        assert word in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) <= 2, r.stderr  # usage line + the error
    assert daemon.request("GET", "/v1/holds?all=true", scope="read").json() == {"holds": []}
    for raw in ("%C2%B2", "%D9%A1", "0", "-1"):  # digits of other scripts are not ids
        assert_error(daemon.request("DELETE", f"/v1/holds/{raw}"), 400, "hold id")
    r = cli(daemon, "hold", "add", "a", "--until", "2099-01-01T00:00Z", "--reason", "r")
    assert r.returncode == 0 and "2099-01-01 00:00" in r.stdout, r.stderr
    assert daemon.errors() == []


def test_budget_evicts_oldest_and_reports_it(make_daemon: MakeDaemon) -> None:
    d = make_daemon(env={"CMROOT_STORE_MAX_BYTES": "1KiB", "CMROOT_STORE_MIN_RETAIN": "1s",
                         "CMROOT_STORE_RETAIN": "30d"})
    first = drop(d, "db", "first")
    second = drop(d, "db", "second")
    assert metric(d, "cmroot_store_budget_bytes") == 1024
    assert metric(d, "cmroot_store_over_budget_bytes") == 2 * 600 - 1024
    time.sleep(1.2)  # both older than min_retain
    r = cli(d, "gc")
    assert r.returncode == 0, r.stderr
    assert "evicted 1 of them" in r.stdout
    assert not served(d, first) and served(d, second)
    assert metric(d, "cmroot_store_over_budget_bytes") == 0
    assert metric(d, "cmroot_gc_evicted_objects_total") == 1
    assert d.errors() == []


def test_gc_dry_run_names_tables_and_files(make_daemon: MakeDaemon) -> None:
    d = make_daemon(env={"CMROOT_STORE_RETAIN": f"{RETAIN:g}s"})
    files = drop(d, "sales", "orders", {"_SUCCESS": b""})
    wait_expired()
    r = cli(d, "gc", "--dry-run", "--files")
    assert r.returncode == 0, r.stderr
    assert "sales.orders: 1 files, 600 B" in r.stdout
    assert str(next(iter(files))) in r.stdout and "_SUCCESS" not in r.stdout
    assert "_SUCCESS" in cli(d, "gc", "--dry-run", "--files", "--all").stdout
    bad = cli(d, "gc", "--files")
    assert bad.returncode == 2 and "--dry-run" in bad.stderr and "Traceback" not in bad.stderr
    assert_error(d.request("POST", "/v1/gc?files=true"), 400, "dry_run")
    assert d.request("GET", "/v1/entries", scope="read").json()["entries"]  # nothing went

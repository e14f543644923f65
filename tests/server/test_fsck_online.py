"""fsck while the daemon runs: `cmroot fsck` checks read-only beside it, `cmroot fsck
--repair` (and POST /v1/fsck) repairs inside it, with recycles going on. Nothing that is
well is reported or touched: an object between its publish and its commit is neither
unindexed nor registered, a row whose object a recycle is publishing is not forgotten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from cmroot_testlib import object_file

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, MakeDaemon, assert_error, write_files


def cli(d: Daemon, *args: str, url: bool = False) -> subprocess.CompletedProcess[str]:
    """The CLI on the daemon's config (so it finds the store the daemon holds)."""
    token = d.base / "token-admin"
    token.write_text(d.tokens["admin"])
    token.chmod(0o600)
    extra = ["--url", d.url] if url else []
    return subprocess.run(
        [sys.executable, "-m", "cmroot.cli", *args, "--config", str(d.config_path),
         "--token-file", str(token), "--json", "-q", *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CMROOT_SERVER_PORT": str(d.port)},
    )


def object_path(d: Daemon, checksum: str) -> Path:
    return object_file(d.store, checksum)


def recycle(d: Daemon, name: str, data: bytes) -> dict[str, str]:
    files = write_files(d.warehouse / name, {"f": data})
    path = next(iter(files))
    r = d.request("POST", "/v1/recycle", {"paths": [path], "op": "DELETE"})
    assert r.status == 200, r
    return {"path": path, "checksum": cks.of_bytes(data)}


def test_fsck_checks_beside_the_daemon_and_repairs_through_it(daemon: Daemon) -> None:
    kept = recycle(daemon, "a", b"kept bytes" * 100)
    r = cli(daemon, "fsck")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["clean"]
    # An object with no row (a store restored from a backup, say), and a row whose object
    # is gone.
    orphan = b"an object nobody indexed" * 10
    c = cks.of_bytes(orphan)
    object_path(daemon, c).parent.mkdir(parents=True, exist_ok=True)
    object_path(daemon, c).write_bytes(orphan)
    lost = recycle(daemon, "b", b"bytes whose object goes" * 10)
    object_path(daemon, lost["checksum"]).unlink()
    r = cli(daemon, "fsck")
    report = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    assert (report["unindexed"], report["missing"]) == ([c], [lost["checksum"]])
    assert not report["repair"]
    r = cli(daemon, "fsck", "--repair")  # reaches the daemon, which holds the store
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["repair"]
    again = json.loads(cli(daemon, "fsck").stdout)
    assert again["clean"], again
    res = daemon.request("POST", "/v1/resolve", {"files": [kept, lost]}, scope="read").json()
    assert [f["status"] for f in res["files"]] == ["cmroot", "missing"]
    assert daemon.errors() == []


def test_fsck_api_refuses_bad_input(daemon: Daemon) -> None:
    assert_error(daemon.request("POST", "/v1/fsck?repair=maybe"), 400, "repair")
    assert_error(daemon.request("POST", "/v1/fsck?deep=1"), 400, "deep")
    assert daemon.request("POST", "/v1/fsck", scope="write").status == 403
    assert daemon.request("POST", "/v1/fsck", scope=None).status == 401
    assert daemon.request("POST", "/v1/fsck").json()["clean"]


def test_repairs_while_recycles_run_report_nothing_and_lose_nothing(
    make_daemon: MakeDaemon,
) -> None:
    """Recycles (plain, and two-phase with objects published ahead of their commit) and
    re-recycles of the same bytes in a loop, beside fsck --repair in the daemon and fsck
    read-only beside it: nothing is ever reported, and every recycled pair resolves."""
    d = make_daemon()
    stop = threading.Event()
    pairs: list[dict[str, str]] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            n = 0
            while not stop.is_set():
                n += 1
                data = f"round {n % 7}".encode() * 300  # the same bytes again and again
                pairs.append(recycle(d, f"w{n}", data))
                files = write_files(d.warehouse / f"p{n}", {"f": f"two-phase {n}".encode()})
                path = next(iter(files))
                r = d.request("POST", "/v1/recycle",
                              {"paths": [path], "op": "DELETE", "prepare": True})
                assert r.status == 200, r
                txid = r.json()["txid"]
                assert d.request("POST", f"/v1/transactions/{txid}/commit").status == 200
                pairs.append({"path": path, "checksum": cks.of_bytes(f"two-phase {n}".encode())})
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    try:
        for i in range(20):
            if i % 2:
                r = d.request("POST", "/v1/fsck?repair=true", timeout=120)
                assert r.status == 200, r
                report = r.json()
            else:
                done = cli(d, "fsck")
                assert done.returncode in (0, 1), done.stderr
                report = json.loads(done.stdout)
            assert report["clean"], report
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert len(pairs) > 10
    res = d.request("POST", "/v1/resolve", {"files": pairs}, scope="read").json()
    assert {f["status"] for f in res["files"]} == {"cmroot"}
    assert json.loads(cli(d, "fsck").stdout)["clean"]
    assert d.errors() == []

"""Bounded classes of work over the real daemon. Requests are held admitted on purpose
(bodies that trickle in a byte a second, downloads nobody reads) until a class is full,
as its `cmroot_work_queue_depth` says; then one more of that class is answered 503 with
Retry-After and changes nothing, while /healthz and the other classes still answer, and
the held requests go on once let go. A resolve whose originals to hash hold more than
resolve.MAX_HASH_BYTES is refused 413 before a byte of them is read.

The stalled downloads go over the daemon's Unix socket: there a send waits once about
256 KiB are queued, where loopback TCP would queue 4 MiB each (1 GiB for the class)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cmroot import checksum as cks
from cmroot.client import Client
from cmroot.exceptions import DaemonUnavailable
from cmroot.server.app import LIMITS
from cmroot.store.resolve import MAX_HASH_BYTES
from tests.server.cmroot_daemon import Daemon, MakeDaemon, Reply, assert_error, write_files

pytestmark = pytest.mark.timeout(300)

PAD = 900  # leading spaces of a held body, sent one a second: it outlives any test
BIG = 8 << 20  # a download far larger than the socket buffers between us and the daemon


def depth(d: Daemon, cls: str) -> float:
    for fam in text_string_to_metric_families(d.metrics()):
        for s in fam.samples:
            if s.name == "cmroot_work_queue_depth" and s.labels == {"class": cls}:
                return s.value
    raise AssertionError(f"no cmroot_work_queue_depth{{class={cls!r}}}")


def wait_depth(d: Daemon, cls: str, n: int) -> None:
    """Until `n` requests of `cls` are admitted (the daemon has read their headers)."""
    deadline = time.monotonic() + 60
    while (got := depth(d, cls)) != n:
        assert time.monotonic() < deadline, f"{cls}: {got} admitted, not {n}\n{d.log()}"
        time.sleep(0.05)


class HeldPosts(threading.Thread):
    """POSTs whose bodies arrive a space a second (the daemon cuts a body idle for 15 s):
    admitted, waiting for their bodies, until `release` sends the rest."""

    def __init__(self, d: Daemon, path: str, scope: str, bodies: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.bodies = bodies
        self.stop = threading.Event()
        self.socks: list[socket.socket] = []
        self.sent: list[int] = []
        for body in bodies:
            s = socket.create_connection(("127.0.0.1", d.port), timeout=120)
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {d.tokens[scope]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {PAD + len(body)}\r\n\r\n "
                .encode()
            )
            self.socks.append(s)
            self.sent.append(1)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            for i, s in enumerate(self.socks):
                if self.sent[i] < PAD:
                    s.sendall(b" ")
                    self.sent[i] += 1

    def release(self) -> list[Reply]:
        self.stop.set()
        self.join()
        for s, body, sent in zip(self.socks, self.bodies, self.sent, strict=True):
            s.sendall(b" " * (PAD - sent) + body)
        replies = []
        for s in self.socks:
            r = http.client.HTTPResponse(s)
            r.begin()
            replies.append(Reply(r.status, r.headers, r.read()))
            s.close()
        return replies


def recycle_body(path: str, table: str) -> dict[str, Any]:
    return {"paths": [path], "op": "DROP_TABLE", "db": "db", "table": table}


def resolve_body(files: dict[str, bytes]) -> dict[str, Any]:
    return {"files": [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def test_a_full_recycle_queue_answers_503_and_changes_nothing(daemon: Daemon) -> None:
    d = daemon
    limit = LIMITS["recycle"].admitted
    held_files = write_files(d.warehouse, {f"db.db/h{i}/f": b"held %d" % i for i in range(limit)})
    bodies = [encode(recycle_body(p, f"h{i}")) for i, p in enumerate(held_files)]
    held = HeldPosts(d, "/v1/recycle", "write", bodies)
    held.start()
    try:
        wait_depth(d, "recycle", limit)
        extra = write_files(d.warehouse, {"db.db/extra/f": b"extra"})
        (extra_path,) = extra
        before = d.snapshot()
        r = d.request("POST", "/v1/recycle", recycle_body(extra_path, "extra"), scope="write")
        assert_error(r, 503, "recycle", "retry", "nothing was done")
        assert int(r.headers["Retry-After"]) >= 1
        assert d.snapshot() == before
        # Other classes answer meanwhile: liveness, a resolve, a download, the event log.
        assert d.request("GET", "/healthz", scope=None).status == 200
        r = d.request("POST", "/v1/resolve", resolve_body(extra), scope="read")
        assert r.status == 200 and r.json()["files"][0]["status"] == "original", r
        r = d.request("GET", d.files_url(extra_path, cks.of_bytes(b"extra")), scope="read")
        assert r.status == 200 and r.body == b"extra", r
        assert d.request("GET", "/v1/events/current").status == 200
    finally:
        replies = held.release()
    assert [r.status for r in replies] == [200] * limit, replies
    assert not any(os.path.exists(p) for p in held_files), "the held recycles went on"
    wait_depth(d, "recycle", 0)
    r = d.request("POST", "/v1/recycle", recycle_body(extra_path, "extra"), scope="write")
    assert r.status == 200, r
    assert d.errors() == [], d.log()


def test_a_full_resolve_queue_answers_503_while_recycles_go_on(daemon: Daemon) -> None:
    d = daemon
    limit = LIMITS["resolve"].admitted
    files = write_files(d.warehouse, {f"db.db/r/f{i}": b"resolved %d" % i for i in range(limit)})
    bodies = [encode(resolve_body({p: b})) for p, b in files.items()]
    held = HeldPosts(d, "/v1/resolve", "read", bodies)
    held.start()
    try:
        wait_depth(d, "resolve", limit)
        r = d.request("POST", "/v1/resolve", resolve_body(files), scope="read")
        assert_error(r, 503, "resolve", "retry")
        assert int(r.headers["Retry-After"]) >= 1
        assert d.request("GET", "/healthz", scope=None).status == 200
        (gone,) = write_files(d.warehouse, {"db.db/gone/f": b"gone"})
        r = d.request("POST", "/v1/recycle", recycle_body(gone, "gone"), scope="write")
        assert r.status == 200, r
    finally:
        replies = held.release()
    for r, (path, data) in zip(replies, files.items(), strict=True):
        assert r.status == 200, r
        assert r.json()["files"] == [
            {
                "path": path,
                "checksum": cks.of_bytes(data),
                "status": "original",
                "location": path,
                "size": len(data),
            }
        ]
    wait_depth(d, "resolve", 0)
    assert d.request("POST", "/v1/resolve", resolve_body(files), scope="read").status == 200
    assert d.errors() == [], d.log()


@pytest.fixture
def sock_path() -> Iterator[Path]:
    """A socket path short enough for sun_path (pytest's tmp_path may not be)."""
    d = Path(tempfile.mkdtemp(prefix="cmq-", dir="/tmp"))
    yield d / "s"
    shutil.rmtree(d, ignore_errors=True)


def stalled_download(path: Path, d: Daemon, url: str) -> socket.socket:
    """A GET over the Unix socket whose answer is never read: once the socket buffer is
    full the daemon's send waits, and the request stays admitted."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.sendall(
        f"GET {url} HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {d.tokens['read']}\r\n\r\n".encode()
    )
    return s


def test_downloads_fill_serve_and_nothing_else(make_daemon: MakeDaemon, sock_path: Path) -> None:
    """Downloads nobody reads hold every place of the serve class: one more GET is 503,
    while a recycle, a resolve and /healthz still answer."""
    d = make_daemon(env={"CMROOT_SERVER_SOCKET": str(sock_path)})
    limit = LIMITS["serve"].admitted
    big = d.warehouse / "db.db/big/f"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(1 << 20) * (BIG >> 20))
    url = d.files_url(str(big), cks.of_bytes(big.read_bytes()))
    assert d.request("HEAD", url, scope="read").status == 200  # hashed once, then trusted
    socks: list[socket.socket] = []
    try:
        socks = [stalled_download(sock_path, d, url) for _ in range(limit)]
        wait_depth(d, "serve", limit)
        r = d.request("GET", url, scope="read")
        assert_error(r, 503, "serve", "retry")
        assert int(r.headers["Retry-After"]) >= 1
        assert d.request("GET", "/healthz", scope=None).status == 200
        (path,) = write_files(d.warehouse, {"db.db/t/f": b"recycled while serving"})
        r = d.request("POST", "/v1/recycle", recycle_body(path, "t"), scope="write")
        assert r.status == 200, r
        pair = {path: b"recycled while serving"}
        r = d.request("POST", "/v1/resolve", resolve_body(pair), scope="read")
        assert r.status == 200 and r.json()["files"][0]["status"] == "cmroot", r
    finally:
        for s in socks:
            s.close()
    wait_depth(d, "serve", 0)
    r = d.request("GET", d.files_url(path, cks.of_bytes(b"recycled while serving")))
    assert r.status == 200 and r.body == b"recycled while serving", r
    assert d.errors() == [], d.log()


def test_resolve_refuses_more_bytes_to_hash_than_its_bound(daemon: Daemon) -> None:
    """Two sparse originals holding more than MAX_HASH_BYTES together: 413 naming the
    bound and the fix, before either is read (no checksum cached)."""
    d = daemon
    paths = []
    for name in ("a", "b"):
        p = d.warehouse / "db.db/huge" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.truncate(MAX_HASH_BYTES // 2 + 1)  # sparse: no disk, no time to write
        paths.append(str(p))
    body = {"files": [{"path": p, "checksum": "0" * 32} for p in paths]}
    r = d.request("POST", "/v1/resolve", body, scope="read")
    assert_error(r, 413, str(MAX_HASH_BYTES), "split the batch")
    con = sqlite3.connect(f"file:{d.store / 'index.sqlite'}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT count(*) FROM checksums").fetchone()[0] == 0
    finally:
        con.close()
    small = write_files(d.warehouse, {"db.db/small/f": b"small"})
    r = d.request("POST", "/v1/resolve", resolve_body(small), scope="read")
    assert r.status == 200 and r.json()["files"][0]["status"] == "original", r
    assert d.errors() == [], d.log()


def test_the_client_waits_out_a_full_queue(daemon: Daemon) -> None:
    """A Client sends a request refused 503 + Retry-After again, as the daemon asks: a
    hook's resolve behind a full class goes through once there is room; with no time to
    wait (busy_wait=0) the 503 is raised at once."""
    d = daemon
    limit = LIMITS["resolve"].admitted
    files = write_files(d.warehouse, {f"db.db/w/f{i}": b"waited %d" % i for i in range(limit)})
    pairs = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    held = HeldPosts(
        d, "/v1/resolve", "read", [encode(resolve_body({p: b})) for p, b in files.items()]
    )
    held.start()
    outcome: list[Any] = []
    try:
        wait_depth(d, "resolve", limit)
        with pytest.raises(DaemonUnavailable, match="resolve"):
            Client(d.url, token=d.tokens["read"], busy_wait=0).resolve(pairs)
        waiting = threading.Thread(
            target=lambda: outcome.append(
                Client(d.url, token=d.tokens["read"], busy_wait=120).resolve(pairs)
            ),
            daemon=True,
        )
        waiting.start()
        # Released only once the waiting client has been refused at least once.
        deadline = time.monotonic() + 60
        while refused(d, "/v1/resolve") < 2:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
    finally:
        held.release()
    waiting.join(120)
    (res,) = outcome
    assert [r.status for r in res.files] == ["original"] * limit


def refused(d: Daemon, route: str) -> float:
    for fam in text_string_to_metric_families(d.metrics()):
        for s in fam.samples:
            if s.name == "cmroot_http_requests_total" and s.labels == {
                "route": route,
                "code": "503",
            }:
                return s.value
    return 0.0

"""Crowds of idle and slow clients: thousands of idle connections and slow-loris clients
(headers sent a byte at a time) leave the daemon answering /healthz and a recycle within
a second; past its connection cap it closes idle connections rather than running out of
descriptors; headers that never finish, bodies that stall and answers nobody reads are
cut off."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cmroot.server.main import WRITE_WATCH_EVERY
from tests.server.cmroot_daemon import (
    FAST_TIMEOUTS,
    SEND_TIMEOUT,
    Daemon,
    MakeDaemon,
    write_files,
)

pytestmark = pytest.mark.timeout(180)

IDLE = 2000
LORIS = 64
SLOW_HEADER = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4000


@pytest.fixture
def nofile() -> Iterator[None]:
    """Room for the test's own sockets (the daemon inherits the limit too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192)
    if want < IDLE + LORIS + 200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for {IDLE} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect(d: Daemon, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", d.port), timeout=10) for _ in range(n)]


class _Loris(threading.Thread):
    """Sends each socket's request headers one byte at a time, round robin, until stopped."""

    def __init__(self, socks: list[socket.socket], pause: float) -> None:
        super().__init__(daemon=True)
        self.socks, self.pause = socks, pause
        self.stop = threading.Event()
        self.cut: set[int] = set()  # sockets the daemon closed

    def run(self) -> None:
        for byte in SLOW_HEADER:
            for i, s in enumerate(self.socks):
                if i not in self.cut:
                    try:
                        s.send(bytes([byte]))
                    except OSError:
                        self.cut.add(i)
            if len(self.cut) == len(self.socks) or self.stop.wait(self.pause):
                return  # every one cut, or told to stop


def _recycle_one(d: Daemon, name: str) -> None:
    """A one-file recycle answered within a second."""
    (path,) = write_files(d.warehouse, {f"db.db/{name}/f": name.encode()})
    body = {"paths": [path], "op": "DROP_TABLE", "db": "db", "table": name}
    r = d.request("POST", "/v1/recycle", body, scope="write", timeout=1.0)
    assert r.status == 200, r


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


def test_idle_connections_and_slow_loris(make_daemon: MakeDaemon, nofile: None) -> None:
    d = make_daemon()
    idle = _connect(d, IDLE)
    loris = _Loris(_connect(d, LORIS), pause=0.05)
    loris.start()
    try:
        time.sleep(1)  # every connection accepted, the slow ones part way through
        for i in range(3):
            assert d.request("GET", "/healthz", scope=None, timeout=1.0).status == 200
            _recycle_one(d, f"t{i}")
        assert loris.is_alive() and not loris.cut, "slow clients are cut only by timeouts"
    finally:
        loris.stop.set()
        loris.join(10)
        _close_all(idle + loris.socks)
    assert d.errors() == [], d.log()
    assert d.stop() == 0


def test_connection_cap_under_a_low_descriptor_limit(
    make_daemon: MakeDaemon, nofile: None
) -> None:
    """A daemon allowed 512 descriptors and offered 800 idle connections: it closes idle
    ones for room (never failing to accept with EMFILE) and keeps answering."""
    d = make_daemon(start=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # inherited by the daemon
    try:
        d.start(wait=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    d.wait_ready()
    idle = _connect(d, 800)
    try:
        time.sleep(1)
        for i in range(3):
            assert d.request("GET", "/healthz", scope=None, timeout=1.0).status == 200
            _recycle_one(d, f"t{i}")
        # The oldest idle connections were the ones closed.
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        _close_all(idle)
    assert "Too many open files" not in d.log(), d.log()
    assert d.errors() == [], d.log()
    assert d.stop() == 0


def test_unfinished_headers_and_stalled_bodies_are_cut_off(make_daemon: MakeDaemon) -> None:
    """Headers trickled for longer than the keep-alive timeout get the connection closed;
    a body that stops arriving is answered 408 instead of holding a handler for ever."""
    d = make_daemon(env=FAST_TIMEOUTS)
    loris = _Loris(_connect(d, 1), pause=1.0)  # 4,000 bytes: over an hour of headers
    loris.start()
    stalled = socket.create_connection(("127.0.0.1", d.port), timeout=60)
    stalled.sendall(
        b"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {d.tokens['write']}\r\n".encode()
        + b"Content-Length: 100\r\n\r\n{\"eventType\": "
    )
    try:
        answer = stalled.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        loris.join(60)
        assert loris.cut == {0}, "the slow-loris connection is still open"
    finally:
        loris.stop.set()
        _close_all([stalled, *loris.socks])
    assert d.request("GET", "/healthz", scope=None, timeout=1.0).status == 200
    assert d.stop() == 0


def test_an_answer_nobody_reads_is_cut(make_daemon: MakeDaemon) -> None:
    """A resolve answer of several MiB whose client never reads it: once nothing of it has
    moved for the send timeout the connection is aborted, instead of the answer sitting in
    the daemon's memory (and holding a connection place) for as long as the client likes."""
    d = make_daemon(env=FAST_TIMEOUTS)
    deep = "/".join(["d" * 200] * 15)  # 3,000 characters, within the path limits
    pairs = [
        {"path": str(d.warehouse / "db.db" / deep / f"f{i}"), "checksum": "0" * 32}
        for i in range(2000)
    ]
    body = json.dumps({"files": pairs}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", d.port))
    try:
        s.sendall(
            b"POST /v1/resolve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {d.tokens['read']}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + SEND_TIMEOUT + 3 * WRITE_WATCH_EVERY
        while not any(r["msg"].startswith("cut a connection") for r in d.log_records()):
            assert time.monotonic() < deadline, "the unread answer is still held"
            time.sleep(1)
        got = b""
        s.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(1 << 20):
                got += chunk
    finally:
        s.close()
    assert len(got) < len(body), "the whole answer went out: nothing was cut"
    assert d.request("GET", "/healthz", scope=None, timeout=1.0).status == 200
    assert d.errors() == [], d.log()

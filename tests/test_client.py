"""cmroot.client.Client against the real daemon (a `cmroot serve` subprocess): every call,
errors mapped back to the same cmroot.exceptions the store raises, keep-alive surviving a
daemon restart, one client shared by threads, and a clear DaemonUnavailable when nothing
listens."""

from __future__ import annotations

import http.server
import io
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cmroot import checksum as cks  # noqa: E402
from cmroot import client as client_mod  # noqa: E402
from cmroot.client import Client, FileRef, Recycled, Resolved  # noqa: E402
from cmroot.exceptions import (  # noqa: E402
    BadRequest,
    ChecksumMismatch,
    CmrootError,
    DaemonUnavailable,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
)
from tests.server.cmroot_daemon import Daemon, free_port, write_files  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "d", env={"CMROOT_SERVER_MAX_BODY": "65536"})
    with d.serving(check_errors=False):
        yield d


def test_every_call(daemon: Daemon) -> None:
    d = daemon
    files = write_files(
        d.warehouse, {f"db.db/t/p=1/f{i}": f"bytes {i}".encode() * 300 for i in range(5)}
    )
    sums = {p: cks.of_bytes(b) for p, b in files.items()}
    c = d.client("admin")
    assert c.healthy()
    e0 = c.add_event(
        "CREATE_TABLE",
        db="db",
        table="t",
        files=[{"path": p, "checksum": s, "size": len(files[p])} for p, s in sums.items()],
    )
    seen: list[tuple[int, int]] = []
    res = c.recycle(
        [str(d.warehouse / "db.db/t")],
        progress=lambda a, b: seen.append((a, b)),
        op="DROP_TABLE",
        db="db",
        table="t",
        partitions=[{"p": "1"}],
        mode="move",
        purge=False,
    )
    assert isinstance(res, Recycled) and all(isinstance(f, FileRef) for f in res.files)
    assert res.event_id == e0 + 1 and seen == [(5, 5)]
    assert {f.path: f.checksum for f in res.files} == sums
    assert res["event_id"] == res.event_id  # callers written against dicts still read it
    out = c.resolve([{"path": p, "checksum": s} for p, s in sums.items()]).files
    assert all(isinstance(f, Resolved) for f in out)
    assert {f.status for f in out} == {"cmroot"} and [f.path for f in out] == list(sums)
    for p, b in files.items():
        buf = io.BytesIO()
        assert c.get(p, sums[p], buf) == len(b) and buf.getvalue() == b
    p = next(iter(files))
    with c.open(p, sums[p], byte_range=(3, 9)) as resp:
        assert resp.status == 206 and resp.read() == files[p][3:10]
        assert resp.getheader("ETag") == f'"{sums[p]}"'
    page = c.entries(db="db", table="t", limit=2)
    assert len(page["entries"]) == 2 and page["cursor"] is not None
    rest = c.entries(db="db", table="t", limit=10, cursor=page["cursor"])
    assert len(rest["entries"]) == 3 and rest["cursor"] is None
    assert [e["eventType"] for e in c.events()] == ["CREATE_TABLE", "DROP_TABLE"]
    assert c.current_event() == e0 + 1
    assert c.gc(dry_run=True)["dry_run"] is True
    assert c.gc()["removed"] == []
    c.close()
    assert c.current_event() == e0 + 1  # a closed client reconnects


def test_errors_come_back_as_cmroot_exceptions(daemon: Daemon) -> None:
    d = daemon
    write_files(d.outside, {"secret": b"s"})
    c = d.client("admin")
    with pytest.raises(BadRequest) as e:
        c.recycle(["/x"], op="NUKE")
    assert "op" in e.value.message and "NUKE" in str(e.value)
    with pytest.raises(Forbidden) as e:
        c.recycle([str(d.outside / "secret")], op="DELETE")
    assert "outside" in e.value.message
    with pytest.raises(NotFound):
        c.recycle([str(d.warehouse / "nope")], op="DELETE")
    with pytest.raises(NotFound):
        c.get(str(d.warehouse / "nope"), "0" * 32, io.BytesIO())
    with pytest.raises(BadRequest) as e:
        c.resolve([{"path": str(d.warehouse / "x"), "checksum": "XYZ"}])
    assert any(name in e.value.message for name in ("pair #0", "files[0]"))  # the pair named
    with pytest.raises(PayloadTooLarge):
        c.recycle([str(d.warehouse / ("x" * 200))] * 2000, op="DELETE")
    with pytest.raises(Forbidden) as e:
        d.client("read").gc()
    assert "scope" in e.value.message
    with pytest.raises(Unauthorized):
        Client(d.url, "wrong").entries()
    with pytest.raises(Unauthorized):
        Client(d.url).entries()
    assert (d.outside / "secret").read_bytes() == b"s"
    assert d.errors() == [], d.log()


def test_keep_alive_survives_a_restart(daemon: Daemon) -> None:
    d = daemon
    files = write_files(d.warehouse, {"db.db/t/f": b"abc"})
    pair = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    c = d.client("admin")
    assert c.resolve(pair)["files"][0]["status"] == "original"
    c.entries()
    d.restart()
    # The pooled connection is stale; reads retry once on a fresh one.
    assert c.entries()["entries"] == []
    d.restart()
    assert c.resolve(pair)["files"][0]["status"] == "original"


def test_a_recycle_after_the_daemon_closed_the_kept_alive_connection(daemon: Daemon) -> None:
    """A recycle is not resent when its answer is lost (it may have run), so it must never
    be written into a kept-alive connection the daemon has closed (here by a restart): the
    client sees the close on the idle socket and connects again. Before, the recycle went
    into the dead connection and failed as DaemonUnavailable, and a fail-open hook would
    have deleted without a copy."""
    d = daemon
    files = write_files(d.warehouse, {"db.db/a/f": b"a", "db.db/b/f": b"b"})
    c = d.client("write")
    paths = sorted(files)
    assert len(c.recycle([paths[0]], op="DELETE").files) == 1
    d.restart()
    assert len(c.recycle([paths[1]], op="DELETE").files) == 1
    assert not any(os.path.exists(p) for p in paths)


def test_one_client_shared_by_threads(daemon: Daemon) -> None:
    d = daemon
    files = write_files(d.warehouse, {f"db.db/t/f{i}": bytes([i]) * 100 for i in range(16)})
    c = d.client("admin")
    errors: list[BaseException] = []

    def work(path: str) -> None:
        try:
            c.recycle([path], op="DELETE")
            for _ in range(10):
                buf = io.BytesIO()
                c.get(path, cks.of_bytes(files[path]), buf)
                assert buf.getvalue() == files[path]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert c.current_event() == 16


def test_nothing_listening_is_daemon_unavailable() -> None:
    port = free_port()
    c = Client(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(DaemonUnavailable) as e:
        c.entries()
    assert "cmroot" in str(e.value) and "cmroot serve" in str(e.value)
    with pytest.raises(DaemonUnavailable) as e:
        c.recycle(["/x"], op="DELETE")
    assert "cmroot" in str(e.value)
    assert c.healthy() is False


def test_connection_cut_mid_answer_is_daemon_unavailable() -> None:
    """A server that accepts and hangs up without answering."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = Client(f"http://127.0.0.1:{port}", "tok", timeout=5)
        with pytest.raises(DaemonUnavailable) as e:
            c.recycle(["/x"], op="DELETE")
        assert "connection to the cmroot daemon lost during recycle" in str(e.value)
        assert "rolled back" in e.value.detail
    finally:
        stop.set()
        t.join(5)
        srv.close()


@pytest.mark.parametrize("url", ["", "localhost:9750", "ftp://x", "http://", "/v1"])
def test_bad_url(url: str) -> None:
    with pytest.raises(CmrootError) as e:
        Client(url)
    assert "URL" in e.value.message


# -- batches, verified copies, early stops, content type -----------------------------------------


def test_resolve_splits_batches_above_the_daemon_limits(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cmroot.store.resolve import MAX_PAIRS

    assert client_mod.MAX_RESOLVE == MAX_PAIRS
    d = daemon
    files = write_files(d.warehouse, {f"db.db/t/f{i}": bytes([i]) * 10 for i in range(5)})
    pairs = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    c = d.client("read")
    monkeypatch.setattr(client_mod, "MAX_RESOLVE", 2)  # the pair limit, made small
    out = c.resolve(pairs).files
    assert [(f.path, f.status) for f in out] == [(p, "original") for p in files]
    # 2,000 pairs are 150 KB, over this daemon's 64 KB body limit: split until they fit.
    monkeypatch.setattr(client_mod, "MAX_RESOLVE", 100_000)
    many = [{"path": str(d.warehouse / f"db.db/t/g{i:05}"), "checksum": "0" * 32}
            for i in range(2000)]
    out = c.resolve(pairs + many).files
    assert [f.path for f in out] == [p["path"] for p in pairs + many]
    assert [f.status for f in out] == ["original"] * 5 + ["missing"] * 2000


def test_get_returns_what_it_wrote(daemon: Daemon) -> None:
    d = daemon
    data = os.urandom(3 << 20)
    (path,) = write_files(d.warehouse, {"db.db/t/big": data})
    buf = io.BytesIO()
    assert d.client("read").get(path, cks.of_bytes(data), buf) == len(data)
    assert buf.getvalue() == data


class _Fake:
    """A one-route HTTP server that answers every request with `reply(handler)` and keeps
    the request headers it saw."""

    def __init__(self, reply: Callable[[http.server.BaseHTTPRequestHandler], None]) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                fake.seen.append((self.command, self.path, dict(self.headers)))
                reply(self)

            do_GET = do_POST = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _send(h: http.server.BaseHTTPRequestHandler, body: bytes, length: bool = True) -> None:
    h.send_response(200)
    if length:
        h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def test_get_verifies_the_bytes_it_wrote() -> None:
    good = b"the right bytes " * 1000
    body = {"bytes": good}
    # No Content-Length (the body ends when the connection closes): the count is of bytes.
    fake = _Fake(lambda h: _send(h, body["bytes"], length=False))
    try:
        c = Client(fake.url, timeout=10)
        buf = io.BytesIO()
        assert c.get("/wh/f", cks.of_bytes(good), buf) == len(good)
        assert buf.getvalue() == good
        body["bytes"] = good[:-1] + b"!"  # damaged on the way
        with pytest.raises(ChecksumMismatch) as e:
            c.get("/wh/f", cks.of_bytes(good), io.BytesIO())
        assert "/wh/f" in e.value.detail and "again" in e.value.detail
    finally:
        fake.close()


def test_a_caller_that_stops_reading_early_does_not_drain_the_body(daemon: Daemon) -> None:
    d = daemon
    data = os.urandom(64 << 20)
    (path,) = write_files(d.warehouse, {"db.db/t/huge": data})
    checksum = cks.of_bytes(data)
    c = d.client("read")
    read = {"bytes": 0}
    with c.open(path, checksum) as resp:
        assert resp.read(10) == data[:10]
        real = resp.read

        def counted(*args: Any) -> bytes:
            out = real(*args)
            read["bytes"] += len(out)
            return out

        resp.read = counted  # type: ignore[method-assign]
        t0 = time.monotonic()
    assert read["bytes"] == 0, "the rest of the body was read to be thrown away"
    assert time.monotonic() - t0 < 2
    assert c.entries()["entries"] == []  # the client goes on, on a fresh connection


def test_every_post_says_its_body_is_json() -> None:
    answers = {
        "/v1/recycle": {"event_id": 1, "files": []},
        "/v1/resolve": {"files": []},
        "/v1/events": {"id": 1},
        "/v1/gc": {"dry_run": True},
    }

    def reply(h: http.server.BaseHTTPRequestHandler) -> None:
        _send(h, json.dumps(answers[h.path.split("?")[0]]).encode())

    fake = _Fake(reply)
    try:
        c = Client(fake.url, "tok", timeout=10)
        c.recycle(["/wh/x"], op="DELETE")
        c.resolve([{"path": "/wh/x", "checksum": "0" * 32}])
        c.add_event("CREATE_TABLE", db="d", table="t")
        c.gc(dry_run=True)
        posts = [(path, hdrs) for method, path, hdrs in fake.seen if method == "POST"]
        assert len(posts) == 4
        for path, hdrs in posts:
            assert hdrs.get("Content-Type") == "application/json", (path, hdrs)
    finally:
        fake.close()


def test_json_only_the_stdlib_reads_and_writes_still_goes_through() -> None:
    """msgspec refuses lone surrogates both ways (an undecodable command-line argument, an
    escaped one in an answer); the client then falls back to the stdlib, as it did before,
    so the answer (or the daemon's own clear refusal) comes through, never a traceback."""
    answers = {
        "/v1/events": b'{"events":[{"table":"\\udcff"}],"next":0,"more":false}',
    }

    def reply(h: http.server.BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        _send(h, answers[path] if h.command == "GET" else b'{"id":1}')

    fake = _Fake(reply)
    try:
        c = Client(fake.url, timeout=10)
        assert [e["table"] for e in c.events(0, 10)] == ["\udcff"]
        c.add_event("CREATE_TABLE", db="d", table="\udcff")  # sent escaped, not refused
        assert fake.seen[-1][0] == "POST"
    finally:
        fake.close()

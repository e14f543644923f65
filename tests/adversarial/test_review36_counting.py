"""Review 36: commit 54debc3. The catch-all resource that matches every target
(app._Anything; a serving process answers a target without a leading "/" itself,
app.forward -> unknown), the counting of cmroot_http_requests_total (the primary counts
every request it answers, cut ones of its private socket included; a serving process
counts only what the primary never saw: request[UPSTREAM] unset, app._errors), and the
body stall watch left to the primary for what a serving process passes on
(main._Listener.watch_body skips `passes_on(request)`).

Attacked, on a single-process daemon and on both processes of a two-process one (each
connection placed on a chosen process, tests.adversarial.test_review35_heartbeat_rundir
.connect_to): bodies that stall before their first byte, after some bytes, or trickle, with
and without `Expect: 100-continue`; clients that hang up before the first body byte,
mid-body, after a 100 Continue; a serving process killed (kill -9) while it holds a
request; early answers (401, 413, 415) with large bodies still coming; pipelined and
keep-alive requests around a forwarded 408; odd targets (`*`, absolute form, CONNECT,
%00, %0A, %2F, raw non-ASCII, 60 KB paths); the forward slots and connections after all of
it; a body that starts after server.keepalive_timeout but within server.body_timeout.
Every check counts requests (cmroot_http_requests_total, summed, /metrics scrapes left
out) before and after.

`test_break_*` are the breaks found (all fixed since; the comment above each says what
broke, where, and the fix); the others are attacks that held."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.adversarial.test_review33_processes import auth_line, fds, listening, restarted
from tests.adversarial.test_review34_processes_fixes import settled
from tests.adversarial.test_review35_heartbeat_rundir import server_side
from tests.server.cmroot_daemon import FAST_TIMEOUTS, Daemon, MakeDaemon
from tests.server.test_processes import TWO, children, started, wait_for

pytestmark = pytest.mark.timeout(120)

BODY_TIMEOUT = 2.0
SLACK = 1.5  # what "about server.body_timeout" allows on top
ENV = {
    **FAST_TIMEOUTS,  # keep-alive 3 s, send 4 s
    "CMROOT_SERVER_BODY_TIMEOUT": f"{BODY_TIMEOUT:g}s",
    "CMROOT_SERVER_MAX_BODY": str(1 << 20),
}


# -- helpers ----------------------------------------------------------------------------

class Two:
    """A two-process daemon and the pid of its serving process."""

    def __init__(self, d: Daemon, worker: int) -> None:
        self.d = d
        self.worker = worker

    @property
    def primary(self) -> int:
        assert self.d.proc is not None
        return self.d.proc.pid


def connect_to(d: Daemon, pid: int) -> socket.socket:
    """A connection that the kernel gave to process `pid` of `d` (SO_REUSEPORT spreads
    them): review 35's, but quick to give up one that landed on any other process."""
    assert d.proc is not None
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # accepted by then (no loop is wedged)
            inode = server_side(d, s)
            if inode is not None:
                if inode in fds(pid):
                    return s
                if any(inode in fds(p) for p in (d.proc.pid, *children(d.proc.pid))):
                    break  # another process's
            time.sleep(0.005)
        s.close()
    raise AssertionError(f"no connection landed on {pid}")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Two]:
    d = Daemon(tmp_path_factory.mktemp("r36two"), env={**TWO, **ENV})
    with d.serving(check_errors=False):
        yield Two(d, started(d))
        assert d.errors() == [], d.log()


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("r36one"), env=ENV)
    with d.serving(check_errors=False):
        yield d
        assert d.errors() == [], d.log()


def head(d: Daemon, extra: bytes, path: bytes = b"/v1/events", scope: str = "write") -> bytes:
    """The head of a POST of JSON (to a route a serving process passes on), `extra`
    (Content-Length and the blank line) last."""
    return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth_line(d, scope)
            + b"Content-Type: application/json\r\n" + extra)


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, at: float) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.at = at  # seconds from the call of read_answer to the answer's head

    def json(self) -> dict[str, str]:
        out = json.loads(self.body)
        assert isinstance(out, dict)
        return out

    @property
    def kind(self) -> tuple[int, str]:
        return self.status, self.headers.get("content-type", "").split(";")[0]

    def __repr__(self) -> str:
        return f"<Answer {self.status} after {self.at:.2f}s {self.body[:200]!r}>"


def read_answers(s: socket.socket, count: int = 1, timeout: float = 10.0) -> list[Answer]:
    """The next `count` final (non-1xx) answers on `s`, each read whole (Content-Length),
    fewer if the daemon closes or says nothing for `timeout`."""
    t0 = time.monotonic()
    s.settimeout(timeout)
    buf = b""
    out: list[Answer] = []
    at = 0.0
    while len(out) < count:
        m = re.match(rb"HTTP/1\.[01] (\d{3})[^\r]*\r\n((?:[^\r]+\r\n)*)\r\n", buf)
        if m is not None:
            if not at:
                at = time.monotonic() - t0
            status = int(m.group(1))
            headers = {}
            for line in m.group(2).decode("latin-1").split("\r\n")[:-1]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            size = 0 if status < 200 else int(headers.get("content-length", "0"))
            if len(buf) - m.end() >= size:
                if status >= 200:
                    out.append(Answer(status, headers, buf[m.end():m.end() + size], at))
                buf = buf[m.end() + size:]
                at = 0.0
                continue
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        buf += chunk
    return out


def queue_depth(d: Daemon, name: str) -> float:
    m = re.search(r'^cmroot_work_queue_depth\{class="' + name + r'"\} (\S+)$', d.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


# -- breaks -----------------------------------------------------------------------------

# A forwarded request whose client sends its head and then nothing (yet) never reaches
# the primary: aiohttp's client (3.14 here) buffers the request head until the first body
# chunk (http_writer.StreamWriter.write_headers keeps it in _headers_buf; the payload
# writer, ClientRequest.write_bytes, flushes it only with the first chunk of the body that
# app.forward feeds it from request.content.iter_chunked, or at once only for
# `Expect: 100-continue`). So the primary sees a private-socket connection with no request:
# its stall watch never starts, and aiohttp's keep-alive timer, which runs from the
# connection's start (web_protocol.RequestHandler.connection_made), closes the silent
# connection after server.keepalive_timeout. forward gets ServerDisconnectedError, the
# client's body has not failed (request.content.exception() is None): a JSON 503 "the
# daemon's primary process went away while asked ... whether it did what was asked is not
# known", counted by the serving process. Not the 408 after server.body_timeout a single
# process (and the primary) gives; with default settings (15 s each, and a pooled upstream
# connection that had already idled up to 5 s) the 503 also comes sooner than a 408 would.
# Since main.watch_body no longer watches a request the serving process passes on, nothing
# on either side watches this body. The FORWARD slot is held the whole time.
# Fix: send the head to the primary at once, before any body byte: e.g. in forward,
# a body generator that yields b"" first (StreamWriter.write(b"") flushes _headers_buf),
# or keep the serving process's _StallWatch until the first body byte has been passed on
# (then leave the rest to the primary).
# Fixed: app.forward sends the head at once (_passed_on yields b"" first), and the
# serving process watches its client's body again (main.watch_body): a 408 at body_timeout.
def test_break_a_body_stalled_before_its_first_byte_is_a_408(two: Two) -> None:
    d = two.d
    before = settled(d)
    got: list[Answer] = []
    socks = []

    def stall() -> None:
        s = connect_to(d, two.worker)
        socks.append(s)
        s.sendall(head(d, b"Content-Length: 50\r\n\r\n"))
        got.extend(read_answers(s, timeout=BODY_TIMEOUT + 5))

    threads = [threading.Thread(target=stall) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    assert len(got) == 3, got
    for a in got:
        assert a.kind == (408, "application/json"), a
        assert a.at < BODY_TIMEOUT + SLACK, a
    assert settled(d) - before == 3


# The same root cause: a client that sends a head with a Content-Length and hangs up
# before any body byte. app.forward sees the cut (request.content.exception() is set),
# marks the request UPSTREAM ("the primary sees its request cut too, and counts it") and
# raises it: the serving process does not count its 499. But the primary never saw a
# request (the head was still in aiohttp's buffer), only a connection opened and closed:
# it counts nothing. The request is counted by no process.
# Fix: as above (the head sent before the first body byte, so the primary does see the
# request and counts its 499); failing that, set UPSTREAM only once the head is known to
# be sent.
# Fixed: the head reaches the primary at once, which sees the cut and counts it.
def test_break_a_client_gone_before_its_first_body_byte_is_counted(two: Two) -> None:
    d = two.d
    before = settled(d)
    for _ in range(4):
        s = connect_to(d, two.worker)
        s.sendall(head(d, b"Content-Length: 50\r\n\r\n"))
        time.sleep(0.2)  # passed on, as far as the serving process knows
        s.close()
    assert settled(d) - before == 4


# The same root cause, kill -9: a serving process killed while it holds a forwarded
# request whose body has not started. The primary never saw the request (its head was
# never sent), the serving process is dead: counted by no process. Once the head is sent
# at once (the fix above), the primary sees its upstream request cut and counts a 499,
# as it does for a serving process killed mid-body (review 35).
# Fixed: the head reaches the primary at once, which sees the cut and counts it.
def test_break_a_killed_serving_process_request_without_body_is_counted(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon("kill", env={**TWO, **ENV})
    worker = started(d)
    before = settled(d)
    s = connect_to(d, worker)
    try:
        s.sendall(head(d, b"Content-Length: 50\r\n\r\n"))
        time.sleep(0.3)
        os.kill(worker, signal.SIGKILL)
        new = restarted(d, worker)
        wait_for(lambda: listening(new, d.port))
        assert read_answers(s, timeout=5) == []  # cut, no answer
    finally:
        s.close()
    assert settled(d) - before == 1


# A well-behaved client whose body starts a little after its head (a client that sends
# the head first and streams the body from a slow source), within server.body_timeout:
# a single process (and the primary) answers it; through a serving process the primary
# closes the silent upstream connection at server.keepalive_timeout (the head is still in
# aiohttp's buffer, see the first break) and the client gets the JSON 503 "primary went
# away while asked" instead, for a request that was never bad. Here keep-alive 1 s and
# body timeout 3 s, the body 1.5 s after the head; with the defaults (15 s each) it takes
# a body that starts 10-15 s late (a pooled upstream connection has idled up to 5 s).
# Fix: the one of the first break.
# Fixed: the head reaches the primary at once: it waits on the body, not on a new
# request, so no keep-alive timer closes the connection.
def test_break_a_late_but_timely_body_is_answered_through_a_serving_process(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon("late", env={**TWO, "CMROOT_SERVER_KEEPALIVE_TIMEOUT": "1s",
                                 "CMROOT_SERVER_BODY_TIMEOUT": "3s"})
    worker = started(d)
    assert d.proc is not None
    got: dict[str, Answer] = {}
    for name, pid in (("primary", d.proc.pid), ("serving", worker)):
        s = connect_to(d, pid)
        try:
            s.sendall(head(d, b"Content-Length: 2\r\n\r\n"))
            time.sleep(1.5)
            s.sendall(b"{}")
            [got[name]] = read_answers(s, timeout=10)
        finally:
            s.close()
    assert got["primary"].status == 400, got  # {} is not an event: the daemon's own 400
    assert got["serving"].status == got["primary"].status, got


# A body trickled through a serving process (a byte every ~0.1 ms, below BODY_MIN_RATE),
# 24 at once: the primary's watch cuts each (main._StallWatch._cut), answers its 408,
# counts it (app._errors) and closes the private-socket connection at once
# (_Connection.drop_body: no lingering read). The serving process's payload writer is
# still passing trickled bytes on: when it writes one after the primary closed, before
# its loop has read the 408 off the socket, aiohttp's ClientRequest.write_bytes gets
# EPIPE and sets ClientOSError on the connection, so the pending
# `upstream.session().request(...)` in app.forward raises it instead of returning the
# 408; the client's body has not failed (request.content.exception() is None), so forward
# answers the JSON 503 "the daemon's primary process went away while asked ... whether it
# did what was asked is not known", and, UPSTREAM unset, the serving process counts that
# 503 too: the request is counted twice (408 by the primary, 503 by the serving
# process), and the client gets a 503 for a request that was cut. Here a quarter to a
# half of them each time; a slower trickle (a byte every 0.5 ms) hits it about once in 30.
# Fix: the primary should not close a private-socket connection on a body it still
# receives: after its 408, let the serving process close it (keep reading and discarding
# until EOF, bounded), so the answer always gets there first; or forward, on a
# ClientOSError while the body was still being written, should read the answer already
# sent (and treat the request as UPSTREAM when one came). The serving process must then
# drop its client's body (see the lingering break below).
# Fixed: the serving process's own watch cuts the trickle first (the primary waits
# twice server.body_timeout for a forwarded body), so the primary never closes on bytes
# still on the way; it sees the cut and counts the request once (as 499: see README).
def test_break_a_trickled_forwarded_body_is_a_408_counted_once(two: Two) -> None:
    d = two.d
    before = settled(d)
    got: list[Answer] = []

    def trickle() -> None:
        s = connect_to(d, two.worker)
        try:
            s.sendall(head(d, b"Content-Length: 100000\r\n\r\n"))
            s.setblocking(False)
            t0 = time.monotonic()
            while time.monotonic() - t0 < BODY_TIMEOUT + SLACK:
                try:
                    s.send(b" ")
                except BlockingIOError:
                    pass
                except OSError:
                    break
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    pass
                time.sleep(0.0001)  # ~6 KB/s: below BODY_MIN_RATE
            s.setblocking(True)
            got.extend(read_answers(s, timeout=3))
        finally:
            s.close()

    threads = [threading.Thread(target=trickle) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 24, got
    kinds = Counter(a.kind for a in got)
    assert kinds == {(408, "application/json"): 24}, kinds
    assert settled(d) - before == 24


# Once a serving process has passed the primary's 408 back, it keeps the client's
# connection open for aiohttp's lingering_time (10 s), reading the stalled body the
# primary gave up on: main.watch_body no longer puts a _StallWatch on what it passes on,
# so _Connection.drop_body is never called there (the primary, and a single process,
# close at once after the 408). Meanwhile the connection is busy (not `idle()`), so the
# connection cap cannot reclaim it, and a slow-loris on a forwarded route holds each
# serving-process connection server.body_timeout + 10 s, not server.body_timeout.
# Fix: in app.forward, when the answer passed back leaves the client's body unread and
# it is the primary's 408 (or any answer, with request.content not at EOF and its read
# cut), call request.protocol.drop_body() (a main._Connection) before returning, as the
# watch did.
# Fixed: the serving process's watch cuts the body and drops it (no lingering read).
def test_break_a_serving_process_closes_a_cut_connection_after_its_408(two: Two) -> None:
    d = two.d
    for pid in (two.primary, two.worker):
        s = connect_to(d, pid)
        try:
            s.sendall(head(d, b"Content-Length: 10\r\n\r\n{"))
            [a] = read_answers(s, timeout=BODY_TIMEOUT + 5)
            assert a.kind == (408, "application/json"), a
            t0 = time.monotonic()
            s.settimeout(3)
            try:
                rest = s.recv(100)
            except TimeoutError:
                rest = None
            except ConnectionResetError:
                rest = b""
            assert rest == b"", (pid == two.worker, rest)
            assert time.monotonic() - t0 < 1.0
        finally:
            s.close()


# -- what held --------------------------------------------------------------------------

def test_a_stalled_body_with_expect_100_continue_is_a_408_once(two: Two) -> None:
    """`Expect: 100-continue` makes aiohttp's client send the head at once: the stall is
    cut, a JSON 408 answers it (after the serving process's own 100 Continue), counted
    once, and the connection is closed at once, as a single process closes it."""
    d = two.d
    before = settled(d)
    s = connect_to(d, two.worker)
    try:
        s.sendall(head(d, b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n"))
        [a] = read_answers(s, timeout=BODY_TIMEOUT + 5)
        assert a.kind == (408, "application/json") and a.at < BODY_TIMEOUT + SLACK, a
        s.settimeout(2)
        assert s.recv(100) == b""
    finally:
        s.close()
    assert settled(d) - before == 1


def test_a_client_gone_after_100_continue_is_counted_once(two: Two) -> None:
    d = two.d
    before = settled(d)
    for _ in range(4):
        s = connect_to(d, two.worker)
        s.sendall(head(d, b"Expect: 100-continue\r\nContent-Length: 50\r\n\r\n"))
        s.settimeout(3)
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(b"{")
        time.sleep(0.1)
        s.close()
    assert settled(d) - before == 4


@pytest.mark.parametrize(("case", "want"), [("token", 401), ("size", 413), ("type", 415)])
def test_an_early_answer_to_a_large_forwarded_body_is_counted_once(
    two: Two, case: str, want: int,
) -> None:
    """The primary answers before the body is in (a bad token, more than server.max_body,
    a text/plain body), while 2 MiB keep coming through the serving process: that answer,
    JSON, counted once."""
    d = two.d
    size = 2 << 20
    if case == "token":
        first = (b"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer no\r\n"
                 b"Content-Type: application/json\r\n")
    elif case == "type":
        first = head(d, b"").replace(b"application/json", b"text/plain")
    else:
        first = head(d, b"")
    before = settled(d)
    s = connect_to(d, two.worker)
    try:
        s.sendall(first + b"Content-Length: %d\r\n\r\n" % size)
        with contextlib.suppress(OSError):  # the daemon may stop reading after answering
            s.sendall(b" " * size)
        [a] = read_answers(s, timeout=10)
        assert a.kind == (want, "application/json"), a
    finally:
        s.close()
    assert settled(d) - before == 1


def test_pipelined_requests_on_a_serving_process_are_each_counted(two: Two) -> None:
    """Forwarded, local, forwarded-unknown, `OPTIONS *` (answered by the serving process)
    and forwarded again, in one write: five answers, five counts."""
    d = two.d
    before = settled(d)
    s = connect_to(d, two.worker)
    try:
        s.sendall(head(d, b"Content-Length: 2\r\n\r\n{}")
                  + b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                  + head(d, b"Content-Length: 2\r\n\r\n{}", path=b"/v1/nothing")
                  + b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                  + head(d, b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"))
        got = read_answers(s, 5)
    finally:
        s.close()
    assert [a.status for a in got] == [400, 200, 404, 404, 400], got
    assert settled(d) - before == 5


ODD = [
    b"OPTIONS *", b"GET *", b"POST *", b"CONNECT 127.0.0.1:80", b"CONNECT /v1/events",
    b"CONNECT *", b"GET http://x/v1/files", b"GET http://x", b"POST http://x/v1/events",
    b"GET /v1/files%00", b"POST /v1/a%0Ab", b"GET /v1/events%2Fcurrent",
    b"GET /" + b"a" * 60000, b"POST /" + b"a" * 60000, b"GET /\xc3\xa9",
    b"POST /v1/events?" + b"\xc3\xa9" * 20000, b"POST /%zz", b"GET foo", b"GET ?x",
    b"POST //primary/v1/events", b"POST /v1/events#x", b"GET \\v1\\events",
]


def test_odd_targets_are_a_counted_json_4xx_on_every_process(one: Daemon, two: Two) -> None:
    """Each odd target on a single process, on the primary and on the serving process of
    two: the same JSON 4xx on all three, each counted once, nothing logged as an error."""
    def ask(d: Daemon, pid: int | None, target: bytes) -> Answer:
        s = (connect_to(d, pid) if pid is not None
             else socket.create_connection(("127.0.0.1", d.port), timeout=10))
        try:
            s.sendall(target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth_line(d)
                      + b"Content-Type: application/json\r\nContent-Length: 2\r\n"
                      b"Connection: close\r\n\r\n{}")
            [a] = read_answers(s, timeout=5)
            return a
        finally:
            s.close()

    before_one, before_two = settled(one), settled(two.d)
    for target in ODD:
        want = ask(one, None, target)
        assert 400 <= want.status < 500 and want.kind[1] == "application/json", (target, want)
        for pid in (two.primary, two.worker):
            got = ask(two.d, pid, target)
            assert (got.kind, got.json()["error"]) == (want.kind, want.json()["error"]), (
                target[:50], pid == two.worker, got, want)
    assert settled(one) - before_one == len(ODD)
    assert settled(two.d) - before_two == 2 * len(ODD)


def test_no_forward_slot_or_connection_is_left_held(two: Two) -> None:
    """After everything above (stalls, trickles, cuts, early answers), then 20 more stalls
    cut by the primary's watch: the serving process holds no forward slot, and its open
    descriptors come back to what they were."""
    d = two.d
    base = len(fds(two.worker))
    socks = [connect_to(d, two.worker) for _ in range(20)]
    for s in socks:
        s.sendall(head(d, b"Content-Length: 10\r\n\r\n{"))
    for s in socks:
        [a] = read_answers(s, timeout=BODY_TIMEOUT + 5)
        assert a.status == 408, a
        s.close()
    wait_for(lambda: queue_depth(d, "forward") == 0, 10)
    wait_for(lambda: len(fds(two.worker)) <= base + 2, 15)

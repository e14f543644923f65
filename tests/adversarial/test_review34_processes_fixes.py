"""Review 34: the fixes of review 33 to server.processes > 1 (forwarded routes under the
primary's route names, 408/499 on forwarded bodies, the JSON 417, the config the primary
publishes in its run dir for its serving processes, reloads that reach every process).
Real daemons over loopback, many fresh connections so both processes get requests.

`test_break_*` are the breaks found (each fixed: see its comment); the others held."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmroot import checksum as cks
from cmroot.server.auth import new_token
from tests.adversarial.test_review33_processes import (
    answer,
    auth_line,
    exchange,
    listening,
    recycle_body,
    restarted,
)
from tests.server.cmroot_daemon import FAST_TIMEOUTS, Daemon, MakeDaemon, write_files
from tests.server.test_processes import TWO, N, children, started, wait_for

pytestmark = pytest.mark.timeout(120)

MAX_BODY = 1 << 20


# -- helpers ----------------------------------------------------------------------------

def requests_total(d: Daemon, route: str | None = None, code: str | None = None) -> float:
    """cmroot_http_requests_total summed over the samples matching `route` and `code`
    (the scrapes of /metrics itself left out)."""
    total = 0.0
    for line in d.metrics().splitlines():
        m = re.fullmatch(r"cmroot_http_requests_total\{(.*)\} (\S+)", line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("route") == "/metrics":
            continue
        if route is not None and labels.get("route") != route:
            continue
        if code is not None and labels.get("code") != code:
            continue
        total += float(m.group(2))
    return total


def settled(d: Daemon, route: str | None = None) -> float:
    """requests_total once it stopped moving (the primary counts a cut upstream request
    when it notices the cut)."""
    last = requests_total(d, route)
    for _ in range(20):
        time.sleep(0.25)
        now = requests_total(d, route)
        if now == last:
            return now
        last = now
    return last


def run_dir(d: Daemon) -> Path:
    """The primary's run dir, as its serving process was told (--config)."""
    assert d.proc is not None
    [worker] = children(d.proc.pid)
    argv = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
    return Path(os.fsdecode(argv[argv.index(b"--config") + 1])).parent


def write_config_atomically(d: Daemon, lines: list[str]) -> None:
    """d.write_config, but the primary never reads a half-written file."""
    real = d.config_path
    tmp = real.with_suffix(".tmp")
    d.config_path = tmp
    try:
        d.write_config(lines)
    finally:
        d.config_path = real
    os.replace(tmp, real)


def reloads(d: Daemon) -> int:
    return sum(1 for r in d.log_records() if r.get("msg") in ("reloaded", "reload failed; "
                                                                "keeping the current settings"))


def statuses(d: Daemon, method: str, path: str, token: str | None, n: int = N,
             **kw: object) -> Counter[int]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers.update(kw.pop("headers", {}))  # type: ignore[arg-type]
    return Counter(d.request(method, path, headers=headers, scope=None,
                             **kw).status for _ in range(n))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("r34"),
               env={**TWO, **FAST_TIMEOUTS, "CMROOT_SERVER_MAX_BODY": str(MAX_BODY)})
    with d.serving(check_errors=False):
        started(d)
        yield d


# -- breaks -----------------------------------------------------------------------------

# An Expect other than 100-continue is answered by app._expect, which aiohttp runs before
# the middlewares (web_app._handle returns its response as is): app._errors never sees the
# 417, so it is counted by no process (single-process mode alike).
# Fixed: app._expect counts the 417 it makes.
def test_break_a_417_is_counted_once(two: Daemon) -> None:
    before = requests_total(two, "/v1/events", "417")
    for _ in range(N):
        raw = exchange(two, b"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       + auth_line(two, "write") + b"Content-Type: application/json\r\n"
                       b"Expect: 200-ok\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert answer(raw)[0] == 417, raw
    assert requests_total(two, "/v1/events", "417") - before == N


# The JSON 417 is only on the routes of the API table (and a serving process's catch-all):
# on the primary (and in single-process mode) a path it has not, or a method a path does
# not take, keeps aiohttp's default expect handler: a text/plain '417 Unknown Expect'. So
# the same request is a JSON error on a serving process and plain text on the primary.
# Fixed: every app ends with a catch-all route carrying _expect; on the primary its
# handler (app.unknown) answers the 404 or 405 (with Allow).
def test_break_an_odd_expectation_on_an_unknown_route_is_json_everywhere(two: Daemon) -> None:
    kinds: Counter[str] = Counter()
    for path in (b"POST /v1/nothing", b"PUT /v1/events"):
        for _ in range(N // 2):
            raw = exchange(two, path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth_line(two)
                           + b"Content-Type: application/json\r\nExpect: 200-ok\r\n"
                           b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            status, headers, _ = answer(raw)
            kinds[status, headers.get("content-type", "").split(";")[0]] += 1
    assert set(kinds) == {(417, "application/json")}, kinds


# A body that stalls on a forwarded route: the serving process answers 408 itself (and
# counts it: UPSTREAM unset), but it had already opened the request on the primary, which
# sees its upstream connection cut mid-body and counts the same request again (499).
# Fixed: a serving process does not watch the body it passes on; the primary's watch
# cuts the stall, answers the 408 (passed back) and counts it. (Review 35 found the first
# fix, the serving process counting its own 408 and the primary no cut, lost the count
# of a request whose serving process died mid-body.)
def test_break_a_stalled_forwarded_body_is_counted_once(two: Daemon) -> None:
    count = 16
    paths = list(write_files(two.warehouse, {f"db.db/st{i}/f": b"x" for i in range(count)}))
    before = settled(two, "/v1/recycle")
    got: list[int] = []

    def slow(i: int) -> None:
        body = recycle_body(paths[i], f"st{i}")
        head = (b"POST /v1/recycle HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth_line(two, "write")
                + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        got.append(answer(exchange(two, head + body[:10], timeout=30))[0])

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [408] * count
    assert settled(two, "/v1/recycle") - before == count


# A client that hangs up mid-body on a forwarded route: the serving process answers 499
# (request.content.exception(), app.forward) and counts it; the primary, whose upstream
# request is cut, counts a 499 too.
# Fixed: the primary alone counts it (app.forward marks it UPSTREAM).
def test_break_a_client_gone_mid_forwarded_body_is_counted_once(two: Daemon) -> None:
    paths = list(write_files(two.warehouse, {f"db.db/gone{i}/f": b"y" for i in range(N)}))
    before = settled(two, "/v1/recycle")
    for i, p in enumerate(paths):
        body = recycle_body(p, f"gone{i}")
        s = socket.create_connection(("127.0.0.1", two.port), timeout=10)
        s.sendall(b"POST /v1/recycle HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth_line(two, "write")
                  + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (len(body) + 5) + body)
        time.sleep(0.05)
        s.close()
    assert all(os.path.exists(p) for p in paths)
    assert settled(two, "/v1/recycle") - before == N


# The primary's reload (main._reload) sets its own tokens first and publishes the config for
# its serving processes last (Workers.reload -> publish); a publish that fails (the run dir
# cleaned away or full, here config.json.tmp taken) is logged as 'reload failed; keeping
# the current settings', yet the primary runs with the new tokens while the serving
# processes keep the old ones: a revoked token is still honoured on about half the
# connections, the new one refused there.
# Fixed: main._reload publishes to the serving processes before the primary changes
# anything, so a failed publish leaves every process on the old tokens.
def test_break_a_failed_publish_leaves_no_process_on_other_tokens(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon("publish", env=TWO)
    started(d)
    [(path, data)] = write_files(d.warehouse, {"db.db/t/f": b"rotate"}).items()
    url = d.files_url(path, cks.of_bytes(data))
    blocker = run_dir(d) / "config.json.tmp"
    blocker.mkdir()
    try:
        old = d.tokens["read"]
        token, line = new_token("read")
        seen = reloads(d)
        write_config_atomically(d, [*d.token_lines[1:], line.split('"')[1]])
        d.signal(signal.SIGHUP)
        wait_for(lambda: reloads(d) > seen)
        got_old = statuses(d, "GET", url, old)
        got_new = statuses(d, "GET", url, token)
    finally:
        blocker.rmdir()
    # Whichever settings won, every process must run with the same ones.
    assert len(got_old) == 1 and len(got_new) == 1, (got_old, got_new)


# Workers.publish encodes the running config with msgspec.json: a value the config accepts
# but JSON cannot carry (a warehouse root with bytes that are not UTF-8, given through the
# environment; a duration so long it is inf) stops the primary at start (UnicodeEncodeError
# in Workers.__init__) or every serving process at start (null is no float: msgspec
# ValidationError in workers._read, a restart loop of error lines); a single process runs
# with it.
# Fixed: Workers.publish writes the stdlib's JSON (lone surrogates escaped, Infinity),
# workers._read converts it back with msgspec.convert: the same Config, value for value.
@pytest.mark.parametrize("env", [
    {"CMROOT_STORE_RETAIN": "9" * 400 + "w"},
    {"CMROOT_STORE_WAREHOUSE_ROOTS": "WAREHOUSE,/srv/caf\udce9"},
], ids=["inf-retain", "non-utf8-root"])
def test_break_any_config_one_process_runs_with_two_run_with(
    make_daemon: MakeDaemon, env: dict[str, str],
) -> None:
    d = make_daemon("one", start=False)
    env = {k: v.replace("WAREHOUSE", str(d.warehouse)) for k, v in env.items()}
    d.env.update(env)
    d.start()
    assert d.stop() == 0, d.log()
    d.env.update(TWO)
    d.log_path.unlink()
    d.start()  # non-utf8-root: the primary exits 1 here (UnicodeEncodeError)
    wait_for(lambda: any(r.get("msg") == "serving" for r in d.log_records()))
    time.sleep(1.5)  # a serving process that fails to start says so meanwhile
    assert not d.errors(), d.log()  # inf-retain: 'a serving process did not start', again


# -- what held --------------------------------------------------------------------------

def test_refusals_are_counted_exactly_once_whichever_process(two: Daemon) -> None:
    """401, 403, 404, 405, 413, 415 through both processes: each request once, under the
    route and code a single process gives."""
    big = b'{"x": "' + b"a" * (2 * MAX_BODY) + b'"}'
    cases: list[tuple[str, str, bytes | None, dict[str, str], str | None, str, str]] = [
        ("GET", "/v1/events", None, {}, None, "/v1/events", "401"),
        ("HEAD", "/v1/events", None, {}, "read", "/v1/events", "403"),
        ("POST", "/v1/gc", None, {}, "read", "/v1/gc", "403"),
        ("GET", "/v1/files", None, {}, None, "/v1/files", "401"),
        ("GET", "/v1/nothing", None, {}, "admin", "other", "404"),
        ("PUT", "/v1/events", None, {}, "admin", "other", "405"),
        ("OPTIONS", "/v1/holds", None, {}, "admin", "other", "405"),
        ("POST", "/v1/events", b"x", {"Content-Type": "text/plain"}, "write", "/v1/events",
         "415"),
        ("POST", "/v1/events", big, {}, "write", "/v1/events", "413"),
        ("POST", "/v1/resolve", big, {}, "read", "/v1/resolve", "413"),
    ]
    errors = len(two.errors())
    for method, path, raw, headers, scope, route, code in cases:
        before = settled(two)
        got = Counter(two.request(method, path, raw=raw, headers=headers, scope=scope).status
                      for _ in range(N // 2))
        assert got == {int(code): N // 2}, (method, path, got)
        after = settled(two)
        assert after - before == N // 2, (method, path, after - before)
        assert requests_total(two, route, code) >= N // 2
    assert len(two.errors()) == errors, two.log()


def test_expect_before_auth_changes_and_leaks_nothing(two: Daemon) -> None:
    """Expect (100-continue or not) on a forwarded write without a token: 401 or 417,
    nothing recycled, the token never echoed."""
    paths = list(write_files(two.warehouse, {f"db.db/ex{i}/f": b"e" for i in range(N)}))
    before = two.snapshot()
    for i, p in enumerate(paths):
        body = recycle_body(p, f"ex{i}")
        expect = b"100-continue" if i % 2 else b"x-" + two.tokens["write"].encode()
        raw = exchange(two, b"POST /v1/recycle HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Authorization: Bearer nope\r\nContent-Type: application/json\r\n"
                       b"Expect: " + expect + b"\r\nContent-Length: %d\r\n"
                       b"Connection: close\r\n\r\n" % len(body) + body)
        status, _, text = answer(raw)
        assert status == (401 if i % 2 else 417), raw
        assert json.loads(text)["error"]
        assert b"nope" not in text
    assert two.snapshot() == before


def test_head_and_options_on_forwarded_routes_keep_their_scope(two: Daemon) -> None:
    for path, scope, want in (("/v1/events/current", None, 401),
                              ("/v1/events/current", "read", 403),
                              ("/v1/events/current", "admin", 200),
                              ("/v1/holds", "read", 200), ("/v1/entries", None, 401),
                              ("/v1/files?path=/x&checksum=" + "0" * 32, None, 401),
                              ("/metrics", None, 200)):
        got = Counter(two.request("HEAD", path, scope=scope).status for _ in range(N // 4))
        assert got == {want: N // 4}, (path, scope, got)
    got = Counter(two.request("OPTIONS", "/v1/events", scope=None).status
                  for _ in range(N // 4))
    assert set(got) <= {401, 405}, got


def test_sighup_storm_while_serving_processes_restart(make_daemon: MakeDaemon) -> None:
    """Tokens rotated several times, each with a burst of SIGHUPs, while the serving
    process is killed and started again: afterwards every process takes the newest token
    only."""
    d = make_daemon("storm", env=TWO)
    worker = started(d)
    [(path, data)] = write_files(d.warehouse, {"db.db/t/f": b"storm"}).items()
    url = d.files_url(path, cks.of_bytes(data))
    revoked = [d.tokens["read"]]
    token = revoked[0]
    rest = d.token_lines[1:]
    for _ in range(3):
        os.kill(worker, signal.SIGKILL)
        worker = restarted(d, worker)
        for _ in range(2):
            seen = reloads(d)
            token, line = new_token("read")
            write_config_atomically(d, [*rest, line.split('"')[1]])
            for _ in range(5):
                d.signal(signal.SIGHUP)
            wait_for(lambda s=seen: reloads(d) > s)  # type: ignore[misc]
            revoked.append(token)
        revoked.pop()
        wait_for(lambda w=worker: listening(w, d.port))  # type: ignore[misc]
        time.sleep(0.2)  # a SIGHUP sent once it listened is handled
    assert statuses(d, "GET", url, token) == {200: N}
    for old in revoked:
        assert statuses(d, "GET", url, old, n=N // 4) == {401: N // 4}
    assert not [r for r in d.errors() if "serving process" not in r["msg"]], d.log()


def test_a_corrupt_published_config_never_serves_other_settings(
    make_daemon: MakeDaemon,
) -> None:
    """config.json replaced by garbage, then the serving process killed: the new one does
    not start (logged), the primary answers everything meanwhile, rightly."""
    d = make_daemon("corrupt", env=TWO)
    worker = started(d)
    [(path, data)] = write_files(d.outside, {"secret": b"outside"}).items()
    url = d.files_url(path, cks.of_bytes(data))
    (run_dir(d) / "config.json").write_bytes(b'{"store": {"warehouse_roots": ["/"]')
    os.kill(worker, signal.SIGKILL)
    restarted(d, worker)
    got = statuses(d, "GET", url, d.tokens["read"])
    assert got == {403: N}, got
    assert statuses(d, "GET", "/v1/events/current", d.tokens["admin"]) == {200: N}

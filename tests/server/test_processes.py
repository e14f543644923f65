"""server.processes = 2 through the real daemon: a primary and a serving process on one
address (SO_REUSEPORT), every request on a fresh connection so the kernel spreads them
over both. Whatever process a request lands on, the answer is the one a single process
gives: reads verified, writes and their events made once by the primary, refusals 4xx
with nothing changed, metrics summed over the processes. A serving process killed is
started again; the primary killed takes it along; SIGTERM stops both, SIGHUP reloads
both."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cmroot_testlib import object_file

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, MakeDaemon, write_files

# Fresh connections per check: with two processes, the chance that all of them land on
# one is 2**-(N-1).
N = 40
TWO = {"CMROOT_SERVER_PROCESSES": "2"}


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def wait_for(check: Callable[[], bool], timeout: float = 30.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def started(d: Daemon) -> int:
    """Wait until the daemon says it serves (its serving processes listen); their pid."""
    wait_for(lambda: any(r.get("msg") == "serving" for r in d.log_records()))
    assert d.proc is not None
    [worker] = children(d.proc.pid)
    return worker


def counter(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample of `name` with exactly `labels` (0 when absent)."""
    for line in metrics.splitlines():
        m = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    return 0.0


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> object:
    d = Daemon(tmp_path_factory.mktemp("processes"), env=TWO)
    with d.serving(check_errors=False):
        started(d)
        yield d


def _recycled(d: Daemon, name: str, files: dict[str, bytes]) -> list[tuple[str, str, bytes]]:
    paths = write_files(d.warehouse, {f"db.db/{name}/{k}": v for k, v in files.items()})
    r = d.request("POST", "/v1/recycle", {"paths": [str(d.warehouse / "db.db" / name)],
                                          "op": "DROP_TABLE", "db": "db", "table": name},
                  scope="write")
    assert r.status == 200, r
    return [(p, cks.of_bytes(v), v) for p, v in zip(paths, files.values(), strict=True)]


def test_reads_on_every_process_are_verified_and_counted_once(two: Daemon) -> None:
    files = {f"p={i % 3}/f{i}": os.urandom(1000 + 7 * i) for i in range(N)}
    recycled = _recycled(two, "reads", files)
    before = counter(two.metrics(), "cmroot_http_requests_total", code="200", route="/v1/files")
    for p, c, data in recycled:
        r = two.request("GET", two.files_url(p, c), scope="read")
        assert (r.status, r.headers["X-Cmroot-Status"], r.body) == (200, "cmroot", data)
        r = two.request("GET", two.files_url(p, c), headers={"Range": "bytes=3-9"},
                        scope="read")
        assert (r.status, r.body) == (206, data[3:10])
        r = two.request("GET", two.files_url(p, c), scope=None)
        assert r.status == 401
    body = [{"path": p, "checksum": c} for p, c, _ in recycled]
    for _ in range(N // 4):
        r = two.request("POST", "/v1/resolve", {"files": body}, scope="read")
        assert r.status == 200, r
        assert {f["status"] for f in r.json()["files"]} == {"cmroot"}
    # Every GET counted once, whichever process answered it: the serving process's
    # counts are in the primary's /metrics.
    after = counter(two.metrics(), "cmroot_http_requests_total", code="200", route="/v1/files")
    assert after - before == 2 * N - N  # the 206s are counted under their own code
    assert counter(two.metrics(), "cmroot_http_requests_total", code="206",
                   route="/v1/files") >= N
    assert counter(two.metrics(), "cmroot_served_bytes_total") >= sum(len(v) for v in
                                                                         files.values())


def test_writes_through_any_process_are_made_once(two: Daemon) -> None:
    """Recycles, two-phase transactions and events, each on a fresh connection: what
    lands on the serving process is passed to the primary, and made exactly once."""
    first = two.client().current_event()
    paths = write_files(two.warehouse, {f"db.db/w{i}/f": os.urandom(500) for i in range(N)})
    for i, p in enumerate(paths):
        r = two.request("POST", "/v1/recycle", {"paths": [p], "op": "DROP_TABLE", "db": "db",
                                                "table": f"w{i}"}, scope="write")
        assert r.status == 200, r
        assert not os.path.exists(p)
    txs = []
    paths = write_files(two.warehouse, {f"db.db/x{i}/f": os.urandom(500) for i in range(N // 2)})
    for i, p in enumerate(paths):
        r = two.request("POST", "/v1/recycle", {"paths": [p], "op": "INSERT_OVERWRITE",
                                                "db": "db", "table": f"x{i}",
                                                "prepare": True}, scope="write")
        assert r.status == 200, r
        txs.append(r.json()["txid"])
    for i, txid in enumerate(txs):
        action = "commit" if i % 2 else "abort"
        r = two.request("POST", f"/v1/transactions/{txid}/{action}", scope="write")
        assert r.status == 200, r
    for i, p in enumerate(paths):
        assert os.path.exists(p) == (i % 2 == 0)  # aborted ones are back
    events = two.client().events(first + 1, 1000)
    ids = [e["id"] for e in events]
    assert ids == list(range(first + 1, first + 1 + N + N // 4))  # gapless, one per write
    assert [e["eventType"] for e in events] == ["DROP_TABLE"] * N + ["INSERT_OVERWRITE"] * (
        N // 4)


def test_refusals_through_any_process_are_4xx_and_change_nothing(two: Daemon) -> None:
    before = two.snapshot()
    asks: list[tuple[str, str, bytes | None, dict[str, str], str | None]] = [
        ("POST", "/v1/recycle", b"{not json", {"Content-Type": "application/json"}, "write"),
        ("POST", "/v1/recycle", b"x", {"Content-Type": "text/plain"}, "write"),
        ("POST", "/v1/recycle", b'{"paths": ["/etc/passwd"], "op": "DROP_TABLE"}',
         {"Content-Type": "application/json"}, "write"),
        ("POST", "/v1/recycle", b'{"paths": ["x"], "op": "DROP_TABLE"}',
         {"Content-Type": "application/json"}, "read"),
        ("POST", "/v1/recycle", b"{}", {"Content-Type": "application/json",
                                         "Authorization": "Bearer \xff"}, None),
        ("POST", "/v1/recycle", b"[" + b"1," * (40 << 20) + b"1]",
         {"Content-Type": "application/json"}, "write"),
        ("POST", "/v1/gc", None, {}, "read"),
        ("GET", "/v1/events?from=x", None, {}, "admin"),
        ("DELETE", "/v1/holds/%ff", None, {}, "admin"),
        ("GET", "/v1/nothing/here", None, {}, "admin"),
        ("PUT", "/v1/files", None, {}, "admin"),
        ("GET", "/v1/files?path=relative&checksum=" + "0" * 32, None, {}, "read"),
        ("POST", "/v1/resolve", b'{"files": [{"path": "/x"}]}',
         {"Content-Type": "application/json"}, "read"),
    ]
    for method, path, raw, headers, scope in asks:
        for _ in range(4):
            r = two.request(method, path, raw=raw, headers=headers, scope=scope)
            assert 400 <= r.status < 500, (method, path, r)
            assert r.json()["error"], r
    assert two.snapshot() == before
    assert not two.errors(), two.log()


def test_probes_answer_on_every_process(two: Daemon) -> None:
    for _ in range(N // 2):
        assert two.request("GET", "/healthz", scope=None).json() == {"status": "ok"}
        assert two.request("GET", "/readyz", scope=None).json() == {"status": "ready"}
        text = two.metrics()
        assert "cmroot_store_objects " in text and "process_resident_memory_bytes" in text
        # One sample per series: the processes' values are summed, never listed apart.
        samples = [line.rsplit(" ", 1)[0] for line in text.splitlines()
                   if line and not line.startswith("#")]
        assert len(samples) == len(set(samples))


def test_a_killed_serving_process_is_started_again(make_daemon: MakeDaemon) -> None:
    d = make_daemon("killed", env=TWO)
    worker = started(d)
    [(p, c, data)] = _recycled(d, "t", {"f": os.urandom(3000)})
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: children(d.proc.pid) not in ([], [worker]))  # type: ignore[union-attr]
    for _ in range(N):  # the new one listens (the primary answers meanwhile)
        r = d.request("GET", d.files_url(p, c), scope="read")
        assert (r.status, r.body) == (200, data)
    assert any(r["msg"] == "a serving process exited: starting another"
               for r in d.errors()), d.log()
    assert d.stop() == 0, d.log()


def test_a_wedged_serving_process_is_killed_and_replaced(make_daemon: MakeDaemon) -> None:
    """A serving process whose event loop stops (here SIGSTOP) is given connections it
    never answers: after server.process_timeout of silence the primary kills it and
    starts another, and every request is answered again."""
    d = make_daemon("wedged", env={**TWO, "CMROOT_SERVER_PROCESS_TIMEOUT": "2s"})
    worker = started(d)
    [(p, c, data)] = _recycled(d, "t", {"f": os.urandom(3000)})
    os.kill(worker, signal.SIGSTOP)
    wait_for(lambda: not alive(worker), 15)
    for _ in range(N):  # the primary answers until the new one listens
        r = d.request("GET", d.files_url(p, c), scope="read", timeout=10)
        assert (r.status, r.body) == (200, data)
    wait_for(lambda: children(d.proc.pid) not in ([], [worker]))  # type: ignore[union-attr]
    assert [r["msg"] for r in d.errors()][:1] == [
        "a serving process stopped answering: killed"], d.log()
    assert d.stop() == 0, d.log()


def test_the_run_dir_of_a_killed_primary_is_removed_by_the_next(
    make_daemon: MakeDaemon, tmp_path: Path, runtime_dir: Path,
) -> None:
    """kill -9 leaves the primary's run dir (socket, metrics files, config.json) behind:
    the next primary to start removes it, and leaves alone the one of a primary that
    runs."""
    runtime = runtime_dir
    env = {**TWO, "RUNTIME_DIRECTORY": str(runtime)}
    a = make_daemon("a", env=env)
    started(a)
    [kept] = runtime.iterdir()
    b = make_daemon("b", env=env)
    started(b)
    b.kill()
    wait_for(lambda: len(list(runtime.iterdir())) == 2)
    [left] = set(runtime.iterdir()) - {kept}
    c = make_daemon("c", env=env)
    started(c)
    assert not left.exists()
    assert kept.exists() and len(list(runtime.iterdir())) == 2
    assert c.stop() == 0 and a.stop() == 0
    assert list(runtime.iterdir()) == []


def test_sigterm_stops_every_process_and_kill_9_of_the_primary_takes_them(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon("stop", env=TWO)
    worker = started(d)
    assert d.stop() == 0, d.log()
    assert not alive(worker)
    d.log_path.unlink()
    d.start()
    worker = started(d)
    d.kill()
    wait_for(lambda: not alive(worker), 10)
    with pytest.raises(OSError):  # nothing listens on the address any more
        d.request("GET", "/healthz", scope=None, timeout=2)
    d.start()  # and a new daemon takes it
    assert d.request("GET", "/readyz", scope=None).status == 200
    assert not [r for r in d.errors() if "serving process" not in r["msg"]], d.log()


def test_sighup_reloads_the_tokens_of_every_process(make_daemon: MakeDaemon) -> None:
    d = make_daemon("hup", env=TWO)
    started(d)
    [(p, c, data)] = _recycled(d, "t", {"f": os.urandom(3000)})
    old = dict(d.tokens)
    from cmroot.server.auth import new_token

    token, line = new_token("read")
    d.write_config([*d.token_lines[1:], line.split('"')[1]])  # the old read token goes
    d.signal(signal.SIGHUP)

    def reloaded() -> bool:
        return all(
            d.request("GET", d.files_url(p, c), headers={"Authorization": f"Bearer {token}"},
                      scope=None).status == 200
            for _ in range(N // 4)
        )

    wait_for(reloaded)
    for _ in range(N):
        r = d.request("GET", d.files_url(p, c), headers={"Authorization": f"Bearer {token}"},
                      scope=None)
        assert (r.status, r.body) == (200, data)
        r = d.request("GET", d.files_url(p, c),
                      headers={"Authorization": f"Bearer {old['read']}"}, scope=None)
        assert r.status == 401
    assert d.stop() == 0, d.log()
    assert not d.errors(), d.log()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_signal_while_the_serving_processes_start_is_no_death(
    make_daemon: MakeDaemon, sig: signal.Signals
) -> None:
    """The serving process is held (SIGSTOP) before it says it listens, and the primary,
    already answering, gets the signal then: SIGHUP reloads once all has started,
    SIGTERM stops it cleanly; neither kills it with the signal's default action."""
    d = make_daemon("sig", start=False, env=TWO)
    for _ in range(20):  # until the serving process is caught before it said so
        d.start()
        assert d.proc is not None
        wait_for(lambda: len(children(d.proc.pid)) == 1)  # type: ignore[union-attr]
        [worker] = children(d.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        if not any(r.get("msg") == "serving" for r in d.log_records()):
            break
        os.kill(worker, signal.SIGCONT)
        assert d.stop() == 0, d.log()
        d.log_path.unlink()
    else:
        pytest.skip("the serving process always said it listens before it could be held")
    d.signal(sig)
    time.sleep(0.3)  # the signal is handled (or would have killed) meanwhile
    assert d.proc.poll() is None, d.log()
    os.kill(worker, signal.SIGCONT)
    if sig == signal.SIGHUP:
        wait_for(lambda: any(r.get("msg") == "reloaded" for r in d.log_records()))
        assert d.request("GET", "/readyz", scope=None).status == 200
        assert d.stop() == 0, d.log()
    else:
        assert d.proc.wait(30) == 0, d.log()
    assert not alive(worker)
    assert not d.errors(), d.log()


def test_a_corrupt_object_met_by_a_serving_process_is_quarantined_by_the_primary(
    two: Daemon,
) -> None:
    """A serving process (read-only) that finds an object corrupt passes the GET to the
    primary, which quarantines the object and answers: the object is out of `objects/`
    after the first GET, whichever process met it, the mismatch is counted once and the
    request once (before, every GET a serving process took hashed it again and logged it
    again, and it stayed until the primary happened to meet it)."""
    from tests.adversarial.test_review36_counting import connect_to, read_answers

    [(p, c, data)] = _recycled(two, "corrupt_on_serving", {"f": os.urandom(5000)})
    obj = object_file(two.store, c)
    os.chmod(obj, 0o644)
    with open(obj, "r+b") as f:
        f.write(b"X" * 16)  # same size, other bytes
    worker = started(two)
    metrics = two.metrics()
    mismatches = counter(metrics, "cmroot_checksum_mismatches_total")
    not_found = counter(metrics, "cmroot_http_requests_total", code="404", route="/v1/files")
    s = connect_to(two, worker)
    try:
        url = two.files_url(p, c)
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
                  + b"".join(f"{k}: {v}\r\n".encode() for k, v in two.auth("read").items())
                  + b"\r\n")
        [a] = read_answers(s, timeout=20)
    finally:
        s.close()
    assert a.status == 404 and b"quarantined" in a.body and b"X" * 16 not in a.body, a
    assert not obj.exists() and any(q.name.startswith(c) for q in (two.store / "quarantine")
                                    .iterdir())
    metrics = two.metrics()
    assert counter(metrics, "cmroot_checksum_mismatches_total") - mismatches == 1
    assert counter(metrics, "cmroot_http_requests_total", code="404",
                   route="/v1/files") - not_found == 1
    r = two.request("GET", two.files_url(p, c), scope="read")
    assert r.status == 404 and r.body != data, r

"""Review 40: commits ae7a354 (the private socket's backlog, "nothing was done" for a
connect that never completed), d068f54 (a corrupt object met by a serving process is
passed to the primary, which quarantines it, counts the mismatch and answers) and afb71d4
(Warehouse.locate's root prefixes made once, ident_str as an f-string).

Attacked, on real two-process daemons (each connection placed on a chosen process,
review 36's connect_to):
- corrupt objects met by the serving process: dozens of concurrent GETs of one large
  corrupt object over both processes (quarantined once? mismatch counted once? request
  counted once? ever served?), a HEAD, a Range request, If-None-Match, a GET with a body,
  a corrupt object whose original is still at its path with the right bytes (served from
  the original), the primary SIGSTOPped while a corrupt GET is passed on, a forward loop
  (the primary never passes it back), an object corrupted while a serving process sends it;
- counting of a corrupt GET passed on: cmroot_http_requests_total and the request
  duration histogram (the same request timed by both processes);
- the private socket's backlog (FORWARD.admitted per serving process) against the
  forwards a serving process may hold at once now that corrupt GETs are passed on from
  the `serve` class as well: a burst while the primary is stopped for a second;
- confinement (afb71d4): roots that are prefixes of each other (/wh, /wh2), the root "/",
  nested roots, trailing slashes, symlinked roots, `..`, symlink escapes to a sibling
  whose name starts with the root's, compared in-process with the previous rule
  (warehouse._under) over thousands of paths, and through the serving process;
  ident_str against the previous join;
- bad input to the serving process's /v1/files (4xx JSON, never a 5xx).

`test_break_*` are the breaks found (each failed on the code reviewed; the comment above
it says what broke, where, how badly, and a fix; all three are fixed since, see FIXED);
the others are attacks that held."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from cmroot_testlib import object_file

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError, OutsideRoots
from cmroot.store import warehouse as wh_mod
from cmroot.store.source.local import ident_of, ident_str
from cmroot.store.warehouse import Warehouse
from tests.adversarial.test_review33_processes import auth_line
from tests.adversarial.test_review34_processes_fixes import requests_total, settled
from tests.adversarial.test_review36_counting import Answer, Two, connect_to, read_answers
from tests.server.cmroot_daemon import Daemon
from tests.server.test_processes import TWO, counter, started
from tests.server.test_processes import _recycled as recycled

pytestmark = pytest.mark.timeout(180)

ENV = {"CMROOT_SERVER_KEEPALIVE_TIMEOUT": "120s"}


# -- helpers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Two]:
    d = Daemon(tmp_path_factory.mktemp("r40two"), env={**TWO, **ENV})
    with d.serving(check_errors=False):
        yield Two(d, started(d))


def obj_path(d: Daemon, c: str) -> Path:
    return object_file(d.store, c)


def corrupt(d: Daemon, c: str, at: int = 0) -> None:
    """Other bytes in place, same size (a writer that kept a descriptor of the inode)."""
    obj = obj_path(d, c)
    os.chmod(obj, 0o644)
    with open(obj, "r+b") as f:
        f.seek(at)
        f.write(b"X" * 16)


def quarantined(d: Daemon, c: str) -> list[Path]:
    q = d.store / "quarantine"
    return [p for p in q.iterdir() if p.name.startswith(c)] if q.exists() else []


def mismatches(d: Daemon) -> float:
    return counter(d.metrics(), "cmroot_checksum_mismatches_total")


def durations(d: Daemon, route: str) -> float:
    return counter(d.metrics(), "cmroot_http_request_duration_seconds_count", route=route)


def get_bytes(d: Daemon, url: str, method: str = "GET", extra: str = "",
              scope: str = "read") -> bytes:
    return (f"{method} {url} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
            + auth_line(d, scope) + extra.encode() + b"\r\n")


def ask(d: Daemon, pid: int, data: bytes, timeout: float = 30.0) -> Answer | None:
    s = connect_to(d, pid)
    try:
        s.sendall(data)
        got = read_answers(s, timeout=timeout)
    finally:
        s.close()
    return got[0] if got else None


def read_head(s: socket.socket, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """The head of one answer (a HEAD's: no body follows whatever Content-Length says),
    and whatever came after it within a short moment."""
    s.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (ln.partition(":") for ln in lines[1:])}
    s.settimeout(0.5)
    try:
        while chunk := s.recv(65536):
            rest += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return status, headers, rest


# -- breaks -----------------------------------------------------------------------------

# BREAK (invariant e: the mismatch counted once). Dozens of GETs of one large corrupt
# object at once, over both processes: the serving process passes each of its own to the
# primary (app.files -> forward), and the primary's serve threads each open the object,
# hash it and find it corrupt before the first of them has moved it: Reader._mismatch
# calls on_mismatch (cmroot_checksum_mismatches_total) and logs an error-level
# "checksum mismatch" for every one of them, while Reader._quarantine moves it only once
# (the others find it gone and return None). One corrupt object is counted (and alerted
# on, logged) as many corruptions. The commit made this the normal course of events: each
# GET a serving process took of it now lands on the primary as well, in a wave, since
# every one was hashed on the serving process first. (The race itself is the primary's:
# a single-process daemon taking dozens of such GETs at once has it too.)
# Where: cmroot/store/read.py Reader._mismatch (and _remote_object), counting before
# knowing whether this call is the one that quarantines.
# Severity: low/medium (metrics and alerting inflated, error log flooded; no bytes served).
# Fix: count and log at error only when _quarantine actually moved the inode (where is
# not None); a call that lost the race (the object already moved) reports nothing new;
# or serialise the checks of one checksum (a per-checksum lock around _object).
# FIXED: only the reader that moves the object to quarantine counts and logs the
# mismatch (Reader._report); the others log it at info.
def test_break_concurrent_gets_of_a_corrupt_object_count_the_mismatch_once(two: Two) -> None:
    d = two.d
    [(p, c, data)] = recycled(d, "concurrent", {"f": os.urandom(48 << 20)})
    corrupt(d, c, at=40 << 20)
    assert d.proc is not None
    # Half on the serving process (each hashed there, found corrupt, passed on), half on
    # the primary: the primary's serve threads race for it.
    placed = [connect_to(d, two.worker) for _ in range(20)]
    placed += [connect_to(d, d.proc.pid) for _ in range(20)]
    before_m, before_r = mismatches(d), requests_total(d, "/v1/files")
    errors_before = len([r for r in d.errors() if "mismatch" in str(r.get("msg"))])
    req = get_bytes(d, d.files_url(p, c))
    got: list[Answer] = []
    lock = threading.Lock()

    def one(s: socket.socket) -> None:
        a = read_answers(s, timeout=60)
        with lock:
            got.extend(a)

    try:
        for s in placed:
            s.sendall(req)
        threads = [threading.Thread(target=one, args=(s,)) for s in placed]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        for s in placed:
            s.close()
    assert Counter(a.status for a in got) == {404: 40}, Counter((a.status, a.body[:100])
                                                                 for a in got)
    assert not any(data[:100] in a.body or b"XXXX" in a.body for a in got)
    assert not obj_path(d, c).exists() and len(quarantined(d, c)) == 1
    assert settled(d, "/v1/files") - before_r == 40
    logged = len([r for r in d.errors() if "mismatch" in str(r.get("msg"))]) - errors_before
    assert (mismatches(d) - before_m, logged) == (1, 1)


# BREAK (invariant b: every request counted once, whichever process answers). A corrupt GET
# that a serving process passes on is timed twice: app._errors on the serving process
# runs it under request_duration.time() and in_flight.track_inprogress() (the branch for
# requests it answers itself: `files` is not the forwarder, passes_on() is False) and the
# primary, which answers it, times it again. Only cmroot_http_requests_total is guarded by
# request[UPSTREAM]; cmroot_http_request_duration_seconds_count{route="/v1/files"} (and its
# _sum, and every bucket) go up by 2 for one request, and cmroot_http_requests_in_flight
# counts it twice while it runs. For passes_on() requests the serving process rightly times
# nothing: this path forgot to.
# Where: cmroot/server/app.py _errors (the non-passes_on branch) with files -> forward.
# Severity: low (latency histograms and the in-flight gauge disagree with the request count;
# an SLO on duration_count vs requests_total is off).
# Fix: in _errors, when request[UPSTREAM] is set after the handler, undo the observation
# (time by hand: observe only when not UPSTREAM; track in-flight with a manual inc/dec and
# dec early when forwarding), or have `files` hand the request to the forwarder route's
# path so that the passes_on branch applies.
# FIXED: _errors observes the duration only when the request was not passed on.
def test_break_a_corrupt_get_passed_on_is_timed_once(two: Two) -> None:
    d = two.d
    [(p, c, _), (p2, c2, data2)] = recycled(d, "timed", {"f": os.urandom(5000),
                                                            "g": os.urandom(5000)})
    # Control: a good GET on each process is timed once and counted once.
    assert d.proc is not None
    for pid in (two.worker, d.proc.pid):
        t0, r0 = durations(d, "/v1/files"), requests_total(d, "/v1/files")
        a = ask(d, pid, get_bytes(d, d.files_url(p2, c2)))
        assert a is not None and a.status == 200 and a.body == data2
        assert (durations(d, "/v1/files") - t0, settled(d, "/v1/files") - r0) == (1, 1)
    corrupt(d, c)
    t0, r0 = durations(d, "/v1/files"), requests_total(d, "/v1/files")
    a = ask(d, two.worker, get_bytes(d, d.files_url(p, c)))
    assert a is not None and a.status == 404 and b"quarantined" in a.body, a
    assert settled(d, "/v1/files") - r0 == 1
    assert durations(d, "/v1/files") - t0 == 1


# BREAK (the commit's own claim, ae7a354: "the private socket's listen backlog holds every
# request the serving processes may pass on at once"; invariant c's neighbour: a client
# the serving process admitted is refused 503 though the primary was merely busy).
# The backlog is FORWARD.admitted (256) per serving process, but since d068f54 a serving
# process also passes on corrupt GETs from its `serve` class (admitted=256), outside the
# FORWARD admission: it may hold up to 512 requests for the primary at once. A burst of
# 200 forwarded requests and 100 GETs of a corrupt object while the primary accepts
# nothing for a second (a GC pause, a busy loop: here SIGSTOP) overflows the private
# socket's backlog: the connects past it fail (ENOTCONN) and their clients get 503
# "too many connections at once" instead of their answer (all would be 404).
# Where: cmroot/server/main.py _run (backlog = FORWARD.admitted * (processes - 1)) with
# cmroot/server/app.py files (forward outside the forward class's admission).
# Severity: low/medium (spurious 503s with Retry-After under load; nothing is done twice).
# Fix: count the serve class in the backlog (FORWARD.admitted + LIMITS["serve"].admitted
# per serving process), or take a FORWARD place (forwarding.admit()) before passing a
# corrupt GET on, answering 503 "nothing was done" only when none is left.
# FIXED: the backlog is (FORWARD.admitted + LIMITS['serve'].admitted) per serving process.
def test_break_a_burst_of_forwards_and_corrupt_gets_fits_the_backlog(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "burst", env={**TWO, **ENV})
    with d.serving(check_errors=False):
        worker = started(d)
        assert d.proc is not None
        [(p, c, _)] = recycled(d, "burst", {"f": os.urandom(5000)})
        corrupt(d, c)
        plain = [connect_to(d, worker) for _ in range(200)]
        bad = [connect_to(d, worker) for _ in range(100)]
        other = (b"GET /v1/nothing-here HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 + auth_line(d) + b"\r\n")
        get = get_bytes(d, d.files_url(p, c))
        try:
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                for s in plain:
                    s.sendall(other)
                for s in bad:
                    s.sendall(get)
                time.sleep(1.5)
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            got = [a for s in plain + bad for a in read_answers(s, timeout=30)]
        finally:
            for s in plain + bad:
                s.close()
        assert len(got) == 300
        assert Counter(a.status for a in got) == {404: 300}, Counter(
            (a.status, a.body[:100]) for a in got)


# -- what held: corrupt objects met by a serving process ----------------------------------

def test_a_corrupt_object_is_never_served_by_head_range_or_etag(two: Two) -> None:
    """HEAD, a Range, If-None-Match and If-Range on the serving process for one corrupt
    object each: never a 200/206/304, never its bytes; quarantined once by the primary on
    the first; the mismatch counted once; every request once."""
    d = two.d
    [(p, c, data)] = recycled(d, "head", {"f": os.urandom(3 << 20)})
    corrupt(d, c, at=1 << 20)
    m0, r0 = mismatches(d), requests_total(d, "/v1/files")
    s = connect_to(d, two.worker)
    try:
        s.sendall(get_bytes(d, d.files_url(p, c), method="HEAD"))
        status, headers, rest = read_head(s)
    finally:
        s.close()
    assert status == 404 and rest == b"", (status, headers, rest)
    assert headers.get("content-type", "").startswith("application/json")
    assert not obj_path(d, c).exists() and len(quarantined(d, c)) == 1
    for extra in ("Range: bytes=0-99\r\n", f'If-None-Match: "{c}"\r\n',
                  f'Range: bytes=-10\r\nIf-Range: "{c}"\r\n'):
        a = ask(d, two.worker, get_bytes(d, d.files_url(p, c), extra=extra))
        assert a is not None and a.status == 404, (extra, a)
        assert data[:99] not in a.body and b"X" * 16 not in a.body
    assert mismatches(d) - m0 == 1
    assert settled(d, "/v1/files") - r0 == 4


def test_a_range_of_a_corrupt_object_first_met_by_a_range(two: Two) -> None:
    """The first request to meet it is a Range on the serving process: passed on with its
    Range header, the primary quarantines and answers 404 (never a 206 of other bytes)."""
    d = two.d
    [(p, c, _)] = recycled(d, "range", {"f": os.urandom(200_000)})
    corrupt(d, c, at=100)
    a = ask(d, two.worker, get_bytes(d, d.files_url(p, c), extra="Range: bytes=90-130\r\n"))
    assert a is not None and a.status == 404 and b"quarantined" in a.body, a
    assert len(quarantined(d, c)) == 1


def test_a_corrupt_object_with_its_original_back_serves_the_original(two: Two) -> None:
    """The object is corrupt but the original is back at its path with the right bytes:
    the serving process serves the original (verified) and leaves the object alone; the
    primary then does the same. No mismatch is counted, nothing is passed on."""
    d = two.d
    [(p, c, data)] = recycled(d, "original", {"f": os.urandom(2 << 20)})
    corrupt(d, c)
    Path(p).parent.mkdir(parents=True, exist_ok=True)
    Path(p).write_bytes(data)
    m0 = mismatches(d)
    assert d.proc is not None
    for pid in (two.worker, d.proc.pid, two.worker):
        a = ask(d, pid, get_bytes(d, d.files_url(p, c)))
        assert a is not None and a.status == 200 and a.body == data, a
        assert a.headers["x-cmroot-status"] == "original"
    assert mismatches(d) == m0 and obj_path(d, c).exists() and not quarantined(d, c)


def test_a_corrupt_get_passed_on_while_the_primary_is_stopped(two: Two) -> None:
    """The primary stopped (SIGSTOP) while the serving process passes a corrupt GET on:
    the client waits, and once the primary runs again it gets the primary's 404; the
    object quarantined once, the request and the mismatch counted once."""
    d = two.d
    assert d.proc is not None
    [(p, c, _)] = recycled(d, "stopped", {"f": os.urandom(300_000)})
    corrupt(d, c)
    m0, r0 = mismatches(d), requests_total(d, "/v1/files")
    s = connect_to(d, two.worker)
    try:
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            s.sendall(get_bytes(d, d.files_url(p, c)))
            time.sleep(2)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        [a] = read_answers(s, timeout=30)
    finally:
        s.close()
    assert a.status == 404 and b"quarantined" in a.body, a
    assert len(quarantined(d, c)) == 1 and not obj_path(d, c).exists()
    assert mismatches(d) - m0 == 1 and settled(d, "/v1/files") - r0 == 1


def test_the_primary_never_passes_a_corrupt_get_back(two: Two) -> None:
    """A forward loop: the primary meets the corrupt object itself (a read-write store: it
    quarantines, never LeftCorrupt), and answers at once; a GET the serving process passes
    on is answered by the primary, not bounced."""
    d = two.d
    assert d.proc is not None
    [(p, c, _), (p2, c2, _)] = recycled(d, "loop", {"f": os.urandom(70_000),
                                                    "g": os.urandom(70_000)})
    corrupt(d, c)
    corrupt(d, c2)
    a = ask(d, d.proc.pid, get_bytes(d, d.files_url(p, c)), timeout=10)
    assert a is not None and a.status == 404 and a.at < 5, a
    a = ask(d, two.worker, get_bytes(d, d.files_url(p2, c2)), timeout=10)
    assert a is not None and a.status == 404 and a.at < 5, a
    assert len(quarantined(d, c)) == len(quarantined(d, c2)) == 1


def test_a_corrupt_get_with_a_body_is_answered_once(two: Two) -> None:
    """A GET of a corrupt object that carries a body (whole, or one that never comes):
    the serving process passes the body on as it comes; the client gets one JSON answer
    (404, or the stall's 408), never a hang nor a 5xx, and the request is counted once."""
    d = two.d
    [(p, c, _), (p2, c2, _)] = recycled(d, "withbody", {"f": os.urandom(9000),
                                                        "g": os.urandom(9000)})
    corrupt(d, c)
    corrupt(d, c2)
    r0 = requests_total(d, "/v1/files")
    a = ask(d, two.worker, get_bytes(d, d.files_url(p, c), extra="Content-Length: 5\r\n")
            + b"hello")
    assert a is not None and a.status == 404, a
    s = connect_to(d, two.worker)
    try:
        s.sendall(get_bytes(d, d.files_url(p2, c2), extra="Content-Length: 100\r\n") + b"x")
        got = read_answers(s, timeout=60)
    finally:
        s.close()
    assert len(got) == 1 and got[0].status in (404, 408), got
    assert got[0].kind[1] == "application/json", got
    assert settled(d, "/v1/files") - r0 == 2


def test_an_object_corrupted_while_the_serving_process_sends_it(two: Two) -> None:
    """Verified, then written to while sendfile'd to a slow client: the answer is cut
    short (never completed with other bytes); the next GET on the serving process meets
    the corruption and is passed on: 404, quarantined once."""
    d = two.d
    size = 64 << 20
    [(p, c, _)] = recycled(d, "midway", {"f": os.urandom(size)})
    s = connect_to(d, two.worker)
    try:
        s.sendall(get_bytes(d, d.files_url(p, c)))
        s.settimeout(30)
        buf = s.recv(4096)
        while b"\r\n\r\n" not in buf:
            buf += s.recv(4096)
        assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
        corrupt(d, c, at=size - 100)  # within the held-back tail
        body = buf.partition(b"\r\n\r\n")[2]
        while True:
            try:
                chunk = s.recv(1 << 20)
            except (ConnectionResetError, TimeoutError):  # cut: aborted, or held

                break
            if not chunk:
                break
            body += chunk
    finally:
        s.close()
    assert len(body) < size and b"X" * 16 not in body
    a = ask(d, two.worker, get_bytes(d, d.files_url(p, c)))
    assert a is not None and a.status == 404, a
    assert len(quarantined(d, c)) == 1


@pytest.mark.parametrize("query", [
    "checksum=zz&path={p}",
    "checksum={c}&path=relative/x",
    "checksum={c}&path={p}%00x",
    "checksum={c}&path={wh}/db.db/../../outside/x",
    "checksum={c}",
    "path={p}",
    "checksum={c}&path={p}&path={p}",
    "checksum={c}&path=" + "a" * 5000,
    "checksum={c}&path=%ED%A0%80",
    "checksum={c}&path=file://[x",
])
def test_bad_input_to_the_serving_process_is_a_json_4xx(two: Two, query: str) -> None:
    d = two.d
    c = "0" * 32
    q = query.format(p=d.warehouse / "db.db" / "x", c=c, wh=d.warehouse)
    a = ask(d, two.worker, get_bytes(d, "/v1/files?" + q))
    assert a is not None and 400 <= a.status < 500, a
    assert a.kind[1] == "application/json", a


# -- what held: confinement (afb71d4) ----------------------------------------------------

def _old_inside(w: Warehouse, real: str) -> bool:
    return any(r.local and wh_mod._under(real, r.real) for r in w.roots)


def _old_root(w: Warehouse, key: str) -> object:
    for root in w.roots:
        if root.local and wh_mod._under(key, root.url):
            return root
    return None


def test_prefixes_match_the_previous_rule(tmp_path: Path) -> None:
    """Warehouse._inside and _local_root against the rule they replaced (_under over every
    root), for roots that are prefixes of each other, nested, trailing-slashed, symlinked,
    and "/", over thousands of paths."""
    base = tmp_path / "b"
    for n in ("wh", "wh2", "wh/t/inner", "data/real", "w h", "whx"):
        (base / n).mkdir(parents=True, exist_ok=True)
    (base / "link").symlink_to(base / "data" / "real")
    b = str(base)
    configs = [
        [f"{b}/wh", f"{b}/wh2"],
        [f"{b}/wh2", f"{b}/wh"],
        [f"{b}/wh/", f"{b}/whx/"],
        [f"{b}/wh", f"{b}/wh/t/inner"],
        [f"{b}/link"],
        [f"file://{b}/wh", f"{b}/w h"],
        ["/"],
        [f"{b}/wh//", f"{b}/wh2"],
    ]
    rng = random.Random(40)
    parts = ["wh", "wh2", "whx", "w h", "t", "inner", "data", "real", "link", "", "x", ".",
             "wh.", "wh-", "WH"]
    for roots in configs:
        w = Warehouse(roots)
        samples = [b, "/", f"{b}/wh", f"{b}/wh2", f"{b}/wh2/x", f"{b}/whx/y", f"{b}/wh/"]
        for _ in range(3000):
            samples.append(b + "/" + "/".join(rng.choice(parts) for _ in range(rng.randint(0, 4))))
        for s in samples:
            assert w._inside(s) == _old_inside(w, s), (roots, s)
            try:
                got = w._local_root(s, s)
            except OutsideRoots:
                got = None
            assert got == _old_root(w, s), (roots, s)


def test_ident_str_matches_the_previous_join(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    for ident in (ident_of(os.stat(f)), (0, 0, 0, 0, 0), (2**63, 1, 2**40, -5, 10**19)):
        assert ident_str(ident) == "local:" + ":".join(str(x) for x in ident)


@pytest.fixture(scope="module")
def prefixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    """A two-process daemon whose warehouse has a sibling whose name starts with the
    root's (warehouse2, not a root) holding a secret, and a nested root inside it."""
    base = tmp_path_factory.mktemp("r40prefix")
    d = Daemon(base, env={**TWO, **ENV})
    sib = base / "warehouse2"
    sib.mkdir()
    (sib / "secret").write_bytes(b"top secret bytes")
    (d.warehouse / "nested").mkdir()
    d.config_path.write_text(d.config_path.read_text().replace(
        f'warehouse_roots = ["{d.warehouse}"]',
        f'warehouse_roots = ["{d.warehouse}/", "{d.warehouse}/nested"]'))
    assert "nested" in d.config_path.read_text()
    with d.serving(check_errors=False):
        yield d, started(d)


def test_a_sibling_whose_name_starts_with_the_roots_is_outside(
    prefixed: tuple[Daemon, int],
) -> None:
    """Through both processes: /…/warehouse2/secret named directly, through a symlink
    in the warehouse, through a symlink in the nested root, through a symlinked
    directory, and with `..`: never its bytes, always a JSON 4xx."""
    d, worker = prefixed
    assert d.proc is not None
    secret = d.base / "warehouse2" / "secret"
    c = cks.of_bytes(secret.read_bytes())
    t = d.warehouse / "t"
    t.mkdir(exist_ok=True)
    links = {
        "direct": str(secret),
        "file": str(t / "l1"),
        "nested": str(d.warehouse / "nested" / "l2"),
        "dir": str(t / "ld" / "secret"),
        "dotdot": f"{d.warehouse}/../warehouse2/secret",
    }
    (t / "l1").symlink_to(secret)
    (d.warehouse / "nested" / "l2").symlink_to(secret)
    (t / "ld").symlink_to(d.base / "warehouse2")
    for name, path in links.items():
        for pid in (worker, d.proc.pid):
            a = ask(d, pid, get_bytes(d, d.files_url(path, c)))
            assert a is not None and 400 <= a.status < 500, (name, a)
            assert b"top secret" not in a.body and a.kind[1] == "application/json", (name, a)
        r = d.request("POST", "/v1/resolve", {"files": [{"path": path, "checksum": c}]},
                      scope="read")
        assert b"top secret" not in r.body
        assert r.status in (200, 400, 403, 404), (name, r)
        if r.status == 200:
            assert r.json()["files"][0]["status"] not in ("original", "cmroot"), (name, r)


def test_a_symlink_swapped_between_requests_is_refused(prefixed: tuple[Daemon, int]) -> None:
    """A path that was a plain file (served, so its parent is in the one-second realpath
    cache) whose parent directory is then swapped for a symlink to the sibling: the next
    GETs, at once and after the cache's second, never serve the sibling's bytes."""
    d, worker = prefixed
    assert d.proc is not None
    sib = d.base / "warehouse2" / "dir"
    sib.mkdir(exist_ok=True)
    other = b"sibling bytes, not the warehouse's"
    (sib / "f").write_bytes(other)
    c = cks.of_bytes(other)
    real = d.warehouse / "swap"
    real.mkdir(exist_ok=True)
    (real / "f").write_bytes(other)  # same bytes, legitimately inside: served
    url = d.files_url(str(real / "f"), c)
    for pid in (worker, d.proc.pid):
        a = ask(d, pid, get_bytes(d, url))
        assert a is not None and a.status == 200 and a.body == other
    aside = d.warehouse / "swap.old"
    os.rename(real, aside)
    real.symlink_to(sib)
    try:
        for _ in range(2):
            for pid in (worker, d.proc.pid):
                a = ask(d, pid, get_bytes(d, url))
                assert a is not None and a.status != 200 and other not in a.body, a
                assert 400 <= a.status < 500, a
            time.sleep(1.1)
    finally:
        real.unlink()
        os.rename(aside, real)


def test_the_root_slash_is_refused_beside_a_store() -> None:
    """"/" as a warehouse root holds every store: refused at start, not matched as "//"."""
    with pytest.raises(CmrootError):
        Warehouse(["/"], store="/var/tmp/store")
    w = Warehouse(["/"])
    assert w._inside("/etc") and w._local_root("/etc/x", "/etc/x").url == "/"

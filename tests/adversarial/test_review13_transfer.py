"""Hostile review 13: the executor side of a load (`transfer.copy_all`, `publish`,
`discard`), the driver's naming of a failed batch, and `dumpdir.in_scope` / the loader's
cross-database renames. No Spark: copy_all is called directly, against the real daemon
(tests/server), against tiny misbehaving HTTP servers written here, or against an fsspec
filesystem whose reads are scripted with events the test controls. The loader test uses a
stand-in catalog (the Spark job of `_copy` replaced by a direct copy_all call).

Each test asserts an invariant; a failing one is a finding."""

from __future__ import annotations

import errno
import http.server
import importlib
import io
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError, DaemonUnavailable, FileLost, ReplError
from cmroot.repl import dumpdir, transfer
from cmroot.repl.catalog import LAST_ID, SOURCE
from cmroot.repl.dumpdir import Dump, DumpEvent, Header
from cmroot.repl.transfer import TEMP_PREFIX, Backoff, Copied, Copy
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(300)

# The module, not the `load` function cmroot.repl re-exports under the same name.
load_mod = importlib.import_module("cmroot.repl.load")

MiB = 1 << 20


# -- helpers ------------------------------------------------------------------------------


def listing(root: Path) -> list[str]:
    """Every file and directory under `root` (relative), temporaries included."""
    if not root.exists():
        return []
    out = []
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(d, n), root))
    return sorted(out)


def temps(root: Path) -> list[str]:
    return [p for p in listing(root) if os.path.basename(p).startswith(TEMP_PREFIX)]


def no_sleep() -> tuple[list[float], Backoff]:
    pauses: list[float] = []
    return pauses, Backoff(attempts=3, first=0.01, sleep=pauses.append)


class Scripted(io.RawIOBase):
    """A read-only stream whose reads follow a script: bytes are returned as one read
    (at most 1 MiB, the size copy_all reads with), a callable is called (it may block on
    an event, or raise) and what it returns, if anything, is returned as the read."""

    def __init__(self, steps: list[bytes | Callable[[], bytes | None]]) -> None:
        self.steps = list(steps)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self.steps:
            step = self.steps.pop(0)
            data = step() if callable(step) else step
            if data is None:
                continue
            assert len(data) <= len(b)
            b[: len(data)] = data
            return len(data)
        return 0


GATES: dict[str, Callable[[], io.RawIOBase]] = {}


class GateFS(fsspec.AbstractFileSystem):
    """`review13gate://NAME`: an original on a remote filesystem (what fsspec reads for a
    non-local path), opened through GATES[NAME]."""

    protocol = "review13gate"
    cachable = False

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> io.RawIOBase:
        return GATES[self._strip_protocol(path).strip("/")]()


fsspec.register_implementation("review13gate", GateFS, clobber=True)


def chunks(data: bytes) -> list[bytes | Callable[[], bytes | None]]:
    return [data[i : i + MiB] for i in range(0, len(data), MiB)]


class FakeDaemon:
    """A tiny HTTP server playing a misbehaving cmroot daemon: `handler(req)` answers
    each request (a BaseHTTPRequestHandler; the JSON body of a POST is in req.json)."""

    def __init__(self, handler: Callable[[Any], None]) -> None:
        outer = self
        self.requests: list[tuple[str, str]] = []

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.json = json.loads(self.rfile.read(n) or b"null")
                outer.requests.append(("POST", self.path))
                handler(self)

            def do_GET(self) -> None:
                self.json = None
                outer.requests.append(("GET", self.path))
                handler(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def send_json(req: Any, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    req.wfile.write(data)


def in_cmroot_elsewhere(req: Any, size: int) -> None:
    """POST /v1/resolve: every pair is in the cmroot, at a path this machine cannot open
    (another cluster's store), so the bytes must come over GET /v1/files."""
    send_json(req, 200, {"files": [
        {"path": f["path"], "checksum": f["checksum"], "status": "cmroot",
         "location": "/nonexistent-review13-store/objects/x", "size": size}
        for f in req.json["files"]]})


@pytest.fixture
def fake() -> Iterator[Callable[[Callable[[Any], None]], FakeDaemon]]:
    made: list[FakeDaemon] = []

    def make(handler: Callable[[Any], None]) -> FakeDaemon:
        made.append(FakeDaemon(handler))
        return made[-1]

    yield make
    for f in made:
        f.close()


# -- 1. the bytes placed are the dump's bytes ---------------------------------------------


def test_a_second_attempt_of_the_same_task_cannot_corrupt_the_published_file(
    tmp_path: Path,
) -> None:
    """Spark may run a task twice at once (speculation, or a zombie attempt on an executor
    the driver gave up on): both attempts write the same temporary (`temp_path` is the same
    on every attempt). The driver publishes the attempt that finished; the other, still
    copying (then killed), must not be able to change the bytes that land at `dst`."""
    data = os.urandom(3 * MiB)
    ck = cks.of_bytes(data)
    midway, release = threading.Event(), threading.Event()
    opened: list[int] = []

    def stall() -> bytes:
        midway.set()
        release.wait(60)
        raise FileNotFoundError("attempt killed")  # the zombie attempt dies

    def gate() -> io.RawIOBase:
        opened.append(1)
        if len(opened) == 1:
            return Scripted(chunks(data))
        return Scripted([data[:MiB], stall])

    GATES["twice"] = gate
    dst = tmp_path / "dst" / "p=1" / "f"
    row = Copy("review13gate://twice", str(dst), ck, len(data))

    first = list(transfer.copy_all([row], None, None, streams=1))
    assert [c.source for c in first] == ["original"]

    second: list[Copied] = []
    t = threading.Thread(target=lambda: second.extend(
        transfer.copy_all([row], None, None, streams=1)), daemon=True)
    t.start()
    assert midway.wait(60)
    transfer.publish(first)  # the driver got the first attempt's answer
    release.set()
    t.join(60)
    assert not t.is_alive()
    got = dst.read_bytes()
    assert cks.of_bytes(got) == ck, (
        f"published file has {len(got)} bytes hashing to {cks.of_bytes(got)}, "
        f"not the dump's {len(data)} bytes {ck}")


def test_two_rows_with_one_destination(daemon: Daemon, tmp_path: Path) -> None:
    """copy_all given the same destination twice (the loader dedups by destination, so
    only a direct caller can): the file placed must be the dump's, and publish must not
    fail on a temporary the other row took away."""
    files = write_files(daemon.warehouse, {"t/f": b"F" * 4000})
    (src, data), = files.items()
    daemon.client().recycle([src], op="DROP_TABLE")
    dst = tmp_path / "dst" / "f"
    row = Copy(src, str(dst), cks.of_bytes(data), len(data))
    done = list(transfer.copy_all([row, row], daemon.url, daemon.tokens["read"], streams=1))
    assert [c.source for c in done] == ["cmroot", "cmroot"]
    transfer.publish(done)
    assert dst.read_bytes() == data
    assert temps(tmp_path / "dst") == []


def test_a_decoy_of_the_right_size_at_the_destination_is_replaced(tmp_path: Path) -> None:
    src = tmp_path / "src" / "f"
    src.parent.mkdir()
    src.write_bytes(b"good" * 1000)
    dst = tmp_path / "dst" / "f"
    dst.parent.mkdir()
    dst.write_bytes(b"evil" * 1000)
    done = list(transfer.copy_all([Copy(str(src), str(dst), cks.of_bytes(b"good" * 1000),
                                        4000)], None, None))
    assert done[0].source == "original"
    transfer.publish(done)
    assert dst.read_bytes() == b"good" * 1000


def test_a_daemon_serving_other_bytes_places_nothing(
    fake: Callable[..., FakeDaemon], tmp_path: Path
) -> None:
    data = os.urandom(2 * MiB + 5)

    def handler(req: Any) -> None:
        if req.command == "POST":
            in_cmroot_elsewhere(req, len(data))
            return
        other = bytes(reversed(data))
        req.send_response(200)
        req.send_header("Content-Length", str(len(other)))
        req.end_headers()
        req.wfile.write(other)

    d = fake(handler)
    dst = tmp_path / "dst" / "f"
    row = Copy(str(tmp_path / "gone"), str(dst), cks.of_bytes(data), len(data))
    done = list(transfer.copy_all([row], d.url, "cmr_x", backoff=no_sleep()[1]))
    assert done[0].source == "lost" and done[0].temp is None
    transfer.discard(done)
    assert listing(tmp_path / "dst") == []


# -- 2. a failed batch leaves nothing behind ------------------------------------------------


def test_one_stream_failing_while_another_copies_leaves_no_temporary(tmp_path: Path) -> None:
    """Stream 1 is mid-copy when the original of stream 2 fails to read (EIO: a disk or a
    remote filesystem failing, not a missing file). Whatever copy_all does with that
    (report the row, or raise), nothing of the batch may stay behind: when it raises, the
    driver has no Copied to discard."""
    good = os.urandom(3 * MiB)
    slow_started, bad_failed = threading.Event(), threading.Event()

    def first_chunk() -> bytes:
        slow_started.set()
        return good[:MiB]

    def wait_for_bad() -> None:
        bad_failed.wait(60)
        return None

    def fail() -> bytes:
        slow_started.wait(60)
        bad_failed.set()
        raise OSError(errno.EIO, "Input/output error")

    GATES["slow"] = lambda: Scripted([first_chunk, wait_for_bad, *chunks(good)[1:]])
    GATES["bad"] = lambda: Scripted([fail])
    root = tmp_path / "dst"
    rows = [
        Copy("review13gate://slow", str(root / "p=1" / "a"), cks.of_bytes(good), len(good)),
        Copy("review13gate://bad", str(root / "p=2" / "b"), "0" * 32, 10),
    ]
    try:
        done = list(transfer.copy_all(rows, None, None, streams=2))
    except Exception as e:
        left = listing(root)
        assert left == [], f"copy_all raised {e!r} and left behind {left}"
    else:
        assert [c.source for c in done][1] in ("lost", "failed")
        transfer.discard(done)
        assert listing(root) == []


def test_a_generator_closed_early_leaves_no_temporary(tmp_path: Path) -> None:
    """copy_all copies every row before its first answer: a consumer that stops after the
    first (and discards what it got) must not leave the others' temporaries behind."""
    src = tmp_path / "src"
    rows = []
    for i in range(3):
        p = src / f"f{i}"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(bytes([i]) * 1000)
        rows.append(Copy(str(p), str(tmp_path / "dst" / f"f{i}"),
                         cks.of_bytes(bytes([i]) * 1000), 1000))
    gen = transfer.copy_all(rows, None, None)
    first = next(gen)
    gen.close()
    transfer.discard([first])
    assert temps(tmp_path / "dst") == []


def test_discard_removes_only_directories_the_batch_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer creates the destination's directory between the batch's look
    (os.path.isdir) and its mkdir: the batch did not make it, so a discarded batch must
    leave it."""
    root = tmp_path / "table"
    root.mkdir()
    theirs = root / "p=1"
    real_mkdir = os.mkdir

    def racing_mkdir(path: Any, *a: Any, **kw: Any) -> None:
        if str(path) == str(theirs) and not theirs.exists():
            real_mkdir(path)  # the other writer wins the race
        real_mkdir(path, *a, **kw)

    monkeypatch.setattr(transfer.os, "mkdir", racing_mkdir)
    row = Copy(str(tmp_path / "never"), str(theirs / "f"), "0" * 32, 3)
    done = list(transfer.copy_all([row], None, None))
    monkeypatch.undo()
    assert done[0].source == "lost"
    transfer.discard(done)
    assert theirs.is_dir(), "discard removed a directory another writer made"


def test_results_are_one_per_row_in_order(daemon: Daemon, tmp_path: Path) -> None:
    files = write_files(daemon.warehouse, {f"t/f{i}": bytes([65 + i]) * (100 + i)
                                           for i in range(12)})
    paths = list(files)
    daemon.client().recycle(paths[::3], op="DROP_PARTITION")
    rows = [Copy(p, str(tmp_path / "dst" / f"{i:02d}"), cks.of_bytes(b), len(b))
            for i, (p, b) in enumerate(files.items())]
    rows.insert(5, Copy(str(daemon.warehouse / "never"), str(tmp_path / "dst" / "x"),
                        "0" * 32, 3))
    done = list(transfer.copy_all(rows, daemon.url, daemon.tokens["read"], streams=4))
    assert [c.dst for c in done] == [r.dst for r in rows]
    want = ["cmroot" if i % 3 == 0 else "original" for i in range(12)]
    want.insert(5, "lost")
    assert [c.source for c in done] == want


# -- 3. errors named truthfully, never a hang ---------------------------------------------


def test_a_connection_cut_mid_file_is_retried_not_a_lost_file(
    fake: Callable[..., FakeDaemon], tmp_path: Path
) -> None:
    """The daemon dies (or a proxy drops the connection) mid-file: the client reads fewer
    bytes than Content-Length, then end of stream. That is a broken connection (retried
    after a backoff), not a file missing from the cmroot. Here the second GET is served
    whole, so the copy must succeed."""
    data = os.urandom(3 * MiB)
    gets: list[int] = []

    def handler(req: Any) -> None:
        if req.command == "POST":
            in_cmroot_elsewhere(req, len(data))
            return
        gets.append(1)
        req.send_response(200)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if len(gets) == 1:
            req.wfile.write(data[: len(data) // 2])
            req.wfile.flush()
            req.close_connection = True  # the daemon is gone: FIN after half the file
            return
        req.wfile.write(data)

    d = fake(handler)
    dst = tmp_path / "dst" / "f"
    row = Copy(str(tmp_path / "gone"), str(dst), cks.of_bytes(data), len(data))
    pauses, backoff = no_sleep()
    done = list(transfer.copy_all([row], d.url, "cmr_x", backoff=backoff))
    assert (done[0].source, done[0].via, done[0].error) == ("cmroot", "http", None), (
        f"a connection cut mid-file became {done[0].source!r}: {done[0].error}; "
        f"GET requests: {len(gets)}, backoff pauses: {pauses}")
    transfer.publish(done)
    assert dst.read_bytes() == data


def test_a_daemon_killed_mid_file_is_not_a_lost_file(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real daemon, kill -9'd while it streams a file from GET /v1/files: the row must
    be `failed` (DaemonUnavailable), never `lost` (FileLost: "retention shorter than lag,
    take a fresh bootstrap")."""
    files = write_files(daemon.warehouse, {"t/big": os.urandom(64 * MiB)})
    (src, data), = files.items()
    daemon.client().recycle([src], op="DROP_TABLE")
    store = str(daemon.store)
    real_isfile = os.path.isfile
    monkeypatch.setattr(transfer.os.path, "isfile",
                        lambda p: False if str(p).startswith(store) else real_isfile(p))
    real_open = transfer.Client.open
    killed: list[int] = []

    class Killing:
        def __init__(self, resp: Any) -> None:
            self.resp = resp

        def readinto(self, b: Any) -> int:
            n = self.resp.readinto(b)
            if not killed:
                killed.append(1)
                daemon.kill()
            return n

    from contextlib import contextmanager

    @contextmanager
    def killing_open(self: Any, path: str, checksum: str, byte_range: Any = None) -> Any:
        with real_open(self, path, checksum, byte_range) as resp:
            yield Killing(resp)

    monkeypatch.setattr(transfer.Client, "open", killing_open)
    dst = tmp_path / "dst" / "big"
    row = Copy(src, str(dst), cks.of_bytes(data), len(data))
    _, backoff = no_sleep()
    done = list(transfer.copy_all([row], daemon.url, daemon.tokens["read"], backoff=backoff))
    assert killed
    assert (done[0].source, done[0].fault) == ("failed", "DaemonUnavailable"), (
        f"daemon killed mid-file reported as {done[0].source!r}: {done[0].error}")
    transfer.discard(done)
    assert listing(tmp_path / "dst") == []


@pytest.mark.parametrize("where", ["resolve", "files"])
def test_a_daemon_internal_error_is_not_a_lost_file(
    fake: Callable[..., FakeDaemon], tmp_path: Path, where: str
) -> None:
    """A 500 from the daemon says nothing about the file: the load must not report it
    lost (FileLost tells the operator the retention was too short and to bootstrap)."""
    data = b"x" * 5000

    def handler(req: Any) -> None:
        if req.command == "POST" and where == "files":
            in_cmroot_elsewhere(req, len(data))
            return
        send_json(req, 500, {"error": "internal error", "detail": "see the daemon's log"})

    d = fake(handler)
    row = Copy(str(tmp_path / "gone"), str(tmp_path / "dst" / "f"), cks.of_bytes(data),
               len(data))
    done = list(transfer.copy_all([row], d.url, "cmr_x", backoff=no_sleep()[1]))
    assert done[0].source != "lost", (
        f"a 500 on {where} reported as a lost file: {done[0].error}")


def test_a_path_the_daemon_will_not_resolve_is_not_a_lost_file(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Two clusters: a decoy of the right size sits at the original path here, so the
    driver's up-front check does not ask the daemon; the executor does, and the daemon
    refuses the pair (400: outside its warehouse roots, e.g. a load given the wrong
    --url, or roots reconfigured). That is the daemon refusing, not a lost file."""
    decoy = daemon.outside / "t" / "f"
    decoy.parent.mkdir(parents=True)
    decoy.write_bytes(b"d" * 3000)
    row = Copy(str(decoy), str(tmp_path / "dst" / "f"), cks.of_bytes(b"r" * 3000), 3000)
    done = list(transfer.copy_all([row], daemon.url, daemon.tokens["read"],
                                  backoff=no_sleep()[1]))
    assert done[0].source != "lost", f"reported lost: {done[0].error}"


def test_a_daemon_that_never_answers_is_given_up_in_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that accepts connections and never answers (hung, or a black-holing
    proxy). Measured without waiting: the client copy_all builds is given a short timeout
    here, the attempts are counted, and the real wait is what the default timeout times
    those attempts, plus the backoff's pauses, comes to. A load must give up on a silent
    daemon within minutes, not an hour."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(conn)  # read nothing, answer nothing

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    timeouts: list[float] = []
    sent: list[str] = []

    class Short(transfer.Client):  # type: ignore[misc, valid-type]
        def __init__(self, url: str, token: str | None = None, timeout: float = 600.0,
                     **kw: Any) -> None:
            timeouts.append(timeout)
            super().__init__(url, token, timeout=0.2, **kw)

        def _send(self, method: str, path: str, *a: Any) -> Any:
            sent.append(f"{method} {path}")
            return super()._send(method, path, *a)

    monkeypatch.setattr(transfer, "Client", Short)
    pauses: list[float] = []
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    row = Copy(str(tmp_path / "gone"), str(tmp_path / "dst" / "f"), "0" * 32, 10)
    try:
        done = list(transfer.copy_all([row], url, "cmr_x",
                                      backoff=Backoff(sleep=pauses.append)))
    finally:
        stop.set()
        t.join(5)
        for c in accepted:
            c.close()
        listener.close()
    assert (done[0].source, done[0].fault) == ("failed", "DaemonUnavailable")
    attempts = len(sent)
    worst = timeouts[0] * attempts + sum(pauses)
    assert worst <= 300, (
        f"a silent daemon holds each stream for {worst:g} s: {attempts} attempts x "
        f"{timeouts[0]:g} s client timeout + {sum(pauses):g} s of backoff")


def test_load_names_a_refused_token_not_a_lost_file(daemon: Daemon, tmp_path: Path) -> None:
    """The driver's naming (Loader._flush): a batch with one failed row and one lost row
    raises the daemon's error; discard leaves nothing."""
    files = write_files(daemon.warehouse, {"t/a": b"a" * 100})
    (src, data), = files.items()
    daemon.client().recycle([src], op="DROP_TABLE")
    rows = [Copy(src, str(tmp_path / "dst" / "a"), cks.of_bytes(data), len(data))]
    done = list(transfer.copy_all(rows, daemon.url, daemon.tokens["write"] + "x",
                                  backoff=no_sleep()[1]))
    assert [(c.source, c.fault) for c in done] == [("failed", "Unauthorized")]
    err = transfer.daemon_error("Unauthorized", done[0].error or "", daemon.url, "db")
    assert not isinstance(err, FileLost) and "401" in str(err)
    transfer.discard(done)
    assert listing(tmp_path / "dst") == []


# -- 4. dumpdir.in_scope ------------------------------------------------------------------


def ev(i: int, kind: str, db: str | None, table: Any, obj: Any = None) -> dict[str, Any]:
    return {"id": i, "eventType": kind, "db": db, "table": table, "tableObj": obj}


def picked(events: list[dict[str, Any]], db: str, table: str | None) -> list[int]:
    return [e["id"] for e, ok in dumpdir.in_scope(events, db, table) if ok]


def test_in_scope_table_followed_into_another_database_and_back() -> None:
    log = [
        ev(1, "INSERT", "a", "t"),
        ev(2, "ALTER_TABLE", "a", "t", {"db": "b", "table": "t"}),
        ev(3, "INSERT", "a", "t"),  # a new a.t: not ours
        ev(4, "INSERT", "b", "t"),
        ev(5, "DROP_DATABASE", "a", None),
        ev(6, "ALTER_TABLE", "b", "t", {"db": "a", "table": "t2"}),
        ev(7, "INSERT", "b", "t"),
        ev(8, "INSERT", "a", "t2"),
        ev(9, "INSERT", "A", "T2"),
    ]
    assert picked(log, "a", "t") == [1, 2, 4, 6, 8, 9]


def test_in_scope_database_entering_and_leaving() -> None:
    log = [
        ev(1, "ALTER_TABLE", "x", "t", {"db": "a", "table": "u"}),  # enters a
        ev(2, "INSERT", "a", "u"),
        ev(3, "ALTER_TABLE", "a", "u", {"db": "x", "table": "u"}),  # leaves a
        ev(4, "INSERT", "x", "u"),
        ev(5, "ALTER_TABLE", "x", "v", {"db": "x", "table": "w"}),  # elsewhere
        ev(6, "ALTER_TABLE", "x", "v", {"db": "A", "table": "W"}),  # enters, other case
    ]
    assert picked(log, "a", None) == [1, 2, 3, 6]


@pytest.mark.parametrize("obj", [
    {"_cmroot": "tableObj omitted: too large"},
    None,
    {},
])
def test_in_scope_omitted_table_obj_does_not_crash(obj: Any) -> None:
    log = [ev(1, "ALTER_TABLE", "a", "t", obj), ev(2, "ALTER_TABLE", "x", "t", obj),
           ev(3, "INSERT", "a", "t")]
    assert picked(log, "a", "t") == [1, 3]
    assert picked(log, "a", None) == [1, 3]


@pytest.mark.parametrize("obj", [
    "a string, not an object",
    ["a", "list"],
    {"table": 5, "db": "a"},
    {"table": ["x"], "db": None},
    {"table": "u", "db": {"not": "a string"}},
    7,
], ids=["str", "list", "table-int", "table-list", "db-dict", "int"])
def test_in_scope_malformed_table_obj_does_not_crash(obj: Any) -> None:
    log = [ev(1, "ALTER_TABLE", "a", "t", obj), ev(2, "INSERT", "a", "t")]
    for table in ("t", None):
        try:
            out = list(dumpdir.in_scope(log, "a", table))
        except ReplError:
            continue  # refused by name: fine
        except Exception as e:
            pytest.fail(f"in_scope(table={table!r}) crashed on tableObj={obj!r}: {e!r}")
        assert len(out) == 2


@pytest.mark.parametrize("field,value", [("table", 5), ("db", 5), ("table", ["t"])])
def test_in_scope_malformed_event_names_do_not_crash(field: str, value: Any) -> None:
    e = ev(1, "INSERT", "a", "t")
    e[field] = value
    for table in ("t", None):
        try:
            list(dumpdir.in_scope([e], "a", table))
        except ReplError:
            continue
        except Exception as ex:
            pytest.fail(f"in_scope crashed on {field}={value!r}: {ex!r}")


# -- 5. the loader: a table entering from another database ---------------------------------


class FakeDest:
    """The catalog calls a db-level incremental load makes, kept in dicts; tables live in
    directories under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dbs: dict[str, dict[str, str]] = {}
        self.tbls: dict[tuple[str, str], dict[str, Any]] = {}
        self.created: dict[str, dict[str, Any]] = {}

    def has_db(self, db: str) -> bool:
        return db in self.dbs

    def has_table(self, db: str, table: str) -> bool:
        return (db, table) in self.tbls

    def db_properties(self, db: str) -> dict[str, str]:
        return dict(self.dbs[db])

    def table_properties(self, db: str, table: str) -> dict[str, str]:
        return dict(self.tbls[(db, table)]["props"])

    def tables(self, db: str) -> list[str]:
        return [t for d, t in self.tbls if d == db]

    data_tables = tables

    def warehouse(self) -> str:
        return str(self.root)

    def db_location(self, db: str) -> str:
        return str(self.root / f"{db}.db")

    def location(self, db: str, table: str) -> str:
        return str(self.root / f"{db}.db" / table)

    def partition_columns(self, db: str, table: str) -> list[str]:
        return []

    def create_db(self, db: str, properties: dict[str, str] | None = None) -> None:
        self.dbs.setdefault(db, dict(properties or {}))

    def set_db_properties(self, db: str, properties: dict[str, str]) -> None:
        self.dbs[db].update(properties)

    def create_table(self, obj: dict[str, Any], db: str, table: str,
                     properties: dict[str, str] | None = None,
                     location: str | None = None) -> None:
        self.tbls[(db, table)] = {"obj": obj, "props": dict(properties or {})}
        self.created[table] = obj
        os.makedirs(self.location(db, table), exist_ok=True)

    def drop_table(self, db: str, table: str) -> None:
        self.tbls.pop((db, table), None)

    def add_partitions(self, *a: Any, **kw: Any) -> None:
        pass

    def refresh(self, db: str, table: str) -> None:
        pass


@pytest.mark.parametrize("entering", [True, False], ids=["entering", "control"])
def test_a_table_entering_from_another_database_does_not_lend_its_definition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entering: bool
) -> None:
    """x.t is renamed into a as a.u (another engine, through the metastore); then a's own
    new table t is written by a CTAS (its INSERT ahead of its CREATE_TABLE, which the
    loader takes its definition from: Loader._definition). The entering event names the
    table by its old name, t: the replica's a.t must still be made from a.t's definition,
    not from a.u's."""
    src = tmp_path / "src"
    f1 = src / "a.db" / "t" / "part-0"
    f1.parent.mkdir(parents=True)
    f1.write_bytes(b"row" * 100)
    u_def = {"db": "a", "table": "u", "location": str(src / "a.db" / "u"),
             "columns": [{"name": "from_u", "type": "int"}]}
    t_def = {"db": "a", "table": "t", "location": str(src / "a.db" / "t"),
             "columns": [{"name": "from_t", "type": "string"}]}
    events = [
        DumpEvent(11, 0, "ALTER_TABLE", "x", "t", location=str(src / "x.db" / "t"),
                  table_obj=u_def),
        DumpEvent(12, 0, "INSERT", "a", "t", location=str(src / "a.db" / "t"),
                  files=[{"path": str(f1), "checksum": cks.of_bytes(b"row" * 100),
                          "size": 300}]),
        DumpEvent(13, 0, "CREATE_TABLE", "a", "t", location=str(src / "a.db" / "t"),
                  table_obj=t_def),
    ]
    header = Header("incremental", "a", None, 10, 13, 0.0, "", source="S")
    tables = {"a.u": {"partitions": None, "tableObj": u_def},
              "a.t": {"partitions": None, "tableObj": t_def}}
    if not entering:  # the same dump without the rename: a.t is made right
        events, tables = events[1:], {"a.t": tables["a.t"]}
    dest = FakeDest(tmp_path / "dst")
    dest.dbs["a"] = {LAST_ID: "10", SOURCE: "S"}
    dest.tbls[("a", "other")] = {"obj": {}, "props": {}}
    monkeypatch.setattr(load_mod, "Destination", lambda spark: dest)
    monkeypatch.setattr(load_mod.Loader, "_copy", lambda self, copies: list(
        transfer.copy_all(copies, None, None)))
    loader = load_mod.Loader(None, Dump("mem://dump", header, events, tables), None, None,
                             None, None)
    loader.run()
    assert set(dest.created) == ({"u", "t"} if entering else {"t"})
    assert dest.created["t"]["columns"] == t_def["columns"], (
        f"a.t made from {dest.created['t']}")
    assert (tmp_path / "dst" / "a.db" / "t" / "part-0").read_bytes() == b"row" * 100


def test_loader_flush_names_the_daemon_error_and_leaves_nothing(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loader._flush with one file the daemon must serve and a token it refuses: the load
    raises the 401 (not FileLost), and the batch's directories are gone."""
    files = write_files(daemon.warehouse, {"s.db/t/f": b"q" * 500})
    (path, data), = files.items()
    daemon.client().recycle([path], op="DROP_PARTITION")
    t_def = {"db": "s", "table": "t", "location": str(daemon.warehouse / "s.db" / "t")}
    events = [
        DumpEvent(11, 0, "INSERT", "s", "t", location=t_def["location"],
                  files=[{"path": path, "checksum": cks.of_bytes(data), "size": len(data)}]),
    ]
    header = Header("incremental", "s", None, 10, 11, 0.0, daemon.url, source="S")
    dest = FakeDest(tmp_path / "dst")
    dest.dbs["s"] = {LAST_ID: "10", SOURCE: "S"}
    dest.create_table(t_def, "s", "t")
    monkeypatch.setattr(load_mod, "Destination", lambda spark: dest)
    bad = daemon.tokens["read"][:-2] + "zz"
    monkeypatch.setattr(load_mod.Loader, "_copy", lambda self, copies: list(
        transfer.copy_all(copies, self.daemon_url, bad, backoff=no_sleep()[1])))
    loader = load_mod.Loader(None, Dump("mem://dump", header, events, {}), None,
                             daemon.url, daemon.tokens["read"], None)
    with pytest.raises(CmrootError) as info:
        loader.run()
    assert not isinstance(info.value, FileLost), str(info.value)
    assert "401" in str(info.value), str(info.value)
    assert listing(tmp_path / "dst" / "s.db" / "t") == []
    assert dest.dbs["s"][LAST_ID] == "10"


def test_daemon_unavailable_error_is_named(tmp_path: Path) -> None:
    err = transfer.daemon_error("DaemonUnavailable", "x", "http://h:1", "db")
    assert isinstance(err, DaemonUnavailable) and "unreachable" in str(err)

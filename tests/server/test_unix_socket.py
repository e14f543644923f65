"""The Unix socket listener (`server.socket`), through the real daemon: requests over it
work (the Python client and the CLI with `--url unix://...`); its file has mode 0660 and is
removed at stop; in open mode only `server.socket_uids` get in (SO_PEERCRED), anyone else
gets a 403 and nothing runs; with tokens, tokens decide; a stale socket left by a dead
daemon is replaced, while a regular file or a live socket at the path is refused and left
alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cmroot import checksum as cks
from cmroot import config as cfg
from cmroot.client import Client
from cmroot.exceptions import ConfigError
from tests.cmroot_testlib import as_user
from tests.server.cmroot_daemon import Daemon, MakeDaemon, clean_env, write_files

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: a client runs as another uid (setuid)"
)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for the socket (sun_path holds 107 bytes; pytest's tmp_path can
    be longer), traversable by every user so another uid can reach the socket's mode."""
    d = Path(tempfile.mkdtemp(prefix="cmr-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _daemon(make_daemon: MakeDaemon, sock: Path, auth: bool = False, **env: str) -> Daemon:
    return make_daemon(auth=auth, env={"CMROOT_SERVER_SOCKET": str(sock), **env})


def _raw(path: Path, method: str, target: str, host: str = "localhost",
         headers: str = "", body: bytes = b"") -> tuple[int, dict[str, object], bytes]:
    """One request over the socket on a fresh connection: status, JSON body (or {}), raw."""
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(head + body)
        data = _read_all(s)
    return _parse(data)


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(data: bytes) -> tuple[int, dict[str, object], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {}
    return status, parsed if isinstance(parsed, dict) else {}, data


def _as_user(uid: int, gid: int, path: Path, request: bytes) -> bytes:
    """Send `request` over the socket as uid/gid on a fresh connection and return what
    came back (b"" if the connection was closed without an answer)."""

    def send(s: socket.socket) -> bytes:
        try:
            s.sendall(request)
        except BrokenPipeError:
            pass  # refused at connect: the answer came before the request was sent
        return _read_all(s)

    return _in_child(uid, gid, path, send)


def _in_child(uid: int, gid: int, path: Path, talk: Callable[[socket.socket], bytes]) -> bytes:
    """Run `talk` on a connection to the socket from a child process running as uid/gid
    and return what it returned."""

    def connect_and_talk() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(path))
            return talk(s)

    return as_user(uid, gid, [], connect_and_talk)


def _answer(s: socket.socket) -> bytes:
    """One whole answer (headers and Content-Length bytes) from a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(1 << 16)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += s.recv(1 << 16)
    return head + b"\r\n\r\n" + body


def _request(method: str, target: str, token: str | None = None, body: object = None) -> bytes:
    payload = json.dumps(body).encode() if body is not None else b""
    extra = f"Authorization: Bearer {token}\r\n" if token else ""
    if body is not None:
        extra += "Content-Type: application/json\r\n"
    return (
        f"{method} {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{extra}"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


def test_requests_over_the_socket(make_daemon: MakeDaemon, sockdir: Path) -> None:
    sock = sockdir / "cmroot.sock"
    d = _daemon(make_daemon, sock)
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert not [p for p in sockdir.iterdir() if p != sock], "no temporary left beside it"

    files = write_files(d.warehouse, {"db.db/t/p=1/a": b"hello" * 100})
    path = next(iter(files))
    client = Client(f"unix://{sock}")
    res = client.recycle([str(d.warehouse / "db.db/t")], op="DROP_TABLE", db="db", table="t")
    assert [f.path for f in res.files] == [path]
    assert not os.path.exists(path)
    checksum = cks.of_bytes(b"hello" * 100)
    out = sockdir / "got"
    with open(out, "wb") as f:
        assert client.get(path, checksum, f) == 500
    assert out.read_bytes() == b"hello" * 100
    assert client.current_event() == res.event_id
    client.close()
    # The `socket=` form: an http URL's daemon, reached through the socket.
    assert Client("http://localhost", socket=str(sock)).current_event() == res.event_id

    # The CLI, as an operator would call it.
    cli = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "ls", "--url", f"unix://{sock}", "--json"],
        env=clean_env(), capture_output=True, timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert [e["path"] for e in json.loads(cli.stdout)["entries"]] == [path]

    # No web page can reach a Unix socket: any Host is served there, while the TCP
    # listener keeps refusing a foreign Host in open mode.
    status, _, raw = _raw(sock, "GET", "/v1/events/current", host="evil.example")
    assert status == 200, raw
    r = d.request("GET", "/v1/events/current", headers={"Host": "evil.example"})
    assert r.status == 403, r

    assert d.stop() == 0, d.log()
    assert not os.path.lexists(sock), "the socket file is removed at stop"
    assert d.errors() == [], d.log()


@needs_root
def test_a_uid_not_allowed_is_refused_and_nothing_runs(
    make_daemon: MakeDaemon, sockdir: Path
) -> None:
    sock = sockdir / "cmroot.sock"
    d = _daemon(make_daemon, sock)  # socket_uids: the daemon's own (root) by default
    files = write_files(d.warehouse, {"db.db/t/a": b"keep me"})
    before = d.snapshot()
    # Group 0 gets through the socket's 0660 mode, so it is the uid check that refuses.
    body = {"paths": [str(d.warehouse / "db.db/t")], "op": "DROP_TABLE"}
    status, err, raw = _parse(_as_user(NOBODY, 0, sock, _request("POST", "/v1/recycle",
                                                                 body=body)))
    assert status == 403, raw
    assert "socket_uids" in str(err["detail"]) and str(NOBODY) in str(err["detail"]), err
    assert all(Path(p).read_bytes() == b for p, b in files.items())
    assert d.snapshot() == before
    # The daemon's own uid is served; so is root's.
    status, _, raw = _raw(sock, "GET", "/v1/events/current")
    assert status == 200, raw

    # Listed in socket_uids (by uid here; a user name works too), nobody gets in.
    d.env["CMROOT_SERVER_SOCKET_UIDS"] = f"{NOBODY},root"
    d.restart()
    status, _, raw = _parse(_as_user(NOBODY, 0, sock, _request("GET", "/v1/events/current")))
    assert status == 200, raw
    assert d.errors() == [], d.log()


@needs_root
def test_with_tokens_the_token_decides_on_the_socket(
    make_daemon: MakeDaemon, sockdir: Path
) -> None:
    sock = sockdir / "cmroot.sock"
    d = _daemon(make_daemon, sock, auth=True)
    status, _, raw = _parse(_as_user(NOBODY, 0, sock, _request("GET", "/v1/events/current")))
    assert status == 401, raw
    request = _request("GET", "/v1/events/current", token=d.tokens["admin"])
    status, _, raw = _parse(_as_user(NOBODY, 0, sock, request))
    assert status == 200, raw
    assert d.errors() == [], d.log()


@needs_root
def test_a_reload_to_open_mode_drops_connections_it_no_longer_admits(
    make_daemon: MakeDaemon, sockdir: Path
) -> None:
    """A connection let in by its token must not outlive the tokens: once a reload removes
    them (open mode), the peer's uid decides, for connections already open too."""
    sock = sockdir / "cmroot.sock"
    d = _daemon(make_daemon, sock, auth=True)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()

    def talk(s: socket.socket) -> bytes:
        keep = _request("GET", "/v1/events/current", d.tokens["admin"]).replace(
            b"Connection: close", b"Connection: keep-alive"
        )
        s.sendall(keep)
        first = _answer(s)
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        try:
            s.sendall(_request("GET", "/v1/events/current"))
            second = _read_all(s)
        except (BrokenPipeError, ConnectionResetError):
            second = b""
        return first + b"\0" + second

    reloads = sum(1 for r in d.log_records() if r.get("msg") == "reloaded")

    def reload_when_ready() -> None:
        assert os.read(ready_r, 1) == b"1"
        d.write_config(token_lines=[])
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while sum(1 for r in d.log_records() if r.get("msg") == "reloaded") == reloads:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        os.write(go_w, b"1")

    reloader = threading.Thread(target=reload_when_ready)
    reloader.start()
    try:
        out = _in_child(NOBODY, 0, sock, talk)
    finally:
        os.write(ready_w, b"0")  # unblocks the thread if the child failed first
        reloader.join()
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    first, _, second = out.partition(b"\0")
    assert _parse(first)[0] == 200, out
    assert second == b"", out  # closed, not answered
    status, _, raw = _parse(_as_user(NOBODY, 0, sock, _request("GET", "/v1/events/current")))
    assert status == 403, raw
    assert d.errors() == [], d.log()


def test_a_stale_socket_is_replaced(make_daemon: MakeDaemon, sockdir: Path) -> None:
    sock = sockdir / "cmroot.sock"
    # What a daemon killed with -9 leaves: a socket file nothing listens on.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))
    dead.close()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    d = _daemon(make_daemon, sock)
    assert _raw(sock, "GET", "/healthz")[0] == 200
    d.kill()
    assert os.path.lexists(sock)
    d.start()  # over its own stale socket, as systemd's restart would
    assert _raw(sock, "GET", "/healthz")[0] == 200
    assert d.errors() == [], d.log()


def _refused_start(d: Daemon) -> str:
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(60) != 0, d.log()
    return d.log()


def test_a_regular_file_at_the_path_is_refused_not_deleted(
    make_daemon: MakeDaemon, sockdir: Path
) -> None:
    sock = sockdir / "cmroot.sock"
    sock.write_bytes(b"somebody's data")
    d = make_daemon(start=False, auth=False, env={"CMROOT_SERVER_SOCKET": str(sock)})
    log = _refused_start(d)
    assert "server.socket" in log and "not a socket" in log, log
    assert "Traceback" not in log, log
    assert sock.read_bytes() == b"somebody's data"


def test_a_live_socket_at_the_path_is_refused_not_deleted(
    make_daemon: MakeDaemon, sockdir: Path
) -> None:
    sock = sockdir / "cmroot.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(sock))
        other.listen()
        ident = os.lstat(sock).st_ino
        d = make_daemon(start=False, auth=False, env={"CMROOT_SERVER_SOCKET": str(sock)})
        log = _refused_start(d)
        assert "another process listens" in log, log
        assert os.lstat(sock).st_ino == ident


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"CMROOT_SERVER_SOCKET": "run/cmroot.sock"}, "absolute"),
        ({"CMROOT_SERVER_SOCKET": "/" + "x" * 120}, "too long"),
        ({"CMROOT_SERVER_SOCKET_UIDS": "no-such-user-cmroot"}, "socket_uids"),
    ],
)
def test_bad_socket_settings_are_refused(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        cfg.load(None, env=env)
    assert words in str(e.value) + " " + e.value.detail

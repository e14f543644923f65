"""The daemon as systemd runs it: the unit file verifies, sd_notify READY/WATCHDOG/STOPPING
reach a socket the test owns, SIGHUP re-reads tokens, SIGTERM exits 0, and a public bind
without tokens is refused at start."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmroot.server.auth import new_token
from tests.server.cmroot_daemon import REPO, MakeDaemon, assert_error, clean_env

pytestmark = pytest.mark.timeout(120)

UNIT = REPO / "systemd" / "cmrootd.service"


def test_unit_file_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    cmroot = shutil.which("cmroot")
    if cmroot is None:
        pytest.skip("the cmroot console script is not on PATH (pip install -e .)")
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/cmroot serve --config" in text
    assert "Type=notify" in text and "ExecReload=" in text and "WatchdogSec=" in text
    unit = tmp_path / "cmrootd.service"
    unit.write_text(text.replace("/usr/local/bin/cmroot", cmroot))
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, f"systemd-analyze verify failed:\n{p.stdout}\n{p.stderr}"
    assert "cmrootd.service" not in p.stderr, p.stderr  # no warning about the unit itself


def test_unit_security_score() -> None:
    """`systemd-analyze security` rates the unit OK (at most 2.0; it was 7.6 EXPOSED)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    p = subprocess.run(
        [analyze, "security", "--offline=true", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", p.stdout + p.stderr)
    if m is None and "--offline" in p.stderr:
        pytest.skip(f"this systemd-analyze has no --offline: {p.stderr.strip()}")
    assert m is not None, (p.stdout, p.stderr)
    print(m.group(0))
    assert float(m.group(1)) <= 2.0 and m.group(2) == "OK", m.group(0)


def _self_signed(base: Path, name: str) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-keyout", str(base / "key.pem"), "-out", str(base / "cert.pem")],
        check=True, capture_output=True, timeout=60,
    )


def _served_cert(port: int) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_sighup_rereads_tls_certificates(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (makes the test certificates)")
    tls = tmp_path / "tls"
    tls.mkdir()
    _self_signed(tls, "first")
    first = ssl.PEM_cert_to_DER_cert((tls / "cert.pem").read_text())
    d = make_daemon(
        start=False,
        env={
            "CMROOT_SERVER_TLS_CERT": str(tls / "cert.pem"),
            "CMROOT_SERVER_TLS_KEY": str(tls / "key.pem"),
        },
    )
    d.start(wait=False)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert _served_cert(d.port) == first
            break
        except OSError:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.1)
    _self_signed(tls, "second")
    second = ssl.PEM_cert_to_DER_cert((tls / "cert.pem").read_text())
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while _served_cert(d.port) != second:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    # A broken pair is refused whole; the daemon keeps serving the renewed one.
    (tls / "key.pem").write_text("not a key")
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reload failed" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert _served_cert(d.port) == second
    assert d.stop() == 0


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """An AF_UNIX datagram socket standing in for systemd's notify socket (a short path:
    sun_path holds 108 bytes)."""
    d = tempfile.mkdtemp(prefix="cmn", dir="/tmp")
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(0.2)
    try:
        yield s, path
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def _collect(s: socket.socket, until: str, timeout: float = 15.0) -> list[str]:
    """Datagrams, split into lines, until one line equals `until`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = s.recv(4096)
        except TimeoutError:
            continue
        seen += data.decode().splitlines()
        if until in seen:
            return seen
    raise AssertionError(f"no {until!r} within {timeout}s; got {seen}")


def test_notify_ready_watchdog_reload_stopping(
    make_daemon: MakeDaemon, notify_socket: tuple[socket.socket, str]
) -> None:
    s, path = notify_socket
    d = make_daemon(start=False)
    d.start(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    seen = _collect(s, "READY=1")
    assert "STATUS=serving" in seen
    # Pings every WATCHDOG_USEC/2 = 0.1s while the store answers.
    t0 = time.monotonic()
    pings = 0
    while pings < 3:
        pings += _collect(s, "WATCHDOG=1", timeout=5).count("WATCHDOG=1")
    assert time.monotonic() - t0 < 5
    # SIGHUP: RELOADING=1 (with the monotonic timestamp systemd wants), then READY=1 again.
    d.signal(signal.SIGHUP)
    seen = _collect(s, "RELOADING=1")
    after = _collect(s, "READY=1")
    assert any(line.startswith("MONOTONIC_USEC=") for line in seen + after)
    # SIGTERM: STOPPING=1, exit 0.
    d.signal(signal.SIGTERM)
    _collect(s, "STOPPING=1")
    assert d.proc is not None and d.proc.wait(30) == 0, d.log()


def test_notify_abstract_socket(make_daemon: MakeDaemon) -> None:
    name = f"cmroot-test-{os.getpid()}-{time.monotonic_ns()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(0.2)
    try:
        d = make_daemon(start=False)
        d.start(env={"NOTIFY_SOCKET": "@" + name})
        _collect(s, "READY=1")
        assert d.stop() == 0
        _collect(s, "STOPPING=1")
    finally:
        s.close()


def test_sighup_reloads_tokens(make_daemon: MakeDaemon) -> None:
    d = make_daemon(start=False)
    first_line = d.token_lines[0]  # the read token only
    d.write_config([first_line])
    d.start()
    new, line = new_token("admin")
    new_line = line.split('"')[1]
    auth = {"Authorization": f"Bearer {new}"}
    assert_error(
        d.request("GET", "/v1/events/current", headers=auth, scope=None), 401, "unknown token"
    )
    assert d.request("GET", "/v1/entries", scope="read").status == 200

    d.write_config([first_line, new_line])
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.request("GET", "/v1/events/current", headers=auth, scope=None).status != 200:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert d.request("GET", "/v1/entries", scope="read").status == 200

    # A broken file is logged and ignored: the daemon keeps its tokens and keeps serving.
    d.config_path.write_text("[auth\ntokens = ")
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reload failed" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert d.request("GET", "/v1/events/current", headers=auth, scope=None).status == 200

    # Revocation: drop the read token, reload, it is refused.
    d.write_config([new_line])
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.request("GET", "/v1/entries", scope="read").status != 401:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert d.request("GET", "/v1/events/current", headers=auth, scope=None).status == 200
    assert d.stop() == 0


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_public_bind_without_tokens_is_refused(make_daemon: MakeDaemon, host: str) -> None:
    d = make_daemon(start=False, auth=False, host=host)
    p = subprocess.run(
        d.command(), env=clean_env(), capture_output=True, text=True, timeout=60, cwd=d.base
    )
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert f"refusing to listen on {host} without tokens" in p.stderr, p.stderr
    assert "auth.tokens" in p.stderr  # and says how to fix it
    assert not (d.store / "index.sqlite").exists(), "refused before opening the store"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", d.port), timeout=1).close()


def test_public_bind_with_tokens_starts(make_daemon: MakeDaemon) -> None:
    d = make_daemon(host="0.0.0.0")
    assert d.request("GET", "/v1/entries", scope=None).status == 401
    assert d.request("GET", "/v1/entries", scope="read").status == 200
    assert d.stop() == 0


def test_loopback_without_tokens_serves_openly(make_daemon: MakeDaemon) -> None:
    d = make_daemon(auth=False)
    assert d.request("GET", "/v1/events/current", scope=None).status == 200
    assert d.stop() == 0


def test_disabled_change_management_refuses_to_start(tmp_path) -> None:
    import subprocess
    import sys

    site = tmp_path / "hive-site.xml"
    site.write_text(
        "<configuration>"
        f"<property><name>hive.repl.cmrootdir</name><value>{tmp_path / 'cm'}</value></property>"
        "<property><name>hive.metastore.warehouse.dir</name>"
        f"<value>{tmp_path / 'wh'}</value></property>"
        "<property><name>hive.repl.cm.enabled</name><value>false</value></property>"
        "</configuration>"
    )
    r = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "serve", "--config", str(site), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "change management is disabled" in r.stderr and "hive.repl.cm.enabled" in r.stderr
    assert not (tmp_path / "cm").exists()

"""Run the real daemon (`python -m cmroot.cli serve`) as a subprocess on a free loopback
port, with a real warehouse and store in a temporary directory, and talk to it over HTTP.

Used by the daemon suite (tests/server/) and by tests/test_client.py and tests/test_cli.py;
fixtures live in tests/server/conftest.py and in those files, this module only has the
machinery (a uniquely named module, so imports never clash with another conftest)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from cmroot_testlib import tree

from cmroot.client import Client
from cmroot.server.auth import new_token

REPO = Path(__file__).resolve().parents[2]
# The `make_daemon` fixture's type: make_daemon(name="d", start=True, **Daemon kwargs).
MakeDaemon = Callable[..., "Daemon"]
SCOPES = ("read", "write", "admin")
# Short server timeouts (server.keepalive_timeout, body_timeout, send_timeout; 15 s, 15 s
# and 30 s by default) for the tests that wait them out: `make_daemon(env=FAST_TIMEOUTS)`.
KEEPALIVE, BODY_TIMEOUT, SEND_TIMEOUT = 3.0, 3.0, 4.0
FAST_TIMEOUTS = {
    "CMROOT_SERVER_KEEPALIVE_TIMEOUT": f"{KEEPALIVE:g}s",
    "CMROOT_SERVER_BODY_TIMEOUT": f"{BODY_TIMEOUT:g}s",
    "CMROOT_SERVER_SEND_TIMEOUT": f"{SEND_TIMEOUT:g}s",
}
# Tables whose rows are the store's state (the checksum cache is advisory and left out).
STATE_TABLES = ("objects", "entries", "events", "txs", "journal")


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the daemon gets SIGKILL if the test process dies without tearing it down."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any CMROOT_* or systemd variables, so a
    developer's shell cannot leak into the daemon under test."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CMROOT_")
        and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env.update(extra or {})
    return env


def toml_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


class Reply:
    """One HTTP answer, read whole."""

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Reply {self.status} {self.body[:300]!r}>"


class Daemon:
    """A cmroot daemon under test. `auth=True` configures one token per scope
    (`self.tokens[scope]`); `env` adds CMROOT_* overrides."""

    def __init__(
        self,
        base: Path,
        *,
        auth: bool = True,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.base = base
        self.warehouse = base / "warehouse"
        self.store = base / "store"
        self.outside = base / "outside"
        for d in (self.warehouse, self.outside):
            d.mkdir(parents=True, exist_ok=True)
        self.config_path = base / "cmroot.toml"
        self.log_path = base / "daemon.log"
        self.host = host
        self.port = free_port()
        self.env = dict(env or {})
        self.tokens: dict[str, str] = {}
        self.token_lines: list[str] = []
        if auth:
            for scope in SCOPES:
                token, line = new_token(scope)
                self.tokens[scope] = token
                self.token_lines.append(line.split('"')[1])
        self.write_config()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- lifecycle -----------------------------------------------------------------------
    def write_config(self, token_lines: Iterable[str] | None = None) -> None:
        lines = self.token_lines if token_lines is None else list(token_lines)
        self.config_path.write_text(
            "[store]\n"
            f"root = {json.dumps(str(self.store))}\n"
            f"warehouse_roots = {toml_list([str(self.warehouse)])}\n"
            "[auth]\n"
            f"tokens = {toml_list(lines)}\n"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "cmroot.cli",
            "serve",
            "--config",
            str(self.config_path),
            "--port",
            str(self.port),
            "--host",
            self.host,
            *extra,
        ]

    def start(self, wait: bool = True, env: Mapping[str, str] | None = None) -> Daemon:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self._log_offset = log.tell()
        try:
            self.proc = subprocess.Popen(
                self.command(),
                env=clean_env({**self.env, **(env or {})}),
                cwd=str(self.base),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"daemon exited with {self.proc.returncode} before it was ready:\n{self.log()}"
                )
            try:
                if self.request("GET", "/readyz", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon ignored SIGTERM for {timeout}s:\n{self.log()}") from None

    @contextlib.contextmanager
    def serving(self, check_errors: bool = True) -> Iterator[Daemon]:
        """Started here and closed on exit (a fixture's whole life); with `check_errors`,
        no error-level log line may have appeared meanwhile."""
        self.start()
        try:
            yield self
            if check_errors:
                assert self.errors() == [], self.log()
        finally:
            self.close()

    def kill(self) -> None:
        """kill -9."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> Daemon:
        if self.proc is not None and self.proc.poll() is None:
            assert self.stop() == 0, self.log()
        return self.start()

    def close(self) -> None:
        """Teardown: never leave a daemon behind, whatever the test did."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log(self, since_start: bool = False) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[self._log_offset if since_start else 0 :].decode(errors="replace")

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    def errors(self) -> list[dict[str, Any]]:
        """Error-level log lines: unhandled exceptions, internal errors."""
        return [r for r in self.log_records() if r.get("level") in ("error", "critical")]

    # -- talking to it ---------------------------------------------------------------------
    def client(self, scope: str | None = "admin", timeout: float = 120.0) -> Client:
        return Client(self.url, self.tokens.get(scope) if scope else None, timeout=timeout)

    def auth(self, scope: str | None) -> dict[str, str]:
        if scope is None or scope not in self.tokens:
            return {}
        return {"Authorization": f"Bearer {self.tokens[scope]}"}

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        scope: str | None = "admin",
        raw: bytes | None = None,
        timeout: float = 60.0,
    ) -> Reply:
        """One request on a fresh connection. `body` is sent as JSON, `raw` as is."""
        payload = (
            raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        )
        hdrs = {**self.auth(scope), **(headers or {})}
        if payload is not None:
            hdrs.setdefault("Content-Type", "application/json")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, payload, hdrs)
            resp = conn.getresponse()
            return Reply(resp.status, resp.headers, resp.read())
        finally:
            conn.close()

    def files_url(self, path: str, checksum: str) -> str:
        return "/v1/files?" + urlencode({"path": path, "checksum": checksum})

    def metrics(self) -> str:
        r = self.request("GET", "/metrics", scope=None)
        assert r.status == 200, r
        return r.body.decode()

    # -- looking at its state ----------------------------------------------------------------
    def index_counts(self) -> dict[str, int]:
        path = self.store / "index.sqlite"
        if not path.exists():
            return dict.fromkeys(STATE_TABLES, 0)
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in STATE_TABLES}
        finally:
            con.close()

    def snapshot(self) -> dict[str, Any]:
        """Warehouse, outside directory and store objects on disk, the index's row counts
        and what the API says (newest entries, current event)."""
        state: dict[str, Any] = {
            "warehouse": tree(self.warehouse),
            "outside": tree(self.outside),
            "objects": tree(self.store / "objects"),
            "staging": tree(self.store / "staging"),
            "trash": tree(self.store / "trash"),
            "index": self.index_counts(),
        }
        if self.proc is not None and self.proc.poll() is None:
            r = self.request("GET", "/v1/entries?limit=1000")
            assert r.status == 200, r
            state["entries"] = r.json()
            r = self.request("GET", "/v1/events/current")
            assert r.status == 200, r
            state["current_event"] = r.json()
        return state


def write_files(root: Path, files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Write {relative path: bytes} under root; returns {absolute path: bytes}."""
    out = {}
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out[str(p)] = data
    return out


def assert_error(reply: Reply, status: int, *words: str) -> dict[str, Any]:
    """A JSON error answer with `status` whose message or detail mentions every word."""
    assert reply.status == status, reply
    assert reply.headers.get_content_type() == "application/json", reply.headers
    err = reply.json()
    assert isinstance(err, dict) and isinstance(err.get("error"), str) and err["error"], err
    assert isinstance(err.get("detail"), str), err
    text = (err["error"] + " " + err["detail"]).lower()
    for w in words:
        assert w.lower() in text, f"{w!r} not in {err}"
    return err

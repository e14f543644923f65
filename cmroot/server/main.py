"""`cmroot serve`: open the store (rolling back interrupted recycles), serve the API,
sweep on a schedule, talk to systemd, reload on SIGHUP, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import os
import resource
import signal
import socket
import ssl
import stat
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_request import BaseRequest
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import CollectorRegistry

from cmroot import config as cfg
from cmroot.exceptions import ConfigError, Conflict
from cmroot.metrics import Metrics, share_between_processes, shared_registry
from cmroot.server.app import (
    FORWARD,
    LIMITS,
    SERVICE,
    Handler,
    Service,
    create_app,
    error_response,
    forwarded,
)
from cmroot.server.auth import Tokens, unix_peer_uid
from cmroot.server.rundir import RunDir
from cmroot.server.systemd import Notifier
from cmroot.server.workers import METRICS_DIR, PRIMARY_SOCKET, Workers
from cmroot.store import Store

log = logging.getLogger("cmroot.server")
# On SIGTERM in-flight requests get SHUTDOWN_GRACE seconds to finish; then connections
# still open are aborted (a client that never reads holds nothing after that) and their
# handlers get SHUTDOWN_ABORT seconds more to return. Both within the unit's
# TimeoutStopSec (150 s), with room for the store calls still running to end.
SHUTDOWN_GRACE = 90.0
SHUTDOWN_ABORT = 20.0
MAX_REQUEST_LINE = 64 * 1024
# server.keepalive_timeout: an idle keep-alive connection, or one whose request headers
# have not all arrived, is closed after it (aiohttp starts the same timer at accept and
# after each answer). server.body_timeout: a request body may stall this long before its
# read fails with 408; one still arriving after it must have come at this rate (bytes/s)
# on average: one trickled a byte at a time would otherwise hold its place in a work
# class for ever.
BODY_MIN_RATE = 16 << 10
WRITE_WATCH_EVERY = 5.0  # seconds between looks for answers no client is taking (at most)
# Connections the kernel queues while the daemon is busy; asyncio also accepts up to this
# many in one go, before the connection cap is looked at, so the cap leaves room for them.
BACKLOG = 128
# Descriptors kept out of the connection cap for the store: a base for SQLite's writer,
# staging and the process itself, and four per worker thread (its SQLite reader and WAL,
# the file it opens, a hashing pool's).
FD_RESERVE = 64 + 4 * sum(limit.workers for limit in LIMITS.values())
EXTEND_EVERY = 10.0  # seconds between start-timeout extensions while the store opens
_BUSY_BODY = json.dumps(
    {"error": "too many connections", "detail": "every connection is busy: retry shortly"}
).encode()
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(_BUSY_BODY)
) + _BUSY_BODY
SOCKET_MODE = 0o660  # the daemon's user and group may connect to server.socket
REFUSED_LINGER = 5.0  # seconds a refused Unix-socket client has to read its 403


def serve(config: cfg.Config, host: str | None = None, port: int | None = None) -> int:
    server = replace(
        config.server,
        host=host or config.server.host,
        port=config.server.port if port is None else port,
    )
    config = replace(config, server=server)
    if not config.store.enabled:
        raise ConfigError(
            f"change management is disabled in {config.source}",
            "store.enabled (hive.repl.cm.enabled) is false: set it to true to run the daemon",
        )
    tokens = _tokens(config.auth.tokens, server.host)
    if tokens.enabled and not server.tls_cert and not _is_loopback(server.host):
        log.warning(
            "tokens travel in clear text: listening beyond loopback without TLS",
            extra={"host": server.host, "fix": "set server.tls_cert and server.tls_key"},
        )
    _ensure_default_dirs(config)
    notifier = Notifier()
    store = _open_store(config, notifier)
    rundir: RunDir | None = None
    try:
        registry = CollectorRegistry()
        if server.processes > 1:
            rundir = RunDir(PRIMARY_SOCKET)
            metrics_dir = os.path.join(rundir.path, METRICS_DIR)
            os.mkdir(metrics_dir)
            share_between_processes(metrics_dir)
            registry = shared_registry(metrics_dir)
        service = Service(store, tokens, registry, send_timeout=config.server.send_timeout,
                          shared=rundir is not None)
        try:
            asyncio.run(_run(config, service, notifier, rundir.path if rundir else None))
        finally:
            service.close()
    finally:
        store.close()
        if rundir is not None:
            rundir.close()
    return 0


def _open_store(config: cfg.Config, notifier: Notifier) -> Store:
    """Store.open settles interrupted recycles first, and a large rollback can outlast
    TimeoutStartSec: systemd would kill it half way and start it again, for ever. So
    while it runs, the start timeout is extended a little at a time."""
    with ThreadPoolExecutor(1, thread_name_prefix="cmroot-open") as pool:
        opening = pool.submit(Store.open, config)
        while True:
            notifier.notify(
                f"EXTEND_TIMEOUT_USEC={int(EXTEND_EVERY * 3e6)}\n"
                "STATUS=opening the store (recovering interrupted recycles)"
            )
            try:
                return opening.result(timeout=EXTEND_EVERY)
            except TimeoutError:
                continue


def _ensure_default_dirs(config: cfg.Config) -> None:
    """The embedded defaults work on a fresh machine: their directories are created."""
    if config.source == "<defaults>":
        for d in config.store.warehouse_roots:
            if cfg.local_path(d):
                os.makedirs(d, exist_ok=True)


def _tokens(entries: Iterable[str], host: str) -> Tokens:
    """The tokens of `auth.tokens`; none (open mode) only on a loopback address, at start
    as on reload: open mode trusts every client that can connect."""
    tokens = Tokens(entries)
    if not tokens.enabled and not _is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host} without tokens",
            "add auth.tokens (cmroot token create --scope admin) or bind to 127.0.0.1",
        )
    return tokens


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ssl_context(server: cfg.ServerConfig) -> ssl.SSLContext | None:
    if not server.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(server.tls_cert, server.tls_key)
    return ctx


def _reload_tls(ctx: ssl.SSLContext, server: cfg.ServerConfig) -> None:
    """Load renewed certificates into the live context: new handshakes present them.
    They are tried on a scratch context first, so a bad pair (a key that does not match
    the certificate) raises before the live one holds half of it."""
    if not server.tls_cert:
        raise ConfigError(
            "server.tls_cert removed", "TLS is switched on or off by a restart, not a reload"
        )
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        server.tls_cert, server.tls_key
    )
    ctx.load_cert_chain(server.tls_cert, server.tls_key)


def _max_connections() -> int:
    """Half the descriptors left after the store's reserve and one accept batch (each
    connection may hold a file it serves), so a crowd of clients never leaves a recycle
    without a descriptor. The unit sets LimitNOFILE; run by hand, `ulimit -n` decides."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - FD_RESERVE - BACKLOG) // 2)


class _Connection(web.RequestHandler):
    """aiohttp's protocol for one connection, with what the daemon needs of it: whether it
    can be closed without losing a request, and malformed HTTP answered as the API's
    client errors rather than logged as daemon faults."""

    metrics: Metrics  # the app's: a refused request is counted like any other
    private = False  # on the primary's private socket (a serving process's connection)

    def idle(self) -> bool:
        """Waiting for a request, none arrived, nothing left to send. aiohttp's loop parks
        on `_waiter` with no message queued only then: a request is queued as soon as its
        headers are parsed, before any handler task exists, and `_waiter` is cleared until
        it has been answered. Closing a connection in any other state would still run the
        request it holds, for a client told the connection was lost (a phantom recycle).
        Headers still arriving (a slow-loris) count as idle: nothing of them has run."""
        waiter = self._waiter
        t = self.transport
        return (
            waiter is not None
            and not waiter.done()
            and not self._messages
            and isinstance(t, asyncio.WriteTransport)
            and not t.is_closing()
            and t.get_write_buffer_size() == 0
        )

    def drop_body(self) -> None:
        """The body being read was cut (_StallWatch): once answered, the connection is
        closed without aiohttp's lingering read of the rest of that body, which would wait
        on the same slow client and fail again (with the error the read got, logged as an
        unhandled exception)."""
        self._lingering_time = 0.0

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request the parser refused (4xx) is the client's fault: a JSON error like any
        other, logged without a traceback at info (any client can send garbage; the log
        must not fill with error-level lines for it). Faults (5xx) stay aiohttp's."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        what = (message or str(exc) or "unparsable request")[:200]
        log.info("malformed request refused", extra={"status": status, "error": what})
        if request.writer.output_size > 0:
            raise ConnectionError("answer already started: cannot answer the error")
        resp = error_response(
            status, "malformed HTTP request", f"{what}: send well-formed HTTP/1.1"
        )
        resp.force_close()
        # Answered outside the app, whose middleware counts every other request.
        self.metrics.http_requests.labels("other", str(status)).inc()
        return resp


class _Listener:
    """aiohttp's protocol factory under a connection cap. At the cap, idle connections
    (keep-alive, or headers still arriving: a slow-loris) are closed first, oldest
    first, so they cannot lock out real requests; only when none is idle does a new
    connection get a 503. It also cuts connections whose answer no client takes."""

    def __init__(self, runner: web.AppRunner, cap: int, options: dict[str, Any],
                 timeouts: cfg.ServerConfig) -> None:
        self.runner = runner
        self.cap = cap
        self.options = options  # the RequestHandler settings the runner was given
        self.send_timeout = timeouts.send_timeout
        self.body_timeout = timeouts.body_timeout

    def __call__(self) -> asyncio.BaseProtocol:
        server = self.runner.server
        assert server is not None, "called only once the runner is set up"
        conns = server.connections
        if len(conns) >= self.cap:
            # A batch at a time keeps the scan of every connection rare.
            idle = [h for h in conns if isinstance(h, _Connection) and not h.private
                    and h.idle()]
            for h in idle[: max(1, self.cap // 16)]:
                h.force_close()
            if not idle:
                return _Busy()
        return self._connection(server)

    def private(self) -> asyncio.BaseProtocol:
        """A connection of the private socket: never refused at the cap (each serving
        process bounds what it passes on, FORWARD; a refusal there would be a 503 its
        client was already admitted for), never closed as idle (the serving process's
        pool would send its next request on it as it closes)."""
        server = self.runner.server
        assert server is not None, "called only once the runner is set up"
        conn = self._connection(server)
        conn.private = True
        return conn

    def _connection(self, server: web.Server) -> _Connection:
        conn = _Connection(server, loop=asyncio.get_running_loop(), **self.options)
        conn.metrics = self.runner.app[SERVICE].metrics
        return conn

    def _transports(self) -> list[tuple[web.RequestHandler, asyncio.WriteTransport]]:
        server = self.runner.server
        return [
            (h, t)
            for h in (server.connections if server is not None else ())
            if isinstance(t := h.transport, asyncio.WriteTransport)
        ]

    async def watch_writers(self) -> None:
        """Abort connections whose buffered answer has not moved for the send timeout (a
        client that never reads): each would hold its answer in memory, and a connection
        place, for ever. The keep-alive and body timeouts never apply to a send. (A
        download's sendfile has its own timeout: its bytes are not in this buffer.)"""
        stalled: dict[web.RequestHandler, tuple[int, float]] = {}
        loop = asyncio.get_running_loop()
        every = min(WRITE_WATCH_EVERY, self.send_timeout / 2)
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            still: dict[web.RequestHandler, tuple[int, float]] = {}
            for h, t in self._transports():
                size = t.get_write_buffer_size()
                if not size:
                    continue
                last = stalled.get(h)
                since = last[1] if last is not None and last[0] == size else now
                if now - since < self.send_timeout:
                    still[h] = (size, since)
                    continue
                log.info(
                    "cut a connection whose client took nothing of its answer",
                    extra={"seconds": self.send_timeout, "unsent": size},
                )
                t.abort()
            stalled = still

    def abort_all(self) -> int:
        """Abort every open connection (at the end of the shutdown grace): a handler
        stuck writing to one sees it lost and returns. Returns how many there were."""
        open_ = self._transports()
        for _, t in open_:
            t.abort()
        return len(open_)

    @web.middleware
    async def watch_body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Cuts the read of a request body that stalls or trickles (see _StallWatch)."""
        # A serving process cuts a client whose body stalls (408) before the primary, to
        # which it passes that body as it comes, would: the primary waits twice as long,
        # so that it does not answer (and close) first while bytes of it are still on the
        # way. It sees the cut, and counts the request, all the same.
        timeout = self.body_timeout * (2 if forwarded(request) else 1)
        watch = (
            None if request.content.is_eof()
            else _StallWatch(request.content, request.protocol, timeout)
        )
        try:
            return await handler(request)
        finally:
            if watch is not None:
                watch.cancel()


class _StallWatch:
    """Fails the read of a request body (408) that stops arriving for `timeout` seconds
    (server.body_timeout), or that has come slower than BODY_MIN_RATE on average once
    `timeout` has passed: a client that withholds or trickles its body holds no handler
    (and no place in its class of work) for ever."""

    def __init__(self, stream: StreamReader, conn: web.RequestHandler, timeout: float) -> None:
        self.stream = stream
        self.conn = conn
        self.timeout = timeout
        loop = asyncio.get_running_loop()
        self.start = loop.time()
        self.handle = loop.call_later(timeout, self._check, stream.total_bytes)

    def _check(self, seen: int) -> None:
        s = self.stream
        if s.is_eof():
            return
        loop = asyncio.get_running_loop()
        if s.total_bytes == seen:
            self._cut(f"no body bytes for {self.timeout:g}s")
        elif s.total_bytes < BODY_MIN_RATE * (loop.time() - self.start):
            self._cut(f"the body came slower than {BODY_MIN_RATE} bytes/s: send it at once")
        else:
            self.handle = loop.call_later(self.timeout, self._check, s.total_bytes)

    def _cut(self, why: str) -> None:
        self.stream.set_exception(web.HTTPRequestTimeout(text=why))
        if isinstance(self.conn, _Connection):
            self.conn.drop_body()

    def cancel(self) -> None:
        self.handle.cancel()


class _Busy(asyncio.Protocol):
    """The answer to a connection beyond the cap: 503, then close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_BUSY)
        transport.close()


class _UnixGate:
    """The protocol factory of the Unix socket. In open mode (no tokens) a connection
    whose peer uid (SO_PEERCRED) is not in `uids` gets a 403 and none of its requests
    reaches aiohttp; the others go on to the same connection cap as TCP. With tokens,
    tokens decide, as on TCP."""

    def __init__(self, listener: _Listener, service: Service, uids: frozenset[int]) -> None:
        self.listener = listener
        self.service = service
        self.uids = uids

    def __call__(self) -> asyncio.BaseProtocol:
        return _PeerCheck(self)

    def admits(self, transport: asyncio.BaseTransport) -> bool:
        return self.service.tokens.enabled or unix_peer_uid(transport) in self.uids

    def drop_refused(self) -> None:
        """Close the Unix-socket connections a reload to open mode no longer admits (they
        came in with tokens, which no longer exist)."""
        server = self.listener.runner.server
        for h in list(server.connections if server is not None else ()):
            t = h.transport
            if t is not None and unix_peer_uid(t) is not None and not self.admits(t):
                h.force_close()


class _PeerCheck(asyncio.Protocol):
    """A Unix-socket connection's first protocol: it looks at the peer, then hands the
    transport to aiohttp (through the connection cap) or answers 403. A refused client's
    request is read and discarded until it closes (for at most REFUSED_LINGER seconds):
    closing on unread bytes would reset the connection, and the client could lose the
    answer that says why."""

    def __init__(self, gate: _UnixGate) -> None:
        self.gate = gate
        self.linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self.gate.admits(transport):
            inner = self.gate.listener()
            transport.set_protocol(inner)
            inner.connection_made(transport)
            return
        uid = unix_peer_uid(transport)
        log.warning(
            "refused a Unix-socket connection",
            extra={"uid": uid, "fix": "add the uid to server.socket_uids, or use tokens"},
        )
        body = json.dumps(
            {
                "error": "user not allowed on this socket",
                "detail": f"uid {uid} is not in the daemon's server.socket_uids: add it "
                "there, or configure auth.tokens and send a token",
            }
        ).encode()
        transport.write(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        transport.write_eof()
        self.linger = asyncio.get_running_loop().call_later(REFUSED_LINGER, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # a refused client's request: never parsed, never run

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()


def _socket_uids(server: cfg.ServerConfig) -> frozenset[int]:
    """server.socket_uids, by default the daemon's own user and root."""
    return frozenset(server.socket_uids or (os.getuid(), 0))


def _bind_unix(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """A socket bound at `path` with SOCKET_MODE, and the (device, inode) of its file.
    It is bound in a private directory beside `path`, given its mode there, then linked
    into place (link, unlike rename, never replaces what is at `path`): no client ever
    finds it with a looser mode. A socket already at `path` is removed only when nothing
    listens on it (a daemon that died left it); anything else there is refused, untouched."""
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        private = tempfile.mkdtemp(prefix=".cmroot-", dir=os.path.dirname(path))
        tmp = os.path.join(private, "s")
        try:
            sock.bind(tmp)
            os.chmod(tmp, SOCKET_MODE)
            os.link(tmp, path)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            os.rmdir(private)
        st = os.lstat(path)
    except FileExistsError:
        sock.close()
        raise ConfigError(
            f"server.socket {path} appeared while the daemon created it",
            "another process is creating it: stop it or choose another server.socket",
        ) from None
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot create server.socket {path}: {e.strerror}",
            "create its directory, writable by the daemon's user (systemd: "
            "RuntimeDirectory=cmroot for /run/cmroot), or choose another server.socket",
        ) from None
    return sock, (st.st_dev, st.st_ino)


def _remove_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(
            f"server.socket {path} exists and is not a socket",
            "it was left as it is: remove it yourself or choose another server.socket",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(5.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nothing listens: the socket of a daemon that is gone
        return
    except OSError as e:
        raise ConfigError(
            f"cannot tell whether server.socket {path} is in use: {e.strerror}",
            "remove it if no daemon runs, or choose another server.socket",
        ) from None
    finally:
        probe.close()
    raise ConfigError(
        f"another process listens on server.socket {path}",
        "stop it (another cmroot serve?) or choose another server.socket",
    )


def _unlink_if_ours(path: str, ident: tuple[int, int]) -> None:
    """Remove the socket file at stop, unless something else has replaced it since."""
    with suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)


EXPIRE_EVERY = 5.0  # seconds between looks for prepared recycles past their lease


def _scheduler(service: Service, interval: float) -> BackgroundScheduler:
    sched = BackgroundScheduler(timezone="UTC")
    sched.add_job(
        _scheduled_sweep,
        _trigger(interval),
        args=[service],
        id="sweep",
        max_instances=1,
        # A sweep that starts late (a suspended host, a busy scheduler thread) still runs,
        # once: APScheduler's default silently skips a run more than 1 s late.
        coalesce=True,
        misfire_grace_time=None,
        next_run_time=datetime.datetime.now(datetime.timezone.utc),
    )
    # Prepared (two-phase) recycles whose statement died go back within a few seconds of
    # their lease; a separate job, so a long sweep never delays it.
    sched.add_job(
        _expire_prepared,
        IntervalTrigger(seconds=EXPIRE_EVERY),
        args=[service],
        id="expire-prepared",
        max_instances=1,
        coalesce=True,
        misfire_grace_time=None,
    )
    return sched


def _expire_prepared(service: Service) -> None:
    try:
        service.store.expire_prepared()
    except Exception:
        log.exception("rolling back expired prepared recycles failed; retried shortly")


def _trigger(interval: float) -> IntervalTrigger:
    return IntervalTrigger(seconds=interval, jitter=int(min(interval * 0.1, 300)))


def _scheduled_sweep(service: Service) -> None:
    try:
        service.gc()
    except Conflict:
        log.info("scheduled sweep skipped: a sweep asked for by POST /v1/gc is running")
    except Exception:
        pass  # stopped for shutdown, or logged and counted by Service.gc: the next one retries


async def _listen(
    config: cfg.Config, app: web.Application, reuse_port: bool
) -> tuple[web.AppRunner, _Listener, asyncio.Server, ssl.SSLContext | None]:
    """`app` set up and listening on server.host:port, under the connection cap. With
    `reuse_port`, other processes of this daemon listen on the same address (the kernel
    spreads connections over them)."""
    loop = asyncio.get_running_loop()
    options: dict[str, Any] = {
        "access_log": None,
        # A request path may be 4096 characters (warehouse.MAX_PATH); percent-encoded in
        # GET /v1/files it can take several times that. aiohttp's default 8190-byte request
        # line would refuse it with a plain-text 400 before the API could answer.
        "max_line_size": MAX_REQUEST_LINE,
        "keepalive_timeout": config.server.keepalive_timeout,
        # Compressed bodies are refused (415, app._guard) before they are read; left on,
        # the parser would inflate them as they arrive, before any handler could refuse.
        "auto_decompress": False,
    }
    runner = web.AppRunner(
        app, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE, **options
    )
    listener = _Listener(runner, _max_connections(), options, config.server)
    app.middlewares.append(listener.watch_body)  # innermost: the API's errors answer a 408
    await runner.setup()
    tls = _ssl_context(config.server)
    # Our own listening socket rather than a TCPSite: the protocol factory enforces the
    # connection cap before aiohttp spends anything on a connection.
    server = await loop.create_server(
        listener,
        config.server.host,
        config.server.port,
        ssl=tls,
        backlog=BACKLOG,
        reuse_address=True,
        reuse_port=reuse_port or None,
    )
    return runner, listener, server, tls


async def _run(
    config: cfg.Config, service: Service, notifier: Notifier, rundir: str | None
) -> None:
    """The primary process. Given `rundir` (server.processes > 1), it also listens on a
    private socket there for what the serving processes pass on, and runs them."""
    loop = asyncio.get_running_loop()
    # First: a SIGTERM while the rest starts (the serving processes take a second) is a
    # stop once started, not the default death.
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    hup = asyncio.Event()  # a reload asked for meanwhile is made once all has started
    loop.add_signal_handler(signal.SIGHUP, hup.set)
    primary = None if rundir is None else os.path.join(rundir, PRIMARY_SOCKET)
    app = create_app(service, config.server.max_body, private=primary)
    runner, listener, server, tls = await _listen(config, app, rundir is not None)
    workers: Workers | None = None
    inner: asyncio.AbstractServer | None = None
    if rundir is not None and primary is not None:
        # Every request a serving process may pass to the primary at once may open a
        # connection (a burst of new clients): those of its forward class, and GETs of
        # objects it found corrupt (its serve class). A backlog overflowed would fail
        # their connects (the kernel caps it at net.core.somaxconn).
        backlog = (FORWARD.admitted + LIMITS["serve"].admitted) * (config.server.processes - 1)
        inner = await loop.create_unix_server(listener.private, path=primary,
                                              backlog=max(BACKLOG, backlog))
        os.chmod(primary, 0o600)
        port = server.sockets[0].getsockname()[1]
        workers = Workers(config, port, rundir, config.server.processes - 1)
        await workers.start()
    gate: _UnixGate | None = None
    unix: asyncio.AbstractServer | None = None
    socket_path = config.server.socket
    if socket_path:
        gate = _UnixGate(listener, service, _socket_uids(config.server))
        sock, ident = _bind_unix(socket_path)
        unix = await loop.create_unix_server(gate, sock=sock, backlog=BACKLOG)
    sched = _scheduler(service, config.store.interval)
    sched.start()
    log.info(
        "serving",
        extra={
            "addresses": [_address(s.getsockname()) for s in server.sockets],
            "socket": socket_path or None,
            "store": config.store.root,
            "config": config.source,
            "auth": "tokens" if service.tokens.enabled else "loopback-open",
            "max_connections": listener.cap,
            "processes": config.server.processes,
        },
    )
    notifier.notify("READY=1\nSTATUS=serving")

    loop.add_signal_handler(
        signal.SIGHUP, lambda: _reload(config, service, sched, notifier, tls, gate, workers)
    )
    if hup.is_set():
        _reload(config, service, sched, notifier, tls, gate, workers)
    watchdog = (
        asyncio.create_task(_watchdog(notifier, notifier.watchdog_interval))
        if notifier.watchdog_interval
        else None
    )
    writers = asyncio.create_task(listener.watch_writers())
    await stop.wait()

    log.info("stopping: draining in-flight requests")
    notifier.notify("STOPPING=1")
    server.close()  # no new connections; the kernel refuses them from now on
    if unix is not None:
        unix.close()
        _unlink_if_ours(socket_path, ident)
    if workers is not None:
        # They drain first, passing on what their clients still ask meanwhile: the
        # private socket stays open until the last of them has exited.
        await workers.stop(SHUTDOWN_GRACE + SHUTDOWN_ABORT)
    if inner is not None:
        inner.close()
    service.stopping.set()  # a running sweep ends after its current batch
    # The scheduler is stopped from a thread: waiting for its sweep on the event loop
    # would freeze every in-flight request behind it.
    await asyncio.gather(asyncio.to_thread(sched.shutdown, True), _drain(runner, listener))
    # Handlers cut off by the grace period leave their store call running in a worker:
    # each recycle finishes or rolls back before the process exits.
    await loop.run_in_executor(None, service.close)
    writers.cancel()
    if watchdog:
        watchdog.cancel()
    log.info("stopped")


async def _drain(runner: web.AppRunner, listener: _Listener) -> None:
    """aiohttp's graceful shutdown, bounded: it waits up to its timeout for each handler,
    then as long again for the handler it cancelled, and a handler blocked on a client
    that never reads waits for ever. After SHUTDOWN_GRACE the connections still open are
    aborted (their handlers see them lost and return); after SHUTDOWN_ABORT more the
    drain is given up. A store call still running in a worker is waited for by the
    caller (Service.close), so no recycle is left half done."""
    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=SHUTDOWN_GRACE)
    if not done:
        cut = listener.abort_all()
        log.warning(
            "connections still busy after the shutdown grace were cut",
            extra={"connections": cut, "grace": SHUTDOWN_GRACE},
        )
        done, _ = await asyncio.wait({cleanup}, timeout=SHUTDOWN_ABORT)
    if not done:
        log.warning("handlers still running after the shutdown grace; exiting without them")
        cleanup.cancel()
        await asyncio.wait({cleanup})
        return
    await cleanup  # raises what the shutdown raised, if anything


def _address(sockname: tuple[str, int] | tuple[str, int, int, int]) -> str:
    return f"{sockname[0]}:{sockname[1]}"


def _reload(
    config: cfg.Config,
    service: Service,
    sched: BackgroundScheduler,
    notifier: Notifier,
    tls: ssl.SSLContext | None,
    gate: _UnixGate | None,
    workers: Workers | None = None,
) -> None:
    """SIGHUP: re-read the config file; tokens, retention settings, TLS certificates and
    server.socket_uids take effect now (the socket's path, the listen address and
    server.processes at a restart); serving processes reload alike. A bad file is
    logged and ignored: the daemon keeps its settings."""
    notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
    try:
        fresh = cfg.load(None if config.source == "<defaults>" else config.source)
        # Checked first: a refused reload changes nothing, certificates included.
        tokens = _tokens(fresh.auth.tokens, config.server.host)
        if tls is not None:
            _reload_tls(tls, fresh.server)
        if workers is not None:
            # Published before the primary changes anything: a publish that fails leaves
            # every process on the old tokens. What the primary takes of the file (the
            # rest waits for a restart, as here).
            workers.reload(replace(config, auth=fresh.auth, server=replace(
                config.server, tls_cert=fresh.server.tls_cert, tls_key=fresh.server.tls_key)))
        service.tokens = tokens
        if gate is not None:
            gate.uids = _socket_uids(fresh.server)
            gate.drop_refused()
        service.store.reconfigure(
            replace(
                service.store.config,
                retain=fresh.store.retain,
                interval=fresh.store.interval,
                on_expire=fresh.store.on_expire,
                retain_overrides=fresh.store.retain_overrides,
                max_bytes=fresh.store.max_bytes,
                min_retain=fresh.store.min_retain,
            )
        )
        sched.reschedule_job("sweep", trigger=_trigger(fresh.store.interval))
        log.info("reloaded", extra={"config": config.source, "tokens": len(fresh.auth.tokens)})
    except Exception as e:
        log.error("reload failed; keeping the current settings", extra={"error": str(e)})
    notifier.notify("READY=1\nSTATUS=serving")


async def _watchdog(notifier: Notifier, interval: float) -> None:
    """WATCHDOG=1 from the event loop itself: the pings stop only if the loop is wedged.
    Nothing here waits for the worker pool or the store (that is /readyz's business):
    eight slow requests filling the pool must not get the daemon killed mid-recycle."""
    while True:
        notifier.notify("WATCHDOG=1")
        await asyncio.sleep(interval)

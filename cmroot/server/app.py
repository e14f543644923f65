"""The HTTP API of DESIGN.md over a Store. Each route belongs to a class of work (LIMITS)
that admits a bounded number of requests; handlers parse and check input, then run the
store call on their class's threads. The one exception is a small file whose every lookup
and byte the kernel already holds in memory (Store.open_cached): it is answered on the
event loop, and anything that would wait for a disk goes to the threads."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import io
import logging
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
import msgspec
from aiohttp import StreamReader, hdrs, web
from aiohttp.web_urldispatcher import _default_expect_handler
from multidict import CIMultiDict
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)
from yarl import URL

from cmroot import checksum as cks
from cmroot.exceptions import (
    BadRequest,
    ChecksumMismatch,
    CmrootError,
    Conflict,
    DaemonUnavailable,
    Forbidden,
    NotFound,
    OutsideRoots,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from cmroot.metrics import Metrics, StoreCollector
from cmroot.server import schemas
from cmroot.server.auth import Tokens, local_request, loopback_origin
from cmroot.store import RecycleResult, Store, Verified
from cmroot.store.fsck import FsckReport
from cmroot.store.read import LeftCorrupt, WouldBlock
from cmroot.store.sweep import SweepReport

log = logging.getLogger("cmroot.server")
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REFUSED = (BadRequest, Conflict, Forbidden, NotFound)  # refused before anything moved
# Bodies up to this size are decoded on the event loop; larger ones in a worker.
_DECODE_INLINE = 1 << 20
_ENCODER = msgspec.json.Encoder()
# What a refusal outside the roots says: its own detail may name the roots or where a
# symlink leads, which is for the log, not for whoever asked.
_OUTSIDE = (
    "outside the warehouse roots (directly or through a symlink): name a path under one of "
    "the daemon's store.warehouse_roots"
)


class NotReady(Exception):
    """The daemon cannot serve: `part` ("index" or "store") names what failed."""

    def __init__(self, part: str, cause: BaseException) -> None:
        super().__init__(f"{part}: {cause}")
        self.part = part


@dataclass(frozen=True)
class Limit:
    workers: int  # threads of the class's own: its store calls running at once
    admitted: int  # requests admitted at once (running or waiting); one more is a 503


# Classes of work. Threads are partitioned, not shared: downloads waiting for a thread
# never delay a recycle, a resolve hashing originals never delays a download. Each class
# admits a bounded number of requests (a download stays admitted while its bytes go
# out); one more is answered 503 with Retry-After before its body is read, so waiting
# requests cost neither unbounded memory nor a place in another class's queue.
# 18 threads in all, mostly waiting on disks and SQLite; recycle and resolve hash with
# pools of their own (checksum.default_workers) besides.
LIMITS = {
    # recycles, two-phase transactions, POST /v1/events: writes, serialized per
    # transaction and by SQLite's single writer; Spark hooks of concurrent statements
    # queue rather than fail.
    "recycle": Limit(workers=4, admitted=64),
    # each may hash up to resolve.MAX_HASH_BYTES and holds a body up to server.max_body
    "resolve": Limit(workers=2, admitted=16),
    # GET/HEAD /v1/files: a thread opens and checks the file, sendfile does the rest
    "serve": Limit(workers=8, admitted=256),
    # entries, the event log, holds
    "other": Limit(workers=2, admitted=32),
    # POST /v1/gc and /v1/fsck, one of each at a time, each holding its thread to the end:
    # apart, so that replication's reads of the event log never wait behind them
    "maintenance": Limit(workers=2, admitted=4),
    # /metrics and /readyz answer while every other class is full
    "probe": Limit(workers=2, admitted=8),
}
RETRY_AFTER = 1  # seconds a 503 asks the client to wait
# What a request the client abandoned is counted as (nginx's "client closed request");
# its answer is never delivered.
CLIENT_GONE = 499


class WorkClass:
    """One class of work: its threads, and the requests admitted (running or waiting)."""

    def __init__(self, name: str, limit: Limit, workers: int, metrics: Metrics) -> None:
        self.name = name
        self.limit = limit.admitted
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=f"cmroot-{name}")
        self.admitted = 0
        # Counted up and down rather than read by a function at scrape time: processes
        # sharing their metrics add their values up from files, which no function feeds.
        self._depth = metrics.queue_depth.labels(name)
        metrics.queue_limit.labels(name).set(self.limit)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """A place for one request until it is answered; 503 when none is left. Only the
        event loop counts: no lock."""
        if self.admitted >= self.limit:
            raise DaemonUnavailable(
                f"too many {self.name} requests",
                f"the daemon's {self.name} queue is full ({self.limit} running or waiting); "
                f"nothing was done: retry in {RETRY_AFTER} s",
            )
        self.admitted += 1
        self._depth.inc()
        try:
            yield
        finally:
            self.admitted -= 1
            self._depth.dec()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args))


class Service:
    """What the handlers share: the store, tokens, metrics and the classes of work."""

    def __init__(
        self,
        store: Store,
        tokens: Tokens,
        registry: CollectorRegistry,
        workers: int | None = None,
        send_timeout: float = 30.0,
        shared: bool = False,
        classes: Iterable[str] = tuple(LIMITS),
    ) -> None:
        """`workers`, when given, is every class's thread count (small in-process tests).
        `registry` is what GET /metrics reports; `shared`: the daemon's processes share
        their metrics (metrics.share_between_processes), and `registry` reads them back
        from their files (metrics.shared_registry). `classes`: the classes of work it
        admits (a serving process has no recycle class, and must not report its limit)."""
        self.store = store
        self.send_timeout = send_timeout  # server.send_timeout
        self.tokens = tokens
        self.registry = registry
        # prometheus_client adds a `_created` series to each counter and histogram, a
        # timestamp no query here needs that doubles the series stored. The switch is
        # global to the library; the daemon exposes one registry, this one.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        # Shared, the values are read back from their files: the metrics must not also
        # be on the registry a scrape reads, or each would be reported twice.
        self.metrics = Metrics(CollectorRegistry() if shared else registry)
        registry.register(StoreCollector(store))
        self.work = {
            name: WorkClass(name, LIMITS[name], workers or LIMITS[name].workers, self.metrics)
            for name in classes
        }
        self._gc_lock = threading.Lock()
        self._fsck_lock = threading.Lock()
        self.stopping = threading.Event()  # set on SIGTERM: a running sweep ends early
        # Mismatches the store finds (objects quarantined, files changed while served).
        store.reader.on_mismatch = self.metrics.checksum_mismatches.inc

    def gc(self, dry_run: bool = False, files: bool = False, everything: bool = False
           ) -> SweepReport:
        """One sweep at a time, scheduled or asked for: a second one is refused (409), not
        queued behind the first (a queued one would hold a worker for as long). A sweep
        stops between two batches once `stopping` is set. Metrics for real sweeps. A dry
        run names what would go (`files`: the files too; `everything`: housekeeping
        files included)."""
        if not self._gc_lock.acquire(blocking=False):
            raise Conflict(
                "a retention sweep is already running", "try again once it has finished"
            )
        try:
            if dry_run:
                return self.store.gc(dry_run=True, progress=self._stop_if_stopping,
                                     files=files, housekeeping=everything)
            m = self.metrics
            try:
                with m.gc_duration.time():
                    report = self.store.gc(progress=self._stop_if_stopping)
            except DaemonUnavailable:
                log.info("retention sweep stopped for shutdown; the next start resumes it")
                raise
            except Exception:
                m.gc_runs.labels("failure").inc()
                log.exception("retention sweep failed")
                raise
            m.gc_runs.labels("failure" if report.failed else "success").inc()
            m.gc_deleted_objects.inc(report.removed_objects)
            m.gc_deleted_bytes.inc(report.removed_bytes)
            m.gc_evicted_objects.inc(report.evicted_objects)
            m.gc_evicted_bytes.inc(report.evicted_bytes)
            if not report.failed:
                m.gc_last_success.set(self.store.clock())
            log.info(
                "retention sweep",
                extra={
                    "removed": report.removed_objects,
                    "bytes": report.removed_bytes,
                    "failed": report.failed,
                    "skipped": report.skipped,
                    "evicted": report.evicted_objects,
                    "held": report.held_objects,
                    "over_budget_bytes": report.over_budget_bytes,
                },
            )
            return report
        finally:
            self._gc_lock.release()

    def fsck(self, repair: bool) -> FsckReport:
        """One fsck at a time (409 for a second), beside recycles and sweeps: every repair
        is decided again under the lock publishes take (see store/fsck.py)."""
        if not self._fsck_lock.acquire(blocking=False):
            raise Conflict("an fsck is already running", "try again once it has finished")
        try:
            log.info("fsck started", extra={"repair": repair})
            report = self.store.fsck(repair, progress=self._fsck_progress, online=True)
            log.info("fsck finished", extra={"repair": repair, "clean": report.clean,
                                             "checked": report.checked, **report.counts})
            return report
        finally:
            self._fsck_lock.release()

    def _fsck_progress(self, done: int, total: int) -> None:
        if self.stopping.is_set():
            raise DaemonUnavailable(
                "fsck stopped", f"the daemon is shutting down ({done} of {total} shards done)"
            )
        if done % 4096 == 0 or done == total:
            log.info("fsck progress", extra={"shards": done, "of": total})

    def _stop_if_stopping(self, removed: int) -> None:
        """The sweep's progress hook, called after each batch is removed and forgotten:
        raising there leaves no object half swept."""
        if self.stopping.is_set():
            raise DaemonUnavailable(
                "retention sweep stopped", f"the daemon is shutting down ({removed} removed)"
            )

    def ready(self) -> None:
        """Raise NotReady unless the index answers and the store root is writable."""
        try:
            self.store.index.current_event_id()
        except Exception as e:
            raise NotReady("index", e) from e
        if not self.store.layout.writable():
            raise NotReady("store", OSError(f"store {self.store.layout.root} is not writable"))

    def close(self) -> None:
        # Waits for in-flight recycles: each finishes or rolls back, nothing half done.
        for work in self.work.values():
            work.pool.shutdown(wait=True)


def _close_result(cf: Future[Verified]) -> None:
    if not cf.cancelled() and cf.exception() is None:
        cf.result().close()


SERVICE = web.AppKey("service", Service)
# The private socket's path on a primary with serving processes (create_app's `private`).
PRIVATE: web.AppKey[str | None] = web.AppKey("private")
# The route of targets the API has not (a serving process passes them on, the primary
# answers 404 or 405), and how many requests a serving process holds at once while the
# primary answers them.
_UNKNOWN_NAME = "unknown"
FORWARD = Limit(workers=1, admitted=256)
WORK = web.RequestKey("work", WorkClass)  # the class a request was admitted to
INLINE_MAX = 1 << 20  # files up to this size are served from memory, hashed as read
# The last bytes of a sendfile'd response are held back until the descriptor's identity
# is checked again: a file changed while it was sent is cut short, never completed.
_HELD_BACK = 1 << 16
# A download whose client takes nothing for server.send_timeout (30 s) is cut: each
# sendfile call must be done within it. A call sends SEND_CHUNK bytes (a client reading
# less than about 8 KiB/s is taken for one that stopped), or, while the client took each
# piece in under 1/_FAST_SHARE of the timeout, twice the last piece, up to MAX_SEND_CHUNK
# (a client that was reading at 4.5 MB/s then must keep 140 KB/s until that piece is out).
# Buffered writes (small files, JSON answers) are watched by the connection's listener
# with the same timeout.
SEND_CHUNK = 1 << 18
MAX_SEND_CHUNK = 1 << 22
_FAST_SHARE = 64
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def _file_headers(checksum: str, status: str) -> dict[str, str]:
    return {
        hdrs.CONTENT_TYPE: "application/octet-stream",
        hdrs.ETAG: f'"{checksum}"',
        hdrs.ACCEPT_RANGES: "bytes",
        "X-Cmroot-Status": status,
    }


def create_app(service: Service, max_body: int, primary: Primary | None = None,
               private: str | None = None) -> web.Application:
    """The API over `service`. Given `primary` (the primary process, on its private
    socket), the app of a serving process: GET/HEAD /v1/files, POST /v1/resolve and
    /healthz are answered here, from a read-only store; every other request goes to the
    primary (`forward`) under the same route, and the primary answers it: writes, the
    sweep, the metrics of all processes. Given `private`, the app of a primary whose
    serving processes reach it on that socket path."""
    app = web.Application(client_max_size=max_body, middlewares=[_errors, _guard])
    app[SERVICE] = service
    app[PRIVATE] = private
    r = app.router
    forwarder: Handler | None = None
    if primary is not None:
        app[PRIMARY] = primary
        app.on_cleanup.append(lambda _: primary.close())
        # Admitted here as well: what waits on the primary holds a connection and its
        # buffers in this process. The token is the primary's to check.
        forwarding = WorkClass("forward", FORWARD, 1, service.metrics)
        forwarder = app[FORWARDER] = _route(None, forwarding, forward)
    for method, path, scope, work, handler in _api():
        if forwarder is not None and handler not in _LOCAL:
            answer = forwarder
        elif work is None:
            answer = handler  # on the event loop alone: no class to wait for
        else:
            answer = _route(scope, service.work[work], handler)
        if method == hdrs.METH_GET:  # aiohttp answers HEAD from GET routes
            r.add_get(path, answer, expect_handler=_expect)
        else:
            r.add_route(method, path, answer, expect_handler=_expect)
    # Last, so that it takes only what no API route does: a serving process passes it to
    # the primary, the primary answers 404 or 405. A route rather than aiohttp's own
    # not-found answer so that an odd `Expect` on it gets the JSON 417 too, counted.
    anything = _Anything("/", name=_UNKNOWN_NAME)
    r.register_resource(anything)
    anything.add_route("*", forwarder or unknown, expect_handler=_expect)
    return app


class _Anything(web.PlainResource):
    """A resource every target matches, even those no path pattern can (`OPTIONS *`, a
    path whose %0A decodes to a newline): without it aiohttp answers them itself, past
    the middlewares and `_expect`."""

    def _match(self, path: str) -> dict[str, str] | None:
        return {}


def _api() -> list[tuple[str, str, str | None, str | None, Handler]]:
    """Every route: method, path, token scope, class of work, handler."""
    return [
        ("POST", "/v1/recycle", "write", "recycle", recycle),
        ("POST", "/v1/transactions/{txid}/{action:commit|abort|renew}", "write", "recycle",
         transaction),
        ("POST", "/v1/resolve", "read", "resolve", resolve),
        ("GET", "/v1/files", "read", "serve", files),
        ("GET", "/v1/entries", "read", "other", entries),
        ("GET", "/v1/events", "admin", "other", events),
        ("GET", "/v1/events/current", "admin", "other", current_event),
        ("GET", "/v1/events/{id:[0-9]+}/files", "admin", "other", event_files),
        ("POST", "/v1/events", "write", "recycle", add_event),
        ("POST", "/v1/gc", "admin", "maintenance", gc),
        ("POST", "/v1/fsck", "admin", "maintenance", fsck),
        ("GET", "/v1/holds", "read", "other", holds),
        ("POST", "/v1/holds", "admin", "other", add_hold),
        ("DELETE", "/v1/holds/{id}", "admin", "other", remove_hold),
        ("GET", "/metrics", None, "probe", metrics),
        ("GET", "/healthz", None, None, healthz),
        ("GET", "/readyz", None, "probe", readyz),
    ]


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """An `Expect` header: 100-continue as aiohttp answers it, anything else a JSON 417
    (aiohttp's own answer is plain text). Counted here: aiohttp sends what this returns
    without running the middlewares (`_errors`)."""
    try:
        await _default_expect_handler(request)
    except web.HTTPExpectationFailed:
        request.app[SERVICE].metrics.http_requests.labels(_route_name(request), "417").inc()
        return error_response(
            417, "expectation not supported",
            f"Expect: {request.headers.get(hdrs.EXPECT, '')[:100]!r}: only 100-continue is",
        )
    return None


async def unknown(request: web.Request) -> web.StreamResponse:
    """A path no API route has (404), or a method its path does not take (405)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.name != _UNKNOWN_NAME:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def _json(data: Any, status: int = 200) -> web.Response:
    # msgspec writes compact JSON several times faster than the stdlib (10,000-pair
    # resolve answers, pages of the event log).
    return web.Response(body=_ENCODER.encode(data), status=status, content_type="application/json")


def error_response(status: int, message: str, detail: str = "") -> web.Response:
    return _json({"error": message, "detail": detail}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    m = request.app[SERVICE].metrics
    route = _route_name(request)
    if passes_on(request):
        # The primary counts every request it is asked, cut ones included (the metrics
        # are shared): counted here are only those it never saw, refused before.
        resp = await _answer(request, handler, route)
        if not request.get(UPSTREAM, False):
            m.http_requests.labels(route, str(resp.status)).inc()
        return resp
    start = time.perf_counter()
    with m.in_flight.track_inprogress():
        resp = await _answer(request, handler, route)
    if not request.get(UPSTREAM, False):  # one it passed on after all: the primary counts
        m.request_duration.labels(route).observe(time.perf_counter() - start)
        m.http_requests.labels(route, str(resp.status)).inc()
    return resp


def passes_on(request: web.Request) -> bool:
    """Whether this (serving) process passes `request` to the primary."""
    return request.match_info.route.handler is request.app.get(FORWARDER)


def forwarded(request: web.Request) -> bool:
    """Whether a serving process passed `request` on (it came over the private socket)."""
    private = request.app[PRIVATE]
    return private is not None and request.transport is not None and (
        request.transport.get_extra_info("sockname") == private)


def _route_name(request: web.Request) -> str:
    """The route's label in the metrics: its path pattern, `other` for paths the API has
    not."""
    resource = request.match_info.route.resource
    return "other" if resource is None or resource.name == _UNKNOWN_NAME else (
        resource.canonical)


async def _answer(request: web.Request, handler: Handler, route: str) -> web.StreamResponse:
    """The handler's answer, or the JSON error it raised."""
    m = request.app[SERVICE].metrics
    try:
        resp = await handler(request)
    except CmrootError as e:
        if isinstance(e, ChecksumMismatch):
            m.checksum_mismatches.inc()
        # 503 is load, not a fault: counted in cmroot_http_requests_total, not logged
        # once per refused request.
        if e.status >= 500 and e.status != 503:
            log.error("request failed", extra={"route": route, "error": str(e)})
        detail = e.detail
        if _outside_roots(e):
            log.warning("refused: outside the warehouse roots", extra={"error": str(e)})
            detail = _OUTSIDE
        resp = error_response(e.status, e.message, detail)
    except web.HTTPRequestEntityTooLarge as e:
        resp = error_response(413, "request body too large", e.text or "")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = error_response(e.status, e.reason, f"{request.method} {request.path}")
        if hdrs.ALLOW in e.headers:  # a 405 says which methods the path takes
            resp.headers[hdrs.ALLOW] = e.headers[hdrs.ALLOW]
    except ConnectionResetError as e:
        # The client hung up (mid-body, or before its request ran): nobody reads this
        # answer, and it is the client's doing, not the daemon's.
        log.debug("client gone", extra={"route": route, "error": str(e)})
        resp = error_response(CLIENT_GONE, "client closed the connection", str(e))
    except Exception as e:
        log.exception("internal error", extra={"route": route})
        resp = error_response(500, "internal error", type(e).__name__)
    if resp.status == 401:
        resp.headers[hdrs.WWW_AUTHENTICATE] = 'Bearer realm="cmroot"'
    if resp.status == 503:
        resp.headers.setdefault(hdrs.RETRY_AFTER, str(RETRY_AFTER))
    return resp


def _outside_roots(e: BaseException) -> bool:
    """Whether `e` is, or was raised while handling, a path outside the roots (resolve
    wraps it in a 400 naming the pair)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OutsideRoots):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# Unauthenticated, read-only probes: a browser may load them from anywhere.
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Cross-site protection, before auth and before any body is read. A web page can
    send a `text/plain` or form POST to localhost without a CORS preflight: only JSON
    bodies are taken. In open mode (no tokens) a page served from a name rebound to
    127.0.0.1 could read the answers too: only loopback Host names are served; and a
    page's own requests (a bodiless POST /v1/gc) are refused by what the browser says
    of their origin."""
    if request.transport is None:
        # The connection was lost (the client hung up, or it was closed for room) before
        # the request ran: nobody would get the answer, so nothing runs (no phantom).
        raise ConnectionResetError("connection closed before the request ran")
    svc = request.app[SERVICE]
    if not svc.tokens.enabled:
        if not local_request(request.headers.get(hdrs.HOST), request.transport):
            raise Forbidden(
                "Host is not a loopback name",
                "open mode (no auth.tokens) serves only Host localhost, 127.0.0.0/8 or "
                "[::1]; configure tokens to serve other names",
            )
        if request.path not in _PROBES:
            _refuse_cross_site(request)
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding != "identity":
        # Inflating a body multiplies what it costs (a 1 MiB gzip of spaces is 1 GiB);
        # the parser does not inflate (auto_decompress off), and no client compresses.
        raise UnsupportedMediaType(
            "compressed request bodies are not accepted",
            f"Content-Encoding {encoding[:50]!r}: send the body uncompressed (identity)",
        )
    # A POST without body or Content-Type (POST /v1/gc) has nothing a page could forge.
    has_body = request.body_exists or hdrs.CONTENT_TYPE in request.headers
    is_json = request.content_type == "application/json" and (
        (request.charset or "utf-8").lower() == "utf-8"
    )
    if request.method == hdrs.METH_POST and has_body and not is_json:
        raise UnsupportedMediaType(
            "unsupported Content-Type",
            f"{request.headers.get(hdrs.CONTENT_TYPE, 'none')[:100]!r}: send the body as "
            "Content-Type: application/json (UTF-8)",
        )
    return await handler(request)


def _refuse_cross_site(request: web.Request) -> None:
    """In open mode, a request a browser sent for another site's page is 403. Browsers
    name that site (Origin) and say how it relates (Sec-Fetch-Site) on every cross-origin
    request, even one a page cannot read the answer of; the CLI and Client send neither."""
    site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
    origin = request.headers.get(hdrs.ORIGIN)
    if site in ("cross-site", "same-site") or (
        origin is not None and not loopback_origin(origin)
    ):
        raise Forbidden(
            "cross-site request refused",
            f"sent by a web page (Origin {(origin or 'unknown')[:100]!r}, Sec-Fetch-Site "
            f"{site or 'unknown'!r}): open mode (no auth.tokens) takes requests from local "
            "programs only; configure tokens for anything else",
        )


def _route(scope: str | None, work: WorkClass, handler: Handler) -> Handler:
    """`handler` behind its token scope (None: open to all) and its class of work. The
    token is checked first (a refused client takes no place), then a place is taken,
    before the body is read: a request refused 503 has cost nothing."""

    async def admitted(request: web.Request) -> web.StreamResponse:
        if scope is not None:
            request.app[SERVICE].tokens.check(request.headers.get(hdrs.AUTHORIZATION), scope)
        with work.admit():
            request[WORK] = work
            return await handler(request)

    return admitted


async def _run(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread of the request's class of work."""
    return await request[WORK].run(fn, *args)


async def _body(request: web.Request, cls: type[schemas.S]) -> schemas.S:
    """The request body decoded and checked as `cls` (see schemas)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise PayloadTooLarge(
            "request body too large", f"at most {request.app._client_max_size} bytes"
        ) from e
    if len(raw) <= _DECODE_INLINE:
        return schemas.decode(raw, cls)
    return await _run(request, schemas.decode, raw, cls)


def _query(request: web.Request, cls: type[schemas.S]) -> schemas.S:
    return schemas.decode_query(request.query.items(), cls)


async def recycle(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request, schemas.RecycleBody)
    req = body.request()
    if body.prepare or body.txid is not None or body.lease is not None:
        if not body.prepare:
            raise BadRequest(
                "txid or lease without prepare",
                'set "prepare": true for a two-phase recycle (a plain one has no lease)',
            )
        prepared = await _counted(request, svc.store.prepare, req, body.lease, body.txid)
        log.info("prepared", extra={"txid": prepared.txid, "op": req.op, "db": req.db,
                                    "table": req.table, "files": len(prepared.files)})
        return _json(prepared.to_json())
    result = await _counted(request, svc.store.recycle, req)
    _recycled(svc, result.op, result)
    log.info(
        "recycled",
        extra={
            "event_id": result.event_id,
            "op": req.op,
            "files": len(result.files),
            "db": req.db,
            "table": req.table,
        },
    )
    return _json(result.to_json())


async def _counted(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """Run a store write, counting failures that are not plain refusals."""
    try:
        return await _run(request, fn, *args)
    except _REFUSED:
        raise
    except Exception:
        request.app[SERVICE].metrics.recycle_errors.inc()
        raise


def _recycled(svc: Service, op: str, result: RecycleResult) -> None:
    svc.metrics.recycled_files.labels(op).inc(len(result.files))
    svc.metrics.recycled_bytes.labels(op).inc(sum(f.size for f in result.files))


async def transaction(request: web.Request) -> web.Response:
    """POST /v1/transactions/{txid}/commit|abort|renew: the second phase."""
    svc = request.app[SERVICE]
    txid, action = request.match_info["txid"], request.match_info["action"]
    if action == "commit":
        result = await _counted(request, svc.store.commit, txid)
        if not result.again:
            _recycled(svc, result.op, result)
        log.info("committed", extra={"txid": txid, "event_id": result.event_id,
                                     "files": len(result.files)})
        return _json(result.to_json())
    if action == "abort":
        displaced = await _counted(request, svc.store.abort, txid)
        log.info("aborted", extra={"txid": txid, "displaced": len(displaced)})
        return _json({"txid": txid, "aborted": True, "displaced": displaced})
    body = await _body(request, schemas.RenewBody) if request.can_read_body else None
    expires = await _run(request, svc.store.renew, txid, body.lease if body else None)
    return _json({"txid": txid, "expires": expires})


async def resolve(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request, schemas.ResolveBody)
    out = await _run(request, svc.store.resolve, body.pairs())
    counts: dict[str, int] = {}
    for r in out:
        counts[r.status] = counts.get(r.status, 0) + 1
    for status, n in counts.items():
        svc.metrics.resolve.labels(status).inc(n)
    return _json({"files": out})  # Resolution structs, encoded as they are


async def files(request: web.Request) -> web.StreamResponse:
    """The bytes of (path, checksum), from the descriptor the store verified (invariant 3):
    small files from memory (read and hashed in one go), larger ones by sendfile from that
    descriptor. One Range (also suffix and open-ended) answers 206, or 416 when it starts
    past the end; If-None-Match on the checksum ETag answers 304."""
    svc = request.app[SERVICE]
    q = _query(request, schemas.FilesQuery)
    try:
        # Small files found in the kernel's caches are answered here: a hop to a thread
        # and back costs more than the whole lookup (it halved GETs of 64 KiB objects).
        v = svc.store.open_cached(q.path, q.checksum, INLINE_MAX)
    except WouldBlock:
        try:
            v = await _open_verified(request, q.path, q.checksum)
        except LeftCorrupt:
            if PRIMARY not in request.app:
                raise
            # Found corrupt by this read-only serving process: the primary alone may
            # quarantine the object, so it is asked the same, and answers (once moved,
            # no process meets it again).
            return await forward(request)
    try:
        return await _serve(request, svc, v)
    finally:
        v.close()


async def _open_verified(request: web.Request, path: str, checksum: str) -> Verified:
    """Store.open_verified on a thread of the request's class. If the request is
    cancelled (the client went away) while the thread runs, the descriptor it opens is
    closed when it is done."""
    store = request.app[SERVICE].store
    cf = request[WORK].pool.submit(store.open_verified, path, checksum, INLINE_MAX)
    try:
        return await asyncio.wrap_future(cf)
    except asyncio.CancelledError:
        cf.add_done_callback(_close_result)
        raise


async def _serve(request: web.Request, svc: Service, v: Verified) -> web.StreamResponse:
    headers = _file_headers(v.checksum, v.status)
    etag = f'"{v.checksum}"'
    if _etag_in(request.headers.get(hdrs.IF_NONE_MATCH), etag):
        return web.Response(status=304, headers={hdrs.ETAG: etag})
    first, count, status = 0, v.size, 200
    if_range = request.headers.get(hdrs.IF_RANGE)
    raw_range = request.headers.get(hdrs.RANGE)
    if raw_range is not None and (if_range is None or if_range.strip() == etag):
        rng = _byte_range(raw_range, v.size)
        if rng is False:
            refused = error_response(
                416, "range not satisfiable", f"{raw_range!r}: the file has {v.size} bytes"
            )
            refused.headers[hdrs.CONTENT_RANGE] = f"bytes */{v.size}"
            return refused
        if rng is not None:
            first, count, status = rng[0], rng[1] - rng[0] + 1, 206
            headers[hdrs.CONTENT_RANGE] = f"bytes {rng[0]}-{rng[1]}/{v.size}"
    if v.data is not None and request.method != hdrs.METH_HEAD:
        resp: web.StreamResponse = web.Response(
            body=v.data[first : first + count], status=status, headers=headers
        )
    else:
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = count
        await resp.prepare(request)
        if request.method != hdrs.METH_HEAD and count:
            try:
                await _send_fd(request, resp, svc, v, first, count)
            except ConnectionError:
                # The client went away, or the answer was cut short (logged): nothing is
                # left to answer, and a download dropped half way is not a daemon error.
                return resp
        await resp.write_eof()
    if request.method == hdrs.METH_GET:
        svc.metrics.served_bytes.inc(count)
    return resp


def _etag_in(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or etag in tags or f"W/{etag}" in tags


def _byte_range(header: str, size: int) -> tuple[int, int] | Literal[False] | None:
    """(first, last) of a single byte range; None to ignore the header (not one range we
    can parse: RFC 9110 lets a server answer 200 then); False when unsatisfiable."""
    m = _RANGE.fullmatch(header.replace(" ", ""))
    if m is None or m.group(1) == m.group(2) == "":
        return None
    a, b = m.groups()
    if a == "":
        n = _position(b)
        if n == 0 or size == 0:
            return False
        return max(0, size - n), size - 1
    first = _position(a)
    if b and _position(b) < first:
        return None
    if first >= size:
        return False
    return first, min(_position(b) if b else size - 1, size - 1)


def _position(digits: str) -> int:
    """A byte position of a Range header. One past any file's size (no file reaches 10**18
    bytes) stands for itself, however many digits it has: Python's int() refuses more
    than 4300 (ValueError), and a client could send thousands."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else sys.maxsize


async def _send_fd(
    request: web.Request, resp: web.StreamResponse, svc: Service, v: Verified, first: int,
    count: int,
) -> None:
    """Send `count` bytes from `first` of the verified descriptor: sendfile where the
    transport has it (as aiohttp's FileResponse does), else pread in chunks. The tail is
    held back until the descriptor is known unchanged (or re-hashes to the checksum):
    a file a writer changed meanwhile is cut short, so no complete wrong body goes out."""
    loop = asyncio.get_running_loop()
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("connection lost")
    head = count - min(count, _HELD_BACK)
    sent = 0
    f = io.FileIO(v.fd, "rb", closefd=False)
    try:
        # A piece at a time, each bounded by the send timeout: a client that stops reading
        # would otherwise park this handler (and its place in the serve class) for ever.
        chunk = SEND_CHUNK
        while sent < head:
            if transport.is_closing():  # asyncio's sendfile raises RuntimeError on it
                raise ConnectionResetError("connection lost")
            n = min(chunk, head - sent)
            started = loop.time()
            await _sending(transport, loop.sendfile(transport, f, first + sent, n),
                           svc.send_timeout)
            sent += n
            # Each sendfile call costs several turns of the loop: a client that took the
            # last piece in a small fraction of the timeout gets a piece twice as big
            # (GB/s downloads were bound by that, not by the copy), one that took longer
            # goes back to the smallest.
            fast = loop.time() - started < svc.send_timeout / _FAST_SHARE
            chunk = min(chunk * 2, MAX_SEND_CHUNK) if fast else SEND_CHUNK
    except NotImplementedError:
        await _write_chunks(request, resp, v, first + sent, head - sent)
    finally:
        f.close()
    tail = await _run(request, _tail_if_unchanged, svc, v, first + head, count - head)
    if tail is None:
        transport.abort()
        raise ConnectionResetError("file changed while served")
    await resp.write(tail)


async def _sending(transport: asyncio.Transport, sending: Awaitable[T], timeout: float) -> T:
    """`sending` (a write), or the connection aborted once it has waited `timeout`
    seconds for the client: ConnectionResetError then, like any client that went away."""
    try:
        return await asyncio.wait_for(sending, timeout)
    except asyncio.TimeoutError:
        transport.abort()
        raise ConnectionResetError(f"the client took nothing for {timeout:g}s") from None


async def _write_chunks(
    request: web.Request, resp: web.StreamResponse, v: Verified, offset: int, count: int
) -> None:
    end = offset + count
    while offset < end:
        chunk = await _run(request, v.pread, min(1 << 18, end - offset), offset)
        if not chunk:
            raise ConnectionResetError("file shrank while served")
        await resp.write(chunk)
        offset += len(chunk)


def _tail_if_unchanged(svc: Service, v: Verified, offset: int, count: int) -> bytes | None:
    """The last bytes of a response, or None if the file no longer holds the verified
    bytes (counted and logged as a mismatch: the response is then cut short)."""
    if not v.unchanged():
        # Identity moved (a link count change moves ctime too): look at the bytes.
        got, _ = cks.of_fd(v.fd)
        if got != v.checksum:
            log.error(
                "checksum mismatch: file changed while served; response cut short",
                extra={"checksum": v.checksum, "status": str(v.status)},
            )
            if svc.store.reader.on_mismatch is not None:
                svc.store.reader.on_mismatch()
            return None
    tail = os.pread(v.fd, count, offset)
    return tail if len(tail) == count else None


async def entries(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    q = _query(request, schemas.EntriesQuery)
    rows = await _run(
        request, svc.store.listing, q.db, q.table, q.limit, q.cursor or None, q.all
    )
    return _json({"entries": rows, "cursor": rows[-1]["id"] if len(rows) == q.limit else None})


async def events(request: web.Request) -> web.Response:
    """A page of the log: at most `limit` events and PAGE_BYTES of JSON. An event whose
    files do not fit carries `filesNext` (see `event_files`); `next` is the `from` of the
    following page, `more` whether events at or past it exist."""
    svc = request.app[SERVICE]
    q = _query(request, schemas.EventsQuery)
    return _json(await _run(request, svc.store.index.events_page, q.start, q.limit))


async def event_files(request: web.Request) -> web.Response:
    """The files of one event with seq > `after`, at most `limit` and PAGE_BYTES of JSON;
    `filesNext` is the `after` of the next page, null after the last file."""
    svc = request.app[SERVICE]
    raw = request.match_info["id"]
    event_id = int(raw) if len(raw) <= 18 else 0
    q = _query(request, schemas.EventFilesQuery)
    page = await _run(request, svc.store.index.event_files_page, event_id, q.after, q.limit)
    if page is None:
        raise NotFound("no such event", f"event {raw} is not in the log")
    return _json(page)


async def current_event(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    _query(request, schemas.NoQuery)
    index = svc.store.index
    return _json({"id": await _run(request, index.current_event_id),
                  "log": await _run(request, index.log_id)})


async def add_event(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request, schemas.EventBody)
    table_obj = body.table_obj()
    event_id = await _run(
        request,
        svc.store.add_event,
        body.type,
        body.db,
        body.table,
        body.partitions or [],
        [f.to_dict() for f in body.files or []],
        body.server,
        body.location,
        table_obj,
        body.partitionLocations,
        body.audit.to_dict() if body.audit is not None else None,
    )
    return _json({"id": event_id})


async def gc(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    q = _query(request, schemas.GcQuery)
    if (q.files or q.all) and not q.dry_run:
        raise BadRequest("files and all go with dry_run",
                         "a real sweep reports counts; ask dry_run=true&files=true for names")
    report = await _run(request, svc.gc, q.dry_run, q.files, q.all)
    return _json(report.to_json())


_HOLD_ID = re.compile(r"[1-9][0-9]{0,17}")


async def holds(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    q = _query(request, schemas.HoldsQuery)
    rows = await _run(request, svc.store.holds, q.all)
    return _json({"holds": [h.to_json() for h in rows]})


async def add_hold(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request, schemas.HoldBody)
    hold = await _run(request, svc.store.add_hold, body.db, body.table, body.until, body.reason)
    return _json(hold.to_json())


async def remove_hold(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    _query(request, schemas.NoQuery)
    raw = request.match_info["id"]
    if not _HOLD_ID.fullmatch(raw):  # ASCII digits only: int() reads other scripts' too
        raise BadRequest("bad hold id", f"{raw[:50]!r}: give the number `cmroot hold ls` shows")
    await _run(request, svc.store.remove_hold, int(raw))
    return _json({"removed": int(raw)})


async def fsck(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    report = await _run(request, svc.fsck, _query(request, schemas.FsckQuery).repair)
    return _json(report.to_json())


class Primary:
    """The primary process as a serving process reaches it: HTTP over its private Unix
    socket. Idle connections are let go well before the primary's keep-alive timeout
    would close them, so a request is never sent on one the primary is closing."""

    def __init__(self, path: str, keepalive: float) -> None:
        self.path = path
        self.keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on the event loop, at the first request
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(
                    self.path, limit=0, keepalive_timeout=self.keepalive / 3
                ),
                # A sweep or an fsck answers after hours: the primary's own timeouts bound
                # what it waits for, not this client.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
                skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING,
                                   hdrs.CONTENT_TYPE),
            )
        return self._session

    @staticmethod
    def url(rel: URL) -> URL:
        """`rel` (path and query as the client spelled them) on the primary's socket."""
        return URL.build(scheme="http", host="primary", path=rel.raw_path,
                         query_string=rel.raw_query_string, encoded=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


PRIMARY = web.AppKey("primary", Primary)
FORWARDER: web.AppKey[Handler] = web.AppKey("forwarder")
UPSTREAM = web.RequestKey("upstream", bool)  # the primary saw it, and counts it
# Headers about one connection, not the request: never passed on (RFC 9110 7.6.1).
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade",
})


def _end_to_end(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


async def forward(request: web.Request) -> web.StreamResponse:
    """A request a serving process does not answer itself, passed to the primary as it
    came (method, path and query, headers, the body as it arrives), and the primary's
    answer passed back as it comes. An answer cut short is cut short here too (the
    connection is aborted), never completed."""
    if not request.rel_url.raw_path.startswith("/"):
        return await unknown(request)  # `OPTIONS *`: no path to pass on, none to find
    upstream = request.app[PRIMARY]
    body = _passed_on(request.content) if request.body_exists else None
    try:
        answer = await upstream.session().request(
            request.method, upstream.url(request.rel_url), headers=_end_to_end(request.headers),
            data=body, allow_redirects=False,
        )
    except aiohttp.ClientConnectorError as e:
        raise DaemonUnavailable(
            "the daemon's primary process is not answering",
            f"{e.strerror or e}: nothing was done; retry in {RETRY_AFTER} s",
        ) from None
    except aiohttp.ClientError as e:
        cut = request.content.exception()
        if cut is not None:
            # The client hung up mid-body: the primary sees its request cut too, and
            # counts it. Nothing was done.
            request[UPSTREAM] = True
            raise cut from None
        if isinstance(e, aiohttp.ConnectionTimeoutError) or (
            isinstance(e, aiohttp.ClientOSError) and e.errno == errno.ENOTCONN
        ):
            # The connect never completed (asyncio takes a full Unix listen backlog's
            # EAGAIN for a connect in progress): the primary never saw the request.
            raise DaemonUnavailable(
                "the daemon's primary process is not answering",
                f"too many connections at once: nothing was done; retry in {RETRY_AFTER} s",
            ) from None
        raise DaemonUnavailable(
            "the daemon's primary process went away while asked",
            f"{type(e).__name__}: {e}; whether it did what was asked is not known: look"
            " (GET /v1/events, /v1/entries) before asking again",
        ) from None
    request[UPSTREAM] = True
    async with answer:
        resp = web.StreamResponse(status=answer.status, reason=answer.reason,
                                  headers=_end_to_end(answer.headers))
        await resp.prepare(request)
        try:
            async for chunk in answer.content.iter_any():
                await resp.write(chunk)
        except aiohttp.ClientError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the primary's answer was cut short") from None
        await resp.write_eof()
    return resp


async def _passed_on(content: StreamReader) -> AsyncIterator[bytes]:
    """The client's body as it arrives, after an empty first piece: that sends the
    request's headers at once (aiohttp's client would hold them for the first body
    byte), so that the primary sees, watches and counts a body that never starts."""
    yield b""
    async for chunk in content.iter_chunked(1 << 16):
        yield chunk


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _run(request, generate_latest, svc.registry)
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    try:
        await _run(request, svc.ready)
    except NotReady as e:
        # Unauthenticated: the answer names the part, the log has the paths and errors.
        log.warning("not ready", extra={"part": e.part, "error": str(e)})
        return error_response(503, f"not ready: {e.part}", "see the daemon's log")
    return _json({"status": "ready"})


_LOCAL = frozenset({resolve, files, healthz})  # what serving processes answer themselves

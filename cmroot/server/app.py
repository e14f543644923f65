"""The HTTP API of DESIGN.md over a Store. Handlers parse and check input, then run the
store call in a thread pool: no file or hashing work happens on the event loop."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from cmroot import checksum as cks
from cmroot.exceptions import (
    BadRequest,
    ChecksumMismatch,
    CmrootError,
    Forbidden,
    NotFound,
    PayloadTooLarge,
)
from cmroot.metrics import Metrics, StoreCollector
from cmroot.server.auth import Tokens
from cmroot.store import FileRef, RecycleRequest, Store
from cmroot.store.sweep import SweepReport

log = logging.getLogger("cmroot.server")
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_PAGE = 1000
VERIFIED_CACHE = 100_000  # objects whose verification is remembered
_REFUSED = (BadRequest, Forbidden, NotFound)  # refused before anything moved


class Service:
    """What the handlers share: the store, tokens, metrics and the worker threads."""

    def __init__(
        self, store: Store, tokens: Tokens, registry: CollectorRegistry, workers: int = 8
    ) -> None:
        self.store = store
        self.tokens = tokens
        self.registry = registry
        self.metrics = Metrics(registry)
        registry.register(StoreCollector(store.index))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="cmroot-store")
        self._gc_lock = threading.Lock()
        # checksum -> (inode, size, mtime_ns) of an object whose bytes were last verified
        self._verified: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._verified_lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kw))

    def gc(self, dry_run: bool = False) -> SweepReport:
        """One sweep at a time, whether scheduled or asked for; metrics for real ones."""
        with self._gc_lock:
            if dry_run:
                return self.store.gc(dry_run=True)
            m = self.metrics
            try:
                with m.gc_duration.time():
                    report = self.store.gc()
            except Exception:
                m.gc_runs.labels("failure").inc()
                log.exception("retention sweep failed")
                raise
            m.gc_runs.labels("failure" if report.failed else "success").inc()
            m.gc_deleted_objects.inc(len(report.removed))
            m.gc_deleted_bytes.inc(report.removed_bytes)
            if not report.failed:
                m.gc_last_success.set(self.store.clock())
            log.info(
                "retention sweep",
                extra={
                    "removed": len(report.removed),
                    "bytes": report.removed_bytes,
                    "failed": len(report.failed),
                    "skipped": report.skipped,
                },
            )
            return report

    def verify_object(self, checksum: str, path: str) -> None:
        """Raise ChecksumMismatch unless the object's bytes hash to its name. Objects are
        immutable once published, so one that was verified and has not changed inode,
        size or mtime since is not re-read: a replication job's many Range reads of one
        large object cost one hash, not one each. (Silent bit rot is fsck's job.)"""
        try:
            st = os.stat(path)
        except FileNotFoundError:  # swept since it was located
            raise NotFound("no such file", f"object {checksum} is no longer in the store") from None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._verified_lock:
            if self._verified.get(checksum) == key:
                self._verified.move_to_end(checksum)
                return
        self.store.verify_object(checksum)
        with self._verified_lock:
            self._verified[checksum] = key
            while len(self._verified) > VERIFIED_CACHE:
                self._verified.popitem(last=False)

    def fetch(self, path: str, checksum: str, inline: bool) -> tuple[FileRef, bytes | None]:
        """Find the bytes of (path, checksum), verified (invariant 3), in one worker call.
        A small local file is read and hashed here when `inline`: serving it from memory
        costs far less than a sendfile round trip; anything else is left to sendfile."""
        ref = self.store.locate(path, checksum)
        if inline and cks.is_local(ref.fs) and ref.size <= INLINE_MAX:
            try:
                with open(ref.path, "rb") as f:
                    data = f.read(ref.size + 1)
            except FileNotFoundError:  # swept or replaced since it was located
                raise NotFound("no such file", f"{path} with checksum {checksum} is gone") from None
            if cks.of_bytes(data) != checksum:
                raise ChecksumMismatch(
                    "stored object is corrupt" if ref.status == "cmroot" else "original changed",
                    f"{ref.path} no longer hashes to {checksum}; not served",
                )
            return ref, data
        if ref.status == "cmroot":
            self.verify_object(checksum, ref.path)
        return ref, None

    def ready(self) -> None:
        """Raise unless the index answers and the store root is writable."""
        self.store.index.current_event_id()
        if not os.access(self.store.layout.staging, os.W_OK):
            raise OSError(f"store {self.store.layout.root} is not writable")

    def close(self) -> None:
        # Waits for in-flight recycles: each finishes or rolls back, nothing half done.
        self.pool.shutdown(wait=True)


SERVICE = web.AppKey("service", Service)
INLINE_MAX = 1 << 20  # files up to this size are served from memory, hashed as read
# Requests aiohttp's FileResponse answers specially (ranges, conditionals): not inlined.
_CONDITIONAL_HEADERS = (
    hdrs.RANGE,
    hdrs.IF_MATCH,
    hdrs.IF_NONE_MATCH,
    hdrs.IF_MODIFIED_SINCE,
    hdrs.IF_UNMODIFIED_SINCE,
    hdrs.IF_RANGE,
)


def _file_headers(checksum: str, status: str) -> dict[str, str]:
    return {
        hdrs.CONTENT_TYPE: "application/octet-stream",
        hdrs.ETAG: f'"{checksum}"',
        hdrs.ACCEPT_RANGES: "bytes",
        "X-Cmroot-Status": status,
    }


def create_app(service: Service, max_body: int) -> web.Application:
    app = web.Application(client_max_size=max_body, middlewares=[_errors])
    app[SERVICE] = service
    r = app.router
    r.add_post("/v1/recycle", _scoped("write", recycle))
    r.add_post("/v1/resolve", _scoped("read", resolve))
    r.add_get("/v1/files", _scoped("read", files))  # aiohttp answers HEAD from GET routes
    r.add_get("/v1/entries", _scoped("read", entries))
    r.add_get("/v1/events", _scoped("admin", events))
    r.add_get("/v1/events/current", _scoped("admin", current_event))
    r.add_post("/v1/events", _scoped("write", add_event))
    r.add_post("/v1/gc", _scoped("admin", gc))
    r.add_get("/metrics", metrics)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    return app


def _json(data: Any, status: int = 200) -> web.Response:
    # Compact separators: a 10,000-pair resolve answer is 10% smaller and faster to write.
    return web.Response(
        text=json.dumps(data, separators=(",", ":")), status=status, content_type="application/json"
    )


def _error(status: int, message: str, detail: str = "") -> web.Response:
    return _json({"error": message, "detail": detail}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    m = request.app[SERVICE].metrics
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else "other"
    )
    try:
        resp = await handler(request)
    except CmrootError as e:
        if isinstance(e, ChecksumMismatch):
            m.checksum_mismatches.inc()
        if e.status >= 500:
            log.error("request failed", extra={"route": route, "error": str(e)})
        resp = _error(e.status, e.message, e.detail)
    except web.HTTPRequestEntityTooLarge as e:
        resp = _error(413, "request body too large", e.text or "")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _error(e.status, e.reason, f"{request.method} {request.path}")
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        log.exception("internal error", extra={"route": route})
        resp = _error(500, "internal error", type(e).__name__)
    m.http_requests.labels(route, str(resp.status)).inc()
    return resp


def _scoped(scope: str, handler: Handler) -> Handler:
    async def checked(request: web.Request) -> web.StreamResponse:
        request.app[SERVICE].tokens.check(request.headers.get(hdrs.AUTHORIZATION), scope)
        return await handler(request)

    return checked


async def _body(request: web.Request, fields: set[str]) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise PayloadTooLarge(
            "request body too large", f"at most {request.app._client_max_size} bytes"
        ) from e
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest("malformed JSON", str(e)) from None
    if not isinstance(body, dict):
        raise BadRequest("malformed request", "the body must be a JSON object")
    unknown = set(body) - fields
    if unknown:
        raise BadRequest(
            "unknown fields", f"{', '.join(sorted(unknown))}; known: {', '.join(sorted(fields))}"
        )
    return body


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"bad {name}", f"{raw!r} is not an integer") from None
    if not low <= value <= high:
        raise BadRequest(f"bad {name}", f"{value} is outside {low}..{high}")
    return value


def _bool_query(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise BadRequest(f"bad {name}", f"{raw!r}: use true or false")
    return raw in ("true", "1")


async def recycle(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(
        request, {"paths", "mode", "purge", "op", "db", "table", "partitions", "location"}
    )
    for name in ("mode", "op"):
        # RecycleRequest.validate tests these against frozensets: a list would raise
        # TypeError (unhashable) and answer 500 instead of 400.
        if name in body and not isinstance(body[name], str):
            raise BadRequest(f"bad {name}", f"{body[name]!r}: give a string")
    req = RecycleRequest(
        paths=body.get("paths") or [],
        mode=body.get("mode", "move"),
        purge=body.get("purge", False),
        op=body.get("op", ""),
        db=body.get("db"),
        table=body.get("table"),
        partitions=body.get("partitions") or [],
        location=body.get("location"),
    )
    req.validate()
    try:
        result = await svc.run(svc.store.recycle, req)
    except _REFUSED:
        raise
    except Exception:
        svc.metrics.recycle_errors.inc()
        raise
    svc.metrics.recycled_files.labels(req.op).inc(len(result.files))
    svc.metrics.recycled_bytes.labels(req.op).inc(sum(f.size for f in result.files))
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


async def resolve(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request, {"files"})
    out = await svc.run(svc.store.resolve, body.get("files"))
    counts: dict[str, int] = {}
    for r in out:
        counts[r.status] = counts.get(r.status, 0) + 1
    for status, n in counts.items():
        svc.metrics.resolve.labels(status).inc(n)
    return _json({"files": [r.to_json() for r in out]})


class _ObjectFile(web.FileResponse):
    """A FileResponse that serves exactly the file named (aiohttp would otherwise pick a
    `.gz`/`.br` sibling when the client accepts compression) and whose ETag is the
    checksum, which identifies the bytes better than mtime and size."""

    def __init__(self, path: str, checksum: str, status: str) -> None:
        super().__init__(
            path,
            chunk_size=1 << 18,
            headers=_file_headers(checksum, status),
        )
        self._checksum = checksum

    async def prepare(self, request: web.BaseRequest) -> Any:
        # The handler prepares (sends) the file itself to count the bytes served; aiohttp
        # then calls prepare again, which FileResponse (unlike StreamResponse) does not
        # guard against: it would try to send the file a second time and fail.
        if self.prepared:
            return None
        return await super().prepare(request)

    def _get_file_path_stat_encoding(self, accept_encoding: str) -> Any:
        st = self._path.stat()
        return (self._path if stat.S_ISREG(st.st_mode) else None), st, None

    @property
    def etag(self) -> Any:
        return super().etag

    @etag.setter
    def etag(self, value: Any) -> None:
        self._headers[hdrs.ETAG] = f'"{self._checksum}"'


async def files(request: web.Request) -> web.StreamResponse:
    svc = request.app[SERVICE]
    path, checksum = request.query.get("path"), request.query.get("checksum")
    if path is None or checksum is None:
        raise BadRequest("missing query parameter", "give ?path=...&checksum=...")
    inline = request.method == hdrs.METH_GET and not any(
        h in request.headers for h in _CONDITIONAL_HEADERS
    )
    ref, body = await svc.run(svc.fetch, path, checksum, inline)
    if body is not None:
        headers = _file_headers(checksum, ref.status)
        resp: web.StreamResponse = web.Response(body=body, headers=headers)
    elif cks.is_local(ref.fs):
        resp = _ObjectFile(ref.path, checksum, ref.status)
        await resp.prepare(request)
    else:
        resp = await _stream_remote(request, svc, ref.fs, ref.path, ref.size, checksum, ref.status)
    if request.method == hdrs.METH_GET and resp.status in (200, 206):
        svc.metrics.served_bytes.inc(resp.content_length or 0)
    return resp


async def _stream_remote(
    request: web.Request, svc: Service, fs: Any, path: str, size: int, checksum: str, status: str
) -> web.StreamResponse:
    """An original on another filesystem: streamed through, whole (no Range)."""
    headers = _file_headers(checksum, status)
    del headers[hdrs.ACCEPT_RANGES]
    resp = web.StreamResponse(headers=headers)
    resp.content_length = size
    await resp.prepare(request)
    if request.method == hdrs.METH_HEAD:
        return resp
    f = await svc.run(fs.open, path, "rb")
    try:
        while chunk := await svc.run(f.read, cks.CHUNK):
            await resp.write(chunk)
    finally:
        await svc.run(f.close)
    await resp.write_eof()
    return resp


async def entries(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    limit = _int_query(request, "limit", 100, 1, MAX_PAGE)
    cursor = _int_query(request, "cursor", 0, 0, 2**62) or None
    rows = await svc.run(
        svc.store.entries,
        request.query.get("db") or None,
        request.query.get("table") or None,
        limit,
        cursor,
    )
    return _json(
        {
            "entries": [e.to_json() for e in rows],
            "cursor": rows[-1].id if len(rows) == limit else None,
        }
    )


async def events(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    start = _int_query(request, "from", 0, 0, 2**62)
    limit = _int_query(request, "limit", 100, 1, MAX_PAGE)
    rows = await svc.run(svc.store.events, start, limit)
    return _json({"events": [e.to_json() for e in rows]})


async def current_event(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    return _json({"id": await svc.run(svc.store.index.current_event_id)})


async def add_event(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(
        request,
        {
            "eventType",
            "db",
            "table",
            "partitions",
            "files",
            "server",
            "timestamp",
            "location",
            "tableObj",
        },
    )
    for name in ("eventType", "db", "table", "server"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"bad {name}", "give a string")
    if body.get("files") is not None and not isinstance(body["files"], list):
        raise BadRequest("bad files", 'give a list of {"path", "checksum", "size"}')
    event_id = await svc.run(
        svc.store.add_event,
        body.get("eventType"),
        body.get("db"),
        body.get("table"),
        body.get("partitions") or [],
        body.get("files") or [],
        body.get("server"),
        body.get("location"),
        body.get("tableObj"),
    )
    return _json({"id": event_id})


async def gc(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    report = await svc.run(svc.gc, _bool_query(request, "dry_run"))
    return _json(report.to_json())


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await svc.run(generate_latest, svc.registry)
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    try:
        await svc.run(svc.ready)
    except (OSError, Exception) as e:
        return _error(503, "not ready", str(e))
    return _json({"status": "ready"})

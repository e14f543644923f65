"""A small synchronous client of the daemon, for Spark drivers and executors, hooks and
the CLI's `--url` mode. One keep-alive connection per thread; errors come back as the
same cmroot.exceptions the store raises."""

from __future__ import annotations

import datetime
import email.utils
import http.client
import json
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import IO, Any
from urllib.parse import urlencode, urlsplit

import msgspec
import xxhash

from cmroot.exceptions import (
    ChecksumMismatch,
    CmrootError,
    DaemonUnavailable,
    PayloadTooLarge,
    for_status,
)

_DECODER = msgspec.json.Decoder()
# The daemon closes a kept-alive connection after server.keepalive_timeout of quiet (15 s
# by default); one idle this long is not reused, so that a request is never written into
# a connection the daemon is closing at that instant (one it closed sooner is seen closed
# before reuse).
POOL_IDLE = 10.0
# The daemon's limit on pairs per resolve (cmroot.store.resolve.MAX_PAIRS, not imported:
# executors load this module without the store).
MAX_RESOLVE = 100_000
_CHUNK = 1 << 20


class _Answer:
    """Typed fields, still readable by their JSON names (`res["files"]`), for callers
    written when the client answered with dicts."""

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@dataclass(frozen=True)
class FileRef(_Answer):
    """A file as an event or a recycle names it."""

    path: str
    checksum: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Recycled(_Answer):
    """The answer of POST /v1/recycle: the event and the files it moved."""

    event_id: int
    files: list[FileRef]

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "files": [f.to_json() for f in self.files]}


@dataclass(frozen=True)
class PreparedTx(_Answer):
    """The answer of a prepared recycle: its transaction, the files this part staged, how
    many the transaction holds (all its parts) and when the daemon rolls it back unless
    committed or renewed."""

    txid: str
    files: list[FileRef]
    expires: float
    staged: int


@dataclass(frozen=True)
class Resolved(_Answer):
    """Where the bytes of one (path, checksum) are: status original, cmroot or missing."""

    path: str
    checksum: str
    status: str
    location: str | None = None
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# A resolve answer decoded straight into `Resolved` values.
_RESOLVED = msgspec.json.Decoder(dict[str, list[Resolved]])
_PAIRS = list[dict[str, str]]


@dataclass(frozen=True)
class Resolutions(_Answer):
    """The answer of POST /v1/resolve: one `Resolved` per pair asked, in order."""

    files: list[Resolved]

    def to_json(self) -> dict[str, Any]:
        return {"files": [f.to_json() for f in self.files]}


class Client:
    """`url` is `http(s)://host:port`, or `unix:///path/to/socket` for the daemon's
    `server.socket`; `socket` (a path) reaches an http URL's daemon through that socket.
    A daemon at capacity answers 503 with Retry-After having done nothing: requests are
    sent again as it asks, for up to `busy_wait` seconds in all (0: raise at once)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float | None = 600.0,  # seconds a read may wait; None: no limit
        ssl_context: ssl.SSLContext | None = None,
        socket: str | None = None,
        busy_wait: float = 30.0,
        audit: dict[str, str] | None = None,
    ) -> None:
        fix = "write http://host:port or unix:///path/to/socket"
        try:
            parts = urlsplit(url)
            port = parts.port  # a port past 65535 or not a number raises here
        except ValueError as e:
            raise CmrootError("bad daemon URL", f"{url!r}: {e}: {fix}") from None
        if parts.scheme == "unix" and not socket:
            socket = parts.path
            if parts.netloc or not socket.startswith("/"):
                raise CmrootError(
                    "bad daemon URL", f"{url!r}: write unix:///absolute/path/to/socket"
                )
        elif parts.scheme not in ("http", "https") or not parts.hostname:
            raise CmrootError("bad daemon URL", f"{url!r}: {fix}")
        if token is not None and not (token.isascii() and token.isprintable()):
            # It could not go in an HTTP header; no token has such characters.
            raise CmrootError(
                "bad token",
                "a cmroot token is printable ASCII (cmr_...): check the token file or "
                "$CMROOT_TOKEN for stray characters",
            )
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = port or (443 if self._https else 80)
        self._socket = socket
        self._token = token
        self._timeout = timeout
        self._ssl = ssl_context
        self._busy_wait = busy_wait
        # Sent with every recycle and event unless the call gives its own: who asks.
        self.audit = audit
        self._local = threading.local()

    @property
    def token(self) -> str | None:
        """The bearer token this client sends (a job passes it on to its executors)."""
        return self._token

    # -- API -------------------------------------------------------------------------------
    def recycle(
        self, paths: list[str], progress: Callable[[int, int], None] | None = None, **kw: Any
    ) -> Recycled:
        """POST /v1/recycle; kw: mode, purge, op, db, table, partitions, location, audit."""
        body = {"paths": paths, "audit": self.audit,
                **{k: v for k, v in kw.items() if v is not None}}
        body = {k: v for k, v in body.items() if v is not None}
        try:
            res = self._json("POST", "/v1/recycle", body)
        except DaemonUnavailable as e:
            raise DaemonUnavailable(
                "connection to the cmroot daemon lost during recycle",
                f"{e.detail}; the request is wholly applied or wholly rolled back when the "
                "daemon restarts: check GET /v1/entries or resolve the paths before retrying",
            ) from e
        out = Recycled(
            int(res["event_id"]),
            [FileRef(f["path"], f["checksum"], int(f["size"])) for f in res["files"]],
        )
        if progress:
            progress(len(out.files), len(out.files))
        return out

    def prepare(
        self, paths: list[str], txid: str | None = None, lease: float | None = None, **kw: Any
    ) -> PreparedTx:
        """First phase of a two-phase recycle (kw as for `recycle`): the files move into
        staging, unseen until `commit`. `txid` adds them to that prepared transaction; if
        they cannot join, the daemon rolls back the whole transaction."""
        body = {"paths": paths, "prepare": True, "txid": txid, "lease": lease,
                "audit": self.audit, **kw}
        res = self._json("POST", "/v1/recycle", {k: v for k, v in body.items() if v is not None})
        return PreparedTx(
            res["txid"],
            [FileRef(f["path"], f["checksum"], int(f["size"])) for f in res["files"]],
            float(res["expires"]),
            int(res["staged"]),
        )

    def commit(self, txid: str) -> Recycled:
        """Publish a prepared transaction with its one event. Safe to send again: a
        transaction already committed answers with the same event."""
        res = self._json("POST", f"/v1/transactions/{txid}/commit", None, retry=True)
        return Recycled(
            int(res["event_id"]),
            [FileRef(f["path"], f["checksum"], int(f["size"])) for f in res["files"]],
        )

    def abort(self, txid: str) -> list[str]:
        """Put every file of a prepared transaction back; returns the displaced paths."""
        return list(self._json("POST", f"/v1/transactions/{txid}/abort", None)["displaced"])

    def renew(self, txid: str, lease: float | None = None) -> float:
        """Extend a prepared transaction's lease; returns its new deadline."""
        body = {"lease": lease} if lease is not None else None
        return float(self._json("POST", f"/v1/transactions/{txid}/renew", body)["expires"])

    def resolve(self, files: list[dict[str, str]]) -> Resolutions:
        """POST /v1/resolve, one answer per pair in order; any number of pairs: batches
        above the daemon's limit, or too large for its body limit, are split."""
        out: list[Resolved] = []
        for i in range(0, len(files), MAX_RESOLVE):
            out += self._resolve(files[i : i + MAX_RESOLVE])
        return Resolutions(out)

    def _resolve(self, files: list[dict[str, str]]) -> list[Resolved]:
        body: Any = {"files": files}
        if all(type(f) is dict for f in files):
            try:
                # msgspec writes plain dicts of strings many times faster than the stdlib.
                # Anything else (bytes it would send as base64, a str subclass, a lone
                # surrogate; a dict subclass, whose methods may show other values than
                # it holds) goes the stdlib's way, which refuses what is not JSON.
                body = msgspec.json.encode({"files": msgspec.convert(files, _PAIRS)})
            except (msgspec.ValidationError, TypeError, UnicodeEncodeError):
                pass
        try:
            # A POST that changes nothing: safe to retry on a stale keep-alive connection.
            res = self._json("POST", "/v1/resolve", body, retry=True, answer=_RESOLVED)
        except PayloadTooLarge:
            if len(files) < 2:
                raise
            half = len(files) // 2
            return self._resolve(files[:half]) + self._resolve(files[half:])
        try:
            return [
                f if isinstance(f, Resolved) else
                Resolved(f["path"], f["checksum"], f["status"], f.get("location"), f.get("size"))
                for f in res["files"]
            ]
        except (KeyError, TypeError, AttributeError) as e:
            raise CmrootError(
                "bad answer from the cmroot daemon",
                f"{self.url}/v1/resolve: {type(e).__name__} {e}: not a list of resolved pairs",
            ) from None

    def get(self, path: str, checksum: str, out: IO[bytes]) -> int:
        """Write the bytes of (path, checksum) to `out`, hashing them as they are written;
        returns the byte count written. Bytes that do not hash to `checksum` (damaged on the
        way) raise ChecksumMismatch: the caller discards what was written."""
        h = xxhash.xxh3_128()
        n = 0
        with self.open(path, checksum) as resp:
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
                n += len(chunk)
        if h.hexdigest() != checksum:
            raise ChecksumMismatch(
                "bytes from the daemon do not match their checksum",
                f"{path}: {n} bytes hash to {h.hexdigest()}, not {checksum}; "
                "what was written is not the file: run the get again",
            )
        return n

    @contextmanager
    def open(
        self, path: str, checksum: str, byte_range: tuple[int, int] | None = None
    ) -> Iterator[http.client.HTTPResponse]:
        """Stream the bytes of (path, checksum); `byte_range` is (first, last) inclusive."""
        headers = {"Range": f"bytes={byte_range[0]}-{byte_range[1]}"} if byte_range else {}
        resp = self._request(
            "GET", "/v1/files?" + urlencode({"path": path, "checksum": checksum}), None, headers
        )
        try:
            if resp.status >= 400:
                self._raise(resp)
            yield resp
        finally:
            if not resp.isclosed():
                # Unread bytes: draining them could take long; a new connection is cheap.
                self.close()

    def entries(self, **kw: Any) -> dict[str, Any]:
        """A page of GET /v1/entries; kw: db, table, limit, cursor, all (bool)."""
        query = urlencode(
            {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in kw.items()
             if v is not None}
        )
        return self._json("GET", "/v1/entries?" + query)

    def events(self, start: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """Up to `limit` whole events with id >= `start`, in order (fewer only at the end
        of the log). The daemon caps its pages in bytes; this reads as many pages, and as
        many pages of the files of an event too large for one, as it takes. A caller that
        cannot hold whole events (a million-file drop) reads `event_pages` instead."""
        out: list[dict[str, Any]] = []
        for page in self.event_pages(start, limit):
            for event in page["events"]:
                after = event.pop("filesNext", None)
                if after is not None:
                    for files in self.event_files(int(event["id"]), int(after)):
                        event["files"].extend(files)
                out.append(event)
            if len(out) >= limit:
                break
        return out[:limit]

    def event_pages(
        self, start: int = 0, limit: int = 100, follow: bool = False
    ) -> Iterator[dict[str, Any]]:
        """The pages of GET /v1/events from `start`, as the daemon sends them:
        `{"events", "next", "more"}`, each at most `limit` events. An event whose files did
        not fit ends its page with `"filesNext": S`; `event_files(id, S)` has the rest.
        Stops at the end of the log (`follow`: polls on for new events instead)."""
        nxt = start
        while True:
            page = self._json("GET", f"/v1/events?from={nxt}&limit={limit}", retry=True)
            if page["events"] or not follow:
                yield page
            nxt = int(page.get("next", nxt))
            if not page.get("more") and not follow:
                return
            if not page["events"]:
                time.sleep(1.0)

    def event_files(
        self, event_id: int, after: int = -1, limit: int | None = None
    ) -> Iterator[list[dict[str, Any]]]:
        """The files of one event with seq > `after`, a page (a list) at a time."""
        while True:
            query = {"after": after, **({"limit": limit} if limit else {})}
            page = self._json("GET", f"/v1/events/{event_id}/files?" + urlencode(query))
            if page["files"]:
                yield list(page["files"])
            if page.get("filesNext") is None:
                return
            after = int(page["filesNext"])

    def current_event(self) -> int:
        return int(self._json("GET", "/v1/events/current")["id"])

    def log_id(self) -> str:
        """The identity of the daemon's event log (ids mean something only within it)."""
        return str(self._json("GET", "/v1/events/current").get("log") or "")

    def add_event(self, event_type: str, **kw: Any) -> int:
        """POST /v1/events; kw: db, table, partitions, files, server, location, tableObj.
        A file given as {"path"} alone is hashed by the daemon."""
        body = {"eventType": event_type, **({"audit": self.audit} if self.audit else {}), **kw}
        return int(self._json("POST", "/v1/events", body)["id"])

    def gc(
        self, dry_run: bool = False, progress: Callable[[int], None] | None = None,
        files: bool = False, everything: bool = False,
    ) -> dict[str, Any]:
        """POST /v1/gc; a dry run names what would go (`files`: the files, `everything`:
        housekeeping files too)."""
        query = {"dry_run": dry_run, **({"files": True} if files else {}),
                 **({"all": True} if everything else {})}
        return self._json("POST", "/v1/gc?" + urlencode(
            {k: str(v).lower() for k, v in query.items()}))

    def fsck(self, repair: bool = False) -> dict[str, Any]:
        """POST /v1/fsck: the daemon checks (and repairs) its store while it serves. It
        takes as long as hashing every object does: give this Client a long timeout."""
        return self._json("POST", f"/v1/fsck?repair={'true' if repair else 'false'}")

    def add_hold(
        self, db: str, table: str | None, until: float, reason: str
    ) -> dict[str, Any]:
        return self._json(
            "POST", "/v1/holds", {"db": db, "table": table, "until": until, "reason": reason}
        )

    def holds(self, everything: bool = False) -> dict[str, Any]:
        return self._json("GET", f"/v1/holds?all={'true' if everything else 'false'}")

    def remove_hold(self, hold_id: int) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/holds/{hold_id}")

    def healthy(self) -> bool:
        try:
            # not ready is an answer here, not a reason to wait
            return bool(self._json("GET", "/readyz", busy_wait=0).get("status") == "ready")
        except CmrootError:
            return False

    # -- transport --------------------------------------------------------------------------
    def _json(
        self,
        method: str,
        path: str,
        body: Any = None,
        retry: bool = False,
        busy_wait: float | None = None,
        answer: msgspec.json.Decoder[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """`body` is JSON-encoded here unless given as bytes (already JSON). `answer`
        decodes into typed values where it can; failing that, into plain JSON values."""
        resp = self._request(method, path, body, retry=retry, busy_wait=busy_wait)
        if resp.status >= 400:
            self._raise(resp)
        data = resp.read()
        if answer is not None:
            try:
                # Straight into the answer's types: a 10,000-pair resolve answer decodes
                # twice as fast as into dicts first. Anything unexpected is read below.
                return answer.decode(data)
            except (msgspec.DecodeError, ValueError, RecursionError):
                pass
        try:
            # msgspec: a 10,000-pair resolve answer decodes several times faster
            out = _DECODER.decode(data)
        except (msgspec.DecodeError, ValueError, RecursionError):
            try:  # what only the stdlib reads (a lone surrogate), or no JSON
                out = json.loads(data)
            except (ValueError, RecursionError) as e:
                raise CmrootError(
                    "bad answer from the cmroot daemon", f"{self.url}{path}: {e}"
                ) from None
        if not isinstance(out, dict):
            raise CmrootError(
                "bad answer from the cmroot daemon", f"{self.url}{path}: not an object"
            )
        return out

    def _raise(self, resp: http.client.HTTPResponse) -> None:
        data = resp.read()
        try:
            err = json.loads(data)
            message, detail = err.get("error", ""), err.get("detail", "")
        except (json.JSONDecodeError, AttributeError):
            message, detail = f"HTTP {resp.status}", data[:200].decode(errors="replace")
        raise for_status(resp.status)(message or f"HTTP {resp.status}", detail)

    def _request(
        self,
        method: str,
        path: str,
        body: Any,
        headers: dict[str, str] | None = None,
        retry: bool = False,
        busy_wait: float | None = None,
    ) -> http.client.HTTPResponse:
        # The stdlib writes requests: msgspec would send NaN/Infinity as null (a lease of
        # inf taken for "none given") and bytes as base64, where the stdlib refuses both. A
        # body given as bytes is JSON already (resolve's pairs, plain strings checked).
        payload = (
            body if isinstance(body, bytes) or body is None
            else json.dumps(body, separators=(",", ":")).encode()
        )
        hdrs = {"Accept": "application/json", **(headers or {})}
        if method == "POST":  # even without a body: the daemon refuses other types (415)
            hdrs["Content-Type"] = "application/json"
        if self._token:
            hdrs["Authorization"] = f"Bearer {self._token}"
        # The daemon sends Retry-After with a 503 only when it did nothing (a full work
        # queue, every connection busy, shutting down): sending again is safe, even a
        # recycle, and a Spark statement waiting a second beats one failing.
        deadline = time.monotonic() + (self._busy_wait if busy_wait is None else busy_wait)
        while True:
            resp = self._send(method, path, payload, hdrs, retry)
            pause = _retry_after(resp)
            if pause is None or time.monotonic() + pause > deadline:
                return resp
            resp.read()  # the error body, so the connection can be used again
            time.sleep(pause)

    def _send(
        self, method: str, path: str, payload: bytes | None, hdrs: dict[str, str], retry: bool
    ) -> http.client.HTTPResponse:
        """One request, sent again once on a fresh connection when a kept-alive one turns
        out closed: always if it failed while being sent (the daemon cannot have read a
        whole request, so it ran nothing), and for requests that change nothing (`GET`,
        `retry`) also if the answer was lost. A recycle whose answer was lost is not sent
        again: it may have run."""
        for attempt in (0, 1):
            conn, reused = self._connection()
            sent = False
            try:
                conn.request(method, path, payload, hdrs)
                sent = True
                return conn.getresponse()
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                conn.close()
                self._local.conn = None
                stale = isinstance(
                    e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
                )
                if attempt == 0 and stale and ((reused and not sent) or method == "GET" or retry):
                    continue
                raise DaemonUnavailable(
                    "cmroot daemon unreachable",
                    f"{method} {self.url}{path}: {e}; is `cmroot serve` running?",
                ) from e
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before. A kept-alive one is
        not reused once idle for POOL_IDLE, or once the daemon closed it (its socket
        reads EOF): a request written into it would be lost, or half sent."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        now = time.monotonic()
        if conn is not None and conn.sock is not None and (
            now - self._local.used > POOL_IDLE or _readable(conn.sock)
        ):
            conn.close()
            conn = None
        reused = conn is not None and conn.sock is not None
        if conn is None:
            if self._socket:
                conn = _UnixConnection(self._socket, self._host, self._timeout)
            elif self._https:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            self._local.conn = conn
        self._local.used = now
        return conn, reused

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _readable(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket has something to read: the daemon closed it
    (EOF or reset), since no answer is due on it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _retry_after(resp: http.client.HTTPResponse) -> float | None:
    """Seconds a 503 asks the client to wait, else None. Retry-After is, per RFC 9110,
    ASCII digits (seconds) or an HTTP-date; anything else (a proxy's, say) is ignored, as
    if absent: a header the client cannot read must never escape it as a ValueError."""
    if resp.status != 503:
        return None
    value = resp.getheader("Retry-After", "").strip()
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": an HTTP-date is always GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - time.time())


_DELAY_SECONDS = re.compile(r"[0-9]+", re.ASCII)


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket; the Host header still names `host` (localhost for a
    unix:// URL)."""

    def __init__(self, path: str, host: str, timeout: float | None) -> None:
        super().__init__(host, timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

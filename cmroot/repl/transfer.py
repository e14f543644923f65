"""Copying one dump's files to the destination, verified: the executor side of a load.

Each file is read from its original path if that still has the checksum, else from its
copy in the cmroot (read directly when the store is reachable from here, else through
the daemon's `GET /v1/files`). Whatever is read locally is only a candidate: another
cluster may hold an unrelated file at the same path, so only bytes that hash to the
checksum are kept. A file is hashed while it is copied and written under a hidden
temporary name next to its destination; the driver renames the temporaries into place
only once every file of the batch arrived, so a failed batch changes nothing visible.

A daemon that cannot be asked (down, or refusing the load's token) is not a lost file:
such a row is `failed`, with the error's class in `fault`, and the driver raises that
error (`daemon_error`). An outage is waited out with a bounded backoff first; a refused
token is not, since it will not fix itself."""

from __future__ import annotations

import contextlib
import errno
import functools
import heapq
import http.client
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import fsspec
import xxhash

from cmroot import checksum as cks
from cmroot.client import Client, Resolved
from cmroot.exceptions import (
    ChecksumMismatch,
    CmrootError,
    DaemonUnavailable,
    Forbidden,
    NotFound,
    Unauthorized,
)

TEMP_PREFIX = ".cmroot-load-"
_CHUNK = 1 << 20
# Files copied at once per task: reads over HTTP mostly wait on the network.
STREAMS = 4
# What stops a load short of the daemon: it is down, or it refuses the load's token.
FAULTS: tuple[type[CmrootError], ...] = (DaemonUnavailable, Unauthorized, Forbidden)
# Where a local read can fail without anything being wrong here: not this file, then.
_UNREADABLE = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# What the daemon answers when it has no such copy (any other answer is the daemon's fault).
_UNAVAILABLE = (NotFound, ChecksumMismatch)
# Seconds without a byte from the daemon before a stream gives up one try (each try is
# waited out with the backoff: a silent daemon holds a stream for minutes, not hours).
_TIMEOUT = 30.0

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """How long a load waits out a daemon it cannot reach: `attempts` tries in all, after
    pauses of `first` seconds, then twice as long each time (the default: 15.5 s over 6
    tries, time for a daemon to be restarted)."""

    attempts: int = 6
    first: float = 0.5
    sleep: Callable[[float], None] = time.sleep

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()`, tried again while the daemon is unavailable; any other error (a 401 or
        403 among them) is raised at once."""
        waited = 0.0
        for i in range(self.attempts - 1):
            try:
                return fn()
            except DaemonUnavailable:
                pause = self.first * 2**i
                self.sleep(pause)
                waited += pause
        try:
            return fn()
        except DaemonUnavailable as e:
            raise DaemonUnavailable(
                e.message, f"{e.detail} (still so after {self.attempts} tries over {waited:g} s)"
            ) from e


BACKOFF = Backoff()


@dataclass(frozen=True)
class Copy:
    """One file to put at `dst` (a local path): the bytes of (`src`, `checksum`)."""

    src: str
    dst: str
    checksum: str
    size: int


@dataclass(frozen=True)
class Copied:
    dst: str
    temp: str | None  # None: `dst` already had the bytes, or they could not be had
    source: str  # "present", "original", "cmroot", "lost" or "failed" (see `fault`)
    size: int
    error: str | None = None
    made_dirs: tuple[str, ...] = ()
    via: str = "local"  # or "http": read from the daemon's GET /v1/files
    fault: str | None = None  # with "failed": the name of the FAULTS class raised

    @property
    def kind(self) -> str:
        """Where the bytes came from, as a load counts them: `original`, `cmroot` or
        `present`, with `_http` when they came over the daemon's HTTP."""
        return self.source if self.via == "local" else f"{self.source}_{self.via}"


def fault_name(e: CmrootError) -> str:
    """The FAULTS class `e` is an instance of, by name (what a row carries to the driver)."""
    return next(f.__name__ for f in FAULTS if isinstance(e, f))


def daemon_error(fault: str, why: str, url: str | None, scope: str) -> CmrootError:
    """The error a load raises when the daemon could not be asked (`fault`, one of the
    FAULTS class names, as the client raised it): what happened, where, and the fix."""
    cls = next(f for f in FAULTS if f.__name__ == fault)
    where = url or "the daemon"
    after = f"No file of this batch was placed in {scope} and its status was not advanced: "
    if cls is DaemonUnavailable:
        return cls(
            f"cmroot daemon unreachable at {where}",
            f"{why}. {after}start the daemon (cmroot serve) or give the load its right "
            "URL, then run the load again",
        )
    fix = (
        "give the load a token of that daemon with the read scope (cmroot token create "
        "--scope read; --token-file or $CMROOT_TOKEN), then run the load again"
    )
    if cls is Unauthorized:
        return cls(f"the cmroot daemon at {where} refused the load's token (401)",
                   f"{why}. {after}{fix}")
    return cls(f"the cmroot daemon at {where} refused the load (403)", f"{why}. {after}{fix}")


def resolve(
    client: Client, pairs: list[dict[str, str]], scope: str, backoff: Backoff = BACKOFF
) -> list[Resolved]:
    """POST /v1/resolve for the driver of a load into `scope`: an outage is waited out, and
    a daemon that cannot be asked raises as `daemon_error` names it."""
    try:
        return backoff.call(functools.partial(client.resolve, pairs)).files
    except FAULTS as e:
        raise daemon_error(fault_name(e), str(e), client.url, scope) from e


def temp_path(dst: str) -> str:
    """A hidden name beside `dst` (Spark and Hive skip names starting with '.'), new for
    every attempt: two attempts of one Spark task (speculation, a task given up on) never
    write one file. What a killed run left is swept by the next load."""
    return os.path.join(os.path.dirname(dst), TEMP_PREFIX + uuid.uuid4().hex)


class _Body(Protocol):
    def readinto(self, b: Any, /) -> int: ...


def _copy_hashed(src: _Body, temp: str) -> tuple[str, int]:
    h = xxhash.xxh3_128()
    n = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(temp, "wb") as out:
        while k := src.readinto(buf):
            h.update(view[:k])
            out.write(view[:k])
            n += k
    return h.hexdigest(), n


def _try(
    opener: Callable[[], AbstractContextManager[Any]], temp: str, checksum: str
) -> int | None:
    """Copy what `opener` gives into `temp`; its size if it hashed to `checksum`. A read
    that fails leaves no temporary; a daemon that cannot be asked raises (FAULTS)."""
    try:
        with opener() as src:
            digest, n = _copy_hashed(src, temp)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        if isinstance(e, (*_UNREADABLE, *_UNAVAILABLE)) and not isinstance(e, FAULTS):
            return None  # this copy cannot be had: the next place may have one
        raise
    if digest == checksum:
        return n
    os.unlink(temp)
    return None


def _open_original(path: str) -> Callable[[], AbstractContextManager[Any]]:
    if path.startswith("/"):
        return functools.partial(open, path, "rb")
    return functools.partial(fsspec.open, path, "rb")


class _Counted:
    """A response body that counts the bytes read from it."""

    def __init__(self, body: Any) -> None:
        self.body = body
        self.count = 0

    def readinto(self, b: Any) -> int:
        n = int(self.body.readinto(b))
        self.count += n
        return n


@contextlib.contextmanager
def _served(client: Client, path: str, checksum: str, size: int) -> Iterator[_Counted]:
    """The `size` bytes of (`path`, `checksum`) from GET /v1/files. A connection that
    breaks mid-file is the daemon being unavailable (waited out), not a bad copy."""
    with client.open(path, checksum) as resp:
        body = _Counted(resp)
        try:
            yield body
        except (http.client.HTTPException, ConnectionError, TimeoutError) as e:
            raise DaemonUnavailable(
                "connection to the cmroot daemon lost mid-file",
                f"GET {client.url}/v1/files {path}: {e!r}",
            ) from e
        if body.count < size:  # http.client ends a body cut short quietly
            raise DaemonUnavailable(
                "connection to the cmroot daemon lost mid-file",
                f"GET {client.url}/v1/files {path}: {body.count} of {size} bytes came",
            )


def _make_dirs(d: str) -> tuple[str, ...]:
    """Create `d` and its missing parents; return the ones created, deepest first."""
    missing = []
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    made = []
    for m in reversed(missing):
        try:
            os.mkdir(m)
        except FileExistsError:
            continue  # someone else's: never ours to remove
        made.append(m)
    return tuple(reversed(made))


class _Daemon:
    """The daemon as the streams of one task see it: calls are waited out with `backoff`
    while it is unreachable; once it stayed so through a whole backoff, later calls fail
    at once (each file waiting again would multiply the wait by the file count)."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.down: DaemonUnavailable | None = None

    def call(self, fn: Callable[[], T]) -> T:
        if self.down is not None:
            # A new error each time: raising one object again would grow its traceback.
            raise DaemonUnavailable(self.down.message, self.down.detail)
        try:
            return self.backoff.call(fn)
        except DaemonUnavailable as e:
            self.down = e
            raise


def copy_all(
    rows: Iterable[Copy],
    daemon_url: str | None,
    token: str | None,
    streams: int = STREAMS,
    backoff: Backoff = BACKOFF,
) -> Iterator[Copied]:
    """Copy each row into its temporary, `streams` at a time, each stream with its own
    connection to the daemon; runs on an executor (or in the driver). The answers come
    in the order of `rows`."""
    todo = list(rows)
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(todo)):
        work.put(i)
    done: dict[int, Copied] = {}
    daemon = _Daemon(backoff)

    def stream() -> None:
        client = Client(daemon_url, token, timeout=_TIMEOUT) if daemon_url else None
        try:
            while True:
                try:
                    i = work.get_nowait()
                except queue.Empty:
                    return
                done[i] = _one(todo[i], client, daemon)
        finally:
            if client is not None:
                client.close()  # this thread's connection: each stream closes its own

    n = max(1, min(streams, len(todo)))
    with ThreadPoolExecutor(n, thread_name_prefix="cmroot-copy") as pool:
        for f in [pool.submit(stream) for _ in range(n)]:
            f.result()
    given = 0
    try:
        for given in range(len(todo)):
            yield done[given]
    except GeneratorExit:  # closed early: what was never handed over is never published
        discard(done[i] for i in range(given + 1, len(todo)))
        raise


def _one(row: Copy, client: Client | None, daemon: _Daemon) -> Copied:
    """One row's copy. Whatever fails here is reported in the row (the driver discards the
    batch and says why), never raised: a stream that died would leave its temporaries and
    directories unknown to the driver."""
    made: tuple[str, ...] = ()
    try:
        return _copy_one(row, client, daemon, made := _make_dirs(os.path.dirname(row.dst)))
    except Exception as e:
        return Copied(row.dst, None, "failed", 0, f"{type(e).__name__}: {e}", made)


def _copy_one(row: Copy, client: Client | None, daemon: _Daemon, made: tuple[str, ...]) -> Copied:
    try:
        st = os.stat(row.dst)
        if st.st_size == row.size and cks.of_local_file(row.dst) == row.checksum:
            return Copied(row.dst, None, "present", row.size)
    except FileNotFoundError:
        pass
    temp = temp_path(row.dst)
    n = _try(_open_original(row.src), temp, row.checksum)
    if n is not None:
        return Copied(row.dst, temp, "original", n, made_dirs=made)
    if client is None:
        return Copied(row.dst, None, "lost", 0, "not at its path and no daemon to ask", made)
    try:
        return _from_daemon(row, client, daemon, temp, made)
    except FAULTS as e:
        return Copied(row.dst, None, "failed", 0, str(e), made, fault=fault_name(e))


def _from_daemon(
    row: Copy, client: Client, daemon: _Daemon, temp: str, made: tuple[str, ...]
) -> Copied:
    """The copy of a file that is not at its path: where the daemon says it is."""
    pair = [{"path": row.src, "checksum": row.checksum}]
    try:
        answer = daemon.call(functools.partial(client.resolve, pair)).files[0]
    except FAULTS:
        raise
    except CmrootError as e:  # the daemon refused the question: not a file it lost
        return Copied(row.dst, None, "failed", 0,
                      f"the daemon at {client.url} could not resolve it: {e}: {e.detail}", made)
    if answer.status == "missing":
        return Copied(row.dst, None, "lost", 0, "neither at its path nor in the cmroot", made)
    source = "cmroot" if answer.status == "cmroot" else "original"
    location = answer.location
    # "original" at another path: a later rename of its table moved the file there.
    moved = answer.status == "original" and location is not None and location != row.src
    if (answer.status == "cmroot" or moved) and location and os.path.isfile(location):
        n = _try(functools.partial(open, location, "rb"), temp, row.checksum)
        if n is not None:
            return Copied(row.dst, temp, source, n, made_dirs=made)
    served = location if moved and location else row.src
    fetch = functools.partial(_served, client, served, row.checksum, row.size)
    n = daemon.call(functools.partial(_try, fetch, temp, row.checksum))
    if n is None:
        return Copied(row.dst, None, "lost", 0, "no copy hashed to its checksum", made)
    return Copied(row.dst, temp, source, n, made_dirs=made, via="http")


def sweep(tops: Iterable[str]) -> None:
    """Remove the temporaries a killed load or restore left below `tops`."""
    for top in sorted(set(tops)):
        for root, _, files in os.walk(top):
            for f in files:
                if f.startswith(TEMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(root, f))


def publish(done: Iterable[Copied]) -> None:
    """Rename every temporary into place (driver side, after the whole batch arrived)."""
    for c in done:
        if c.temp is not None:
            os.replace(c.temp, c.dst)


def discard(done: Iterable[Copied]) -> None:
    """Undo a failed batch: remove its temporaries and the directories it created."""
    made: list[str] = []
    for c in done:
        if c.temp is not None:
            try:
                os.unlink(c.temp)
            except FileNotFoundError:
                pass
        made.extend(c.made_dirs)
    for d in sorted(set(made), key=len, reverse=True):
        try:
            os.rmdir(d)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                raise


def copy_on_spark(
    spark: Any, copies: list[Copy], daemon_url: str | None, token: str | None,
    report: Callable[[str, int, int | None], None], what: str,
) -> list[Copied]:
    """`copy_all` on the executors of `spark`: a few tasks of about equal bytes each (a
    Spark task costs ~25 ms here), progress reported from Spark's status tracker."""
    sc = spark.sparkContext
    bins = _balanced(copies, max(1, min(len(copies), sc.defaultParallelism * 4)))
    group = f"cmroot-copy-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, f"{what}: copy {len(copies)} files", False)
    rdd = sc.parallelize(bins, len(bins)).mapPartitions(
        lambda it: copy_all((c for b in it for c in b), daemon_url, token)
    )
    with _tracking(sc, group, len(copies), len(bins), report):
        return list(rdd.collect())


@contextlib.contextmanager
def _tracking(sc: Any, group: str, files: int, tasks: int,
              report: Callable[[str, int, int | None], None]) -> Iterator[None]:
    """Report the copy job's progress from Spark's status tracker."""
    stop = threading.Event()

    def poll() -> None:
        tracker = sc.statusTracker()
        while not stop.wait(0.5):
            done = 0
            for job in tracker.getJobIdsForGroup(group):
                info = tracker.getJobInfo(job)
                for stage in info.stageIds if info else ():
                    s = tracker.getStageInfo(stage)
                    done += s.numCompletedTasks if s else 0
            report("files copied", files * done // tasks, files)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        report("files copied", files, files)


def _balanced(copies: list[Copy], n: int) -> list[list[Copy]]:
    """`copies` in `n` bins of about equal bytes (largest first, into the lightest bin)."""
    heap = [(0, i) for i in range(n)]
    bins: list[list[Copy]] = [[] for _ in range(n)]
    for c in sorted(copies, key=lambda c: c.size, reverse=True):
        load, i = heapq.heappop(heap)
        bins[i].append(c)
        heapq.heappush(heap, (load + c.size + 4096, i))  # + a file's fixed cost
    return bins

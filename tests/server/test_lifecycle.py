"""Liveness, shutdown and restart as systemd sees them: the watchdog keeps pinging while
the worker pool is stuck, SIGTERM during a long sweep and a recycle exits within the stop
timeout with nothing half done, recovery extends the start timeout, a late sweep still
runs, and POST /v1/gc during a sweep answers 409."""

from __future__ import annotations

import datetime
import re
import signal
import sqlite3
import threading
import time
from typing import Any

import pytest

from cmroot import checksum as cks
from cmroot import config as cfg
from cmroot.exceptions import CmrootError
from cmroot.server import main
from cmroot.store import Store
from tests.server.cmroot_daemon import REPO, Daemon, MakeDaemon, assert_error, tree, write_files
from tests.server.test_systemd import _collect, notify_socket  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(300)

# systemd kills a daemon that has not exited this long after SIGTERM.
STOP_TIMEOUT = float(
    re.search(r"^TimeoutStopSec=(\d+)s$", (REPO / "systemd" / "cmrootd.service").read_text(), re.M)
    .group(1)  # type: ignore[union-attr]
)
EXPIRED = 30_000  # objects: a sweep of them takes seconds, 15 batches


def _objects(d: Daemon) -> int:
    con = sqlite3.connect(f"file:{d.store / 'index.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return int(con.execute("SELECT count(*) FROM objects").fetchone()[0])
    finally:
        con.close()


def _expired_store(make_daemon: MakeDaemon) -> Daemon:
    """A daemon whose store holds EXPIRED objects past retention, stopped: its next start
    sweeps them at once (the first sweep runs at start)."""
    d = make_daemon(env={"CMROOT_STORE_RETAIN": "1s"})
    write_files(d.warehouse, {f"old.db/t/f{i}": i.to_bytes(4, "big") for i in range(EXPIRED)})
    d.client("write", timeout=300).recycle(
        [str(d.warehouse / "old.db" / "t")], op="DROP_TABLE", db="old", table="t"
    )
    assert d.stop() == 0
    time.sleep(1.1)  # past retention
    return d


def _wait_sweeping(d: Daemon) -> None:
    """Until the sweep has removed its first batch (and not yet the last)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = _objects(d)
        if 0 < left < EXPIRED:
            return
        assert left, "the sweep ended before the test saw it run"
        time.sleep(0.005)
    raise AssertionError(f"no sweep within 60s:\n{d.log()}")


def test_watchdog_pings_while_the_worker_pool_is_stuck(
    make_daemon: MakeDaemon, notify_socket: tuple[Any, str]  # noqa: F811
) -> None:
    """Eight requests stuck in SQLite's busy wait fill the pool; the pings go on, no gap
    longer than WATCHDOG_USEC (where systemd would kill the daemon)."""
    s, path = notify_socket
    d = make_daemon(start=False)
    d.start(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    _collect(s, "READY=1")
    lock = sqlite3.connect(str(d.store / "index.sqlite"), isolation_level=None, timeout=30)
    lock.execute("BEGIN IMMEDIATE")  # every index write of the daemon waits behind this
    replies: list[int] = []

    def add_event(i: int) -> None:
        body = {"eventType": "CREATE_TABLE", "db": "busy", "table": f"t{i}"}
        replies.append(d.request("POST", "/v1/events", body, scope="write").status)

    stuck = [threading.Thread(target=add_event, args=(i,)) for i in range(12)]
    try:
        for t in stuck:
            t.start()
        time.sleep(0.5)  # the requests reach the pool
        pings = []
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                if "WATCHDOG=1" in s.recv(4096).decode().splitlines():
                    pings.append(time.monotonic())
            except TimeoutError:
                pass
        gaps = [b - a for a, b in zip([end - 3, *pings], [*pings, end], strict=True)]
        assert max(gaps) < 1.0, f"watchdog silent for {max(gaps):.1f}s:\n{d.log()}"
        assert d.request("GET", "/healthz", scope=None, timeout=5).status == 200
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        for t in stuck:
            t.join(60)
    assert replies == [200] * len(stuck)
    assert d.stop() == 0


def test_gc_during_a_sweep_answers_409(make_daemon: MakeDaemon) -> None:
    d = _expired_store(make_daemon)
    d.start()
    _wait_sweeping(d)
    r = d.request("POST", "/v1/gc", scope="admin", timeout=5)
    assert_error(r, 409, "sweep", "running")
    assert _objects(d) > 0, "answered before the running sweep ended, not after it"
    assert d.stop(STOP_TIMEOUT) == 0


class _Recycle(threading.Thread):
    def __init__(self, d: Daemon, path: str) -> None:
        super().__init__(daemon=True)
        self.client = d.client("write", timeout=300)
        self.path = path
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.client.recycle([self.path], op="DROP_TABLE", db="new", table="t")
        except BaseException as e:
            self.error = e


def test_sigterm_during_a_sweep_and_a_recycle(make_daemon: MakeDaemon) -> None:
    """SIGTERM while a sweep of many objects and a 5,000-file recycle run: the daemon exits
    0 within the stop timeout; the sweep stopped between batches; the recycle is whole
    (every file recycled, with its event) or undone (every file at its source); no journal
    row is left and fsck finds the store clean."""
    d = _expired_store(make_daemon)
    files = write_files(d.warehouse, {f"new.db/t/f{i}": b"new%d" % i for i in range(5000)})
    before = tree(d.warehouse / "new.db")
    d.start()
    _wait_sweeping(d)
    req = _Recycle(d, str(d.warehouse / "new.db" / "t"))
    req.start()
    deadline = time.monotonic() + 60
    while not any((d.store / "staging").iterdir()) and req.is_alive():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.001)
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc is not None
    code = d.proc.wait(STOP_TIMEOUT)
    print(f"exited {time.monotonic() - t0:.2f}s after SIGTERM")
    req.join(60)
    assert code == 0, d.log()
    assert "retention sweep stopped for shutdown" in d.log(), d.log()
    assert _objects(d) > 0, "the sweep ran to its end instead of stopping"
    counts = d.index_counts()
    assert counts["journal"] == 0 and counts["txs"] == 0, counts
    config = cfg.load(str(d.config_path))
    with Store.open(config, readonly=True) as store:
        report = store.fsck()
    assert report.clean, report

    d.start()
    c = d.client("admin")
    sums = {p: cks.of_bytes(b) for p, b in files.items()}
    out = c.resolve([{"path": p, "checksum": s} for p, s in sums.items()])["files"]
    statuses = {f["status"] for f in out}
    events = [e for e in c.events(0, 1000) if e["db"] == "new"]
    if statuses == {"original"}:
        assert tree(d.warehouse / "new.db") == before and events == []
        assert req.result is None, "the client was told it succeeded"
    else:
        assert statuses == {"cmroot"}, f"half done: {statuses}"
        assert len(events) == 1 and len(events[0]["files"]) == len(files)
    if req.error is not None:
        assert isinstance(req.error, CmrootError), req.error
    assert d.stop(STOP_TIMEOUT) == 0


def test_recovery_extends_the_start_timeout(
    make_daemon: MakeDaemon, notify_socket: tuple[Any, str]  # noqa: F811
) -> None:
    s, path = notify_socket
    d = make_daemon(start=False)
    write_files(d.warehouse, {f"db.db/t/f{i}": b"x%d" % i for i in range(100)})
    d.start(env={"CMROOT_FAULTS": "recycle.file_staged@10"})  # SIGKILL mid-recycle
    with pytest.raises(CmrootError):
        d.client("write").recycle([str(d.warehouse / "db.db" / "t")], op="DROP_TABLE")
    assert d.proc is not None and d.proc.wait(30) == -signal.SIGKILL
    d.start(env={"NOTIFY_SOCKET": path})
    seen = _collect(s, "READY=1")
    ready = seen.index("READY=1")
    assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in seen[:ready]), seen
    assert "rolling back an interrupted recycle" in d.log()
    assert d.stop() == 0


def test_a_late_sweep_still_runs() -> None:
    """A run due 10 s ago (a suspended host, a busy scheduler thread) still runs, once."""

    class Service:
        def __init__(self) -> None:
            self.runs = 0
            self.ran = threading.Event()

        def gc(self) -> None:
            self.runs += 1
            self.ran.set()

    svc = Service()
    sched = main._scheduler(svc, 3600)  # type: ignore[arg-type]
    late = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=10)
    sched.modify_job("sweep", next_run_time=late)
    sched.start()
    try:
        assert svc.ran.wait(10), "the late sweep was skipped"
    finally:
        sched.shutdown(wait=True)
    assert svc.runs == 1


def test_cleartext_tokens_warning(make_daemon: MakeDaemon) -> None:
    d = make_daemon(host="0.0.0.0")
    assert any("clear text" in r["msg"] for r in d.log_records() if r["level"] == "warning")
    assert d.stop() == 0
    quiet = make_daemon("quiet")
    assert "clear text" not in quiet.log()
    assert quiet.stop() == 0


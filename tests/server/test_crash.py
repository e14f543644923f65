"""Crash and shutdown during a 5,000-file recycle request. kill -9 at several points (first
file staged, half staged, everything staged) and SIGTERM mid-request; after a restart the
request is wholly applied (every file resolvable as cmroot with identical bytes) or wholly
rolled back (every file back at its source with identical bytes). Nothing is lost, nothing
half done, and the client was told (DaemonUnavailable naming cmroot) when it was cut off."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import object_file

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError, DaemonUnavailable
from tests.server.cmroot_daemon import Daemon, MakeDaemon, tree, write_files

pytestmark = pytest.mark.timeout(300)

N = 5000


class Request(threading.Thread):
    """One recycle request from its own thread; `result` or `error` once it ends."""

    def __init__(self, d: Daemon, paths: list[str], db: str) -> None:
        super().__init__(daemon=True)
        self.client = d.client("write", timeout=300)
        self.paths, self.db = paths, db
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.client.recycle(self.paths, op="DROP_TABLE", db=self.db, table="t")
        except BaseException as e:
            self.error = e


def _table(d: Daemon, db: str, rng: random.Random) -> dict[str, bytes]:
    return write_files(
        d.warehouse,
        {
            f"{db}.db/t/p={i % 10}/part-{i:05d}": i.to_bytes(4, "big")
            + rng.randbytes(rng.randint(0, 1500))
            for i in range(N)
        },
    )


def _staged(d: Daemon) -> int:
    """Files in the store's staging directories right now."""
    n = 0
    try:
        with os.scandir(d.store / "staging") as txs:
            for tx in txs:
                try:
                    n += len(os.listdir(tx.path))
                except FileNotFoundError:
                    pass
    except FileNotFoundError:
        pass
    return n


def _wait_staged(d: Daemon, req: Request, at_least: int, timeout: float = 120) -> bool:
    """Poll until `at_least` files are staged; False if the request ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _staged(d) >= at_least:
            return True
        if not req.is_alive():
            return False
        time.sleep(0.0005)
    raise AssertionError(f"fewer than {at_least} files staged after {timeout}s:\n{d.log()}")


def _wait_committed(d: Daemon, req: Request, timeout: float = 120) -> bool:
    """Poll until every file is staged and then the journal record is gone: the index
    commit happened, the answer has not been sent yet (or only just)."""
    if not _wait_staged(d, req, N, timeout):
        return False
    con = sqlite3.connect(f"file:{d.store / 'index.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if con.execute("SELECT count(*) FROM txs").fetchone()[0] == 0:
                return req.is_alive()
            time.sleep(0.0002)
    finally:
        con.close()
    raise AssertionError(f"recycle not committed after {timeout}s:\n{d.log()}")


def _assert_all_or_nothing(
    d: Daemon, db: str, files: dict[str, bytes], before: dict[str, str]
) -> str:
    """After a restart: the request is wholly applied or wholly rolled back. Returns which."""
    c = d.client("admin")
    assert tree(d.store / "staging") == {}, "recovery leaves nothing staged"
    sums = {p: cks.of_bytes(b) for p, b in files.items()}
    out = c.resolve([{"path": p, "checksum": s} for p, s in sums.items()])["files"]
    statuses = {f["status"] for f in out}
    assert statuses in ({"original"}, {"cmroot"}), f"half done: {sorted(statuses)}"
    table = d.warehouse / f"{db}.db"
    entries = 0
    cursor = None
    while True:
        page = c.entries(db=db, limit=1000, cursor=cursor)
        entries += len(page["entries"])
        if (cursor := page["cursor"]) is None:
            break
    events = [e for e in c.events(0, 1000) if e["db"] == db]
    if statuses == {"original"}:
        # rolled back: every file at its source, same bytes, same tree; no trace in the store
        assert tree(table) == before
        assert entries == 0 and events == []
        for s in sums.values():
            assert not (object_file(d.store, s)).exists(), "phantom object"
        return "rolled back"
    # applied: nothing left at the source, every object holds the exact bytes
    assert not any(Path(p).exists() for p in files)
    for f in out:
        with open(f["location"], "rb") as fh:
            assert fh.read() == files[f["path"]], f["path"]
    for p in random.Random(1).sample(list(files), 50):
        r = d.request("GET", d.files_url(p, sums[p]), scope="read")
        assert r.status == 200 and r.body == files[p]
    assert entries == N
    assert len(events) == 1 and len(events[0]["files"]) == N
    return "applied"


@pytest.fixture
def lake(make_daemon: MakeDaemon) -> Daemon:
    return make_daemon()


def test_kill_9_during_recycle_is_all_or_nothing(lake: Daemon) -> None:
    d = lake
    rng = random.Random(99)
    outcomes = []
    # kill points: first file staged, half staged, every file staged (hashing, publishing,
    # flushing), and just after the index commit (before or while the answer is sent)
    points: dict[str, Callable[[Request], bool]] = {
        "first staged": lambda req: _wait_staged(d, req, 1),
        "half staged": lambda req: _wait_staged(d, req, N // 2),
        "all staged": lambda req: _wait_staged(d, req, N),
        "committed": lambda req: _wait_committed(d, req),
    }
    for k, (point, wait) in enumerate(points.items()):
        db = f"crash{k}"
        files = _table(d, db, rng)
        before = tree(d.warehouse / f"{db}.db")
        req = Request(d, [str(d.warehouse / f"{db}.db" / "t")], db)
        req.start()
        cut = wait(req)
        d.kill()
        req.join(60)
        assert not req.is_alive()
        if cut or req.error is not None:
            assert isinstance(req.error, DaemonUnavailable), req.error
            assert "cmroot" in str(req.error), str(req.error)
        else:  # the request beat the kill (a fast machine): it must have succeeded
            assert req.error is None and req.result is not None
            assert len(req.result["files"]) == N
        d.start()
        outcome = _assert_all_or_nothing(d, db, files, before)
        if req.result is not None:
            assert outcome == "applied"
        if point == "committed" and cut:
            assert outcome == "applied", "committed before the kill: it must stay"
        outcomes.append((point, cut, outcome))
    print("kill points (point, cut mid-request, outcome):", outcomes)
    assert sum(cut for _, cut, _ in outcomes) >= 3, outcomes
    # the store is sound after all of it
    assert d.errors() == [], d.log()


def test_sigterm_during_recycle_finishes_or_rolls_back(lake: Daemon) -> None:
    d = lake
    files = _table(d, "term", random.Random(7))
    before = tree(d.warehouse / "term.db")
    req = Request(d, [str(d.warehouse / "term.db" / "t")], "term")
    req.start()
    cut = _wait_staged(d, req, 1)
    d.signal(signal.SIGTERM)
    assert d.proc is not None
    code = d.proc.wait(120)
    req.join(60)
    assert code == 0, d.log()
    assert "stopped" in d.log()
    if req.error is not None:
        assert isinstance(req.error, CmrootError) and "cmroot" in str(req.error), req.error
    else:
        assert req.result is not None and len(req.result["files"]) == N
    d.start()
    outcome = _assert_all_or_nothing(d, "term", files, before)
    print("SIGTERM mid-request:", "cut" if cut else "late", outcome, repr(req.error))
    if req.result is not None:
        assert outcome == "applied"
    else:
        assert outcome == "rolled back", "the client saw an error: the request must be undone"

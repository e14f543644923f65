"""Eight clients recycling at once, the same bytes at different paths, while two more read:
no loss, no 5xx, and deduplication right (one object per distinct content)."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, MakeDaemon, write_files

pytestmark = pytest.mark.timeout(180)

THREADS = 8
FILES_PER_THREAD = 120
REQUESTS_PER_THREAD = 4
DISTINCT = 20


def _gauge(d: Daemon, name: str) -> float:
    for fam in text_string_to_metric_families(d.metrics()):
        if fam.name == name:
            return float(fam.samples[0].value)
    raise AssertionError(f"{name} not exported")


def test_concurrent_recycles_of_overlapping_content(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    rng = random.Random(8)
    pool = [rng.randbytes(rng.randint(1, 64 * 1024)) + bytes([i]) for i in range(DISTINCT)]
    # every content appears in every thread's files, at different paths
    files: dict[str, bytes] = {}
    for t in range(THREADS):
        files |= write_files(
            d.warehouse,
            {
                f"db.db/t{t}/r={i % REQUESTS_PER_THREAD}/f{i:03d}": pool[(i + t) % DISTINCT]
                for i in range(FILES_PER_THREAD)
            },
        )
    # an object already in the store, read over and over while the recycles run
    [(steady_path, steady)] = write_files(d.warehouse, {"db.db/steady/f": pool[0]}).items()
    d.client("write").recycle([steady_path], op="DELETE")

    start = threading.Barrier(THREADS + 2)
    done = threading.Event()
    errors: list[BaseException] = []
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def writer(t: int) -> None:
        c = d.client("write")
        try:
            start.wait()
            for r in range(REQUESTS_PER_THREAD):
                res = c.recycle(
                    [str(d.warehouse / f"db.db/t{t}/r={r}")],
                    op="DROP_PARTITION",
                    db="db",
                    table=f"t{t}",
                )
                with lock:
                    results.append(res)
        except BaseException as e:
            with lock:
                errors.append(e)

    def reader() -> None:
        c = d.client("read")
        pair = [{"path": steady_path, "checksum": cks.of_bytes(steady)}]
        try:
            start.wait()
            while not done.is_set():
                assert c.resolve(pair)["files"][0]["status"] == "cmroot"
                r = d.request("GET", d.files_url(steady_path, cks.of_bytes(steady)), scope="read")
                assert r.status == 200 and r.body == steady, r
        except BaseException as e:
            with lock:
                errors.append(e)

    writers = [threading.Thread(target=writer, args=(t,)) for t in range(THREADS)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for th in writers + readers:
        th.start()
    for th in writers:
        th.join(120)
    done.set()
    for th in readers:
        th.join(60)
    assert errors == [], errors
    assert len(results) == THREADS * REQUESTS_PER_THREAD
    assert sorted(f["path"] for r in results for f in r["files"]) == sorted(files)
    event_ids = [r["event_id"] for r in results]
    assert len(set(event_ids)) == len(event_ids), "each request has its own event"

    # no loss: every (path, checksum) resolves from the store with the right bytes
    c = d.client("admin")
    out = c.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])["files"]
    assert {f["status"] for f in out} == {"cmroot"}
    for f in out:
        with open(f["location"], "rb") as fh:
            assert fh.read() == files[f["path"]]
    for p in random.Random(2).sample(list(files), 40):
        r = d.request("GET", d.files_url(p, cks.of_bytes(files[p])), scope="read")
        assert r.status == 200 and r.body == files[p]

    # dedupe: one object per distinct content, on disk and in the gauges
    objects = [p for p in (d.store / "objects").rglob("*") if p.is_file()]
    assert sorted(p.name for p in objects) == sorted(cks.of_bytes(b) for b in pool)
    assert _gauge(d, "cmroot_store_objects") == DISTINCT
    assert _gauge(d, "cmroot_store_bytes") == sum(map(len, pool))
    assert not any((d.store / "staging").iterdir())
    events = c.events(0, 1000)
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    assert len(events) == 1 + THREADS * REQUESTS_PER_THREAD
    assert d.errors() == [], d.log()

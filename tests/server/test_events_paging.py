"""GET /v1/events pages are capped in bytes as well as in count: a page's JSON never
exceeds the cap, an event whose files do not fit is paged by its files (`filesNext` and
GET /v1/events/{id}/files), and every page says where the next one starts. The client
still hands out whole events, and streams pages for callers that want them.

The daemon runs in-process here (the real app on a real socket), so the cap can be
lowered: a million-file event is then simulated by a few thousand files."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from cmroot.client import Client
from cmroot.exceptions import BadRequest, Forbidden, NotFound
from cmroot.index import Event, Index
from cmroot.index import events as events_mod
from cmroot.server.app import Service, create_app
from cmroot.server.auth import Tokens, hash_token
from cmroot.store import Store

pytestmark = pytest.mark.timeout(120)

CAP = 8 << 10  # 8 KiB pages: a few dozen files each


@contextmanager
def serve(store: Store, tokens: dict[str, str] | None = None) -> Iterator[str]:
    """The daemon's app over `store` on a loopback port; yields its URL."""
    entries = [f"{scope}:sha256:{hash_token(t)}" for t, scope in (tokens or {}).items()]
    svc = Service(store, Tokens(entries), CollectorRegistry(), workers=2)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(svc, 1 << 20))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        svc.close()


def files(n: int, tag: str) -> list[dict[str, Any]]:
    return [
        {"path": f"/wh/{tag}/part-{i:06d}.parquet", "checksum": f"{i:032x}", "size": i}
        for i in range(n)
    ]


def add(index: Index, n_files: int, tag: str, **kw: Any) -> int:
    return index.add_event(
        Event(0, "INSERT", "db", tag, [], 1.0, "hms", False, files(n_files, tag), **kw)
    )


def raw_get(url: str, path: str) -> tuple[int, bytes]:
    c = Client(url)
    resp = c._request("GET", path, None)
    return resp.status, resp.read()


@pytest.fixture
def cap(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(events_mod, "PAGE_BYTES", CAP)
    return CAP


@pytest.fixture
def log(store: Store) -> list[dict[str, Any]]:
    """Small events around two that exceed a page: 3,000 files and 200 files."""
    index = store.index
    add(index, 0, "empty")
    add(index, 2, "small", location="/wh/small", table_obj={"table": "small"})
    add(index, 3000, "huge")
    add(index, 1, "one")
    add(index, 200, "big")
    for i in range(30):
        add(index, 3, f"t{i}")
    return [e.to_json() for e in index.events(0, 1000)]


def test_pages_fit_the_cap_and_chain_to_the_whole_log(
    store: Store, cap: int, log: list[Any]
) -> None:
    with serve(store) as url:
        nxt, got, sizes = 0, [], []
        while True:
            status, body = raw_get(url, f"/v1/events?from={nxt}&limit=1000")
            assert status == 200
            sizes.append(len(body))
            page = json.loads(body)
            for e in page["events"]:
                after = e.pop("filesNext", None)
                while after is not None:
                    status, fbody = raw_get(url, f"/v1/events/{e['id']}/files?after={after}")
                    assert status == 200 and len(fbody) <= cap
                    fpage = json.loads(fbody)
                    assert fpage["id"] == e["id"] and fpage["files"]
                    e["files"] += fpage["files"]
                    after = fpage["filesNext"]
                got.append(e)
            assert page["next"] == (page["events"][-1]["id"] + 1 if page["events"] else nxt)
            nxt = page["next"]
            if not page["more"]:
                break
        assert got == log  # every event once, in order, files whole and in order
        assert max(sizes) <= cap and len(sizes) > 3
        # A page starting past the end is empty and points at itself.
        status, body = raw_get(url, f"/v1/events?from={nxt}")
        assert json.loads(body) == {"events": [], "next": nxt, "more": False}


def test_an_event_too_large_for_a_page_comes_with_the_files_that_fit(
    store: Store, cap: int, log: list[Any]
) -> None:
    huge = next(e for e in log if e["table"] == "huge")
    with serve(store) as url:
        # The small event before it ends a page: events after the first come whole.
        _, body = raw_get(url, f"/v1/events?from={huge['id'] - 1}&limit=10")
        page = json.loads(body)
        assert [e["id"] for e in page["events"]] == [huge["id"] - 1]
        assert page["next"] == huge["id"] and page["more"] is True
        # First on its page, it comes with the files that fit.
        _, body = raw_get(url, f"/v1/events?from={huge['id']}&limit=10")
        page = json.loads(body)
        assert len(body) <= cap and [e["id"] for e in page["events"]] == [huge["id"]]
        part = page["events"][0]
        n = len(part["files"])
        assert 0 < n < 3000 and part["files"] == huge["files"][:n]
        assert part["filesNext"] == n - 1  # seq of the last file listed: pass it as `after`
        assert page["next"] == huge["id"] + 1 and page["more"] is True
        # The rest, a page at a time; `limit` caps the count, the cap the bytes.
        _, body = raw_get(url, f"/v1/events/{huge['id']}/files?after={n - 1}&limit=5")
        assert json.loads(body) == {
            "id": huge["id"],
            "files": huge["files"][n : n + 5],
            "filesNext": n + 4,
        }
        _, body = raw_get(url, f"/v1/events/{huge['id']}/files?after=2997")
        assert json.loads(body) == {
            "id": huge["id"],
            "files": huge["files"][2998:],
            "filesNext": None,
        }
        _, body = raw_get(url, f"/v1/events/{huge['id']}/files?after=2999")
        assert json.loads(body) == {"id": huge["id"], "files": [], "filesNext": None}
        # An event whose own fields fill the page still comes (paging must progress).
        obj = {"columns": ["x" * 100] * 200}  # ~20 KiB of table definition
        fat = add(store.index, 5, "fat", table_obj=obj)
        _, body = raw_get(url, f"/v1/events?from={fat}")
        page = json.loads(body)
        assert [e["id"] for e in page["events"]] == [fat] and page["events"][0]["tableObj"] == obj
        assert page["events"][0]["files"] == [] and page["events"][0]["filesNext"] == -1
        assert Client(url).events(fat, 1)[0]["files"] == files(5, "fat")


def test_refusals(store: Store, cap: int, log: list[Any]) -> None:
    with serve(store, {"r": "read", "w": "write", "a": "admin"}) as url:
        for token, error in (("r", Forbidden), ("w", Forbidden)):
            c = Client(url, token)
            with pytest.raises(error):
                next(c.event_files(1))
        c = Client(url, "a")
        with pytest.raises(NotFound, match="no such event"):
            next(c.event_files(len(log) + 1))
        with pytest.raises(NotFound):
            next(c.event_files(10**30))
        for query in ("after=x", "after=-2", "limit=0", "limit=100001"):
            with pytest.raises(BadRequest):
                c._json("GET", f"/v1/events/3/files?{query}")
        assert next(c.event_files(3))[0] == log[2]["files"][0]


def test_the_client_returns_whole_events(store: Store, cap: int, log: list[Any]) -> None:
    with serve(store) as url:
        c = Client(url)
        assert c.events(0, 1000) == log
        assert c.events(0, 3) == log[:3]
        assert c.events(3, 2) == log[2:4]  # starts at the huge one: assembled from pages
        assert c.events(len(log) + 1) == []
        # Streaming: pages as sent, the huge event's files a page at a time.
        pages = list(c.event_pages(0, 1000))
        assert len(pages) > 3 and [p["next"] for p in pages][-1] == len(log) + 1
        partial = [e for p in pages for e in p["events"] if "filesNext" in e]
        assert {e["id"] for e in partial} == {3, 5}  # the two larger than a page
        chunks = list(c.event_files(3, partial[0]["filesNext"]))
        assert len(chunks) > 1
        assert partial[0]["files"] + [f for ch in chunks for f in ch] == log[2]["files"]


def test_the_default_cap_allows_big_pages(store: Store) -> None:
    assert events_mod.PAGE_BYTES == 4 << 20
    add(store.index, 50_000, "big")  # ~5 MiB of files: more than one page
    with serve(store) as url:
        _, body = raw_get(url, "/v1/events?from=1")
        page = json.loads(body)
        assert len(body) <= events_mod.PAGE_BYTES
        assert 20_000 < len(page["events"][0]["files"]) < 50_000
        assert Client(url).events(1, 1)[0]["files"] == files(50_000, "big")


def test_ids_stay_gapless_while_writers_race_a_reader(store: Store, cap: int) -> None:
    stop = threading.Event()

    def writer(tag: str) -> None:
        while not stop.is_set():
            add(store.index, 40, tag)

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        with serve(store) as url:
            c = Client(url)
            seen: list[int] = []
            while len(seen) < 300:
                for page in c.event_pages(seen[-1] + 1 if seen else 0, 50):
                    seen += [e["id"] for e in page["events"]]
                    if len(seen) >= 300:
                        # Enough: the writers may outpace the pages for as long as
                        # they run (the pages end only once the reader caught up).
                        break
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert seen == list(range(1, len(seen) + 1))

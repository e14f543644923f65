"""Input limits and cross-site protection of the daemon (issue 10): bodies nested too deep,
integers too large, oversized or deep `tableObj`s, mistyped sizes, `POST` bodies that are not
`application/json`, foreign `Host` headers in open mode, 401 challenges and what a refusal may
reveal. Every refusal is a JSON 4xx naming the field, and changes nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, Reply, assert_error, write_files

pytestmark = pytest.mark.timeout(180)

GOOD = b"good bytes" * 50
POSTS = ("/v1/recycle", "/v1/resolve", "/v1/events")


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("limits"))
    write_files(d.warehouse, {"db.db/t/p=1/good": GOOD})
    write_files(d.outside, {"secret": b"secret"})
    os.symlink(d.outside / "secret", d.warehouse / "db.db/escape")
    with d.serving():
        yield d


@pytest.fixture(scope="module")
def open_lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """No tokens configured: loopback-open mode."""
    d = Daemon(tmp_path_factory.mktemp("open"), auth=False)
    with d.serving():
        yield d


def _good(d: Daemon) -> str:
    return str(d.warehouse / "db.db/t/p=1/good")


def _refused(d: Daemon, status: int, *words: str, **kw: Any) -> dict[str, Any]:
    """Send one request that must be refused with `status` and change nothing."""
    kw.setdefault("method", "POST")
    method, path = kw.pop("method"), kw.pop("path")
    before = d.snapshot()
    r = d.request(method, path, **kw)
    err = assert_error(r, status, *words)
    assert d.snapshot() == before, (method, path)
    return err


# -- 1. body limits ----------------------------------------------------------------------


@pytest.mark.parametrize("route", POSTS)
def test_deep_nesting_is_400_not_500(lake: Daemon, route: str) -> None:
    for raw in (b"[" * 100_000, b'{"files": ' + b"[" * 100_000, b"[" * 500 + b"]" * 500):
        _refused(lake, 400, path=route, raw=raw)


@pytest.mark.parametrize("route", POSTS)
def test_huge_integers_are_400_not_500(lake: Daemon, route: str) -> None:
    big = b"9" * 5000
    for raw in (big, b'{"paths": ' + big + b"}", b'{"files": [' + big + b"]}"):
        _refused(lake, 400, path=route, raw=raw)


def test_invalid_utf8_and_nul_are_400(lake: Daemon) -> None:
    d = lake
    _refused(d, 400, "UTF-8", path="/v1/recycle", raw=b'{"paths": ["\xff\xfe"], "op": "DELETE"}')
    _refused(
        d, 400, "paths", path="/v1/recycle", body={"paths": [_good(d) + "\0"], "op": "DELETE"}
    )


def test_huge_integer_in_table_obj_is_400(lake: Daemon) -> None:
    raw = b'{"eventType": "CREATE_TABLE", "db": "db", "table": "t", "tableObj": {"n": '
    _refused(lake, 400, "tableObj", path="/v1/events", raw=raw + b"1" * 5000 + b"}}")


def test_table_obj_size_and_depth_are_limited(lake: Daemon) -> None:
    d = lake
    base = {"eventType": "CREATE_TABLE", "db": "db", "table": "t"}
    big = {"params": {f"k{i}": "v" * 1000 for i in range(2100)}}  # ~2 MiB
    _refused(d, 400, "tableObj", "bytes", path="/v1/events", body={**base, "tableObj": big})
    deep: Any = {"leaf": 1}
    for _ in range(200):
        deep = {"n": deep}
    _refused(d, 400, "tableObj", "deep", path="/v1/events", body={**base, "tableObj": deep})
    arrays: Any = [1]
    for _ in range(100):
        arrays = [arrays]
    _refused(d, 400, "tableObj", path="/v1/events", body={**base, "tableObj": {"a": arrays}})
    _refused(d, 400, "tableObj", path="/v1/events", body={**base, "tableObj": [1, 2]})
    # A realistic definition is stored and the log still pages (the control).
    table = {
        "table": "t",
        "db": "db",
        "sd": {"cols": [{"name": f"c{i}", "type": "string"} for i in range(50)]},
        "parameters": {"k": "v" * 100_000},
    }
    r = d.request("POST", "/v1/events", {**base, "tableObj": table}, scope="write")
    assert r.status == 200, r
    event_id = r.json()["id"]
    page = d.request("GET", f"/v1/events?from={event_id}")
    assert page.status == 200, page
    assert page.json()["events"][0]["tableObj"] == table


def test_file_sizes_are_typed(lake: Daemon) -> None:
    d = lake
    f = {"path": _good(d), "checksum": cks.of_bytes(GOOD), "size": len(GOOD)}
    base = {"eventType": "INSERT", "db": "db", "table": "t"}
    for size in (True, False, -1, 1.5, "12", 2**64, None):
        _refused(
            d,
            400,
            "files[0].size",
            path="/v1/events",
            body={**base, "files": [{**f, "size": size}]},
        )
    assert d.request("POST", "/v1/events", {**base, "files": [f]}).status == 200


def test_every_field_is_typed_and_named(lake: Daemon) -> None:
    d = lake
    good = _good(d)
    rec = {"paths": [good], "op": "DROP_TABLE", "mode": "copy"}
    for field, value in [
        ("paths", []),
        ("paths", ["x" * 5000]),
        ("mode", 1),
        ("purge", 0),
        ("db", "d" * 2000),
        ("table", ["t"]),
        ("partitions", [{"p": 1}]),
        ("location", 5),
    ]:
        err = _refused(d, 400, field, path="/v1/recycle", body={**rec, field: value})
        assert "give" in err["detail"] or "use" in err["detail"], err
    _refused(d, 400, "unknown", "force", path="/v1/recycle", body={**rec, "force": True})
    ev = {"eventType": "CREATE_TABLE", "db": "db", "table": "t"}
    for field, value in [("server", 1), ("timestamp", True), ("timestamp", "now"), ("db", 1)]:
        _refused(d, 400, field, path="/v1/events", body={**ev, field: value})
    pair = {"path": good, "checksum": cks.of_bytes(GOOD)}
    body = {"files": [pair, {**pair, "checksum": 1}]}
    _refused(d, 400, "files[1].checksum", path="/v1/resolve", body=body)


def test_query_parameters_are_schema_checked(lake: Daemon) -> None:
    d = lake
    for path, words in [
        ("/v1/entries?limit=1&limit=2", ["limit", "once"]),
        ("/v1/entries?db=" + "d" * 2000, ["db"]),
        ("/v1/entries?bogus=1", ["bogus"]),
        ("/v1/events?from=" + "9" * 5000, ["from"]),
        ("/v1/events/1/files?after=x", ["after"]),
    ]:
        _refused(d, 400, *words, method="GET", path=path)
    _refused(d, 400, "dry_run", path="/v1/gc?dry_run=true&dry_run=false")


# -- 2. Content-Type ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "application/json; charset=latin-1",
        None,
    ],
)
def test_post_bodies_must_be_json(open_lake: Daemon, content_type: str | None) -> None:
    d = open_lake
    write_files(d.warehouse, {"db.db/victim/f": b"must stay"})
    body = json.dumps({"paths": [str(d.warehouse / "db.db/victim")], "op": "DROP_TABLE"})
    headers = {} if content_type is None else {"Content-Type": content_type}
    for route in POSTS:
        before = d.snapshot()
        r = _post_typed(d, route, body.encode(), headers)
        assert_error(r, 415, "application/json")
        assert d.snapshot() == before
    assert (d.warehouse / "db.db/victim/f").read_bytes() == b"must stay"


def _post_typed(d: Daemon, route: str, raw: bytes, headers: dict[str, str]) -> Reply:
    """POST with exactly these headers: http.client adds no Content-Type of its own."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.request("POST", route, raw, headers)
        resp = conn.getresponse()
        return Reply(resp.status, resp.headers, resp.read())
    finally:
        conn.close()


def test_json_content_type_with_parameters_is_accepted(open_lake: Daemon) -> None:
    d = open_lake
    pair = {"path": str(d.warehouse / "nope"), "checksum": "0" * 32}
    for ct in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        raw = json.dumps({"files": [pair]}).encode()
        r = _post_typed(d, "/v1/resolve", raw, {"Content-Type": ct})
        assert r.status == 200, (ct, r)
    # POST /v1/gc carries no body: no Content-Type needed.
    r = _post_typed(d, "/v1/gc?dry_run=true", b"", {})
    assert r.status == 200, r


# -- 3. Host in open mode ----------------------------------------------------------------


def test_open_mode_refuses_foreign_hosts(open_lake: Daemon) -> None:
    d = open_lake
    write_files(d.warehouse, {"db.db/rebound/f": b"must stay"})
    body = {"paths": [str(d.warehouse / "db.db/rebound")], "op": "DROP_TABLE"}
    for host in (
        "evil.example",
        f"evil.example:{d.port}",
        "localhost.evil.example",
        "127.0.0.1.evil.example",
        "10.0.0.1",
        "[::2]:80",
        "",
    ):
        _refused(d, 403, "host", path="/v1/recycle", body=body, headers={"Host": host})
        _refused(d, 403, "host", method="GET", path="/metrics", headers={"Host": host})
    assert (d.warehouse / "db.db/rebound/f").exists()
    for host in (
        "localhost",
        f"localhost:{d.port}",
        "LOCALHOST",
        "127.0.0.1",
        f"127.0.0.2:{d.port}",
        "[::1]",
        f"[::1]:{d.port}",
    ):
        r = d.request("GET", "/v1/entries", headers={"Host": host})
        assert r.status == 200, (host, r)


def test_token_mode_serves_any_host(lake: Daemon) -> None:
    r = lake.request("GET", "/v1/entries", headers={"Host": "cmroot.example.com"})
    assert r.status == 200, r


# -- 4. 401 challenge, scheme case, what refusals reveal -----------------------------------


def test_401_carries_a_bearer_challenge(lake: Daemon) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic eDp5"}):
        r = lake.request("GET", "/v1/entries", headers=headers, scope=None)
        assert r.status == 401, r
        assert r.headers.get("WWW-Authenticate", "").startswith("Bearer"), r.headers


def test_bearer_scheme_is_case_insensitive(lake: Daemon) -> None:
    token = lake.tokens["read"]
    for scheme in ("bearer", "BEARER", "BeArEr"):
        r = lake.request(
            "GET", "/v1/entries", headers={"Authorization": f"{scheme} {token}"}, scope=None
        )
        assert r.status == 200, (scheme, r)


def test_403_details_reveal_no_paths(lake: Daemon) -> None:
    d = lake
    escape = str(d.warehouse / "db.db/escape")
    outside = str(d.outside / "secret")
    for body in (
        {"paths": [escape], "op": "DELETE"},
        {"paths": [outside], "op": "DELETE"},
    ):
        err = _refused(d, 403, "outside the warehouse roots", path="/v1/recycle", body=body)
        text = json.dumps(err)
        assert str(d.outside) not in text and str(d.warehouse) not in text, err
    r = d.request("GET", d.files_url(escape, cks.of_bytes(b"secret")))
    assert r.status == 403 and str(d.outside) not in r.body.decode(), r
    # A resolve pair through the symlink: refused, naming the pair, not the target.
    r = d.request("POST", "/v1/resolve", {"files": [{"path": escape, "checksum": "0" * 32}]})
    assert r.status == 400 and "#0" in r.body.decode(), r
    assert str(d.outside) not in r.body.decode(), r


def test_readyz_reveals_no_paths(tmp_path: Any) -> None:
    d = Daemon(tmp_path / "unready")
    d.start()
    try:
        staging = d.store / "staging"
        os.rename(staging, d.base / "staging-away")
        try:
            r = d.request("GET", "/readyz", scope=None)
        finally:
            os.rename(d.base / "staging-away", staging)
        err = assert_error(r, 503, "not ready: store")
        assert str(d.store) not in json.dumps(err) and str(d.base) not in json.dumps(err), err
        assert str(d.store) in d.log()  # the operator still finds the cause in the log
    finally:
        d.close()

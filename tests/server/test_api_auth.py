"""Every endpoint, every way of being refused: no token, a malformed or unknown token, a
token without the scope. Each refusal is 401/403 JSON and changes nothing: the warehouse,
the store on disk, the index and what the API reports are the same before and after. The
same requests with the right token then succeed, so the refused ones would have mattered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmroot import checksum as cks
from tests.server.cmroot_daemon import SCOPES, Daemon, assert_error, write_files

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("auth"), env={"CMROOT_STORE_RETAIN_OVERRIDES": "tmp.*=1s"})
    d.start()
    try:
        write_files(
            d.warehouse,
            {
                "db.db/t/p=1/a": b"a" * 1000,
                "db.db/t/p=1/b": b"b" * 1000,
                "tmp.db/old/x": b"expiring" * 10,
            },
        )
        # Something for a sweep to remove, and something to download.
        d.client("admin").recycle(
            [str(d.warehouse / "tmp.db/old")], op="DROP_TABLE", db="tmp", table="old"
        )
        time.sleep(1.2)
        yield d
        assert d.errors() == [], d.log()
    finally:
        d.close()


def _endpoints(d: Daemon) -> list[tuple[str, str, object, str]]:
    a = str(d.warehouse / "db.db/t/p=1/a")
    x = str(d.warehouse / "tmp.db/old/x")
    sa, sx = cks.of_bytes(b"a" * 1000), cks.of_bytes(b"expiring" * 10)
    return [
        (
            "POST",
            "/v1/recycle",
            {"paths": [str(d.warehouse / "db.db/t")], "op": "DROP_TABLE"},
            "write",
        ),
        ("POST", "/v1/resolve", {"files": [{"path": a, "checksum": sa}]}, "read"),
        ("GET", d.files_url(x, sx), None, "read"),
        ("HEAD", d.files_url(x, sx), None, "read"),
        ("GET", "/v1/entries?limit=10", None, "read"),
        ("GET", "/v1/events?from=0", None, "admin"),
        ("GET", "/v1/events/current", None, "admin"),
        (
            "POST",
            "/v1/events",
            {"eventType": "CREATE_TABLE", "db": "db", "table": "t2", "files": []},
            "write",
        ),
        ("POST", "/v1/gc?dry_run=false", None, "admin"),
    ]


BAD_HEADERS = [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Bearer not-a-token",
    "Basic dXNlcjpwYXNz",
    "Token {admin}",
    "Bearer {admin}x",
    "Bearer x{admin}",
    "{admin}",
]


def test_missing_or_unknown_token_is_401_and_changes_nothing(lake: Daemon) -> None:
    d = lake
    for method, path, body, _scope in _endpoints(d):
        for header in BAD_HEADERS:
            before = d.snapshot()
            headers = (
                {} if header is None else {"Authorization": header.format(admin=d.tokens["admin"])}
            )
            r = d.request(method, path, body, headers=headers, scope=None)
            if method == "HEAD":
                assert r.status == 401 and r.body == b"", (path, header, r)
            else:
                err = assert_error(r, 401, "token")
                assert "expiring" not in str(err)
            # RFC 9110: a 401 names the scheme that would be accepted.
            assert r.headers["WWW-Authenticate"].startswith("Bearer"), (path, r.headers)
            assert d.snapshot() == before, (method, path, header)


def test_token_without_the_scope_is_403_and_changes_nothing(lake: Daemon) -> None:
    d = lake
    refused = 0
    for method, path, body, needed in _endpoints(d):
        for scope in SCOPES[: SCOPES.index(needed)]:
            before = d.snapshot()
            r = d.request(method, path, body, scope=scope)
            if method == "HEAD":
                assert r.status == 403 and r.body == b"", (path, scope, r)
            else:
                assert_error(r, 403, "scope", needed)
            assert d.snapshot() == before, (method, path, scope)
            refused += 1
    # recycle and events POST need write (1 lower scope each); events GET, current and gc
    # need admin (2 each).
    assert refused == 8


def test_bearer_scheme_is_case_insensitive(lake: Daemon) -> None:
    d = lake
    for method, path, body, needed in _endpoints(d):
        if method == "POST" and needed != "read":
            continue  # the control test below does the changing ones
        for scheme in ("bearer", "BEARER", "bEaReR"):
            auth = {"Authorization": f"{scheme} {d.tokens['admin']}"}
            r = d.request(method, path, body, headers=auth, scope=None)
            assert r.status == 200, (method, path, scheme, r)


def test_open_endpoints_need_no_token(lake: Daemon) -> None:
    for path in ("/metrics", "/healthz", "/readyz"):
        assert lake.request("GET", path, scope=None).status == 200, path


def test_right_scope_succeeds_and_admin_implies_the_others(lake: Daemon) -> None:
    """The control: the very requests refused above do their work with a good token."""
    d = lake
    eps = {(m, p.split("?")[0]): (m, p, b, s) for m, p, b, s in _endpoints(d)}
    # read scope reads...
    for key in [
        ("POST", "/v1/resolve"),
        ("GET", "/v1/files"),
        ("HEAD", "/v1/files"),
        ("GET", "/v1/entries"),
    ]:
        m, p, b, _ = eps[key]
        for scope in ("read", "write", "admin"):
            r = d.request(m, p, b, scope=scope)
            assert r.status == 200, (key, scope, r)
    r = d.request("GET", eps[("GET", "/v1/files")][1], scope="read")
    assert r.body == b"expiring" * 10
    # ...write records and recycles...
    n = d.client("admin").current_event()
    m, p, b, _ = eps[("POST", "/v1/events")]
    assert d.request(m, p, b, scope="write").status == 200
    m, p, b, _ = eps[("POST", "/v1/recycle")]
    r = d.request(m, p, b, scope="write")
    assert r.status == 200 and len(r.json()["files"]) == 2
    assert not (d.warehouse / "db.db/t").exists()
    # ...admin reads the log and sweeps.
    for key in [("GET", "/v1/events"), ("GET", "/v1/events/current")]:
        m, p, b, _ = eps[key]
        assert d.request(m, p, b, scope="admin").status == 200
    assert d.client("admin").current_event() == n + 2
    m, p, b, _ = eps[("POST", "/v1/gc")]
    r = d.request(m, p, b, scope="admin")
    assert r.status == 200 and r.json()["removed_objects"] == 1
    assert not list(Path(d.store / "objects").rglob(cks.of_bytes(b"expiring" * 10)))

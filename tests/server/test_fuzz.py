"""Hypothesis over the HTTP API: random JSON bodies (free-form, and near-valid ones built
from real paths, traversal spellings, checksums and ops) and random query strings, with
random tokens, sent to every endpoint. Whatever comes in: never a 5xx, every refusal is a
JSON error, and a refused request changes neither the warehouse nor the store nor the index."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, Reply, write_files

pytestmark = pytest.mark.timeout(240)

MAX_BODY = 16384
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # Deterministic in CI; CMROOT_FUZZ_RANDOM=1 explores new inputs on every run.
    derandomize=os.environ.get("CMROOT_FUZZ_RANDOM") != "1",
    database=None,
)
OPS = [
    "DROP_TABLE",
    "DROP_PARTITION",
    "TRUNCATE",
    "INSERT_OVERWRITE",
    "ALTER_LOCATION",
    "DELETE",
    "CREATE_TABLE",
    "CREATE_DATABASE",
    "ADD_PARTITION",
    "INSERT",
    "ALTER_TABLE",
    "DROP_DATABASE",
    "drop_table",
    "",
    "DROP_TABLE ",
    "NUKE",
]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("fuzz"), env={"CMROOT_SERVER_MAX_BODY": str(MAX_BODY)})
    files = write_files(
        d.warehouse, {f"db.db/t/p={i % 2}/f{i}": f"content {i % 3}".encode() * 20 for i in range(8)}
    )
    write_files(d.outside, {"secret": b"secret"})
    os.symlink(d.outside / "secret", d.warehouse / "db.db/link")
    d.start()
    # A recycled file too, so the store has an object and entries to protect.
    write_files(d.warehouse, {"db.db/gone/f": b"recycled bytes"})
    d.client("admin").recycle([str(d.warehouse / "db.db/gone")], op="DROP_TABLE")
    d.fuzz_paths = list(files)  # type: ignore[attr-defined]
    try:
        yield d
        assert d.errors() == [], d.log()
    finally:
        d.close()


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _strategies(d: Daemon) -> dict[str, st.SearchStrategy[Any]]:
    w, o = str(d.warehouse), str(d.outside)
    real = d.fuzz_paths  # type: ignore[attr-defined]
    spellings = [
        *real,
        f"{w}/db.db/gone/f",
        f"{w}/db.db/t",
        w,
        f"{w}/db.db/../../outside/secret",
        f"{w}/db.db/t/p=0/../p=1/f1",
        f"{w}/db.db/%2e%2e/%2e%2e/outside/secret",
        f"{o}/secret",
        f"file://{o}/secret",
        f"file://{real[0]}",
        f"{w}/db.db/link",
        "/etc/passwd",
        "/",
        "relative/path",
        "",
        f"{real[0]}\0",
        "s3://bucket/key",
        "\udcff",
        f"{w}-evil/x",
        f"{w}/{'a' * 5000}",
    ]
    json_leaf = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=12)
    )
    any_json = st.recursive(
        json_leaf,
        lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
        max_leaves=10,
    )
    spelled = st.sampled_from(spellings)
    paths = st.one_of(spelled, spelled, spelled, st.text(max_size=30), any_json)
    sums = [cks.of_bytes(f"content {i}".encode() * 20) for i in range(3)] + [
        cks.of_bytes(b"recycled bytes"),
        cks.of_bytes(b"secret"),
        "0" * 32,
        "F" * 32,
        "abc",
    ]
    summed = st.sampled_from(sums)
    checksums = st.one_of(summed, summed, summed, st.text(max_size=34), any_json)
    names = st.one_of(st.none(), st.sampled_from(["db", "t", "tmp", "x\0"]), any_json)
    partitions = st.one_of(
        st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), max_size=2),
        any_json,
    )
    pair = st.one_of(
        st.fixed_dictionaries({"path": paths, "checksum": checksums}),
        st.fixed_dictionaries(
            {}, optional={"path": paths, "checksum": checksums, "size": any_json}
        ),
    )
    extra = st.dictionaries(st.sampled_from(["force", "files", "paths", "x"]), any_json, max_size=1)
    recycle_fields = {
        "mode": st.sampled_from(["copy", "copy", "move", "teleport"]) | any_json,
        "purge": st.booleans() | any_json,
        "db": names,
        "table": names,
        "partitions": partitions,
    }
    recycle = st.one_of(
        # Near-valid: real and hostile paths, mostly valid ops, mostly copy mode (a move that
        # succeeds would drain the warehouse the other examples need).
        st.fixed_dictionaries(
            {"paths": st.lists(paths, min_size=1, max_size=3), "op": st.sampled_from(OPS)},
            optional=recycle_fields,
        ),
        st.fixed_dictionaries(
            {"paths": st.lists(paths, min_size=1, max_size=3), "op": st.sampled_from(OPS[:6])},
            optional=recycle_fields,
        ),
        st.fixed_dictionaries(
            {},
            optional={
                "paths": st.lists(paths, max_size=3) | any_json,
                "op": any_json,
                **recycle_fields,
            },
        ),
    )
    event_fields = {
        "db": names,
        "table": names,
        "partitions": partitions,
        "files": st.lists(pair, max_size=3) | any_json,
        "server": names,
        "timestamp": any_json,
    }
    event = st.one_of(
        st.fixed_dictionaries({"eventType": st.sampled_from(OPS[6:])}, optional=event_fields),
        st.fixed_dictionaries(
            {
                "eventType": st.sampled_from(OPS[6:]),
                "files": st.lists(pair, min_size=1, max_size=3),
            },
            optional={k: v for k, v in event_fields.items() if k != "files"},
        ),
        st.fixed_dictionaries(
            {}, optional={"eventType": st.sampled_from(OPS) | any_json, **event_fields}
        ),
    )
    resolve = st.one_of(
        st.fixed_dictionaries({"files": st.lists(pair, min_size=1, max_size=4)}),
        st.fixed_dictionaries({"files": st.lists(pair, min_size=1, max_size=4)}),
        st.fixed_dictionaries({}, optional={"files": st.lists(pair, max_size=4) | any_json}),
    )

    def bodies(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
        return st.one_of(
            structured.map(lambda b: json.dumps(b).encode()),
            structured.map(lambda b: json.dumps(b).encode()),
            st.tuples(structured, extra).map(lambda t: json.dumps({**t[0], **t[1]}).encode()),
            any_json.map(lambda b: json.dumps(b).encode()),
            st.binary(max_size=64),
            st.just(b'{"paths": ["' + b"x" * MAX_BODY + b'"]}'),
        )

    # Query strings are UTF-8: no lone surrogates there.
    in_query = st.sampled_from([p for p in spellings if p != "\udcff"])
    query_value = st.one_of(in_query, summed, st.text(max_size=20).filter(_utf8))
    numbers = st.one_of(st.integers().map(str), st.sampled_from(["1", "10", "1000", "0"]))
    junk = st.text(max_size=40).filter(_utf8).map(lambda t: quote(t, safe="=&%/+:;,"))
    files_query = st.one_of(
        st.fixed_dictionaries({"path": in_query, "checksum": summed}).map(urlencode),
        st.fixed_dictionaries({"path": in_query, "checksum": summed}).map(urlencode),
        st.fixed_dictionaries({"path": query_value, "checksum": query_value}).map(urlencode),
        # Hand-spelled encodings of the path: %2e%2e, %2f, %00, doubled escapes.
        st.tuples(
            st.lists(
                st.sampled_from(
                    [
                        "db.db",
                        "t",
                        "p=0",
                        "f0",
                        "..",
                        "%2e%2e",
                        "%2E%2e",
                        "%252e%252e",
                        ".",
                        "%2f",
                        "%00",
                        "",
                        "outside",
                        "secret",
                    ]
                ),
                max_size=6,
            ),
            summed,
        ).map(lambda t: f"path={w}/{'/'.join(t[0])}&checksum={t[1]}"),
        st.dictionaries(st.sampled_from(["path", "checksum", "x"]), query_value, max_size=3).map(
            urlencode
        ),
        junk,
    )
    other_query = st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "limit": numbers | st.text(max_size=5).filter(_utf8),
                "cursor": numbers | st.text(max_size=5).filter(_utf8),
                "from": numbers | st.text(max_size=5).filter(_utf8),
                "db": st.text(max_size=5).filter(_utf8),
                "table": st.text(max_size=5).filter(_utf8),
                "dry_run": st.sampled_from(["true", "true", "false", "1", "0", "yes", ""]),
            },
        ).map(urlencode),
        st.dictionaries(
            st.sampled_from(["limit", "cursor", "from", "dry_run", "x"]),
            query_value | numbers,
            max_size=4,
        ).map(urlencode),
        junk,
    )
    return {
        "recycle": bodies(recycle),
        "resolve": bodies(resolve),
        "event": bodies(event),
        "files_query": files_query,
        "other_query": other_query,
        "scope": st.sampled_from(["admin"] * 8 + ["write", "read", None, "bogus"]),
    }


def _send(d: Daemon, method: str, path: str, scope: str | None, raw: bytes | None = None) -> Reply:
    headers = {"Authorization": "Bearer bogus-token"} if scope == "bogus" else {}
    return d.request(method, path, raw=raw, scope=scope, headers=headers)


def _assert_sound(d: Daemon, before: dict[str, Any], r: Reply, what: str) -> None:
    assert r.status < 500, (what, r, d.log()[-3000:])
    if r.status >= 400:
        if r.body:  # HEAD answers carry no body
            err = r.json()
            assert isinstance(err["error"], str) and err["error"] and isinstance(err["detail"], str)
        assert d.snapshot() == before, (what, r)


def _fuzz_post(d: Daemon, route: str, scope: str | None, body: bytes) -> None:
    before = d.snapshot()
    r = _send(d, "POST", route, scope, body)
    _assert_sound(d, before, r, f"POST {route} {body[:300]!r}")


@pytest.fixture(scope="module")
def strategies(lake: Daemon) -> dict[str, st.SearchStrategy[Any]]:
    return _strategies(lake)


def test_fuzz_recycle(lake: Daemon, strategies: dict[str, Any]) -> None:
    @FUZZ
    @given(body=strategies["recycle"], scope=strategies["scope"])
    def run(body: bytes, scope: str | None) -> None:
        _fuzz_post(lake, "/v1/recycle", scope, body)

    run()


def test_fuzz_resolve(lake: Daemon, strategies: dict[str, Any]) -> None:
    @FUZZ
    @given(body=strategies["resolve"], scope=strategies["scope"])
    def run(body: bytes, scope: str | None) -> None:
        _fuzz_post(lake, "/v1/resolve", scope, body)

    run()


def test_fuzz_events(lake: Daemon, strategies: dict[str, Any]) -> None:
    @FUZZ
    @given(body=strategies["event"], scope=strategies["scope"])
    def run(body: bytes, scope: str | None) -> None:
        _fuzz_post(lake, "/v1/events", scope, body)

    run()


def test_fuzz_query_strings(lake: Daemon, strategies: dict[str, Any]) -> None:
    routes = [
        ("GET", "/v1/files", "files_query"),
        ("GET", "/v1/files", "files_query"),
        ("HEAD", "/v1/files", "files_query"),
        ("GET", "/v1/entries", "other_query"),
        ("GET", "/v1/events", "other_query"),
        ("GET", "/v1/events/current", "other_query"),
        ("POST", "/v1/gc", "other_query"),
    ]

    @settings(FUZZ, max_examples=400)
    @given(route=st.sampled_from(routes), data=st.data(), scope=strategies["scope"])
    def run(route: tuple[str, str, str], data: st.DataObject, scope: str | None) -> None:
        method, path, kind = route
        query = data.draw(strategies[kind], label="query")
        before = lake.snapshot()
        r = _send(lake, method, f"{path}?{query}", scope)
        _assert_sound(lake, before, r, f"{method} {path}?{query}")

    run()

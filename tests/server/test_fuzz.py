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


# -- a corpus of nasty bodies, on a daemon with the default (64 MiB) body limit -----------


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("nasty"))
    write_files(d.warehouse, {"db.db/t/p=0/f": b"stays put" * 10})
    with d.serving():
        yield d


def _nasty(d: Daemon) -> list[tuple[str, bytes]]:
    """(route, body) pairs each of which must be refused: deep nesting, huge numbers,
    invalid UTF-8, duplicate keys whose last value is bad, NUL bytes, 10 MB strings."""
    good = str(d.warehouse / "db.db/t/p=0/f")
    gone = str(d.warehouse / "db.db/nothing-here")
    s = cks.of_bytes(b"stays put" * 10)
    ten_mb = "x" * (10 << 20)
    pair = json.dumps({"path": good, "checksum": s})
    out: list[tuple[str, bytes]] = []
    for route in ("/v1/recycle", "/v1/resolve", "/v1/events"):
        out += [
            (route, b"[" * 100_000),
            (route, b'{"a":' * 50_000),
            (route, b'{"paths": ' + b"[" * 100_000),
            (route, b'{"files": [' + b"{" * 100_000),
            (route, b"9" * 5000),
            (route, b'{"files": [' + b"9" * 5000 + b"]}"),
            (route, b"1e400"),
            (route, b"\xff\xfe\xfd"),
            (route, b'{"paths": ["\xc3\x28"], "op": "DROP_TABLE"}'),
            (route, b'{"paths": ["\xed\xa0\x80"], "op": "DROP_TABLE"}'),  # UTF-8 surrogate
            (route, b'{"paths": ["\xc0\xaf"], "op": "DROP_TABLE"}'),  # overlong "/"
            (route, b"\x00"),
            (route, b'{"\x00": 1}'),
            (route, json.dumps({"\0": 1}).encode()),
            (route, json.dumps({ten_mb: 1}).encode()),
            (route, b"{}" + b" " * 100 + b"{}"),
            (route, b'{"files": [' + pair.encode() + b"]} trailing"),
        ]
    out += [
        ("/v1/recycle", json.dumps({"paths": [good], "op": "DROP_TABLE", "op ": 1}).encode()),
        ("/v1/recycle", b'{"paths": ["' + good.encode() + b'"], "op": "DROP_TABLE", "op": "NUKE"}'),
        ("/v1/recycle", b'{"op": "DROP_TABLE", "paths": ["' + good.encode() + b'"], "paths": []}'),
        ("/v1/recycle", json.dumps({"paths": [good + "\0"], "op": "DROP_TABLE"}).encode()),
        ("/v1/recycle", json.dumps({"paths": [good], "op": "DROP_TABLE\0"}).encode()),
        ("/v1/recycle", json.dumps({"paths": [good], "op": "DROP_TABLE", "db": "d\0"}).encode()),
        ("/v1/recycle", json.dumps({"paths": [ten_mb], "op": "DROP_TABLE"}).encode()),
        ("/v1/recycle", json.dumps({"paths": [good], "op": ten_mb}).encode()),
        ("/v1/recycle", json.dumps({"paths": [good], "op": "DROP_TABLE", "db": ten_mb}).encode()),
        ("/v1/recycle", json.dumps({"paths": [gone] * 200_000, "op": "DROP_TABLE"}).encode()),
        ("/v1/resolve", json.dumps({"files": [{"path": ten_mb, "checksum": s}]}).encode()),
        ("/v1/resolve", json.dumps({"files": [{"path": good, "checksum": ten_mb}]}).encode()),
        ("/v1/resolve", b'{"files": [{"path": "' + good.encode() + b'", "checksum": "'
         + s.encode() + b'", "checksum": 5}]}'),
        ("/v1/events", json.dumps({"eventType": ten_mb}).encode()),
        (
            "/v1/events",
            json.dumps({"eventType": "CREATE_TABLE", "tableObj": {"k": ten_mb}}).encode(),
        ),
        (
            "/v1/events",
            b'{"eventType": "CREATE_TABLE", "tableObj": ' + b'{"a":' * 900 + b"1" + b"}" * 901,
        ),
        (
            "/v1/events",
            b'{"eventType": "CREATE_TABLE", "tableObj": {"n": ' + b"1" * 5000 + b"}}",
        ),
        (
            "/v1/events",
            b'{"eventType": "CREATE_TABLE", "eventType": "DROP_TABLE", "files": [' + pair.encode()
            + b"]}",
        ),
        (
            "/v1/events",
            json.dumps(
                {"eventType": "INSERT", "files": [{"path": good, "checksum": s, "size": True}]}
            ).encode(),
        ),
        (
            "/v1/events",
            b'{"eventType": "INSERT", "files": [{"path": "' + good.encode() + b'", "checksum": "'
            + s.encode() + b'", "size": ' + b"9" * 5000 + b"}]}",
        ),
    ]
    return out


def test_nasty_corpus_is_refused_and_changes_nothing(roomy: Daemon) -> None:
    d = roomy
    for route, raw in _nasty(d):
        before = d.snapshot()
        r = d.request("POST", route, raw=raw)
        what = f"POST {route} {raw[:120]!r}"
        assert 400 <= r.status < 500, (what, r, d.log()[-2000:])
        assert r.json()["error"] and isinstance(r.json()["detail"], str), what
        assert len(r.body) < 4096, (what, "a refusal does not echo the body back")
        assert d.snapshot() == before, what
    assert d.request("GET", "/healthz", scope=None).status == 200
    assert d.request("GET", "/readyz", scope=None).status == 200
    assert (d.warehouse / "db.db/t/p=0/f").read_bytes() == b"stays put" * 10


WRONG = [None, True, False, 0, -1, 2**63, 1.5, "", "x", "\0", [], [None], [[]], {}, {"a": 1}]


def test_wrong_types_for_every_field(roomy: Daemon) -> None:
    """Every field of every body, given every JSON type: a 4xx naming that field, or (where
    the value happens to be valid) an answer that is not a 5xx."""
    d = roomy
    good = str(d.warehouse / "db.db/t/p=0/f")
    s = cks.of_bytes(b"stays put" * 10)
    gone = str(d.warehouse / "db.db/nothing-here")  # a valid recycle of it is a 404
    bases: list[tuple[str, dict[str, Any]]] = [
        (
            "/v1/recycle",
            {
                "paths": [gone],
                "op": "DROP_TABLE",
                "mode": "copy",
                "purge": False,
                "db": "db",
                "table": "t",
                "partitions": [{"p": "0"}],
                "location": gone,
            },
        ),
        ("/v1/resolve", {"files": [{"path": good, "checksum": s}]}),
        (
            "/v1/events",
            {
                "eventType": "DROP_TABLE",  # with files: refused by the store when well typed
                "db": "db",
                "table": "t",
                "partitions": [{"p": "0"}],
                "files": [{"path": good, "checksum": s, "size": 90}],
                "server": "s",
                "timestamp": 1.0,
                "location": gone,
                "tableObj": {"table": "t"},
            },
        ),
    ]
    for route, base in bases:
        control = d.request("POST", route, base).body  # the well-typed body's own answer
        for field in base:
            for value in WRONG:
                body = {**base, field: value}
                before = d.snapshot()
                r = d.request("POST", route, body)
                what = (route, field, value, r)
                assert r.status < 500, what
                if r.status >= 400:
                    assert d.snapshot() == before, what
                    err = r.json()
                    if r.status == 400 and r.body != control:
                        # The store says "bad path" of a path it refuses (relative, NUL).
                        text = err["error"] + err["detail"]
                        assert field in text or "path" in text, what
    assert d.request("GET", "/readyz", scope=None).status == 200


def test_fuzz_content_types(lake: Daemon) -> None:
    """Any Content-Type but JSON: 415, nothing read, nothing changed."""
    d = lake
    body = json.dumps({"paths": [d.fuzz_paths[0]], "op": "DROP_TABLE"}).encode()  # type: ignore[attr-defined]

    @settings(FUZZ, max_examples=60)
    @given(
        ctype=st.one_of(
            st.sampled_from(
                ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                 "application/json-patch+json", "text/json", "application/json; charset=utf-16"]
            ),
            st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
        ),
        route=st.sampled_from(["/v1/recycle", "/v1/resolve", "/v1/events", "/v1/gc"]),
    )
    def run(ctype: str, route: str) -> None:
        if ctype.split(";")[0].strip().lower() == "application/json":
            return
        before = d.snapshot()
        r = d.request("POST", route, raw=body, headers={"Content-Type": ctype})
        assert r.status == 415, (ctype, r)
        assert d.snapshot() == before

    run()

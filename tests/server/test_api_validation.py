"""Bad input to every endpoint: malformed JSON, unknown fields and ops, bad checksums,
oversized bodies, traversal (`..`, `%2e%2e`, absolute paths outside the roots, symlinks
escaping a root). Each is a 4xx with a JSON message that says what is wrong, and none of
them changes the warehouse, the store or the index."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, MakeDaemon, assert_error, tree, write_files

pytestmark = pytest.mark.timeout(120)

MAX_BODY = 65536
SECRET = b"top secret bytes outside every root\n"
GOOD = b"good bytes" * 50


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("validation"), env={"CMROOT_SERVER_MAX_BODY": str(MAX_BODY)})
    write_files(d.warehouse, {"db.db/t/p=1/good": GOOD, "db.db/t/p=1/other": b"other"})
    write_files(d.outside, {"secret": SECRET})
    links = d.warehouse / "db.db/links"
    links.mkdir(parents=True)
    os.symlink(d.outside / "secret", links / "to-secret")
    os.symlink(d.outside, links / "to-outside-dir")
    mixed = d.warehouse / "db.db/mixed"
    mixed.mkdir()
    (mixed / "plain").write_bytes(b"plain file beside an escaping symlink")
    os.symlink(d.outside / "secret", mixed / "escape")
    with d.serving():
        yield d


def _paths(d: Daemon) -> dict[str, str]:
    w, o = str(d.warehouse), str(d.outside)
    return {
        "good": f"{w}/db.db/t/p=1/good",
        "dotdot": f"{w}/db.db/t/../../outside/secret",
        "dotdot_inside": f"{w}/db.db/t/p=1/../p=1/good",
        "outside": f"{o}/secret",
        "etc": "/etc/passwd",
        "url_outside": f"file://{o}/secret",
        "relative": "db.db/t/p=1/good",
        "nul": f"{w}/db.db/t/p=1/good\0",
        "link_file": f"{w}/db.db/links/to-secret",
        "link_dir": f"{w}/db.db/links/to-outside-dir/secret",
        "prefix_sibling": f"{w}-evil/secret",
        "missing": f"{w}/db.db/t/p=1/nope",
        "s3": "s3://bucket/warehouse/x",
    }


def _check(d: Daemon, method: str, path: str, status: int, *words: str, **kw: Any) -> None:
    before = d.snapshot()
    r = d.request(method, path, **kw)
    if method == "HEAD":
        assert r.status == status and r.body == b"", r
    else:
        assert_error(r, status, *words)
        assert SECRET not in r.body and GOOD not in r.body
    assert d.snapshot() == before, (method, path, kw)


# -- POST /v1/recycle --------------------------------------------------------------------


def test_recycle_rejects_malformed_bodies(lake: Daemon) -> None:
    d = lake
    good = _paths(d)["good"]
    for raw, words in [
        (b"{not json", ["malformed JSON"]),
        (b"", ["malformed JSON"]),
        (b"\xff\xfe\x00", ["malformed JSON"]),
        (b"[1, 2]", ["JSON object"]),
        (b'"paths"', ["JSON object"]),
        (b"null", ["JSON object"]),
    ]:
        _check(d, "POST", "/v1/recycle", 400, *words, raw=raw)
    for body, words in [
        ({"paths": [good], "op": "DROP_TABLE", "force": True}, ["unknown field", "force"]),
        ({"paths": [good], "op": "DROP_EVERYTHING"}, ["unknown op", "DROP_EVERYTHING", "DELETE"]),
        ({"paths": [good], "op": "drop_table"}, ["unknown op", "DROP_TABLE"]),
        ({"paths": [good], "op": "CREATE_TABLE"}, ["unknown op"]),
        ({"paths": [good]}, ["missing op", "DROP_TABLE"]),
        ({"paths": [good], "op": ["DROP_TABLE"]}, ["op"]),
        ({"paths": [good], "op": "DROP_TABLE", "mode": "teleport"}, ["mode"]),
        ({"paths": [good], "op": "DROP_TABLE", "mode": ["move"]}, ["mode"]),
        ({"paths": [good], "op": "DROP_TABLE", "mode": {"a": 1}}, ["mode"]),
        ({"paths": [good], "op": "DROP_TABLE", "purge": "yes"}, ["purge"]),
        ({"paths": [good], "op": "DROP_TABLE", "db": 7}, ["db"]),
        ({"paths": [good], "op": "DROP_TABLE", "table": "t\0"}, ["table"]),
        ({"paths": [good], "op": "DROP_TABLE", "partitions": {"p": "1"}}, ["partitions"]),
        ({"paths": [good], "op": "DROP_TABLE", "partitions": [{"p": 1}]}, ["partitions"]),
        ({"paths": [], "op": "DROP_TABLE"}, ["paths"]),
        ({"paths": good, "op": "DROP_TABLE"}, ["paths"]),
        ({"paths": {"a": good}, "op": "DROP_TABLE"}, ["paths"]),
        ({"paths": [good, 7], "op": "DROP_TABLE"}, ["path"]),
        ({"paths": [good, None], "op": "DROP_TABLE"}, ["path"]),
        ({"op": "DROP_TABLE"}, ["paths"]),
    ]:
        _check(d, "POST", "/v1/recycle", 400, *words, body=body)


def test_recycle_refuses_paths_outside_the_roots_whole(lake: Daemon) -> None:
    d = lake
    p = _paths(d)
    cases = [
        ("dotdot", 400, ["'..'"]),
        ("dotdot_inside", 400, ["'..'"]),
        ("relative", 400, ["relative"]),
        ("nul", 400, ["NUL"]),
        ("outside", 403, ["outside the warehouse roots"]),
        ("etc", 403, ["outside the warehouse roots"]),
        ("url_outside", 403, ["outside the warehouse roots"]),
        ("prefix_sibling", 403, ["outside the warehouse roots"]),
        ("s3", 403, ["outside the warehouse roots"]),
        ("link_file", 403, ["symlink"]),
        ("link_dir", 403, ["symlink"]),
        ("missing", 404, ["does not exist"]),
    ]
    for name, status, words in cases:
        # Alone, and after a good path: the good file must not move either.
        for paths in ([p[name]], [p["good"], p[name]]):
            _check(
                d, "POST", "/v1/recycle", status, *words, body={"paths": paths, "op": "DROP_TABLE"}
            )
    # A directory holding a symlink that escapes: refused whole, the plain file stays.
    _check(
        d,
        "POST",
        "/v1/recycle",
        403,
        "symlink",
        body={"paths": [str(d.warehouse / "db.db/mixed")], "op": "DROP_TABLE"},
    )
    # The symlinked directory itself, and the directory holding the links.
    _check(
        d,
        "POST",
        "/v1/recycle",
        403,
        "symlink",
        body={"paths": [str(d.warehouse / "db.db/links")], "op": "DROP_TABLE"},
    )
    assert (d.warehouse / "db.db/mixed/plain").exists()
    assert (d.outside / "secret").read_bytes() == SECRET


def test_recycle_files_one_table_under_one_table_label(lake: Daemon) -> None:
    """A recycle labelled as a table must name that one table's files: events are
    replayed, so another table's files filed under it would be dropped or restored with
    it on every replica. A warehouse root itself is never recycled, labelled or not."""
    d = lake
    w = str(d.warehouse)
    label = {"op": "DROP_TABLE", "db": "db", "table": "t"}
    for paths, words in [
        ([f"{w}/db.db/t/p=1", f"{w}/db.db/mixed/plain"], ["one table", "db.db/mixed", "--table"]),
        ([f"{w}/db.db/t/p=1/good", f"{w}/db.db/mixed"], ["one table", '"table"']),
        ([f"{w}/db.db"], ["one table", "database 'db'"]),
    ]:
        _check(d, "POST", "/v1/recycle", 400, *words, body={"paths": paths, **label})
    for body in ({"paths": [w], **label}, {"paths": [w], "op": "DROP_TABLE"}):
        _check(d, "POST", "/v1/recycle", 403, "warehouse root", body=body)


def test_a_part_of_another_table_cannot_join_a_labelled_statement(
    make_daemon: MakeDaemon,
) -> None:
    """Two-phase: each part may name one table, and all of them the same one; a part of
    another table rolls the whole statement back, as any part that cannot join does."""
    d = make_daemon()
    w = d.warehouse
    write_files(w, {"db.db/t/p=1/a": b"a", "db.db/t/p=2/b": b"b", "db.db/u/c": b"c"})
    before = tree(w)
    part = {"op": "DROP_PARTITION", "db": "db", "table": "t", "prepare": True}
    r = d.request("POST", "/v1/recycle", {"paths": [str(w / "db.db/t/p=1")], **part})
    assert r.status == 200, r
    txid = r.json()["txid"]
    r = d.request("POST", "/v1/recycle", {"paths": [str(w / "db.db/t/p=2")], "txid": txid, **part})
    assert r.status == 200, r  # the same table: joins
    r = d.request("POST", "/v1/recycle", {"paths": [str(w / "db.db/u")], "txid": txid, **part})
    assert_error(r, 400, "one table", "db.db/u")
    assert tree(w) == before
    assert d.request("POST", f"/v1/transactions/{txid}/commit").status == 404
    assert d.errors() == [], d.log()


# -- POST /v1/resolve --------------------------------------------------------------------


def test_resolve_rejects_bad_pairs_naming_them(lake: Daemon) -> None:
    d = lake
    p = _paths(d)
    good = {"path": p["good"], "checksum": cks.of_bytes(GOOD)}
    for raw in (b"{", b"[]", b"42", b'{"files": {"path": "x"}}', b'{"files": "x"}', b"{}"):
        _check(d, "POST", "/v1/resolve", 400, raw=raw)
    _check(d, "POST", "/v1/resolve", 400, "unknown field", body={"files": [good], "more": 1})
    bad_checksums = [
        cks.of_bytes(GOOD).upper(),
        cks.of_bytes(GOOD)[:31],
        cks.of_bytes(GOOD) + "0",
        "z" * 32,
        "",
        None,
        123,
        "sha256:" + "0" * 32,
    ]
    for bad in bad_checksums:
        body = {"files": [good, good, {"path": p["good"], "checksum": bad}]}
        words = ("pair #2", "files[2].checksum", "32 lowercase hex")
        _check(d, "POST", "/v1/resolve", 400, *words, body=body)
    for name in (
        "dotdot",
        "relative",
        "nul",
        "outside",
        "etc",
        "url_outside",
        "link_file",
        "link_dir",
        "s3",
    ):
        body = {"files": [good, {"path": p[name], "checksum": cks.of_bytes(SECRET)}]}
        _check(d, "POST", "/v1/resolve", 400, "pair #1", body=body)
    for pair in (
        {"path": p["good"]},
        {"checksum": good["checksum"]},
        [p["good"], good["checksum"]],
        {**good, "size": 3},
    ):
        _check(d, "POST", "/v1/resolve", 400, "pair #0", "files[0]", body={"files": [pair]})
    # The good pair alone works (the control).
    r = d.request("POST", "/v1/resolve", {"files": [good]}, scope="read")
    assert r.status == 200 and r.json()["files"][0]["status"] == "original"


# -- GET /v1/files -----------------------------------------------------------------------


def test_files_rejects_traversal_in_the_query_string(lake: Daemon) -> None:
    d = lake
    w, o = str(d.warehouse), str(d.outside)
    s = cks.of_bytes(SECRET)  # the right checksum of the secret: still never served
    q = f"&checksum={s}"
    for method in ("GET", "HEAD"):
        for query, status, words in [
            (f"path={w}/db.db/../../outside/secret{q}", 400, ["'..'"]),
            (f"path={w}/db.db/%2e%2e/%2e%2e/outside/secret{q}", 400, ["'..'"]),
            (f"path={w}/db.db/%2E%2E/%2e%2E/outside/secret{q}", 400, ["'..'"]),
            (f"path={w}%2fdb.db%2f%2e%2e%2f%2e%2e%2foutside%2fsecret{q}", 400, ["'..'"]),
            (f"path={w}/db.db/t/p=1/good%00{q}", 400, ["NUL"]),
            (f"path={o}/secret{q}", 403, ["outside"]),
            (f"path=file://{o}/secret{q}", 403, ["outside"]),
            (f"path=%2Fetc%2Fpasswd{q}", 403, ["outside"]),
            (f"path={w}-evil/secret{q}", 403, ["outside"]),
            (f"path={w}/db.db/links/to-secret{q}", 403, ["symlink"]),
            (f"path={w}/db.db/links/to-outside-dir/secret{q}", 403, ["symlink"]),
            (f"path={w}/db.db/mixed/escape{q}", 403, ["symlink"]),
            (f"path=outside/secret{q}", 400, ["relative"]),
            (f"path={w}/db.db/t/p=1/good", 400, ["checksum"]),
            (f"checksum={s}", 400, ["path"]),
            ("", 400, ["path"]),
            (f"path={w}/db.db/t/p=1/good&checksum={s.upper()}", 400, ["checksum"]),
            (f"path={w}/db.db/t/p=1/good&checksum={s[:-1]}", 400, ["checksum"]),
            # Double encoding is not decoded twice: a literal '%2e%2e' name, which does not exist.
            (f"path={w}/db.db/%252e%252e/%252e%252e/outside/secret{q}", 404, []),
        ]:
            _check(d, method, "/v1/files?" + query, status, *words, scope="read")


def test_files_serves_the_good_file(lake: Daemon) -> None:
    d = lake
    r = d.request("GET", d.files_url(_paths(d)["good"], cks.of_bytes(GOOD)), scope="read")
    assert r.status == 200 and r.body == GOOD


# -- GET /v1/entries, /v1/events; POST /v1/gc --------------------------------------------


def test_query_parameters_are_checked(lake: Daemon) -> None:
    d = lake
    for path, words in [
        ("/v1/entries?limit=abc", ["limit", "integer"]),
        ("/v1/entries?limit=0", ["limit"]),
        ("/v1/entries?limit=-5", ["limit"]),
        ("/v1/entries?limit=1000001", ["limit"]),
        ("/v1/entries?limit=1e3", ["limit"]),
        ("/v1/entries?cursor=-1", ["cursor"]),
        ("/v1/entries?cursor=x", ["cursor"]),
        ("/v1/entries?cursor=99999999999999999999999", ["cursor"]),
        ("/v1/events?from=x", ["from"]),
        ("/v1/events?from=-1", ["from"]),
        ("/v1/events?limit=0", ["limit"]),
        ("/v1/events?limit=%00", ["limit"]),
    ]:
        _check(d, "GET", path, 400, *words)
    for q in ("maybe", "yes%00", "2"):
        _check(d, "POST", f"/v1/gc?dry_run={q}", 400, "dry_run")


# -- POST /v1/events ---------------------------------------------------------------------


def test_events_rejects_destructive_and_malformed_events(lake: Daemon) -> None:
    d = lake
    p = _paths(d)
    f = {"path": p["good"], "checksum": cks.of_bytes(GOOD), "size": len(GOOD)}
    base = {"eventType": "CREATE_TABLE", "db": "db", "table": "t"}
    for raw in (b"{", b"[]", b"null"):
        _check(d, "POST", "/v1/events", 400, raw=raw)
    for body, status, words in [
        ({**base, "eventType": "TRUNCATE"}, 400, ["eventType"]),
        ({**base, "eventType": "DROP_TABLE", "files": [f]}, 400, ["/v1/recycle"]),
        ({**base, "eventType": "NUKE"}, 400, ["eventType"]),
        ({**base, "eventType": ["CREATE_TABLE"]}, 400, ["eventType"]),
        ({**base, "eventType": None}, 400, ["eventType"]),
        ({"db": "db"}, 400, ["eventType"]),
        ({**base, "db": 1}, 400, ["db"]),
        ({**base, "ttl": 1}, 400, ["unknown field"]),
        ({**base, "files": f}, 400, ["files"]),
        ({**base, "files": [f, "x"]}, 400, ["file #1"]),
        ({**base, "files": [f, {**f, "size": "12"}]}, 400, ["file #1", "files[1].size", "size"]),
        ({**base, "files": [{**f, "checksum": "nope"}]}, 400, ["checksum"]),
        ({**base, "files": [{**f, "path": p["outside"]}]}, 403, ["outside"]),
        ({**base, "files": [{**f, "path": p["dotdot"]}]}, 400, ["'..'"]),
        ({**base, "files": [{**f, "path": p["relative"]}]}, 400, ["relative"]),
        ({**base, "partitions": [{"p": 1}]}, 400, ["partitions"]),
        ({**base, "partitions": "p=1"}, 400, ["partitions"]),
    ]:
        _check(d, "POST", "/v1/events", status, *words, body=body)


# -- sizes, routes -----------------------------------------------------------------------


def test_oversized_bodies_are_413(lake: Daemon) -> None:
    d = lake
    good = {"path": _paths(d)["good"], "checksum": cks.of_bytes(GOOD)}
    big_resolve = json.dumps({"files": [good] * (2 * MAX_BODY // len(json.dumps(good)))}).encode()
    assert len(big_resolve) > MAX_BODY
    _check(d, "POST", "/v1/resolve", 413, "too large", raw=big_resolve)
    big_recycle = json.dumps({"paths": [good["path"]] * 2000, "op": "DROP_TABLE"}).encode()
    assert len(big_recycle) > MAX_BODY
    _check(d, "POST", "/v1/recycle", 413, "too large", raw=big_recycle)
    big_event = json.dumps({"eventType": "INSERT", "files": [{**good, "size": 1}] * 1000}).encode()
    assert len(big_event) > MAX_BODY
    _check(d, "POST", "/v1/events", 413, "too large", raw=big_event)
    # Just under the limit is fine.
    small = json.dumps({"files": [good] * (MAX_BODY // 2 // len(json.dumps(good)))}).encode()
    assert d.request("POST", "/v1/resolve", raw=small, scope="read").status == 200


def test_unknown_routes_and_methods_answer_json(lake: Daemon) -> None:
    d = lake
    _check(d, "GET", "/v1/nothing", 404)
    _check(d, "GET", "/v1/../etc/passwd", 404)
    _check(d, "GET", "/v1/recycle", 405)
    _check(d, "DELETE", "/v1/files?path=/x&checksum=" + "0" * 32, 405)
    _check(d, "PUT", "/v1/events", 405)


# -- odd paths the filesystem itself refuses --------------------------------------------------


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("odd"))
    write_files(d.warehouse, {"db.db/t/file": b"a regular file", "db.db/d/f": b"in a dir"})
    os.symlink("loop", d.warehouse / "db.db/loop")
    os.mkfifo(d.warehouse / "db.db/fifo")
    with d.serving(check_errors=False):
        yield d


def _odd_paths(d: Daemon) -> dict[str, str]:
    w = str(d.warehouse)
    # Under PATH_MAX bytes with every component under NAME_MAX, but 2 bytes per character
    # in UTF-8 and 6 once percent-encoded: a legal path whose GET /v1/files request line
    # is ~11 KB, over aiohttp's default 8190-byte limit.
    long_legal = w + "".join("/" + "é" * 100 for _ in range((3900 - len(w.encode())) // 201))
    return {
        "fifo": f"{w}/db.db/fifo",
        "directory": f"{w}/db.db/d",
        "long_legal": long_legal,
        "name_too_long": f"{w}/db.db/{'n' * 300}",
        "under_a_file": f"{w}/db.db/t/file/x",
        "symlink_loop": f"{w}/db.db/loop",
    }


@pytest.mark.parametrize("endpoint", ["files", "resolve", "recycle"])
@pytest.mark.parametrize(
    "name", ["fifo", "directory", "long_legal", "name_too_long", "under_a_file", "symlink_loop"]
)
def test_odd_paths_are_answered_4xx_or_2xx_never_5xx(odd: Daemon, name: str, endpoint: str) -> None:
    """A name over NAME_MAX, a path through a regular file, a symlink loop: the filesystem
    refuses them (ENAMETOOLONG, ENOTDIR, ELOOP). That is bad input, never a 500."""
    d = odd
    path = _odd_paths(d)[name]
    before = d.snapshot()
    if endpoint == "files":
        r = d.request("GET", d.files_url(path, "0" * 32), scope="read")
        assert r.status in (400, 404), r
        assert_error(r, r.status)
    elif endpoint == "resolve":
        r = d.request("POST", "/v1/resolve", {"files": [{"path": path, "checksum": "0" * 32}]})
        if r.status == 200:  # no file there: missing
            assert r.json()["files"][0]["status"] == "missing"
        else:  # or a malformed path: the pair is named
            assert_error(r, 400, "pair #0")
    else:
        r = d.request("POST", "/v1/recycle", {"paths": [path], "op": "DELETE"})
        if name == "directory":  # the control: a real directory is recycled
            assert r.status == 200, r
            return
        assert 400 <= r.status < 500, r
        assert_error(r, r.status)
    assert d.snapshot() == before

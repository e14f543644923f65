"""Review 48 (resolve): cb735c8..3f1efc0 — originals lstat'ed by name in a confined
directory descriptor (no open), Structs for Resolution/Located/Resolved, _normalise
skipping normpath, the NAME_MAX precheck, the client's msgspec encoding and typed decoding.

test_break_* failed on 3f1efc0 (those marked "pre-existing" on cb735c8 as well), each
FIXED since (its docstring says how); test_held_* are attacks that held."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import posixpath
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cmroot_testlib import as_user, make_table, pairs_of, write_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot import config as cfgmod
from cmroot.client import Client, Resolved
from cmroot.exceptions import BadRequest, CmrootError, NotFound, OutsideRoots
from cmroot.store import RecycleRequest, Store, read
from cmroot.store.warehouse import NAME_MAX, Warehouse
from tests.server.cmroot_daemon import Daemon

NOBODY = 65534
GROUP = 4242  # a group the file's readers are in (needs no /etc/group line)


# -- helpers --------------------------------------------------------------------------------
def _status(store: Store, path: str, c: str) -> str:
    return store.resolve([{"path": path, "checksum": c}])[0].status


def _served(store: Store, path: str, c: str) -> str:
    """What GET /v1/files serves for the pair (its store call): a status or NotFound."""
    try:
        with store.open_verified(path, c) as v:
            return str(v.status)
    except NotFound:
        return "NotFound"


def _as_nobody(groups: list[int], fn: Any) -> Any:
    """fn()'s JSON result, run in a forked child as uid/gid 65534 with supplementary
    `groups` (the daemon's account after a restart); modules are loaded already."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the store as another user with other groups")
    data = as_user(NOBODY, NOBODY, groups, lambda: json.dumps({"ok": fn()}).encode())
    return json.loads(data)["ok"]


@pytest.fixture
def shared_world(env) -> Any:
    """(base, file, bytes): a warehouse and a store (nobody's) in a 0755 directory (not
    tmp_path: 0700), the file root:GROUP 0640."""
    env.open().close()  # what a store loads is imported before any fork
    base = Path(tempfile.mkdtemp(prefix="cmroot-r48-"))
    try:
        os.chmod(base, 0o755)
        data = os.urandom(5000)
        f = write_file(base / "wh" / "db.db" / "t" / "f", data)
        for d in (base / "wh", base / "wh" / "db.db", base / "wh" / "db.db" / "t"):
            os.chmod(d, 0o755)
        os.chown(f, 0, GROUP)
        os.chmod(f, 0o640)
        (base / "store").mkdir()
        os.chown(base / "store", NOBODY, NOBODY)
        yield base, str(f), data
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _nobody_view(base: Path, path: str, c: str) -> Any:
    """In the child: resolve's answer and GET's (RACY_NS 0: the new file is cached)."""

    def run() -> dict[str, str]:
        read.RACY_NS = 0
        store = Store.open(cfgmod.load(None, env={
            "CMROOT_STORE_ROOT": str(base / "store"),
            "CMROOT_STORE_WAREHOUSE_ROOTS": str(base / "wh")}))
        try:
            return {"resolve": _status(store, path, c), "get": _served(store, path, c)}
        finally:
            store.close()

    return run


# -- invariant 1: `original` only for bytes reachable and hashing to the checksum ----------
def test_break_an_unreadable_original_whose_checksum_is_cached_is_answered_original(
    shared_world,
) -> None:
    """The daemon's account read the file while in its group (checksum cached for the
    file's identity), then is taken out of the group and restarted. The file did not
    change (no chmod, same ctime), so the cache matches and the lstat-only look answers
    `original` for a file the daemon cannot open; GET says 404. cb735c8 opened it:
    `missing`.
    FIXED: each original is opened again (resolve._open_named), not only lstat'ed."""
    base, path, data = shared_world
    c = cks.of_bytes(data)
    before = _as_nobody([GROUP], _nobody_view(base, path, c))
    assert before == {"resolve": "original", "get": "original"}, before
    after = _as_nobody([], _nobody_view(base, path, c))
    assert after["get"] == "NotFound", after
    assert after["resolve"] == "missing", (f"resolve answered {after['resolve']!r} for a "
                                           f"file it cannot open; GET says {after['get']}")


def test_held_chmod_000_of_a_cached_original_moves_its_identity(shared_world) -> None:
    """chmod moves ctime: the cache misses and the file is opened (and refused)."""
    base, path, data = shared_world
    c = cks.of_bytes(data)
    assert _as_nobody([GROUP], _nobody_view(base, path, c))["resolve"] == "original"
    os.chmod(path, 0)
    view = _as_nobody([GROUP], _nobody_view(base, path, c))
    assert view == {"resolve": "missing", "get": "NotFound"}, view


def _agree(store: Store, path: str, c: str) -> str:
    """Resolve's answer for the pair, checked against what GET would serve at once."""
    r, g = _status(store, path, c), _served(store, path, c)
    assert (r == "original") == (g == "original") and (r == "missing") == (g == "NotFound"), (
        f"{path}: resolve says {r!r}, GET serves {g!r}")
    return r


def _settle(paths: list[str]) -> None:
    """Busy-wait until the clock is 50 ms past the files' ctime: RACY_NS is 0 here, so a
    change must get another ctime tick (a same-tick rewrite is RACY_NS's business)."""
    last = max(os.stat(p).st_ctime_ns for p in paths)
    while time.time_ns() < last + 50_000_000:
        pass


def test_held_a_cached_original_replaced_or_rewritten_keeping_size_and_mtime(
    env, store, monkeypatch
) -> None:
    """Cached originals become a FIFO, a directory, a symlink to another file of the root,
    a file renamed over it with the old size and mtime, an in-place rewrite keeping size
    and mtime: none is `original`; a hard link inside the root is; GET agrees each time."""
    monkeypatch.setattr(read, "RACY_NS", 0)
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=6,
                       size=4096)
    pairs = pairs_of(files)
    assert {r.status for r in store.resolve(pairs)} == {"original"}  # all cached
    (fifo, c0), (d, c1), (link, c2), (renamed, c3), (inplace, c4), (linked, c5) = (
        (p["path"], p["checksum"]) for p in pairs)
    _settle(list(files))
    os.unlink(fifo)
    os.mkfifo(fifo)
    os.unlink(d)
    os.mkdir(d)
    os.unlink(link)
    os.symlink(linked, link)  # in the root, other bytes: the path goes through a symlink
    st = os.stat(renamed)
    write_file(renamed + ".new", bytes(b ^ 1 for b in files[renamed]))
    os.replace(renamed + ".new", renamed)
    os.utime(renamed, ns=(st.st_atime_ns, st.st_mtime_ns))
    st = os.stat(inplace)
    with open(inplace, "r+b") as f:
        f.write(bytes(b ^ 1 for b in files[inplace]))
    os.utime(inplace, ns=(st.st_atime_ns, st.st_mtime_ns))
    hard = str(Path(linked).with_name("hard"))
    os.link(linked, hard)
    for path, c in ((fifo, c0), (d, c1), (link, c2), (link, c5), (renamed, c3),
                    (inplace, c4)):
        assert _agree(store, path, c) == "missing", path
    assert _agree(store, hard, c5) == "original"


def test_held_a_directory_swapped_for_a_symlink_while_resolving(env, store, monkeypatch
                                                                 ) -> None:
    """p=1/f held B (cached), p=1 then moved to p=B, a new p=1 holds A. A thread swaps p=1
    for a symlink to p=B and back: B keeps its identity (its cache row would match
    through the symlink), yet neither resolve nor GET may ever give B at p=1."""
    monkeypatch.setattr(read, "RACY_NS", 0)
    part = env.warehouse / "db.db" / "t" / "p=1"
    a, b = os.urandom(3000), os.urandom(3000)
    f = str(write_file(part / "f", b))
    ca, cb = cks.of_bytes(a), cks.of_bytes(b)
    assert _status(store, f, cb) == "original"  # B cached under p=1/f
    part.rename(part.with_name("p=B"))
    write_file(part / "f", a)
    hold = part.with_name("p=A")
    stop, swaps = threading.Event(), [0]

    def swap() -> None:
        while not stop.is_set():
            part.rename(hold)
            os.symlink("p=B", part)
            os.unlink(part)
            hold.rename(part)
            swaps[0] += 1

    t = threading.Thread(target=swap, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the two threads interleave at every few bytecodes
    t.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            got = store.resolve([{"path": f, "checksum": cb}, {"path": f, "checksum": ca}])
            assert got[0].status != "original", "B answered original through the symlink"
            seen.add(got[1].status)
            assert _served(store, f, cb) == "NotFound", "B served as the original"
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert swaps[0] > 100 and seen == {"original", "missing"}, (swaps, seen)


def test_held_a_nested_root_swapped_for_a_symlink_has_no_originals(env, monkeypatch) -> None:
    """A root inside another (listed first), its file cached, moved within the outer root
    and a symlink put in its place: same identity, yet no original; GET agrees."""
    monkeypatch.setattr(read, "RACY_NS", 0)
    inner = env.warehouse / "inner"
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{inner},{env.warehouse}")
    data = os.urandom(2000)
    f, c = str(write_file(inner / "t" / "f", data)), cks.of_bytes(data)
    assert _agree(store, f, c) == "original"
    inner.rename(env.warehouse / "elsewhere")
    os.symlink(env.warehouse / "elsewhere", inner)
    assert _agree(store, f, c) == "missing"


# -- invariant 2: `cmroot` only for an entry of that path and checksum, object present ----
def test_held_cmroot_only_for_the_recorded_path_and_a_present_object(env, store) -> None:
    data = os.urandom(3000)
    c = cks.of_bytes(data)
    p = str(write_file(env.warehouse / "db.db" / "t" / "f", data))
    q = str(env.warehouse / "db.db" / "u" / "f")
    store.recycle(RecycleRequest(paths=[p], mode="move", op="DROP_TABLE"))
    assert _agree(store, p, c) == "cmroot"
    assert _agree(store, q, c) == "missing"  # same bytes, other path: not resolvable
    write_file(q, os.urandom(3000))
    assert _agree(store, q, c) == "missing"
    os.unlink(env.object_path(c))
    assert _agree(store, p, c) == "missing"


# -- invariant 3: malformed pairs, and the canonical key of every spelling ----------------
def _old_key(roots: list[str], raw: str) -> str:
    """cb735c8's locate(raw, resolve=False): the key, or the refusal's name."""
    scheme, _, rest = raw.partition("://")
    authority, _, rpath = rest.partition("/")
    try:
        if "\0" in raw or len(raw) > 4096:
            raise ValueError
        raw.encode("utf-8")
        lp = cfgmod.local_path(raw)
        path = "/" + rpath if lp is None else lp
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError
    except ValueError:
        return "BadRequest"
    key = posixpath.normpath(path).replace("//", "/")
    if lp is None:
        key = f"{scheme}://{authority}{key.rstrip('/')}"
    elif len(key.encode()) > NAME_MAX and any(len(s.encode()) > NAME_MAX
                                              for s in key.split("/")):
        return "BadRequest"
    local = [r for r in roots if ("://" in r) == (lp is None)]
    return key if any(key == r or key.startswith(r + "/") for r in local) else "OutsideRoots"


_SEGMENTS = ["", ".", "..", "...", "...x", ".hidden", "a", "x.", "a..b", "é" * 127 + "a",
             "é" * 128, "x" * 255, "x" * 256, "\U0001f600" * 63 + "abc", "\U0001f600" * 64,
             "%2e%2e", "\ud800", "a\x00b"]


@pytest.fixture(scope="module")
def spelled(tmp_path_factory) -> tuple[Warehouse, list[str]]:
    wh = tmp_path_factory.mktemp("r48wh") / "wh"
    wh.mkdir()
    roots = [str(wh), "memory://r48bucket/wh"]
    return Warehouse(roots), roots


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_held_every_spelling_gives_the_key_it_gave_before(spelled, data) -> None:
    """"/./", trailing "/." and "/", "//", leading "//", "/...x", ".hidden", multi-byte
    names about NAME_MAX, surrogates, NUL, file:// and remote URLs: cb735c8's answer."""
    wh, roots = spelled
    segs = data.draw(st.lists(st.one_of(st.sampled_from(_SEGMENTS),
                                        st.text("a./é", max_size=4)), max_size=6))
    head = data.draw(st.sampled_from(["", "/", "//", "///", "file://", "file:///",
                                      roots[0], roots[0] + "/", "/" + roots[0],
                                      "file://" + roots[0], roots[1], roots[1] + "/"]))
    tail = data.draw(st.sampled_from(["", "/", "/.", "//", "/./"]))
    raw = head + "/".join(segs) + tail
    if not raw:
        return
    try:
        got = wh.locate(raw, resolve=False).key
    except (BadRequest, OutsideRoots) as e:
        got = type(e).__name__
    assert got == _old_key(roots, raw), raw


@pytest.mark.parametrize("name, ok", [
    ("é" * 127 + "a", True), ("é" * 128, False), ("\U0001f600" * 63 + "abc", True),
    ("\U0001f600" * 64, False), ("x" * 255, True), ("x" * 256, False)],
    ids=["e-255", "e-256", "emoji-255", "emoji-256", "x-255", "x-256"])
def test_held_name_max_counts_utf8_bytes_in_every_spelling(env, store, name, ok) -> None:
    good = pairs_of({str(env.warehouse / "f"): b""})
    for p in (f"{env.warehouse}/{name}", f"file://{env.warehouse}/{name}",
              f"{env.warehouse}/./{name}/"):
        pair = {"path": p, "checksum": cks.of_bytes(b"")}
        if ok:
            assert store.resolve([*good, pair])[1].status == "missing"
        else:
            with pytest.raises(BadRequest, match="#1"):
                store.resolve([*good, pair])


# -- the daemon: hostile bodies, the answer's shape, order and duplicates -------------------
@pytest.fixture(scope="module")
def d48(tmp_path_factory) -> Any:
    """(daemon, {name: (path, checksum)}): an original, a recycled file, a FIFO, a symlink
    out of the roots, a file of other bytes, a missing one."""
    d = Daemon(tmp_path_factory.mktemp("r48d"))
    wh = d.warehouse / "db.db" / "t"
    data = {n: os.urandom(1000 + i) for i, n in enumerate(("orig", "gone", "other"))}
    files = {n: (str(write_file(wh / n, b)), cks.of_bytes(b)) for n, b in data.items()}
    write_file(wh / "other", b"changed")
    os.mkfifo(wh / "fifo")
    files["fifo"] = (str(wh / "fifo"), cks.of_bytes(b""))
    write_file(d.outside / "secret", b"secret")
    os.symlink(d.outside, wh / "out")
    files["missing"] = (str(wh / "nothere"), cks.of_bytes(b"x"))
    with d.serving():
        d.client("write").recycle([files["gone"][0]], op="DROP_TABLE")
        yield d, files


def _post(d: Daemon, raw: bytes) -> Any:
    return d.request("POST", "/v1/resolve", raw=raw, scope="read")


_C = "0" * 32
_P = "WH/db.db/t/orig"
_BAD = {  # one bad pair, third of the batch ("WH", "OUT": the daemon's directories)
    "relative": {"path": "db.db/t/orig", "checksum": _C},
    "nul": {"path": "WH/a\0b", "checksum": _C},
    "dotdot": {"path": "WH/db.db/../db.db/t/orig", "checksum": _C},
    "name-256-bytes": {"path": "WH/" + "é" * 128, "checksum": _C},
    "name-256-bytes-url": {"path": "file://WH/" + "\U0001f600" * 64, "checksum": _C},
    "outside": {"path": "OUT/secret", "checksum": _C},
    "symlink-out": {"path": "WH/db.db/t/out/secret", "checksum": _C},
    "checksum-upper": {"path": _P, "checksum": "A" * 32},
    "checksum-int": {"path": _P, "checksum": 12},
    "path-int": {"path": 7, "checksum": _C},
    "path-null": {"path": None, "checksum": _C},
    "path-list": {"path": [_P], "checksum": _C},
    "path-empty": {"path": "", "checksum": _C},
    "extra-key": {"path": _P, "checksum": _C, "size": 1},
    "missing-key": {"path": _P},
    "not-an-object": _P,
    "nested": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    "unix-root": {"path": "/", "checksum": _C},
}


@pytest.mark.parametrize("kind", list(_BAD))
def test_held_a_hostile_pair_is_a_400_naming_it(d48, kind) -> None:
    d, files = d48
    good = [{"path": p, "checksum": c} for p, c in (files["orig"], files["gone"])]
    for ascii_only in (True, False):
        body = json.dumps({"files": [*good, _BAD[kind]]}, ensure_ascii=ascii_only)
        body = body.replace("WH", str(d.warehouse)).replace("OUT", str(d.outside))
        r = _post(d, body.encode())
        assert r.status == 400, (kind, r)
        err = r.json()
        assert set(err) == {"error", "detail"} and "#2" in err["error"], (kind, err)


@pytest.mark.parametrize("name", ["\\ud800", "\\udc00\\ud800", "a\\udfff"])
def test_break_a_lone_surrogate_pair_is_a_400_not_naming_the_pair(d48, name) -> None:
    """(Pre-existing: schemas.decode.) A lone surrogate escape is valid JSON syntax;
    msgspec refuses the body as "malformed JSON" before locate can name the pair.
    FIXED: schemas._surrogate names the item the stdlib finds it in."""
    d, files = d48
    good = [{"path": p, "checksum": c} for p, c in (files["orig"], files["gone"])]
    bad = f'{{"path": "{d.warehouse}/{name}", "checksum": "{_C}"}}'
    body = f'{{"files": {json.dumps(good)[:-1]}, {bad}]}}'
    json.loads(body)  # valid JSON, as the stdlib reads it
    r = _post(d, body.encode())
    assert r.status == 400, r
    assert "#2" in r.json()["error"], f"the 400 names no pair: {r.json()}"


def test_held_answers_have_the_design_shape_in_order_with_duplicates(d48) -> None:
    """DESIGN.md's fields in order, pairs in request order, duplicates answered each,
    each status what GET /v1/files serves; the client's typed answer the same."""
    d, files = d48
    order = ["orig", "gone", "fifo", "missing", "orig", "other", "gone", "orig"]
    pairs = [{"path": files[n][0], "checksum": files[n][1]} for n in order]
    pairs.append({"path": "file://" + files["orig"][0].replace("/t/", "/./t//"),
                  "checksum": files["orig"][1]})
    r = _post(d, json.dumps({"files": pairs}).encode())
    assert r.status == 200, r
    got = r.json()
    assert list(got) == ["files"] and len(got["files"]) == len(pairs)
    want = {"orig": "original", "gone": "cmroot", "fifo": "missing", "missing": "missing",
            "other": "missing"}
    for name, pair, ans in zip([*order, "orig"], pairs, got["files"], strict=True):
        assert list(ans) == ["path", "checksum", "status", "location", "size"], ans
        assert ans["path"] == files[name][0] and ans["checksum"] == pair["checksum"], ans
        assert ans["status"] == want[name], (name, ans)
        if ans["status"] == "missing":
            assert ans["location"] is None and ans["size"] is None, ans
        else:
            assert isinstance(ans["location"], str) and type(ans["size"]) is int, ans
        g = d.request("GET", d.files_url(pair["path"], pair["checksum"]), scope="read")
        assert (g.status == 200) == (ans["status"] != "missing"), (name, ans, g)
        if g.status == 200:
            assert cks.of_bytes(g.body) == pair["checksum"]
    typed = d.client("read").resolve(pairs).files
    assert [x.to_json() for x in typed] == got["files"]


def test_break_a_file_under_a_write_lease_makes_resolve_a_500(make_daemon) -> None:
    """(Pre-existing: O_NONBLOCK opens, EWOULDBLOCK not in read.NO_FILE.) A file's owner
    holding a kernel write lease (F_SETLEASE; Samba oplocks, NFS delegations) makes every
    resolve naming it a 500 instead of an answer per pair.
    FIXED: EWOULDBLOCK of an open is read.NO_FILE: no original while the lease holds."""
    import fcntl
    import signal

    d = make_daemon("lease")
    c = cks.of_bytes(b"leased")
    orig = write_file(d.warehouse / "t" / "orig", b"o")
    leased = write_file(d.warehouse / "t" / "leased", b"leased")
    old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease break notice
    fd = os.open(leased, os.O_WRONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        r = d.request("POST", "/v1/resolve", {"files": [
            {"path": str(orig), "checksum": cks.of_bytes(b"o")},
            {"path": str(leased), "checksum": c}]}, scope="read")
    finally:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)
        signal.signal(signal.SIGIO, old)
    assert r.status < 500, f"resolve with one leased file: {r}"


# -- the client ------------------------------------------------------------------------------
def _sent(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bodies `client` puts on the wire from now on."""
    bodies: list[bytes] = []
    real = client._send

    def send(method, path, payload, hdrs, retry):
        bodies.append(payload)
        return real(method, path, payload, hdrs, retry)

    monkeypatch.setattr(client, "_send", send)
    return bodies


def _strict_json(data: bytes) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"the client sent {name}, which is not JSON: {data[:200]!r}")

    return json.loads(data, parse_constant=refuse)


class _Path(str):
    """A str subclass, as a caller's own path type (or numpy.str_) is."""


def test_break_a_str_subclass_path_is_no_longer_sent(d48) -> None:
    """json.dumps wrote a str subclass as its string; msgspec.convert passes it through
    and msgspec.json.encode raises TypeError, which Client._resolve does not catch.
    FIXED: what msgspec cannot write goes the stdlib's way."""
    d, files = d48
    path, c = files["orig"]
    try:
        got = d.client("read").resolve([{"path": _Path(path), "checksum": c}]).files
    except TypeError as e:
        raise AssertionError(f"Client.resolve refused a str subclass path: {e}") from None
    assert got[0].status == "original"


class _Shown(dict):
    """A dict presenting its values through its methods (a path kept relative to a base,
    shown absolute): json.dumps writes what items() shows."""

    base = ""

    def __getitem__(self, k):
        v = super().__getitem__(k)
        return self.base + v if k == "path" else v

    def items(self):
        return [(k, self[k]) for k in self]

    def get(self, k, default=None):
        return self[k] if k in self else default  # noqa: SIM401 - self[k] is shown


def test_break_a_dict_subclass_pair_is_sent_as_its_raw_storage(d48, monkeypatch) -> None:
    """msgspec.convert copies the dict's storage, not what its methods show: another path
    is asked (cb735c8 sent what json.dumps wrote: the path items() shows).
    FIXED: only plain dicts are written by msgspec."""
    d, files = d48
    path, c = files["orig"]
    pair = _Shown(path=path[len(str(d.warehouse)):], checksum=c)
    pair.base = str(d.warehouse)
    client = d.client("read")
    sent = _sent(client, monkeypatch)
    try:
        got = client.resolve([pair]).files[0].status
    except BadRequest as e:
        got = f"400 {e}: {e.detail}"
    asked = _strict_json(sent[0])["files"][0]["path"]
    assert asked == path and got == "original", f"asked {asked!r}: {got}"


def test_held_a_nan_checksum_is_refused_by_the_daemon(d48, monkeypatch) -> None:
    """Kept as designed (tests/test_client_json_review.py): the client writes requests
    as json.dumps does, NaN as the bare token NaN, which the daemon refuses whole (400)
    rather than taking a null for it."""
    d, files = d48
    client = d.client("read")
    sent = _sent(client, monkeypatch)
    with pytest.raises(BadRequest, match="malformed JSON"):
        client.resolve([{"path": files["orig"][0], "checksum": float("nan")}])
    assert b'"checksum":NaN' in sent[0]


@pytest.mark.parametrize("pair, words", [
    ({"path": b"/x", "checksum": _C}, "bytes"),
    ({"path": "/x\ud800", "checksum": _C}, None),
    ({1: "/x", "checksum": _C}, None),
    ({"path": "/x", "checksum": _C, ("t",): 1}, "keys"),
], ids=["bytes", "lone-surrogate", "int-key", "tuple-key"])
def test_held_what_is_not_a_pair_of_strings_is_refused_or_sent_as_json(
    d48, monkeypatch, pair, words
) -> None:
    d, _ = d48
    client = d.client("read")
    sent = _sent(client, monkeypatch)
    if words is not None:
        with pytest.raises(TypeError, match=words):
            client.resolve([pair])
        assert sent == []
        return
    with pytest.raises(BadRequest):  # "#0", or the schema's "malformed JSON" (see above)
        client.resolve([pair])
    _strict_json(sent[0])


def test_held_resolved_still_behaves_as_the_dataclass_did(d48) -> None:
    d, files = d48
    pairs = [{"path": p, "checksum": c} for p, c in files.values()]
    got = d.client("read").resolve(pairs)
    import pyspark.cloudpickle as cloudpickle

    for r in got.files:
        assert type(r) is Resolved
        assert r["path"] == r.path and r.get("size") == r.size and r.get("nope", 5) == 5
        assert r == Resolved(**r.to_json()) and hash(r) == hash(Resolved(**r.to_json()))
        assert r != r.to_json()
        assert pickle.loads(pickle.dumps(r)) == r == cloudpickle.loads(cloudpickle.dumps(r))
        assert repr(r) == (f"Resolved(path={r.path!r}, checksum={r.checksum!r}, status="
                           f"{r.status!r}, location={r.location!r}, size={r.size!r})")
        with pytest.raises(AttributeError):
            r.status = "original"  # type: ignore[misc]
    assert got["files"] == got.files and got.to_json() == {"files": [r.to_json()
                                                                     for r in got.files]}


def test_break_resolved_is_no_longer_a_dataclass() -> None:
    """Resolved was a frozen dataclass (FileRef, Recycled, Resolutions still are):
    callers' dataclasses.replace / asdict now raise TypeError.
    FIXED: Resolved is a frozen dataclass again (msgspec decodes into it directly)."""
    r = Resolved("/wh/f", _C, "missing")
    assert dataclasses.is_dataclass(r), "Resolved is no dataclass any more"
    assert dataclasses.replace(r, status="cmroot").status == "cmroot"
    assert dataclasses.asdict(r) == r.to_json()


def _answered(monkeypatch: pytest.MonkeyPatch, answer: Any) -> Client:
    """A client whose daemon answers `answer` to anything."""
    client = Client("http://127.0.0.1:9", busy_wait=0)
    reply = SimpleNamespace(status=200, read=lambda: json.dumps(answer).encode())
    monkeypatch.setattr(client, "_request", lambda *a, **k: reply)
    return client


_F = {"path": "/wh/f", "checksum": _C, "status": "cmroot", "location": "/s/o", "size": 3}


@pytest.mark.parametrize("answer, want", [
    ({"files": [{**_F, "mtime": 1.5, "extra": {"a": [1]}}]}, Resolved(**_F)),
    ({"files": [_F], "took": 0.25, "server": "x"}, Resolved(**_F)),
    ({"files": [{"path": "/wh/f", "checksum": _C, "status": "missing"}]},
     Resolved("/wh/f", _C, "missing")),
    ({"files": [{**_F, "size": 3.0}]}, Resolved(**{**_F, "size": 3.0})),
    ({"files": [{**_F, "path": "/wh/\ud800"}]}, Resolved(**{**_F, "path": "/wh/\ud800"})),
], ids=["extra-fields", "extra-top-level", "no-location-size", "float-size", "surrogate"])
def test_held_an_unexpected_answer_still_decodes_as_before(monkeypatch, answer, want) -> None:
    client = _answered(monkeypatch, answer)
    assert client.resolve([{"path": "/wh/f", "checksum": _C}]).files == [want]


@pytest.mark.parametrize("answer", [
    {"files": [{"path": "/wh/f", "checksum": _C}]}, {"files": 5}, {"files": [5]}, {"x": []},
], ids=["no-status", "files-int", "file-int", "no-files"])
def test_break_a_garbled_answer_is_no_clear_error(monkeypatch, answer) -> None:
    """(Pre-existing.) An answer without a status, or files not objects: KeyError or
    TypeError from inside the client, not a CmrootError naming a bad answer.
    FIXED: Client._resolve raises CmrootError naming a bad answer."""
    try:
        _answered(monkeypatch, answer).resolve([{"path": "/wh/f", "checksum": _C}])
    except CmrootError:
        return
    except Exception as e:
        raise AssertionError(f"{type(e).__name__}: {e} (no CmrootError)") from None
    raise AssertionError("a garbled answer was taken")

"""Bad input is refused whole with the right error class and a clear message, and nothing
changes: not the warehouse, not the files outside it, not the store, not the index
(invariants 2 and 5). Property tests throw arbitrary strings and JSON values at
resolve / locate / recycle and check that only cmroot errors come back."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from cmroot_testlib import Clock, Env, make_table, snapshot, table_dir, write_file
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, CmrootError, NotFound, OutsideRoots
from cmroot.store import RecycleRequest, Store

GOOD = "0" * 32


@pytest.fixture
def world(env: Env, store: Store):
    """A warehouse with a table, a secret file outside it, and one recycle already done
    (so the index is not empty and a change would show in its counts)."""
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=3)
    done = make_table(env.warehouse, "db", "old", [{}], files_per_partition=2)
    store.recycle(
        RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "old"))], op="DROP_TABLE")
    )
    secret = write_file(env.outside / "secret.txt", b"do not touch")
    return files, done, secret


def refused(env: Env, call, error: type[CmrootError], *words: str) -> CmrootError:
    before = snapshot(env)
    with pytest.raises(CmrootError) as ei:
        call()
    e = ei.value
    assert type(e) is error or isinstance(e, error), f"{type(e).__name__}: {e}"
    msg = str(e).lower()
    for w in words:
        assert w.lower() in msg, f"{w!r} not in {msg!r}"
    assert snapshot(env) == before, "a refused request changed something"
    return e


def recycle(store: Store, *paths: object, **kw):
    kw.setdefault("op", "DROP_TABLE")
    return lambda: store.recycle(RecycleRequest(paths=list(paths), **kw))


def resolve(store: Store, path: object, checksum: object = GOOD):
    return lambda: store.resolve([{"path": path, "checksum": checksum}])


# -- recycle -----------------------------------------------------------------------------------


def test_outside_the_roots(env, store, world) -> None:
    _, _, secret = world
    e = refused(
        env, recycle(store, str(secret)), OutsideRoots, "outside the warehouse roots", str(secret)
    )
    assert e.status == 403
    refused(env, recycle(store, "/etc/passwd"), OutsideRoots, "/etc/passwd")
    refused(env, recycle(store, "/"), OutsideRoots)
    refused(env, recycle(store, str(env.store_root)), OutsideRoots)  # not even the store itself
    refused(env, recycle(store, f"file://{secret}"), OutsideRoots)
    refused(env, recycle(store, "s3://bucket/warehouse/t"), OutsideRoots)
    # a sibling whose name merely starts like the root
    sib = write_file(Path(str(env.warehouse) + "-2") / "f", b"x")
    refused(env, recycle(store, str(sib)), OutsideRoots)


def test_one_bad_path_refuses_the_whole_request(env, store, world) -> None:
    files, _, secret = world
    good = sorted(files)[0]
    refused(env, recycle(store, good, str(secret)), OutsideRoots)
    refused(env, recycle(store, good, str(env.warehouse / "nope")), NotFound)
    refused(env, recycle(store, good, "relative/x"), BadRequest)
    assert Path(good).read_bytes() == files[good]


def test_dot_dot_segments(env, store, world) -> None:
    tdir = table_dir(env.warehouse, "db", "t")
    sneaky = f"{tdir}/../../../outside/secret.txt"
    e = refused(env, recycle(store, sneaky), BadRequest, "..")
    assert e.status == 400
    refused(env, recycle(store, f"{tdir}/p=1/.."), BadRequest, "..")
    refused(env, resolve(store, sneaky), BadRequest, "..", "#0")


def test_symlink_escaping_a_root_as_the_named_path(env, store, world) -> None:
    _, _, secret = world
    link = env.warehouse / "db.db" / "link-to-secret"
    link.symlink_to(secret)
    refused(env, recycle(store, str(link)), OutsideRoots, "symlink", str(secret))
    dlink = env.warehouse / "db.db" / "dir-link"
    dlink.symlink_to(env.outside, target_is_directory=True)
    refused(env, recycle(store, str(dlink)), OutsideRoots)
    refused(env, recycle(store, f"{dlink}/secret.txt"), OutsideRoots)
    refused(env, resolve(store, f"{dlink}/secret.txt", cks.of_bytes(b"do not touch")), BadRequest)
    with pytest.raises(CmrootError):
        store.open_verified(f"{dlink}/secret.txt", cks.of_bytes(b"do not touch"))
    assert secret.read_bytes() == b"do not touch"


def test_symlink_escaping_a_root_inside_a_recycled_directory(env, store, world) -> None:
    files, _, secret = world
    tdir = table_dir(env.warehouse, "db", "t")
    (tdir / "p=2" / "evil.parquet").symlink_to(secret)
    refused(env, recycle(store, str(tdir)), OutsideRoots, "symlink", "evil.parquet")
    (tdir / "p=2" / "evil.parquet").unlink()
    (tdir / "p=1" / "evil-dir").symlink_to(env.outside, target_is_directory=True)
    refused(env, recycle(store, str(tdir)), OutsideRoots, "symlink")
    assert {p: Path(p).read_bytes() for p in files} == files


def test_a_parent_swapped_for_a_symlink_after_a_lookup(env, store, world) -> None:
    """Confinement is decided on the path as it is now, not as it was a moment ago."""
    d = env.warehouse / "db.db" / "swap"
    write_file(d / "secret.txt", b"inside")
    assert store.resolve([{"path": str(d / "secret.txt"), "checksum": GOOD}])[0].status == "missing"
    shutil.rmtree(d)
    d.symlink_to(env.outside, target_is_directory=True)
    refused(env, recycle(store, str(d / "secret.txt")), OutsideRoots)
    assert (env.outside / "secret.txt").read_bytes() == b"do not touch"


def test_a_symlink_inside_the_roots_is_not_recycled(env, store, world) -> None:
    files, _, _ = world
    tdir = table_dir(env.warehouse, "db", "t")
    (tdir / "p=1" / "alias").symlink_to(sorted(files)[-1])
    refused(env, recycle(store, str(tdir)), BadRequest, "symlink")


def test_special_files_are_refused(env, store, world) -> None:
    tdir = table_dir(env.warehouse, "db", "t")
    os.mkfifo(tdir / "p=1" / "pipe")
    refused(env, recycle(store, str(tdir)), BadRequest, "regular file")


def test_a_file_name_that_is_not_utf8_refuses_the_directory(env, store, world) -> None:
    files, _, _ = world
    tdir = table_dir(env.warehouse, "db", "t")
    with open(os.fsencode(tdir / "p=1") + b"/part-\xff.parquet", "wb") as f:
        f.write(b"latin-1 name")
    refused(env, recycle(store, str(tdir)), BadRequest, "utf-8")
    assert {p: Path(p).read_bytes() for p in files} == files


def test_missing_paths(env, store, world) -> None:
    files, _, _ = world
    missing = str(env.warehouse / "db.db" / "t" / "p=9")
    e = refused(env, recycle(store, missing), NotFound, missing)
    assert e.status == 404
    below_a_file = sorted(files)[0] + "/child"
    refused(env, recycle(store, below_a_file), NotFound)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("relative/path", ["relative"]),
        ("./x", ["relative"]),
        ("", ["bad path"]),
        ("file:relative/x", ["relative"]),
    ],
)
def test_relative_and_empty_paths(env, store, world, path, words) -> None:
    refused(env, recycle(store, path), BadRequest, *words)
    refused(env, resolve(store, path), BadRequest, "#0")


def test_nul_bytes_and_oversized_paths(env, store, world) -> None:
    tdir = table_dir(env.warehouse, "db", "t")
    refused(env, recycle(store, f"{tdir}/p=1\0/part-00000.parquet"), BadRequest, "nul")
    refused(env, recycle(store, str(tdir) + "/x" * 3000), BadRequest)
    refused(env, recycle(store, str(tdir) + "/" + "a" * 300), BadRequest)  # NAME_MAX
    refused(env, resolve(store, f"{tdir}\0"), BadRequest, "#0")
    refused(env, resolve(store, str(tdir) + "/" + "a" * 300), BadRequest)


def test_unencodable_and_unparsable_paths(env, store, world) -> None:
    tdir = table_dir(env.warehouse, "db", "t")
    refused(env, recycle(store, f"{tdir}/\ud800"), BadRequest)  # a lone surrogate from JSON
    refused(env, resolve(store, f"{tdir}/\udcff"), BadRequest)
    refused(env, recycle(store, "file://[::1/x"), BadRequest)
    refused(env, resolve(store, "file://[bad/x"), BadRequest)


@pytest.mark.parametrize("path", [None, 42, b"/bytes", ["/list"], {"path": "/x"}])
def test_non_string_paths(env, store, world, path) -> None:
    refused(env, recycle(store, path), BadRequest)
    refused(env, resolve(store, path), BadRequest)


def test_request_fields(env, store, world) -> None:
    files, _, _ = world
    p = sorted(files)[0]
    refused(env, recycle(store, p, op="DROP_EVERYTHING"), BadRequest, "unknown op", "DROP_TABLE")
    refused(env, recycle(store, p, op="drop_table"), BadRequest, "unknown op")
    refused(env, recycle(store, p, op="CREATE_TABLE"), BadRequest, "unknown op")
    refused(env, recycle(store, p, op=["DROP_TABLE"]), BadRequest, "op")
    refused(env, recycle(store, p, mode="rename"), BadRequest, "bad mode", "move", "copy")
    refused(env, recycle(store, p, mode=None), BadRequest, "mode")
    refused(env, recycle(store, p, mode={"move": 1}), BadRequest, "mode")
    refused(env, recycle(store, p, purge="yes"), BadRequest, "purge")
    refused(env, recycle(store, p, db=7), BadRequest, "db")
    refused(env, recycle(store, p, table="t\0"), BadRequest, "table")
    refused(env, recycle(store, p, partitions={"p": "1"}), BadRequest, "partitions")
    refused(env, recycle(store, p, partitions=[{"p": 1}]), BadRequest, "partitions")
    refused(env, recycle(store, p, partitions=["p=1"]), BadRequest, "partitions")
    refused(env, lambda: store.recycle(RecycleRequest(paths=[], op="DELETE")), BadRequest, "paths")
    refused(env, lambda: store.recycle(RecycleRequest(paths=p, op="DELETE")), BadRequest, "paths")


# -- resolve / locate ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "checksum",
    ["", "0" * 31, "0" * 33, "A" * 32, "z" * 32, None, 123, ["0" * 32], "0" * 31 + "\0"],
)
def test_malformed_checksums(env, store, world, checksum) -> None:
    files, _, _ = world
    p = sorted(files)[0]
    e = refused(env, resolve(store, p, checksum), BadRequest, "checksum", "#0")
    assert e.status == 400
    refused(env, lambda: store.open_verified(p, checksum), BadRequest, "checksum")


def test_a_bad_pair_refuses_the_batch_and_names_the_pair(env, store, world) -> None:
    files, _, secret = world
    pairs = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    for i, bad in [
        (2, {"path": str(secret), "checksum": GOOD}),
        (4, {"path": "rel", "checksum": GOOD}),
        (5, {"path": pairs[0]["path"], "checksum": "nope"}),
        (1, {"path": pairs[0]["path"]}),
        (3, {"path": pairs[0]["path"], "checksum": GOOD, "extra": 1}),
        (0, "not a dict"),
    ]:
        batch = [*pairs[:i], bad, *pairs[i:]]
        refused(env, lambda b=batch: store.resolve(b), BadRequest, f"bad pair #{i}")
    refused(env, lambda: store.resolve({"files": pairs}), BadRequest)
    refused(env, lambda: store.resolve(None), BadRequest)


def test_outside_roots_on_resolve_is_a_400_naming_the_pair(env, store, world) -> None:
    _, _, secret = world
    e = refused(
        env,
        resolve(store, str(secret), cks.of_bytes(b"do not touch")),
        BadRequest,
        "#0",
        str(secret),
        "outside",
    )
    assert e.status == 400


def test_add_event_bad_input(env, store, world) -> None:
    refused(env, lambda: store.add_event("NOPE"), BadRequest, "eventType")
    refused(
        env,
        lambda: store.add_event("INSERT", files=[{"path": "/etc/x", "checksum": GOOD}]),
        OutsideRoots,
    )
    refused(env, lambda: store.add_event("INSERT", files=["x"]), BadRequest, "file #0")
    refused(
        env,
        lambda: store.add_event(
            "INSERT", files=[{"path": str(env.warehouse / "f"), "checksum": GOOD, "size": "1"}]
        ),
        BadRequest,
        "file #0",
    )


# -- properties ---------------------------------------------------------------------------------

SPECIAL = [
    "",
    ".",
    "..",
    "...",
    "//",
    "~",
    "\\",
    "%2e%2e",
    "\0",
    "\ud800",
    "\udcff",
    "\n",
    " ",
    "*",
    "?",
    "[",
    "file:",
    "p=1",
    "a" * 256,
    "é" * 130,
    "-",
]


def path_strategy(root: str, outside: str):
    segment = st.one_of(
        st.text(max_size=12),
        st.sampled_from(SPECIAL),
        st.text(st.characters(), min_size=200, max_size=300),
    )
    rel = st.lists(segment, max_size=5).map("/".join)
    return st.one_of(
        st.text(max_size=40),
        st.text(st.characters(codec=None), max_size=40),
        rel.map(lambda r: f"{root}/{r}"),
        rel.map(lambda r: f"file://{root}/{r}"),
        rel.map(lambda r: f"file://{r}"),
        rel.map(lambda r: f"{outside}/{r}"),
        rel.map(lambda r: f"s3://bucket/{r}"),
        st.tuples(st.text(max_size=8), rel).map(lambda t: f"{t[0]}://{t[1]}"),
        rel.map(lambda r: f"/{r}"),
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


class PropertyWorld:
    """A store for hypothesis runs (function-scoped fixtures do not mix with @given)."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="cmroot-prop-")
        base = Path(self.tmp)
        self.env = Env(
            base=base,
            warehouse=base / "wh",
            store_root=base / "cmroot",
            outside=base / "outside",
            clock=Clock(),
        )
        self.env.warehouse.mkdir()
        self.env.outside.mkdir()
        make_table(self.env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=2)
        write_file(self.env.outside / "secret", b"secret")
        (self.env.warehouse / "db.db" / "out").symlink_to(
            self.env.outside, target_is_directory=True
        )
        (self.env.warehouse / "loop").symlink_to(self.env.warehouse / "loop")
        self.store = self.env.open()

    def close(self) -> None:
        self.env.close_all()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def prop():
    w = PropertyWorld()
    yield w
    w.close()


def _state(w: PropertyWorld):
    return snapshot(w.env)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_paths_to_resolve_and_locate(prop, data) -> None:
    w = prop
    path = data.draw(path_strategy(str(w.env.warehouse), str(w.env.outside)))
    checksum = data.draw(st.one_of(st.just(GOOD), st.text(max_size=40)))
    before = _state(w)
    try:
        res = w.store.resolve([{"path": path, "checksum": checksum}])
        assert len(res) == 1 and res[0].status in ("original", "cmroot", "missing")
    except CmrootError as e:
        assert e.status == 400 and str(e)
    try:
        with w.store.open_verified(path, checksum) as v:
            assert v.status in ("original", "cmroot")
    except CmrootError as e:
        assert e.status in (400, 403, 404) and str(e)
    assert _state(w) == before


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_paths_to_recycle_never_change_anything(prop, data) -> None:
    w = prop
    path = data.draw(path_strategy(str(w.env.warehouse), str(w.env.outside)))
    try:
        loc = w.store.warehouse.locate(path)
    except CmrootError:
        loc = None
    # a path that names something real would (rightly) be recycled: not this property
    assume(loc is None or not os.path.lexists(loc.key) or os.path.islink(loc.key))
    before = _state(w)
    with pytest.raises(CmrootError) as ei:
        w.store.recycle(RecycleRequest(paths=[path], op="DELETE"))
    assert ei.value.status in (400, 403, 404) and str(ei.value)
    assert _state(w) == before


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=JSON, mode=JSON, op=JSON, purge=JSON, db=JSON, partitions=JSON)
def test_arbitrary_json_request_fields(prop, paths, mode, op, purge, db, partitions) -> None:
    """What a JSON body can carry, field by field: only 4xx cmroot errors, no change."""
    w = prop
    before = _state(w)
    try:
        w.store.recycle(
            RecycleRequest(paths=paths, mode=mode, op=op, purge=purge, db=db, partitions=partitions)
        )
    except CmrootError as e:
        assert 400 <= e.status < 500, e
    else:  # pragma: no cover - no generated request names an existing file
        raise AssertionError("an arbitrary request succeeded")
    assert _state(w) == before


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=JSON)
def test_arbitrary_json_to_resolve(prop, pairs) -> None:
    w = prop
    before = _state(w)
    try:
        res = w.store.resolve(pairs)
        assert all(r.status == "missing" for r in res) or res == []
    except CmrootError as e:
        assert e.status == 400, e
    assert _state(w) == before

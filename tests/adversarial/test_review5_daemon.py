"""Fifth hostile review, daemon side: 904fdfe (Warehouse.locate_all and Located.is_file,
Journal.items_of placing sources by name, Objects.make_shards_soon). Python Store API on a
real filesystem (tests/conftest.py's `env` / `store`). A test FAILS while the bug its
docstring describes is present; "probe" tests pass and pin a sequence."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from cmroot_testlib import Env, object_file

from cmroot import checksum as cks
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest, Store


def resolve_status(store: Store, path: Path, data: bytes) -> str:
    res = store.resolve([{"path": str(path), "checksum": cks.of_bytes(data)}])
    first = res[0]
    return first["status"] if isinstance(first, dict) else first.status


def test_a_nested_root_path_holding_a_regular_file_is_never_recycled(env: Env) -> None:
    """Roots /wh and /wh/inner (a nested root, configured before its directory exists).
    A writer of /wh creates /wh/inner as a regular FILE. DELETE /wh/inner (move).
    Before 904fdfe, Recycler._plan called Warehouse.protected() on every path: /wh/inner is
    a warehouse root, refused. Now locate_all marks it `is_file` (a regular file, resolved
    afresh) and _plan skips protected() for it, so the root's own path is recycled and an
    event records it. Invariant 5: "A warehouse root itself, and any directory that
    contains one, is never removed, moved or recycled by any hook or verb." Expected: the
    request is refused (403) and /wh/inner stays where it is."""
    inner = env.warehouse / "inner"
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{env.warehouse},{inner}")
    inner.write_bytes(b"not a directory\n")
    refused = None
    try:
        res = store.recycle(RecycleRequest(paths=[str(inner)], op="DELETE"))
    except CmrootError as e:
        refused = e
        res = None
    assert refused is not None, (res, inner.exists())
    assert inner.is_file()


def test_abort_after_a_parent_became_a_symlink_out_of_the_roots_writes_nothing_outside(
    env: Env, store: Store
) -> None:
    """Probe (passes). Journal.items_of now places a prepared transaction's sources by name
    (resolve=False). Sequence: prepare DELETE of /wh/t/f (staged); the writer of /wh
    replaces /wh/t with a symlink to /outside/t (a directory holding nothing named f);
    abort. The put-back must not follow the symlink: nothing appears under /outside, and
    f's bytes stay retrievable by (path, checksum) from the store (displaced)."""
    t = env.warehouse / "t"
    t.mkdir()
    f = t / "f"
    f.write_bytes(b"old bytes\n")
    prep = store.prepare(RecycleRequest(paths=[str(f)], op="DELETE"))
    assert not f.exists()
    (env.outside / "t").mkdir()
    shutil.rmtree(t)
    t.symlink_to(env.outside / "t", target_is_directory=True)
    store.abort(prep.txid)
    assert os.listdir(env.outside / "t") == []
    assert resolve_status(store, f, b"old bytes\n") == "cmroot"


def test_file_whose_parent_is_swapped_for_a_symlink_in_a_loop_never_moves_outside(
    env: Env, store: Store
) -> None:
    """locate_all resolves each parent once per request and a regular file found there is
    staged without confirm() or the source's listing (Located.is_file). A racing writer
    flips /wh/t between a real directory and a symlink to /outside/t (both holding a file
    f) while DELETE /wh/t/f runs 2,000 times. Confinement holds (the part that passes): no
    file under /outside is moved, read into the store or recycled. FAILS on the error
    contract: when locate_all sees no regular file (the link was there), _plan calls
    Warehouse.protected(), whose bare os.path.realpath() (warehouse._realpath catches only
    RecursionError) raises FileNotFoundError when the link is renamed away between
    realpath's lstat and its readlink. That raw OSError escapes Store.recycle (the HTTP
    API turns it into a 500; DESIGN: never a 5xx for bad input) instead of the
    PathUnsettled (409 "try again") that locate() gives the same race."""
    t = env.warehouse / "t"
    real_t = env.warehouse / "t_real"
    out_t = env.outside / "t"
    out_t.mkdir()
    (out_t / "f").write_bytes(b"outside secret\n")
    stop = threading.Event()

    link_t = env.warehouse / "t_link"

    def flipper() -> None:
        while not stop.is_set():
            for a, b in ((real_t, t), (t, real_t), (link_t, t), (t, link_t)):
                try:
                    os.rename(a, b)
                except OSError:
                    pass

    crashes: list[str] = []
    real_t.mkdir()
    link_t.symlink_to(out_t, target_is_directory=True)
    th = threading.Thread(target=flipper, daemon=True)
    th.start()
    try:
        for i in range(2000):
            for d in (real_t, t):
                try:
                    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
                    os.write(fd, b"inside %d\n" % i)
                    os.close(fd)
                except OSError:
                    pass
            try:
                store.recycle(RecycleRequest(paths=[str(t / "f")], op="DELETE"))
            except CmrootError:
                pass
            except Exception as e:  # not one of the API's errors: an HTTP 500
                crashes.append(f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        th.join(10)
    assert (out_t / "f").read_bytes() == b"outside secret\n"
    secret = cks.of_bytes(b"outside secret\n")
    assert not (object_file(env.store_root, secret)).exists()
    if t.is_symlink():
        t.unlink()
    assert resolve_status(store, t / "f", b"outside secret\n") == "missing"
    assert crashes == [], crashes[:3]


def test_store_close_leaves_no_thread_making_shard_directories(env: Env) -> None:
    """Probe (passes). Objects.make_shards_soon makes a prepared transaction's shard
    directories on a background thread; Store.close must wait for it: after close, no
    `cmroot-shards` thread is alive and no shard directory appears."""
    store = env.open()
    d = env.warehouse / "t"
    d.mkdir()
    for i in range(400):
        (d / f"f{i}").write_bytes(b"%d\n" % i)
    store.prepare(RecycleRequest(paths=[str(d)], op="DELETE"))
    store.close()
    objects = env.store_root / "objects"
    before = sorted(str(p) for p in objects.rglob("*")) if objects.exists() else []
    alive = [t.name for t in threading.enumerate() if t.name.startswith("cmroot-shards")]
    assert alive == []
    after = sorted(str(p) for p in objects.rglob("*")) if objects.exists() else []
    assert after == before


def test_a_lookup_just_after_a_symlinked_parent_was_put_back_is_answered_afresh(
    env: Env, store: Store
) -> None:
    """Found by CI (the flip loop above, then a lookup): /wh/t was a symlink to /outside/t
    when a lookup cached its parent's real path; within the cache's second it is a real
    directory again. The next lookup was refused as escaping the roots on the stale entry.
    A refusal must rest on a fresh look: the file now under /wh/t is found."""
    t = env.warehouse / "t"
    out_t = env.outside / "t"
    out_t.mkdir()
    (out_t / "f").write_bytes(b"outside\n")
    t.symlink_to(out_t, target_is_directory=True)
    try:
        resolve_status(store, t / "f", b"outside\n")
    except CmrootError:
        pass  # refused: the path escapes (what it should say while the link is there)
    t.unlink()
    t.mkdir()
    (t / "f").write_bytes(b"inside\n")
    assert resolve_status(store, t / "f", b"inside\n") == "original"

"""Adversarial reproducers: invariant 5 (a warehouse root, and any directory containing
one, is never removed, moved or recycled)."""

from __future__ import annotations

import os

import pytest
from cmroot_testlib import Env, on_point

from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest


def test_recycling_a_root_itself_is_refused(env: Env) -> None:
    """Sequence: POST recycle {"paths": ["<warehouse root>"], "op": "DROP_TABLE"}.
    Observed: accepted; every file of the whole warehouse is moved into the store.
    Breaks invariant 5 ("a warehouse root itself ... is never ... recycled by any hook or
    verb"). Expected: refused (4xx) before anything moves. `Warehouse.is_root` and
    `Warehouse.protected` exist but Recycler.recycle never consults them."""
    store = env.open()
    (env.warehouse / "db.db" / "t").mkdir(parents=True)
    f = env.warehouse / "db.db" / "t" / "part-0"
    f.write_bytes(b"x")
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(env.warehouse)], op="DROP_TABLE"))
    assert f.read_bytes() == b"x"


def test_recycling_a_directory_that_contains_a_nested_root_is_refused(env: Env) -> None:
    """Roots /wh and /wh/t/inner (nested). Sequence: DROP_TABLE /wh/t.
    Observed: accepted; the files of the root /wh/t/inner are recycled with it.
    Breaks invariant 5 ("any directory that contains one is never ... recycled").
    Expected: refused before anything moves."""
    inner = env.warehouse / "t" / "inner"
    inner.mkdir(parents=True)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{env.warehouse},{inner}")
    (inner / "f").write_bytes(b"inner data")
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(env.warehouse / "t")], op="DROP_TABLE"))
    assert (inner / "f").read_bytes() == b"inner data"


def test_root_configured_through_a_symlink_is_not_removed(env: Env) -> None:
    """Roots /wh and /links/inner, where /links/inner is a symlink (an administrator's
    alias, which the code explicitly supports) to /wh/t/inner. Sequence: DROP_TABLE /wh/t.
    After the commit, clean-up removes emptied directories; `Warehouse.protected` (the
    keeper) compares directories with the roots' configured spelling only (r.url), never
    with their real path, so /wh/t/inner -- the second root's real directory -- is
    removed, leaving that root a dangling symlink.
    Breaks invariant 5. Expected: /wh/t/inner still a directory after the recycle (or
    the request refused, as for a nested root)."""
    inner = env.warehouse / "t" / "inner"
    inner.mkdir(parents=True)
    (inner / "f").write_bytes(b"inner data")
    (env.warehouse / "t" / "g").write_bytes(b"table data")
    links = env.base / "links"
    links.mkdir()
    (links / "inner").symlink_to(inner)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{env.warehouse},{links / 'inner'}")
    try:
        store.recycle(RecycleRequest(paths=[str(env.warehouse / "t")], op="DROP_TABLE"))
    except CmrootError:
        pass  # refusing is fine too
    assert inner.is_dir(), "the real directory of warehouse root /links/inner was removed"
    assert os.path.isdir(links / "inner")


def test_nested_root_swapped_for_a_symlink_does_not_serve_outside_bytes(env: Env) -> None:
    """Roots /wh/t/inner and /wh (nested; the inner one listed first). A writer of /wh
    controls /wh/t, so it can replace the directory /wh/t/inner with a symlink to
    /outside. Reads of the inner root open `root.real` *by path*
    (`confined.directory(loc.root.real)` follows symlinks: only the components below it
    are confined), and `Warehouse.locate` answers from its one-second realpath cache, so
    for a second after the swap GET /v1/files?path=/wh/t/inner/f&checksum=<of
    /outside/f> serves /outside/f (and resolve says "original": an oracle for any file
    outside the roots).
    Breaks invariants 3 and 5 (bytes served from outside the roots and store).
    Expected: NotFound / OutsideRoots: a nested root is reached through its outer
    root's descriptor with no symlink followed."""
    inner = env.warehouse / "t" / "inner"
    inner.mkdir(parents=True)
    (inner / "f").write_bytes(b"inside")
    (env.outside / "f").write_bytes(b"SECRET outside the roots")
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{inner},{env.warehouse}")
    from cmroot import checksum as cks
    from cmroot.exceptions import NotFound

    with store.open_verified(str(inner / "f"), cks.of_bytes(b"inside")) as v:
        assert v.status == "original"  # warms the parent realpath cache
    inner.rename(env.warehouse / "t" / "inner.old")
    inner.symlink_to(env.outside)
    secret = cks.of_bytes(b"SECRET outside the roots")
    leaked = None
    try:
        with store.open_verified(str(inner / "f"), secret) as v:
            leaked = os.pread(v.fd, 100, 0)
    except (NotFound, CmrootError):
        pass
    assert leaked is None, f"served bytes from outside the roots: {leaked!r}"


def test_nested_root_swapped_for_a_symlink_is_never_recycled_from(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roots /wh/t/inner and /wh; a writer of /wh swaps /wh/t/inner for a symlink to
    /outside after the request was confined and journaled, before its file is staged.
    /outside/f must not move into the store: the nested root is opened through /wh's
    descriptor, where the symlink is refused."""
    inner = env.warehouse / "t" / "inner"
    inner.mkdir(parents=True)
    (inner / "f").write_bytes(b"inside")
    (env.outside / "f").write_bytes(b"outside")
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=f"{inner},{env.warehouse}")

    def swap() -> None:
        inner.rename(env.warehouse / "t" / "inner.old")
        inner.symlink_to(env.outside)

    on_point(monkeypatch, "journal.begun", swap)
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(inner / "f")], op="DELETE"))
    assert (env.outside / "f").read_bytes() == b"outside"
    assert (env.warehouse / "t" / "inner.old" / "f").read_bytes() == b"inside"
    assert store.index.stats()[0] == 0, "an object was recorded"

"""Adversarial reproducers against the store (hostile review). Each test states the
sequence, the invariant it breaks and what is expected; a test here FAILS while the bug
is present."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
from cmroot_testlib import Env, on_point

from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import CmrootError, NotFound
from cmroot.store import RecycleRequest, Store


def served(store: Store, path: Path | str, data: bytes) -> bytes | None:
    try:
        with store.open_verified(str(path), cks.of_bytes(data)) as v:
            return os.pread(v.fd, len(data) + 1, 0)
    except NotFound:
        return None


# --- 1. hard links: a store object shares its inode with a file still in the warehouse --


def test_hardlinked_source_stays_writable_through_the_store_object(env: Env, store: Store) -> None:
    """Sequence: /wh/t/a and /wh/keep/b are two names of one inode (a writer made a hard
    link: `cp -l`, `ln`). DELETE /wh/t/a (move). The object is a hard link of that inode,
    so a later in-place write to /wh/keep/b rewrites the store's copy of a.
    Breaks invariant 1 (no loss): (a, checksum) is no longer retrievable (the object is
    quarantined as corrupt) and a is not at its source.
    Expected: the recycled bytes of a stay retrievable (stage by copy when st_nlink > 1,
    or give the object an inode of its own)."""
    old = b"A" * 4096
    a = env.warehouse / "t" / "a"
    a.parent.mkdir()
    a.write_bytes(old)
    b = env.warehouse / "keep" / "b"
    b.parent.mkdir()
    os.link(a, b)
    store.recycle(RecycleRequest(paths=[str(a)], op="DELETE"))
    with open(b, "r+b") as f:  # the writer of b updates its own file, in place
        f.write(b"B" * 4096)
    assert served(store, a, old) == old


def test_file_swapped_for_directory_before_staging_is_put_back(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: /wh/t/f is a file when the request is listed; a writer replaces it with a
    directory holding data (rm f; mkdir f; f/x) before it is staged. rename_out moves the
    whole directory into staging, refuses it (not a regular file), and the rollback's
    put_back calls link() on a directory: EPERM, so the transaction is quarantined.
    Breaks invariant 2 (a failed recycle leaves the source as it was) and loses f/x from
    the warehouse: it sits in <store>/staging/<txid>/0, unreachable by any API.
    Expected: the request fails and /wh/t/f/x is where the writer put it."""
    f = env.warehouse / "t" / "f"
    f.parent.mkdir()
    f.write_bytes(b"old")

    def swap() -> None:
        f.unlink()
        f.mkdir()
        (f / "x").write_bytes(b"precious")

    on_point(monkeypatch, "journal.begun", swap)
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(f)], op="DELETE"))
    assert (f / "x").read_bytes() == b"precious"
    assert not store.index.pending(), "transaction left quarantined"


# --- 3. a FIFO swapped in before a copy hangs the recycle forever ------------------------


def test_fifo_swapped_in_before_copy_does_not_hang(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: recycle /wh/t/f with mode "copy"; between listing and staging a writer
    replaces f with a FIFO (mkfifo). LocalSession.copy_out opens it O_RDONLY without
    O_NONBLOCK: the open blocks until some writer opens the FIFO, i.e. forever. The
    daemon's worker thread (and with it the request, and SIGTERM's pool.shutdown(wait=True))
    hangs. Expected: refused as "not a regular file" within a moment."""
    f = env.warehouse / "t" / "f"
    f.parent.mkdir()
    f.write_bytes(b"old")

    def swap() -> None:
        f.unlink()
        os.mkfifo(f)

    on_point(monkeypatch, "journal.begun", swap)
    out: dict[str, object] = {}

    def run() -> None:
        try:
            store.recycle(RecycleRequest(paths=[str(f)], mode="copy", op="DELETE"))
            out["ok"] = True
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung:  # unblock the thread so the test run can finish
        fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
    assert not hung, "recycle hung opening a FIFO"
    assert isinstance(out.get("error"), CmrootError)


# --- 4. a parent directory taken over while a file is staged -----------------------------


@pytest.mark.parametrize("takeover", ["file", "symlink"])
def test_failed_recycle_keeps_file_whose_parent_was_taken_over(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch, takeover: str
) -> None:
    """Sequence: recycle [/wh/t/a, /wh/u/b] (one request). After a is staged its directory
    /wh/t is empty; a writer removes it and creates a regular file (or a symlink to a
    directory outside the roots) named /wh/t. Then b fails (here: an I/O error while
    staging it), so the request rolls back. a cannot go back (its parent is no
    directory, or a symlink the confined walk refuses): put_back raises, the transaction
    is quarantined and a's bytes stay in staging. Worse, Journal.rollback stops at that
    first file, so b -- whose path is untouched -- is never put back either.
    Breaks invariants 1 and 2: b is not at its source after a failed recycle, and
    (a, checksum) is neither at its source nor retrievable; the
    journal's own remedy for a source it cannot return to (a *displaced* entry with no
    event) only covers FileExistsError.
    Expected: a kept as displaced (retrievable by path and old checksum), no event."""
    store.recycler.workers = 1
    a = env.warehouse / "t" / "a"
    b = env.warehouse / "u" / "b"
    for p, data in ((a, b"aaaa"), (b, b"bbbb")):
        p.parent.mkdir()
        p.write_bytes(data)
    (env.outside / "t").mkdir()

    def take_over() -> None:
        a.parent.rmdir()
        if takeover == "file":
            a.parent.write_bytes(b"someone else's file")
        else:
            a.parent.symlink_to(env.outside / "t")

    def fail() -> None:
        raise OSError(errno.EIO, "injected I/O error")

    on_point(monkeypatch, "recycle.file_staged", take_over, k=1)
    real = faults.point
    monkeypatch.setattr(
        faults, "point",
        lambda n, _c={"n": 0}: (
            (_c.__setitem__("n", _c["n"] + 1), fail() if _c["n"] == 2 else None, real(n))
            if n == "recycle.file_staged" else real(n)
        ),
    )
    with pytest.raises(CmrootError):
        store.recycle(RecycleRequest(paths=[str(a), str(b)], op="DELETE"))
    assert b.read_bytes() == b"bbbb"
    assert served(store, a, b"aaaa") == b"aaaa", "a is neither at its source nor in the store"
    assert store.events() == []


def test_crash_then_parent_taken_over_recovery_keeps_file(env: Env, clock) -> None:  # type: ignore[no-untyped-def]
    """Sequence: recycle /wh/t/a; the process dies after a is staged (before commit).
    Before restart a writer replaces the now-empty /wh/t with a regular file. Recovery
    cannot put a back and quarantines the transaction.
    Breaks invariant 1 (same as above, crash variant). Expected: displaced entry."""
    store = env.open()
    a = env.warehouse / "t" / "a"
    a.parent.mkdir()
    a.write_bytes(b"aaaa")
    faults.arm("recycle.staged", crash=True)
    with pytest.raises(faults.Crash):
        store.recycle(RecycleRequest(paths=[str(a)], op="DELETE"))
    store.close()
    a.parent.rmdir()
    a.parent.write_bytes(b"new")
    store2 = env.open()
    assert not store2.recovery.quarantined
    assert served(store2, a, b"aaaa") == b"aaaa"


# --- 5. a source gone between listing and staging is a 5xx --------------------------------


def test_concurrent_recycle_of_the_same_file_is_not_a_server_error(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: two DROP_PARTITION requests for /wh/t/p=1 race (two hooks, a retry).
    Both list the file; B stages and commits first (here: B runs while A stands at
    `journal.begun`); A's rename then fails with ENOENT and A answers RecycleFailed,
    whose status is 500. The same happens when any writer deletes a listed file.
    Breaks "never a 5xx for bad input" (a 5xx also counts as a daemon fault to every
    retrying client and alert). Expected: 404 (the file no longer exists) or 409."""
    f = env.warehouse / "t" / "p=1" / "f"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"data")
    req = RecycleRequest(paths=[str(f.parent)], op="DROP_PARTITION", db="d", table="t")
    on_point(monkeypatch, "journal.begun", lambda: store.recycle(req), k=1)
    with pytest.raises(CmrootError) as ei:
        store.recycle(req)
    assert ei.value.status < 500, f"{type(ei.value).__name__} {ei.value.status}: {ei.value}"
    assert len(store.events()) == 1


# --- 6. a committed recycle that can never be closed ---------------------------------------


def test_committed_recycle_is_closed_even_if_its_directory_became_a_symlink(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: DROP_TABLE /wh/t (move) commits; before clean-up removes the emptied
    /wh/t, a writer replaces it with a symlink to a directory outside the roots.
    Journal.finish calls `warehouse.locate(d)` for each directory, which raises
    OutsideRoots; the committed transaction is "quarantined" and, since recovery calls
    the same finish, stays quarantined at every start, forever (an error log line and
    cmroot_quarantined_transactions=1 on every start; fsck reports it as troubled).
    Expected: nothing of ours left to tidy there, so the record is closed."""
    t = env.warehouse / "t"
    t.mkdir()
    (t / "f").write_bytes(b"data")
    (env.outside / "elsewhere").mkdir()

    def swap() -> None:
        t.rmdir()
        t.symlink_to(env.outside / "elsewhere")

    on_point(monkeypatch, "journal.unstaged", swap)
    store.recycle(RecycleRequest(paths=[str(t)], op="DROP_TABLE", db="d", table="t"))
    store.close()
    monkeypatch.undo()
    again = env.open()
    assert not again.recovery.quarantined
    assert not again.index.pending()


def test_a_path_that_keeps_changing_falls_back_to_its_copy_alone(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: /wh/t/a is recycled (copy); then every realpath() of it fails, as it does
    while a symlink on its way is swapped faster than it can be read. Resolve of a batch
    {/wh/t/a, /wh/t/b} and a GET of /wh/t/a.
    Observed before: after three tries the whole batch answered 400 ("bad pair #0").
    Expected: /wh/t/a answers from its recycled copy, /wh/t/b as the original."""
    a = env.warehouse / "t" / "a"
    a.parent.mkdir(parents=True)
    a.write_bytes(b"old a")
    b = env.warehouse / "u" / "b"
    b.parent.mkdir()
    b.write_bytes(b"b")
    # The directory is named (not the file): /wh/t's own lookups are not cached yet.
    store.recycle(RecycleRequest(paths=[str(a.parent)], mode="copy", op="INSERT_OVERWRITE"))
    a.write_bytes(b"new a")
    real = os.path.realpath

    def realpath(p: str, *args: object, **kw: bool) -> str:
        if str(p) in (str(a), str(a.parent)):
            raise OSError(errno.ENOENT, "swapped while read", p)
        return real(p)

    monkeypatch.setattr("cmroot.store.warehouse.os.path.realpath", realpath)
    got = store.resolve([
        {"path": str(a), "checksum": cks.of_bytes(b"old a")},
        {"path": str(b), "checksum": cks.of_bytes(b"b")},
    ])
    assert [(r.path, r.status) for r in got] == [
        (str(a), "cmroot"), (str(b), "original")
    ]
    with store.open_verified(str(a), cks.of_bytes(b"old a")) as v:
        assert v.status == "cmroot"
        assert os.pread(v.fd, 100, 0) == b"old a"
    with pytest.raises(NotFound):  # its original is not looked at while it keeps changing
        store.open_verified(str(a), cks.of_bytes(b"new a"))

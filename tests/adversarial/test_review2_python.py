"""Second hostile review of the recent Python changes (fsspec hook, daemon, two-phase
store, client). Each test named as a finding failed on the code it was written against;
real daemon subprocesses over loopback HTTP, real SQLite, real files under tmp dirs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cmroot.client import Client
from cmroot.exceptions import CmrootError
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.adversarial.fsspeclib import attempt, lost, table
from tests.adversarial.fsspeclib import hook as _hook
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("rv2") / "lake").serving(check_errors=False) as d:
        yield d


# -- fsspec: a move out of the roots removes warehouse files without a recycle ---------------
def test_mv_of_a_warehouse_file_out_of_the_roots_loses_it(wh: Daemon, tmp_path: Path) -> None:
    """`fs.mv(<root>/db.db/t/p=0/part-0, /elsewhere/x)`: the file leaves its warehouse path
    (a delete, as far as the table and its replicas are concerned) with no recycle and no
    event: (original path, checksum) resolves `missing` (invariant 1)."""
    files = table(wh, 1)
    [(src, _data)] = files.items()
    hook(wh).mv(src, str(tmp_path / "x"))
    assert not Path(src).exists()
    assert lost(wh, files) == []


def hook(d: Daemon, scope: str = "write", **kw: Any) -> CmrootFileSystem:
    return _hook(d, scope=scope, retry_delays=(), **kw)


def test_mv_of_a_table_directory_out_of_the_roots_loses_it(wh: Daemon, tmp_path: Path) -> None:
    """`fs.mv(<root>/db.db/t, /elsewhere/t, recursive=True)` (`_move_dir_local`: one
    rename): every file of the table leaves the warehouse unrecycled."""
    files = table(wh, 2)
    tdir = str(Path(next(iter(files))).parents[1])
    hook(wh).mv(tdir, str(tmp_path / "t"), recursive=True)
    assert not Path(tdir).exists()
    assert lost(wh, files) == []


# -- fsspec: fs.transaction that raises does not leave every path as it was ------------------
def test_rm_outside_the_roots_inside_a_failed_transaction_is_not_undone(
    wh: Daemon, tmp_path: Path
) -> None:
    """README: "a block that raises leaves every path as it was". An `rm` naming a file
    under a root and one outside, inside `fs.transaction`, then an exception: the root
    file comes back, the outside file is gone for good (deleted at the rm, not deferred)."""
    files = table(wh, 1)
    outside = write_files(tmp_path, {"keep-me": b"precious"})
    fs = hook(wh)
    with pytest.raises(RuntimeError, match="boom"), fs.transaction:
        fs.rm([*files, *outside])
        raise RuntimeError("boom")
    assert {p: Path(p).read_bytes() for p in files} == files
    assert {p: Path(p).read_bytes() for p in outside if Path(p).exists()} == outside


# -- two-phase: a renew after the lease passed resurrects the transaction ---------------------
def test_a_renew_after_the_lease_passed_resurrects_the_transaction(env, store) -> None:
    """Sequence: prepare a partition with a 60 s lease; 120 s pass (the expiry job, every
    5 s, has not run yet); renew; commit.
    Observed: the renew answers a new deadline (`Recycler.renew` only looks at the state,
    never at the lease, unlike commit and join, which `_prepared` rolls back), and the
    commit then publishes the DROP_PARTITION event of a statement whose lease had ended.
    Broken: API row "a prepared transaction neither committed nor aborted before its
    lease expires is rolled back by the daemon"; the outcome of renew+commit depends on
    whether the timer ran first.
    Expected: a renew once the lease has passed is a 404 and the files go back."""
    from cmroot.exceptions import NotFound
    from cmroot.store import RecycleRequest

    tdir = env.warehouse / "db.db" / "t"
    files = write_files(tdir, {"p=0/a": b"a" * 10, "p=0/b": b"b" * 10})
    req = RecycleRequest([str(tdir / "p=0")], op="DROP_PARTITION", db="db", table="t",
                         partitions=[{"p": "0"}])
    p = store.prepare(req, lease=60)
    env.clock.advance(120)
    with pytest.raises(NotFound):
        store.renew(p.txid, 600)
    assert attempt(lambda: store.commit(p.txid)) is not None
    assert store.events() == []
    assert {k: Path(k).read_bytes() for k in files} == files


# -- client: a Retry-After the client cannot parse ----------------------------------------------
class _Busy503(BaseHTTPRequestHandler):
    retry_after = "\xb2"  # "²" in ISO-8859-1: str.isdigit() is True, float() refuses it

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error": "busy", "detail": "retry"}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", self.retry_after)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_503_with_a_non_ascii_digit_retry_after_is_not_a_cmroot_error() -> None:
    """A proxy (or anything) in front of the daemon answers 503 with `Retry-After: ²`
    (byte 0xB2). `client._retry_after` checks `value.isdigit()` (true for superscript
    digits) then calls `float(value)`: ValueError escapes from every Client call, not a
    DaemonUnavailable; hooks that fail open or retry on CmrootError crash instead.
    Expected: an unparsable Retry-After is ignored (the 503 raised as DaemonUnavailable)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Busy503)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        c = Client(f"http://127.0.0.1:{srv.server_address[1]}", busy_wait=5)
        err = attempt(lambda: c.commit("0" * 32))
        assert isinstance(err, CmrootError), repr(err)
    finally:
        srv.shutdown()
        srv.server_close()


# -- fsspec: a file moved inside fs.transaction is then overwritten as "created here" ---------
def test_a_moved_warehouse_file_rewritten_in_a_failed_transaction_is_destroyed(
    wh: Daemon,
) -> None:
    """Sequence, inside one `fs.transaction`: `mv(A, B)` (A an existing warehouse file, B a
    new name in the same table), then `open(B, "wb")` and write, then the block raises.
    Observed: the mv is recorded in the unit's `created` list, so `_created_here(B)` makes
    the open truncate B in place (no recycle: A's bytes live only there); the rollback
    then drops B and finds nothing to give back to A. A's old bytes are nowhere: not at A,
    not at B, not in the store.
    Broken: invariant 1 (no loss) and the README's "a block that raises leaves every path
    as it was". Fault: `CmrootFileSystem._created_here` / `open` treat a file moved in by
    the unit as the unit's own output; `_undo` takes back in reverse without the data."""
    files = table(wh, 1)
    [(a, data)] = files.items()
    b = str(Path(a).with_name("renamed.parquet"))
    fs = hook(wh)
    with pytest.raises(RuntimeError, match="boom"), fs.transaction:
        fs.mv(a, b)
        with fs.open(b, "wb") as f:
            f.write(b"new bytes")
        raise RuntimeError("boom")
    assert lost(wh, files) == []
    assert Path(a).read_bytes() == data


def test_mv_of_two_warehouse_files_onto_one_new_name_destroys_the_first(wh: Daemon) -> None:
    """`fs.mv([A, C], [B, B])` (A, C existing warehouse files, B a new name): one call,
    no error. The first move makes B "created here" (`_replace` appends it to the call's
    `created`), so the second move replaces B by rename without a recycle; A's bytes are
    neither at A, nor at B, nor in the store (invariant 1). fsspec's own mv onto an
    existing B would have recycled B's bytes first."""
    files = table(wh, 2)
    (a, _), (c, _) = sorted(files.items())
    b = str(Path(a).parent / "renamed.parquet")
    hook(wh).mv([a, c], [b, b])
    assert lost(wh, {a: files[a]}) == []

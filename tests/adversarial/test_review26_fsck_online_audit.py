"""Hostile review 26: online fsck (`cmroot fsck` beside the daemon, `--repair` and
POST /v1/fsck inside it) and the audit of recycles and events (who asked).

Every sequence is deterministic: threads stop at fault points (`cmroot.faults.point`,
monkeypatched) or at a read-only index call wrapped to wait (`wait_in`: the pause changes
timing only), and go on when the test says. Tests that expose a break fail on the code
they were written against (b0b0393); those that pass are attacks that held."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cmroot_testlib import Env, object_file, write_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import audit as audit_mod
from cmroot import checksum as cks
from cmroot import faults
from cmroot.exceptions import RecycleFailed
from cmroot.index import Event
from cmroot.store import RecycleRequest, Store
from tests.server.cmroot_daemon import REPO, Daemon, MakeDaemon, clean_env, write_files

pytestmark = pytest.mark.timeout(120)


# -- machinery -----------------------------------------------------------------------------


class Gate:
    """A place where one thread stops (the first to get there) until released."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.reached = threading.Event()
        self._release = threading.Event()
        self.used = False

    def stop_here(self) -> None:
        self.reached.set()
        assert self._release.wait(30), f"{self.label}: never released"

    def wait(self) -> None:
        assert self.reached.wait(30), f"{self.label}: never reached"

    def release(self) -> None:
        self._release.set()


class Points:
    """Fault points that pause the first thread to pass them, or raise there once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._real = faults.point
        self._lock = threading.Lock()
        self._gates: dict[str, list[Gate]] = {}
        self._fails: dict[str, BaseException] = {}
        monkeypatch.setattr(faults, "point", self._point)

    def pause(self, name: str) -> Gate:
        g = Gate(name)
        self._gates.setdefault(name, []).append(g)
        return g

    def fail(self, name: str, exc: BaseException) -> None:
        self._fails[name] = exc

    def _point(self, name: str) -> None:
        gate = None
        with self._lock:
            for g in self._gates.get(name, []):
                if not g.used:
                    g.used = True
                    gate = g
                    break
            exc = self._fails.pop(name, None)
        if gate is not None:
            gate.stop_here()
        if exc is not None:
            raise exc
        self._real(name)

    def release_all(self) -> None:
        for gates in self._gates.values():
            for g in gates:
                g.release()


class Bg:
    """`fn()` on its own thread; `join()` returns its result or raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._t.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:
            self._error = e

    def join(self) -> Any:
        self._t.join(60)
        assert not self._t.is_alive(), "thread did not finish"
        if self._error is not None:
            raise self._error
        return self._result

    def error(self) -> BaseException | None:
        self._t.join(60)
        assert not self._t.is_alive(), "thread did not finish"
        return self._error


def wait_in(obj: Any, method: str, when: Callable[..., bool], monkeypatch: pytest.MonkeyPatch
            ) -> Gate:
    """Make the first call of `obj.method(*args)` for which `when(*args)` holds stop before
    it runs (a read-only call: the pause changes nothing but timing)."""
    real = getattr(obj, method)
    gate = Gate(method)
    lock = threading.Lock()

    def wrapped(*args: Any, **kw: Any) -> Any:
        with lock:
            mine = not gate.used and when(*args)
            if mine:
                gate.used = True
        if mine:
            gate.stop_here()
        return real(*args, **kw)

    monkeypatch.setattr(obj, method, wrapped)
    return gate


def wait_after(obj: Any, method: str, monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Make the first call of `obj.method` stop before it runs (then run as it would)."""
    return wait_in(obj, method, lambda *a: True, monkeypatch)


def object_path(root: Path, c: str) -> Path:
    return object_file(root, c)


def recycle_of(store: Store, path: Path, **kw: Any) -> Callable[[], Any]:
    return lambda: store.recycle(RecycleRequest(paths=[str(path)], op="DELETE", **kw))


# -- fsck inside the daemon (repair, online, guard = the writer's objects) -------------------


def test_online_repair_never_registers_an_object_a_rollback_removed(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recycle publishes its object; fsck --repair (in the daemon) hashes it; the recycle
    then fails and rolls back, which removes the object (nobody else claims it, the index
    never knew it). fsck must not register what is no longer there: `_unindexed` decides
    again under the lock, but only about claims and the index, never whether the file is
    still there."""
    data = b"rolled back after fsck hashed it" * 50
    c = cks.of_bytes(data)
    f = write_file(env.warehouse / "a" / "f", data)
    pts = Points(monkeypatch)
    published = pts.pause("recycle.file_published")
    pts.fail("recycle.flushed", OSError(errno.EIO, "injected: the flush failed"))
    rec = Bg(recycle_of(store, f))
    published.wait()
    hashed = pts.pause("fsck.object_hashed")
    check = Bg(lambda: store.fsck(repair=True, online=True))
    hashed.wait()
    published.release()
    assert isinstance(rec.error(), RecycleFailed)
    assert f.read_bytes() == data  # rolled back: the file is home again
    assert not object_path(env.store_root, c).exists()  # and its object gone
    hashed.release()
    report = check.join()
    seen = {"reported unindexed": report.unindexed,
            "row registered": store.index.get_object(c) is not None,
            "the next fsck finds missing": store.fsck().missing}
    assert seen == {"reported unindexed": [], "row registered": False,
                    "the next fsck finds missing": []}


def test_online_repair_does_not_report_an_evicted_object_missing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The byte budget evicts an object before its expiry: the sweep unlinks it, then
    forgets its rows. fsck --repair walks meanwhile (the object gone, its rows there) and
    settles its rows once the walk is done. It used to report the evicted object missing
    (the sweep forgot rows outside the lock, and online fsck left only *expired* rows to
    it); the sweep now forgets under the lock it unlinks under, so fsck, deciding under
    that lock, sees the row and the file go together. Sequence: the sweep stops while
    forgetting (the lock held); fsck walks every shard; then the sweep goes on."""
    store = env.open(CMROOT_STORE_MAX_BYTES="3000", CMROOT_STORE_MIN_RETAIN="1h")
    old, young = b"o" * 2000, b"y" * 2000
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "a" / "old", old))],
                                 op="DELETE"))
    env.clock.advance(7200)
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "b" / "new", young))],
                                 op="DELETE"))
    between = wait_after(store.index, "forget_evicted", monkeypatch)
    sweep = Bg(store.gc)
    between.wait()  # the old object is unlinked, its rows not yet forgotten
    assert not object_path(env.store_root, cks.of_bytes(old)).exists()
    walked = threading.Event()

    def progress(done: int, total: int) -> None:
        if done == total:
            walked.set()

    check = Bg(lambda: store.fsck(repair=True, progress=progress, online=True))
    try:
        assert walked.wait(30)  # every shard walked: what is left is settling the rows
    finally:
        between.release()
    report = check.join()
    swept = sweep.join()
    assert swept.evicted_objects == 1
    assert report.missing == [], "the evicted object, reported missing (and its rows forgotten)"


# Two attacks of this review, a check read-only beside the daemon while a sweep is between
# unlink and forget, and while a plain recycle is between publish and commit, showed that
# such a check cannot tell work in flight from damage: it holds no lock and plain recycles
# journal no checksums. `cmroot fsck` now checks through the daemon whenever it holds the
# store (exact: tests/server/test_fsck_online.py), and reads beside it only when the daemon
# does not answer, saying that findings may be work in flight.


def test_an_object_swept_between_listing_and_hashing_is_not_unreadable(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsck lists a shard, then reads its rows, then hashes its files. An expired object
    swept (unlinked and forgotten) in between is hashed after it is gone: ENOENT, reported
    "unreadable" (a finding no repair fixes: exit 1, "check the disk (dmesg, SMART)"). The
    same happens to an object a rollback or an abort removes (published ahead, then the
    statement failed): routine while a daemon serves, across a walk of hours."""
    data = b"expires during the walk" * 40
    c = cks.of_bytes(data)
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "a" / "f", data))],
                                 op="DELETE"))
    env.clock.advance(2 * 86400)  # past retention
    shard = env.object_path(c).parent.relative_to(env.objects_dir).as_posix().replace("/", "")
    asked: list[str] = []

    def in_walk(low: str, high: str) -> bool:
        if low != shard:
            return False
        asked.append(low)
        # a one-level store's plan asks each top-level prefix first; its walk asks again
        return len(asked) == (2 if len(shard) == 2 else 1)

    listed = wait_in(store.index, "objects_between", in_walk, monkeypatch)
    check = Bg(lambda: store.fsck(repair=True, online=True))
    listed.wait()  # the shard listed (the object there), its rows not read yet
    swept = store.gc()
    assert swept.removed_objects == 1
    listed.release()
    report = check.join()
    assert report.unreadable == [], "the swept object, reported unreadable"
    assert not report.needs_attention


def test_online_check_reports_a_lost_held_object(
    env: Env, store: Store
) -> None:
    """A hold keeps a table's recycled files past their expiry (legal hold). One of them is
    lost from disk. The sweep never touches it (held); online fsck leaves every expired
    row "to the sweep" and never reports it: the loss of held data goes unseen by the only
    fsck an operator can run while the daemon serves (offline fsck reports it)."""
    data = b"legally held bytes" * 40
    c = cks.of_bytes(data)
    f = write_file(env.warehouse / "sales.db" / "orders" / "part-0", data)
    store.recycle(RecycleRequest(paths=[str(f)], op="DROP_TABLE", db="sales", table="orders"))
    store.add_hold("sales", "orders", env.clock() + 30 * 86400, "litigation")
    env.clock.advance(2 * 86400)  # past retention, within the hold
    assert store.gc().removed_objects == 0  # held: the sweep keeps it
    object_path(env.store_root, c).unlink()  # lost
    offline = store.fsck()
    assert offline.missing == [c]  # a real finding
    online = store.fsck(online=True)  # what the daemon runs
    beside = env.open(readonly=True).fsck()  # what `cmroot fsck` runs beside it
    assert {"in the daemon": online.missing, "beside it": beside.missing} == {
        "in the daemon": [c], "beside it": [c]}


# -- what holds: claims, in-flight transactions, heals, sweeps ------------------------------


def test_prepared_objects_survive_repair_abort_expiry_and_restart(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two-phase recycles, published ahead: fsck --repair online never registers their
    objects (claimed, or journaled across a restart), abort and lease expiry put every file
    back and leave nothing for fsck, and a commit after a restart indexes them."""
    store = env.open()
    files = {n: write_file(env.warehouse / n / "f", f"two-phase {n}".encode() * 30)
             for n in ("abort", "expire", "restart")}
    txs = {n: store.prepare(RecycleRequest(paths=[str(p)], op="DELETE"), lease=60).txid
           for n, p in files.items()}
    for txid in txs.values():
        store.renew(txid, 60)  # waits for its objects to be published ahead
    for n in files:
        c = cks.of_bytes(f"two-phase {n}".encode() * 30)
        assert object_path(env.store_root, c).exists()  # published, not indexed
    report = store.fsck(repair=True, online=True)
    assert report.clean, report.to_json()
    assert store.index.stats()[0] == 0  # nothing registered
    store.abort(txs["abort"])
    assert files["abort"].exists()
    store.renew(txs["restart"], 3600)
    env.clock.advance(120)
    assert store.expire_prepared() == 1
    assert files["expire"].exists()
    store.close()
    store = env.open()  # claims are gone; the journal still has the prepared transaction
    report = store.fsck(repair=True, online=True)
    assert report.clean, report.to_json()
    assert store.index.stats()[0] == 0  # nothing registered
    store.commit(txs["restart"])
    data = b"two-phase restart" * 30
    res = store.resolve([{"path": str(files["restart"]), "checksum": cks.of_bytes(data)}])
    assert res[0].status == "cmroot"
    assert store.fsck().clean


def test_a_corrupt_object_swept_while_fsck_holds_its_hash_is_left_alone(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsck hashes a rotted, expired object (corrupt); before it acts, the sweep removes it
    and forgets its rows. The repair re-hashes under the lock and finds nothing to do."""
    data = b"rot then sweep" * 50
    c = cks.of_bytes(data)
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "a" / "f", data))],
                                 op="DELETE"))
    object_path(env.store_root, c).write_bytes(b"X" * len(data))
    env.clock.advance(2 * 86400)
    pts = Points(monkeypatch)
    hashed = pts.pause("fsck.object_hashed")
    check = Bg(lambda: store.fsck(repair=True, online=True))
    hashed.wait()
    assert store.gc().removed_objects == 1
    hashed.release()
    report = check.join()
    assert report.counts["corrupt"] == 0 and report.counts["missing"] == 0, report.to_json()
    assert not (env.store_root / "quarantine").exists() or not list(
        (env.store_root / "quarantine").iterdir())


# -- fsck through the CLI beside a real daemon ---------------------------------------------


def cli(d: Daemon, *args: str, env: dict[bytes, bytes] | None = None, token: bool = True,
        url: bool = False) -> subprocess.CompletedProcess[bytes]:
    extra: list[str] = []
    if token:
        t = d.base / "token-admin"
        t.write_text(d.tokens["admin"])
        t.chmod(0o600)
        extra += ["--token-file", str(t)]
    if url:
        extra += ["--url", d.url]
    base = {k.encode(): v.encode() for k, v in clean_env(
        {"CMROOT_SERVER_PORT": str(d.port)}).items()}
    return subprocess.run(
        [sys.executable, "-m", "cmroot.cli", *args, "--config", str(d.config_path), *extra],
        capture_output=True, timeout=120, env={**base, **(env or {})}, cwd=str(REPO),
    )


def one_line_error(r: subprocess.CompletedProcess[bytes]) -> str:
    err = r.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_cli_fsck_repair_without_admin_token_is_a_one_line_refusal(make_daemon: MakeDaemon
                                                                   ) -> None:
    d = make_daemon()
    r = cli(d, "fsck", "--repair", token=False)
    assert r.returncode == 2, r
    assert "401" in one_line_error(r) or "token" in one_line_error(r).lower()
    r = cli(d, "fsck")  # read-only beside: no token needed
    assert r.returncode == 0, r
    assert d.errors() == []


# -- audit ---------------------------------------------------------------------------------


UNDECODABLE_USER = {b"USER": b"r\xe9my", b"LOGNAME": b"r\xe9my"}  # a Latin-1 login name


def test_a_cli_recycle_by_a_latin1_user_does_not_poison_the_event_log(
    make_daemon: MakeDaemon,
) -> None:
    """`cmroot recycle` with the store to itself (daemon stopped) records `audit.here()`:
    getpass.getuser() from $USER/$LOGNAME, which Python decodes with surrogateescape
    ("r\\udce9my"). audit.clean keeps the lone surrogate, json.dumps stores it escaped;
    the daemon's msgspec encoder cannot write it: every page of GET /v1/events holding
    that event, and GET /v1/entries, answer 500 - replication stops at that event."""
    d = make_daemon(start=False)
    f = write_files(d.warehouse / "t", {"f": b"bytes of a latin-1 user" * 10})
    r = cli(d, "recycle", "--op", "DELETE", *f, env=UNDECODABLE_USER, token=False)
    assert r.returncode == 0, r
    d.start()
    events = d.request("GET", "/v1/events")
    entries = d.request("GET", "/v1/entries", scope="read")
    assert (events.status, entries.status, d.errors()) == (200, 200, []), (events, entries)


def test_a_cli_recycle_by_a_latin1_user_through_the_daemon_is_not_refused(
    make_daemon: MakeDaemon,
) -> None:
    """The same user with the daemon running: the CLI sends its audit as JSON with a lone
    surrogate escape, the daemon refuses the whole body (400): a recycle that nothing is
    wrong with fails because of the login name (the fsspec hook sends audit.here() on
    every rm too). An audit is advisory: it must never cost the recycle it describes."""
    d = make_daemon()
    f = write_files(d.warehouse / "t", {"f": b"bytes of a latin-1 user" * 10})
    r = cli(d, "recycle", "--op", "DELETE", *f, env=UNDECODABLE_USER)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert not Path(next(iter(f))).exists()


def test_ls_shows_one_line_per_entry_whatever_the_audit_says(make_daemon: MakeDaemon) -> None:
    """Any write token sets the audit's user and host. `cmroot ls` prints them as they
    came (only NULs are dropped): a newline forges a whole row of the listing, an escape
    sequence drives the operator's terminal."""
    d = make_daemon()
    f = write_files(d.warehouse / "t", {"f": b"x" * 100})
    forged = ("mallory\n2020-01-01 00:00  DROP_TABLE  prod.users  -  9.9 GiB  "
              "2020-01-02 00:00  root@prod  /wh/prod.db/users/part-0\x1b[2K")
    r = d.request("POST", "/v1/recycle", {"paths": list(f), "op": "DELETE",
                                          "audit": {"user": forged, "host": "h"}},
                  scope="write")
    assert r.status == 200, r
    out = cli(d, "ls", url=True)
    assert out.returncode == 0, out
    lines = out.stdout.decode().splitlines()
    rows = [ln for ln in lines if not ln.startswith(("RECYCLED", "(more"))]
    assert len(rows) == 1, lines
    assert all(ch.isprintable() for ln in lines for ch in ln), lines


def test_an_audit_of_nuls_only_is_no_audit(make_daemon: MakeDaemon) -> None:
    """audit.clean: "None for none (or nothing in it)"; NULs are dropped - after the test
    for emptiness, so {"user": "\\0"} is stored as {"user": ""}."""
    d = make_daemon()
    r = d.request("POST", "/v1/events", {"eventType": "CREATE_TABLE", "db": "x",
                                          "table": "y", "audit": {"user": "\0\0"}},
                  scope="write")
    assert r.status == 200, r
    ev = d.request("GET", "/v1/events").json()["events"][-1]
    assert ev.get("audit") is None, ev
    assert audit_mod.clean({"user": "\0"}) is None


def test_bad_audits_change_nothing_and_a_join_keeps_its_transaction(
    make_daemon: MakeDaemon,
) -> None:
    """Bad audits are 400s that change nothing: not an object, a number, an unknown field,
    over 64 Ki characters; on a join, the prepared transaction survives (the body is
    refused before the store sees it). Long values are cut; a two-phase statement keeps
    its first part's audit, across a restart, and the event log still pages."""
    d = make_daemon()
    f = write_files(d.warehouse / "t", {"a": b"a" * 50, "b": b"b" * 50, "c": b"c" * 50})
    a, b, c = sorted(f)
    before = d.snapshot()
    bad = [[1], {"user": 5}, {"who": "x"}, {"user": "x" * 65537}, "root", {"user": ["x"]}]
    for audit in bad:
        r = d.request("POST", "/v1/recycle", {"paths": [a], "op": "DELETE", "audit": audit},
                      scope="write")
        assert r.status == 400, (audit, r)
        r = d.request("POST", "/v1/events", {"eventType": "INSERT", "db": "x", "table": "y",
                                              "audit": audit}, scope="write")
        assert r.status == 400, (audit, r)
    assert d.snapshot() == before
    first = {"user": "u" * 65536, "host": "h1",
             "statement": "DELETE FROM t WHERE " + "x" * 5000}
    r = d.request("POST", "/v1/recycle", {"paths": [a], "op": "DELETE", "prepare": True,
                                          "audit": first}, scope="write")
    assert r.status == 200, r
    txid = r.json()["txid"]
    for audit in bad:
        r = d.request("POST", "/v1/recycle", {"paths": [b], "op": "DELETE", "txid": txid,
                                              "prepare": True, "audit": audit}, scope="write")
        assert r.status == 400, r
    r = d.request("POST", "/v1/recycle", {"paths": [b], "op": "DELETE", "txid": txid,
                                          "prepare": True, "audit": {"user": "second"}},
                  scope="write")
    assert r.status == 200, r
    d.restart()
    r = d.request("POST", f"/v1/transactions/{txid}/commit", scope="write")
    assert r.status == 200, r
    ev = d.request("GET", "/v1/events").json()["events"][-1]
    assert ev["audit"]["user"] == "u" * 255 + "\u2026"
    assert ev["audit"]["host"] == "h1"
    assert len(ev["audit"]["statement"]) == 1000
    assert {x["path"] for x in ev["files"]} == {a, b}
    entries = d.request("GET", "/v1/entries", scope="read").json()["entries"]
    assert {e["audit"]["host"] for e in entries} == {"h1"}
    assert Path(c).exists()
    assert d.errors() == []


_AUDIT_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=1200)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(audits=st.lists(st.fixed_dictionaries({}, optional={
    "user": _AUDIT_TEXT, "host": _AUDIT_TEXT, "app": _AUDIT_TEXT, "statement": _AUDIT_TEXT,
}), min_size=1, max_size=8), cap=st.integers(1200, 9000))
def test_pages_with_audits_fit_their_cap_and_have_no_gaps(
    store: Store, monkeypatch: pytest.MonkeyPatch, audits: list[dict[str, str]], cap: int
) -> None:
    """Pages are measured with json.dumps and written with msgspec: with audits of any
    text (escapes, astral characters, controls) every page, as the daemon writes it, fits
    the cap, and paging visits every event once."""
    index = store.index
    first = index.current_event_id() + 1
    for a in audits:
        index.add_event(Event(0, "INSERT", "db", "t", [], 1.0, "s", False,
                              [{"path": "/w/f", "checksum": "0" * 32, "size": 1}],
                              audit=audit_mod.clean(a)))
    last = index.current_event_id()
    start, seen = first, []
    while start <= last:
        page = index.events_page(start, 1000, max_bytes=cap)
        body = msgspec.json.encode(page)
        if len(page["events"]) > 1:  # the first event of a page comes whatever its size
            assert len(body) <= cap, (len(body), cap)
        seen += [e["id"] for e in page["events"]]
        start = page["next"]
    assert seen == list(range(first, last + 1))
    monkeypatch.undo()


def test_a_fail_open_fsspec_hook_in_a_latin1_named_script_loses_no_file(
    make_daemon: MakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fsspec hook sends `audit.here()` with every prepare: its app is the script's
    name, sys.argv[0], which Python decodes with surrogateescape when it is not UTF-8
    ("/jobs/r\\udce9sum\\udce9.py"). The daemon refuses the body (400); a hook with
    `fail_open=True` takes any refusal for an unavailable daemon and deletes the file
    without a copy. Before the audit, the same rm recycled it."""
    from tests.adversarial.fsspeclib import hook, lost

    d = make_daemon()
    monkeypatch.setattr(sys, "argv", ["/jobs/r\udce9sum\udce9.py"])
    fs = hook(d, fail_open=True)
    files = write_files(d.warehouse / "db.db" / "t", {"part-0.parquet": b"kept bytes" * 20})
    fs.rm(next(iter(files)))
    assert lost(d, files) == [], "deleted without a copy"


def test_check_beside_the_daemon_rechecks_a_corrupt_finding(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside the daemon, findings are "checked again ... after the walk"; a corrupt one is
    not: an object a recycle of the same bytes healed during the walk is still reported
    corrupt (exit 1, "--repair quarantines") though it hashes right at the end."""
    data = b"rots, then heals" * 50
    c = cks.of_bytes(data)
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "a" / "f", data))],
                                 op="DELETE"))
    object_path(env.store_root, c).write_bytes(b"X" * len(data))
    beside = env.open(readonly=True)
    pts = Points(monkeypatch)
    hashed = pts.pause("fsck.object_hashed")
    check = Bg(beside.fsck)
    hashed.wait()
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "b" / "f", data))],
                                 op="DELETE"))  # heals the object (Objects._heal)
    assert cks.of_local_file(str(object_path(env.store_root, c))) == c
    hashed.release()
    report = check.join()
    assert report.corrupt == [], "a healed object, reported corrupt"


def test_entries_and_the_event_log_answer_while_fsck_and_a_sweep_run(
    env: Env, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POST /v1/fsck and POST /v1/gc each hold a thread of the "other" class (two threads)
    to their end: with both running, GET /v1/entries and GET /v1/events (replication's
    reader) wait for one to finish - for a sweep's minutes, or an fsck's hours. The daemon
    app in-process on a real socket (as tests/server/test_events_paging.py runs it)."""
    from cmroot.client import Client
    from tests.server.test_events_paging import serve

    old, new = b"expired bytes" * 30, b"live bytes" * 30
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "a" / "f", old))],
                                 op="DELETE"))
    env.clock.advance(2 * 86400)
    store.recycle(RecycleRequest(paths=[str(write_file(env.warehouse / "b" / "f", new))],
                                 op="DELETE"))
    pts = Points(monkeypatch)
    hashed = pts.pause("fsck.object_hashed")
    sweeping = wait_after(store.index, "forget_expired", monkeypatch)
    with serve(store) as url:
        try:
            check = Bg(lambda: Client(url, timeout=None).fsck(repair=True))
            hashed.wait()
            sweep = Bg(lambda: Client(url, timeout=None).gc())
            sweeping.wait()
            answers: dict[str, Any] = {}
            reads: list[tuple[str, Callable[[Client], object]]] = [
                ("entries", lambda c: c.entries(limit=1)), ("events", lambda c: c.events(0, 1))]
            for name, call in reads:
                try:
                    call(Client(url, timeout=5, busy_wait=0))
                    answers[name] = "answered"
                except Exception as e:
                    answers[name] = f"{type(e).__name__}: {e}"
        finally:
            hashed.release()
            sweeping.release()
            pts.release_all()
        assert check.join()["clean"]
        assert sweep.join()["removed_objects"] == 1
    assert answers == {"entries": "answered", "events": "answered"}


def test_fsck_in_the_daemon_reports_a_stray_whose_name_is_not_utf8(
    make_daemon: MakeDaemon,
) -> None:
    """A stray file in the object store whose name is not UTF-8 (left by a restore, an
    old tool, a hand): fsck's very job is to report it. Python names it with surrogate
    escapes; POST /v1/fsck puts that name in its answer, which the daemon's encoder cannot
    write: a 500 (a traceback in the log) after the repair ran, and `cmroot fsck --repair`
    fails with "internal error" instead of its report."""
    d = make_daemon()
    shard = d.store / "objects" / "ab" / "cd"
    shard.mkdir(parents=True)
    fd = os.open(os.fsencode(str(shard)) + b"/r\xe9sum\xe9.bak", os.O_CREAT | os.O_WRONLY)
    os.close(fd)
    beside = cli(d, "fsck", "--json")  # read-only beside the daemon: reports it
    assert beside.returncode == 1 and json.loads(beside.stdout)["counts"]["stray"] == 1, beside
    r = d.request("POST", "/v1/fsck?repair=true")
    done = cli(d, "fsck", "--repair", "--json")  # through the daemon
    assert (r.status, done.returncode, d.errors()) == (200, 0, []), (r, done.stderr)

"""fsck of a store on S3 (`store.root = "s3://bucket/cm"`), against the real S3 server on
loopback (moto): the same findings as the local fsck (tests/store/test_fsck.py), the same
repairs, and nothing lost. The store is damaged through another S3 client, as a person or
another job would: an object deleted, overwritten, added, put in the wrong shard, a
staging area left behind."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import Clock, held_at

from cmroot import checksum as cks
from cmroot import config as cfg
from cmroot.exceptions import BadRequest, NotFound
from cmroot.store import RecycleRequest, Store

REPO = Path(__file__).resolve().parents[2]
TOPS = 256  # progress is reported once per top-level prefix of objects/


@dataclass
class S3Store:
    """A store on bucket `bucket` (prefix `cm`) whose warehouse root is bucket `wh`; `fs`
    is the tests' own S3 client (not the store's, and without listing cache)."""

    store: Store
    fs: Any
    bucket: str
    wh: str
    env: dict[str, str]
    clock: Clock

    @property
    def base(self) -> str:
        return f"{self.bucket}/cm"

    def obj(self, c: str, shard: tuple[str, str] | None = None) -> str:
        a, b = shard or (c[:2], c[2:4])
        return f"{self.base}/objects/{a}/{b}/{c}"

    def url(self, path: str) -> str:
        return f"s3://{path}"

    def put(self, path: str, data: bytes) -> str:
        with self.fs.open(path, "wb") as f:
            f.write(data)
        return path

    def get(self, path: str) -> bytes:
        data: bytes = self.fs.cat_file(path)
        return data

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def quarantined(self, c: str) -> list[str]:
        q = f"{self.base}/quarantine"
        if not self.fs.exists(q):
            return []
        return sorted(p for p in self.fs.ls(q, detail=False) if p.rsplit("/", 1)[-1]
                      .startswith(c + "."))

    def snapshot(self) -> dict[str, bytes]:
        """Every file of the store's bucket, with its bytes."""
        return {p: self.get(p) for p in self.fs.find(self.bucket)}

    def open(self, readonly: bool = False) -> Store:
        return Store.open(cfg.load(None, self.env), clock=self.clock, readonly=readonly)


@pytest.fixture
def s3(tmp_path: Path, s3_client: Any) -> Iterator[S3Store]:
    bucket, wh = f"st-{uuid.uuid4().hex[:10]}", f"wh-{uuid.uuid4().hex[:10]}"
    s3_client.mkdir(bucket)
    s3_client.mkdir(wh)
    env = {
        "CMROOT_STORE_ROOT": f"s3://{bucket}/cm",
        "CMROOT_STORE_WAREHOUSE_ROOTS": f"s3://{wh}",
        "CMROOT_INDEX_PATH": str(tmp_path / "idx" / "index.sqlite"),
    }
    clock = Clock()
    store = Store.open(cfg.load(None, env), clock=clock)
    s = S3Store(store, s3_client, bucket, wh, env, clock)
    try:
        yield s
    finally:
        s.store.close()
        for b in (bucket, wh):
            s3_client.rm(b, recursive=True)


def recycled(s: S3Store, n: int = 4, table: str = "t") -> dict[str, bytes]:
    """n files of distinct bytes in table db.t of the warehouse bucket, recycled (a
    DROP_TABLE): {their URL: their bytes}."""
    files = {}
    for i in range(n):
        data = f"{table} row {i}\n".encode() * (50 + i)
        s.put(f"{s.wh}/db.db/{table}/f{i}", data)
        files[f"s3://{s.wh}/db.db/{table}/f{i}"] = data
    s.store.recycle(
        RecycleRequest([f"s3://{s.wh}/db.db/{table}"], op="DROP_TABLE", db="db", table=table)
    )
    assert not any(s.exists(p.removeprefix("s3://")) for p in files)
    return files


def read(store: Store, path: str, c: str) -> bytes:
    with store.reader.open_verified(path, c) as v:
        out = io.BytesIO()
        v.copy_to(out)
        assert v.status == "cmroot"
        return out.getvalue()


def assert_retrievable(store: Store, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert read(store, path, cks.of_bytes(data)) == data


def stray_shard(c: str, before: bool) -> tuple[str, str]:
    """A shard that is not c's, sorting before (or after) c's own."""
    if before:
        return ("00", "00") if c[:4] != "0000" else ("00", "01")
    return ("ff", "ff") if c[:4] != "ffff" else ("ff", "fe")


# -- the findings, one at a time ---------------------------------------------------------


def test_a_healthy_store_is_clean(s3: S3Store) -> None:
    files = recycled(s3, n=6)
    seen: list[tuple[int, int]] = []
    r = s3.store.fsck(progress=lambda i, n: seen.append((i, n)))
    assert r.clean, r.to_json()
    assert r.checked == 6
    assert seen == [(i, TOPS) for i in range(1, TOPS + 1)]  # once per top-level prefix
    assert r.shards == len({cks.of_bytes(b)[:4] for b in files.values()})
    assert s3.store.fsck(repair=True).clean
    assert s3.store.fsck(online=True).clean
    assert_retrievable(s3.store, files)


def test_an_object_deleted_from_the_store_is_missing_and_forgotten_on_repair(
    s3: S3Store,
) -> None:
    files = recycled(s3)
    gone_path, gone_data = sorted(files.items())[0]
    c = cks.of_bytes(gone_data)
    s3.fs.rm_file(s3.obj(c))

    r = s3.store.fsck()
    assert r.missing == [c] and not r.clean
    assert (r.corrupt, r.unindexed, r.stray, r.misplaced) == ([], [], [], [])
    assert s3.store.index.get_object(c) is not None  # report only
    beside = s3.open(readonly=True)  # read-only beside the writer: the same finding
    try:
        assert beside.fsck().missing == [c]
    finally:
        beside.close()

    r = s3.store.fsck(repair=True)
    assert r.missing == [c]
    assert s3.store.index.get_object(c) is None
    assert s3.store.index.entries(checksum=c) == []
    assert s3.store.fsck().clean
    with pytest.raises(NotFound):
        read(s3.store, gone_path, c)
    assert_retrievable(s3.store, {p: b for p, b in files.items() if p != gone_path})


def test_a_corrupt_object_is_reported_then_quarantined_never_served(s3: S3Store) -> None:
    files = recycled(s3)
    bad_path, bad_data = sorted(files.items())[1]
    c = cks.of_bytes(bad_data)
    rotten = b"X" + bad_data[1:]  # same size, other bytes
    s3.put(s3.obj(c), rotten)
    before = s3.snapshot()

    r = s3.store.fsck()
    assert r.corrupt == [c] and not r.clean
    assert (r.missing, r.unindexed) == ([], [])
    assert s3.snapshot() == before  # report only

    # Beside the writer, read-only: it checks (looked at again after the walk) and
    # refuses to repair; nothing moves.
    beside = s3.open(readonly=True)
    try:
        assert beside.fsck().corrupt == [c]
        with pytest.raises(BadRequest):
            beside.fsck(repair=True)
    finally:
        beside.close()
    assert s3.snapshot() == before

    r = s3.store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []  # corrupt, not also missing
    assert not s3.exists(s3.obj(c))
    (q,) = s3.quarantined(c)
    assert q == f"{s3.base}/quarantine/{c}.{int(s3.clock())}"
    assert s3.get(q) == rotten  # kept for inspection, out of the serving path
    assert s3.store.index.get_object(c) is None  # no valid copy anywhere: rows go
    with pytest.raises(NotFound):  # never the wrong bytes
        read(s3.store, bad_path, c)
    assert s3.store.fsck().clean
    assert_retrievable(s3.store, {p: b for p, b in files.items() if p != bad_path})


def test_a_corrupt_object_is_quarantined_by_the_daemon_s_fsck_too(s3: S3Store) -> None:
    """online with the writer's guard (the daemon): the object is hashed again under the
    objects' lock before it is quarantined."""
    files = recycled(s3, n=2)
    _path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    s3.put(s3.obj(c), b"rotten")
    r = s3.store.fsck(repair=True, online=True)
    assert r.corrupt == [c] and r.missing == []
    assert [s3.get(q) for q in s3.quarantined(c)] == [b"rotten"]
    assert s3.store.index.get_object(c) is None
    assert s3.store.fsck().clean


def test_a_truncated_object_is_corrupt(s3: S3Store) -> None:
    files = recycled(s3, n=2)
    c = cks.of_bytes(sorted(files.values(), key=len)[-1])
    s3.put(s3.obj(c), s3.get(s3.obj(c))[:1])
    assert s3.store.fsck().corrupt == [c]


def test_an_unindexed_object_is_registered_for_a_full_retention_never_deleted(
    s3: S3Store,
) -> None:
    files = recycled(s3)
    data = b"an object the index lost" * 10
    c = cks.of_bytes(data)
    s3.put(s3.obj(c), data)
    before = s3.snapshot()

    r = s3.store.fsck()
    assert r.unindexed == [c] and not r.clean
    assert (r.missing, r.corrupt) == ([], [])
    beside = s3.open(readonly=True)  # looked at again after the walk: still unindexed
    try:
        assert beside.fsck().unindexed == [c]
    finally:
        beside.close()
    assert s3.snapshot() == before

    r = s3.store.fsck(repair=True)
    assert r.unindexed == [c]
    assert s3.get(s3.obj(c)) == data  # never deleted
    o = s3.store.index.get_object(c)
    assert o is not None and o.size == len(data)
    assert o.expires >= s3.clock() + s3.store.config.retain
    assert s3.store.fsck().clean
    assert_retrievable(s3.store, files)
    # registered, it is swept like any other object once its retention runs out
    s3.clock.advance(s3.store.config.retain)
    assert c in {x["checksum"] for x in s3.store.gc().removed}


def test_names_that_are_not_objects_are_stray_and_never_touched(s3: S3Store) -> None:
    files = recycled(s3, n=2)
    c = cks.of_bytes(b"whatever")
    objects = f"{s3.base}/objects"
    expected = [
        s3.put(f"{objects}/README", b"a"),  # a file beside the top-level prefixes
        f"{objects}/zz",  # not a hex prefix: the directory, once
        s3.put(f"{objects}/ab/notes.txt", b"c"),  # a file beside the shards
        s3.put(f"{objects}/ab/cd/not-a-checksum", b"d"),
        s3.put(f"{objects}/ab/cd/{c}.tmp", b"e"),
        f"{objects}/ab/ce/{c}",  # a "directory" named like an object, inside a shard
    ]
    s3.put(f"{objects}/ab/ce/{c}/part-0", b"f")
    s3.put(f"{objects}/zz/yy/x", b"b")
    s3.put(f"{objects}/zz/yy/z", b"g")
    before = s3.snapshot()

    r = s3.store.fsck(repair=True)
    assert sorted(r.stray) == sorted(s3.url(p) for p in expected), r.stray
    assert (r.corrupt, r.missing, r.unindexed, r.misplaced) == ([], [], [], [])
    assert s3.snapshot() == before  # reported, never touched
    assert_retrievable(s3.store, files)


def test_a_staging_area_no_transaction_owns_is_stray_a_troubled_one_is_reported(
    s3: S3Store,
) -> None:
    files = recycled(s3, n=2)
    staging = f"{s3.base}/staging"
    leftover = s3.put(f"{staging}/not-a-transaction/0", b"?")
    txid = "txquar0123456789abcdef0123456789"
    staged = s3.put(s3.store.layout.staged_path(txid, 0), b"a file waiting for its rollback")
    source = f"s3://{s3.wh}/gone.parquet"
    s3.store.index.journal_begin(
        txid, s3.clock(), "move", {"op": "DROP_TABLE", "paths": [source]}, [],
        [(0, source, staged, "take")],
    )
    s3.store.index.quarantine_tx(txid, "PermissionDenied: could not put it back")
    before = s3.snapshot()

    for repair in (False, True):
        r = s3.store.fsck(repair=repair)
        assert not r.clean and r.needs_attention
        (tx,) = r.quarantined_transactions
        assert (tx["txid"], tx["state"], tx["files"]) == (txid, "quarantined", 1)
        assert "could not put it back" in tx["error"]
        # its staged file is its own: not stray, and left alone even by --repair
        assert r.stray == [s3.url(f"{staging}/not-a-transaction")]
        assert s3.snapshot() == before
    assert s3.get(leftover) == b"?"
    # online, staging is looked at after the walk: the same findings
    r = s3.store.fsck(online=True)
    assert r.stray == [s3.url(f"{staging}/not-a-transaction")]
    assert [t["txid"] for t in r.quarantined_transactions] == [txid]
    assert_retrievable(s3.store, files)


# -- an object in the wrong shard --------------------------------------------------------


@pytest.mark.parametrize("before", [True, False], ids=["stray-shard-first", "home-first"])
def test_a_valid_object_in_the_wrong_shard_is_moved_home_with_its_rows(
    s3: S3Store, before: bool
) -> None:
    files = recycled(s3)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    wrong = s3.obj(c, stray_shard(c, before))
    s3.fs.mv(s3.obj(c), wrong)
    snap = s3.snapshot()

    r = s3.store.fsck()
    assert r.misplaced == [{"path": s3.url(wrong), "checksum": c, "action": "move to its place"}]
    # not corrupt, and not missing: a valid copy exists, only in the wrong place
    assert (r.corrupt, r.missing, r.unindexed) == ([], [], []) and not r.clean
    assert s3.snapshot() == snap

    r = s3.store.fsck(repair=True)
    assert r.misplaced[0]["action"] == "moved to its place"
    assert (r.corrupt, r.missing, r.unindexed) == ([], [], [])
    assert s3.get(s3.obj(c)) == data and not s3.exists(wrong)
    assert s3.quarantined(c) == []
    assert [e.path for e in s3.store.index.entries(checksum=c)] == [path]  # rows kept
    assert s3.store.fsck().clean
    assert_retrievable(s3.store, files)


@pytest.mark.parametrize("before", [True, False], ids=["stray-shard-first", "home-first"])
def test_a_stray_duplicate_of_a_placed_object_is_removed_rows_kept(
    s3: S3Store, before: bool
) -> None:
    files = recycled(s3)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    dup = s3.put(s3.obj(c, stray_shard(c, before)), data)

    r = s3.store.fsck()
    assert r.misplaced == [
        {"path": s3.url(dup), "checksum": c, "action": "remove: a duplicate of its place"}
    ]
    assert s3.exists(dup) and r.corrupt == []

    r = s3.store.fsck(repair=True)
    assert (r.corrupt, r.missing) == ([], [])
    assert not s3.exists(dup) and s3.get(s3.obj(c)) == data
    assert [e.path for e in s3.store.index.entries(checksum=c)] == [path]
    assert s3.store.fsck().clean
    assert_retrievable(s3.store, files)


@pytest.mark.parametrize("before", [True, False], ids=["stray-shard-first", "home-first"])
def test_a_valid_stray_copy_replaces_a_corrupt_one_at_its_place(
    s3: S3Store, before: bool
) -> None:
    files = recycled(s3)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    good = s3.put(s3.obj(c, stray_shard(c, before)), data)
    s3.put(s3.obj(c), b"rotten " + data)

    r = s3.store.fsck()
    assert r.corrupt == [c] and len(r.misplaced) == 1 and r.missing == []

    r = s3.store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []
    # the corrupt copy is quarantined by whichever of the two prefixes is walked first
    assert r.misplaced[0]["action"] in (
        "replaced the corrupt copy at its place (quarantined)",
        "moved to its place",
    )
    assert [s3.get(q) for q in s3.quarantined(c)] == [b"rotten " + data]
    assert s3.get(s3.obj(c)) == data and not s3.exists(good)
    assert [e.path for e in s3.store.index.entries(checksum=c)] == [path]  # never dropped
    assert s3.store.fsck().clean
    assert_retrievable(s3.store, files)


def test_an_unindexed_object_in_the_wrong_shard_is_moved_and_registered(s3: S3Store) -> None:
    recycled(s3, n=1)
    data = b"misfiled and unknown"
    c = cks.of_bytes(data)
    wrong = s3.put(s3.obj(c, stray_shard(c, True)), data)
    r = s3.store.fsck(repair=True)
    assert r.unindexed == [c] and r.corrupt == []
    assert s3.get(s3.obj(c)) == data and not s3.exists(wrong)
    assert s3.store.index.get_object(c) is not None
    assert s3.store.fsck().clean


def test_bytes_not_hashing_to_their_name_in_the_wrong_shard_are_quarantined(
    s3: S3Store,
) -> None:
    files = recycled(s3)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    bogus = s3.put(s3.obj(c, stray_shard(c, True)), b"not it")

    r = s3.store.fsck()
    assert r.corrupt == [c] and r.misplaced == [] and s3.exists(bogus)
    r = s3.store.fsck(repair=True)
    assert r.corrupt == [c] and r.missing == []
    assert not s3.exists(bogus)
    assert [s3.get(q) for q in s3.quarantined(c)] == [b"not it"]
    # the valid copy at its place, and its rows, are untouched
    assert s3.get(s3.obj(c)) == data
    assert [e.path for e in s3.store.index.entries(checksum=c)] == [path]
    assert s3.store.fsck().clean
    assert_retrievable(s3.store, files)


def test_two_corrupt_copies_quarantined_in_one_run_both_stay(s3: S3Store) -> None:
    """Both quarantined at the same unix time: the second gets `.1`, never written over
    the first."""
    files = recycled(s3, n=1)
    (data,) = files.values()
    c = cks.of_bytes(data)
    s3.put(s3.obj(c), b"rotten at home")
    s3.put(s3.obj(c, stray_shard(c, True)), b"rotten elsewhere")
    r = s3.store.fsck(repair=True)
    assert r.corrupt == [c, c] and r.missing == []
    assert sorted(s3.get(q) for q in s3.quarantined(c)) == [b"rotten at home",
                                                             b"rotten elsewhere"]
    assert s3.store.index.get_object(c) is None
    assert s3.store.fsck().clean


# -- several at once, limits -------------------------------------------------------------


def test_all_at_once_and_repair_loses_nothing_it_should_keep(s3: S3Store) -> None:
    files = recycled(s3, n=5)
    sums = sorted(cks.of_bytes(b) for b in files.values())
    s3.fs.rm_file(s3.obj(sums[0]))
    s3.put(s3.obj(sums[1]), b"garbage")
    extra = b"extra"
    s3.put(s3.obj(cks.of_bytes(extra)), extra)
    r = s3.store.fsck(repair=True)
    assert (r.missing, r.corrupt, r.unindexed) == ([sums[0]], [sums[1]], [cks.of_bytes(extra)])
    assert r.checked == 5
    r2 = s3.store.fsck()
    assert r2.clean, r2.to_json()
    assert s3.store.index.stats()[0] == 4
    assert len(s3.fs.find(f"{s3.base}/objects")) == 4
    keep = {p: b for p, b in files.items() if cks.of_bytes(b) not in sums[:2]}
    assert_retrievable(s3.store, keep)


def test_report_lists_are_capped_counts_are_not(s3: S3Store) -> None:
    recycled(s3, n=1)
    for i in range(5):
        data = f"extra {i}".encode()
        s3.put(s3.obj(cks.of_bytes(data)), data)
    r = s3.store.fsck(limit=2)
    assert len(r.unindexed) == 2 and r.counts["unindexed"] == 5 and r.truncated
    r = s3.store.fsck(repair=True, limit=2)
    assert r.counts["unindexed"] == 5  # all repaired, not only those listed
    assert s3.store.fsck().clean


# -- online: recycles run meanwhile ------------------------------------------------------


def test_an_object_between_publish_and_commit_is_not_unindexed(
    s3: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"in flight" * 100
    c = cks.of_bytes(data)
    s3.put(f"{s3.wh}/a/f", data)

    def work() -> object:
        return s3.store.recycle(RecycleRequest([f"s3://{s3.wh}/a/f"], op="DELETE"))

    with held_at(monkeypatch, "recycle.file_published", work):
        assert s3.exists(s3.obj(c))  # published, not indexed
        assert s3.store.index.get_object(c) is None
        report = s3.store.fsck(repair=True, online=True)
        assert report.clean, report.to_json()
    o = s3.store.index.get_object(c)
    assert o is not None and o.expires > s3.clock()  # its commit's
    assert s3.store.fsck().clean


def test_an_object_healed_after_fsck_hashed_it_is_not_quarantined(
    s3: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object's bytes rot; fsck hashes it (corrupt); before fsck acts, a recycle of the
    same bytes heals it (Objects.publish) and commits. Quarantining on the earlier look
    would take the healed object away, and its rows with it."""
    data = b"rotting bytes" * 100
    c = cks.of_bytes(data)
    s3.put(f"{s3.wh}/a/f", data)
    s3.store.recycle(RecycleRequest([f"s3://{s3.wh}/a/f"], op="DELETE"))
    s3.put(s3.obj(c), b"X" * len(data))
    s3.put(f"{s3.wh}/b/f", data)
    reports: list[Any] = []

    def check() -> None:
        reports.append(s3.store.fsck(repair=True, online=True))

    with held_at(monkeypatch, "fsck.object_hashed", check):
        s3.store.recycle(RecycleRequest([f"s3://{s3.wh}/b/f"], op="DELETE"))  # heals it
    assert reports[0].corrupt == [], reports[0].to_json()
    assert s3.get(s3.obj(c)) == data
    assert_retrievable(s3.store, {f"s3://{s3.wh}/a/f": data, f"s3://{s3.wh}/b/f": data})
    assert s3.store.fsck().clean


# -- the command line ---------------------------------------------------------------------


def cli(s3: S3Store, *args: str) -> subprocess.CompletedProcess[str]:
    """`cmroot` in a subprocess on this store: the config from CMROOT_* variables, S3 from
    the AWS variables the s3_server fixture set (AWS_ENDPOINT_URL: the loopback server)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CMROOT_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(s3.env)
    return subprocess.run([sys.executable, "-m", "cmroot.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_cmroot_fsck_on_an_s3_store(s3: S3Store) -> None:
    files = recycled(s3, n=3)
    sums = sorted(cks.of_bytes(b) for b in files.values())
    s3.put(s3.obj(sums[0]), b"garbage")
    s3.store.close()  # the CLI takes the store's lock

    p = cli(s3, "--json", "fsck")
    assert p.returncode == 1, p.stderr  # findings, no --repair
    r = json.loads(p.stdout)
    assert r["corrupt"] == [sums[0]] and r["checked"] == 3 and r["clean"] is False

    p = cli(s3, "fsck")
    assert p.returncode == 1 and "1 corrupt" in p.stdout and sums[0] in p.stdout, p.stdout

    p = cli(s3, "--json", "fsck", "--repair")
    assert p.returncode == 0, p.stderr  # every finding repaired
    assert json.loads(p.stdout)["corrupt"] == [sums[0]]
    assert [s3.get(q) for q in s3.quarantined(sums[0])] == [b"garbage"]

    p = cli(s3, "--json", "fsck")
    assert p.returncode == 0 and json.loads(p.stdout)["clean"] is True, p.stdout
    s3.store = s3.open()
    assert_retrievable(s3.store, {p: b for p, b in files.items() if cks.of_bytes(b) != sums[0]})

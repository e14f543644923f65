"""Review 31: attacks on 72e54ca (the conditional take on S3, place_key overlap, the
tagged publish that recovery asks) and its surroundings, with the store on S3 (s3fs
against moto on loopback).

Each strict xfail names a break of an invariant of ../shared/DESIGN.md; the test_held_
ones are attacks that held."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import Clock

from cmroot import checksum as cks
from cmroot import config as cfg
from cmroot import faults
from cmroot.exceptions import CmrootError
from cmroot.store import RecycleRequest, Store
from tests.adversarial.s3_store import S3Store, hook_delete

pytestmark = pytest.mark.timeout(120)


def _suspended_like_aws(monkeypatch: pytest.MonkeyPatch, fs: Any, bucket: str) -> None:
    """Make HEAD answer as AWS S3 does in a bucket whose versioning is suspended: every
    object written there is the `null` version (x-amz-version-id: null). moto keeps the
    null version (list_object_versions shows it, DeleteObject VersionId=null removes it)
    but leaves the header out of HEAD."""
    real = fs._call_s3

    async def call(method: str, *akw: Any, **kw: Any) -> Any:
        out = await real(method, *akw, **kw)
        args = {**{k: v for d in akw for k, v in d.items()}, **kw}
        if method == "head_object" and args.get("Bucket") == bucket and not out.get("VersionId"):
            out = dict(out, VersionId="null")
        return out

    monkeypatch.setattr(fs, "_call_s3", call)


# -- breaks -----------------------------------------------------------------------------


def test_held_take_in_a_versioning_suspended_bucket_keeps_the_writers_new_object(
    s3s: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A break at 72e54ca (review 31); fixed by source.remote.remote_ident (a "null"
    version id names no version: the ETag does).
    No loss (1): a file never recycled is never deleted. In a bucket whose versioning
    is suspended (or whose objects predate enabling it), every object is the version
    `null`: a rewrite replaces it and keeps the version id. remote_ident() takes the
    version id first, so the identity a take records is "versionid:null" whatever the
    bytes; RemoteSession.remove_if_unchanged finds "versionid:null" again after a writer
    rewrote the path, and _s3_delete deletes by VersionId=null - the writer's new object,
    never recycled, gone for good (the store holds only the old bytes). Sequence: put old
    bytes; a move recycle copies them; a writer puts new bytes between the take's check
    and its DeleteObject (the same holds for a writer landing between the copy and the
    check). (cmroot/store/source/remote.py remote_ident/_s3_delete: a version id of
    "null" names no version - fall back to the ETag (If-Match) for it, or make the
    identity version id *and* ETag and delete by VersionId with If-Match.)"""
    s3s.fs.call_s3("put_bucket_versioning", Bucket=s3s.wh,
                   VersioningConfiguration={"Status": "Suspended"})
    _suspended_like_aws(monkeypatch, s3s.store.layout.fs, s3s.wh)
    old, new = b"old bytes" * 100, b"the writer's new bytes" * 100
    url = s3s.put("db.db/t/f", old)
    path = f"{s3s.wh}/db.db/t/f"
    fired = hook_delete(monkeypatch, s3s.store.layout.fs, path,
                         lambda: s3s.fs.pipe_file(path, new))
    with contextlib.suppress(CmrootError):
        s3s.store.recycle(RecycleRequest([url]))
    assert fired, "the take never deleted its source"
    assert s3s.get("db.db/t/f") == new, "the writer's new object was deleted"


def test_held_resolve_in_a_versioning_suspended_bucket_follows_a_rewrite(
    s3s: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A break at 72e54ca (review 31); fixed by source.remote.remote_ident (as above).
    Right bytes (3): "a trusted earlier verification holds only while the file's
    identity (ETag or version id) is unchanged". The same root cause as the take above,
    through resolve: remote_ident() gives "versionid:null" for every object of a
    versioning-suspended bucket, so resolve caches (path, versionid:null) -> checksum and
    keeps answering it after a rewrite: (path, old checksum) is `original` while the path
    holds other bytes, and (path, new checksum) is `missing`. (cmroot/store/source/
    remote.py remote_ident: never let a "null" version id stand for the object; use the
    ETag then, or both.)"""
    s3s.fs.call_s3("put_bucket_versioning", Bucket=s3s.wh,
                   VersioningConfiguration={"Status": "Suspended"})
    _suspended_like_aws(monkeypatch, s3s.store.layout.fs, s3s.wh)
    old, new = b"O" * 2000, b"N" * 2000
    url = s3s.put("db.db/t/f", old)
    c_old, c_new = cks.of_bytes(old), cks.of_bytes(new)
    [r] = s3s.store.resolve([{"path": url, "checksum": c_old}])
    assert r.status == "original"
    s3s.put("db.db/t/f", new)
    got = {r.checksum: r.status for r in s3s.store.resolve(
        [{"path": url, "checksum": c_old}, {"path": url, "checksum": c_new}])}
    assert got == {c_old: "missing", c_new: "original"}, got


@pytest.mark.parametrize("key", ["db.db/t/./a", "db.db/t/p=1//a"])
def test_held_a_drop_of_a_key_with_a_dot_or_empty_segment_is_refused(
    s3s: S3Store, key: str
) -> None:
    """A break at 72e54ca (review 31); fixed by warehouse._addressable (a 409 before
    anything moves).
    No loss (1). S3 keys are opaque: `t/./a` and `t/p=1//a` are keys of their own (a
    job joining "t/p=1/" and "/a" writes the second). A DROP of the table directory lists
    them (RemoteSource.expand: fs.find, key = base + sub, never normalised), takes them
    and records entries and the event under `s3://wh/db.db/t/./a`. Every lookup then
    normalises the path it is given (warehouse._url_key -> _normalise: "." and "//"
    folded), so resolve, GET /v1/files and open_verified all look for
    `s3://wh/db.db/t/a` and find nothing: the source was taken, nothing serves it.
    (RemoteSource.expand / Warehouse.expand: refuse - 409/400 naming the key - a listed
    key that _url_key does not leave as it is, before anything moves; or record keys in
    the spelling lookups use and address the object by its listed key.)"""
    data = os.urandom(700)
    s3s.fs.call_s3("put_object", Bucket=s3s.wh, Key=key, Body=data)
    c = cks.of_bytes(data)
    with contextlib.suppress(CmrootError):
        s3s.store.recycle(RecycleRequest([f"s3://{s3s.wh}/db.db/t"], op="DROP_TABLE",
                                         db="db", table="t"))
    if s3s.get(key) == data:
        return  # refused, nothing moved: held
    listed = f"s3://{s3s.wh}/{key}"
    [r] = s3s.store.resolve([{"path": listed, "checksum": c}])
    assert r.status == "cmroot", f"{key} was taken and resolves {r.status}"
    assert s3s.served(listed, c) == data


def test_held_a_path_with_a_version_query_is_refused(
    s3s: S3Store,
) -> None:
    """A break at 72e54ca (review 31); fixed by warehouse._url_key (a 400).
    No loss (1), and bad input changes nothing (5). A recycle of
    `s3://wh/db.db/t/f?versionId=zzz` (a pasted console URL, or a real key containing
    that text) is confined as the key `db.db/t/f?versionId=zzz`; s3fs's split_path cuts
    `?versionId=...` off every path it is given (version_aware or not), so expand, the
    copy and the conditional delete all act on `db.db/t/f`, while the entry and the
    event name `.../f?versionId=zzz`. The file `db.db/t/f` is gone and (f, checksum)
    resolves `missing`; had the key `db.db/t/f?versionId=zzz` existed, it would stay and
    `db.db/t/f` be taken in its place. (Warehouse.locate/_url_key for s3 roots, and
    RemoteSource.expand for listed keys: refuse a path containing "?versionId=" - 400 -
    since s3fs cannot address such a key; or check split_path(path) gives back the key
    recorded.)"""
    data = os.urandom(500)
    s3s.put("db.db/t/f", data)
    c = cks.of_bytes(data)
    with contextlib.suppress(CmrootError):
        s3s.store.recycle(RecycleRequest([f"s3://{s3s.wh}/db.db/t/f?versionId=zzz"]))
    if s3s.get("db.db/t/f") == data:
        return  # refused: held
    [r] = s3s.store.resolve([{"path": f"s3://{s3s.wh}/db.db/t/f", "checksum": c}])
    assert r.status == "cmroot", "db.db/t/f was taken and is retrievable by no path"


@pytest.mark.parametrize("spelling", ["s3:///{st}", "simplecache::s3://{st}"])
def test_held_a_warehouse_root_without_authority_or_chained_never_holds_the_store(
    s3s: S3Store, spelling: str
) -> None:
    """A break at 72e54ca (review 31); fixed by config.place_key (the bucket of
    `s3:///b`) and absolute_root (no chained roots).
    Confinement (5), then no loss (1). s3fs opens `s3:///<bucket>` as the bucket (it
    strips the leading "/" of the path), and fsspec opens `simplecache::s3://<bucket>` as
    the same bucket through a cache; config.place_key keys the first with an empty
    authority (`s3fs.S3FileSystem:///<bucket>`) and leaves the second's scheme
    (`simplecache::s3`) unknown, so neither overlaps `s3://<bucket>/cm` and both the
    config check and Warehouse._fence accept them. A recycle through that root then takes
    the store's own files: here the staged copy of a prepared DROP (after a restart); the
    commit fails, its rollback claims "every file is back at its source", and the dropped
    file is neither at its path nor retrievable from the store. (config.place_key: key a
    URL by what fsspec opens - `fs, p = url_to_fs(url)`; compare
    `(type(fs), fs._strip_protocol(p) split by fs.split_path where there is one)` -, or
    refuse an empty authority for bucket filesystems and any chained URL as a root.)"""
    env = dict(s3s.env)
    root = spelling.format(st=s3s.st)
    env["CMROOT_STORE_WAREHOUSE_ROOTS"] = f"s3://{s3s.wh},{root}"
    try:
        c = cfg.load(None, env)
        s3s.store.close()
        s3s.store = store = Store.open(c, clock=s3s.clock)
    except CmrootError:
        return  # refused at load or open: held
    s3s.env = env
    data = os.urandom(3000)
    url = s3s.put("db.db/t/f", data)
    p = store.prepare(RecycleRequest([url], op="DROP_TABLE", db="db", table="t"), lease=600)
    store = s3s.reopen()  # a restart between prepare and commit (the lease holds it)
    staged = store.layout.staged_path(p.txid, 0)  # "<st>/cm/staging/<txid>/0"
    with contextlib.suppress(CmrootError):
        store.recycle(RecycleRequest([root + staged[len(s3s.st):]]))
    with contextlib.suppress(CmrootError):
        store.commit(p.txid)
    if s3s.get("db.db/t/f") != data:
        try:
            assert s3s.served(url, cks.of_bytes(data)) == data
        except CmrootError:
            pytest.fail(f"{root} holds the store; the dropped file is lost")


def test_held_a_local_scheme_warehouse_root_never_holds_a_local_store(tmp_path: Path) -> None:
    """A break at 72e54ca (review 31); fixed by config.local_path (`local://` is local).
    Confinement (5), then no loss (1). fsspec opens `local:///x` as the local
    filesystem, like `file:///x`; config.local_path knows only `file://`, so place_key
    keys `local:///<base>` as `fsspec.implementations.local.LocalFileSystem:///<base>`,
    never equal to or above the store's plain path `<base>/cm`: the config check and
    Warehouse._fence (local roots by real path, others by that key) both let the root
    through, and it becomes a RemoteSource over LocalFileSystem whose take deletes with
    rm_file. A recycle of `local://<base>/cm/staging` through it then takes the staged
    file of a prepared DROP (a rename: the source itself) and records a DELETE event for
    it; the statement aborts, the rollback finds nothing staged and puts nothing back,
    and the dropped file is retrievable neither at its path nor from the store.
    (config.local_path/place_key: treat every scheme whose fsspec class is
    LocalFileSystem as local - or key URLs by `url_to_fs` - and realpath them in
    _fence.)"""
    base = tmp_path / "lake"
    (base / "wh").mkdir(parents=True)
    env = {
        "CMROOT_STORE_ROOT": str(base / "cm"),
        "CMROOT_STORE_WAREHOUSE_ROOTS": f"{base / 'wh'},local://{base}",
        "CMROOT_INDEX_PATH": str(tmp_path / "idx" / "index.sqlite"),
        "CMROOT_STORE_RETAIN": "1h",
    }
    clock = Clock()
    try:
        store = Store.open(cfg.load(None, env), clock=clock)
    except CmrootError:
        return  # refused: held
    try:
        data = os.urandom(3000)
        src = base / "wh" / "db.db" / "t" / "f"
        src.parent.mkdir(parents=True)
        src.write_bytes(data)
        p = store.prepare(RecycleRequest([str(src)], op="DROP_TABLE", db="db", table="t"),
                          lease=600)
        # The store's staging directory, through the root that holds the store.
        with contextlib.suppress(CmrootError):
            store.recycle(RecycleRequest([f"local://{base}/cm/staging"]))
        with contextlib.suppress(CmrootError):
            store.abort(p.txid)  # the statement failed: every file goes back
        if not src.exists():
            try:
                with store.open_verified(str(src), cks.of_bytes(data)) as v:
                    got = os.pread(v.fd, 1 << 20, 0) if v.data is None else v.data
                assert got == data
            except CmrootError:
                pytest.fail("local:// holds the store; the dropped file is lost")
    finally:
        store.close()


def test_held_resolve_caches_a_checksum_only_under_the_etag_the_bytes_were_read_at(
    s3s: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A break at 72e54ca (review 31); fixed by resolve._hash (an S3 original's identity is
    looked at again after its bytes are read: changed meanwhile, no answer and no cache).
    Right bytes (3): "a trusted earlier verification holds only while the file's
    identity (ETag ...) is unchanged". resolve._stat reads an S3 original's ETag, then
    _hash reads its bytes (cks.of_file) and caches (path, that ETag) -> checksum, with no
    look at the ETag after the read (the local branch compares identities before and
    after). A writer that lands between the two gets its new bytes' checksum cached under
    the old ETag; a single-part ETag is the content's MD5, so when the old bytes come back
    (an INSERT OVERWRITE writing the same output again, a restore), the cache answers for
    them with the other checksum: resolve says `original` for (path, c_new) while the
    path holds the old bytes, and `missing` for (path, c_old), which is there. (Fix in
    cmroot/store/resolve.py _hash: after of_file, take fresh_info again and return None
    unless its identity is o.ident; or cache under the identity read after the bytes
    only if it equals the one before.)"""
    import cmroot.store.resolve as resolve_mod

    old, new = b"A" * 3000, b"B" * 3000
    url = s3s.put("db.db/t/f", old)
    real = resolve_mod._stat
    fired: list[bool] = []

    def stat_then_writer(loc: Any) -> Any:
        o = real(loc)
        if not fired:
            fired.append(True)
            s3s.put("db.db/t/f", new)  # lands after the ETag was read, before the hash
        return o

    monkeypatch.setattr(resolve_mod, "_stat", stat_then_writer)
    c_old, c_new = cks.of_bytes(old), cks.of_bytes(new)
    s3s.store.resolve([{"path": url, "checksum": c_old}])
    assert fired
    monkeypatch.setattr(resolve_mod, "_stat", real)
    s3s.put("db.db/t/f", old)  # the old bytes again: the same ETag (their MD5)
    got = {r.checksum: r.status for r in s3s.store.resolve(
        [{"path": url, "checksum": c_old}, {"path": url, "checksum": c_new}])}
    assert got == {c_old: "original", c_new: "missing"}, got


def test_held_owner_deleted_while_open_lets_no_second_index_sweep_the_first_ones_object(
    s3s: S3Store, tmp_path: Path
) -> None:
    """A break at 72e54ca (review 31); fixed by RemoteLayout.owned (OWNER written again
    when missing; one naming another index marked contested by A's next recycle) and
    Objects.remove (no index OWNER does not name deletes: B's sweep is refused).
    No loss (1) / retention (4). The OWNER marker is what keeps a second index (which
    would sweep objects it does not know) off the store, but it is only checked and
    written at open (RemoteLayout.lock); `writable()` merely reports it missing (readyz).
    The marker is deleted while daemon A runs (an operator tidying a prefix, a lifecycle
    rule, the StoreLocked hint followed against the wrong daemon): daemon B with another
    index then opens the same store and writes its own OWNER. A recycles file x (kept 1h);
    B recycles the same bytes from y, deduplicating against A's object, with a 1m
    retention; B's sweep deletes the object, and A's (x, checksum) is served by nobody
    before its retention. (RemoteLayout: put OWNER back (exclusive create) when it is
    found missing and refuse writes while it names another index - check it in
    writable() and before each recycle publishes, not only at open.)"""
    s3s.fs.rm_file(f"{s3s.st}/cm/OWNER")
    # Daemon B is another process: spelled s3a:// only so that this process's registry
    # of open stores (keyed by the root as written) does not stand in for that.
    env_b = dict(s3s.env, CMROOT_INDEX_PATH=str(tmp_path / "b" / "index.sqlite"),
                 CMROOT_STORE_RETAIN="1m", CMROOT_STORE_ROOT=f"s3a://{s3s.st}/cm")
    clock_b = Clock()
    try:
        b = Store.open(cfg.load(None, env_b), clock=clock_b)
    except CmrootError:
        return  # refused: held
    try:
        data = os.urandom(2000)
        x = s3s.put("db.db/t/x", data)
        [f] = s3s.store.recycle(RecycleRequest([x])).files
        y = s3s.put("db.db/u/y", data)
        b.recycle(RecycleRequest([y]))
        clock_b.advance(3600)
        b.gc()
        try:
            assert s3s.served(x, f.checksum) == data
        except CmrootError:
            pytest.fail("a second index swept the first one's object within its retention")
    finally:
        b.close()


# -- attacks that held ------------------------------------------------------------------


def test_held_a_healed_object_stays_when_the_healing_recycle_dies_and_is_rolled_back(
    s3s: S3Store,
) -> None:
    """No loss (1), right bytes (3). An indexed object rots; a recycle of the same bytes
    heals it (Objects.publish -> RemoteLayout.heal, tagged with its own staged name)
    and dies right after. Recovery finds the object tagged as its own (published() is
    True) but indexed, so it stays, with the good bytes; the dying recycle's source goes
    back; the rotten bytes are kept in quarantine."""
    data = os.urandom(3000)
    a = s3s.put("db.db/t/a", data)
    [f] = s3s.store.recycle(RecycleRequest([a])).files
    c = f.checksum
    s3s.fs.pipe_file(s3s.obj(c), b"rot" * 10)
    b = s3s.put("db.db/u/b", data)
    faults.arm("recycle.file_published", crash=True)
    with pytest.raises(faults.Crash):
        s3s.store.recycle(RecycleRequest([b]))
    store = s3s.reopen()
    assert s3s.get("db.db/u/b") == data  # rolled back: put back
    assert store.index.current_event_id() == 1
    assert s3s.served(a, c) == data  # the healed object stayed
    assert s3s.fs.find(f"{s3s.st}/cm/quarantine")


POINTS = ["journal.begun", "recycle.file_staged", "recycle.copy_journaled",
          "recycle.source_taken", "recycle.file_published", "recycle.staged",
          "recycle.flushed", "journal.committed", "journal.source_removed", "journal.unstaged"]


@pytest.mark.parametrize("point", POINTS)
def test_held_crash_with_an_unindexed_object_of_the_checksum_keeps_it(
    s3s: S3Store, point: str
) -> None:
    """No loss (1) for what fsck adopts, no phantom (2): an unindexed object of the
    checksum (a lost index's) is there; a move recycle of the same bytes dies at each
    point; recovery finishes or rolls back, and the object is still there either way."""
    data = os.urandom(2222)
    c = cks.of_bytes(data)
    s3s.fs.pipe_file(s3s.obj(c), data)
    url = s3s.put("db.db/t/f", data)
    faults.arm(point, crash=True)
    with contextlib.suppress(faults.Crash):
        s3s.store.recycle(RecycleRequest([url]))
    store = s3s.reopen()
    assert s3s.fs.exists(s3s.obj(c)), "recovery deleted an object it never made"
    if store.index.current_event_id():
        assert s3s.served(url, c) == data
    else:
        assert s3s.get("db.db/t/f") == data


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_held_prepared_dedup_against_an_unindexed_object_across_a_restart(
    s3s: S3Store, end: str
) -> None:
    """No loss, no phantom (1, 2) with two-phase on S3: a prepared DROP deduplicates
    against an unindexed object it did not make; after a restart (claims and `_made`
    gone) the commit publishes (published() says not ours: it links, finds the same
    bytes) and serves, or the abort puts the source back and leaves the object."""
    data = os.urandom(2500)
    c = cks.of_bytes(data)
    s3s.fs.pipe_file(s3s.obj(c), data)
    url = s3s.put("db.db/t/f", data)
    p = s3s.store.prepare(RecycleRequest([url], op="DROP_TABLE", db="db", table="t"),
                          lease=600)
    store = s3s.reopen()
    if end == "commit":
        store.commit(p.txid)
        assert s3s.get("db.db/t/f") is None
        assert s3s.served(url, c) == data
    else:
        store.abort(p.txid)
        assert s3s.get("db.db/t/f") == data
        assert store.index.current_event_id() == 0
    assert s3s.fs.exists(s3s.obj(c))


def test_held_a_multipart_warehouse_object_is_taken_and_deduplicated_byte_for_byte(
    s3s: S3Store,
) -> None:
    """No loss (1), right bytes (3): a 6 MiB object uploaded in two parts (ETag "...-2")
    is taken with If-Match on that ETag and deduplicated against the object a single-part
    upload of the same bytes made (ETags differ in kind: compared byte for byte)."""
    data = os.urandom(6 << 20)
    first = s3s.put("db.db/u/single", data)
    s3s.store.recycle(RecycleRequest([first]))
    key = "db.db/t/multi"
    up = s3s.fs.call_s3("create_multipart_upload", Bucket=s3s.wh, Key=key)
    parts = []
    for n, chunk in enumerate((data[: 5 << 20], data[5 << 20 :]), 1):
        r = s3s.fs.call_s3("upload_part", Bucket=s3s.wh, Key=key, UploadId=up["UploadId"],
                           PartNumber=n, Body=chunk)
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
    s3s.fs.call_s3("complete_multipart_upload", Bucket=s3s.wh, Key=key,
                   UploadId=up["UploadId"], MultipartUpload={"Parts": parts})
    assert "-" in s3s.fs.info(f"{s3s.wh}/{key}")["ETag"]
    url = f"s3://{s3s.wh}/{key}"
    [f] = s3s.store.recycle(RecycleRequest([url])).files
    assert f.checksum == cks.of_bytes(data)
    assert s3s.get(key) is None
    assert s3s.served(url, f.checksum) == data


def test_held_a_server_without_conditional_deletes_falls_back_and_says_so(
    s3s: S3Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No loss (1): a DeleteObject with If-Match answered 501 (NotImplemented, ENOSYS in
    s3fs) falls back to check-then-delete: the take completes, the bytes are served, and
    the fallback is logged."""
    import errno

    import cmroot.store.source.remote as remote_mod

    monkeypatch.setattr(remote_mod, "_WARNED", False)
    fs = s3s.store.layout.fs
    real = fs.call_s3

    def call(method: str, *a: Any, **kw: Any) -> Any:
        if method == "delete_object" and "IfMatch" in kw:
            raise OSError(errno.ENOSYS, "A header you provided implies functionality that"
                          " is not implemented")
        return real(method, *a, **kw)

    monkeypatch.setattr(fs, "call_s3", call)
    data = os.urandom(900)
    url = s3s.put("db.db/t/f", data)
    with caplog.at_level("WARNING", logger="cmroot.store.source.remote"):
        [f] = s3s.store.recycle(RecycleRequest([url])).files
    assert s3s.get("db.db/t/f") is None
    assert s3s.served(url, f.checksum) == data
    assert any("conditional deletes" in r.getMessage() for r in caplog.records)


def test_held_versioned_bucket_writer_deletes_between_check_and_delete(
    s3s: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No loss (1) on a versioned bucket: a writer deletes the path (a delete marker)
    between the take's check and its DeleteObject; the take removes the version it copied
    by id, the recycle commits and the bytes are served."""
    s3s.fs.call_s3("put_bucket_versioning", Bucket=s3s.wh,
                   VersioningConfiguration={"Status": "Enabled"})
    data = os.urandom(1200)
    url = s3s.put("db.db/t/f", data)
    path = f"{s3s.wh}/db.db/t/f"
    fired = hook_delete(monkeypatch, s3s.store.layout.fs, path,
                         lambda: s3s.fs.rm_file(path))
    res = s3s.store.recycle(RecycleRequest([url]))
    assert fired
    assert s3s.served(url, res.files[0].checksum) == data


@pytest.mark.parametrize("roots", [
    "s3://{st}/cm2", "s3://{st}/c", "s3://{st}/cmx/cm", "s3://{st}/objects", "s3://{st}x",
])
def test_held_roots_beside_the_store_are_not_refused(s3s: S3Store, roots: str) -> None:
    """Availability of the overlap check (place_key): siblings and prefixes-by-text of
    the store `s3://<st>/cm` (`cm2`, `c`, another bucket `<st>x`) are no overlap; a file
    there is recycled and served."""
    root = roots.format(st=s3s.st)
    if root.endswith("x"):
        s3s.fs.mkdir(root[len("s3://"):])
    env = dict(s3s.env, CMROOT_STORE_WAREHOUSE_ROOTS=f"s3://{s3s.wh},{root}")
    s3s.store.close()
    s3s.env = env
    s3s.store = store = Store.open(cfg.load(None, env), clock=s3s.clock)
    try:
        data = os.urandom(300)
        s3s.fs.pipe_file(f"{root[len('s3://'):]}/db.db/t/f", data)
        [f] = store.recycle(RecycleRequest([f"{root}/db.db/t/f"])).files
        assert s3s.served(f"{root}/db.db/t/f", f.checksum) == data
    finally:
        if root.endswith("x"):
            with contextlib.suppress(Exception):
                s3s.fs.rm(root[len("s3://"):], recursive=True)


@pytest.mark.parametrize("spelling", ["S3A://{st}/", "s3n://{st}", "s3://{st}/cm/objects/..",
                                      "s3://{st}/./cm//", "s3://{st}/cm/staging"])
def test_held_other_spellings_of_the_store_are_refused(s3s: S3Store, spelling: str) -> None:
    """Confinement (5): a root that is, holds or lies in the store, spelled otherwise, is
    refused at load or open with a clear error."""
    env = dict(s3s.env, CMROOT_STORE_WAREHOUSE_ROOTS=f"s3://{s3s.wh},"
               + spelling.format(st=s3s.st))
    with pytest.raises(CmrootError, match="overlap"):
        cfg.load(None, env)


def test_held_bad_paths_against_a_daemon_whose_store_is_on_s3(
    tmp_path: Path, s3_client: Any
) -> None:
    """Bad input gets a clear error and changes nothing (5): S3 spellings a request may
    carry - an empty authority, the store's own keys by either scheme, a key over S3's
    1024 bytes, glob and escape characters, a bucket-less URL - are 4xx on recycle,
    resolve and files, never a 5xx; the store's OWNER marker stays."""
    from tests.server.test_store_on_s3 import S3Daemon

    d = S3Daemon(tmp_path / "d", s3_client)
    d.d.start()
    try:
        wh, st = d.wh, d.store
        d.put("db.db/t/f", b"keep")
        c = "0" * 32
        paths = [f"s3:///{wh}/db.db/t/f", f"s3://{st}/cm/OWNER", f"s3a://{st}/cm/OWNER",
                 f"s3://{wh}/" + "k" * 1100, f"s3://{wh}/db.db/t/*", f"s3://{wh}/%ff/x",
                 "s3://", "s3:///", f"s3://{wh}/db.db/../x", f"S3://{wh}/db.db/t/f",
                 f"s3://{wh}/db.db/t/f\\..\\g"]
        for p in paths:
            for method, path, body in (
                ("POST", "/v1/recycle", {"paths": [p], "mode": "move"}),
                ("POST", "/v1/resolve", {"files": [{"path": p, "checksum": c}]}),
                ("GET", d.d.files_url(p, c), None),
            ):
                r = d.d.request(method, path, body)
                assert r.status < 500, (p, path, r)
                if method == "POST" and path == "/v1/recycle":
                    assert r.status >= 400, (p, r)
        assert s3_client.cat_file(f"{wh}/db.db/t/f") == b"keep"
        assert s3_client.exists(f"{st}/cm/OWNER")
    finally:
        d.close()


@pytest.mark.parametrize("rewrite", [False, True], ids=["alone", "writer-recreates"])
@pytest.mark.parametrize("point", POINTS)
def test_held_crash_on_a_versioned_warehouse_bucket_then_recovery_keeps_every_byte(
    s3s: S3Store, point: str, rewrite: bool
) -> None:
    """No loss, no phantom (1, 2) where the take deletes by version id: a move recycle
    from a versioned bucket dies at `point`; a writer may then re-create the path;
    recovery finishes it (event, bytes served) or rolls it back (the old bytes put back,
    or kept displaced beside the writer's)."""
    s3s.fs.call_s3("put_bucket_versioning", Bucket=s3s.wh,
                   VersioningConfiguration={"Status": "Enabled"})
    old, new = os.urandom(1800), b"writer" * 10
    url = s3s.put("db.db/t/f", old)
    faults.arm(point, crash=True)
    with contextlib.suppress(faults.Crash):
        s3s.store.recycle(RecycleRequest([url]))
    faults.disarm()
    if rewrite and s3s.get("db.db/t/f") is None:
        s3s.put("db.db/t/f", new)
    store = s3s.reopen()
    c = cks.of_bytes(old)
    at = s3s.get("db.db/t/f")
    if store.index.current_event_id():
        assert s3s.served(url, c) == old
        assert at in (None, new)
    else:
        assert at in (old, new)
        if at == new:
            assert s3s.served(url, c) == old
    assert not s3s.fs.find(f"{s3s.st}/cm/staging")

"""The daemon with its store on S3 (`store.root = "s3://bucket/prefix"`), a real S3
server on loopback (moto) and warehouses on S3 and on local disk: recycles over HTTP
land in the bucket, reads serve the right bytes, the sweep empties it, a kill -9 mid
recycle is rolled back at the next start, a second index is refused the same store,
and the fsspec hook over an S3 warehouse protects through it."""

from __future__ import annotations

import io
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmroot import checksum as cks
from cmroot.exceptions import DaemonUnavailable
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, assert_error, clean_env

pytestmark = pytest.mark.timeout(300)


class S3Daemon:
    """A daemon whose store is `s3://{store}/cm`, warehouse roots `s3://{wh}` and a local
    directory; `fs` is the tests' own client of the S3 server."""

    def __init__(self, base: Path, fs: Any, **env: str) -> None:
        self.fs = fs
        self.store = f"st-{uuid.uuid4().hex[:8]}"
        self.wh = f"wh-{uuid.uuid4().hex[:8]}"
        fs.mkdir(self.store)
        fs.mkdir(self.wh)
        self.index = base / "var" / "index.sqlite"
        self.d = Daemon(base, env={
            "CMROOT_STORE_ROOT": f"s3://{self.store}/cm",
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"s3://{self.wh},{base / 'warehouse'}",
            "CMROOT_INDEX_PATH": str(self.index),
            **env,
        })

    def put(self, rel: str, data: bytes) -> str:
        with self.fs.open(f"{self.wh}/{rel}", "wb") as f:
            f.write(data)
        return f"s3://{self.wh}/{rel}"

    def objects(self) -> list[str]:
        return sorted(self.fs.find(f"{self.store}/cm/objects"))

    def staging(self) -> list[str]:
        return sorted(self.fs.find(f"{self.store}/cm/staging"))

    def get(self, path: str, checksum: str) -> bytes:
        buf = io.BytesIO()
        self.d.client().get(path, checksum, buf)
        return buf.getvalue()

    def close(self) -> None:
        self.d.close()
        for b in (self.store, self.wh):
            self.fs.rm(b, recursive=True)


@pytest.fixture
def s3d(tmp_path: Path, s3_client: Any) -> Iterator[S3Daemon]:
    d = S3Daemon(tmp_path / "d", s3_client)
    d.d.start()
    yield d
    d.close()


def table(s3d: S3Daemon) -> dict[str, bytes]:
    files = {
        "db.db/t/p=1/a": b"alpha" * 1000,
        "db.db/t/p=1/b": b"alpha" * 1000,  # the same bytes: one object
        "db.db/t/p=2/c": b"",
        "db.db/t/p=2/d": bytes(range(256)) * 4096,  # 1 MiB
    }
    return {s3d.put(rel, data): data for rel, data in files.items()}


def test_a_drop_over_http_lands_in_the_bucket_and_is_served(s3d: S3Daemon) -> None:
    files = table(s3d)
    client = s3d.d.client()
    r = client.recycle([f"s3://{s3d.wh}/db.db/t"], op="DROP_TABLE", db="db", table="t")
    assert sorted(f.path for f in r.files) == sorted(files)
    assert s3d.fs.find(s3d.wh) == []
    assert len(s3d.objects()) == 3 and s3d.staging() == []
    res = client.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])
    assert {f.status for f in res.files} == {"cmroot"}
    assert all(str(f.location).startswith(f"s3://{s3d.store}/cm/objects/") for f in res.files)
    for p, b in files.items():
        assert s3d.get(p, cks.of_bytes(b)) == b
    big = next(p for p in files if p.endswith("/d"))
    c = cks.of_bytes(files[big])
    ranged = s3d.d.request("GET", s3d.d.files_url(big, c), headers={"Range": "bytes=10-19"})
    assert ranged.status == 206 and ranged.body == files[big][10:20]
    head = s3d.d.request("HEAD", s3d.d.files_url(big, c))
    assert head.status == 200 and int(head.headers["Content-Length"]) == len(files[big])
    metrics = s3d.d.metrics()
    assert "cmroot_store_objects 3.0" in metrics
    assert s3d.d.request("GET", "/readyz", scope=None).status == 200


def test_a_local_warehouse_file_is_uploaded_into_the_bucket(s3d: S3Daemon) -> None:
    f = s3d.d.warehouse / "db.db" / "u" / "x"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"local bytes")
    r = s3d.d.client().recycle([str(f)], op="DROP_TABLE", db="db", table="u")
    assert not f.exists()
    [rec] = r.files
    c = rec.checksum
    assert s3d.get(str(f), c) == b"local bytes"
    assert s3d.objects() == [f"{s3d.store}/cm/objects/{c[:2]}/{c[2:4]}/{c}"]


def test_two_phase_over_http(s3d: S3Daemon) -> None:
    files = table(s3d)
    client = s3d.d.client()
    p = client.prepare([f"s3://{s3d.wh}/db.db/t/p=1"], op="DROP_PARTITION", db="db",
                       table="t", partitions=[{"p": "1"}])
    assert not s3d.fs.exists(f"{s3d.wh}/db.db/t/p=1/a")  # a prepared delete is a delete
    client.abort(p.txid)
    assert s3d.fs.cat_file(f"{s3d.wh}/db.db/t/p=1/a") == files[f"s3://{s3d.wh}/db.db/t/p=1/a"]
    assert s3d.objects() == [] and s3d.staging() == []
    since = client.current_event()
    p = client.prepare([f"s3://{s3d.wh}/db.db/t/p=1"], op="DROP_PARTITION", db="db",
                       table="t", partitions=[{"p": "1"}])
    done = client.commit(p.txid)
    assert done.event_id > since and len(s3d.objects()) == 1


def test_a_corrupt_object_is_never_served(s3d: S3Daemon) -> None:
    path = s3d.put("db.db/t/f", b"good bytes" * 100)
    [rec] = s3d.d.client().recycle([path], op="DELETE").files
    c = rec.checksum
    with s3d.fs.open(f"{s3d.store}/cm/objects/{c[:2]}/{c[2:4]}/{c}", "wb") as f:
        f.write(b"rotten bytes" * 100)
    reply = s3d.d.request("GET", s3d.d.files_url(path, c))
    assert reply.status == 404 and b"rotten" not in reply.body
    assert s3d.objects() == []  # quarantined
    assert "cmroot_checksum_mismatches_total 1.0" in s3d.d.metrics()


def test_expired_objects_are_swept_from_the_bucket(tmp_path: Path, s3_client: Any) -> None:
    s3d = S3Daemon(tmp_path / "d", s3_client, CMROOT_STORE_RETAIN="1s")
    s3d.d.start()
    try:
        files = table(s3d)
        client = s3d.d.client()
        client.recycle([f"s3://{s3d.wh}/db.db/t"], op="DROP_TABLE", db="db", table="t")
        assert len(s3d.objects()) == 3
        time.sleep(1.1)  # the retention itself: one real second has to pass
        report = client.gc(dry_run=False)
        assert report["removed_objects"] == 3, report
        assert s3d.objects() == []
        res = client.resolve([{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()])
        assert {f.status for f in res.files} == {"missing"}
    finally:
        s3d.close()


def test_kill_9_mid_recycle_is_rolled_back_at_restart(tmp_path: Path, s3_client: Any) -> None:
    s3d = S3Daemon(tmp_path / "d", s3_client)
    try:
        files = table(s3d)
        s3d.d.start(env={"CMROOT_FAULTS": "recycle.file_published@2"})  # SIGKILL there
        with pytest.raises(DaemonUnavailable):
            s3d.d.client(timeout=30).recycle([f"s3://{s3d.wh}/db.db/t"], op="DROP_TABLE",
                                              db="db", table="t")
        assert s3d.d.proc is not None and s3d.d.proc.wait(30) != 0
        s3d.d.start()
        for p, b in files.items():  # every file back where it was, bytes unchanged
            assert s3d.fs.cat_file(p[len("s3://"):]) == b
        assert s3d.objects() == [] and s3d.staging() == []
        assert s3d.d.client().current_event() == 0  # no event: nothing was dropped
    finally:
        s3d.close()


def test_a_second_index_is_refused_the_same_store(s3d: S3Daemon, tmp_path: Path) -> None:
    other = Daemon(tmp_path / "other", env={
        "CMROOT_STORE_ROOT": f"s3://{s3d.store}/cm",
        "CMROOT_STORE_WAREHOUSE_ROOTS": f"s3://{s3d.wh}",
        "CMROOT_INDEX_PATH": str(tmp_path / "other" / "var" / "index.sqlite"),
    })
    with pytest.raises(AssertionError, match="belongs to another index"):
        other.start()
    other.close()


def test_a_store_url_without_an_index_path_is_a_clear_error(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "x", env={"CMROOT_STORE_ROOT": "s3://some-bucket/cm"})
    with pytest.raises(AssertionError, match=r"index\.path is needed"):
        d.start()
    assert "Traceback" not in d.log()
    d.close()


def test_bad_requests_change_nothing(s3d: S3Daemon) -> None:
    before = s3d.objects()
    r = s3d.d.request("POST", "/v1/recycle", {"paths": [f"s3://{s3d.wh}/nope"], "op": "DELETE"})
    assert_error(r, 404)
    r = s3d.d.request("POST", "/v1/recycle", {"paths": [f"s3://{s3d.store}/cm/OWNER"],
                                               "op": "DELETE"})
    assert_error(r, 403)
    r = s3d.d.request("POST", "/v1/recycle", {"paths": [f"s3://{s3d.wh}"], "op": "DELETE"})
    assert_error(r, 403)
    assert s3d.objects() == before and s3d.d.client().current_event() == 0


def test_the_fsspec_hook_over_an_s3_warehouse(s3d: S3Daemon) -> None:
    path = s3d.put("db.db/h/part-0", b"version one")
    hooked = CmrootFileSystem(target_protocol="s3", url=s3d.d.url,
                              warehouse_roots=[f"s3://{s3d.wh}"], token=s3d.d.tokens["write"])
    with hooked.open(path, "wb") as f:  # an overwrite: the old bytes are kept first
        f.write(b"version two")
    hooked.rm(path)
    events = s3d.d.client().events(1, 10)
    assert [e["eventType"] for e in events] == ["DELETE", "DELETE"]
    assert s3d.get(path, cks.of_bytes(b"version one")) == b"version one"
    assert s3d.get(path, cks.of_bytes(b"version two")) == b"version two"


def test_an_unreachable_store_is_a_clear_error(tmp_path: Path) -> None:
    env = clean_env({
        "CMROOT_STORE_ROOT": "s3://nowhere/cm",
        "CMROOT_STORE_WAREHOUSE_ROOTS": str(tmp_path / "wh"),
        "CMROOT_INDEX_PATH": str(tmp_path / "var" / "index.sqlite"),
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",  # nothing listens there
        "AWS_MAX_ATTEMPTS": "1",
    })
    r = subprocess.run([sys.executable, "-m", "cmroot.cli", "gc", "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "cannot reach the store at s3://nowhere/cm" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

"""The remote-warehouse backends the conformance classes run against: a store whose one
warehouse root is a fresh bucket, and a client of that bucket's filesystem for the test to
write and inspect with. Paths differ per filesystem (`/{bucket}/k` on fsspec's memory
filesystem, `{bucket}/k` on S3), so tests spell them through `path()` and `url()`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from cmroot import config as cfg
from cmroot.store import Store


@dataclass(frozen=True)
class RemoteWarehouse:
    """A store on `store_root` whose warehouse root is `{protocol}://{bucket}`, and `fs`, a
    client of that filesystem; `root` is the bucket's path on `fs`."""

    store: Store
    fs: Any
    bucket: str
    protocol: str
    root: str

    def path(self, rel: str = "") -> str:
        """`rel` (below the bucket) as a path on `fs`."""
        return f"{self.root}/{rel}" if rel else self.root

    def url(self, rel: str = "") -> str:
        """`rel` as the URL a request names, spelled as the store records it."""
        return f"{self.protocol}://{self.bucket}/{rel}" if rel else f"{self.protocol}://{self.bucket}"

    def write(self, rel: str, data: bytes) -> None:
        with self.fs.open(self.path(rel), "wb") as f:
            f.write(data)

    def read(self, rel: str) -> bytes:
        data: bytes = self.fs.cat_file(self.path(rel))
        return data


def reopen(wh: RemoteWarehouse) -> Store:
    """Close `wh`'s store (as a crash would leave it) and open it again: recovery runs."""
    wh.store.close()
    return _store(Path(wh.store.layout.root), wh.url())


def _bucket() -> str:
    return f"wh-{uuid.uuid4().hex[:8]}"


def _store(store_root: Path, root_url: str) -> Store:
    config = cfg.load(
        None,
        {"CMROOT_STORE_ROOT": str(store_root), "CMROOT_STORE_WAREHOUSE_ROOTS": root_url},
    )
    return Store.open(config)


@contextmanager
def memory_warehouse(store_root: Path) -> Iterator[RemoteWarehouse]:
    """A bucket on fsspec's in-memory filesystem (shared by every client of the process),
    removed afterwards."""
    bucket = _bucket()
    fs = fsspec.filesystem("memory")
    with _store(store_root, f"memory://{bucket}") as store:
        yield RemoteWarehouse(store, fs, bucket, "memory", f"/{bucket}")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


@contextmanager
def s3_warehouse(store_root: Path, fs: Any) -> Iterator[RemoteWarehouse]:
    """A new bucket on the S3 server `fs` talks to, emptied and removed afterwards. The
    store reaches the server through its own s3fs instance (fsspec's global config)."""
    bucket = _bucket()
    fs.mkdir(bucket)
    try:
        with _store(store_root, f"s3://{bucket}") as store:
            yield RemoteWarehouse(store, fs, bucket, "s3", bucket)
    finally:
        fs.rm(bucket, recursive=True)

"""The store backends the store's conformance class (tests/store/test_store_backends.py)
runs against: where the store lives (a local directory, or a prefix of an S3 bucket) and
where its one warehouse root is (a local directory, or another S3 bucket), with a uniform
way for a test to write, read, list and delete warehouse files and store objects.

Paths differ per backend (`/tmp/.../warehouse/k` locally, `bucket/k` on S3, as fsspec
spells them; the store records `/tmp/.../warehouse/k` and `s3://bucket/k`), so tests name
files by their path below the root (`rel`) and spell the store's keys through `url()`.
Every file is read and written through the test's own clients (a local fsspec filesystem,
the tests' s3fs client without listing cache), never through the store's."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from cmroot_testlib import Clock

from cmroot import config as cfg
from cmroot.config import Config
from cmroot.store import Store
from cmroot.store.layout import shard_of
from cmroot.store.layout.local import shard_levels

# Fault points a move recycle passes only on some staging methods (see cmroot.vocab.Method):
# a take (copy, then remove the source once the copy is journaled) and a copy of a move
# (whose source is removed at clean-up, after the commit).
TAKE_ONLY = frozenset({"recycle.copy_journaled", "recycle.source_taken"})
COPY_ONLY = frozenset({"journal.source_removed"})


@dataclass(frozen=True)
class Place:
    """A directory (or bucket prefix) on `fs`, the test's client of its filesystem: `base`
    is its path on `fs`, `url` how the store spells it."""

    fs: Any
    base: str
    url: str
    local: bool

    def path(self, rel: str = "") -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def url_of(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def write(self, rel: str, data: bytes) -> None:
        if self.local:
            os.makedirs(os.path.dirname(self.path(rel)), exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def read(self, rel: str) -> bytes | None:
        """The file's bytes, None if there is none."""
        try:
            data: bytes = self.fs.cat_file(self.path(rel))
        except (FileNotFoundError, IsADirectoryError):
            return None
        return data

    def exists(self, rel: str = "") -> bool:
        """A file or a directory (on S3: a key, or a prefix of one) is there."""
        if self.local:
            return os.path.lexists(self.path(rel))
        return bool(self.fs.exists(self.path(rel)))

    def names(self, rel: str = "") -> list[str]:
        """Every file at or under `rel`, as its path below the place."""
        top = self.path(rel)
        if self.local and not os.path.exists(top):
            return []
        return sorted(p[len(self.base) + 1 :] for p in self.fs.find(top))

    def files(self, rel: str = "") -> dict[str, bytes]:
        """Every file at or under `rel`: {path below the place: bytes}."""
        return {n: self.fs.cat_file(self.path(n)) for n in self.names(rel)}

    def delete(self, rel: str) -> None:
        self.fs.rm_file(self.path(rel))


@dataclass
class StoreBackend:
    """A store on `store_at` with one warehouse root `warehouse`, opened with `clock`.
    `outside` is a place of the warehouse's kind under no root (it holds a file `x`);
    `method` is how a move stages a file there: "rename", "take" or "copy" (a copy of a
    move, its source removed after the commit)."""

    name: str
    warehouse: Place
    store_at: Place
    outside: Place
    method: str
    clock: Clock
    config: Config
    store: Store = field(init=False)

    def __post_init__(self) -> None:
        self.store = Store.open(self.config, clock=self.clock)

    # -- the warehouse ----------------------------------------------------------------------
    def url(self, rel: str = "") -> str:
        """A warehouse file (or the root) as a request names it and the store records it."""
        return self.warehouse.url_of(rel)

    def write(self, rel: str, data: bytes) -> None:
        self.warehouse.write(rel, data)

    def read(self, rel: str) -> bytes | None:
        return self.warehouse.read(rel)

    def exists(self, rel: str) -> bool:
        return self.warehouse.exists(rel)

    def files(self, rel: str = "") -> dict[str, bytes]:
        return self.warehouse.files(rel)

    def delete(self, rel: str) -> None:
        self.warehouse.delete(rel)

    # -- the store --------------------------------------------------------------------------
    def objects(self) -> set[str]:
        """The names (checksums) of the objects in the store."""
        return {rel.rsplit("/", 1)[-1] for rel in self.store_at.names("objects")}

    def object_rel(self, checksum: str) -> str:
        # Local stores made now are one-level; object stores are two-level (see Layout).
        levels = shard_levels(self.store_at.path()) if self.store_at.local else 2
        return f"objects/{shard_of(checksum, levels)}/{checksum}"

    def object_bytes(self, checksum: str) -> bytes | None:
        return self.store_at.read(self.object_rel(checksum))

    def write_object(self, checksum: str, data: bytes) -> None:
        """Overwrite object `checksum`'s bytes in place (rot, or a stray writer)."""
        if self.store_at.local:
            with open(self.store_at.path(self.object_rel(checksum)), "r+b") as f:
                f.truncate(0)
                f.write(data)
        else:
            self.store_at.write(self.object_rel(checksum), data)

    def quarantine(self) -> list[str]:
        """The names in the store's quarantine (`<checksum>.<time>`)."""
        return sorted(rel.rsplit("/", 1)[-1] for rel in self.store_at.names("quarantine"))

    def staging(self) -> list[str]:
        """Whatever is left in the store's staging area (files; locally directories too)."""
        if self.store_at.local:
            top = self.store_at.path("staging")
            return sorted(os.listdir(top)) if os.path.isdir(top) else []
        return self.store_at.names("staging")

    def reopen(self) -> Store:
        """Close the store as a crash leaves it (nothing more runs: no rollback, no
        clean-up; the lock goes with the process) and open it again: recovery runs."""
        self.store.close()
        self.store = Store.open(self.config, clock=self.clock)
        return self.store

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.close()


def _config(store_root: str, warehouse_root: str, work: Path) -> Config:
    return cfg.load(
        None,
        {
            "CMROOT_STORE_ROOT": store_root,
            "CMROOT_STORE_WAREHOUSE_ROOTS": warehouse_root,
            "CMROOT_INDEX_PATH": str(work / "index.sqlite"),
            "CMROOT_STORE_RETAIN": "24h",
        },
    )


def _local(path: Path) -> Place:
    path.mkdir(parents=True, exist_ok=True)
    real = os.path.realpath(path)  # the store records canonical paths
    return Place(fsspec.filesystem("file"), real, real, True)


def _bucket(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@contextmanager
def local_backend(tmp_path: Path, clock: Clock, two_level: bool = False
                  ) -> Iterator[StoreBackend]:
    """A local store directory and a local warehouse directory beside it; `two_level`: a
    store made before LAYOUT files (`objects/ab/cd/<checksum>`)."""
    wh, st, out = _local(tmp_path / "warehouse"), _local(tmp_path / "cmroot"), _local(
        tmp_path / "outside")
    if two_level:
        os.makedirs(st.path("objects"))
    out.write("x", b"outside the roots")
    b = StoreBackend("local", wh, st, out, "rename", clock,
                     _config(st.base, wh.base, tmp_path / "work"))
    try:
        yield b
    finally:
        b.close()


@contextmanager
def s3_store_backend(
    tmp_path: Path, clock: Clock, s3: Any, warehouse_on_s3: bool
) -> Iterator[StoreBackend]:
    """A store at `s3://<bucket>/cm`; its warehouse another bucket of the same server (the
    server-side copy path) or a local directory (the upload path). Buckets are removed
    afterwards."""
    buckets = [_bucket("st")]
    s3.mkdir(buckets[0])
    st = Place(s3, f"{buckets[0]}/cm", f"s3://{buckets[0]}/cm", False)
    try:
        if warehouse_on_s3:
            buckets.append(_bucket("wh"))
            s3.mkdir(buckets[1])
            wh = Place(s3, buckets[1], f"s3://{buckets[1]}", False)
            # Under no root: the store's bucket, beside the store's prefix.
            out = Place(s3, f"{buckets[0]}/elsewhere", f"s3://{buckets[0]}/elsewhere", False)
            method = "take"
        else:
            wh, out = _local(tmp_path / "warehouse"), _local(tmp_path / "outside")
            method = "take"  # nothing is renamed into a remote store: a move takes
        out.write("x", b"outside the roots")
        b = StoreBackend(f"s3-store-{'s3' if warehouse_on_s3 else 'local'}-warehouse", wh, st,
                         out, method, clock, _config(st.url, wh.url, tmp_path / "work"))
        try:
            yield b
        finally:
            b.close()
    finally:
        for bucket in buckets:
            with contextlib.suppress(FileNotFoundError):
                s3.rm(bucket, recursive=True)

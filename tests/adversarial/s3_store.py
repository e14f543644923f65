"""A store in a moto bucket with S3 and local warehouse roots, for the reviews of the
store on an object store: the `s3s` fixture (registered in conftest.py) and a hook that
lands a concurrent actor in a delete's window."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import Clock

from cmroot import config as cfg
from cmroot import faults
from cmroot.store import Store


@dataclass
class S3Store:
    """A store at s3://<st>/cm, warehouse roots s3://<wh> and a local directory."""

    fs: Any  # the tests' own client (no listing cache)
    st: str
    wh: str
    local: Path
    env: dict[str, str]
    clock: Clock
    store: Store

    def put(self, rel: str, data: bytes) -> str:
        self.fs.pipe_file(f"{self.wh}/{rel}", data)
        return f"s3://{self.wh}/{rel}"

    def get(self, rel: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(f"{self.wh}/{rel}"))
        except FileNotFoundError:
            return None

    def obj(self, c: str) -> str:
        return f"{self.st}/cm/objects/{c[:2]}/{c[2:4]}/{c}"

    def reopen(self) -> Store:
        """Close as a crash leaves it and open again: recovery runs."""
        faults.disarm()
        self.store.close()
        self.store = Store.open(cfg.load(None, self.env), clock=self.clock)
        return self.store

    def served(self, path: str, c: str) -> bytes:
        with self.store.open_verified(path, c) as v:
            return os.pread(v.fd, 1 << 24, 0) if v.data is None else v.data


@pytest.fixture
def s3s(tmp_path: Path, s3_client: Any) -> Iterator[S3Store]:
    st, wh = f"st-{uuid.uuid4().hex[:10]}", f"wh-{uuid.uuid4().hex[:10]}"
    s3_client.mkdir(st)
    s3_client.mkdir(wh)
    (tmp_path / "lw").mkdir()
    env = {
        "CMROOT_STORE_ROOT": f"s3://{st}/cm",
        "CMROOT_STORE_WAREHOUSE_ROOTS": f"s3://{wh},{tmp_path / 'lw'}",
        "CMROOT_INDEX_PATH": str(tmp_path / "idx" / "index.sqlite"),
        "CMROOT_STORE_RETAIN": "1h",
    }
    clock = Clock()
    s = S3Store(s3_client, st, wh, tmp_path / "lw", env, clock,
                Store.open(cfg.load(None, env), clock=clock))
    try:
        yield s
    finally:
        faults.disarm()
        with contextlib.suppress(Exception):
            s.store.close()
        for b in (st, wh):
            with contextlib.suppress(Exception):
                s3_client.rm(b, recursive=True)


def hook_delete(monkeypatch: pytest.MonkeyPatch, fs: Any, path: str,
                 before: Any) -> list[bool]:
    """Run `before()` just before the first delete of `path`, whichever call makes it
    (`rm_file`, or a `DeleteObject` through `call_s3`)."""
    fired: list[bool] = []
    real_rm, real_call = fs.rm_file, fs.call_s3

    def once(p: str) -> None:
        if not fired and fs._strip_protocol(p).lstrip("/") == path:
            fired.append(True)
            before()

    def rm_file(p: str, *a: Any, **kw: Any) -> Any:
        once(p)
        return real_rm(p, *a, **kw)

    def call_s3(method: str, *a: Any, **kw: Any) -> Any:
        if method == "delete_object":
            once(f"{kw['Bucket']}/{kw['Key']}")
        return real_call(method, *a, **kw)

    monkeypatch.setattr(fs, "rm_file", rm_file)
    monkeypatch.setattr(fs, "call_s3", call_s3)
    return fired

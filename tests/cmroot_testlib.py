"""Helpers for the core suite (imported by tests as `cmroot_testlib`; fixtures live in
conftest.py). A uniquely named module rather than `from conftest import ...`, which breaks
as soon as another test directory has its own conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sqlite3
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cmroot import checksum as cks
from cmroot import config as cfgmod
from cmroot import faults
from cmroot.config import Config
from cmroot.store import Store
from cmroot.store.layout import shard_of
from cmroot.store.layout.local import shard_levels

T0 = 1_700_000_000.0
INDEX_TABLES = ("objects", "entries", "events", "txs", "journal")


class Clock:
    """The daemon's one clock, under the test's control."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t

    def set(self, t: float) -> None:
        self.t = t


@dataclass
class Env:
    """A warehouse root, a store root beside it, a directory outside both, and a clock."""

    base: Path
    warehouse: Path
    store_root: Path
    outside: Path
    clock: Clock
    overrides: dict[str, str] = field(default_factory=dict)
    _open: list[Store] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "CMROOT_STORE_ROOT": str(self.store_root),
            "CMROOT_STORE_WAREHOUSE_ROOTS": str(self.warehouse),
            "CMROOT_STORE_RETAIN": "24h",
        }
        env.update(self.overrides)
        env.update(extra)
        return env

    def config(self, **extra: str) -> Config:
        return cfgmod.load(None, env=self.env(**extra))

    def open(self, readonly: bool = False, **extra: str) -> Store:
        store = Store.open(self.config(**extra), clock=self.clock, readonly=readonly)
        self._open.append(store)
        return store

    def close_all(self) -> None:
        for s in self._open:
            with contextlib.suppress(Exception):
                s.close()
        self._open.clear()

    @property
    def index_path(self) -> Path:
        return self.store_root / "index.sqlite"

    @property
    def objects_dir(self) -> Path:
        return self.store_root / "objects"

    def object_path(self, checksum: str) -> Path:
        return object_file(self.store_root, checksum)

    @property
    def staging_dir(self) -> Path:
        return self.store_root / "staging"


def object_file(store_root: Path | str, checksum: str) -> Path:
    """Where the local store at `store_root` keeps object `checksum` (its LAYOUT says)."""
    return Path(store_root, "objects", shard_of(checksum, shard_levels(str(store_root))),
                checksum)


# -- building tables ----------------------------------------------------------------------


def random_bytes(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def write_file(path: Path | str, data: bytes) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def make_table(
    warehouse: Path,
    db: str,
    table: str,
    partitions: Sequence[Mapping[str, str]] = ({"p": "1"}, {"p": "2"}),
    files_per_partition: int = 3,
    size: int | tuple[int, int] = (1, 4096),
    rng: random.Random | None = None,
    contents: Sequence[bytes] | None = None,
) -> dict[str, bytes]:
    """Lay out `<warehouse>/<db>.db/<table>/<k=v>/.../part-NNNNN.parquet` files of random
    bytes (or of `contents`, reused round-robin). Returns {absolute path: bytes}. An empty
    `partitions` gives an unpartitioned table."""
    rng = rng or random.Random(f"{db}.{table}")
    tdir = table_dir(warehouse, db, table)
    tdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, bytes] = {}
    parts = list(partitions) or [{}]
    n = 0
    for part in parts:
        pdir = tdir.joinpath(*[f"{k}={v}" for k, v in part.items()])
        for i in range(files_per_partition):
            if contents is not None:
                data = contents[n % len(contents)]
            else:
                lo, hi = (size, size) if isinstance(size, int) else size
                data = random_bytes(rng, rng.randint(lo, hi))
            n += 1
            out[str(write_file(pdir / f"part-{i:05d}.parquet", data))] = data
    return out


def table_dir(warehouse: Path, db: str, table: str) -> Path:
    return warehouse / f"{db}.db" / table


def pairs_of(files: Mapping[str, bytes]) -> list[dict[str, str]]:
    return [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]


# -- inspecting state ------------------------------------------------------------------------


def index_counts(env: Env) -> dict[str, int]:
    """Row counts of the index's durable tables, read through a separate connection."""
    if not env.index_path.exists():
        return dict.fromkeys(INDEX_TABLES, 0)
    con = sqlite3.connect(f"file:{env.index_path}?mode=ro", uri=True)
    try:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in INDEX_TABLES}
    finally:
        con.close()


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`: directories as 'dir', symlinks by target, files by digest."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            out[p] = "link->" + os.readlink(p) if os.path.islink(p) else "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[p] = "link->" + os.readlink(p)
            elif not stat.S_ISREG(st.st_mode):
                out[p] = f"special:{stat.S_IFMT(st.st_mode)}"  # never open a fifo
            else:
                with open(p, "rb") as fh:
                    out[p] = hashlib.sha256(fh.read()).hexdigest()
    return out


def snapshot(env: Env) -> dict[str, object]:
    """Warehouse, outside dir and store objects on disk, plus index row counts."""
    return {
        "warehouse": tree(env.warehouse),
        "outside": tree(env.outside),
        "objects": tree(env.objects_dir),
        "staging": tree(env.staging_dir),
        "index": index_counts(env),
    }


def object_files(env: Env) -> list[Path]:
    return sorted(p for p in env.objects_dir.rglob("*") if p.is_file())


def tables_of(
    env: Env, names: Sequence[str], contents: Sequence[bytes]
) -> dict[str, dict[str, bytes]]:
    """Tables db.<name>, each holding one file `part-<i>` per content (the same bytes in
    every table): {table: {path: bytes}}."""
    out: dict[str, dict[str, bytes]] = {}
    for name in names:
        d = env.warehouse / "db.db" / name
        d.mkdir(parents=True)
        out[name] = {}
        for i, data in enumerate(contents):
            (d / f"part-{i}").write_bytes(data)
            out[name][str(d / f"part-{i}")] = data
    return out


def objects_sharing_inodes(env: Env) -> list[Path]:
    """Store objects that are hard links of a warehouse file (a write there would change
    them): always a bug."""
    wh = set()
    for dirpath, _, names in os.walk(env.warehouse):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            wh.add((st.st_dev, st.st_ino))
    return [p for p in object_files(env) if (os.stat(p).st_dev, os.stat(p).st_ino) in wh]


def assert_objects_match_names(env: Env) -> None:
    """Invariant 3 on disk: every object's bytes hash to its name, at its sharded path."""
    for p in object_files(env):
        c = p.name
        assert cks.of_local_file(str(p)) == c, f"object {p} does not hash to its name"
        assert p == object_file(env.store_root, c), f"{p} is mis-sharded"


def assert_retrievable(store: Store, files: Mapping[str, bytes], status: str | None = None) -> None:
    """Every (path, checksum) resolves (with `status` if given) and `open_verified` serves
    exactly the original bytes."""
    pairs = pairs_of(files)
    res = store.resolve(pairs)
    assert [r.path for r in res] == [p["path"] for p in pairs]
    for r in res:
        assert r.status in ("original", "cmroot"), f"{r.path} is {r.status}"
        if status is not None:
            assert r.status == status, f"{r.path} is {r.status}, expected {status}"
    for path, data in files.items():
        with store.open_verified(path, cks.of_bytes(data)) as v:
            if status is not None:
                assert v.status == status
            assert os.pread(v.fd, len(data) + 1, 0) == data, f"wrong bytes served for {path}"
            assert v.size == len(data)


def on_point(
    monkeypatch: pytest.MonkeyPatch, name: str, fn: Callable[[], None], k: int = 1
) -> None:
    """Run `fn` (a racing writer, or a failure) the k-th time execution passes fault
    point `name`, then go on as the real point would."""
    real = faults.point
    seen = {"n": 0}

    def point(n: str) -> None:
        if n == name:
            seen["n"] += 1
            if seen["n"] == k:
                fn()
        real(n)

    monkeypatch.setattr(faults, "point", point)


@contextmanager
def held_at(monkeypatch: pytest.MonkeyPatch, point: str, work: Callable[[], object]
            ) -> Iterator[None]:
    """Run `work` in a thread that stops at fault point `point` until the block ends."""
    reached, release = threading.Event(), threading.Event()
    real = faults.point

    def pausing(name: str) -> None:
        if name == point and not reached.is_set():
            reached.set()
            release.wait(30)
        real(name)

    monkeypatch.setattr(faults, "point", pausing)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert reached.wait(30), f"{point} never reached"
    try:
        yield
    finally:
        release.set()
        t.join(60)
    assert not errors, errors


@contextmanager
def bind_mount(real: Path, target: Path) -> Iterator[None]:
    """`target` as a bind mount of the directory `real` (same st_dev, yet rename() across
    them fails with EXDEV); the test is skipped where that cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root (mount --bind); run the suite as root to cover it")
    real.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(real), str(target)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount --bind refused here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def as_user(uid: int, gid: int, groups: list[int], fn: Callable[[], bytes]) -> bytes:
    """fn()'s bytes, run in a forked child as uid/gid with supplementary `groups` (needs
    root). A fork, not a new interpreter: the test's Python may live where that uid cannot
    execute it, and what fn needs is imported already. A failure in the child fails the
    caller, with the child's error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:
            out, code = f"child failed: {type(e).__name__}: {e}".encode(), 1
        try:
            os.write(w, out)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, out
    return out

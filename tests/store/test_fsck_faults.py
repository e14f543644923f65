"""fsck never destroys what it could not read. An object or a shard directory that cannot
be read (EACCES, EIO, ...) is reported under `unreadable` with its error, is never
quarantined, and `--repair` keeps its index rows.

Real faults: permissions (chmod 000). Root ignores file permissions through
CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so when the tests run as root the `cmroot fsck`
subprocess is started with those two capabilities dropped from its bounding set
(`setpriv --bounding-set=-dac_override,-dac_read_search`): it is still uid 0, owns the
files, and gets a genuine EACCES from the kernel. EIO cannot be produced on demand here
(no FUSE, no loop devices or device-mapper in the sandbox), so it is injected
deterministically in process, on the open(2) of one object or the listing of one shard.
The CLI tests also check what `cmroot fsck` prints and its exit codes."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cmroot_testlib import make_table, snapshot, table_dir, write_file

from cmroot import checksum as cks
from cmroot.store import RecycleRequest, Store

REPO = Path(__file__).resolve().parents[2]
DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def recycled(env, store: Store, n: int = 4) -> dict[str, bytes]:
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=n)
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))], op="DROP_TABLE"))
    return files


def obj(env, c: str) -> Path:
    return env.object_path(c)


def quarantine(env) -> list[str]:
    q = env.store_root / "quarantine"
    return sorted(os.listdir(q)) if q.exists() else []


def entries_of(store: Store, c: str) -> list[str]:
    return sorted(e.path for e in store.index.entries(checksum=c))


def _cli_env(env) -> dict[str, str]:
    out = {
        k: v for k, v in os.environ.items()
        if not k.startswith("CMROOT_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out.update(env.env())
    return out


def _privilege_prefix() -> list[str]:
    """How to run a process that file permissions apply to."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root (permissions are not enforced) and setpriv is missing")
    probe = subprocess.run([*DROP_DAC, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and cannot drop CAP_DAC_OVERRIDE: {probe.stderr!r}")
    return DROP_DAC


def fsck_cli(env, *args: str) -> subprocess.CompletedProcess[str]:
    env.close_all()  # the CLI takes the store's lock
    return subprocess.run(
        [*_privilege_prefix(), sys.executable, "-m", "cmroot.cli", "fsck", *args],
        env=_cli_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def fsck_json(env, *args: str, code: int) -> dict[str, Any]:
    p = fsck_cli(env, "--json", *args)
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr
    out: dict[str, Any] = json.loads(p.stdout)
    return out


@pytest.fixture
def chmod_000() -> Iterator[list[Path]]:
    """Paths to make unreadable (mode 000), restored afterwards so tmp clean-up works."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def _deny(chmod_000: list[Path], p: Path) -> None:
    chmod_000.append(p)
    os.chmod(p, 0)


# -- real faults: permissions --------------------------------------------------------------


def test_an_unreadable_object_is_reported_kept_and_keeps_its_rows(env, store, chmod_000) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    _deny(chmod_000, obj(env, c))

    for args in ([], ["--repair"]):
        r = fsck_json(env, *args, code=1)  # a person must look, even after --repair
        assert r["unreadable"] == [{"path": str(obj(env, c)), "error": "EACCES: Permission denied"}]
        assert (r["corrupt"], r["missing"], r["unindexed"]) == ([], [], [])
        assert r["checked"] == len(files) - 1 and r["clean"] is False
    store = env.open()
    assert entries_of(store, c) == [path] and store.index.get_object(c) is not None
    assert quarantine(env) == []
    os.chmod(obj(env, c), 0o644)
    assert obj(env, c).read_bytes() == data
    assert store.fsck().clean


def test_an_unreadable_shard_directory_is_reported_and_its_rows_kept(
    env, store, chmod_000
) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    shard = obj(env, c).parent
    in_shard = {p for p, b in files.items() if obj(env, cks.of_bytes(b)).parent == shard}
    _deny(chmod_000, shard)

    r = fsck_json(env, "--repair", code=1)
    assert r["unreadable"] == [{"path": str(shard), "error": "EACCES: Permission denied"}]
    assert (r["corrupt"], r["missing"], r["stray"]) == ([], [], [])
    assert r["checked"] == len(files) - len(in_shard)
    os.chmod(shard, 0o755)
    store = env.open()
    assert entries_of(store, c) == [path]
    assert obj(env, c).read_bytes() == data and quarantine(env) == []
    assert store.fsck().clean


def test_an_unreadable_top_level_directory_keeps_every_row_under_it(
    env, store, chmod_000
) -> None:
    files = recycled(env, store)
    c = cks.of_bytes(sorted(files.values())[0])
    top = env.objects_dir / c[:2]
    _deny(chmod_000, top)
    r = fsck_json(env, "--repair", code=1)
    assert r["unreadable"] == [{"path": str(top), "error": "EACCES: Permission denied"}]
    assert r["missing"] == []
    os.chmod(top, 0o755)
    assert env.open().fsck().clean


def test_cmroot_fsck_prints_a_summary_and_what_to_do(env, store, chmod_000) -> None:
    files = recycled(env, store)
    c = cks.of_bytes(sorted(files.values())[0])
    _deny(chmod_000, obj(env, c))
    extra = b"unknown to the index"
    write_file(obj(env, cks.of_bytes(extra)), extra)

    p = fsck_cli(env)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    out = p.stdout
    assert f"checked {len(files)} objects in " in out
    assert "1 unindexed" in out and "1 unreadable" in out
    assert f"{obj(env, c)}: EACCES: Permission denied" in out
    assert "index rows kept" in out and "--repair registers" in out
    p = fsck_cli(env, "--quiet", "--repair")
    assert p.returncode == 1 and "registered" in p.stdout and p.stderr == ""


def test_a_clean_store_prints_clean_and_exits_0(env, store) -> None:
    recycled(env, store)
    p = fsck_cli(env)
    assert p.returncode == 0 and p.stdout.strip().endswith(": clean"), (p.stdout, p.stderr)
    r = fsck_json(env, code=0)
    assert r["clean"] is True and r["counts"]["unreadable"] == 0


def test_cmroot_fsck_lists_quarantined_transactions_with_what_to_do(env, store) -> None:
    recycled(env, store, n=2)
    # A transaction whose rollback fails at every open: its source is outside the roots.
    txid = "0123456789abcdef0123456789abcdef"
    staged = write_file(env.staging_dir / txid / "0", b"a file waiting for its rollback")
    source = str(env.outside / "gone.parquet")
    store.index.journal_begin(
        txid, store.clock(), "move", {"op": "DROP_TABLE", "paths": [source]}, [],
        [(0, source, str(staged), "rename")],
    )
    store.index.quarantine_tx(txid, "stuck")

    r = fsck_json(env, "--repair", code=1)  # nothing --repair can do: a person must look
    (tx,) = r["quarantined_transactions"]
    assert (tx["txid"], tx["state"], tx["files"]) == (txid, "quarantined", 1)
    assert tx["error"] and r["stray"] == [] and r["clean"] is False
    assert staged.exists()

    p = fsck_cli(env)
    assert p.returncode == 1, p.stderr
    assert "recycle transactions recovery could not finish" in p.stdout
    assert txid in p.stdout and "what to do" in p.stdout and "restart the daemon" in p.stdout
    assert staged.read_bytes() == b"a file waiting for its rollback"


# -- injected faults: EIO ------------------------------------------------------------------


def _eio_on_open(monkeypatch, target: Path) -> None:
    """open(2) of `target` fails with EIO, whichever Python call makes it."""
    real_os_open, real_open = os.open, builtins.open

    def fail(path: Any) -> None:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(target):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(target))

    def os_open(path: Any, *a: Any, **k: Any) -> int:
        fail(path)
        return real_os_open(path, *a, **k)

    def b_open(file: Any, *a: Any, **k: Any) -> Any:
        fail(file)
        return real_open(file, *a, **k)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", b_open)


def test_an_object_failing_with_eio_is_never_quarantined_nor_forgotten(
    env, store, monkeypatch
) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[1]
    c = cks.of_bytes(data)
    before = snapshot(env)
    _eio_on_open(monkeypatch, obj(env, c))

    r = store.fsck(repair=True)
    assert r.unreadable == [{"path": str(obj(env, c)), "error": "EIO: Input/output error"}]
    assert (r.corrupt, r.missing, r.unindexed) == ([], [], []) and not r.clean
    assert r.checked == len(files) - 1
    monkeypatch.undo()
    assert snapshot(env) == before  # nothing moved, nothing forgotten
    assert entries_of(store, c) == [path]
    assert store.fsck().clean


def test_a_shard_directory_failing_with_eio_keeps_its_rows(env, store, monkeypatch) -> None:
    files = recycled(env, store)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    shard = obj(env, c).parent
    real = os.scandir

    def scandir(p: Any = ".") -> Any:
        if os.fspath(p) == str(shard):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(shard))
        return real(p)

    before = snapshot(env)
    monkeypatch.setattr(os, "scandir", scandir)
    r = store.fsck(repair=True)
    assert r.unreadable == [{"path": str(shard), "error": "EIO: Input/output error"}]
    monkeypatch.undo()
    assert r.missing == [] and snapshot(env) == before
    assert entries_of(store, c) == [path]
    assert store.fsck().clean


def test_a_repair_the_filesystem_refuses_is_reported_and_keeps_the_rows(env, store) -> None:
    files = recycled(env, store, n=2)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    obj(env, c).write_bytes(b"rotten")
    (env.store_root / "quarantine").write_bytes(b"a file where the quarantine goes")

    r = store.fsck(repair=True)  # does not stop at the first refusal
    assert r.corrupt == [c] and r.missing == []
    (u,) = r.unreadable
    assert u["path"] == str(obj(env, c)) and u["error"].startswith("repair: EEXIST")
    assert obj(env, c).read_bytes() == b"rotten" and entries_of(store, c) == [path]

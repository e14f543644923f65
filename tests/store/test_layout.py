"""Where a local store keeps its objects: `objects/ab/<checksum>` in a store made now (its
LAYOUT file says so), `objects/ab/cd/<checksum>` in one made before LAYOUT files, which
stays so across upgrades. A LAYOUT this cmroot does not know is refused before anything
is written. Objects found at the other layout's place (a downgrade, then an upgrade) are
read, swept and quarantined there, and moved to their place by fsck --repair. Every
invariant test also runs on both layouts (test_store_backends' TestLocalTwoLevelStore,
test_fsck's `env`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from cmroot_testlib import (
    Env,
    assert_objects_match_names,
    assert_retrievable,
    make_table,
    object_files,
    pairs_of,
    table_dir,
)

from cmroot import checksum as cks
from cmroot.exceptions import ConfigError
from cmroot.store import Quarantined, RecycleRequest, Store
from cmroot.store.layout import shard_of
from cmroot.store.layout.local import LAYOUT_FILE, shard_levels
from tests.test_cli import cmroot


def dirs_below(top: Path) -> list[Path]:
    return sorted(p for p in top.rglob("*") if p.is_dir())


def drop(env: Env, store: Store, table: str, n: int) -> dict[str, bytes]:
    files = make_table(env.warehouse, "db", table, [{"p": "1"}], files_per_partition=n)
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", table))],
                                 op="DROP_TABLE", db="db", table=table))
    return files


def test_a_new_store_is_one_level_and_says_so(env: Env) -> None:
    store = env.open()
    assert (env.store_root / LAYOUT_FILE).read_text() == "objects/ab/<checksum>\n"
    files = drop(env, store, "t", 600)
    shards = dirs_below(env.objects_dir)
    # 600 objects over at most 256 directories, none below another
    assert 0 < len(shards) <= 256
    assert all(p.parent == env.objects_dir and len(p.name) == 2 for p in shards)
    assert_objects_match_names(env)
    assert_retrievable(store, files, status="cmroot")
    assert store.fsck().clean


def test_a_store_made_before_layout_files_stays_two_level(env: Env) -> None:
    """A store with `objects/` and no LAYOUT (every store before this release): its
    objects stay at ab/cd, old and new alike, and nothing is written to say so."""
    old = env.open()
    (env.store_root / LAYOUT_FILE).unlink()  # as the release before wrote it: no LAYOUT
    old.close()
    legacy = env.objects_dir / "00" / "11"
    legacy.mkdir(parents=True)  # an old shard directory, left empty by a sweep
    store = env.open()
    files = drop(env, store, "t", 40)
    store.close()
    store = env.open(readonly=True)
    assert not (env.store_root / LAYOUT_FILE).exists()
    assert all(len(p.relative_to(env.objects_dir).parts) == 3
               for p in env.objects_dir.rglob("*") if p.is_file())
    assert_objects_match_names(env)
    assert_retrievable(store, files, status="cmroot")
    assert store.fsck().clean


def test_an_interrupted_creation_is_one_level(env: Env) -> None:
    """LAYOUT is durable before `objects/` exists: a crash in between leaves LAYOUT alone,
    which still says one level (never a one-level store read as two-level)."""
    env.store_root.mkdir()
    assert shard_levels(str(env.store_root)) == 1
    assert not env.objects_dir.exists()
    store = env.open()
    files = drop(env, store, "t", 5)
    assert all(p.parent.parent == env.objects_dir
               for p in env.objects_dir.rglob("*") if p.is_file())
    assert_retrievable(store, files, status="cmroot")


def test_concurrent_openers_of_a_new_store_agree(env: Env) -> None:
    env.store_root.mkdir()
    got: list[int | BaseException] = []
    start = threading.Barrier(8)

    def open_it() -> None:
        start.wait()
        try:
            got.append(shard_levels(str(env.store_root)))
        except BaseException as e:  # reported by the assertion below
            got.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [1] * 8
    assert sorted(os.listdir(env.store_root)) == [LAYOUT_FILE]  # no temporary left


@pytest.mark.parametrize("said", ["objects/<checksum>", "v9", "\xff\xfe"])
def test_an_unknown_layout_is_refused_and_nothing_is_written(env: Env, said: str) -> None:
    env.store_root.mkdir()
    (env.store_root / LAYOUT_FILE).write_bytes(said.encode("latin-1"))
    with pytest.raises(ConfigError, match=LAYOUT_FILE) as e:
        env.open()
    assert "objects/ab/<checksum>" in str(e.value)
    untouched(env, said.encode("latin-1"))


def untouched(env: Env, said: bytes) -> None:
    """Nothing of the store was made (the index's file is opened before the layout is
    read, as for any refused store), and LAYOUT is as it was."""
    assert not {"objects", "staging"} & set(os.listdir(env.store_root))
    assert (env.store_root / LAYOUT_FILE).read_bytes() == said


def test_the_cli_names_an_unknown_layout_in_one_line(env: Env) -> None:
    env.store_root.mkdir()
    (env.store_root / LAYOUT_FILE).write_text("objects/a/b/c/<checksum>\n")
    p = cmroot("fsck", env=env.env())
    err = p.stderr.decode()
    assert p.returncode != 0 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and str(env.store_root / LAYOUT_FILE) in err, err
    untouched(env, b"objects/a/b/c/<checksum>\n")


def other_place(env: Env, c: str) -> Path:
    levels = shard_levels(str(env.store_root))
    return env.objects_dir / shard_of(c, 3 - levels) / c


def move_to_other_level(env: Env, c: str) -> Path:
    """Put object `c` where a release that knew no LAYOUT file (or a newer one, for a
    two-level store) would have: the other layout's place."""
    dest = other_place(env, c)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(env.object_path(c), dest)
    return dest


@pytest.fixture(params=[1, 2], ids=["one-level", "two-level"])
def leveled(request: pytest.FixtureRequest, env: Env) -> Env:
    if request.param == 2:
        (env.store_root / "objects").mkdir(parents=True)
    return env


def test_objects_at_the_other_level_are_served_swept_and_moved_home(leveled: Env) -> None:
    env = leveled
    store = env.open()
    files = drop(env, store, "t", 6)
    sums = sorted({cks.of_bytes(b) for b in files.values()})
    moved = {c: move_to_other_level(env, c) for c in sums[:3]}
    # read where they are: resolve answers their real place, reads verify them there
    by_sum = {r.checksum: r for r in store.resolve(pairs_of(files))}
    for c, where in moved.items():
        assert by_sum[c].status == "cmroot" and by_sum[c].location == str(where)
    assert_retrievable(store, files, status="cmroot")
    # fsck: misplaced, never missing; --repair moves them to their place, rows kept
    report = store.fsck()
    assert report.counts["missing"] == 0 and report.counts["stray"] == 0, report.to_json()
    assert {m["checksum"] for m in report.misplaced} == set(moved)
    assert store.fsck(repair=True).counts["missing"] == 0
    assert all(env.object_path(c).exists() and not w.exists() for c, w in moved.items())
    assert_objects_match_names(env)
    assert store.fsck().clean


def test_an_expired_object_at_the_other_level_is_swept(leveled: Env) -> None:
    env = leveled
    store = env.open()
    files = drop(env, store, "t", 4)
    moved = [move_to_other_level(env, c) for c in sorted({cks.of_bytes(b)
                                                          for b in files.values()})[:2]]
    env.clock.advance(2 * 86400)
    assert store.gc().removed_objects == 4
    assert not any(p.exists() for p in moved) and object_files(env) == []


def test_a_corrupt_object_at_the_other_level_is_quarantined_from_there(leveled: Env) -> None:
    env = leveled
    store = env.open()
    files = drop(env, store, "t", 2)
    path, data = sorted(files.items())[0]
    c = cks.of_bytes(data)
    where = move_to_other_level(env, c)
    where.write_bytes(b"rot" + data[3:])
    with pytest.raises(Quarantined):
        store.open_verified(path, c)
    assert not where.exists()
    assert [p.name.split(".")[0] for p in (env.store_root / "quarantine").iterdir()] == [c]

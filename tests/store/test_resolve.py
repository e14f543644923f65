"""Resolve and open_verified: per pair `original` / `cmroot` / `missing`, in request order, for
thousands of pairs per call; originals' checksums cached by (path, identity)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from cmroot_testlib import assert_retrievable, make_table, pairs_of, table_dir, write_file

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest, NotFound
from cmroot.store import RecycleRequest, Store, read
from cmroot.store.resolve import MAX_PAIRS


class CountingHash:
    """Wraps cmroot.checksum.of_fd (what resolve and open_verified hash files with, from
    the descriptor they opened) and of_file, and counts the files they read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real, real_fd = cks.of_file, cks.of_fd

        def of_file(fs, path):
            self.paths.append(path)
            return real(fs, path)

        def of_fd(fd):
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            return real_fd(fd)

        monkeypatch.setattr(cks, "of_file", of_file)
        monkeypatch.setattr(cks, "of_fd", of_fd)

    def take(self) -> list[str]:
        out, self.paths = self.paths, []
        return out


def test_checksum_cache_skips_unchanged_originals_and_rehashes_changed_ones(
    env, store, monkeypatch
) -> None:
    monkeypatch.setattr(read, "RACY_NS", 0)  # files written a moment ago count as settled
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=5)
    pairs = pairs_of(files)
    hashed = CountingHash(monkeypatch)

    assert {r.status for r in store.resolve(pairs)} == {"original"}
    assert sorted(hashed.take()) == sorted(files)  # the first resolve reads every file
    assert {r.status for r in store.resolve(pairs)} == {"original"}
    assert hashed.take() == []  # the second reads none
    with store.open_verified(pairs[0]["path"], pairs[0]["checksum"]) as v:
        assert v.status == "original" and hashed.take() == []

    p_size, p_mtime, p_same = sorted(files)[:3]
    # size change: new bytes appended
    with open(p_size, "ab") as f:
        f.write(b"more")
    # same size, other bytes, mtime moved on
    st = os.stat(p_mtime)
    Path(p_mtime).write_bytes(bytes(b ^ 1 for b in files[p_mtime]))
    os.utime(p_mtime, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    # same bytes rewritten with a new mtime: re-hashed, still original
    st = os.stat(p_same)
    os.utime(p_same, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))

    res = {r.path: r.status for r in store.resolve(pairs)}
    assert sorted(hashed.take()) == sorted([p_size, p_mtime, p_same])
    assert res[p_size] == "missing" and res[p_mtime] == "missing"
    assert res[p_same] == "original"
    assert all(res[p] == "original" for p in files if p not in (p_size, p_mtime, p_same))
    # and the new state is cached in turn
    store.resolve(pairs)
    assert hashed.take() == []


def test_a_readonly_store_answers_without_writing_the_cache(env, store, monkeypatch) -> None:
    files = make_table(env.warehouse, "db", "t", [{}], files_per_partition=3)
    hashed = CountingHash(monkeypatch)
    ro = env.open(readonly=True)
    for _ in range(2):
        assert {r.status for r in ro.resolve(pairs_of(files))} == {"original"}
        assert len(hashed.take()) == 3


def test_a_batch_of_thousands_mixing_original_cmroot_and_missing(env, store, clock) -> None:
    rng = random.Random(5)
    parts = [{"p": str(i)} for i in range(10)]
    kept = make_table(
        env.warehouse, "db", "kept", parts, files_per_partition=100, size=(0, 512), rng=rng
    )
    gone = make_table(
        env.warehouse, "db", "gone", parts, files_per_partition=100, size=(0, 512), rng=rng
    )
    store.recycle(
        RecycleRequest(
            paths=[str(table_dir(env.warehouse, "db", "gone"))],
            op="DROP_TABLE",
            db="db",
            table="gone",
        )
    )
    never = [
        {
            "path": str(env.warehouse / "db.db" / "never" / f"f{i}"),
            "checksum": cks.of_bytes(str(i).encode()),
        }
        for i in range(500)
    ]
    wrong = [{"path": p, "checksum": cks.of_bytes(b + b"x")} for p, b in list(kept.items())[:500]]
    want = (
        [(x, "original") for x in pairs_of(kept)]
        + [(x, "cmroot") for x in pairs_of(gone)]
        + [(x, "missing") for x in never + wrong]
    )
    rng.shuffle(want)
    assert len(want) == 3000

    res = store.resolve([x for x, _ in want])
    assert len(res) == len(want)
    for r, (pair, status) in zip(res, want, strict=True):
        assert (r.path, r.checksum) == (pair["path"], pair["checksum"])  # request order
        assert r.status == status, r
        if status == "original":
            assert r.location == r.path and r.size == len(kept[r.path])
        elif status == "cmroot":
            c = r.checksum
            assert r.location == str(env.object_path(c))
            assert r.size == len(gone[r.path])
            with open(r.location, "rb") as f:
                assert f.read() == gone[r.path]
        else:
            assert r.location is None and r.size is None
            assert r.to_json()["status"] == "missing"


def test_duplicate_pairs_each_get_an_answer(env, store) -> None:
    [(p, b)] = make_table(env.warehouse, "db", "t", [{}], files_per_partition=1).items()
    pair = {"path": p, "checksum": cks.of_bytes(b)}
    assert [r.status for r in store.resolve([pair, pair, pair])] == ["original"] * 3


def test_original_wins_while_it_still_holds_the_bytes(env, store) -> None:
    data = b"x" * 100
    p = str(write_file(env.warehouse / "t" / "f", data))
    store.recycle(RecycleRequest(paths=[p], mode="copy", op="INSERT_OVERWRITE"))
    c = cks.of_bytes(data)
    assert store.resolve([{"path": p, "checksum": c}])[0].status == "original"
    with store.open_verified(p, c) as v:
        assert v.status == "original"
    Path(p).write_bytes(b"overwritten")
    assert store.resolve([{"path": p, "checksum": c}])[0].status == "cmroot"
    with store.open_verified(p, c) as v:
        assert v.status == "cmroot"
        assert os.pread(v.fd, 1000, 0) == data
    with store.open_verified(p, cks.of_bytes(b"overwritten")) as v:
        assert v.status == "original"


def test_a_recorded_pair_whose_object_is_gone_is_missing(env, store) -> None:
    data = b"y" * 10
    p = str(write_file(env.warehouse / "t" / "f", data))
    store.recycle(RecycleRequest(paths=[p], op="DELETE"))
    c = cks.of_bytes(data)
    os.unlink(env.object_path(c))
    assert store.resolve([{"path": p, "checksum": c}])[0].status == "missing"
    with pytest.raises(NotFound):
        store.open_verified(p, c)


def test_directories_and_missing_parents_are_not_originals(env, store) -> None:
    d = env.warehouse / "db.db" / "t"
    d.mkdir(parents=True)
    f = write_file(d / "file", b"z")
    c = cks.of_bytes(b"")
    res = store.resolve(
        [
            {"path": str(d), "checksum": c},
            {"path": str(f / "below-a-file"), "checksum": c},
            {"path": str(env.warehouse / "no" / "such" / "dir"), "checksum": c},
        ]
    )
    assert [r.status for r in res] == ["missing"] * 3


def test_empty_and_oversized_batches(env, store) -> None:
    assert store.resolve([]) == []
    with pytest.raises(BadRequest, match="too many"):
        store.resolve([{"path": "/x", "checksum": "0" * 32}] * (MAX_PAIRS + 1))


def test_retrieval_after_recycle_round_trip(env, store: Store) -> None:
    files = make_table(
        env.warehouse, "db", "t", [{"p": "1"}, {"p": "2"}], files_per_partition=4, size=(0, 200_000)
    )
    store.recycle(RecycleRequest(paths=[str(table_dir(env.warehouse, "db", "t"))], op="DROP_TABLE"))
    assert_retrievable(store, files, status="cmroot")


def test_a_batch_answers_each_pair_as_it_would_be_answered_alone(env, store) -> None:
    """Originals are looked up a directory at a time: every odd entry a batch can hold
    (a symlink to a file or a directory in the roots, a FIFO, a directory, a missing
    parent, the root, duplicates, files of many directories in any order) gets the
    answer it gets alone."""
    wh = Path(env.warehouse)
    outside = wh.parent / "beyond-the-roots"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    files = {}
    for d in ("a", "b", "b/c", "lnkdir-target"):
        for i in range(3):
            p = wh / "db.db" / d / f"f{i}"
            write_file(str(p), f"{d}{i}".encode())
            files[str(p)] = cks.of_bytes(f"{d}{i}".encode())
    base = wh / "db.db"
    os.symlink(base / "a" / "f0", base / "a" / "to-file")
    os.symlink(base / "lnkdir-target", base / "lnkdir")
    os.symlink(outside, base / "out")
    os.symlink(outside / "secret", base / "b" / "secret")
    os.mkfifo(base / "b" / "fifo")
    (base / "b" / "dir").mkdir()
    odd = {
        base / "a" / "to-file": files[str(base / "a" / "f0")],
        base / "lnkdir" / "f1": files[str(base / "lnkdir-target" / "f1")],
        base / "b" / "fifo": cks.of_bytes(b""),
        base / "b" / "dir": cks.of_bytes(b""),
        base / "nothere" / "f": cks.of_bytes(b"x"),
        wh: cks.of_bytes(b""),
    }
    pairs = [{"path": p, "checksum": c} for p, c in files.items()]
    pairs += [{"path": str(p), "checksum": c} for p, c in odd.items()]
    pairs += [{"path": p, "checksum": cks.of_bytes(b"other")} for p in list(files)[:4]]
    pairs += pairs[:5]
    random.Random(7).shuffle(pairs)
    alone = [store.resolve([pair])[0] for pair in pairs]
    assert store.resolve(pairs) == alone
    assert sum(r.status == "original" for r in alone) >= len(files)
    # A path out of the roots through a symlink is refused (400) before any lookup.
    for link in (base / "out" / "secret", base / "b" / "secret"):
        with pytest.raises(BadRequest):
            store.resolve([*pairs, {"path": str(link), "checksum": cks.of_bytes(b"secret")}])


def test_a_cached_original_reached_through_a_symlink_is_no_original(
    env, store, monkeypatch
) -> None:
    """A pair is answered `original` from the lstat taken while confining it only when
    that lstat went through no symlink below the root. Here the partition directory is
    moved and a symlink put in its place: the file's identity (device, inode, size,
    mtime, ctime) is unchanged, so its cached checksum still matches, yet the path now
    leads through a symlink, which a GET never follows: no original, for the batch, for
    the pair alone and for the read."""
    monkeypatch.setattr(read, "RACY_NS", 0)
    files = make_table(env.warehouse, "db", "t", [{"p": "1"}], files_per_partition=3)
    pairs = pairs_of(files)
    assert {r.status for r in store.resolve(pairs)} == {"original"}  # cached now
    part = Path(next(iter(files))).parent
    part.rename(part.with_name("p=moved"))
    os.symlink(part.with_name("p=moved"), part)
    for pair in pairs:
        assert store.resolve([pair])[0].status == "missing"
        with pytest.raises(NotFound):
            store.open_verified(pair["path"], pair["checksum"])
    assert {r.status for r in store.resolve(pairs)} == {"missing"}
    # Put back, the same files are originals again, from the cache.
    os.unlink(part)
    part.with_name("p=moved").rename(part)
    hashed = CountingHash(monkeypatch)
    assert {r.status for r in store.resolve(pairs)} == {"original"}
    assert hashed.take() == []


def test_a_root_configured_through_a_symlink_still_has_originals(env, monkeypatch) -> None:
    """The root's own path may be a symlink (configured as /data/wh -> /mnt/disk/wh):
    what counts is that nothing below it is one."""
    monkeypatch.setattr(read, "RACY_NS", 0)
    link = env.base / "wh-link"
    os.symlink(env.warehouse, link)
    store = env.open(CMROOT_STORE_WAREHOUSE_ROOTS=str(link))
    files = make_table(link, "db", "t", [{"p": "1"}], files_per_partition=3)
    hashed = CountingHash(monkeypatch)
    for _ in range(2):
        assert {r.status for r in store.resolve(pairs_of(files))} == {"original"}
    assert len(hashed.take()) == 3  # hashed once, then answered from the cache
    for pair in pairs_of(files):
        with store.open_verified(pair["path"], pair["checksum"]) as v:
            assert v.status == "original"

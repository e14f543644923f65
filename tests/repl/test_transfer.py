"""The executor side of a load against a real daemon on loopback: each file comes from its
original when that still has the checksum, else from the cmroot (read directly, or over
HTTP when the store is not reachable from the executor), always verified; a file in
neither place is reported, and a failed batch leaves nothing behind."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmroot import checksum as cks
from cmroot.repl import transfer
from cmroot.repl.transfer import Copy
from tests.spark.sparklib import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("transfer")).start()
    yield d
    d.stop()


def put(path: Path, data: bytes) -> Copy:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return Copy(str(path), "", cks.of_bytes(data), len(data))


def to(c: Copy, dst: Path) -> Copy:
    return Copy(c.src, str(dst), c.checksum, c.size)


def run(rows: list[Copy], daemon: Daemon | None) -> list[transfer.Copied]:
    return list(transfer.copy_all(rows, daemon.url if daemon else None, None))


def test_original_present_and_cmroot(daemon: Daemon, tmp_path: Path) -> None:
    wh = daemon.warehouse / "t1"
    keep = to(put(wh / "keep", b"k" * 5000), tmp_path / "dst" / "p=1" / "keep")
    gone = to(put(wh / "gone", b"g" * 7000), tmp_path / "dst" / "p=1" / "gone")
    daemon.client.recycle([gone.src], op="DROP_PARTITION")
    (tmp_path / "dst" / "p=1").mkdir(parents=True)
    present = to(put(wh / "present", b"p" * 10), tmp_path / "dst" / "p=1" / "present")
    Path(present.dst).write_bytes(b"p" * 10)

    done = run([keep, gone, present], daemon)
    assert [c.source for c in done] == ["original", "cmroot", "present"]
    assert not any(Path(c.dst).exists() for c in done[:2])  # nothing visible before publish
    assert all(Path(c.temp).name.startswith(transfer.TEMP_PREFIX) for c in done[:2] if c.temp)
    transfer.publish(done)
    assert Path(keep.dst).read_bytes() == b"k" * 5000
    assert Path(gone.dst).read_bytes() == b"g" * 7000
    assert sorted(os.listdir(tmp_path / "dst" / "p=1")) == ["gone", "keep", "present"]
    assert [c.source for c in run([keep, gone], daemon)] == ["present", "present"]


def test_changed_original_falls_back_to_the_cmroot(daemon: Daemon, tmp_path: Path) -> None:
    """Same path, same size, other bytes: the copy hashes wrong and is discarded."""
    old = put(daemon.warehouse / "t2" / "f", b"old!" * 100)
    daemon.client.recycle([old.src], op="INSERT_OVERWRITE")
    put(Path(old.src), b"new!" * 100)
    done = run([to(old, tmp_path / "f")], daemon)
    assert done[0].source == "cmroot"
    transfer.publish(done)
    assert (tmp_path / "f").read_bytes() == b"old!" * 100


def test_over_http_when_the_store_is_not_reachable(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor on another machine cannot open the store's files: it streams them from
    GET /v1/files. (The other machine is what cannot exist here: the store's object path
    is made to look absent.)"""
    c = put(daemon.warehouse / "t3" / "f", os.urandom(3 << 20))
    daemon.client.recycle([c.src], op="DROP_TABLE")
    store = str(daemon.store)
    real = os.path.isfile
    monkeypatch.setattr(transfer.os.path, "isfile",
                        lambda p: False if str(p).startswith(store) else real(p))
    served = served_bytes(daemon)
    done = run([to(c, tmp_path / "f")], daemon)
    assert done[0].source == "cmroot"
    assert served_bytes(daemon) - served == c.size
    transfer.publish(done)
    assert cks.of_local_file(str(tmp_path / "f")) == c.checksum


def served_bytes(daemon: Daemon) -> float:
    with urllib.request.urlopen(daemon.url + "/metrics") as r:
        text = r.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("cmroot_served_bytes_total "))
    return float(line.split()[1])


def test_lost_file_reported_and_batch_discarded(daemon: Daemon, tmp_path: Path) -> None:
    ok = to(put(daemon.warehouse / "t4" / "ok", b"ok"), tmp_path / "new" / "deep" / "ok")
    lost = Copy(str(daemon.warehouse / "t4" / "never"), str(tmp_path / "new" / "deep" / "x"),
                "0" * 32, 3)
    done = run([ok, lost], daemon)
    assert [c.source for c in done] == ["original", "lost"]
    assert "neither at its path nor in the cmroot" in (done[1].error or "")
    transfer.discard(done)
    assert not (tmp_path / "new").exists()
    no_daemon = run([lost], None)
    assert no_daemon[0].source == "lost" and "no daemon" in (no_daemon[0].error or "")

"""A load that cannot ask the daemon says so: a daemon that is down, a 401 and a 403 come
back from the executor side of a load (`transfer.copy_all`, against a real daemon) as
that error, never as a lost file, and leave nothing behind. An outage is waited out with
a bounded backoff (counted here through its `sleep`, never timed); a refused token is not
retried, since it will not fix itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmroot import checksum as cks
from cmroot.exceptions import DaemonUnavailable, Forbidden, Unauthorized
from cmroot.repl import transfer
from cmroot.repl.transfer import Backoff, Copied, Copy
from cmroot.server.auth import new_token
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon with one token per scope."""
    d = Daemon(tmp_path / "d")
    with d.serving(check_errors=False):
        yield d


def layout(daemon: Daemon, dst: Path) -> list[Copy]:
    """Three files to load into `dst`: one still at its path, two only in the cmroot."""
    files = write_files(daemon.warehouse, {"t/keep": b"k" * 3000, "t/gone1": b"1" * 5000,
                                          "t/gone2": b"2" * 7000})
    gone = [p for p in files if "gone" in p]
    daemon.client().recycle(gone, op="DROP_PARTITION")
    return [Copy(p, str(dst / "p=1" / Path(p).name), cks.of_bytes(b), len(b))
            for p, b in files.items()]


def assert_nothing_left(done: list[Copied], dst: Path) -> None:
    """`discard` (what the driver does with a failed batch) leaves no file, temporary or
    directory of the batch."""
    transfer.discard(done)
    assert not dst.exists(), sorted(os.listdir(dst))


def test_a_daemon_outage_is_waited_out_then_named(daemon: Daemon, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    rows = layout(daemon, dst)
    daemon.stop()
    pauses: list[float] = []
    done = list(transfer.copy_all(rows, daemon.url, daemon.tokens["read"], streams=1,
                                  backoff=Backoff(attempts=3, first=0.01, sleep=pauses.append)))
    assert [(c.source, c.fault) for c in done] == [
        ("original", None), ("failed", "DaemonUnavailable"), ("failed", "DaemonUnavailable")]
    # One backoff for the task, not one per file: the second file fails at once.
    assert pauses == [0.01, 0.02]
    err = transfer.daemon_error("DaemonUnavailable", done[1].error or "", daemon.url, "db.t")
    assert isinstance(err, DaemonUnavailable)
    text = str(err)
    assert daemon.url in text and "cmroot serve" in text and "lost" not in text, text
    assert_nothing_left(done, dst)

    def come_back(seconds: float) -> None:
        pauses.append(seconds)
        daemon.start()

    pauses.clear()
    done = list(transfer.copy_all(rows, daemon.url, daemon.tokens["read"], streams=1,
                                  backoff=Backoff(attempts=3, first=0.01, sleep=come_back)))
    assert [c.source for c in done] == ["original", "cmroot", "cmroot"]
    assert pauses == [0.01]
    transfer.publish(done)
    assert sorted(os.listdir(dst / "p=1")) == ["gone1", "gone2", "keep"]


def test_a_refused_token_is_named_and_not_retried(daemon: Daemon, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    rows = layout(daemon, dst)
    unknown, _ = new_token("read")
    pauses: list[float] = []
    done = list(transfer.copy_all(rows, daemon.url, unknown,
                                  backoff=Backoff(attempts=3, first=0.01, sleep=pauses.append)))
    assert [(c.source, c.fault) for c in done] == [
        ("original", None), ("failed", "Unauthorized"), ("failed", "Unauthorized")]
    assert pauses == []
    err = transfer.daemon_error("Unauthorized", done[1].error or "", daemon.url, "db.t")
    assert isinstance(err, Unauthorized)
    text = str(err)
    assert daemon.url in text and "read scope" in text and "bootstrap" not in text, text
    assert_nothing_left(done, dst)


def test_a_forbidden_load_is_named_and_not_retried(tmp_path: Path) -> None:
    """A 403 from a real daemon: its Unix socket, in open mode, serves only the users
    listed in server.socket_uids (and this test's user is not one of them)."""
    sock = f"/tmp/cmroot-{os.getpid()}-{tmp_path.name[-20:]}.sock"
    d = Daemon(tmp_path / "d", auth=False,
               env={"CMROOT_SERVER_SOCKET": sock,
                    "CMROOT_SERVER_SOCKET_UIDS": str(os.getuid() + 1)})
    with d.serving(check_errors=False):
        dst = tmp_path / "dst"
        rows = layout(d, dst)
        pauses: list[float] = []
        url = f"unix://{sock}"
        done = list(transfer.copy_all(rows, url, None, backoff=Backoff(
            attempts=3, first=0.01, sleep=pauses.append)))
    assert [(c.source, c.fault) for c in done] == [
        ("original", None), ("failed", "Forbidden"), ("failed", "Forbidden")]
    assert pauses == []
    err = transfer.daemon_error("Forbidden", done[1].error or "", url, "db.t")
    assert isinstance(err, Forbidden)
    text = str(err)
    assert url in text and "read scope" in text and "socket_uids" in text, text
    assert_nothing_left(done, dst)

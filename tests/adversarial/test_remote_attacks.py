"""Adversarial reproducers against a remote (fsspec) warehouse root."""

from __future__ import annotations

from typing import Any

import pytest

from cmroot import faults
from cmroot.store import RecycleRequest, Store


def test_clean_up_does_not_delete_a_file_written_after_the_emptiness_check(
    remote: tuple[Store, Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequence: DROP_TABLE memory://wh/db/t (move). After the commit, clean-up runs
    RemoteSession.remove_empty_dirs: `if not fs.find(path): fs.rm(path, recursive=True)`.
    A writer that puts a new file under db/t between that find and that rm (a job
    re-creating the table right after the drop) loses it: a *recursive* delete of a
    directory checked empty a moment before removes a file that was never recycled, never
    recorded, and is in no store.
    Breaks invariant 1 (a file removed with no copy anywhere). Expected: the new file
    survives (remove only what was checked, non-recursively; object stores need no
    directory clean-up at all)."""
    store, fs, bucket = remote
    base = f"/{bucket}/db/t"
    with fs.open(f"{base}/old", "wb") as f:
        f.write(b"old bytes")
    state = {"raced": False}
    real_point = faults.point

    def point(name: str) -> None:
        if name == "journal.unstaged":  # clean-up is next: a job re-creates the table
            state["raced"] = True
            with fs.open(f"{base}/new", "wb") as f:
                f.write(b"new bytes")
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    store.recycle(RecycleRequest([f"memory://{bucket}/db/t"], op="DROP_TABLE"))
    assert state["raced"]
    assert fs.cat(f"{base}/new") == b"new bytes"

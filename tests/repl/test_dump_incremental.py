"""Incremental dumps against a real daemon: the events after --from, in scope, up to --to,
at most --limit, and the id the dump is consistent as of (the next --from)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cmroot.exceptions import BadRequest
from cmroot.repl import dump, dumpdir
from tests.spark.sparklib import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("dumps")).start()
    c = d.client
    c.add_event("CREATE_DATABASE", db="s")                         # 1
    c.add_event("CREATE_TABLE", db="s", table="t")                 # 2
    c.add_event("CREATE_TABLE", db="other", table="t")             # 3
    c.add_event("CREATE_TABLE", db="s", table="u")                 # 4
    c.add_event("ALTER_TABLE", db="s", table="u")                  # 5
    c.add_event("CREATE_DATABASE", db="other")                     # 6
    yield d
    d.stop()


def ids(url: str) -> list[int]:
    return [e.id for e in dumpdir.read(url).events]


def test_from_to_limit(daemon: Daemon, tmp_path: Path) -> None:
    to = str(tmp_path)
    url, h = dump(daemon.client, "s", None, to, from_id=0)
    assert ids(url) == [1, 2, 4, 5] and (h.first_event_id, h.last_event_id) == (0, 6)
    url, h = dump(daemon.client, "S", None, to, from_id=1, to_id=4)
    assert ids(url) == [2, 4] and h.last_event_id == 4
    url, h = dump(daemon.client, "s", None, to, from_id=0, limit=2)
    assert ids(url) == [1, 2] and h.last_event_id == 2  # the next dump starts after 2
    url, h = dump(daemon.client, "s", "u", to, from_id=0, limit=5)
    assert ids(url) == [1, 4, 5] and h.last_event_id == 6
    url, h = dump(daemon.client, "s", None, to, from_id=6)
    assert ids(url) == [] and h.last_event_id == 6
    assert url.startswith(to) and "s-incremental-6-6-" in url


def test_bad_arguments(daemon: Daemon, tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="--limit"):
        dump(daemon.client, "s", None, str(tmp_path), from_id=0, limit=0)
    with pytest.raises(BadRequest, match="need --from"):
        dump(daemon.client, "s", None, str(tmp_path), to_id=3)
    assert list(tmp_path.iterdir()) == []

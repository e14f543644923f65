"""The fsspec hook refused by the daemon (a 403: the path is outside the daemon's warehouse
roots): the error says where to write instead, and nothing is deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmroot.exceptions import CmrootError
from cmroot.hooks.fsspec import CmrootFileSystem
from tests.server.cmroot_daemon import Daemon, write_files

pytestmark = pytest.mark.timeout(120)


def test_a_403_says_which_root_to_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = Daemon(tmp_path / "d", auth=False)
    d.start()
    try:
        # The hook protects a directory the daemon does not (./spark-warehouse, say).
        (path,) = write_files(d.outside, {"t/f": b"x"})
        monkeypatch.setenv("CMROOT_CONFIG", str(d.config_path))
        fs = CmrootFileSystem(target_protocol="file", url=d.url, warehouse_roots=[str(d.outside)])
        with pytest.raises(CmrootError) as e:
            fs.rm_file(path)
        assert f"spark.sql.warehouse.dir={d.warehouse}" in e.value.detail
        assert Path(path).read_bytes() == b"x"
    finally:
        d.close()

"""`disk://`, the test-only Hadoop scheme over the local disk (tests/jvm/DiskFileSystem.java),
as an fsspec filesystem: what the daemon under test reads that warehouse root through, as it
reads an object store through s3fs. Registered by this directory's entry point (fsspec's
`fsspec.specs` group) when the directory is on the daemon's PYTHONPATH."""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem


class DiskFileSystem(LocalFileSystem):  # type: ignore[misc]
    protocol = ("disk",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        for prefix in ("disk://", "disk:"):
            if path.startswith(prefix):
                path = path[len(prefix):]
                break
        return super()._strip_protocol(path)

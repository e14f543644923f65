"""Replication by event replay, on Spark: dump a database or table on the source, load the
dump on a destination, ask a destination how far it got.

    url, header = dump(client, "sales", None, "/dumps", from_id=None, spark=spark)
    load(dest_spark, url)            # idempotent: rerun it after any failure
    status(dest_spark, "sales")      # the last source event applied, or None

The dump names files by (original path, checksum) only; the load copies each one from its
original if it still has that checksum, else from the cmroot, so a destination replays
exactly the states the source went through."""

from __future__ import annotations

from cmroot.repl.dump import after, dump
from cmroot.repl.load import LoadResult, load, status

__all__ = ["LoadResult", "after", "dump", "load", "status"]

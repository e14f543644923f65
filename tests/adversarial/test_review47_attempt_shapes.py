"""Review 47 (Spark hook): c7bb913, numbered directories below a committer's `_temporary`
judged by what they hold.

Reviewed: Cmroot.dataAttempts / committerShaped (a recursive delete of a committer
`_temporary` directory, a job's clean-up of <t>/_temporary, left in place every
`_temporary/<digits>` directory holding anything but directories called `_temporary` or
`task_*`), its use in Ctx.keptBelow by CmrootLocalFileSystem.delete / SchemeHook.delete, and
Cmroot.temporaryEnd (any `_temporary/<digits>` below a statement's table is a job's output
again); 4571a02 for the README's claim that a table located at <t>/_temporary/7 keeps its
data when t is overwritten.

Real PySpark local[2] with its embedded metastore, a real daemon, real files; one session
for the module (tests/spark/conftest.py's `lake`). test_break_* failed on c7bb913: each
docstring gives the sequence, what was seen, and what is expected. Two are fixed since
(Cmroot.dataInAttempts keeps an attempt directory's entries that no committer writes, and
deletes the committer's `_temporary` and `task_<job>_<m|r>_<n>` ones beside them); one is a
xfail kept (a table at the job's own attempt directory, `_temporary/0`, which Hadoop's
committer takes for its output). test_held_* held."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from tests.adversarial.test_review4_spark import (
    attempt,
    brief,
    kept,
    outer_and_inner,
    rows,
    unrecoverable,
)
from tests.adversarial.test_review7_spark import with_conf
from tests.adversarial.test_review46_attempts import FAILING, listing, temp_paths
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake

pytestmark = pytest.mark.timeout(600)

DB = "rev47"
NO_SUCCESS = ("mapreduce.fileoutputcommitter.marksuccessfuljobs",
              "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs")


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


@contextlib.contextmanager
def no_success_marker(lake: Lake) -> Iterator[None]:  # noqa: F811
    """No `_SUCCESS` file at job commit (a common setting: some readers choke on it)."""
    with with_conf(lake, NO_SUCCESS[0], "false"), with_conf(lake, NO_SUCCESS[1], "false"):
        yield


def overwrite_keeps_partitioned_inner(lake: Lake, o: str, n: str, col: str) -> None:  # noqa: F811
    """Outer table `o` holding table `n`, partitioned by `col`, at <o>/_temporary/7, no
    `_SUCCESS`; INSERT OVERWRITE TABLE o SELECT 2: o holds (2,), inner's `<col>=1/` stays
    with its file (or that resolves from the cmroot), inner reads (5, 1), no event names a
    `_temporary` path."""
    with no_success_marker(lake):
        inner = outer_and_inner(lake, DB, o, n, "_temporary/7", f"(a INT, {col} INT)",
                                f"USING parquet PARTITIONED BY ({col})", "(5, 1)")
        old = kept(inner)
        assert old and sorted(os.listdir(inner)) == [f"{col}=1"], listing(inner)
        err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{o} SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{o}") == [(2,)]
    assert unrecoverable(lake, old) == [], (brief(events), listing(tdir(lake, o)))
    assert rows(lake, f"SELECT a, {col} FROM {DB}.{n}") == [(5, 1)]
    assert temp_paths(events) == [], brief(events)


# == breaks ================================================================================
def test_break_a_table_at_temporary_7_partitioned_by_task_id_is_lost(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Sequence (SET mapreduce.fileoutputcommitter.marksuccessfuljobs=false, so no
    `_SUCCESS` file): CREATE TABLE outer (a INT) USING parquet; INSERT INTO outer VALUES (1);
    CREATE TABLE inner (a INT, task_id INT) USING parquet PARTITIONED BY (task_id) LOCATION
    '<outer>/_temporary/7'; INSERT INTO inner VALUES (5, 1); INSERT OVERWRITE TABLE outer
    SELECT 2.
    Seen: the statement succeeds; inner's only directory entry is `task_id=1/` (a partition,
    data), which Cmroot.committerShaped reads as a committer's `task_...` directory, so
    dataAttempts does not keep `_temporary/7` and outer's job clean-up (delete of
    <outer>/_temporary, a temporary path, never recycled) removes inner's data file raw: it
    resolves 'missing' and no event names it (the only event is outer's INSERT_OVERWRITE
    of its own part file).
    Expected (README: "a table placed at <t>/_temporary/7 of another table t keeps its data
    when t is overwritten"; invariant 1): inner's file stays at its path (or resolves from
    the cmroot) and inner still reads (5, 1). The same table partitioned by `p` holds
    (test_held_a_table_at_temporary_7_partitioned_by_p_keeps_its_data)."""
    overwrite_keeps_partitioned_inner(lake, "otid", "ntid", "task_id")


def test_break_a_failed_insert_leaves_its_task_output_in_a_table_at_temporary_0(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Sequence: CREATE TABLE outer (a INT) USING parquet; INSERT INTO outer VALUES (1);
    CREATE TABLE inner (a INT) USING parquet LOCATION '<outer>/_temporary/0'; INSERT INTO
    inner VALUES (5); INSERT INTO outer <10 rows over 2 tasks, the task of rows 5-9 fails
    after the task of rows 0-4 committed> (the statement fails); INSERT OVERWRITE TABLE
    inner SELECT 6.
    Seen: the failed job's abort deletes <outer>/_temporary; dataAttempts keeps
    `_temporary/0` whole because it holds inner's data file, and with it the failed job's
    committed `task_<job>_m_000000/part-...` (rows 0-4, and its .crc) and its `_temporary/`
    attempts: they stay inside inner's directory. inner's overwrite then recycles them as
    inner's data: its INSERT_OVERWRITE event names
    <outer>/_temporary/0/task_.../part-... (a file no statement ever published; a replica
    replaying it is told inner held it).
    Expected: a failed statement leaves no trace (invariant 2), so the overwrite's event
    names only inner's own part file (and its .crc), no `task_` path."""
    inner = outer_and_inner(lake, DB, "ofl0", "nfl0", "_temporary/0")
    assert rows(lake, f"SELECT a FROM {DB}.nfl0") == [(5,)]
    err, _ = attempt(lake, f"INSERT INTO {DB}.ofl0 {FAILING}")
    assert err is not None and "boom" in err
    assert rows(lake, f"SELECT a FROM {DB}.ofl0") == [(1,)]
    got = rows(lake, f"SELECT a FROM {DB}.nfl0")
    assert got == [(5,)], (got, listing(inner))
    left = listing(inner)
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.nfl0 SELECT 6")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.nfl0") == [(6,)]
    named = [(e["eventType"], f["path"]) for e in events for f in e["files"]
             if "/task_" in f["path"]]
    assert named == [], (left, brief(events))


@pytest.mark.xfail(strict=False, reason=(  # passes when first in its session: Spark's
    # order of the job's commit steps then differs; either way nothing of inner is lost
    "kept: a table located at <t>/_temporary/0 is, by Hadoop's rules, the job's own attempt"
    " directory: FileOutputCommitter.commitJob merges its files into t (Spark alone moves the"
    " inner table's data into t); with the hook the INSERT fails and its task output stays"))
def test_break_an_insert_into_a_table_holding_one_at_temporary_0_leaves_its_output(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Sequence (no `_SUCCESS` files): CREATE TABLE outer (a INT) USING parquet; INSERT
    INTO outer VALUES (1); CREATE TABLE inner (a INT) USING parquet LOCATION
    '<outer>/_temporary/0'; INSERT INTO inner VALUES (5); INSERT INTO outer VALUES (2).
    Seen: FileOutputCommitter.commitJob merges every entry of _temporary/0 but
    `_temporary` into outer, inner's part file too (Spark alone would move inner's data
    into outer); here the statement fails (FileNotFoundException for
    <outer>/_temporary/0/part-... of inner) and nothing of inner moves (outer reads (1,),
    inner (5,), inner's file in place, no event): these hold. But the failed job's
    clean-up keeps `_temporary/0` whole (dataAttempts then: it holds inner's data) and with it
    the job's committed <outer>/_temporary/0/task_<job>_m_000000/part-... (row 2): inner's
    directory gains a file no statement published (its next overwrite or drop records it,
    see test_break_a_failed_insert_leaves_its_task_output_in_a_table_at_temporary_0), and
    every INSERT INTO outer fails the same way while inner is there.
    Expected: a failed statement leaves no trace (invariant 2): inner's directory holds
    exactly its own data files afterwards."""
    with no_success_marker(lake):
        inner = outer_and_inner(lake, DB, "omv0", "nmv0", "_temporary/0")
        old = kept(inner)
        assert old
        err, events = attempt(lake, f"INSERT INTO {DB}.omv0 VALUES (2)")
    got_outer = rows(lake, f"SELECT a FROM {DB}.omv0")
    got_inner = rows(lake, f"SELECT a FROM {DB}.nmv0")
    assert got_outer in ([(1,)], [(1,), (2,)]) and got_inner == [(5,)], (
        (err or "")[:300], got_outer, got_inner, brief(events), listing(tdir(lake, "omv0")))
    assert unrecoverable(lake, old) == [], brief(events)
    assert all(f["path"] not in old for e in events for f in e["files"]), brief(events)
    assert set(kept(inner)) == set(old), listing(inner)


# == attacks that held =====================================================================
def test_held_a_table_at_temporary_7_partitioned_by_p_keeps_its_data(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """The control of the task_id break: inner partitioned by `p` at <outer>/_temporary/7,
    no `_SUCCESS`: INSERT OVERWRITE TABLE outer leaves `p=1/` (a k=v directory) in place;
    inner reads (5, 1), outer (2,), no event names a `_temporary` path."""
    overwrite_keeps_partitioned_inner(lake, "opp", "npp", "p")


def test_held_a_failed_insert_into_a_table_holding_one_at_temporary_7(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """inner at <outer>/_temporary/7 (data: kept); INSERT INTO outer <one task committed,
    the other fails>: the failed job's `_temporary/0` goes (committer-shaped), inner reads
    (5,), outer (1,); the next INSERT INTO outer VALUES (100) publishes only its row and
    names no `_temporary` path."""
    inner = outer_and_inner(lake, DB, "of7", "nf7", "_temporary/7")
    err, _ = attempt(lake, f"INSERT INTO {DB}.of7 {FAILING}")
    assert err is not None and "boom" in err
    assert sorted(os.listdir(tdir(lake, "of7") / "_temporary")) == ["7"], listing(inner)
    assert rows(lake, f"SELECT a FROM {DB}.nf7") == [(5,)]
    err, events = attempt(lake, f"INSERT INTO {DB}.of7 VALUES (100)")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.of7") == [(1,), (100,)]
    assert rows(lake, f"SELECT a FROM {DB}.nf7") == [(5,)]
    assert temp_paths(events) == [], brief(events)


def test_held_overwrite_of_a_table_located_at_temporary_7_of_a_plain_directory(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """A table located at <db dir>/plain/_temporary/7 (no outer table): INSERT OVERWRITE of
    it recycles its old file (INSERT_OVERWRITE event naming exactly it), its own job's
    clean-up of <loc>/_temporary leaves nothing behind, and it reads the new row."""
    loc = lake.warehouse / f"{DB}.db" / "plain" / "_temporary" / "7"
    lake.sql(f"CREATE TABLE {DB}.loc7 (a INT) USING parquet LOCATION '{loc}'")
    lake.sql(f"INSERT INTO {DB}.loc7 VALUES (5)")
    old = kept(loc)
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.loc7 SELECT 6")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.loc7") == [(6,)]
    assert unrecoverable(lake, old) == [], brief(events)
    [ow] = [e for e in events if e["eventType"] == "INSERT_OVERWRITE"]
    assert {f["path"] for f in ow["files"]
            if not os.path.basename(f["path"]).startswith((".", "_"))} == set(old)
    assert not (loc / "_temporary").exists(), listing(loc)

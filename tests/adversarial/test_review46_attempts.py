"""Review 46 (Spark hook): 4571a02, attempt directories below a committer's `_temporary`.

Reviewed: Cmroot.ownAttempt (`_temporary/<n>` a job's temporary output only when
n <= mapreduce.job.application.attempt.id, default 0), Cmroot.foreignAttempts and its use
in Ctx.keptBelow by CmrootLocalFileSystem.delete / SchemeHook.delete (a recursive delete
of a committer `_temporary` left the other numbered attempt directories in place), and
Cmroot.temporaryEnd, which asked ownAttempt.

Real PySpark local[2] with its embedded metastore, a real daemon, real files; one session
for the module (tests/spark/conftest.py's `lake`). test_break_* failed on 4571a02 (the
sequence, what was seen, what is expected in each docstring): the hook reads no job's
attempt number (it is in the job's configuration, not the file system's), and a number is
no proof. Fixed since: any number below `_temporary` is a job's again, and the clean-up
leaves what the numbered directories hold that no committer writes (Cmroot.dataInAttempts).
test_held_* held."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from tests.spark.conftest import lake  # noqa: F401 - the module's daemon and session
from tests.spark.sparklib import Lake

pytestmark = pytest.mark.timeout(600)

DB = "rev46"
ATTEMPT_KEYS = ("mapreduce.job.application.attempt.id",
                "spark.hadoop.mapreduce.job.application.attempt.id")
# One task (ids 0-4) commits at once; the other sleeps, then fails: the job is aborted
# after a task of it committed its output into _temporary/<attempt>/task_...
FAILING = ("SELECT CAST(IF(id < 5, id, IF(reflect('java.lang.Thread', 'sleep',"
           " CAST(1500 AS BIGINT)) IS NULL, raise_error('boom'), raise_error('boom'))) AS INT)"
           " FROM range(0, 10, 1, 2)")


def tdir(lake: Lake, table: str) -> Path:  # noqa: F811
    return lake.warehouse / f"{DB}.db" / table


@contextlib.contextmanager
def attempt_id(lake: Lake, n: str) -> Iterator[None]:  # noqa: F811
    """The session's application attempt id (SET, as a job resubmitted by a scheduler that
    numbers attempts would have it; both spellings), for the duration."""
    with with_conf(lake, ATTEMPT_KEYS[0], n), with_conf(lake, ATTEMPT_KEYS[1], n):
        yield


def temp_paths(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["eventType"], f["path"]) for e in events for f in e["files"]
            if "/_temporary/" in f["path"]]


def listing(root: Path) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in dirs + files]
    return sorted(out)


# == breaks ================================================================================
def test_break_an_insert_with_attempt_id_3_records_a_delete_of_its_temporary_file(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Sequence: SET mapreduce.job.application.attempt.id=3 (and its spark.hadoop.
    spelling); CREATE TABLE t (a INT) USING parquet; INSERT INTO t VALUES (1).
    Seen: the statement's events are INSERT [<t>/part-X], DELETE
    [<t>/_temporary/3/task_.../part-X], INSERT [<t>/part-X]: the job commit's rename of its
    own temporary file is recorded as a delete of data (a phantom DELETE of a path no
    replica ever had, and the new file inserted twice), and <t>/_temporary/3/... is left
    in the table. Before 4571a02 every `_temporary/<digits>` was temporary. The hook's
    Cmroot.hadoop() has no value for the key at all (it is never handed Spark's conf in a
    local lake), so ownAttempt("3") is false while FileOutputCommitter uses 3.
    Expected: one INSERT naming the new file; no event names a `_temporary` path
    (invariant 2: no phantom); no `_temporary` left behind."""
    lake.sql(f"CREATE TABLE {DB}.ins3 (a INT) USING parquet")
    with attempt_id(lake, "3"):
        err, events = attempt(lake, f"INSERT INTO {DB}.ins3 VALUES (1)")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.ins3") == [(1,)]
    assert temp_paths(events) == [], brief(events)
    assert [e["eventType"] for e in events] == ["INSERT"], brief(events)
    assert not (tdir(lake, "ins3") / "_temporary").exists(), listing(tdir(lake, "ins3"))


def test_break_a_failed_insert_with_attempt_id_3_publishes_its_rows_with_the_next_insert(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Sequence (attempt id 3 SET as above): CREATE TABLE t (a INT) USING parquet;
    INSERT INTO t <10 rows over 2 tasks, the task of rows 5-9 fails after the task of rows
    0-4 committed> (the statement fails); INSERT INTO t VALUES (100).
    Seen: after the failure <t>/_temporary/3/task_.../part-... holds rows 0-4 (abortJob's
    delete of <t>/_temporary was turned into a delete around _temporary/3,
    Cmroot.foreignAttempts); the next INSERT's job commit merges every committed task
    directory of _temporary/3, so t reads 0, 1, 2, 3, 4, 100 and its INSERT event names the
    failed statement's file as new data. Before 4571a02 the failed job's output went
    with the clean-up.
    Expected: t holds only (100,) (a failed statement leaves no trace, invariant 2), and
    the INSERT event names only the new statement's file."""
    lake.sql(f"CREATE TABLE {DB}.fail3 (a INT) USING parquet")
    with attempt_id(lake, "3"):
        err, _ = attempt(lake, f"INSERT INTO {DB}.fail3 {FAILING}")
        assert err is not None and "boom" in err
        assert rows(lake, f"SELECT a FROM {DB}.fail3") == []
        err, events = attempt(lake, f"INSERT INTO {DB}.fail3 VALUES (100)")
    assert err is None, err
    got = rows(lake, f"SELECT a FROM {DB}.fail3")
    assert got == [(100,)], (got, brief(events), listing(tdir(lake, "fail3")))


def test_break_a_table_at_temporary_00_is_lost_when_its_outer_table_is_overwritten(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """Sequence: CREATE TABLE outer (a INT) USING parquet; INSERT INTO outer VALUES (1);
    CREATE TABLE inner (a INT) USING parquet LOCATION '<outer>/_temporary/00'; INSERT INTO
    inner VALUES (5); INSERT OVERWRITE TABLE outer SELECT 2.
    Seen: the statement succeeds; inner's data file is gone and resolves 'missing' (no
    event names it): FileOutputCommitter's cleanupJob deletes <outer>/_temporary and
    Cmroot.foreignAttempts keeps only names whose VALUE exceeds the attempt id; "00" is
    0 by value, though Hadoop only ever writes "0" (Integer.toString of the attempt).
    `_temporary/7` and `_temporary/007` hold (see the held tests).
    Expected: inner's file still at its path or resolvable by (path, checksum)
    (invariant 1)."""
    inner = outer_and_inner(lake, DB, "o00", "n00", "_temporary/00")
    old = kept(inner)
    assert old
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.o00 SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.o00") == [(2,)]
    assert unrecoverable(lake, old) == [], brief(events)


# == attacks that held =====================================================================
@pytest.mark.parametrize("where", ["007", "99999999999"])
def test_held_a_table_at_an_odd_attempt_name_keeps_its_data_when_outer_is_overwritten(
    lake: Lake, db: str, where: str  # noqa: F811
) -> None:
    """A table located at <outer>/_temporary/007 (7 by value) or /99999999999 (past an
    int): INSERT OVERWRITE TABLE outer leaves it in place, and it still reads its row;
    outer holds only the new row."""
    o, n = f"o{where[:4]}", f"n{where[:4]}"
    inner = outer_and_inner(lake, DB, o, n, f"_temporary/{where}")
    old = kept(inner)
    err, events = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.{o} SELECT 2")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.{o}") == [(2,)]
    assert unrecoverable(lake, old) == [], brief(events)
    assert rows(lake, f"SELECT a FROM {DB}.{n}") == [(5,)]
    assert temp_paths(events) == [], brief(events)


def test_held_a_failed_then_retried_insert_with_the_default_attempt(
    lake: Lake, db: str  # noqa: F811
) -> None:
    """The default attempt id (0): a failed INSERT (one task committed, the other failed)
    leaves no `_temporary` behind, and the retried INSERT and an INSERT OVERWRITE record
    only their own files, never a `_temporary` path; the table holds the right rows."""
    lake.sql(f"CREATE TABLE {DB}.fail0 (a INT) USING parquet")
    err, events = attempt(lake, f"INSERT INTO {DB}.fail0 {FAILING}")
    assert err is not None and "boom" in err
    assert events == [] and not (tdir(lake, "fail0") / "_temporary").exists()
    err, events = attempt(lake, f"INSERT INTO {DB}.fail0 VALUES (100)")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.fail0") == [(100,)]
    err, events2 = attempt(lake, f"INSERT OVERWRITE TABLE {DB}.fail0 SELECT 7")
    assert err is None, err
    assert rows(lake, f"SELECT a FROM {DB}.fail0") == [(7,)]
    assert temp_paths(events + events2) == [], brief(events + events2)
    assert not (tdir(lake, "fail0") / "_temporary").exists()


@pytest.mark.parametrize("verb", ["TRUNCATE TABLE", "DROP TABLE"])
def test_break_truncate_or_drop_after_a_failed_insert_names_its_temporary_files(
    lake: Lake, db: str, verb: str  # noqa: F811
) -> None:
    """Sequence (attempt id 3 SET as above): CREATE TABLE t (a INT) USING parquet; INSERT
    INTO t VALUES (1); INSERT INTO t <a job whose second task fails after the first
    committed> (fails); TRUNCATE TABLE t, resp. DROP TABLE t.
    Seen: the TRUNCATE (DROP_TABLE) event lists, besides t's part file, the failed
    statement's <t>/_temporary/3/task_.../part-... and its .crc as files of the table
    (Cmroot.temporaryEnd: `_temporary/3` is no own attempt, so data). A replica replaying
    the event is told t held a file no statement ever published.
    Expected: the event names only t's data (its part file; no `_temporary` path)
    (invariant 2: no phantom)."""
    name = "tr3" if verb.startswith("TRUNCATE") else "dr3"
    lake.sql(f"CREATE TABLE {DB}.{name} (a INT) USING parquet")
    lake.sql(f"INSERT INTO {DB}.{name} VALUES (1)")
    with attempt_id(lake, "3"):
        err, _ = attempt(lake, f"INSERT INTO {DB}.{name} {FAILING}")
        assert err is not None and "boom" in err
        before = listing(tdir(lake, name))
        err, events = attempt(lake, f"{verb} {DB}.{name}")
    assert err is None, err
    assert temp_paths(events) == [], (before, brief(events))

"""Replication end to end: a hooked source (real PySpark, real daemon on loopback) dumps,
a destination (its own Spark and metastore, in a subprocess) loads, and the destination
holds exactly the rows the source held at the dump's last event."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.repl.conftest import Destination, Source
from tests.spark import jvm_archive
from tests.spark.sparklib import REPO

pytestmark = pytest.mark.timeout(900)


def test_no_rubber_banding(source: Source, destination: Destination) -> None:
    """The Hive replication v2 scenario: files the dump names are dropped and their
    partition recreated with other data before the load; the load still shows the state
    of the dump's last event, with the dropped files served from the cmroot."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE rb")
    source.sql("CREATE TABLE rb.t (a INT, p STRING) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO rb.t PARTITION (p='a') VALUES (1), (2)")
    source.sql("INSERT INTO rb.t PARTITION (p='b') VALUES (3)")
    source.sql("INSERT INTO rb.t PARTITION (p='a') VALUES (4)")
    at_dump = source.rows("SELECT a, p FROM rb.t")
    files_at_dump = source.data_files("rb", "t")
    url, header = source.dump("rb", from_id=start)
    assert header.kind == "incremental" and header.last_event_id > start

    source.sql("ALTER TABLE rb.t DROP PARTITION (p='a')")
    source.sql("INSERT INTO rb.t PARTITION (p='a') VALUES (100)")
    dropped = [f for f in files_at_dump if f.startswith("p=a/")]
    assert dropped and not any((source.table_dir("t", "rb") / f).exists() for f in dropped)
    url2, header2 = source.dump("rb", from_id=header.last_event_id)

    query = {"t": "SELECT a, p FROM rb.t"}
    first, second, again = destination.run(
        {"load": {"dump": url}, "queries": query, "status": ["rb"], "files": ["rb.t"],
         "partitions": ["rb.t"]},
        {"load": {"dump": url2}, "queries": query, "status": ["rb"]},
        {"load": {"dump": url2}, "queries": query, "status": ["rb"]},
    )
    assert first["rows"]["t"] == at_dump == [[1, "a"], [2, "a"], [3, "b"], [4, "a"]]
    assert first["load"]["sources"]["cmroot"] == len(dropped)
    assert first["files"]["rb.t"] == files_at_dump
    assert first["partitions"]["rb.t"] == ["p=a", "p=b"]
    assert first["status"]["rb"] == header.last_event_id
    now = source.rows("SELECT a, p FROM rb.t")
    assert second["rows"]["t"] == now == [[3, "b"], [100, "a"]]
    assert second["status"]["rb"] == header2.last_event_id
    assert again["rows"]["t"] == now and again["load"]["events"] == 0


def test_bootstrap_while_a_writer_adds_and_drops(source: Source, destination: Destination) -> None:
    source.sql("CREATE DATABASE bs")
    source.sql("CREATE TABLE bs.t (a BIGINT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("CREATE TABLE bs.flat (a BIGINT) USING parquet")
    source.sql("INSERT INTO bs.t SELECT /*+ REPARTITION(8) */ id, id % 6 FROM range(600)")
    source.sql("INSERT INTO bs.flat SELECT id FROM range(50)")
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        i = 100
        try:
            while not stop.is_set():
                source.sql(f"INSERT INTO bs.t PARTITION (p={i}) VALUES ({i}), ({i + 1})")
                source.sql(f"ALTER TABLE bs.t DROP IF EXISTS PARTITION (p={i - 2})")
                source.sql(f"INSERT INTO bs.flat VALUES ({i})")
                i += 1
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    try:
        time.sleep(1.0)
        for _ in range(5):  # until events land while the snapshot is taken
            url, header = source.dump("bs")
            if header.last_event_id > header.first_event_id:
                break
        time.sleep(0.5)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert header.kind == "bootstrap" and header.last_event_id > header.first_event_id
    url2, header2 = source.dump("bs", from_id=header.last_event_id)
    queries = {"t": "SELECT a, p FROM bs.t", "flat": "SELECT a FROM bs.flat"}
    boot, inc = destination.run(
        {"load": {"dump": url}, "status": ["bs"]},
        {"load": {"dump": url2}, "queries": queries, "status": ["bs"],
         "partitions": ["bs.t"], "files": ["bs.t", "bs.flat"]},
    )
    assert boot["status"]["bs"] == header.last_event_id, boot
    assert inc["rows"]["t"] == source.rows(queries["t"])
    assert inc["rows"]["flat"] == source.rows(queries["flat"])
    assert inc["partitions"]["bs.t"] == sorted(r[0] for r in source.sql("SHOW PARTITIONS bs.t"))
    assert inc["files"]["bs.t"] == source.data_files("bs", "t")
    assert inc["files"]["bs.flat"] == source.data_files("bs", "flat")
    assert inc["status"]["bs"] == header2.last_event_id


def test_driver_killed_midway_then_rerun(source: Source, fresh_destination: Destination) -> None:
    destination = fresh_destination
    """kill -9 of the load's spark-submit while files are being copied; the rerun ends
    with exactly the source's rows and files, no duplicates, no temporaries."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE kl")
    source.sql("CREATE TABLE kl.t (a BIGINT, s STRING, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO kl.t SELECT /*+ REPARTITION(64) */ id, "
               "sha2(CAST(id * rand() AS STRING), 512), id % 4 FROM range(300000)")
    source.sql("INSERT OVERWRITE TABLE kl.t PARTITION (p=1) SELECT id, 'x' FROM range(10)")
    source.sql("INSERT INTO kl.t SELECT /*+ REPARTITION(64) */ id, "
               "sha2(CAST(id * rand() AS STRING), 512), 5 FROM range(100000)")
    url, header = source.dump("kl", from_id=start)
    table = destination.warehouse / "kl.db" / "t"
    # the class-data archive the tests' other drivers map (tests/spark/jvm_archive.py)
    archive = jvm_archive.options()
    cmd = ["spark-submit", "--master", "local[2]",
           *(["--driver-java-options", archive] if archive else []),
           str(REPO / "cmd" / "repl_load.py"), "--from-dir", url, *destination.with_args()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=destination.env(), cwd=destination.base, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _copying(table):
            assert proc.poll() is None, "the load ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    res = destination.cli("load", "--from-dir", url, "--json")
    assert json.loads(res.stdout)["last_event_id"] == header.last_event_id
    (after,) = destination.run({"queries": {"t": "SELECT count(*), count(DISTINCT a, p), "
                                                 "sum(a), sum(p) FROM kl.t"},
                                "files": ["kl.t"], "status": ["kl"]})
    expected = source.rows("SELECT count(*), count(DISTINCT a, p), sum(a), sum(p) FROM kl.t")
    assert after["rows"]["t"] == expected
    assert after["files"]["kl.t"] == source.data_files("kl", "t")
    assert after["status"]["kl"] == header.last_event_id


def _copying(table: Path) -> bool:
    """Has the load started putting files under the table directory?"""
    return any(files for _, _, files in os.walk(table))


def test_file_expired_from_the_cmroot(source: Source, destination: Destination) -> None:
    """Retention shorter than the lag: the load fails naming the file and the fix, and the
    destination keeps its state from before that event."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE expiring")
    source.sql("CREATE TABLE expiring.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    # Values no other test writes: equal rows make byte-identical parquet files, which
    # would share a stored object (and its 24h retention) with another test's file.
    source.sql("INSERT INTO expiring.t VALUES (314159, 1)")
    url1, h1 = source.dump("expiring", from_id=start)
    source.sql("INSERT INTO expiring.t VALUES (271828, 2)")
    url2, _ = source.dump("expiring", from_id=h1.last_event_id)
    lost = source.data_files("expiring", "t")
    source.sql("ALTER TABLE expiring.t DROP PARTITION (p=2)")
    time.sleep(1.5)
    report = source.daemon.client.gc()
    assert report["removed_objects"] >= 1
    first, second = destination.run(
        {"load": {"dump": url1}, "status": ["expiring"]},
        {"load": {"dump": url2}, "queries": {"t": "SELECT a, p FROM expiring.t"},
         "status": ["expiring"], "partitions": ["expiring.t"], "files": ["expiring.t"]},
    )
    assert first["status"]["expiring"] == h1.last_event_id
    err = second["load"]
    assert err["kind"] == "FileLost", err
    p2 = next(f for f in lost if f.startswith("p=2/"))
    assert p2 in err["error"] + err["detail"]
    assert "retention" in err["detail"] and "bootstrap" in err["detail"]
    assert second["rows"]["t"] == [[314159, 1]]
    assert second["partitions"]["expiring.t"] == ["p=1"]
    assert second["files"]["expiring.t"] == [f for f in lost if f.startswith("p=1/")]
    assert second["status"]["expiring"] == h1.last_event_id


def test_one_table_renamed_on_load_through_the_cli(
    source: Source, fresh_destination: Destination, tmp_path: Path
) -> None:
    destination = fresh_destination
    start = source.daemon.current()
    source.sql("CREATE DATABASE one")
    source.sql("CREATE TABLE one.t (a INT) USING parquet")
    source.sql("CREATE TABLE one.other (a INT) USING parquet")
    source.sql("INSERT INTO one.t VALUES (1), (2)")
    source.sql("INSERT INTO one.other VALUES (9)")
    source.sql("INSERT OVERWRITE TABLE one.t VALUES (3)")
    dumps = tmp_path / "dumps"
    res = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "repl", "dump", "one.t", "--from", str(start),
         "--to-dir", str(dumps), "--url", source.daemon.url, "--json"],
        capture_output=True, text=True, env=destination.env(), cwd=destination.base, check=True,
    )
    out = json.loads(res.stdout)
    assert out["kind"] == "incremental" and out["events"] >= 4
    destination.cli("load", "dr.copy", "--from-dir", out["dump_dir"])
    status = destination.cli("status", "dr.copy").stdout.strip()
    assert status == str(out["last_event_id"])
    assert destination.cli("status", "dr.never").stdout.strip() == ""
    (got,) = destination.run({"queries": {"copy": "SELECT a FROM dr.copy",
                                          "tables": "SHOW TABLES IN dr"}})
    assert got["rows"]["copy"] == [[3]]
    assert [r[1] for r in got["rows"]["tables"]] == ["copy"]


def test_refusals_change_nothing(source: Source, destination: Destination) -> None:
    """A dump that starts after what the destination has, and a bootstrap over a database
    that is not its replica, are refused and leave the destination as it was."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE rf")
    source.sql("CREATE TABLE rf.t (a INT) USING parquet")
    source.sql("INSERT INTO rf.t VALUES (1)")
    url1, h1 = source.dump("rf", from_id=start)
    source.sql("INSERT INTO rf.t VALUES (2)")
    _, h2 = source.dump("rf", from_id=h1.last_event_id)
    source.sql("INSERT INTO rf.t VALUES (3)")
    url3, _ = source.dump("rf", from_id=h2.last_event_id)  # skips the second dump
    boot, _ = source.dump("rf")
    q = {"t": "SELECT a FROM rf.t"}
    first, gap, over = destination.run(
        {"load": {"dump": url1}, "queries": q, "status": ["rf"]},
        {"load": {"dump": url3}, "queries": q, "status": ["rf"]},
        {"load": {"dump": boot}, "queries": q, "status": ["rf"], "files": ["rf.t"]},
    )
    assert first["rows"]["t"] == [[1]]
    assert gap["load"]["kind"] == "ReplError" and "--from" in gap["load"]["detail"]
    assert over["load"]["kind"] == "ReplError" and "already exists" in over["load"]["error"]
    for step in (gap, over):
        assert step["rows"]["t"] == [[1]] and step["status"]["rf"] == h1.last_event_id
    assert len(over["files"]["rf.t"]) == 1


def _as_of_another_source(url: str, to: Path) -> str:
    """A copy of the dump at `url` that says it was taken of another event log."""
    import shutil

    shutil.copytree(url, to)
    header = json.loads((to / "_dump.json").read_text())
    assert len(header["source"]) == 32  # every dump names the log it was taken of
    header["source"] = "f" * 32
    (to / "_dump.json").write_text(json.dumps(header))
    return str(to)


def test_a_replica_refuses_another_source_and_an_unfinished_bootstrap(
    source: Source, destination: Destination, tmp_path: Path
) -> None:
    """Event ids mean something only within one source's log: a replica of source A
    refuses a dump of source B (whatever its ids), incremental or bootstrap. A bootstrap
    that failed midway (a file lost from both the source and its cmroot) leaves a target
    with no repl.last.id: an incremental dump into it is refused, never applied on top of
    half a snapshot. Each refusal leaves the destination as it was."""
    source.sql("CREATE DATABASE ot")
    source.sql("CREATE TABLE ot.t (a INT) USING parquet")
    source.sql("INSERT INTO ot.t VALUES (1)")
    boot, hb = source.dump("ot")
    source.sql("INSERT INTO ot.t VALUES (2)")
    inc, hi = source.dump("ot", from_id=hb.last_event_id)
    other_inc = _as_of_another_source(inc, tmp_path / "other-inc")
    other_boot = _as_of_another_source(boot, tmp_path / "other-boot")
    q = {"t": "SELECT a FROM ot.t ORDER BY a"}
    first, foreign, foreign_boot, mine = destination.run(
        {"load": {"dump": boot}, "queries": q, "status": ["ot"]},
        {"load": {"dump": other_inc}, "queries": q, "status": ["ot"]},
        {"load": {"dump": other_boot}, "queries": q, "status": ["ot"]},
        {"load": {"dump": inc}, "queries": q, "status": ["ot"]},
    )
    assert first["rows"]["t"] == [[1]] and first["status"]["ot"] == hb.last_event_id
    for step in (foreign, foreign_boot):
        assert step["load"]["kind"] == "ReplError", step["load"]
        assert "another source" in step["load"]["error"] or "already exists" in (
            step["load"]["error"]), step["load"]
        assert step["rows"]["t"] == [[1]] and step["status"]["ot"] == hb.last_event_id
    assert "another source" in foreign["load"]["error"]
    assert mine["rows"]["t"] == [[1], [2]] and mine["status"]["ot"] == hi.last_event_id

    # An unfinished bootstrap: one of its files is gone from the source (removed behind
    # the hook's back) and was never in the cmroot, so the load fails midway.
    source.sql("CREATE DATABASE ub")
    source.sql("CREATE TABLE ub.t (a INT) USING parquet")
    source.sql("INSERT INTO ub.t VALUES (1)")
    source.sql("INSERT INTO ub.t VALUES (2)")
    boot2, h2 = source.dump("ub")
    lost = sorted(source.data_files("ub", "t"))[0]
    (source.table_dir("t", "ub") / lost).unlink()
    source.sql("REFRESH TABLE ub.t")
    source.sql("INSERT INTO ub.t VALUES (3)")
    inc2, _ = source.dump("ub", from_id=h2.last_event_id)
    failed, refused = destination.run(
        {"load": {"dump": boot2}, "status": ["ub"]},
        {"load": {"dump": inc2}, "status": ["ub"], "files": ["ub.t"]},
    )
    assert failed["load"]["kind"] == "FileLost", failed["load"]
    assert failed["status"]["ub"] is None
    assert refused["load"]["kind"] == "ReplError", refused["load"]
    assert "did not finish" in refused["load"]["error"], refused["load"]
    assert refused["status"]["ub"] is None
    assert len(refused["files"]["ub.t"]) <= 1  # the one file the bootstrap got, no more


def test_a_table_swap_replicates(source: Source, destination: Destination) -> None:
    """The table swap every ETL framework does: CREATE TABLE t_new AS ..., DROP TABLE t,
    ALTER TABLE t_new RENAME TO t. The INSERT into t_new names files at t_new/, which the
    rename moved to t/ (neither there nor in the cmroot under that path): the daemon follows
    the rename recorded in its log. Then a swap whose rename (and a drop of the renamed
    table) comes after the dump: the load still finds the bytes, at the new place or in the
    cmroot, and the replica is the source as of the dump."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE sw")
    source.sql("CREATE TABLE sw.t (a INT) USING parquet")
    source.sql("INSERT INTO sw.t VALUES (1), (2)")
    url0, h0 = source.dump("sw", from_id=start)
    source.sql("CREATE TABLE sw.t_new USING parquet AS SELECT a + 10 AS a FROM sw.t")
    source.sql("DROP TABLE sw.t")
    source.sql("ALTER TABLE sw.t_new RENAME TO t")
    url1, h1 = source.dump("sw", from_id=h0.last_event_id)
    swapped = source.rows("SELECT a FROM sw.t")
    source.sql("CREATE TABLE sw.u_new USING parquet AS SELECT a + 100 AS a FROM sw.t")
    at_dump = source.rows("SELECT a FROM sw.u_new")
    url2, h2 = source.dump("sw", from_id=h1.last_event_id)
    source.sql("ALTER TABLE sw.u_new RENAME TO u")  # after the dump: the files move ...
    source.sql("ALTER TABLE sw.t RENAME TO t_old")
    source.sql("DROP TABLE sw.t_old")  # ... or move, then go to the cmroot
    q = {"t": "SELECT a FROM sw.t", "u_new": "SELECT a FROM sw.u_new"}
    first, second, third = destination.run(
        {"load": {"dump": url0}, "queries": q, "status": ["sw"]},
        {"load": {"dump": url1}, "queries": q, "status": ["sw"]},
        {"load": {"dump": url2}, "queries": q, "status": ["sw"], "files": ["sw.u_new"]},
    )
    assert first["rows"]["t"] == [[1], [2]]
    assert "error" not in second["load"], second["load"]
    assert second["rows"]["t"] == swapped == [[11], [12]]
    assert second["status"]["sw"] == h1.last_event_id
    assert "error" not in third["load"], third["load"]
    assert third["rows"]["u_new"] == at_dump == [[111], [112]]
    assert third["rows"]["t"] == [[11], [12]] and third["status"]["sw"] == h2.last_event_id
    assert third["files"]["sw.u_new"]


def test_moves_and_adoptions_replicate(source: Source, destination: Destination) -> None:
    """What moves or adopts data without deleting any (issue 11, item 7): a renamed partition,
    a table given a new location, a table created over data already there, and inserts into
    a Hive SerDe table. Each load leaves the replica with the source's rows. (The data is
    loaded before the rename moves it: following a file across a later rename is replication
    work of its own.)"""
    start = source.daemon.current()
    source.sql("CREATE DATABASE mv")
    source.sql("CREATE TABLE mv.p (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO mv.p VALUES (1, 1), (2, 2)")
    source.sql("CREATE TABLE mv.flat (a INT) USING parquet")
    source.sql("INSERT INTO mv.flat VALUES (1)")
    url1, h1 = source.dump("mv", from_id=start)
    (first,) = destination.run({"load": {"dump": url1}, "queries": {"p": "SELECT * FROM mv.p"}})
    assert first["rows"]["p"] == [[1, 1], [2, 2]], first["load"]

    source.sql("ALTER TABLE mv.p PARTITION (p=1) RENAME TO PARTITION (p=9)")
    moved = source.warehouse / "mv.db" / "flat_v2"
    source.spark.range(3).selectExpr("CAST(id + 10 AS INT) AS a").write.parquet(str(moved))
    source.sql(f"ALTER TABLE mv.flat SET LOCATION '{moved}'")
    source.sql("INSERT INTO mv.flat VALUES (20)")
    landing = source.warehouse / "mv.db" / "landing"
    source.spark.range(2).selectExpr("CAST(id + 30 AS INT) AS a").write.parquet(str(landing))
    source.sql(f"CREATE TABLE mv.adopted (a INT) USING parquet LOCATION '{landing}'")
    source.sql("CREATE TABLE mv.h (a INT) STORED AS TEXTFILE")
    source.sql("INSERT INTO mv.h VALUES (5), (6)")
    source.sql("INSERT INTO mv.h SELECT a + 1 FROM mv.h")
    url2, _ = source.dump("mv", from_id=h1.last_event_id)
    q = {t: f"SELECT * FROM mv.{t}" for t in ("p", "flat", "adopted", "h")}
    (second,) = destination.run({"load": {"dump": url2}, "queries": q, "partitions": ["mv.p"]})
    for t, sql in q.items():
        assert second["rows"][t] == source.rows(sql), (t, second["load"])
    assert second["partitions"]["mv.p"] == ["p=2", "p=9"]

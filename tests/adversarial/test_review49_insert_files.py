"""Review 49 (Spark hook): 2efe158, an INSERT's files as its tasks report them.

Reviewed: CmrootCommitProtocol.newTaskTempFile / newTaskTempFileAbsPath / commitTask (each
task's commit message wrapped in a `Written` naming the files it wrote), commitJob's
`reported` / `sparkOwn` / `landed` (the INSERT event lists the reported files that exist
instead of a walk of the table for the job's id), and CmrootCommands.customPartitions
(the analysed plan's CatalogTable, or forTable's one getTableMetadata; no metastore call
for an unpartitioned table).

How: real PySpark local[2,3] (a task may fail twice and be retried) with its embedded
metastore and a real daemon, one session for the module whose warehouse roots are a local
directory and `disk://` (tests/jvm, the second Hadoop scheme of tests/spark/
test_spark_schemes.py); every INSERT's event compared with the data files that appeared on
disk, its partitions and partitionLocations with where they lie; a replica (the shared
destination of tests/adversarial/conftest.py) loaded from a dump and its rows compared
with the source's. Findings were checked against 2efe158^ (a copy of the tree at
HEAD~1 with the same tests).

Breaks (test_break_*; each docstring: the sequence, what was seen, what is expected), all
six fixed since:
- A Spark application with `spark.kryo.registrationRequired=true` could no longer write a
  table: every task's result carried CmrootCommitProtocol$Written, a class Kryo was never
  told about ("Class is not registered"). (Regression.) FIXED: the message is a Tuple2 of
  Spark's own and a String[], types Spark registers.
- A partition whose location is a symlink to a directory: the reported file was spelt by
  Cmroot.where (its parent, the symlink, resolved) while the statement's partition
  directory is the catalog's spelling (the symlink kept): the INSERT listed the file in no
  partition, and the replica's load refused the event. 2efe158^ failed the statement at
  write time (the daemon refuses the path through the symlink). (Regression.) FIXED: a
  custom location's file is the catalog-spelt directory joined with its name, as the walk
  had it; the statement fails closed again.
- On `disk://`, a partition located in a directory whose name holds a space (or `%`): the
  INSERT recorded no file for it (Cmroot.uriKey read the URI `.../sp%20ace` undecoded).
  The same misreading of the catalog's location made TRUNCATE recycle that partition's
  file under a table-less DELETE, and DROP TABLE fail. Already so on 2efe158^. FIXED:
  Cmroot.where(URI) reads a catalog location on another file system as the Hadoop path it
  names.
- A partition column named `_`: its directory `_=1` was hidden to Cmroot.notData (its `=`
  is at index 1) though Spark reads it; an INSERT into an existing partition recorded no
  event. Already so on 2efe158^. FIXED: a hidden name with a '=' past its first character
  is a partition.
- A failed multi-insert whose first insert overwrites a whole partitioned table: the
  rollback puts the old files back, but the partition the overwrite emptied stays dropped
  from the catalog (and a DROP_PARTITION is recorded): the table loses rows though the
  statement failed. Already so on 2efe158^ (the rollback is not part of the change).
  FIXED: the rollback puts the dropped partitions back in the catalog; the metastore
  records the drop and the re-add (with the files), which a replica replays to the same
  rows.

Held (test_held_*): custom partition locations named with a space, `%25`, `%2F`, `=`,
`+`, `#`, `:` and unicode; partition values needing escaping, nested partitions, the
hidden-looking columns `_p` and `.q`; dynamic and static partition overwrite (with custom
locations); a task failing its first attempt (v1 and v2 committers, dynamic overwrite);
multi-insert; CTAS and DataFrameWriter insertInto/saveAsTable; empty inserts; a failed
multi-insert overwriting one partition (old files back, output removed, no event); DROP
PARTITION / TRUNCATE / DROP TABLE of tables with custom locations (every file kept);
INSERT on `disk://` with escaped partition values; a replica of all that equal to the
source. Speculative attempts are not provoked: local mode runs no speculative task."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from cmroot import spark as cmspark
from tests.adversarial.test_review4_spark import attempt, brief, kept, unrecoverable
from tests.adversarial.test_review7_spark import with_conf
from tests.jvm import DISK_FS, FSSPEC_DISK, disk_fs_jar
from tests.repl.conftest import RETAIN_OVERRIDES, Destination, Source, load_ok
from tests.spark.sparklib import (
    REPO,
    Daemon,
    fresh_jvm_if_needed,
    release_filesystems,
    spark_builder,
)

pytestmark = pytest.mark.timeout(900)

DB = "rev49"


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    """The module's one session: local[2,3], warehouse roots <base>/warehouse and
    disk://<base>/lake (both the daemon's and the hook's), database rev49 made."""
    base = tmp_path_factory.mktemp("rev49")
    (base / "lake").mkdir()
    daemon = Daemon(base, env={
        "CMROOT_STORE_WAREHOUSE_ROOTS": f"{base / 'warehouse'},disk://{base / 'lake'}",
        "CMROOT_STORE_RETAIN_OVERRIDES": RETAIN_OVERRIDES,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(FSSPEC_DISK)]),
    }).start()
    spark = None
    try:
        fresh_jvm_if_needed(None)
        builder = spark_builder(base, daemon.warehouse).config("spark.master", "local[2,3]")
        spark = cmspark.configure(
            builder, url=daemon.url, schemes={"disk": DISK_FS}, scheme_jars=(disk_fs_jar(),),
            warehouse_roots=[str(daemon.warehouse), f"disk://{base / 'lake'}"]).getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        s = Source(base, daemon, spark)
        s.sql(f"CREATE DATABASE {DB}")
        yield s
    finally:
        with contextlib.suppress(Exception):
            if spark is not None:
                spark.stop()
            release_filesystems()
        fresh_jvm_if_needed(None)  # the next module's application gets a JVM of its own
        daemon.stop()


# -- helpers ----------------------------------------------------------------------------------


def tdir(s: Source, t: str, db: str = DB) -> Path:
    return s.warehouse / f"{db}.db" / t


def lake(s: Source) -> Path:
    return s.base / "lake"


def rows(s: Source, q: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in s.sql(q))


def snapshot(*roots: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for r in roots:
        out.update(kept(r))
    return out


def inserted(events: list[dict[str, Any]]) -> list[str]:
    return sorted(f["path"] for e in events if e["eventType"] == "INSERT" for f in e["files"])


def placed(events: list[dict[str, Any]]) -> dict[str, tuple[dict[str, str], str | None]]:
    """{file: (its partition, its partition's directory)} as the INSERT events say."""
    out: dict[str, tuple[dict[str, str], str | None]] = {}
    for e in events:
        if e["eventType"] != "INSERT":
            continue
        locs = e.get("partitionLocations") or [None] * len(e["partitions"])
        for f in e["files"]:
            hits = [(p, d) for p, d in zip(e["partitions"], locs, strict=True)
                    if d is not None and f["path"].startswith(d.rstrip("/") + "/")]
            out[f["path"]] = max(hits, key=lambda h: len(h[1] or "")) if hits else ({}, None)
    return out


def insert_checked(s: Source, stmt: str, roots: tuple[Path, ...],
                   dirs: dict[str, dict[str, str]] | None = None,
                   scheme: str = "") -> list[dict[str, Any]]:
    """Run `stmt` (it must succeed): its INSERT events list exactly the data files that
    appeared (or changed) under `roots`; with `dirs` ({directory: spec}), each file is
    placed in the partition of the directory holding it."""
    before = snapshot(*roots)
    err, events = attempt(s, stmt)
    assert err is None, err
    after = snapshot(*roots)
    new = sorted(scheme + p for p, b in after.items() if before.get(p) != b)
    assert inserted(events) == new, (new, brief(events))
    if dirs is not None:
        where = placed(events)
        want: dict[str, tuple[dict[str, str], str | None]] = {f: ({}, None) for f in new}
        for f in new:
            for d, spec in dirs.items():
                if os.path.dirname(f) == d:
                    want[f] = (spec, d)
        assert where == want, brief(events)
    return events


# == breaks ==================================================================================

KRYO_APP = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.spark.sparklib import Lake, SHORT_LIVED_JVM, hooked_lake
base = Path(sys.argv[1])
(base / "derby").mkdir(parents=True, exist_ok=True)
out = {}
with hooked_lake(base, Lake, extra=lambda d: {
        "spark.serializer": "org.apache.spark.serializer.KryoSerializer",
        "spark.kryo.registrationRequired": "true",
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={base / 'derby'} {SHORT_LIVED_JVM}",
}) as lk:
    lk.sql("CREATE TABLE k (a INT, p INT) USING parquet PARTITIONED BY (p)")
    for name, proto in [("spark", "org.apache.spark.sql.execution.datasources."
                         "SQLHadoopMapReduceCommitProtocol"),
                        ("cmroot", "io.cmroot.spark.CmrootCommitProtocol")]:
        lk.spark.conf.set("spark.sql.sources.commitProtocolClass", proto)
        try:
            lk.sql("INSERT INTO k VALUES (1, 1)")
            out[name] = "ok"
        except Exception as e:
            out[name] = [l for l in str(e).splitlines() if "Class is not registered" in l][:1] \
                or str(e)[:300]
    lk.spark.conf.set("spark.sql.sources.commitProtocolClass",
                      "io.cmroot.spark.CmrootCommitProtocol")
    out["rows"] = sorted(tuple(r) for r in lk.sql("SELECT a, p FROM k"))
print("RESULT " + json.dumps(out))
"""


def test_break_kryo_registration_required_fails_every_insert(tmp_path: Path) -> None:
    """Sequence (an application of its own: the serializer is fixed at launch): a hooked
    session with spark.serializer=KryoSerializer and spark.kryo.registrationRequired=true;
    CREATE TABLE k (a INT, p INT) USING parquet PARTITIONED BY (p); with Spark's own
    SQLHadoopMapReduceCommitProtocol (SET for the session) INSERT INTO k VALUES (1, 1);
    with cmroot's protocol again the same INSERT.
    Seen: Spark's protocol writes; cmroot's fails every task: the task's result (a
    WriteTaskResult holding the TaskCommitMessage) is serialized with Kryo and its object
    is now CmrootCommitProtocol$Written: "Class is not registered:
    io.cmroot.spark.CmrootCommitProtocol$Written". 2efe158^ returned Spark's own message
    (registered by Spark) and wrote.
    Expected: Spark's commit semantics unchanged: the hooked INSERT writes as Spark's does
    (k reads (1, 1) twice). At fault: CmrootCommitProtocol.commitTask wraps the message in
    a class of cmroot's (register it with Kryo, or carry the names in a type Spark
    registers, or keep them on the driver another way)."""
    res = subprocess.run(
        [sys.executable, "-c", KRYO_APP, str(tmp_path / "kryo"), str(REPO)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, res.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    assert out["spark"] == "ok", out
    assert out["cmroot"] == "ok", out
    assert out["rows"] == [[1, 1], [1, 1]], out


def test_break_a_partition_at_a_symlinked_directory_is_recorded_in_no_partition(
    src: Source, destination: Destination
) -> None:
    """Sequence: <wh>/landing49/day1 a directory, <wh>/landing49/current a symlink to it
    (the usual `current` layout of a landing area); CREATE TABLE rev49s.sl (a INT, p INT)
    USING parquet PARTITIONED BY (p); ALTER TABLE ADD PARTITION (p=1) LOCATION
    '<wh>/landing49/current'; INSERT INTO rev49s.sl PARTITION (p=1) VALUES (1); INSERT
    INTO rev49s.sl VALUES (2, 2); dump, load on a replica, SELECT.
    Seen: both statements succeed. The first INSERT event lists
    <wh>/landing49/day1/part-... with partitions [] and no partitionLocations, the second
    places only p=2's file: the reported file went through Cmroot.where, whose `real`
    resolves the symlink, while the statement's partition directory (customPartitions,
    the catalog's location) keeps <wh>/landing49/current, so Ctx.partitionOf finds no
    partition for it. The replica's load then fails: "file outside its table's location
    ... does not say which partition holds it (recorded by an older cmroot): take a
    bootstrap of rev49s.sl". On 2efe158^ the walk listed <wh>/landing49/current/part-...,
    the daemon refused that path ("not a file on disk") and the statement failed saying
    the change was not recorded (fail closed, at write time).
    Expected: each INSERT event places p=1's file in partition p=1 (or the statement
    fails closed as before), and the replica loads and reads the source's rows. At fault:
    CmrootCommitProtocol.reported (a custom location's file spelt by Cmroot.where, not as
    the statement's partition directories are)."""
    s = src
    start = s.daemon.current()
    real = s.warehouse / "landing49" / "day1"
    real.mkdir(parents=True)
    link = s.warehouse / "landing49" / "current"
    link.symlink_to(real, target_is_directory=True)
    s.sql("CREATE DATABASE rev49s")
    s.sql("CREATE TABLE rev49s.sl (a INT, p INT) USING parquet PARTITIONED BY (p)")
    s.sql(f"ALTER TABLE rev49s.sl ADD PARTITION (p=1) LOCATION '{link}'")
    err1, ev1 = attempt(s, "INSERT INTO rev49s.sl PARTITION (p=1) VALUES (1)")
    err2, ev2 = attempt(s, "INSERT INTO rev49s.sl VALUES (2, 2)")
    if err1 or err2:  # 2efe158^: failed saying the change is not recorded (fail closed)
        assert "cmroot could not record the INSERT event" in (err1 or err2 or ""), (err1, err2)
        return
    in_p1 = [p for p, (spec, _) in placed(ev1 + ev2).items() if spec == {"p": "1"}]
    assert len(in_p1) == 2, brief(ev1 + ev2)
    now = sorted(list(r) for r in s.sql("SELECT a, p FROM rev49s.sl"))
    assert now == [[1, 1], [2, 2]]
    dump, _ = s.dump("rev49s", from_id=start)
    [after] = destination.run({"load": {"dump": dump},
                               "queries": {"t": "SELECT a, p FROM rev49s.sl"}})
    load_ok(after)
    assert after["rows"]["t"] == now, (after["rows"], brief(ev1 + ev2))


def test_break_an_insert_on_disk_into_a_partition_located_at_a_name_with_a_space(
    src: Source
) -> None:
    """Sequence (warehouse root disk://<base>/lake): CREATE TABLE rev49.dsp (a INT, p INT)
    USING parquet PARTITIONED BY (p) LOCATION 'disk://<lake>/dsp'; ALTER TABLE ADD
    PARTITION (p=1) LOCATION 'disk://<lake>/landing/sp ace'; INSERT INTO rev49.dsp
    VALUES (1, 1), (2, 2).
    Seen: the file lands at <lake>/landing/sp ace/part-00000-...; the INSERT event lists
    only p=2's file: the task reported the custom file as the URI
    disk://<lake>/landing/sp%20ace/part-... (Path.toUri().toString()), Cmroot.where ->
    uriKey builds a Hadoop Path from that string, which keeps `%20` literally, and
    landed() finds no file `sp%20ace/part-...`. (A lone INSERT INTO ... PARTITION (p=1)
    records no event at all.) The catalog's location reaches customPartitions the same
    way, so 2efe158^'s walk walked a missing directory and missed it too; `%25` and `%2F`
    in the name do the same, unicode does not.
    Expected: the INSERT lists both files, the one at disk://<lake>/landing/sp ace in p=1:
    a replica replaying it would lack row (1, 1). At fault: Cmroot.place/uriKey for a
    non-file URI (no percent-decoding), reached from CmrootCommitProtocol.reported and
    CmrootCommands.customPartitions."""
    s = src
    lk = lake(s)
    s.sql(f"CREATE TABLE {DB}.dsp (a INT, p INT) USING parquet PARTITIONED BY (p) "
          f"LOCATION 'disk://{lk}/dsp'")
    s.sql(f"ALTER TABLE {DB}.dsp ADD PARTITION (p=1) LOCATION 'disk://{lk}/landing/sp ace'")
    insert_checked(s, f"INSERT INTO {DB}.dsp VALUES (1, 1), (2, 2)", (lk,), scheme="disk://")


def test_break_truncate_and_drop_on_disk_of_a_partition_at_a_name_with_a_space(
    src: Source
) -> None:
    """Sequence: CREATE DATABASE rev49d LOCATION 'disk://<lake>/rev49d.db'; two managed
    tables t1, t2 (a INT, p INT) USING parquet PARTITIONED BY (p), each with p=1 at
    'disk://<lake>/land/<t> sp' and a row in p=1 and in p=2; TRUNCATE TABLE rev49d.t1;
    DROP TABLE rev49d.t2.
    Seen: TRUNCATE succeeds, every file is kept, but its TRUNCATE event names only p=2's
    file: p=1's (at `t1 sp`) is recycled by a DELETE event with no table (forTable's
    partition directories, read by customPartitions through Cmroot.where, spell it
    `t1%20sp`), so a replica replaying the events keeps row (1, 1) of t1. DROP TABLE fails:
    the daemon answers 400 "one table per recycle: ... are in different tables" (t2's
    custom file taken for another table's); the table cannot be dropped. Same on 2efe158^.
    Expected: TRUNCATE's event lists both files of t1; DROP TABLE succeeds with one
    DROP_TABLE event keeping every file of t2."""
    s = src
    lk = lake(s)
    s.sql(f"CREATE DATABASE rev49d LOCATION 'disk://{lk}/rev49d.db'")
    for t in ("t1", "t2"):
        s.sql(f"CREATE TABLE rev49d.{t} (a INT, p INT) USING parquet PARTITIONED BY (p)")
        s.sql(f"ALTER TABLE rev49d.{t} ADD PARTITION (p=1) LOCATION 'disk://{lk}/land/{t} sp'")
        s.sql(f"INSERT INTO rev49d.{t} VALUES (1, 1), (2, 2)")
    old = {"disk://" + p: b for p, b in snapshot(lk / "land", lk / "rev49d.db").items()}
    err, events = attempt(s, "TRUNCATE TABLE rev49d.t1")
    assert err is None, err
    assert unrecoverable(s, {p: b for p, b in old.items() if "/t1" in p}) == []
    truncated = [f["path"] for e in events if e["eventType"] == "TRUNCATE" for f in e["files"]
                 if not os.path.basename(f["path"]).startswith((".", "_"))]
    assert sorted(truncated) == sorted(p for p in old if "/t1" in p), brief(events)
    err, events = attempt(s, "DROP TABLE rev49d.t2")
    assert err is None, err
    assert unrecoverable(s, {p: b for p, b in old.items() if "/t2" in p}) == []


def test_break_a_partition_column_named_underscore_records_no_insert(src: Source) -> None:
    """Sequence: CREATE TABLE rev49.us (a INT, _ INT) USING parquet PARTITIONED BY (_);
    INSERT INTO rev49.us VALUES (1, 1); INSERT INTO rev49.us VALUES (2, 1).
    Seen: the table reads [(1, 1), (2, 1)] (Spark's file index reads `_=1`: a name with
    a '=' is no hidden one to it); the first INSERT records only ADD_PARTITION (no INSERT
    event), the second no event at all: a replica never gets row (2, 1). hiddenBelow
    (notData: a hidden directory name is a partition only with its '=' past index 1)
    drops the reported file, as 2efe158^'s walk did.
    Expected: each INSERT event lists the file it wrote into `_=1`."""
    s = src
    s.sql(f"CREATE TABLE {DB}.us (a INT, _ INT) USING parquet PARTITIONED BY (_)")
    s.sql(f"INSERT INTO {DB}.us VALUES (1, 1)")
    insert_checked(s, f"INSERT INTO {DB}.us VALUES (2, 1)", (tdir(s, "us"),))
    assert rows(s, f"SELECT a, _ FROM {DB}.us") == [(1, 1), (2, 1)]


# == attacks that held =======================================================================

# Custom partition locations, by partition value: directory names cmroot must spell as the
# file system has them.
ODD_DIRS = {"sp": "sp ace", "pc": "pc%25t", "sl": "s%2Ft", "un": "uni é中", "eq": "k=v",
            "pl": "pl+us#h"}
# A `:` in a name Spark's TRUNCATE cannot restore the permissions of (URISyntaxException,
# Spark's own): written and replicated, not truncated.
COLON = {"cl": "co:lon"}
# Values Spark escapes in a k=v directory name (`/`, `%`, `=`, `:`), and hidden-looking ones.
ODD_VALUES = ["a b", "c/d", "e%f", "g=h", "i:j", "é", "_x", ".y"]


def odd_table(s: Source, db: str, t: str, colon: bool = False) -> dict[str, dict[str, str]]:
    """db.t (a INT, p STRING) partitioned by p, a partition at each ODD_DIRS (and COLON)
    directory below <wh>/l49<db>/<t>; {custom directory: spec}."""
    s.sql(f"CREATE TABLE {db}.{t} (a INT, p STRING) USING parquet PARTITIONED BY (p)")
    out = {}
    for v, name in {**ODD_DIRS, **(COLON if colon else {})}.items():
        d = s.warehouse / f"l49{db}" / t / name
        s.sql(f"ALTER TABLE {db}.{t} ADD PARTITION (p='{v}') LOCATION '{d}'")
        out[str(d)] = {"p": v}
    return out


def odd_values(vals: list[str], start: int = 1) -> str:
    return ", ".join(f"({i}, '{v}')" for i, v in enumerate(vals, start))


def escaped(v: str) -> str:
    """A partition value as Spark names its directory (ExternalCatalogUtils.escapePathName)."""
    return "".join(f"%{ord(c):02X}" if c in '"#%\'*/:=?\\\x7f{[]^' or ord(c) < 0x20 else c
                   for c in v)


def default_dirs(s: Source, db: str, t: str) -> dict[str, dict[str, str]]:
    return {str(tdir(s, t, db) / f"p={escaped(v)}"): {"p": v} for v in ODD_VALUES}


def test_held_inserts_into_partitions_at_oddly_named_locations_and_escaped_values(
    src: Source
) -> None:
    """A table with partitions at custom locations named `sp ace`, `pc%25t`, `s%2Ft`,
    `uni é中`, `k=v`, `pl+us#h`, `co:lon`: one INSERT writing all of them and default partitions
    whose values Spark escapes ('c/d' -> p=c%2Fd, 'e%f', 'g=h', 'i:j', 'é', '_x', '.y');
    a static INSERT into one custom partition; a dynamic overwrite of custom and default
    partitions; a static overwrite of one custom partition. Each INSERT event lists exactly
    the new files, each in its partition at its directory."""
    s = src
    custom = odd_table(s, DB, "odd", colon=True)
    dirs = {**custom, **default_dirs(s, DB, "odd")}
    roots = (tdir(s, "odd"), s.warehouse / f"l49{DB}")
    everything = odd_values(list(ODD_DIRS) + list(COLON) + ODD_VALUES)
    insert_checked(s, f"INSERT INTO {DB}.odd VALUES {everything}", roots, dirs)
    insert_checked(s, f"INSERT INTO {DB}.odd PARTITION (p='pc') VALUES (20)", roots, dirs)
    with with_conf(s, "spark.sql.sources.partitionOverwriteMode", "dynamic"):
        insert_checked(s, f"INSERT OVERWRITE TABLE {DB}.odd VALUES "
                          f"(30, 'sp'), (31, 'un'), (32, 'c/d'), (33, '_x')", roots, dirs)
    insert_checked(s, f"INSERT OVERWRITE TABLE {DB}.odd PARTITION (p='sl') VALUES (40)",
                   roots, dirs)
    got = dict(rows(s, f"SELECT p, count(*) FROM {DB}.odd GROUP BY p"))
    assert got == {**{v: 1 for v in list(ODD_DIRS) + list(COLON) + ODD_VALUES}, "pc": 2}, got


def test_held_nested_partitions_with_hidden_looking_columns(src: Source) -> None:
    """(a INT, `_p` STRING, `.q` STRING) partitioned by (_p, .q), one partition at a
    custom location `x=1 %2F é` holding a k=v-looking name: an INSERT into it and into
    default partitions `_p=a b/.q=c%2Fd`; a static overwrite of the custom one."""
    s = src
    s.sql(f"CREATE TABLE {DB}.nest (a INT, _p STRING, `.q` STRING) USING parquet "
          "PARTITIONED BY (_p, `.q`)")
    d = s.warehouse / "l49n" / "x=1 %2F é"
    s.sql(f"ALTER TABLE {DB}.nest ADD PARTITION (_p='a b', `.q`='c/d') LOCATION '{d}'")
    dirs = {str(d): {"_p": "a b", ".q": "c/d"},
            str(tdir(s, "nest") / "_p=a b" / ".q=e%25f"): {"_p": "a b", ".q": "e%f"},
            str(tdir(s, "nest") / "_p=_z" / ".q=.y"): {"_p": "_z", ".q": ".y"}}
    roots = (tdir(s, "nest"), s.warehouse / "l49n")
    insert_checked(s, f"INSERT INTO {DB}.nest VALUES (1, 'a b', 'c/d'), (2, 'a b', 'e%f'), "
                      "(3, '_z', '.y')", roots, dirs)
    insert_checked(s, f"INSERT OVERWRITE TABLE {DB}.nest PARTITION (_p='a b', `.q`='c/d') "
                      "VALUES (4)", roots, dirs)
    assert rows(s, f"SELECT * FROM {DB}.nest") == [(2, "a b", "e%f"), (3, "_z", ".y"),
                                                     (4, "a b", "c/d")]


# A task of each of the 2 fails its first attempt after writing some rows (a JVM system
# property remembers the attempt), the retry writes into other partitions (p 200+, the
# failed attempt into p 100+).
RETRY = ("SELECT CAST(id AS INT) AS a, CAST(IF(reflect('java.lang.System', 'getProperty', "
         "concat('{k}.', spark_partition_id())) IS NULL, 100, 200) + spark_partition_id() "
         "AS INT) AS p FROM range(0, 10, 1, 2) WHERE IF(id % 5 = 3 AND reflect("
         "'java.lang.System', 'setProperty', concat('{k}.', spark_partition_id()), '1') "
         "IS NULL, raise_error('first attempt'), true)")


@pytest.mark.parametrize(("name", "version", "dynamic"), [
    ("rt1", "1", False), ("rt2", "2", False), ("rtd", "2", True)])
def test_held_a_task_retried_after_its_first_attempt_wrote(
    src: Source, name: str, version: str, dynamic: bool
) -> None:
    """INSERT (or a dynamic INSERT OVERWRITE) whose every task fails once after writing
    rows, then succeeds writing other partitions, with FileOutputCommitter v1 or v2: the
    INSERT lists exactly the retries' files (p=200, p=201), none of the failed attempts'
    (p=100, p=101 never appear)."""
    s = src
    s.sql(f"CREATE TABLE {DB}.{name} (a INT, p INT) USING parquet PARTITIONED BY (p)")
    s.sql(f"INSERT INTO {DB}.{name} VALUES (0, 100), (0, 7)")
    stmt = ("INSERT OVERWRITE TABLE" if dynamic else "INSERT INTO") + f" {DB}.{name} "
    with with_conf(s, "mapreduce.fileoutputcommitter.algorithm.version", version), \
            with_conf(s, "spark.hadoop.mapreduce.fileoutputcommitter.algorithm.version",
                      version), \
            with_conf(s, "spark.sql.sources.partitionOverwriteMode",
                      "dynamic" if dynamic else "static"):
        events = insert_checked(s, stmt + RETRY.format(k=f"r49.{name}"), (tdir(s, name),))
    assert [e["partitions"] for e in events if e["eventType"] == "INSERT"] == [
        [{"p": "200"}, {"p": "201"}]]
    assert dict(rows(s, f"SELECT p, count(*) FROM {DB}.{name} GROUP BY p")) == {
        7: 1, 100: 1, 200: 5, 201: 5}


def test_held_multi_insert_ctas_dataframe_writes_and_empty_inserts(src: Source) -> None:
    """FROM s INSERT INTO a (one partition at a custom location) INSERT INTO b; CTAS
    partitioned; df.write insertInto (append, overwrite) and saveAsTable (append); INSERT
    of zero rows into an unpartitioned table (Spark writes one empty file: listed) and a
    partitioned one (no file: no INSERT)."""
    s = src
    s.sql(f"CREATE TABLE {DB}.ms USING parquet AS SELECT CAST(id AS INT) a FROM range(4)")
    s.sql(f"CREATE TABLE {DB}.ma (a INT, p INT) USING parquet PARTITIONED BY (p)")
    s.sql(f"CREATE TABLE {DB}.mb (a INT) USING parquet")
    loc = s.warehouse / "l49m" / "ma p1"
    s.sql(f"ALTER TABLE {DB}.ma ADD PARTITION (p=1) LOCATION '{loc}'")
    roots = (tdir(s, "ma"), tdir(s, "mb"), loc.parent)
    insert_checked(s, f"FROM {DB}.ms INSERT INTO {DB}.ma SELECT a, a % 2 "
                      f"INSERT INTO {DB}.mb SELECT a", roots,
                   {str(loc): {"p": "1"}, str(tdir(s, "ma") / "p=0"): {"p": "0"}})
    insert_checked(s, f"CREATE TABLE {DB}.ct USING parquet PARTITIONED BY (p) AS "
                      "SELECT 1 a, 2 p", (tdir(s, "ct"),))
    df = s.spark.sql("SELECT 5 a, 6 p")
    for mode, how in (("append", "insertInto"), ("append", "saveAsTable"),
                      ("overwrite", "insertInto")):
        before = kept(tdir(s, "ct"))
        since = s.daemon.current()
        writer = df.write.mode(mode)
        if how == "saveAsTable":
            writer.partitionBy("p").saveAsTable(f"{DB}.ct")
        else:
            writer.insertInto(f"{DB}.ct")
        events = s.daemon.events_after(since)
        new = sorted(p for p, b in kept(tdir(s, "ct")).items() if before.get(p) != b)
        assert inserted(events) == new and new, brief(events)
    s.sql(f"CREATE TABLE {DB}.em (a INT) USING parquet")
    s.sql(f"CREATE TABLE {DB}.emp (a INT, p INT) USING parquet PARTITIONED BY (p)")
    insert_checked(s, f"INSERT INTO {DB}.em SELECT 1 WHERE false", (tdir(s, "em"),))
    assert insert_checked(s, f"INSERT INTO {DB}.emp SELECT 1, 1 WHERE false",
                          (tdir(s, "emp"),)) == []


def failed_multi_insert(
    s: Source, name: str, overwrite: str, db: str = DB
) -> tuple[Any, ...]:
    """db.<name>a (a INT, p INT) partitioned by p, p=1 at a custom location, rows (1, 1) and
    (2, 2); `FROM <name>s <overwrite> ... INSERT INTO <name>b <a task raises>`: (error,
    events, data files before, after, rows after, partitions after)."""
    s.sql(f"CREATE TABLE {db}.{name}s USING parquet AS SELECT CAST(id AS INT) a FROM range(4)")
    s.sql(f"CREATE TABLE {db}.{name}a (a INT, p INT) USING parquet PARTITIONED BY (p)")
    s.sql(f"CREATE TABLE {db}.{name}b (a INT) USING parquet")
    loc = s.warehouse / "l49f" / f"{name} p1"
    s.sql(f"ALTER TABLE {db}.{name}a ADD PARTITION (p=1) LOCATION '{loc}'")
    s.sql(f"INSERT INTO {db}.{name}a VALUES (1, 1), (2, 2)")
    roots = (tdir(s, f"{name}a", db), tdir(s, f"{name}b", db), loc)
    before = snapshot(*roots)
    err, events = attempt(s, f"FROM {db}.{name}s {overwrite.format(t=f'{db}.{name}a')} "
                             f"INSERT INTO {db}.{name}b SELECT IF(a > 2, raise_error('boom'), a)")
    assert err is not None and "boom" in err
    return (err, events, before, snapshot(*roots), rows(s, f"SELECT a, p FROM {db}.{name}a"),
            sorted(r[0] for r in s.sql(f"SHOW PARTITIONS {db}.{name}a")))


def test_break_a_failed_multi_insert_whole_table_overwrite_drops_a_partition(
    src: Source, destination: Destination
) -> None:
    """Sequence: CREATE TABLE rev49.fwa (a INT, p INT) USING parquet PARTITIONED BY (p);
    p=1 at a custom location; INSERT INTO fwa VALUES (1, 1), (2, 2); FROM fws (a = 0..3)
    INSERT OVERWRITE TABLE fwa SELECT a, 1 INSERT INTO fwb SELECT IF(a > 2,
    raise_error('boom'), a).
    Seen: the statement fails (boom); every file of fwa is back byte for byte, no INSERT
    event; but fwa reads [(1, 1)] and SHOW PARTITIONS lists p=1 only: the first insert's
    command dropped p=2 (emptied by the overwrite) from the catalog after its job
    committed, the rollback restored p=2's file into a directory no partition names, and a
    DROP_PARTITION p=2 event (no files) was recorded. Neither the table before the
    statement nor Spark's own outcome (p=1 holding 0..3). Same on 2efe158^.
    Expected: a failed statement leaves nothing half applied: fwa reads [(1, 1), (2, 2)]
    with partitions p=1, p=2, and no event is recorded.
    FIXED as far as the catalog allows: the rollback puts the dropped partition back in
    the catalog (CmrootCommands.partitionsRestorer). The metastore made the drop and
    records it; it records the re-add too (ADD_PARTITION with p=2's file), so a replica
    replaying both ends with the source's rows."""
    start = src.daemon.current()
    src.sql("CREATE DATABASE rev49f")
    _, events, before, after, got, parts = failed_multi_insert(
        src, "fw", "INSERT OVERWRITE TABLE {t} SELECT a, 1", "rev49f")
    assert after == before and inserted(events) == [], brief(events)
    assert (got, parts) == ([(1, 1), (2, 2)], ["p=1", "p=2"]), brief(events)
    p2 = sorted(p for p in before if "/p=2/" in p and not os.path.basename(p).startswith("."))
    assert [(e["eventType"], e["partitions"], sorted(f["path"] for f in e["files"]))
            for e in events] == [("DROP_PARTITION", [{"p": "2"}], []),
                                 ("ADD_PARTITION", [{"p": "2"}], p2)], brief(events)
    dump, _ = src.dump("rev49f", from_id=start)
    [replica] = destination.run({"load": {"dump": dump},
                                 "queries": {"t": "SELECT a, p FROM rev49f.fwa"}})
    load_ok(replica)
    assert replica["rows"]["t"] == [[1, 1], [2, 2]], replica["rows"]


def test_held_a_failed_multi_insert_partition_overwrite_leaves_nothing(src: Source) -> None:
    """FROM s INSERT OVERWRITE TABLE a PARTITION (p=1) (a custom location) ... INSERT INTO
    b <a task raises>: the statement fails; a's old file is back and none of the job's
    files stays, no event is recorded, a reads its old rows."""
    _, events, before, after, got, parts = failed_multi_insert(
        src, "fp", "INSERT OVERWRITE TABLE {t} PARTITION (p=1) SELECT a")
    assert after == before, brief(events)
    assert events == [], brief(events)
    assert (got, parts) == ([(1, 1), (2, 2)], ["p=1", "p=2"])


def test_held_drops_and_truncates_keep_files_at_custom_locations(src: Source) -> None:
    """Managed tables with partitions at custom locations (named `sp ace`, `s%2Ft`...):
    ALTER TABLE DROP PARTITION of a custom one, TRUNCATE TABLE, DROP TABLE (unpartitioned
    and partitioned): every file that went resolves from the cmroot, and the events name
    it under the table."""
    s = src
    for t in ("dp", "tr", "dt"):
        dirs = odd_table(s, DB, t)
        s.sql(f"INSERT INTO {DB}.{t} VALUES {odd_values([*ODD_DIRS, 'a b'])}")
        assert len(dirs) == len(ODD_DIRS)
    s.sql(f"CREATE TABLE {DB}.du USING parquet AS SELECT 1 a")
    for stmt, t in ((f"ALTER TABLE {DB}.dp DROP PARTITION (p='sl')", "dp"),
                    (f"TRUNCATE TABLE {DB}.tr", "tr"), (f"DROP TABLE {DB}.dt", "dt"),
                    (f"DROP TABLE {DB}.du", "du")):
        roots = (tdir(s, t), s.warehouse / f"l49{DB}" / t)
        before = snapshot(*roots)
        err, events = attempt(s, stmt)
        assert err is None, err
        gone = {p: b for p, b in before.items() if snapshot(*roots).get(p) != b}
        assert gone, stmt
        assert unrecoverable(s, gone) == []
        named = {f["path"] for e in events if e["table"] == t for f in e["files"]}
        assert set(gone) <= named, brief(events)
    assert rows(s, f"SELECT count(*) FROM {DB}.dp") == [(len(ODD_DIRS),)]
    assert rows(s, f"SELECT count(*) FROM {DB}.tr") == [(0,)]


def test_held_an_insert_on_disk_with_escaped_partition_values(src: Source) -> None:
    """On disk:// (a table at disk://<lake>/dv): one INSERT into partitions 'a b', 'c/d',
    'e%f', 'g=h', 'i:j', 'é', '_x', '.y': the event lists each new file by its disk:// path
    (the walk's spelling), the replica-relevant place of every row."""
    s = src
    lk = lake(s)
    s.sql(f"CREATE TABLE {DB}.dv (a INT, p STRING) USING parquet PARTITIONED BY (p) "
          f"LOCATION 'disk://{lk}/dv'")
    insert_checked(s, f"INSERT INTO {DB}.dv VALUES {odd_values(ODD_VALUES)}", (lk / "dv",),
                   scheme="disk://")
    assert len(rows(s, f"SELECT * FROM {DB}.dv")) == len(ODD_VALUES)


def test_held_a_replica_of_odd_locations_values_retries_and_overwrites(
    src: Source, destination: Destination
) -> None:
    """Database rev49r: the odd table (custom locations with special names, escaped
    values) written, appended in a static partition, dynamically and statically
    overwritten, and a table written by a retried task with the v2 committer; dump, load:
    the replica reads the source's rows."""
    s = src
    start = s.daemon.current()
    s.sql("CREATE DATABASE rev49r")
    odd_table(s, "rev49r", "odd", colon=True)
    s.sql(f"INSERT INTO rev49r.odd VALUES {odd_values(list(ODD_DIRS) + list(COLON) + ODD_VALUES)}")
    s.sql("INSERT INTO rev49r.odd PARTITION (p='pc') VALUES (20)")
    with with_conf(s, "spark.sql.sources.partitionOverwriteMode", "dynamic"):
        s.sql("INSERT OVERWRITE TABLE rev49r.odd VALUES (30, 'sp'), (31, 'c/d')")
    s.sql("INSERT OVERWRITE TABLE rev49r.odd PARTITION (p='sl') VALUES (40)")
    s.sql("CREATE TABLE rev49r.rt (a INT, p INT) USING parquet PARTITIONED BY (p)")
    with with_conf(s, "spark.hadoop.mapreduce.fileoutputcommitter.algorithm.version", "2"):
        s.sql("INSERT INTO rev49r.rt " + RETRY.format(k="r49.rev49r"))
    q = {t: f"SELECT * FROM rev49r.{t}" for t in ("odd", "rt")}
    now = {t: sorted(list(r) for r in s.sql(sql)) for t, sql in q.items()}
    dump, _ = s.dump("rev49r", from_id=start)
    [after] = destination.run({"load": {"dump": dump}, "queries": q})
    load_ok(after)
    assert after["rows"] == now

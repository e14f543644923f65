"""Review 21: a hostile review of Spark's hook over a REMOTE Hive metastore that runs the
cmroot metastore plugin (spark.hadoop.hive.metastore.uris, spark.cmroot.metastorePlugin=true),
and of the JVM core's HTTP/JSON client.

One in-process Spark `Source` over a standalone metastore with the plugin (as in
tests/metastore/test_remote_replication.py), one shared replication destination. Each test
names the invariant it attacks and its sequence. The tests that restart the metastore
without the plugin run last (they put it back when done)."""

from __future__ import annotations

import io
import os
import shutil
import stat
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.metastore.conftest import metastore_conf
from tests.metastore.hms import Metastore, spark_remote_conf, start_metastore
from tests.repl.conftest import Destination, SharedDestination, Source
from tests.spark.sparklib import Daemon, app_conf, hooked_lake

pytestmark = pytest.mark.timeout(900)

PLUGIN_KEYS: list[str] = []


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    pytest.importorskip("pyspark")
    base = tmp_path_factory.mktemp("review21-source")
    started: list[Metastore] = []

    def remote(daemon: Daemon) -> Mapping[str, str]:
        conf = metastore_conf("--url", daemon.url)
        PLUGIN_KEYS[:] = list(conf["properties"])
        ms = start_metastore(base / "hms", daemon.warehouse, conf["properties"],
                             conf["classpath"])
        started.append(ms)
        return spark_remote_conf(ms.uri, daemon.warehouse) | {
            "spark.cmroot.metastorePlugin": "true"}

    try:
        with hooked_lake(base, Source, extra=remote) as src:
            src.metastore = started[0]  # type: ignore[attr-defined]
            yield src
    finally:
        for ms in started:
            ms.stop()


@pytest.fixture(scope="module")
def destination(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Destination]:
    d = SharedDestination(tmp_path_factory.mktemp("review21-dest") / "destination")
    try:
        yield d
    finally:
        d.close()


def files_of(top: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(top.rglob("*"))
            if p.is_file() and not stat.S_ISFIFO(p.lstat().st_mode)}


def served(source: Source, path: str, checksum: str) -> bytes:
    buf = io.BytesIO()
    source.daemon.client.get(path, checksum, buf)
    return buf.getvalue()


def kept(source: Source, since: int) -> dict[str, bytes]:
    """Every file the events after `since` carry, as the daemon serves it back."""
    out = {}
    for e in source.daemon.events_after(since):
        for f in e.get("files", []):
            if f.get("checksum"):
                out[f["path"]] = served(source, f["path"], f["checksum"])
    return out


def lost(source: Source, before: dict[str, bytes], since: int) -> list[str]:
    """Files of `before` neither in place (same bytes) nor served back by an event."""
    stored = kept(source, since)
    return sorted(p for p, data in before.items()
                  if not (Path(p).is_file() and Path(p).read_bytes() == data)
                  and stored.get(p) != data)


def kinds(source: Source, since: int) -> list[tuple[str, str, list[Any]]]:
    return [(e["eventType"], e["table"], e["partitions"])
            for e in source.daemon.events_after(since)]


# -- DROP PARTITION: one statement, one unit -----------------------------------------------


def test_a_drop_of_two_partitions_with_one_refused_is_all_or_nothing(source: Source) -> None:
    """Invariant 2 (a statement is one unit). `ALTER TABLE t DROP PARTITION (p=1),
    PARTITION (p=2)` where p=2 holds a FIFO the daemon refuses to keep. Spark's Hive client
    drops the partitions one metastore call at a time, and with metastorePlugin=true the hook
    no longer stages every named partition up front (CmrootStatementCommand skips
    CmrootDropPartitions.stage): the plugin keeps p=1 in its own call, then refuses p=2. The
    statement fails, yet p=1 is gone from the catalog and the disk: half applied. Either both
    partitions must stay (nothing dropped), or both be gone with their bytes kept."""
    source.sql("CREATE DATABASE IF NOT EXISTS r21")
    source.sql("CREATE TABLE r21.dp (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r21.dp VALUES (1, 1), (2, 2)")
    top = source.table_dir("dp", "r21")
    pipe = top / "p=2" / "pipe"
    os.mkfifo(pipe)
    try:
        since = source.daemon.current()
        with pytest.raises(Exception, match="cmroot"):
            source.sql("ALTER TABLE r21.dp DROP PARTITION (p=1), PARTITION (p=2)")
        parts = source.partitions("r21.dp")
        events = kinds(source, since)
    finally:
        pipe.unlink()
    assert parts in (["p=1", "p=2"], []), (
        f"half applied: the failed statement left partitions {parts}; events {events}")


# -- INSERT OVERWRITE over a remote catalog, replicated ------------------------------------


def test_a_static_overwrite_that_empties_partitions_replicates(
        source: Source, destination: Destination) -> None:
    """Invariant 4 (the replica ends as the source). A datasource table with p=1, p=2;
    `INSERT OVERWRITE TABLE t SELECT 5, 3` (static mode) deletes both partitions' files (Spark's
    hook keeps them, INSERT_OVERWRITE at the statement's end), drops p=1 and p=2 from the
    catalog with retainData (the plugin records DROP_PARTITION during the statement) and adds
    p=3 (ADD_PARTITION, during the statement). Loaded on a replica, the table must have only
    p=3 and the row (5, 3)."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE IF NOT EXISTS r21o")
    source.sql("CREATE TABLE r21o.t (a INT, p INT) USING parquet PARTITIONED BY (p)")
    source.sql("INSERT INTO r21o.t VALUES (1, 1), (2, 2)")
    url0, h0 = source.dump("r21o", from_id=start)
    since = source.daemon.current()
    source.sql("INSERT OVERWRITE TABLE r21o.t SELECT 5, 3")
    events = kinds(source, since)
    url1, _ = source.dump("r21o", from_id=h0.last_event_id)
    assert source.partitions("r21o.t") == ["p=3"]
    q = {"t": "SELECT a, p FROM r21o.t"}
    first, second = destination.run(
        {"load": {"dump": url0}, "queries": q, "partitions": ["r21o.t"]},
        {"load": {"dump": url1}, "queries": q, "partitions": ["r21o.t"]})
    assert first["rows"]["t"] == [[1, 1], [2, 2]], first
    assert "error" not in second["load"], (second["load"], events)
    assert second["rows"]["t"] == [[5, 3]], (second, events)
    assert second["partitions"]["r21o.t"] == ["p=3"], (second, events)


def test_a_hive_table_dynamic_overwrite_truncate_and_load_replicate(
        source: Source, destination: Destination) -> None:
    """Invariant 4. A Hive-format (STORED AS PARQUET) partitioned table: a dynamic INSERT
    OVERWRITE that replaces p=1 and creates p=3 (Hive's loadDynamicPartitions in Spark's JVM,
    ADD_PARTITION recorded by the plugin in the metastore), TRUNCATE TABLE ... PARTITION (p=2),
    then LOAD DATA INPATH into p=4 (a partition the load creates). Replayed on a replica, the
    rows and partitions must match the source, and each file the source replaced or emptied
    must have been kept once."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE IF NOT EXISTS r21h")
    source.sql("CREATE TABLE r21h.h (a INT) PARTITIONED BY (p INT) STORED AS PARQUET")
    source.sql("INSERT INTO r21h.h PARTITION (p=1) VALUES (1)")
    source.sql("INSERT INTO r21h.h PARTITION (p=2) VALUES (2)")
    source.sql("CREATE TABLE r21h.src (a INT) STORED AS PARQUET")
    source.sql("INSERT INTO r21h.src VALUES (40)")
    url0, h0 = source.dump("r21h", from_id=start)
    top = source.table_dir("h", "r21h")
    before = files_of(top)
    since = source.daemon.current()
    source.sql("SET hive.exec.dynamic.partition.mode=nonstrict")
    source.sql("INSERT OVERWRITE TABLE r21h.h PARTITION (p) "
               "SELECT * FROM VALUES (10, 1), (30, 3) AS v(a, p)")
    source.sql("TRUNCATE TABLE r21h.h PARTITION (p=2)")
    landing = source.warehouse / "r21-landing"
    landing.mkdir(exist_ok=True)
    for f in source.table_dir("src", "r21h").iterdir():
        if not f.name.startswith((".", "_")):
            shutil.copy(f, landing / f.name)
    source.sql(f"LOAD DATA INPATH '{landing}' INTO TABLE r21h.h PARTITION (p=4)")
    events = kinds(source, since)
    gone = lost(source, before, since)
    want_rows = source.rows("SELECT a, p FROM r21h.h")
    want_parts = source.partitions("r21h.h")
    assert want_rows == [[10, 1], [30, 3], [40, 4]], want_rows
    url1, _ = source.dump("r21h", from_id=h0.last_event_id)
    q = {"h": "SELECT a, p FROM r21h.h"}
    first, second = destination.run(
        {"load": {"dump": url0}, "queries": q},
        {"load": {"dump": url1}, "queries": q, "partitions": ["r21h.h"]})
    assert first["rows"]["h"] == [[1, 1], [2, 2]], first
    assert not gone, f"replaced and not kept: {gone}; events {events}"
    assert "error" not in second["load"], (second["load"], events)
    assert second["rows"]["h"] == want_rows, (second, events)
    assert second["partitions"]["r21h.h"] == want_parts, (second, events)


def test_save_as_table_overwrite_replicates(source: Source, destination: Destination) -> None:
    """Invariants 1, 4. `df.write.mode("overwrite").saveAsTable(t)` over an existing table:
    Spark drops the table through the metastore (the plugin keeps it: DROP_TABLE), creates it
    again and writes it (Spark's hook). Every old file kept once, and a replica ends with the
    new rows only."""
    start = source.daemon.current()
    source.sql("CREATE DATABASE IF NOT EXISTS r21s")
    source.sql("CREATE TABLE r21s.t (a INT) USING parquet")
    source.sql("INSERT INTO r21s.t VALUES (1), (2)")
    url0, h0 = source.dump("r21s", from_id=start)
    before = files_of(source.table_dir("t", "r21s"))
    since = source.daemon.current()
    source.spark.range(3).selectExpr("CAST(id + 7 AS INT) AS a").write.mode(
        "overwrite").format("parquet").saveAsTable("r21s.t")
    events = kinds(source, since)
    gone = lost(source, before, since)
    url1, _ = source.dump("r21s", from_id=h0.last_event_id)
    q = {"t": "SELECT a FROM r21s.t"}
    _, second = destination.run({"load": {"dump": url0}, "queries": q},
                                {"load": {"dump": url1}, "queries": q})
    assert not gone, f"dropped and not kept: {gone}; events {events}"
    assert "error" not in second["load"], (second["load"], events)
    assert second["rows"]["t"] == [[7], [8], [9]], (second, events)


def test_a_unicode_partition_value_overwritten_is_kept_at_its_path(source: Source) -> None:
    """Invariant 1, and Json.write/parse of non-ASCII text. A partition value 'é☃𝄞' (one
    character outside the BMP: a surrogate pair in Java) and a quote in the column's data;
    INSERT OVERWRITE of that partition: the old file's event names it at its real path on
    disk, its partition value round-trips, and the daemon serves back its bytes."""
    source.sql("CREATE DATABASE IF NOT EXISTS r21u")
    source.sql("CREATE TABLE r21u.t (a STRING, p STRING) USING parquet PARTITIONED BY (p)")
    value = "é☃𝄞"
    source.sql(f"INSERT INTO r21u.t VALUES ('x\"\\\\y', '{value}')")
    before = files_of(source.table_dir("t", "r21u") / f"p={value}")
    assert before, before
    since = source.daemon.current()
    source.sql(f"INSERT OVERWRITE TABLE r21u.t PARTITION (p='{value}') SELECT 'z'")
    events = source.daemon.events_after(since)
    over = [e for e in events if e["eventType"] == "INSERT_OVERWRITE"]
    assert len(over) == 1 and over[0]["partitions"] == [{"p": value}], events
    assert sorted(f["path"] for f in over[0]["files"]) == sorted(before), over[0]["files"]
    assert not lost(source, before, since), events
    assert source.rows("SELECT a, p FROM r21u.t") == [["z", value]]


# -- the JVM core's JSON reader -------------------------------------------------------------


def test_json_parse_of_a_deeply_nested_answer_is_an_argument_error(source: Source) -> None:
    """Bad input must be refused, not crash: Json.parse documents IllegalArgumentException
    for text that is not JSON (Answer.json() turns exactly that into an IOException the
    statement reports). An answer of 100 000 '[' (a truncated or hostile body) recurses
    once per bracket and throws StackOverflowError, an Error every catch of
    IOException/RuntimeException in the hook and the plugin lets through (in the metastore it
    takes down the handler thread's call instead of failing it with cmroot's message)."""
    jvm = source.spark.sparkContext._jvm
    from py4j.protocol import Py4JJavaError

    with pytest.raises(Exception) as e:
        jvm.io.cmroot.core.Json.parse("[" * 100_000)
    cls = (e.value.java_exception.getClass().getName() if isinstance(e.value, Py4JJavaError)
           else type(e.value).__name__)
    assert cls in ("java.lang.IllegalArgumentException", "IllegalArgumentException"), cls


def test_json_parse_refuses_what_is_not_json(source: Source) -> None:
    """Json.parse must refuse text that is not JSON rather than read a value out of it: a
    daemon answer `{"id": 01}` or `{"id": +5}` or `{"n": 1-2}` is not JSON (RFC 8259 has no
    leading zero, no '+', no inner '-')."""
    jvm = source.spark.sparkContext._jvm
    accepted = {}
    for text in ['{"id": 01}', '{"id": +5}', '{"n": 1-2}', '[1,]', '{"a":1,}']:
        try:
            accepted[text] = str(jvm.io.cmroot.core.Json.parse(text))
        except Exception:  # refused (py4j's error, or pyspark's translation of it)
            pass
    assert not accepted, f"not JSON, yet parsed: {accepted}"


def test_a_read_only_query_does_not_need_the_token_file(source: Source) -> None:
    """Bad input must not crash what deletes nothing. spark.cmroot.tokenFile naming a file
    that is missing for a moment (a rotation that removes and rewrites it): the token is read
    at every Cmroot.settings() call, and the analyzer rules (WrapStatements, the remote-drop
    check) call it for every plan, so `SELECT 1` fails with "cannot read the token file",
    though it neither deletes nor records anything."""
    missing = source.base / "rotating.token"
    with app_conf(source.spark, "spark.cmroot.tokenFile", str(missing)):
        rows = source.rows("SELECT 1")
    assert rows == [[1]]


# -- a metastore that does not run the plugin (run last: restarts the metastore) ------------


def _restart_without_plugin(ms: Metastore) -> str:
    site = ms.base / "conf" / "hive-site.xml"
    original = site.read_text()
    root = ET.fromstring(original)
    for prop in list(root):
        name = prop.findtext("name")
        if name in PLUGIN_KEYS and name != "hive.metastore.warehouse.dir":
            root.remove(prop)
    site.write_text(ET.tostring(root, encoding="unicode"))
    ms.restart()
    return original


@pytest.fixture(scope="module")
def unplugged(source: Source) -> Iterator[Source]:
    """The same metastore (same URI, same catalog) restarted without the cmroot plugin's
    settings, as after an administrator's upgrade that lost them; put back afterwards."""
    ms: Metastore = source.metastore  # type: ignore[attr-defined]
    site = ms.base / "conf" / "hive-site.xml"
    original = _restart_without_plugin(ms)
    try:
        source.sql("SHOW DATABASES")  # the client reconnects
        yield source
    finally:
        site.write_text(original)
        ms.restart()


def test_save_as_table_overwrite_is_refused_without_the_plugin(unplugged: Source) -> None:
    """Invariant 1. metastorePlugin=false and a remote metastore: DROP TABLE is refused
    ("metastore is remote"), but `df.write.mode("overwrite").saveAsTable(t)` over an existing
    managed table drops it through the same metastore (SessionCatalog.dropTable inside
    DataFrameWriter, no DropTableCommand for the check rule to see), which deletes the files
    in its process, unkept. It must be refused like DROP TABLE, or its files kept."""
    source = unplugged
    source.sql("CREATE DATABASE IF NOT EXISTS r21n")
    source.sql("CREATE TABLE r21n.t (a INT) USING parquet")
    source.sql("INSERT INTO r21n.t VALUES (1), (2)")
    with app_conf(source.spark, "spark.cmroot.metastorePlugin", "false"):
        with pytest.raises(Exception, match="metastore is remote"):
            source.sql("DROP TABLE r21n.t")
        before = files_of(source.table_dir("t", "r21n"))
        since = source.daemon.current()
        try:
            source.spark.range(1).selectExpr("CAST(id AS INT) AS a").write.mode(
                "overwrite").format("parquet").saveAsTable("r21n.t")
        except Exception as e:  # refused: nothing may be gone
            assert "remote" in str(e), e
        gone = lost(source, before, since)
    assert not gone, f"deleted by the metastore and not kept: {gone}"


def test_a_drop_declared_protected_by_a_metastore_without_the_plugin(unplugged: Source) -> None:
    """Invariant 1. spark.cmroot.metastorePlugin=true, but the metastore at
    hive.metastore.uris does not run the plugin: Spark's hook trusts the flag, leaves the
    DROP TABLE to the metastore, which deletes the files unkept. Nothing checks that the
    metastore answering actually runs the plugin: the drop must be refused or kept."""
    source = unplugged
    source.sql("CREATE DATABASE IF NOT EXISTS r21n")
    source.sql("CREATE TABLE r21n.d (a INT) USING parquet")
    source.sql("INSERT INTO r21n.d VALUES (1)")
    before = files_of(source.table_dir("d", "r21n"))
    since = source.daemon.current()
    try:
        source.sql("DROP TABLE r21n.d")
    except Exception as e:  # refused: nothing may be gone
        assert "cmroot" in str(e), e
    gone = lost(source, before, since)
    assert not gone, f"deleted by the metastore and not kept: {gone}"

"""Self-test of the metastore harness: a real Hive 2.3 metastore (no plugin) driven through
HmsClient deletes the directories of dropped managed partitions and tables itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.metastore.hms import Metastore, spark_remote_conf, start_metastore
from tests.metastore.thrift_client import HmsClient, NoSuchObjectException

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def metastore(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Metastore]:
    base = tmp_path_factory.mktemp("hms")
    with start_metastore(base, base / "warehouse", properties={}, classpath=[]) as ms:
        yield ms


def test_drops_delete_directories(metastore: Metastore, tmp_path: Path) -> None:
    db_dir = tmp_path / "sales.db"
    with HmsClient(metastore.uri) as hms:
        hms.create_database("sales", db_dir)
        hms.create_table(
            "sales",
            "orders",
            db_dir / "orders",
            columns=[("id", "bigint"), ("amount", "double")],
            partition_keys=[("day", "string")],
        )
        hms.add_partition("sales", "orders", ["2024-01-01"])
        hms.add_partition("sales", "orders", ["2024-01-02"])
        assert hms.list_partition_names("sales", "orders") == ["day=2024-01-01", "day=2024-01-02"]

        table = hms.get_table("sales", "orders")
        assert table.tableType == "MANAGED_TABLE"
        assert table.sd.serdeInfo.serializationLib.endswith("ParquetHiveSerDe")
        p1 = db_dir / "orders" / "day=2024-01-01"
        p2 = db_dir / "orders" / "day=2024-01-02"
        assert p1.is_dir() and p2.is_dir()  # the metastore made them
        (p1 / "part-0.parquet").write_bytes(b"not really parquet")
        (p2 / "part-0.parquet").write_bytes(b"not really parquet")

        dropped = hms.drop_partitions("sales", "orders", ["day=2024-01-01"])
        assert [p.values for p in dropped] == [["2024-01-01"]]
        assert not p1.exists()
        assert p2.is_dir()
        assert hms.list_partition_names("sales", "orders") == ["day=2024-01-02"]

        hms.drop_table("sales", "orders")
        assert not (db_dir / "orders").exists()
        with pytest.raises(NoSuchObjectException, match="orders"):
            hms.get_table("sales", "orders")
        assert db_dir.is_dir()


def test_external_table_keeps_files(metastore: Metastore, tmp_path: Path) -> None:
    loc = tmp_path / "ext"
    with HmsClient(metastore.uri) as hms:
        hms.create_database("ext_db", tmp_path / "ext_db.db")
        hms.create_table(
            "ext_db",
            "t",
            loc,
            columns=[("a", "int")],
            partition_keys=[("p", "int")],
            external=True,
            file_format="text",
        )
        hms.add_partition("ext_db", "t", ["1"])
        (loc / "p=1" / "data.csv").write_text("1\n")
        hms.drop_partition("ext_db", "t", ["1"])
        hms.drop_table("ext_db", "t", purge=True)
        assert (loc / "p=1" / "data.csv").exists()


def test_spark_conf_names_the_uri(metastore: Metastore) -> None:
    conf = spark_remote_conf(metastore.uri)
    assert conf["spark.hadoop.hive.metastore.uris"] == metastore.uri
    assert conf["spark.sql.catalogImplementation"] == "hive"

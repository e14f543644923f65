"""Table definitions recorded by the hook become the right CREATE TABLE on a destination;
names and values are quoted so no definition can inject SQL."""

from __future__ import annotations

import json

import pytest

from cmroot.exceptions import ReplError
from cmroot.repl import tabledef

SCHEMA = {"type": "struct", "fields": [
    {"name": "a", "type": "integer", "nullable": True, "metadata": {}},
    {"name": "m", "type": {"type": "map", "keyType": "string", "valueType": "long",
                           "valueContainsNull": True}, "nullable": True, "metadata": {}},
    {"name": "p", "type": "string", "nullable": True, "metadata": {}},
]}


def datasource(**params: str) -> dict[str, object]:
    text = json.dumps(SCHEMA)
    return {
        "db": "s", "table": "t", "tableType": "MANAGED_TABLE", "location": "/wh/s.db/t/",
        "columns": [{"name": "col", "type": "array<string>"}],
        "partitionKeys": [{"name": "p", "type": "string"}],
        "parameters": {
            "spark.sql.sources.provider": "parquet",
            "spark.sql.sources.schema.numParts": "2",
            "spark.sql.sources.schema.part.0": text[:20],
            "spark.sql.sources.schema.part.1": text[20:],
            "spark.sql.sources.schema.numPartCols": "1",
            "spark.sql.sources.schema.partCol.0": "p",
            "transient_lastDdlTime": "1", "numFiles": "3", "repl.last.id": "7",
            **params,
        },
        "serdeParameters": {"path": "/wh/s.db/t", "compression": "zstd"},
    }


def test_datasource_table() -> None:
    obj = datasource(owner="it's me")
    assert tabledef.location(obj) == "/wh/s.db/t"
    assert tabledef.partition_columns(obj) == ["p"]
    assert tabledef.columns(obj) == [("a", "int"), ("m", "map<string,bigint>"), ("p", "string")]
    assert tabledef.create_sql(obj, "dr", "t2") == (
        "CREATE TABLE IF NOT EXISTS `dr`.`t2` (`a` int, `m` map<string,bigint>, `p` string) "
        "USING parquet PARTITIONED BY (`p`) OPTIONS ('compression'='zstd') "
        "TBLPROPERTIES ('owner'='it\\'s me')"
    )


def test_hive_table() -> None:
    obj = {
        "db": "s", "table": "h", "location": "/wh/s.db/h",
        "columns": [{"name": "a", "type": "int"}, {"name": "b`c", "type": "string"}],
        "partitionKeys": [{"name": "d", "type": "date"}],
        "parameters": {},
        "serde": "org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe",
        "serdeParameters": {"field.delim": ","},
        "inputFormat": "org.apache.hadoop.mapred.TextInputFormat",
        "outputFormat": "org.apache.hadoop.hive.ql.io.HiveIgnoreKeyTextOutputFormat",
    }
    assert tabledef.create_sql(obj, "s", "h") == (
        "CREATE TABLE IF NOT EXISTS `s`.`h` (`a` int, `b``c` string) PARTITIONED BY (`d` date) "
        "ROW FORMAT SERDE 'org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe' "
        "WITH SERDEPROPERTIES ('field.delim'=',') "
        "STORED AS INPUTFORMAT 'org.apache.hadoop.mapred.TextInputFormat' "
        "OUTPUTFORMAT 'org.apache.hadoop.hive.ql.io.HiveIgnoreKeyTextOutputFormat'"
    )


def test_no_columns_refused() -> None:
    with pytest.raises(ReplError, match="without columns"):
        tabledef.create_sql({"db": "s", "table": "x", "parameters": {}}, "s", "x")


def test_partition_spec_and_dir() -> None:
    assert tabledef.partition_spec({"q": "1", "p": "a'b"}, ["p", "q"]) == (
        "PARTITION (`p`='a\\'b', `q`='1')")
    assert tabledef.partition_dir({"p": "a/b=c", "q": "x y"}, ["p", "q"]) == "p=a%2Fb%3Dc/q=x y"
    with pytest.raises(ReplError, match="incomplete partition spec"):
        tabledef.partition_spec({"p": "a"}, ["p", "q"])

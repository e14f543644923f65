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


# -- what a dump may not smuggle into the destination's SQL ----------------------------------


def test_a_provider_that_is_not_a_name_is_refused() -> None:
    """A provider is spliced after USING: anything but a (dotted) name could add clauses
    (a LOCATION on the destination's disk, OPTIONS pointing elsewhere)."""
    for bad in ("parquet LOCATION '/etc'", "parquet OPTIONS (path '/')", "", "1x", "a--b"):
        obj = datasource(**{"spark.sql.sources.provider": bad})
        if bad == "":
            continue  # no provider at all: a Hive table
        with pytest.raises(ReplError, match="provider"):
            tabledef.create_sql(obj, "dr", "t2")
    ok = datasource(**{"spark.sql.sources.provider": "org.apache.spark.sql.parquet"})
    assert "USING org.apache.spark.sql.parquet " in tabledef.create_sql(ok, "dr", "t2")


def hive(types: dict[str, str], parts: dict[str, str] | None = None) -> dict[str, object]:
    return {"db": "s", "table": "h", "parameters": {},
            "columns": [{"name": n, "type": t} for n, t in types.items()],
            "partitionKeys": [{"name": n, "type": t} for n, t in (parts or {}).items()]}


@pytest.mark.parametrize("bad", [
    "int) USING parquet LOCATION '/tmp/x' --",
    "int, `evil` string",
    "string COMMENT 'x'",
    "array<int",
    "decimal(10,2",
    "decimal(a)",
    "map<string>",
    "struct<a int>",
    "int)",
])
def test_a_column_type_that_does_not_parse_is_refused(bad: str) -> None:
    with pytest.raises(ReplError, match="column type"):
        tabledef.create_sql(hive({"a": bad}), "s", "h")
    with pytest.raises(ReplError, match="column type"):
        tabledef.create_sql(hive({"a": "int"}, {"d": bad}), "s", "h")


def test_nested_types_are_rewritten_with_quoted_field_names() -> None:
    obj = hive({"a": "array<struct<x:int,`y z`:decimal(10,2)>>",
                "m": "MAP<string, array<varchar(5)>>",
                "u": "struct<k b:int,c:uniontype<int,string>>"})
    assert tabledef.create_sql(obj, "s", "h") == (
        "CREATE TABLE IF NOT EXISTS `s`.`h` ("
        "`a` array<struct<`x`:int,`y z`:decimal(10,2)>>, "
        "`m` map<string,array<varchar(5)>>, "
        "`u` struct<`k b`:int,`c`:uniontype<int,string>>)"
    )


def test_spark_schema_field_names_are_quoted_inside_nested_types() -> None:
    """Spark's simpleString() writes nested field names raw: a name like `x:int>, y` would
    end the type early."""
    schema = {"type": "struct", "fields": [
        {"name": "s", "nullable": True, "metadata": {}, "type": {
            "type": "struct", "fields": [
                {"name": "x:int>, y", "type": "integer", "nullable": True, "metadata": {}},
                {"name": "ok", "type": {"type": "array", "elementType": "string",
                                        "containsNull": True},
                 "nullable": True, "metadata": {}},
            ]}},
        {"name": "p", "type": "string", "nullable": True, "metadata": {}},
    ]}
    obj = datasource(**{"spark.sql.sources.schema.numParts": "1",
                        "spark.sql.sources.schema.part.0": json.dumps(schema)})
    assert tabledef.create_sql(obj, "dr", "t2").startswith(
        "CREATE TABLE IF NOT EXISTS `dr`.`t2` "
        "(`s` struct<`x:int>, y`:int,`ok`:array<string>>, `p` string) USING parquet"
    )


def test_a_user_defined_type_in_a_spark_schema_is_refused_before_pyspark_imports_it() -> None:
    schema = {"type": "struct", "fields": [
        {"name": "udt", "nullable": True, "metadata": {}, "type": {
            "type": "udt", "pyClass": "os.system", "class": "x", "sqlType": "string"}},
    ]}
    obj = datasource(**{"spark.sql.sources.schema.numParts": "1",
                        "spark.sql.sources.schema.part.0": json.dumps(schema)})
    with pytest.raises(ReplError, match="user-defined"):
        tabledef.create_sql(obj, "dr", "t2")


def test_a_path_option_in_any_case_never_reaches_the_destination() -> None:
    """Spark takes an OPTIONS key `path` in any case as the table's location: a dump whose
    serdeParameters said 'PATH'='/evil' made the replica an external table at /evil, where
    the loader then copies and deletes files. Every spelling of `path` is dropped."""
    for key in ("path", "PATH", "Path"):
        obj = datasource()
        obj["serdeParameters"] = {key: "/evil", "compression": "zstd"}
        sql = tabledef.create_sql(obj, "dr", "t2")
        assert "/evil" not in sql and "OPTIONS ('compression'='zstd')" in sql, sql

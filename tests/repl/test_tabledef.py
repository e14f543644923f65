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
                "u": "struct<k b:int,c:array<char(3)>>"})
    assert tabledef.create_sql(obj, "s", "h") == (
        "CREATE TABLE IF NOT EXISTS `s`.`h` ("
        "`a` array<struct<`x`:int,`y z`:decimal(10,2)>>, "
        "`m` map<string,array<varchar(5)>>, "
        "`u` struct<`k b`:int,`c`:array<char(3)>>)"
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


# -- Hive types Spark has, written as Spark's parser takes them ------------------------------


@pytest.mark.parametrize(("hive_type", "spark_type"), [
    ("interval day to second", "interval day to second"),
    ("INTERVAL YEAR TO MONTH", "interval year to month"),
    ("interval_day_time", "interval day to second"),  # the metastore's names for the two
    ("interval_year_month", "interval year to month"),
    ("interval hour to minute", "interval hour to minute"),
    ("interval month", "interval month"),
    ("double precision", "double"),
    ("DOUBLE   PRECISION", "double"),
    ("integer", "int"),
    ("real", "float"),
    ("dec(10, 2)", "decimal(10,2)"),
    ("numeric", "decimal"),
    ("struct<a:int COMMENT 'x'>", "struct<`a`:int COMMENT 'x'>"),
    ("struct<a:int comment \"it's\",b:string>", "struct<`a`:int COMMENT 'it\\'s',`b`:string>"),
    # Hive's literal: pieces one after another, backslash escapes, Hive's reading of `\\%`.
    ("struct<a:decimal(5,1)COMMENT 'a\\nb'\"c\\\\\\%\">",
     "struct<`a`:decimal(5,1) COMMENT 'a\nbc\\\\\\\\%'>"),
    ("array<struct<`x y`:double precision comment 'q'>>",
     "array<struct<`x y`:double COMMENT 'q'>>"),
    ("map<string,struct<a:interval_day_time COMMENT '\\u00e9'>>",
     "map<string,struct<`a`:interval day to second COMMENT '\u00e9'>>"),
])
def test_hive_types_become_the_spark_type(hive_type: str, spark_type: str) -> None:
    assert tabledef.create_sql(hive({"c": hive_type}), "s", "h") == (
        f"CREATE TABLE IF NOT EXISTS `s`.`h` (`c` {spark_type})")


def test_a_struct_field_comment_cannot_end_the_type() -> None:
    """A comment is re-quoted: its quotes and backslashes stay inside the literal."""
    sql = tabledef.create_sql(hive({"c": "struct<a:int comment \"x') LOCATION '/y\\\\\">"}),
                              "s", "h")
    assert sql == ("CREATE TABLE IF NOT EXISTS `s`.`h` "
                   "(`c` struct<`a`:int COMMENT 'x\\') LOCATION \\'/y\\\\'>)")


@pytest.mark.parametrize("bad", [
    "timestamp with local time zone",
    "TIMESTAMPLOCALTZ",
    "uniontype<int,string>",
    "array<uniontype<int>>",
    "struct<a:datetime>",
    "void",
    "timestamp_ntz_or_so",
])
def test_a_type_spark_cannot_create_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ReplError, match="unsupported column type") as e:
        tabledef.create_sql(hive({"a": "int", "odd col": bad}), "s", "h")
    assert "s.h" in e.value.detail and "'odd col'" in e.value.detail and bad in e.value.detail


def test_an_interval_in_a_hive_format_table_is_refused_by_name() -> None:
    """Spark keeps ANSI intervals in data source tables only: a Hive-format replica of one
    cannot be created."""
    obj = {**hive({"a": "int", "i": "array<interval day to second>"}),
           "serde": "org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe",
           "inputFormat": "org.apache.hadoop.mapred.TextInputFormat",
           "outputFormat": "org.apache.hadoop.hive.ql.io.HiveIgnoreKeyTextOutputFormat"}
    with pytest.raises(ReplError, match="unsupported column type") as e:
        tabledef.create_sql(obj, "s", "h")
    assert "s.h" in e.value.detail and "'i'" in e.value.detail and "interval" in e.value.detail
    # The same columns in a data source table are fine.
    obj["parameters"] = {"spark.sql.sources.provider": "parquet"}
    assert "`i` array<interval day to second>) USING parquet" in tabledef.create_sql(
        obj, "s", "h")


@pytest.mark.parametrize("bad", ["interval", "interval month to year", "interval day to month",
                                 "decimal(1,2,3)", "char", "varchar(1,2)", "int(3)",
                                 "struct<a:int COMMENT>", "struct<a:int COMMENT 'x>",
                                 "struct<a:int COMMENT 'x' COMMENT 'y'>"])
def test_a_malformed_hive_type_is_refused(bad: str) -> None:
    with pytest.raises(ReplError, match="bad column type"):
        tabledef.create_sql(hive({"a": bad}), "s", "h")


# -- user-defined types: only a real data type is one -----------------------------------------


def spark_schema(*fields: dict[str, object]) -> dict[str, object]:
    schema = {"type": "struct", "fields": [
        *fields, {"name": "p", "type": "string", "nullable": True, "metadata": {}}]}
    return datasource(**{"spark.sql.sources.schema.numParts": "1",
                         "spark.sql.sources.schema.part.0": json.dumps(schema)})


def test_a_udt_lookalike_in_field_metadata_is_not_a_user_defined_type() -> None:
    obj = spark_schema({"name": "a", "type": "integer", "nullable": True, "metadata": {
        "note": {"type": "udt", "pyClass": "os.system", "class": "x", "sqlType": "string"}}})
    assert tabledef.create_sql(obj, "dr", "t2").startswith(
        "CREATE TABLE IF NOT EXISTS `dr`.`t2` (`a` int, `p` string) USING parquet")


def test_a_user_defined_type_nested_in_a_spark_type_is_refused() -> None:
    udt = {"type": "udt", "pyClass": "os.system", "class": "x", "sqlType": "string"}
    for t in ({"type": "array", "elementType": udt, "containsNull": True},
              {"type": "map", "keyType": "string", "valueType": udt, "valueContainsNull": True},
              {"type": "struct", "fields": [
                  {"name": "u", "type": udt, "nullable": True, "metadata": {}}]}):
        obj = spark_schema({"name": "a", "type": t, "nullable": True, "metadata": {}})
        with pytest.raises(ReplError, match="user-defined") as e:
            tabledef.create_sql(obj, "dr", "t2")
        assert "s.t" in e.value.detail and "'a" in e.value.detail, e.value


# -- a damaged definition is a ReplError naming the table --------------------------------------


def _schema_text(schema: object) -> dict[str, str]:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return {"spark.sql.sources.schema.numParts": "1", "spark.sql.sources.schema.part.0": text}


_FIELD = {"name": "p", "type": "string", "nullable": True, "metadata": {}}
DAMAGED_DATASOURCE: dict[str, dict[str, str]] = {
    "schema is not JSON": _schema_text('{"type": "struct", "fields": ['),
    "schema is a list": _schema_text([_FIELD]),
    "schema without type": _schema_text({"fields": [_FIELD]}),
    "schema without fields": _schema_text({"type": "struct"}),
    "field without name": _schema_text({"type": "struct", "fields": [
        {"type": "string", "nullable": True, "metadata": {}}]}),
    "field without type": _schema_text({"type": "struct", "fields": [
        {"name": "p", "nullable": True, "metadata": {}}]}),
    "field name not a string": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "name": 5}]}),
    "field a string": _schema_text({"type": "struct", "fields": ["p"]}),
    "nullable not a bool": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "nullable": "yes"}]}),
    "metadata not an object": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "metadata": [1]}]}),
    "array without elementType": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "type": {"type": "array", "containsNull": True}}]}),
    "map without valueType": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "type": {"type": "map", "keyType": "string", "valueContainsNull": True}}]}),
    "unknown type name": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "type": "integr"}]}),
    "unknown complex type": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "type": {"type": "tree"}}]}),
    "bad collation metadata": _schema_text({"type": "struct", "fields": [
        {**_FIELD, "metadata": {"__COLLATIONS": ["x"]}}]}),
    "numParts not a number": {"spark.sql.sources.schema.numParts": "two"},
    "a schema part missing": {"spark.sql.sources.schema.numParts": "3"},
    "numPartCols not a number": {"spark.sql.sources.schema.numPartCols": "x"},
    "a partition column missing": {"spark.sql.sources.schema.numPartCols": "2"},
    "a partition column not in the schema": {"spark.sql.sources.schema.partCol.0": "q"},
}


@pytest.mark.parametrize("case", sorted(DAMAGED_DATASOURCE))
def test_a_damaged_spark_schema_is_a_repl_error(case: str) -> None:
    obj = datasource(**DAMAGED_DATASOURCE[case])
    with pytest.raises(ReplError) as e:
        tabledef.create_sql(obj, "dr", "t2")
    assert "s.t" in str(e.value), e.value


HIVE_SERDE = {"serde": "org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe",
              "inputFormat": "org.apache.hadoop.mapred.TextInputFormat",
              "outputFormat": "org.apache.hadoop.hive.ql.io.HiveIgnoreKeyTextOutputFormat",
              "serdeParameters": {"field.delim": ","}}
DAMAGED_HIVE: dict[str, dict[str, object]] = {
    "column without type": {"columns": [{"name": "a"}]},
    "column without name": {"columns": [{"type": "int"}]},
    "column name not a string": {"columns": [{"name": 5, "type": "int"}]},
    "column type not a string": {"columns": [{"name": "a", "type": 5}]},
    "column a string": {"columns": ["a int"]},
    "columns not a list": {"columns": "a int"},
    "partition key without name": {"partitionKeys": [{"type": "int"}]},
    "partitionKeys not a list": {"partitionKeys": {"name": "d", "type": "int"}},
    "serde not a string": {"serde": 5},
    "inputFormat not a string": {"inputFormat": ["org.apache.hadoop.mapred.TextInputFormat"]},
    "outputFormat not a string": {"outputFormat": {"x": 1}},
    "serdeParameters not an object": {"serdeParameters": [["field.delim", ","]]},
    "a serde parameter not a string": {"serdeParameters": {"field.delim": 44}},
    "parameters a list": {"parameters": [["owner", "me"]]},
    "parameters a string": {"parameters": "owner=me"},
    "a parameter not a string": {"parameters": {"owner": {"name": "me"}}},
    "provider not a string": {"parameters": {"spark.sql.sources.provider": True}},
    "provider a list": {"parameters": {"spark.sql.sources.provider": ["parquet"]}},
}


@pytest.mark.parametrize("case", sorted(DAMAGED_HIVE))
def test_a_damaged_hive_definition_is_a_repl_error(case: str) -> None:
    obj = {**hive({"a": "int"}, {"d": "date"}), **HIVE_SERDE, **DAMAGED_HIVE[case]}
    with pytest.raises(ReplError) as e:
        tabledef.create_sql(obj, "s", "h")
    assert "s.h" in str(e.value), e.value


def test_a_location_that_is_not_a_string_is_a_repl_error() -> None:
    """The loader copies files below the location: it is a path or nothing."""
    with pytest.raises(ReplError) as e:
        tabledef.location({**hive({"a": "int"}), "location": ["/wh/s.db/h"]})
    assert "s.h" in str(e.value), e.value

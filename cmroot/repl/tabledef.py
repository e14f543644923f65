"""Table definitions as the Spark hook records them (`tableObj`: the metastore's table,
as JSON) and the Spark SQL that recreates them on a destination.

Spark keeps a table's real schema, provider and partition columns in table parameters
(`spark.sql.sources.*`); a table Hive created has only its columns and SerDe. Both are
recreated as managed tables under the destination's warehouse."""

from __future__ import annotations

import json
from typing import Any

from cmroot.exceptions import ReplError

_SCHEMA = "spark.sql.sources.schema"
# Parameters that describe the source's copy, not the table: never replicated.
_LOCAL_PARAMS = frozenset(
    {
        "transient_lastDdlTime",
        "numFiles",
        "numFilesErasureCoded",
        "totalSize",
        "numRows",
        "rawDataSize",
        "COLUMN_STATS_ACCURATE",
        "EXTERNAL",
        "bucketing_version",
        "last_modified_by",
        "last_modified_time",
        "numPartitions",
    }
)
REPL_PREFIXES = ("repl.", "cmroot.")


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def literal(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def qualified(db: str, table: str) -> str:
    return f"{quote(db)}.{quote(table)}"


def location(table_obj: dict[str, Any]) -> str | None:
    loc = table_obj.get("location")
    return str(loc).rstrip("/") if loc else None


def provider(table_obj: dict[str, Any]) -> str | None:
    p = (table_obj.get("parameters") or {}).get("spark.sql.sources.provider")
    return str(p) if p else None


def _spark_schema(params: dict[str, str]) -> dict[str, Any] | None:
    text = params.get(_SCHEMA)
    if text is None and f"{_SCHEMA}.numParts" in params:
        n = int(params[f"{_SCHEMA}.numParts"])
        text = "".join(params[f"{_SCHEMA}.part.{i}"] for i in range(n))
    return json.loads(text) if text else None


def partition_columns(table_obj: dict[str, Any]) -> list[str]:
    params = table_obj.get("parameters") or {}
    n = params.get(f"{_SCHEMA}.numPartCols")
    if n is not None:
        return [params[f"{_SCHEMA}.partCol.{i}"] for i in range(int(n))]
    return [k["name"] for k in table_obj.get("partitionKeys") or []]


def columns(table_obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, type) of every column, partition columns last, in Spark SQL type syntax."""
    schema = _spark_schema(table_obj.get("parameters") or {})
    if schema is not None:
        from pyspark.sql.types import StructType

        return [(f.name, f.dataType.simpleString()) for f in StructType.fromJson(schema).fields]
    cols = list(table_obj.get("columns") or []) + list(table_obj.get("partitionKeys") or [])
    return [(c["name"], c["type"]) for c in cols]


def user_properties(table_obj: dict[str, Any]) -> dict[str, str]:
    return {
        k: str(v)
        for k, v in (table_obj.get("parameters") or {}).items()
        if not k.startswith("spark.sql.") and k not in _LOCAL_PARAMS
        and not k.startswith(REPL_PREFIXES)
    }


def create_sql(table_obj: dict[str, Any], db: str, table: str) -> str:
    """`CREATE TABLE IF NOT EXISTS` for the definition, as a managed table `db`.`table`."""
    cols = columns(table_obj)
    if not cols:
        raise ReplError(
            "table definition without columns",
            f"{table_obj.get('db')}.{table_obj.get('table')}: the dump cannot recreate it",
        )
    parts = partition_columns(table_obj)
    types = dict(cols)
    prov = provider(table_obj)
    props = user_properties(table_obj)
    sql = [f"CREATE TABLE IF NOT EXISTS {qualified(db, table)}"]
    if prov and prov.lower() != "hive":
        sql.append("(" + ", ".join(f"{quote(n)} {t}" for n, t in cols) + ")")
        sql.append(f"USING {prov}")
        if parts:
            sql.append("PARTITIONED BY (" + ", ".join(quote(p) for p in parts) + ")")
        options = {
            k: v for k, v in (table_obj.get("serdeParameters") or {}).items() if k != "path"
        }
        if options:
            sql.append("OPTIONS (" + properties_sql(options) + ")")
    else:
        data = [(n, t) for n, t in cols if n not in parts]
        sql.append("(" + ", ".join(f"{quote(n)} {t}" for n, t in data) + ")")
        if parts:
            sql.append(
                "PARTITIONED BY (" + ", ".join(f"{quote(p)} {types[p]}" for p in parts) + ")"
            )
        serde = table_obj.get("serde")
        if serde:
            sql.append(f"ROW FORMAT SERDE {literal(serde)}")
            serde_params = table_obj.get("serdeParameters") or {}
            if serde_params:
                sql.append("WITH SERDEPROPERTIES (" + properties_sql(serde_params) + ")")
        if table_obj.get("inputFormat") and table_obj.get("outputFormat"):
            sql.append(
                f"STORED AS INPUTFORMAT {literal(table_obj['inputFormat'])}"
                f" OUTPUTFORMAT {literal(table_obj['outputFormat'])}"
            )
    if props:
        sql.append("TBLPROPERTIES (" + properties_sql(props) + ")")
    return " ".join(sql)


def properties_sql(d: dict[str, Any]) -> str:
    """`'k'='v', ...` for OPTIONS, TBLPROPERTIES, SERDEPROPERTIES and DBPROPERTIES."""
    return ", ".join(f"{literal(k)}={literal(str(v))}" for k, v in sorted(d.items()))


def partition_spec(spec: dict[str, str], keys: list[str]) -> str:
    """`PARTITION (k='v', ...)` in the table's key order."""
    missing = [k for k in keys if k not in spec]
    if missing:
        raise ReplError("incomplete partition spec", f"{spec}: missing {missing}")
    return "PARTITION (" + ", ".join(f"{quote(k)}={literal(spec[k])}" for k in keys) + ")"


def partition_dir(spec: dict[str, str], keys: list[str]) -> str:
    """The directory of a partition below its table, escaped as Hive and Spark do."""
    return "/".join(f"{_escape(k)}={_escape(spec[k])}" for k in keys)


def _escape(value: str) -> str:
    return "".join(
        f"%{ord(c):02X}" if c in '"#%\'*/:=?\\\x7f{[]^' or ord(c) < 0x20 else c for c in value
    )

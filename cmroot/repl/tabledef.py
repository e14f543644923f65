"""Table definitions as the Spark hook records them (`tableObj`: the metastore's table,
as JSON) and the Spark SQL that recreates them on a destination.

Spark keeps a table's real schema, provider and partition columns in table parameters
(`spark.sql.sources.*`); a table Hive created has only its columns and SerDe. Both are
recreated as managed tables under the destination's warehouse."""

from __future__ import annotations

import json
import re
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


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PROVIDER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def provider(table_obj: dict[str, Any]) -> str | None:
    """The data source the table was created with (None: a Hive table). It is spliced
    after USING, so only a (dotted) name is taken."""
    p = (table_obj.get("parameters") or {}).get("spark.sql.sources.provider")
    if not p:
        return None
    if not _PROVIDER.fullmatch(str(p)):
        raise ReplError(
            "bad table provider",
            f"{_name(table_obj)}: provider {str(p)[:80]!r} is not a data source name"
            " (parquet, orc, org.apache.spark.sql.parquet, ...): the dump is damaged or was"
            " not written by cmroot",
        )
    return str(p)


def _name(table_obj: dict[str, Any]) -> str:
    return f"{table_obj.get('db')}.{table_obj.get('table')}"


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

        if _has_udt(schema):
            # pyspark imports a user-defined type's class named in the JSON: never from a dump.
            raise ReplError("user-defined column type",
                            f"{_name(table_obj)}: user-defined types are not replicated")
        return [(f.name, _spark_type(f.dataType)) for f in StructType.fromJson(schema).fields]
    cols = list(table_obj.get("columns") or []) + list(table_obj.get("partitionKeys") or [])
    out = []
    for c in cols:
        try:
            out.append((c["name"], _TypeParser(str(c["type"])).parse()))
        except ValueError as e:
            raise ReplError(
                "bad column type",
                f"{_name(table_obj)}: column type {str(c['type'])[:120]!r} of {c['name']!r}"
                f" does not parse ({e}): the dump is damaged or was not written by cmroot",
            ) from None
    return out


def _has_udt(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "udt" or any(_has_udt(v) for v in node.values())
    return isinstance(node, list) and any(_has_udt(v) for v in node)


def _spark_type(dt: Any) -> str:
    """Spark SQL for a Spark type, nested field names quoted (simpleString() writes them
    raw, so a name like `a:int>` would end the type early)."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(dt, StructType):
        return "struct<" + ",".join(
            f"{quote(f.name)}:{_spark_type(f.dataType)}" for f in dt.fields) + ">"
    if isinstance(dt, ArrayType):
        return f"array<{_spark_type(dt.elementType)}>"
    if isinstance(dt, MapType):
        return f"map<{_spark_type(dt.keyType)},{_spark_type(dt.valueType)}>"
    return str(dt.simpleString())


class _TypeParser:
    """A Hive column type (`decimal(10,2)`, `array<struct<a:int,b b:string>>`), parsed and
    written back with every struct field name quoted: the only SQL a dump's type string
    can become. Anything else (a clause after the type, a comment, unbalanced brackets)
    raises ValueError."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def parse(self) -> str:
        out = self._type()
        self._ws()
        if self.i != len(self.s):
            raise ValueError(f"unexpected {self.s[self.i:self.i + 20]!r}")
        return out

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _take(self, ch: str) -> bool:
        self._ws()
        if self.s.startswith(ch, self.i):
            self.i += len(ch)
            return True
        return False

    def _expect(self, ch: str) -> None:
        if not self._take(ch):
            raise ValueError(f"expected {ch!r} at {self.s[self.i:self.i + 20]!r}")

    def _type(self) -> str:
        self._ws()
        m = _NAME.match(self.s, self.i)
        if not m:
            raise ValueError(f"expected a type at {self.s[self.i:self.i + 20]!r}")
        self.i = m.end()
        name = m.group().lower()
        if name == "array":
            self._expect("<")
            inner = self._type()
            self._expect(">")
            return f"array<{inner}>"
        if name == "map":
            self._expect("<")
            key = self._type()
            self._expect(",")
            value = self._type()
            self._expect(">")
            return f"map<{key},{value}>"
        if name in ("struct", "uniontype"):
            self._expect("<")
            items: list[str] = []
            while not self._take(">"):
                if items:
                    self._expect(",")
                items.append(self._field() if name == "struct" else self._type())
            return f"{name}<{','.join(items)}>"
        if not self._take("("):
            return name
        args = [self._int()]
        while self._take(","):
            args.append(self._int())
        self._expect(")")
        return f"{name}({','.join(args)})"

    def _int(self) -> str:
        self._ws()
        m = re.compile(r"\d{1,9}").match(self.s, self.i)
        if not m:
            raise ValueError(f"expected a number at {self.s[self.i:self.i + 20]!r}")
        self.i = m.end()
        return m.group()

    def _field(self) -> str:
        self._ws()
        if self.s.startswith("`", self.i):
            m = re.compile(r"`((?:[^`]|``)+)`").match(self.s, self.i)
            if not m:
                raise ValueError("unterminated `quoted` field name")
            self.i = m.end()
            name = m.group(1).replace("``", "`")
        else:
            m = re.compile(r"[^:,<>()`]+").match(self.s, self.i)
            if not m or not m.group().strip():
                raise ValueError(f"expected a field name at {self.s[self.i:self.i + 20]!r}")
            self.i = m.end()
            name = m.group().strip()
        self._expect(":")
        return f"{quote(name)}:{self._type()}"


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
            k: v for k, v in (table_obj.get("serdeParameters") or {}).items()
            if str(k).lower() != "path"  # Spark reads the key in any case as the location
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

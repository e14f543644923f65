"""Table definitions as the Spark hook records them (`tableObj`: the metastore's table,
as JSON) and the Spark SQL that recreates them on a destination.

Spark keeps a table's real schema, provider and partition columns in table parameters
(`spark.sql.sources.*`); a table Hive created has only its columns and SerDe. Both are
recreated as managed tables under the destination's warehouse."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

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
    loc = _text(table_obj, "location")
    return loc.rstrip("/") if loc else None


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PROVIDER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def provider(table_obj: dict[str, Any]) -> str | None:
    """The data source the table was created with (None: a Hive table). It is spliced
    after USING, so only a (dotted) name is taken."""
    p = _strings(table_obj, "parameters").get("spark.sql.sources.provider")
    if not p:
        return None
    if not _PROVIDER.fullmatch(p):
        raise ReplError(
            "bad table provider",
            f"{_name(table_obj)}: provider {p[:80]!r} is not a data source name"
            " (parquet, orc, org.apache.spark.sql.parquet, ...): the dump is damaged or was"
            " not written by cmroot",
        )
    return p


def _name(table_obj: dict[str, Any]) -> str:
    return f"{table_obj.get('db')}.{table_obj.get('table')}"


def _damaged(table_obj: dict[str, Any], what: str) -> ReplError:
    return ReplError(
        "damaged table definition",
        f"{_name(table_obj)}: {what}: the dump is damaged or was not written by cmroot",
    )


def _text(table_obj: dict[str, Any], key: str) -> str | None:
    """A string the definition may lack (location, serde, formats)."""
    value = table_obj.get(key)
    if value is not None and not isinstance(value, str):
        raise _damaged(table_obj, f"{key} is {_shown(value)}, not a string")
    return value


def _strings(table_obj: dict[str, Any], key: str) -> dict[str, str]:
    """A map of strings (parameters, serdeParameters), as the metastore keeps them: any
    other value would be written into the destination's SQL as its Python spelling."""
    value = table_obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _damaged(table_obj, f"{key} is {_shown(value)}, not an object")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise _damaged(table_obj, f"{key}[{k!r}] is {_shown(v)}, not a string")
    return value


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {str(value)[:80]!r}"


def _count(table_obj: dict[str, Any], params: dict[str, str], key: str) -> int:
    """How many `.part.N`/`.partCol.N` parameters Spark split a value into."""
    n = params[key]
    if not re.fullmatch(r"[0-9]{1,6}", n):
        raise _damaged(table_obj, f"parameter {key} is {n[:20]!r}, not a count")
    return int(n)


def _part(table_obj: dict[str, Any], params: dict[str, str], key: str) -> str:
    if key not in params:
        raise _damaged(table_obj, f"parameter {key} is missing")
    return params[key]


def _spark_schema(table_obj: dict[str, Any]) -> dict[str, Any] | None:
    params = _strings(table_obj, "parameters")
    text = params.get(_SCHEMA)
    if text is None and f"{_SCHEMA}.numParts" in params:
        n = _count(table_obj, params, f"{_SCHEMA}.numParts")
        text = "".join(_part(table_obj, params, f"{_SCHEMA}.part.{i}") for i in range(n))
    if not text:
        return None
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _damaged(table_obj, f"its Spark schema is not JSON ({str(e)[:80]})") from None
    if not isinstance(schema, dict) or schema.get("type") != "struct":
        raise _damaged(table_obj, f"its Spark schema {text[:80]!r} is not a struct type")
    return schema


def partition_columns(table_obj: dict[str, Any]) -> list[str]:
    params = _strings(table_obj, "parameters")
    if f"{_SCHEMA}.numPartCols" in params:
        n = _count(table_obj, params, f"{_SCHEMA}.numPartCols")
        return [_part(table_obj, params, f"{_SCHEMA}.partCol.{i}") for i in range(n)]
    return [name for name, _ in _hive_columns(table_obj, "partitionKeys")]


def columns(table_obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, type) of every column, partition columns last, in Spark SQL type syntax."""
    schema = _spark_schema(table_obj)
    if schema is not None:
        return _spark_columns(table_obj, schema)
    out = []
    for name, text in _hive_columns(table_obj, "columns") + _hive_columns(
        table_obj, "partitionKeys"
    ):
        try:
            out.append((name, _TypeParser(text).parse()))
        except _Unsupported as e:
            raise _unsupported(table_obj, name, text, str(e)) from None
        except ValueError as e:
            raise ReplError(
                "bad column type",
                f"{_name(table_obj)}: column type {text[:120]!r} of {name!r}"
                f" does not parse ({e}): the dump is damaged or was not written by cmroot",
            ) from None
    return out


def _unsupported(table_obj: dict[str, Any], column: str, text: str, why: str) -> ReplError:
    return ReplError(
        "unsupported column type",
        f"{_name(table_obj)}: column {column!r} has type {text[:120]!r}: {why}; the table "
        "cannot be replicated through Spark",
    )


def _hive_columns(table_obj: dict[str, Any], key: str) -> list[tuple[str, str]]:
    """(name, Hive type) of the metastore's `columns` or `partitionKeys`."""
    value = table_obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _damaged(table_obj, f"{key} is {_shown(value)}, not a list")
    for c in value:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str)
                and isinstance(c.get("type"), str)):
            raise _damaged(table_obj, f"{key} holds {_shown(c)}, not a column with a name and a"
                                      " type")
    return [(c["name"], c["type"]) for c in value]


def _spark_columns(table_obj: dict[str, Any], schema: dict[str, Any]) -> list[tuple[str, str]]:
    _check_spark_type(table_obj, schema)
    from pyspark.sql.types import StructType

    try:
        fields = StructType.fromJson(schema).fields
    except (ValueError, TypeError, AttributeError, AssertionError, RecursionError) as e:
        # What the structural check leaves to pyspark: type names, collation metadata.
        raise _damaged(table_obj, f"its Spark schema does not parse ({str(e)[:120]})") from None
    return [(f.name, _declared(table_obj, f)) for f in fields]


def _declared(table_obj: dict[str, Any], field: Any) -> str:
    """A field's type as declared: Spark keeps a char(n) or varchar(n) column as a string
    with the declaration in its metadata, which the replica must declare again."""
    declared = (field.metadata or {}).get(CHAR_VARCHAR)
    if isinstance(declared, str):
        try:
            parsed = _TypeParser(declared).parse()
        except (_Unsupported, ValueError):
            parsed = ""
        if parsed.startswith(("char(", "varchar(")):
            return parsed
        raise _damaged(table_obj, f"column {field.name!r} declares {declared[:60]!r}")
    return _spark_type(field.dataType)


CHAR_VARCHAR = "__CHAR_VARCHAR_TYPE_STRING"  # where Spark keeps a declared char/varchar


def _check_spark_type(table_obj: dict[str, Any], node: Any, column: str = "") -> None:
    """Refuse what is not a data type as Spark writes one in JSON (a type name; an array, map
    or struct object) before pyspark reads it: pyspark fails on a missing key with a KeyError,
    and imports the class a user-defined type names, never to be done for a dump. Only data
    types are looked at: a field's metadata is free-form, whatever it holds. `column` is the
    (dotted) field the type is of."""
    if isinstance(node, str):
        return
    kind = node.get("type") if isinstance(node, dict) else None
    if kind == "udt":
        raise ReplError("user-defined column type", f"{_name(table_obj)}: column {column!r} has"
                        f" the type {str(node.get('class'))[:80]!r}: user-defined types are not"
                        " replicated")
    if kind == "struct" and isinstance(node.get("fields"), list):
        for f in node["fields"]:
            if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                    and isinstance(f.get("nullable", True), bool)
                    and isinstance(f.get("metadata", {}), dict)):
                raise _damaged(table_obj, f"its Spark schema has a field {_shown(f)}")
            _check_spark_type(table_obj, f.get("type"), f"{column}.{f['name']}".lstrip("."))
    elif kind == "array" and isinstance(node.get("containsNull"), bool):
        _check_spark_type(table_obj, node.get("elementType"), column)
    elif kind == "map" and isinstance(node.get("valueContainsNull"), bool):
        _check_spark_type(table_obj, node.get("keyType"), column)
        _check_spark_type(table_obj, node.get("valueType"), column)
    else:
        raise _damaged(table_obj, f"its Spark schema has a type {_shown(node)}")


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


# Hive's column types that Spark has, by every name Hive's DDL and its metastore use, with
# Spark's name and how many arguments (precision, scale, length) each takes.
_TYPES: dict[str, tuple[str, int, int]] = {
    "boolean": ("boolean", 0, 0),
    "tinyint": ("tinyint", 0, 0),
    "smallint": ("smallint", 0, 0),
    "int": ("int", 0, 0),
    "integer": ("int", 0, 0),
    "bigint": ("bigint", 0, 0),
    "float": ("float", 0, 0),
    "real": ("float", 0, 0),
    "double": ("double", 0, 0),  # also `double precision`
    "string": ("string", 0, 0),
    "binary": ("binary", 0, 0),
    "date": ("date", 0, 0),
    "timestamp": ("timestamp", 0, 0),
    "decimal": ("decimal", 0, 2),
    "dec": ("decimal", 0, 2),
    "numeric": ("decimal", 0, 2),
    "char": ("char", 1, 1),
    "varchar": ("varchar", 1, 1),
    "interval_year_month": ("interval year to month", 0, 0),
    "interval_day_time": ("interval day to second", 0, 0),
}
_LOCAL_TZ_WHY = (
    "Spark has no such column type (Spark 4 takes the words but creates a plain timestamp,"
    " which is not what the source's files hold)"
)
# Hive types Spark cannot create a column of, and why.
_UNSUPPORTED = {
    "uniontype": "Spark has no union type",
    "timestamplocaltz": _LOCAL_TZ_WHY,
}
_UNITS = ("year", "month", "day", "hour", "minute", "second")
_END = r"(?![A-Za-z0-9_])"
_INTERVAL = re.compile(
    rf"\s+({'|'.join(_UNITS)}){_END}(?:\s+to\s+({'|'.join(_UNITS)}){_END})?", re.IGNORECASE
)
_PRECISION = re.compile(rf"\s+precision{_END}", re.IGNORECASE)
_WITH_LOCAL_TZ = re.compile(rf"\s+with\s+local\s+time\s+zone{_END}", re.IGNORECASE)
_COMMENT = re.compile(rf"\s*comment{_END}\s*", re.IGNORECASE)
# Hive's string literal: quoted pieces, one after the other, each with backslash escapes.
_PIECE = r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"'
_STRING = re.compile(rf"(?:{_PIECE})+", re.DOTALL)
_ESCAPE = re.compile(r"\\(u[0-9A-Fa-f]{4}|[01][0-7]{2}|.)", re.DOTALL)
_ESCAPED = {"0": "\0", "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a",
            "%": "\\%", "_": "\\_"}


class _Unsupported(ValueError):
    """A Hive type that parses but that Spark cannot create a column of."""


class _TypeParser:
    """A Hive column type (`decimal(10,2)`, `array<struct<a:int,b b:string COMMENT 'x'>>`),
    parsed and written back as Spark's parser takes it: every struct field name quoted, every
    comment re-quoted, Hive's other spellings (`double precision`, `interval_day_time`) as
    Spark's names. This is the only SQL a dump's type string can become. Anything else (a
    clause after the type, unbalanced brackets) raises ValueError; a type Spark has no column
    of raises _Unsupported."""

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

    def _match(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        m = pattern.match(self.s, self.i)
        if m:
            self.i = m.end()
        return m

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
        if name == "struct":
            self._expect("<")
            items: list[str] = []
            while not self._take(">"):
                if items:
                    self._expect(",")
                items.append(self._field())
            return f"struct<{','.join(items)}>"
        if name == "interval":
            return self._interval()
        if name == "double":
            self._match(_PRECISION)
        elif name == "timestamp" and self._match(_WITH_LOCAL_TZ):
            raise _Unsupported(_LOCAL_TZ_WHY)
        if name in _UNSUPPORTED:
            raise _Unsupported(_UNSUPPORTED[name])
        if name not in _TYPES:
            raise _Unsupported(f"{name} is not a column type Hive and Spark share")
        spark, least, most = _TYPES[name]
        args = []
        if self._take("("):
            args.append(self._int())
            while self._take(","):
                args.append(self._int())
            self._expect(")")
        if not least <= len(args) <= most:
            raise ValueError(f"{name} takes {least} to {most} arguments, not {len(args)}")
        return f"{spark}({','.join(args)})" if args else spark

    def _interval(self) -> str:
        """`interval <unit> [to <unit>]`: Hive's two (year to month, day to second) and the
        others Spark has."""
        m = self._match(_INTERVAL)
        if not m:
            raise ValueError(f"expected an interval's unit at {self.s[self.i:self.i + 20]!r}")
        start, end = m.group(1).lower(), (m.group(2) or "").lower()
        if not end:
            return f"interval {start}"
        years = ("year", "month")
        if _UNITS.index(start) >= _UNITS.index(end) or (start in years) != (end in years):
            raise ValueError(f"no interval runs from {start} to {end}")
        return f"interval {start} to {end}"

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
        field = f"{quote(name)}:{self._type()}"
        if not self._match(_COMMENT):
            return field
        comment = self._match(_STRING)
        if not comment:
            raise ValueError(f"expected a quoted comment at {self.s[self.i:self.i + 20]!r}")
        # Spark takes a struct field's comment too: kept, as Spark's literal of its text.
        return f"{field} COMMENT {literal(_unquote(comment.group()))}"


def _unquote(text: str) -> str:
    """The text of a Hive string literal (BaseSemanticAnalyzer.unescapeSQLString)."""
    def char(m: re.Match[str]) -> str:
        e = m.group(1)
        if len(e) == 5:
            return chr(int(e[1:], 16))
        if len(e) == 3:
            return chr(int(e, 8))
        return _ESCAPED.get(e, e)

    return "".join(_ESCAPE.sub(char, piece[1:-1])
                   for piece in re.findall(_PIECE, text, re.DOTALL))


def _has_interval(sql_type: str) -> bool:
    """Whether a type written by this module holds an interval: its keywords, without the
    quoted field names and comments, name one."""
    keywords = re.sub(r"`(?:[^`]|``)*`|'(?:[^'\\]|\\.)*'", "", sql_type, flags=re.DOTALL)
    return re.search(r"\binterval\b", keywords) is not None


def user_properties(table_obj: dict[str, Any]) -> dict[str, str]:
    return {
        k: v
        for k, v in _strings(table_obj, "parameters").items()
        if not k.startswith("spark.sql.") and k not in _LOCAL_PARAMS
        and not k.startswith(REPL_PREFIXES)
    }


def is_external(table_obj: dict[str, Any]) -> bool:
    return table_obj.get("tableType") == "EXTERNAL_TABLE"


def create_sql(
    table_obj: dict[str, Any], db: str, table: str, extra: dict[str, str] | None = None,
    location: str | None = None,
) -> str:
    """`CREATE TABLE IF NOT EXISTS` for the definition, as `db`.`table`: a managed table,
    or an external one at `location`, with the `extra` table properties (the replica's
    own) set by the same statement."""
    cols = columns(table_obj)
    if not cols:
        raise ReplError(
            "table definition without columns",
            f"{table_obj.get('db')}.{table_obj.get('table')}: the dump cannot recreate it",
        )
    parts = partition_columns(table_obj)
    types = dict(cols)
    missing = [p for p in parts if p not in types]
    if missing:
        raise _damaged(table_obj, f"its partition columns {missing} are not among its columns")
    prov = provider(table_obj)
    props = user_properties(table_obj) | (extra or {})
    hive = not (prov and prov.lower() != "hive")
    external = "EXTERNAL " if location is not None and hive else ""
    sql = [f"CREATE {external}TABLE IF NOT EXISTS {qualified(db, table)}"]
    if not hive:
        sql.append("(" + ", ".join(f"{quote(n)} {t}" for n, t in cols) + ")")
        sql.append(f"USING {prov}")
        if parts:
            sql.append("PARTITIONED BY (" + ", ".join(quote(p) for p in parts) + ")")
        options = {
            k: v for k, v in _strings(table_obj, "serdeParameters").items()
            if k.lower() != "path"  # Spark reads the key in any case as the location
        }
        if options:
            sql.append("OPTIONS (" + properties_sql(options) + ")")
    else:
        serde = _text(table_obj, "serde")
        input_format = _text(table_obj, "inputFormat")
        output_format = _text(table_obj, "outputFormat")
        if serde or (input_format and output_format):  # the replica is a Hive-format table
            for n, t in cols:
                if _has_interval(t):
                    raise _unsupported(table_obj, n, t, "Spark keeps intervals in data source"
                                       " tables only, not in Hive-format ones")
        data = [(n, t) for n, t in cols if n not in parts]
        sql.append("(" + ", ".join(f"{quote(n)} {t}" for n, t in data) + ")")
        if parts:
            sql.append(
                "PARTITIONED BY (" + ", ".join(f"{quote(p)} {types[p]}" for p in parts) + ")"
            )
        if serde:
            sql.append(f"ROW FORMAT SERDE {literal(serde)}")
            serde_params = _strings(table_obj, "serdeParameters")
            if serde_params:
                sql.append("WITH SERDEPROPERTIES (" + properties_sql(serde_params) + ")")
        if input_format and output_format:
            sql.append(
                f"STORED AS INPUTFORMAT {literal(input_format)}"
                f" OUTPUTFORMAT {literal(output_format)}"
            )
    if location is not None:  # a data source table with a LOCATION is external
        sql.append(f"LOCATION {literal(location)}")
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


def spec_of(rel_dir: str, keys: list[str]) -> dict[str, str]:
    """The partition spec a directory below its table names (`p=1/q=a%20b`), or {} when
    it does not name a value for every one of `keys`."""
    spec = {}
    for seg in rel_dir.split("/"):
        k, sep, v = seg.partition("=")
        if sep and unquote(k) in keys:
            spec[unquote(k)] = unquote(v)
    return spec if keys and len(spec) == len(keys) else {}

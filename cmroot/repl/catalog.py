"""The destination catalog, through a Spark session: what a load reads and changes.

Writes are Spark SQL, so they go through whatever catalog the session is configured with
(the Hive metastore in production, Derby in tests); reads that SQL answers awkwardly
(database properties, a table's location) use the session catalog through py4j."""

from __future__ import annotations

import json
from typing import Any

from cmroot.exceptions import ReplError
from cmroot.repl import tabledef
from cmroot.repl.tabledef import literal, properties_sql, qualified, quote

LAST_ID = "repl.last.id"  # Hive's key: the last source event applied here
BOOTSTRAP = "cmroot.repl.bootstrap"  # the event id of the bootstrap this replica came from
SOURCE = "cmroot.repl.source"  # the identity of the source's event log (Header.source)
SCOPE = "cmroot.repl.scope"  # what the replica follows at the source: "db" or "db.table"


class Destination:
    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self._jvm = spark.sparkContext._jvm
        self._locations: dict[tuple[str, str], str] = {}

    def sql(self, text: str) -> list[Any]:
        return list(self.spark.sql(text).collect())

    def _catalog(self) -> Any:
        return self.spark._jsparkSession.sessionState().catalog()

    def _ident(self, db: str, table: str) -> Any:
        return self._jvm.org.apache.spark.sql.catalyst.TableIdentifier(
            table, self._jvm.scala.Option.apply(db)
        )

    # -- reads ----------------------------------------------------------------------------
    def has_db(self, db: str) -> bool:
        return bool(self._catalog().databaseExists(db))

    def has_table(self, db: str, table: str) -> bool:
        return self.has_db(db) and bool(self._catalog().tableExists(self._ident(db, table)))

    def db_properties(self, db: str) -> dict[str, str]:
        props = self._catalog().getDatabaseMetadata(db).properties()
        return scala_map(props)

    def table_properties(self, db: str, table: str) -> dict[str, str]:
        return scala_map(self._catalog().getTableMetadata(self._ident(db, table)).properties())

    def tables(self, db: str) -> list[str]:
        return [t.name for t in self.spark.catalog.listTables(db) if not t.isTemporary]

    def data_tables(self, db: str) -> list[str]:
        """The tables of `db` that hold data (its views left out)."""
        return [t.name for t in self.spark.catalog.listTables(db)
                if not t.isTemporary and t.tableType != "VIEW"]

    def location(self, db: str, table: str) -> str:
        """The local directory of a table (cached until the table is dropped or renamed)."""
        key = (db, table)
        if key not in self._locations:
            uri = self._catalog().getTableMetadata(self._ident(db, table)).location()
            self._locations[key] = _local(uri)
        return self._locations[key]

    def partition_location(self, db: str, table: str, spec: dict[str, str]) -> str | None:
        """The local directory of one partition; None if the table has no such partition."""
        jspec = self._jvm.java.util.HashMap()
        for k, v in spec.items():
            jspec.put(k, v)
        found = self._external().getPartitionOption(
            db, table, self._jvm.org.apache.spark.api.python.PythonUtils.toScalaMap(jspec)
        )
        return _local(found.get().location()) if found.isDefined() else None

    def partition_locations(self, db: str, table: str) -> list[str]:
        """The local directory of every partition of the table."""
        parts = self._external().listPartitions(db, table, self._jvm.scala.Option.empty())
        out = []
        it = parts.iterator()
        while it.hasNext():
            out.append(_local(it.next().location()))
        return out

    def partitions(self, db: str, table: str) -> list[tuple[dict[str, str], str]]:
        """(spec, local directory) of every partition of the table."""
        parts = self._external().listPartitions(db, table, self._jvm.scala.Option.empty())
        out = []
        it = parts.iterator()
        while it.hasNext():
            p = it.next()
            out.append((scala_map(p.spec()), _local(p.location())))
        return out

    def _external(self) -> Any:
        return self.spark._jsparkSession.sharedState().externalCatalog()

    def provider(self, db: str, table: str) -> str | None:
        """The data source the table reads its files with (hive, parquet, ...)."""
        found = self._catalog().getTableMetadata(self._ident(db, table)).provider()
        return str(found.get()) if found.isDefined() else None

    def partition_columns(self, db: str, table: str) -> list[str]:
        names = self._catalog().getTableMetadata(self._ident(db, table)).partitionColumnNames()
        return [str(names.apply(i)) for i in range(names.size())]

    def columns(self, db: str, table: str) -> list[str]:
        return [f.name.lower() for f in self.spark.table(qualified(db, table)).schema.fields]

    def data_schema(self, db: str, table: str) -> list[tuple[str, str]]:
        """(name, Spark SQL type) of the table's data columns (partition columns left out)."""
        schema = self._catalog().getTableMetadata(self._ident(db, table)).dataSchema()
        return [(f.name(), _declared_type(f)) for f in schema.fields()]

    # -- writes ---------------------------------------------------------------------------
    def create_db(self, db: str, properties: dict[str, str] | None = None) -> None:
        props = f" WITH DBPROPERTIES ({properties_sql(properties)})" if properties else ""
        self.sql(f"CREATE DATABASE IF NOT EXISTS {quote(db)}{props}")

    def drop_db(self, db: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS {quote(db)} CASCADE")
        self._locations = {k: v for k, v in self._locations.items() if k[0] != db}

    def set_db_properties(self, db: str, properties: dict[str, str]) -> None:
        self.sql(f"ALTER DATABASE {quote(db)} SET DBPROPERTIES ({properties_sql(properties)})")

    def create_table(
        self, table_obj: dict[str, Any], db: str, table: str,
        properties: dict[str, str] | None = None, location: str | None = None,
    ) -> None:
        self.sql(tabledef.create_sql(table_obj, db, table, properties, location))

    def warehouse(self) -> str:
        """The local directory of the session's warehouse."""
        return _local(self._jvm.java.net.URI(self.spark.conf.get("spark.sql.warehouse.dir")))

    def db_location(self, db: str) -> str:
        """The local directory of a database."""
        return _local(self._catalog().getDatabaseMetadata(db).locationUri())

    def drop_table(self, db: str, table: str) -> None:
        self.sql(f"DROP TABLE IF EXISTS {qualified(db, table)} PURGE")
        self._locations.pop((db, table), None)

    def set_location(self, db: str, table: str, path: str) -> None:
        self.sql(f"ALTER TABLE {qualified(db, table)} SET LOCATION {literal(path)}")
        self._locations.pop((db, table), None)

    def rename_table(self, db: str, old: str, new: str) -> None:
        self.sql(f"ALTER TABLE {qualified(db, old)} RENAME TO {qualified(db, new)}")
        self._locations.pop((db, old), None)

    def add_columns(self, db: str, table: str, cols: list[tuple[str, str]]) -> None:
        spec = ", ".join(f"{quote(n)} {t}" for n, t in cols)
        self.sql(f"ALTER TABLE {qualified(db, table)} ADD COLUMNS ({spec})")

    def replace_data_schema(self, db: str, table: str, cols: list[tuple[str, str]]) -> None:
        """Give the table exactly these data columns: what SQL cannot do to a non-v2 table
        (drop, rename or retype a column), through the metastore as ADD COLUMNS does."""
        ddl = ", ".join(f"{quote(n)} {t}" for n, t in cols)
        schema = self._jvm.org.apache.spark.sql.types.StructType.fromDDL(ddl)
        self._external().alterTableDataSchema(db, table, schema)
        self.refresh(db, table)

    def set_table_properties(self, db: str, table: str, properties: dict[str, str]) -> None:
        props = properties_sql(properties)
        self.sql(f"ALTER TABLE {qualified(db, table)} SET TBLPROPERTIES ({props})")

    def unset_table_properties(self, db: str, table: str, keys: list[str]) -> None:
        names = ", ".join(literal(k) for k in keys)
        self.sql(f"ALTER TABLE {qualified(db, table)} UNSET TBLPROPERTIES IF EXISTS ({names})")

    def add_partitions(self, db: str, table: str, specs: list[dict[str, str]],
                       keys: list[str], places: dict[str, str] | None = None) -> None:
        """Add the partitions that do not exist; those in `places` (by `spec_key`) at that
        directory, the others at their default places."""
        if specs:
            parts = " ".join(_partition_clause(s, keys, (places or {}).get(spec_key(s)))
                             for s in specs)
            self.sql(f"ALTER TABLE {qualified(db, table)} ADD IF NOT EXISTS {parts}")

    def set_partition_location(self, db: str, table: str, spec: dict[str, str],
                               keys: list[str], path: str) -> None:
        self.sql(f"ALTER TABLE {qualified(db, table)} {tabledef.partition_spec(spec, keys)}"
                 f" SET LOCATION {literal(path)}")

    def drop_partitions(self, db: str, table: str, specs: list[dict[str, str]],
                        keys: list[str]) -> None:
        if specs:
            parts = ", ".join(tabledef.partition_spec(s, keys) for s in specs)
            self.sql(f"ALTER TABLE {qualified(db, table)} DROP IF EXISTS {parts} PURGE")

    def refresh(self, db: str, table: str) -> None:
        self.sql(f"REFRESH TABLE {qualified(db, table)}")


def spec_key(spec: dict[str, str]) -> str:
    """A partition spec as a dictionary key."""
    return json.dumps(spec, sort_keys=True)


def _partition_clause(spec: dict[str, str], keys: list[str], place: str | None) -> str:
    clause = tabledef.partition_spec(spec, keys)
    return clause if place is None else f"{clause} LOCATION {literal(place)}"


def _local(uri: Any) -> str:
    """The local path of a catalog location (a java.net.URI). The load writes with local
    file operations: a location on another filesystem is refused, never taken for the
    local path of the same name."""
    scheme = uri.getScheme()
    if scheme not in (None, "file"):
        raise ReplError(
            "destination not on the local filesystem",
            f"{uri.toString()}: cmroot repl load writes replicas into local (file:)"
            " warehouses only; run the load with spark.sql.warehouse.dir (and the target"
            " database's location) on a local path",
        )
    return str(uri.getPath() or "").rstrip("/")


def _declared_type(field: Any) -> str:
    """A column's type as declared (char(n) and varchar(n) are strings to Spark, which
    keeps the declaration in the field's metadata)."""
    meta = field.metadata()
    if meta.contains(tabledef.CHAR_VARCHAR):
        return str(meta.getString(tabledef.CHAR_VARCHAR))
    return str(field.dataType().sql())


def scala_map(m: Any) -> dict[str, str]:
    out = {}
    it = m.iterator()
    while it.hasNext():
        kv = it.next()
        out[str(kv._1())] = str(kv._2())
    return out

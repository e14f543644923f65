"""A plain-Python Thrift client for the Hive 2.3 metastore, with no Spark in the way.

Why: Spark hides or rewrites several metastore calls (it drops partitions one by one, never
sends ``drop_partitions_req``, and chooses ``deleteData``/purge itself). Tests that need to
issue exactly one metastore call - and see the Thrift exception it raises, unchanged - use
this wrapper instead.

The generated Hive 2.x Thrift bindings come from the ``hmsclient`` PyPI package (0.1.1,
which needs ``thrift``); only its generated ``ThriftHiveMetastore`` client and types are
used, not its ``HMSClient`` helpers (whose ``drop_partitions`` passes ``need_result`` into
the ``deleteData`` slot). The metastore speaks unframed TBinaryProtocol without SASL.
"""

from __future__ import annotations

import copy
import getpass
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import urlparse

from hmsclient.genthrift.hive_metastore import ThriftHiveMetastore
from hmsclient.genthrift.hive_metastore.ttypes import (
    AlreadyExistsException,
    Database,
    DropPartitionsRequest,
    EnvironmentContext,
    FieldSchema,
    InvalidObjectException,
    InvalidOperationException,
    MetaException,
    NoSuchObjectException,
    Partition,
    RequestPartsSpec,
    SerDeInfo,
    StorageDescriptor,
    Table,
)
from thrift.protocol import TBinaryProtocol
from thrift.transport import TSocket, TTransport

__all__ = [
    "FORMATS",
    "AlreadyExistsException",
    "Database",
    "EnvironmentContext",
    "FieldSchema",
    "HmsClient",
    "InvalidObjectException",
    "InvalidOperationException",
    "MetaException",
    "NoSuchObjectException",
    "Partition",
    "StorageDescriptor",
    "Table",
]

# (inputFormat, outputFormat, serializationLib) per table format
FORMATS: dict[str, tuple[str, str, str]] = {
    "parquet": (
        "org.apache.hadoop.hive.ql.io.parquet.MapredParquetInputFormat",
        "org.apache.hadoop.hive.ql.io.parquet.MapredParquetOutputFormat",
        "org.apache.hadoop.hive.ql.io.parquet.serde.ParquetHiveSerDe",
    ),
    "text": (
        "org.apache.hadoop.mapred.TextInputFormat",
        "org.apache.hadoop.hive.ql.io.HiveIgnoreKeyTextOutputFormat",
        "org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe",
    ),
}


def _purge_context(purge: bool) -> EnvironmentContext | None:
    return EnvironmentContext(properties={"ifPurge": "TRUE"}) if purge else None


def _location(location: str | Path | None) -> str | None:
    if location is None:
        return None
    return str(Path(location).resolve()) if isinstance(location, Path) else location


class HmsClient:
    """One Thrift connection to a metastore; every method is a single metastore call.

    Thrift exceptions (``MetaException``, ``NoSuchObjectException``, ...) propagate unchanged;
    their ``message`` attribute (and ``str()``) carry the server's text.
    """

    def __init__(self, uri: str, timeout: float = 60.0) -> None:
        parsed = urlparse(uri)
        if parsed.scheme != "thrift" or parsed.hostname is None or parsed.port is None:
            raise ValueError(f"not a thrift://host:port metastore URI: {uri!r}")
        self.uri = uri
        sock = TSocket.TSocket(parsed.hostname, parsed.port)
        sock.setTimeout(int(timeout * 1000))
        self._transport = TTransport.TBufferedTransport(sock)
        protocol = TBinaryProtocol.TBinaryProtocol(self._transport)
        self.client = ThriftHiveMetastore.Client(protocol)  # the raw generated client
        self._transport.open()

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> HmsClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- databases -----------------------------------------------------------------------
    def create_database(self, name: str, location: str | Path | None = None) -> None:
        self.client.create_database(
            Database(name=name, description="", locationUri=_location(location), parameters={})
        )

    def get_database(self, name: str) -> Database:
        return self.client.get_database(name)

    def drop_database(self, name: str, delete_data: bool = True, cascade: bool = False) -> None:
        self.client.drop_database(name, delete_data, cascade)

    # -- tables --------------------------------------------------------------------------
    def create_table(
        self,
        db: str,
        name: str,
        location: str | Path | None,
        columns: list[tuple[str, str]],
        partition_keys: list[tuple[str, str]] | None = None,
        external: bool = False,
        file_format: str = "parquet",
        parameters: dict[str, str] | None = None,
    ) -> None:
        """A plain Hive table (``file_format`` "parquet" or "text") that Spark can read."""
        input_format, output_format, serde = FORMATS[file_format]
        serde_params = {"serialization.format": "1"}
        if file_format == "text":
            serde_params["field.delim"] = ","
        sd = StorageDescriptor(
            cols=[FieldSchema(name=c, type=t, comment=None) for c, t in columns],
            location=_location(location),
            inputFormat=input_format,
            outputFormat=output_format,
            compressed=False,
            numBuckets=-1,
            serdeInfo=SerDeInfo(name=name, serializationLib=serde, parameters=serde_params),
            bucketCols=[],
            sortCols=[],
            parameters={},
            storedAsSubDirectories=False,
        )
        params = dict(parameters or {})
        if external:
            params["EXTERNAL"] = "TRUE"
        table = Table(
            tableName=name,
            dbName=db,
            owner=getpass.getuser(),
            createTime=int(time.time()),
            lastAccessTime=0,
            retention=0,
            sd=sd,
            partitionKeys=[
                FieldSchema(name=c, type=t, comment=None) for c, t in (partition_keys or [])
            ],
            parameters=params,
            tableType="EXTERNAL_TABLE" if external else "MANAGED_TABLE",
        )
        self.client.create_table(table)

    def get_table(self, db: str, name: str) -> Table:
        return self.client.get_table(db, name)

    def get_tables(self, db: str, pattern: str = "*") -> list[str]:
        return list(self.client.get_tables(db, pattern))

    def alter_table(self, db: str, name: str, new_table: Table) -> None:
        self.client.alter_table(db, name, new_table)

    def drop_table(self, db: str, name: str, delete_data: bool = True, purge: bool = False) -> None:
        """drop_table_with_environment_context; purge sends ``{"ifPurge": "TRUE"}``."""
        self.client.drop_table_with_environment_context(
            db, name, delete_data, _purge_context(purge)
        )

    # -- partitions ----------------------------------------------------------------------
    def add_partition(
        self,
        db: str,
        table: str,
        values: list[str],
        location: str | Path | None = None,
    ) -> Partition:
        """Add one partition with the table's storage descriptor; without ``location`` the
        metastore puts it at ``<table location>/k1=v1/k2=v2`` and creates that directory."""
        tbl = self.client.get_table(db, table)
        sd = copy.deepcopy(tbl.sd)
        sd.location = _location(location)
        now = int(time.time())
        part = Partition(
            values=list(values),
            dbName=db,
            tableName=table,
            createTime=now,
            lastAccessTime=0,
            sd=sd,
            parameters={},
        )
        return self.client.add_partition(part)

    def get_partition(self, db: str, table: str, values: list[str]) -> Partition:
        return self.client.get_partition(db, table, list(values))

    def list_partition_names(self, db: str, table: str) -> list[str]:
        return list(self.client.get_partition_names(db, table, -1))

    def drop_partition(
        self,
        db: str,
        table: str,
        values: list[str],
        delete_data: bool = True,
        purge: bool = False,
    ) -> bool:
        return bool(
            self.client.drop_partition_with_environment_context(
                db, table, list(values), delete_data, _purge_context(purge)
            )
        )

    def drop_partitions(
        self,
        db: str,
        table: str,
        names: list[str],
        delete_data: bool = True,
        purge: bool = False,
    ) -> list[Partition]:
        """One ``drop_partitions_req`` call dropping every partition named ("k=v/k2=v2")."""
        req = DropPartitionsRequest(
            dbName=db,
            tblName=table,
            parts=RequestPartsSpec(names=list(names)),
            deleteData=delete_data,
            ifExists=False,
            environmentContext=_purge_context(purge),
            needResult=True,
        )
        result = self.client.drop_partitions_req(req)
        return list(result.partitions or [])

"""cmroot for a Hive metastore: the `hive-site.xml` properties and the class path that load
the cmroot metastore plugin, so that every engine's drops through that metastore (Spark,
Hive, Trino, Impala, Flink, a bare Thrift client) keep their files and record their events.

    cmroot metastore-conf --url http://cmroot-host:9750 --token-file /etc/cmroot/token

The plugin is four listeners (`io.cmroot.metastore`, in the jar `cmroot.jvm` builds): the
pre-event listener refuses drops that would delete a warehouse root; the transactional one
stages a drop's files inside the metastore's transaction; the post-event one records events
and commits; the end-function one settles a call a later listener failed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from xml.sax.saxutils import escape

from cmroot import jvm

__all__ = ["LISTENERS", "format_conf", "metastore_conf"]

_PACKAGE = "io.cmroot.metastore"
# hive-site.xml key -> the plugin's listener for it (comma-separated lists in Hive).
LISTENERS = {
    "hive.metastore.pre.event.listeners": f"{_PACKAGE}.CmrootPreEventListener",
    "hive.metastore.transactional.event.listeners": f"{_PACKAGE}.CmrootTransactionalListener",
    "hive.metastore.event.listeners": f"{_PACKAGE}.CmrootEventListener",
    "hive.metastore.end.function.listeners": f"{_PACKAGE}.CmrootEndFunctionListener",
}


def metastore_conf(
    url: str,
    token: str | None = None,
    *,
    token_file: str | None = None,
    fail_open: bool = False,
    warehouse_roots: list[str] | None = None,
    jar: str | None = None,
) -> dict[str, object]:
    """{"classpath": [jar], "properties": {hive-site key: value}} for a metastore whose
    cmroot daemon is at `url`. The token goes in as a file path when `token_file` is given
    (read by the plugin at each call: rotate it without a restart), else inline."""
    props = dict(LISTENERS)
    props["cmroot.url"] = url.rstrip("/")
    if token_file:
        props["cmroot.tokenFile"] = os.path.abspath(token_file)
    elif token:
        props["cmroot.token"] = token
    props["cmroot.failOpen"] = "true" if fail_open else "false"
    if warehouse_roots:
        props["cmroot.warehouseRoots"] = ",".join(warehouse_roots)
    return {"classpath": [jar or jvm.build_metastore_jar()], "properties": props}


def format_conf(props: Mapping[str, str], style: str = "xml") -> str:
    """The properties as `<property>` elements for hive-site.xml (`xml`), or `key=value`
    lines (`properties`)."""
    if style == "properties":
        return "\n".join(f"{k}={v}" for k, v in props.items())
    return "\n".join(
        f"<property>\n  <name>{escape(k)}</name>\n  <value>{escape(v)}</value>\n</property>"
        for k, v in props.items()
    )

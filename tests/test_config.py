"""Configuration: defaults, the TOML file, `CMROOT_<SECTION>_<KEY>` overrides, the Hive
`hive-site.xml` mapping, and refusals that name the offending key."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from cmroot import config
from cmroot.config import DEFAULT_PORT, parse_duration
from cmroot.exceptions import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def refusal(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as ei:
        config.load(*args, **kwargs)
    return str(ei.value)


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, str]:
    return {
        "CMROOT_STORE_ROOT": str(tmp_path / "store"),
        "CMROOT_STORE_WAREHOUSE_ROOTS": str(tmp_path / "wh"),
    }


# -- defaults ----------------------------------------------------------------------------------


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    c = config.load(None, env={})
    assert c.source == "<defaults>"
    assert c.store.root == str(tmp_path / "xdg" / "cmroot" / "store")
    assert c.store.warehouse_roots == (str(tmp_path / "xdg" / "cmroot" / "warehouse"),)
    assert c.store.retain == 24 * 3600
    assert c.store.interval == 3600
    assert c.store.on_expire == "delete"
    assert c.store.retain_overrides == ()
    assert c.store.enabled is True
    assert c.server.host == "127.0.0.1"
    assert c.server.port == DEFAULT_PORT
    assert c.server.base_url == f"http://127.0.0.1:{DEFAULT_PORT}"
    assert c.index.path == ""
    assert c.index_path == os.path.join(c.store.root, "index.sqlite")
    assert c.auth.tokens == ()
    assert (c.server.keepalive_timeout, c.server.body_timeout, c.server.send_timeout) == (
        15, 15, 30)
    assert c.server.processes == 1
    assert c.server.process_timeout == 30


def test_server_processes(tmp_path: Path, roots: dict[str, str]) -> None:
    f = write(tmp_path / "c.toml", "[server]\nprocesses = 4\n")
    assert config.load(f, env=roots).server.processes == 4
    assert config.load(f, env={**roots, "CMROOT_SERVER_PROCESSES": "2"}).server.processes == 2
    for bad in ('"many"', "0", "-1", "100"):
        msg = refusal(write(tmp_path / "bad.toml", f"[server]\nprocesses = {bad}\n"), env=roots)
        assert "server.processes" in msg, msg


def test_server_timeouts(tmp_path: Path, roots: dict[str, str]) -> None:
    f = write(tmp_path / "c.toml", '[server]\nkeepalive_timeout = "1m"\nsend_timeout = "2s"\n')
    c = config.load(f, env={**roots, "CMROOT_SERVER_BODY_TIMEOUT": "5s"})
    assert (c.server.keepalive_timeout, c.server.body_timeout, c.server.send_timeout) == (
        60, 5, 2)
    for value in ("0s", "2h", "15"):
        msg = refusal(None, env={**roots, "CMROOT_SERVER_SEND_TIMEOUT": value})
        assert "server.send_timeout" in msg, msg
        msg = refusal(None, env={**roots, "CMROOT_SERVER_PROCESS_TIMEOUT": value})
        assert "server.process_timeout" in msg, msg
    assert config.load(None, env={**roots, "CMROOT_SERVER_PROCESS_TIMEOUT": "10s"}
                       ).server.process_timeout == 10


def test_load_reads_the_process_environment_when_env_is_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CMROOT_STORE_ROOT", str(tmp_path / "s"))
    monkeypatch.setenv("CMROOT_STORE_WAREHOUSE_ROOTS", str(tmp_path / "w"))
    monkeypatch.setenv("CMROOT_STORE_RETAIN", "2h")
    c = config.load(None)
    assert c.store.root == str(tmp_path / "s")
    assert c.store.retain == 7200


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("15m", 900),
        ("24h", 86400),
        ("7d", 604800),
        ("1w", 604800),
        ("1.5h", 5400),
        (" 2 h ", 7200),
        ("3 days", 259200),
        ("5min", 300),
    ],
)
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad", ["", "soon", "-1h", "0s", "0", "1y", "h", "1 h s", True, 0, -5, "10", 42, 0.5]
)
def test_parse_duration_refuses(bad: object) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_duration(bad, "store.retain")  # type: ignore[arg-type]
    assert "store.retain" in str(ei.value)


# -- TOML ----------------------------------------------------------------------------------------


def test_toml_file(tmp_path: Path) -> None:
    f = write(
        tmp_path / "cmroot.toml",
        f"""
        [store]
        root = "{tmp_path}/store"
        warehouse_roots = ["{tmp_path}/wh1", "file://{tmp_path}/wh2/", "s3://bucket/warehouse/"]
        retain = "7d"
        interval = "15m"
        on_expire = "trash"
        retain_overrides = {{ "sales.*" = "30d", "tmp.*" = "1h" }}

        [server]
        host = "0.0.0.0"
        port = 8080

        [index]
        path = "{tmp_path}/idx/index.sqlite"

        [auth]
        tokens = ["read:sha256:abc"]
        """,
    )
    c = config.load(f, env={})
    assert c.source == str(f)
    assert c.store.root == f"{tmp_path}/store"
    assert c.store.warehouse_roots == (
        f"{tmp_path}/wh1",
        f"{tmp_path}/wh2",
        "s3://bucket/warehouse",
    )
    assert c.store.retain == 7 * 86400
    assert c.store.interval == 900
    assert c.store.on_expire == "trash"
    assert c.store.retain_overrides == (("sales.*", 30 * 86400.0), ("tmp.*", 3600.0))
    assert c.server.port == 8080
    assert c.server.base_url == "http://127.0.0.1:8080"
    assert c.index_path == f"{tmp_path}/idx/index.sqlite"
    assert c.auth.tokens == ("read:sha256:abc",)


def test_a_single_root_may_be_a_string(tmp_path: Path) -> None:
    f = write(
        tmp_path / "c.toml",
        f"""
        [store]
        root = "{tmp_path}/store"
        warehouse_roots = "{tmp_path}/wh"
        retain = "600s"
        """,
    )
    c = config.load(f, env={})
    assert c.store.warehouse_roots == (f"{tmp_path}/wh",)
    assert c.store.retain == 600


@pytest.mark.parametrize(
    "line",
    ["retain = 24", "retain = 1.5", 'retain = "24"', "interval = 3600",
     'retain_overrides = { "sales.*" = 7 }'],
)
def test_a_duration_without_a_unit_in_toml_is_refused(
    tmp_path: Path, roots: dict[str, str], line: str
) -> None:
    # Hive reads a bare retain in hours, TOML once read it in seconds: say which instead.
    f = write(tmp_path / "c.toml", f"[store]\n{line}\n")
    msg = refusal(f, env=roots)
    assert "store." + line.split()[0] in msg
    assert "unit" in msg and all(u in msg for u in ("90s", "15m", "24h", "7d"))


@pytest.mark.parametrize(
    ("key", "value"),
    [("CMROOT_STORE_RETAIN", "24"), ("CMROOT_STORE_INTERVAL", "60"),
     ("CMROOT_STORE_RETAIN_OVERRIDES", "sales.*=7")],
)
def test_a_duration_without_a_unit_in_the_environment_is_refused(
    roots: dict[str, str], key: str, value: str
) -> None:
    msg = refusal(None, env={**roots, key: value})
    assert "unit" in msg and all(u in msg for u in ("90s", "15m", "24h", "7d"))


def test_a_bare_duration_over_a_hive_site_is_refused(tmp_path: Path) -> None:
    # The environment is cmroot's own config, even on top of a hive-site.xml.
    msg = refusal(hive_site(tmp_path), env={"CMROOT_STORE_RETAIN": "24"})
    assert "CMROOT_STORE_RETAIN" in msg or "store.retain" in msg
    assert "24h" in msg


def test_retain_for_glob_on_db_table_first_match_wins(
    tmp_path: Path, roots: dict[str, str]
) -> None:
    c = config.load(
        None,
        env={
            **roots,
            "CMROOT_STORE_RETAIN": "1d",
            "CMROOT_STORE_RETAIN_OVERRIDES": "sales.orders=2d, sales.*=7d ,tmp.*=1h",
        },
    )
    s = c.store
    assert s.retain_overrides == (
        ("sales.orders", 172800.0),
        ("sales.*", 604800.0),
        ("tmp.*", 3600.0),
    )
    assert s.retain_for("sales", "orders") == 2 * 86400
    assert s.retain_for("sales", "returns") == 7 * 86400
    assert s.retain_for("tmp", "x") == 3600
    assert s.retain_for("default", "x") == 86400
    assert s.retain_for(None, None) == 86400
    assert s.retain_for("salesx", "orders") == 86400  # the glob is on "db.table", not a prefix


# -- environment overrides --------------------------------------------------------------------


def test_env_overrides_the_file(tmp_path: Path) -> None:
    f = write(
        tmp_path / "c.toml",
        f"""
        [store]
        root = "{tmp_path}/store"
        warehouse_roots = ["{tmp_path}/wh"]
        retain = "7d"
        [server]
        port = 8080
        """,
    )
    c = config.load(
        f,
        env={
            "CMROOT_STORE_RETAIN": "2h",
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"{tmp_path}/a, {tmp_path}/b",
            "CMROOT_STORE_ON_EXPIRE": "trash",
            "CMROOT_STORE_ENABLED": "false",
            "CMROOT_SERVER_PORT": "9999",
            "CMROOT_INDEX_PATH": f"{tmp_path}/i.sqlite",
            "CMROOT_AUTH_TOKENS": "read:sha256:aa,admin:sha256:bb",
            # not config keys: the CLI's own variables pass through
            "CMROOT_CONFIG": str(f),
            "CMROOT_TOKEN": "secret",
            "CMROOT_URL": "http://x",
            "PATH": "/usr/bin",
            "HOME": "/root",
        },
    )
    assert c.store.retain == 7200
    assert c.store.warehouse_roots == (f"{tmp_path}/a", f"{tmp_path}/b")
    assert c.store.on_expire == "trash"
    assert c.store.enabled is False
    assert c.server.port == 9999
    assert c.index_path == f"{tmp_path}/i.sqlite"
    assert c.auth.tokens == ("read:sha256:aa", "admin:sha256:bb")
    assert c.store.root == f"{tmp_path}/store"  # untouched keys keep the file's value


# -- hive-site.xml -------------------------------------------------------------------------------

HIVE_SITE = """\
<?xml version="1.0"?>
<configuration>
  <property><name>hive.repl.cmrootdir</name><value>{root}</value></property>
  <property><name>hive.metastore.warehouse.dir</name><value>{wh}</value></property>
  <property><name>hive.repl.cm.retain</name><value>{retain}</value></property>
  <property><name>hive.repl.cm.interval</name><value>{interval}</value></property>
  <property><name>hive.repl.cm.enabled</name><value>{enabled}</value></property>
  <property><name>hive.metastore.uris</name><value>thrift://ms:9083</value></property>
</configuration>
"""


def hive_site(tmp_path: Path, **kw: str) -> Path:
    values = {
        "root": f"{tmp_path}/cmroot",
        "wh": f"{tmp_path}/warehouse",
        "retain": "10d",
        "interval": "3600s",
        "enabled": "true",
        **kw,
    }
    p = tmp_path / "hive-site.xml"
    p.write_text(HIVE_SITE.format(**values))
    return p


def test_hive_site_mapping(tmp_path: Path) -> None:
    c = config.load(hive_site(tmp_path), env={})
    assert c.store.root == f"{tmp_path}/cmroot"
    assert c.store.warehouse_roots == (f"{tmp_path}/warehouse",)
    assert c.store.retain == 10 * 86400
    assert c.store.interval == 3600
    assert c.store.enabled is True
    assert c.source.endswith("hive-site.xml")


def test_hive_site_bare_numbers_use_hive_units_and_enabled_false(tmp_path: Path) -> None:
    # Hive reads a bare hive.repl.cm.retain in hours and hive.repl.cm.interval in seconds.
    c = config.load(hive_site(tmp_path, retain="24", interval="90", enabled="FALSE"), env={})
    assert c.store.retain == 24 * 3600
    assert c.store.interval == 90
    assert c.store.enabled is False
    c = config.load(hive_site(tmp_path, retain="1.5", interval=" 30 "), env={})
    assert c.store.retain == 1.5 * 3600
    assert c.store.interval == 30


def test_hive_site_with_env_override(tmp_path: Path) -> None:
    c = config.load(hive_site(tmp_path), env={"CMROOT_STORE_RETAIN": "1h"})
    assert c.store.retain == 3600


def test_hive_site_refusals(tmp_path: Path) -> None:
    msg = refusal(hive_site(tmp_path, retain="forever"), env={})
    assert "store.retain" in msg
    bad = tmp_path / "broken.xml"
    bad.write_text("<configuration><property>")
    assert "not valid XML" in refusal(bad, env={})


# -- refusals -----------------------------------------------------------------------------------


def test_unknown_key_in_toml_is_named(tmp_path: Path, roots: dict[str, str]) -> None:
    f = write(tmp_path / "c.toml", '[store]\nretian = "1h"\n')
    msg = refusal(f, env=roots)
    assert "store.retian" in msg and "retain" in msg  # names the key and lists the known ones


def test_unknown_section_is_named(tmp_path: Path, roots: dict[str, str]) -> None:
    f = write(tmp_path / "c.toml", '[stroe]\nroot = "/x"\n')
    assert "[stroe]" in refusal(f, env=roots)


def test_unknown_env_key_is_named(roots: dict[str, str]) -> None:
    assert "store.retian" in refusal(None, env={**roots, "CMROOT_STORE_RETIAN": "1h"})
    assert "CMROOT_NOPE_X" in refusal(None, env={**roots, "CMROOT_NOPE_X": "1"})
    assert "CMROOT_STORE" in refusal(None, env={**roots, "CMROOT_STORE": "1"})


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("CMROOT_STORE_RETAIN", "a while", "store.retain"),
        ("CMROOT_STORE_RETAIN", "0h", "store.retain"),
        ("CMROOT_STORE_INTERVAL", "1x", "store.interval"),
        ("CMROOT_STORE_RETAIN_OVERRIDES", "sales.*=later", "store.retain_overrides.sales.*"),
        ("CMROOT_STORE_RETAIN_OVERRIDES", "sales.*", "CMROOT_STORE_RETAIN_OVERRIDES"),
        ("CMROOT_STORE_ON_EXPIRE", "shred", "store.on_expire"),
        ("CMROOT_SERVER_PORT", "http", "CMROOT_SERVER_PORT"),
        ("CMROOT_SERVER_PORT", "70000", "server.port"),
        ("CMROOT_SERVER_PROCESSES", "two", "CMROOT_SERVER_PROCESSES"),
        ("CMROOT_SERVER_PROCESSES", "0", "server.processes"),
        ("CMROOT_SERVER_PROCESSES", "65", "server.processes"),
        ("CMROOT_INDEX_PATH", "rel/index.sqlite", "index.path"),
        ("CMROOT_STORE_WAREHOUSE_ROOTS", "", "store.warehouse_roots"),
        ("CMROOT_STORE_ROOT", "", "store.root"),
    ],
)
def test_bad_values_are_refused_naming_the_key(
    roots: dict[str, str], key: str, value: str, named: str
) -> None:
    assert named in refusal(None, env={**roots, key: value})


def test_bad_duration_in_toml(tmp_path: Path, roots: dict[str, str]) -> None:
    f = write(tmp_path / "c.toml", '[store]\ninterval = "hourly"\n')
    msg = refusal(f, env=roots)
    assert "store.interval" in msg and "hourly" in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("CMROOT_STORE_ROOT", "relative/store"),
        ("CMROOT_STORE_WAREHOUSE_ROOTS", "wh"),
        ("CMROOT_STORE_WAREHOUSE_ROOTS", "/abs/wh,relative"),
        ("CMROOT_STORE_ROOT", "/a\0b"),
    ],
)
def test_relative_roots_are_refused(roots: dict[str, str], key: str, value: str) -> None:
    msg = refusal(None, env={**roots, key: value})
    assert "must be absolute" in msg
    assert key.removeprefix("CMROOT_").lower().replace("store_", "store.", 1) in msg


def test_store_root_inside_a_warehouse_root_is_refused(tmp_path: Path) -> None:
    msg = refusal(
        None,
        env={
            "CMROOT_STORE_ROOT": f"{tmp_path}/wh/.cmroot",
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"{tmp_path}/other,{tmp_path}/wh",
        },
    )
    assert "store.root" in msg and "store.warehouse_roots" in msg
    assert f"{tmp_path}/wh" in msg


def test_warehouse_root_inside_the_store_root_is_refused(tmp_path: Path) -> None:
    msg = refusal(
        None,
        env={
            "CMROOT_STORE_ROOT": f"{tmp_path}/data",
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"{tmp_path}/data/warehouse",
        },
    )
    assert "store.root" in msg and "store.warehouse_roots" in msg


def test_same_store_and_warehouse_root_is_refused(tmp_path: Path) -> None:
    refusal(
        None,
        env={
            "CMROOT_STORE_ROOT": f"{tmp_path}/x/",
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"file://{tmp_path}/x",
        },
    )


@pytest.mark.parametrize(("store", "warehouse"), [
    ("s3://b/cm", "s3a://b"),
    ("s3a://b/cm", "s3://b/cm/../cm/t"),
    ("s3://b/cm", "s3n://b/./"),
    ("s3://b/cm", "s3://B"),
    ("abfs://c@acct/cm", "abfss://c@acct"),
])
def test_one_place_spelled_two_ways_is_overlap(tmp_path: Path, store: str, warehouse: str) -> None:
    """Hadoop's spellings of one object store (s3a, s3n) and unnormalised paths name the
    same place as fsspec opens it: a root holding the store that way is refused."""
    msg = refusal(None, env={
        "CMROOT_STORE_ROOT": store, "CMROOT_STORE_WAREHOUSE_ROOTS": warehouse,
        "CMROOT_INDEX_PATH": f"{tmp_path}/index.sqlite",
    })
    assert "overlap" in msg


@pytest.mark.parametrize("which", ["root into the store", "store into the root"])
def test_a_symlink_that_makes_store_and_root_overlap_is_refused_at_open(
    tmp_path: Path, which: str
) -> None:
    """Distinct names, one place: a warehouse root that is a symlink into the store (or
    a store root that is one into the warehouse) is refused when the store opens."""
    from cmroot.store import Store

    (tmp_path / "real").mkdir()
    if which == "root into the store":
        store, wh = tmp_path / "real", tmp_path / "wh"
        (tmp_path / "real" / "wh").mkdir()
        wh.symlink_to(tmp_path / "real" / "wh")
    else:
        store, wh = tmp_path / "cm", tmp_path / "real"
        (tmp_path / "real" / "cm").mkdir()
        store.symlink_to(tmp_path / "real" / "cm")
    c = config.load(None, env={
        "CMROOT_STORE_ROOT": str(store), "CMROOT_STORE_WAREHOUSE_ROOTS": str(wh),
        "CMROOT_INDEX_PATH": f"{tmp_path}/idx/index.sqlite",
    })
    with pytest.raises(ConfigError, match="overlap"):
        Store.open(c)


def test_sibling_prefix_is_not_overlap(tmp_path: Path) -> None:
    c = config.load(
        None,
        env={
            "CMROOT_STORE_ROOT": f"{tmp_path}/wh-cmroot",
            "CMROOT_STORE_WAREHOUSE_ROOTS": f"{tmp_path}/wh",
        },
    )
    assert c.store.root == f"{tmp_path}/wh-cmroot"


def test_missing_or_broken_files(tmp_path: Path, roots: dict[str, str]) -> None:
    assert "not found" in refusal(tmp_path / "nope.toml", env=roots)
    broken = write(tmp_path / "b.toml", "[store\nroot=")
    assert "not valid TOML" in refusal(broken, env=roots)


def test_tls_cert_and_key_go_together(roots: dict[str, str]) -> None:
    msg = refusal(None, env={**roots, "CMROOT_SERVER_TLS_CERT": "/etc/cert.pem"})
    assert "tls_cert" in msg and "tls_key" in msg


def test_config_errors_are_not_http_errors(roots: dict[str, str]) -> None:
    # A bad config stops the daemon at start; it is not a client's 4xx.
    with pytest.raises(ConfigError) as ei:
        config.load(None, env={**roots, "CMROOT_STORE_RETAIN": "x"})
    assert ei.value.status == 500


def test_the_jvm_cache_variable_is_not_a_config_override(roots: dict[str, str]) -> None:
    """$CMROOT_SPARK_CACHE (where the JVM jars are cached, documented) is no config key:
    every verb ran into "unknown environment override" with it set."""
    c = config.load(None, env={**roots, "CMROOT_SPARK_CACHE": "/tmp/cmroot-jars"})
    assert c.store.warehouse_roots

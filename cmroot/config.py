"""Configuration: one TOML file, every key overridable by `CMROOT_<SECTION>_<KEY>`.

A Hive `hive-site.xml` may stand in for the TOML file: its `hive.repl.cm*` keys and the
warehouse directory map onto the store section. Everything is checked at load time so a
bad value stops the daemon at start, with the key and the fix in the message.
"""

from __future__ import annotations

import fnmatch
import math
import os
import posixpath
import pwd
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fsspec.registry import known_implementations

from cmroot.exceptions import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_PORT = 9750
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(
    r"\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|m|min|mins|h|hour|hours|d|day|days|w)?\s*"
)
_UNIT_CHOICES = "90s, 15m, 24h or 7d"


def parse_duration(text: str | int | float, key: str = "duration") -> float:
    """`90s`, `15m`, `24h`, `7d` → seconds. A bare number is refused: Hive reads one in
    hours, and guessing seconds instead once turned a day of retention into 24 seconds."""
    m = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if m is None or m.group(2) is None:
        bare = m is not None or _is_number(text)
        raise ConfigError(
            f"bad duration for {key}",
            f"{text!r}"
            + (" has no unit: add one" if bare else ": write it")
            + f" like {_UNIT_CHOICES} (s, m, h, d or w)",
        )
    seconds = float(m.group(1)) * _UNITS[m.group(2)[0]]
    if seconds <= 0:
        raise ConfigError(f"bad duration for {key}", f"{text!r}: it must be greater than zero")
    return seconds


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*", re.IGNORECASE)
MAX_SIZE = 2**63  # SQLite's integers
_SIZE_UNITS = {"b": 1, **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgtp")},
               **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")}}


def parse_size(text: str | float, key: str = "size") -> int:
    """`500GiB`, `2TB`, `1048576` (bytes) → bytes; 0 means no limit."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and (
        math.isfinite(text) and 0 <= text < MAX_SIZE and text == int(text)
    ):
        return int(text)
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    size = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()] if m else -1.0
    # A size that rounds to 0 bytes would turn the limit off without saying so.
    if not 0 <= size < MAX_SIZE or (size < 1 and float(m.group(1) if m else 1) != 0):
        raise ConfigError(
            f"bad size for {key}",
            f"{str(text)[:100]!r}: write bytes, or a size like 500GiB or 2TB (0: no limit,"
            " at most 8 EiB)",
        )
    return int(size)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def data_home() -> str:
    """Where the embedded defaults keep the store: $XDG_DATA_HOME/cmroot."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "cmroot")


@dataclass(frozen=True)
class StoreConfig:
    root: str = field(default_factory=lambda: os.path.join(data_home(), "store"))
    warehouse_roots: tuple[str, ...] = field(
        default_factory=lambda: (os.path.join(data_home(), "warehouse"),)
    )
    retain: float = 86400.0
    interval: float = 3600.0
    on_expire: str = "delete"
    # (glob on "db.table", seconds); the first matching glob wins.
    retain_overrides: tuple[tuple[str, float], ...] = ()
    enabled: bool = True
    # How long a prepared (two-phase) recycle waits for its commit before it is rolled
    # back; its statement renews it while it runs.
    prepare_lease: float = 300.0
    # The store's byte budget (0: none): over it, the sweep evicts the oldest objects
    # before they expire, never one recycled less than `min_retain` ago nor one held.
    max_bytes: int = 0
    min_retain: float = 3600.0

    def retain_for(self, db: str | None, table: str | None) -> float:
        if db is not None or table is not None:
            # Case-insensitive, as the metastore treats names (and holds match them).
            name = f"{db or ''}.{table or ''}".lower()
            for pattern, seconds in self.retain_overrides:
                if fnmatch.fnmatchcase(name, pattern.lower()):
                    return seconds
        return self.retain


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    url: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    max_body: int = 64 << 20
    # A Unix socket the daemon also listens on ("" = none), and the users (uids or names)
    # it serves there in open mode; empty: the daemon's own user and root.
    socket: str = ""
    socket_uids: tuple[int, ...] = ()
    # Seconds an idle keep-alive connection (or one still sending its headers) is kept,
    # a request body may stall, and an answer may sit untaken, before it is cut.
    keepalive_timeout: float = 15.0
    body_timeout: float = 15.0
    send_timeout: float = 30.0
    # Processes answering on host:port: the primary (writes, recovery, the sweep) and
    # processes - 1 that serve GET/HEAD /v1/files and POST /v1/resolve themselves and pass
    # every other request to the primary.
    processes: int = 1
    # Seconds a serving process's event loop may give no sign of life before the primary
    # kills it and starts another (a wedged one would hang the connections it is given).
    process_timeout: float = 30.0

    @property
    def base_url(self) -> str:
        if self.url:
            return self.url.rstrip("/")
        scheme = "https" if self.tls_cert else "http"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{scheme}://{host}:{self.port}"


@dataclass(frozen=True)
class IndexConfig:
    path: str = ""


@dataclass(frozen=True)
class AuthConfig:
    # "<scope>:sha256:<hex>" per token; only hashes live in the file.
    tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    source: str = "<defaults>"

    @property
    def index_path(self) -> str:
        return self.index.path or os.path.join(self.store.root, "index.sqlite")


# Environment variables of the CLI and logging that are not config keys.
_NOT_CONFIG = frozenset(
    {"CMROOT_CONFIG", "CMROOT_TOKEN", "CMROOT_URL", "CMROOT_LOG_LEVEL", "CMROOT_FAULTS",
     "CMROOT_SPARK_CACHE"}
)

_SECTIONS: dict[str, type[Any]] = {
    "store": StoreConfig,
    "server": ServerConfig,
    "index": IndexConfig,
    "auth": AuthConfig,
}


def load(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Read the config file (TOML, or a Hive `hive-site.xml`), apply `CMROOT_*` overrides,
    validate. Without a path only defaults and the environment count."""
    env = os.environ if env is None else env
    raw: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} not found", "pass an existing file to --config")
        if str(path).endswith(".xml"):
            raw["store"].update(read_hive_site(path))
        else:
            raw = _merge_toml(raw, path)
    _apply_env(raw, env)
    return _build(raw, source)


def _merge_toml(
    raw: dict[str, dict[str, Any]], path: str | os.PathLike[str]
) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML", str(e)) from e
    for section, values in doc.items():
        if section not in _SECTIONS or not isinstance(values, dict):
            raise ConfigError(
                f"unknown config section [{section}] in {path}",
                f"known sections: {', '.join(_SECTIONS)}",
            )
        raw[section].update(values)
    return raw


def _apply_env(raw: dict[str, dict[str, Any]], env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not name.startswith("CMROOT_") or name in _NOT_CONFIG:
            continue
        rest = name[len("CMROOT_") :].lower()
        section, _, key = rest.partition("_")
        if section not in _SECTIONS or not key:
            raise ConfigError(
                f"unknown environment override {name}",
                "write CMROOT_<SECTION>_<KEY>, e.g. CMROOT_STORE_RETAIN=24h",
            )
        raw[section][key] = _env_value(_SECTIONS[section], key, value, name)


def _env_value(cls: type[Any], key: str, value: str, name: str) -> Any:
    default = getattr(cls(), key, None)
    if key == "retain_overrides":
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ConfigError(
                f"bad value for {name}", "write glob=duration pairs: sales.*=7d,tmp.*=1h"
            )
        return {k.strip(): v.strip() for k, v in pairs}
    if key == "max_bytes":
        return value  # a size with its unit: parse_size reads it
    if isinstance(default, tuple):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int) and not isinstance(default, bool):
        try:
            return int(value)
        except ValueError as e:
            raise ConfigError(f"bad value for {name}", f"{value!r} is not an integer") from e
    return value


def _build(raw: dict[str, dict[str, Any]], source: str) -> Config:
    for section, values in raw.items():
        known = set(_SECTIONS[section].__dataclass_fields__)
        for key in values:
            if key not in known:
                raise ConfigError(
                    f"unknown config key {section}.{key} in {source}",
                    f"known keys of [{section}]: {', '.join(sorted(known))}",
                )
    s = raw["store"]
    defaults = StoreConfig()
    root = absolute_root(s.get("root", defaults.root), "store.root")
    roots = s.get("warehouse_roots", list(defaults.warehouse_roots))
    if isinstance(roots, str):
        roots = [roots]
    if not roots:
        raise ConfigError("store.warehouse_roots is empty", "list at least one warehouse directory")
    warehouse = tuple(absolute_root(r, "store.warehouse_roots") for r in roots)
    for w in warehouse:
        if overlap(root, w):
            raise ConfigError(
                "store.root and store.warehouse_roots overlap",
                f"{root} and {w}: keep the store beside the warehouse, not inside it"
                " (or the reverse)",
            )
    on_expire = s.get("on_expire", "delete")
    if on_expire not in ("delete", "trash"):
        raise ConfigError(
            "bad value for store.on_expire", f'{on_expire!r}: use "delete" or "trash"'
        )
    overrides = s.get("retain_overrides", {})
    if not isinstance(overrides, dict):
        raise ConfigError(
            "bad value for store.retain_overrides", 'write a table: {"sales.*" = "7d"}'
        )
    store = StoreConfig(
        root=root,
        warehouse_roots=warehouse,
        retain=parse_duration(s.get("retain", "24h"), "store.retain"),
        interval=parse_duration(s.get("interval", "1h"), "store.interval"),
        on_expire=on_expire,
        retain_overrides=tuple(
            (str(k), parse_duration(v, f"store.retain_overrides.{k}")) for k, v in overrides.items()
        ),
        enabled=bool(s.get("enabled", True)),
        prepare_lease=parse_duration(s.get("prepare_lease", "5m"), "store.prepare_lease"),
        max_bytes=parse_size(s.get("max_bytes", 0), "store.max_bytes"),
        min_retain=parse_duration(s.get("min_retain", "1h"), "store.min_retain"),
    )
    srv = raw["server"]
    try:
        port = int(srv.get("port", DEFAULT_PORT))
        max_body = int(srv.get("max_body", ServerConfig.max_body))
        processes = int(srv.get("processes", ServerConfig.processes))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            "bad value for server.port, server.max_body or server.processes", "use an integer"
        ) from e
    if not 0 <= port < 65536:
        raise ConfigError("bad value for server.port", f"{port} is not a TCP port")
    if not 1 <= processes <= MAX_PROCESSES:
        raise ConfigError(
            "bad value for server.processes",
            f"{processes}: give 1 to {MAX_PROCESSES} (about one per core serves best)",
        )
    server = ServerConfig(
        host=str(srv.get("host", ServerConfig.host)),
        port=port,
        url=str(srv.get("url", "")),
        tls_cert=str(srv.get("tls_cert", "")),
        tls_key=str(srv.get("tls_key", "")),
        max_body=max_body,
        socket=_socket_path(srv.get("socket", "")),
        socket_uids=tuple(_uid(u) for u in _listed(srv.get("socket_uids", []))),
        processes=processes,
        **{key: _timeout(srv, key) for key in _TIMEOUTS},
    )
    if bool(server.tls_cert) != bool(server.tls_key):
        raise ConfigError("server.tls_cert and server.tls_key go together", "set both or neither")
    index_path = str(raw["index"].get("path", ""))
    if index_path and not os.path.isabs(index_path):
        raise ConfigError("index.path must be absolute", f"{index_path!r}: write a full path")
    if not index_path and local_path(root) is None:
        # SQLite needs a local file; the index is not kept in the store's bucket.
        raise ConfigError(
            f"store.root {root} is not a local directory: index.path is needed",
            "set index.path (CMROOT_INDEX_PATH) to a file on local disk, e.g."
            " /var/lib/cmroot/index.sqlite; the store's lock and scratch files go beside it",
        )
    tokens = raw["auth"].get("tokens", [])
    if isinstance(tokens, str):
        tokens = [tokens]
    return Config(
        store=store,
        server=server,
        index=IndexConfig(path=index_path),
        auth=AuthConfig(tokens=tuple(str(t) for t in tokens)),
        source=source,
    )


_TIMEOUTS = ("keepalive_timeout", "body_timeout", "send_timeout", "process_timeout")
MAX_PROCESSES = 64


def _timeout(srv: dict[str, Any], key: str) -> float:
    """A server timeout: a duration of one second to one hour."""
    default: float = getattr(ServerConfig, key)
    seconds = parse_duration(srv.get(key, f"{default:g}s"), f"server.{key}")
    if not 1 <= seconds <= 3600:
        raise ConfigError(f"bad value for server.{key}", "give a duration from 1s to 1h")
    return seconds


# sun_path holds 108 bytes with its terminating NUL.
MAX_SOCKET_PATH = 107


def _socket_path(value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            "bad value for server.socket", 'write an absolute path, or "" for none'
        )
    if not value:
        return ""
    if "\0" in value or not os.path.isabs(value):
        raise ConfigError(
            "server.socket must be absolute", f"{value!r}: write a full path such as "
            "/run/cmroot/cmroot.sock"
        )
    if len(os.fsencode(value)) > MAX_SOCKET_PATH:
        raise ConfigError(
            "server.socket is too long",
            f"{value[:200]!r}: a Unix socket path holds at most {MAX_SOCKET_PATH} bytes; "
            "use a shorter one such as /run/cmroot/cmroot.sock",
        )
    return os.path.normpath(value)


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _uid(value: object) -> int:
    """A uid from a number or a user name (resolved now: a typo stops the daemon at start
    rather than locking its users out)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, str) and value.strip():
        try:
            return pwd.getpwnam(value.strip()).pw_uid
        except KeyError:
            pass
    raise ConfigError(
        "bad value for server.socket_uids",
        f"{value!r} is not a uid or a known user name: list uids or user names",
    )


def local_path(url_or_path: str) -> str | None:
    """The local path behind `/x`, `file:///x` or `local:///x` (fsspec's two names of the
    local filesystem), or None for another filesystem."""
    if url_or_path.startswith(("file://", "local://")):
        return urlsplit(url_or_path).path or "/"
    if "://" in url_or_path:
        return None
    return url_or_path


def absolute_root(value: str, key: str) -> str:
    """`value` as a warehouse root (an absolute path, normalised, or a URL); ConfigError,
    naming `key`, otherwise."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"bad value for {key}", "write an absolute path or an fsspec URL")
    local = local_path(value)
    if local is None:
        if "::" in value:
            raise ConfigError(
                f"bad value for {key}",
                f"{value!r} chains filesystems: name the filesystem itself (s3://bucket/...)",
            )
        return value.rstrip("/")
    if "\0" in local or not os.path.isabs(local):
        raise ConfigError(
            f"{key} must be absolute", f"{value!r}: write a full path such as /data/warehouse"
        )
    return os.path.normpath(local)


# Hadoop spellings fsspec does not register, and the ones it opens as they are.
_SCHEME_ALIASES = {"s3n": "s3", "abfss": "abfs"}
# Filesystems whose first path component is the bucket: `s3:///b/x` opens `s3://b/x`.
_BUCKETS = frozenset({"s3fs.S3FileSystem", "gcsfs.GCSFileSystem", "adlfs.AzureBlobFileSystem"})


def place_key(value: str) -> str:
    """Where a path or URL points, spelled one way so that two spellings of one place
    compare equal: a local path normalised; a URL with its scheme named by the fsspec
    class that opens it (`s3`, `s3a` and `s3n` are one S3), its authority lower-cased
    (bucket and host names are) and its path normalised."""
    local = local_path(value)
    if local is not None:
        return posixpath.normpath(local)
    scheme, _, rest = value.partition("://")
    scheme = _SCHEME_ALIASES.get(scheme.lower(), scheme.lower())
    opener = known_implementations.get(scheme, {}).get("class", scheme)
    authority, _, path = rest.partition("/")
    if not authority and opener in _BUCKETS:
        authority, _, path = path.lstrip("/").partition("/")
    path = posixpath.normpath("/" + path).lstrip("/")
    return f"{opener}://{authority.lower()}/{path}".rstrip("/")


def overlap(a: str, b: str) -> bool:
    """Whether one of two paths or URLs lies in (or is) the other, however spelled."""
    ka, kb = place_key(a), place_key(b)
    return _inside(ka, kb) or _inside(kb, ka)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def read_hive_site(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Map a hive-site.xml's change-manager keys onto [store] keys."""
    try:
        tree = ET.parse(path)
    except ET.ParseError as e:
        raise ConfigError(f"{path} is not valid XML", str(e)) from e
    props = {
        (p.findtext("name") or "").strip(): (p.findtext("value") or "").strip()
        for p in tree.getroot().iter("property")
    }
    out: dict[str, Any] = {}
    if "hive.repl.cmrootdir" in props:
        out["root"] = props["hive.repl.cmrootdir"]
    if "hive.metastore.warehouse.dir" in props:
        out["warehouse_roots"] = [props["hive.metastore.warehouse.dir"]]
    # Hive's defaults: retain is in hours and interval in seconds when no unit is written.
    if "hive.repl.cm.retain" in props:
        out["retain"] = _hive_duration(props["hive.repl.cm.retain"], "h")
    if "hive.repl.cm.interval" in props:
        out["interval"] = _hive_duration(props["hive.repl.cm.interval"], "s")
    if "hive.repl.cm.enabled" in props:
        out["enabled"] = props["hive.repl.cm.enabled"].lower() == "true"
    return out


def _hive_duration(value: str, unit: str) -> str:
    m = _DURATION.fullmatch(value)
    return value.strip() + unit if m and m.group(2) is None else value


def default_config_path() -> str | None:
    """`$CMROOT_CONFIG`, else /etc/cmroot/cmroot.toml if it exists."""
    env = os.environ.get("CMROOT_CONFIG")
    if env:
        return env
    etc = Path("/etc/cmroot/cmroot.toml")
    return str(etc) if etc.is_file() else None

"""The `cmroot` command line.

Every verb but `serve`, `checksum` and `token` acts either directly on the store named by
the config, or, with `--url` (or when a running daemon holds the store), through that
daemon's HTTP API. Both paths return the same JSON, so `--json` output does not depend on
which was used.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import logging
import os
import re
import signal
import stat
import sys
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import fsspec

from cmroot import __version__, audit
from cmroot import checksum as cks
from cmroot import config as cfg
from cmroot.client import Client, Resolutions, Resolved
from cmroot.exceptions import (
    BadRequest,
    ChecksumMismatch,
    CmrootError,
    ConfigError,
    DaemonUnavailable,
    Forbidden,
    NotFound,
    StoreLocked,
    Unauthorized,
)
from cmroot.logs import setup_cli_logging, setup_logging
from cmroot.progress import Progress
from cmroot.store import RecycleRequest, Store
from cmroot.store.recycle import RecycleResult
from cmroot.vocab import DESTRUCTIVE

_OPS = ", ".join(sorted(DESTRUCTIVE))

log = logging.getLogger("cmroot.cli")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line that says where the help is, like every other error."""

    def error(self, message: str) -> Any:
        self.exit(2, f"cmroot: {message} (see `{self.prog} --help`)\n")


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: write 1 or more") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: write 1 or more")
    return n


def _hold_id(text: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]{0,17}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: give the number `cmroot hold ls` shows")
    return int(text)


def _until(text: str) -> float:
    """--until: a duration from now (7d), or an ISO date or time (UTC unless it says)."""
    try:
        return time.time() + cfg.parse_duration(text, "--until")
    except ConfigError:
        pass
    text = text.strip()
    if text[-1:] in ("Z", "z"):  # Python 3.10's fromisoformat reads no Z
        text = text[:-1] + "+00:00"
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write a date or time (2026-12-01, 2026-12-01T18:00Z) or a duration"
            " from now (7d, 36h)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: write 0 to 65535")
    return n


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cmroot", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"cmroot {__version__}")
    # Global options work before or after the verb; SUPPRESS keeps a subparser from
    # overwriting a value given before it, and `_COMMON_DEFAULTS` fills what is left.
    common = _Parser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument(
        "--config",
        help="TOML config or hive-site.xml (default: $CMROOT_CONFIG, /etc/cmroot/cmroot.toml, "
        "then the embedded defaults)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--url", help="act through the daemon at this URL (or $CMROOT_URL)")
    common.add_argument(
        "--token-file", help="file holding the bearer token for the daemon (or $CMROOT_TOKEN)"
    )
    common.add_argument(
        "--token", help="bearer token; visible to every local user in `ps`: prefer --token-file"
    )
    common.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    common.add_argument(
        "--log-json", action="store_true", help="log lines as JSON on stderr (as `serve` does)"
    )
    for action in common._actions:
        p._add_action(action)
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    s = sub.add_parser("serve", parents=[common], help="run the daemon in the foreground")
    s.add_argument("--host")
    s.add_argument("--port", type=_port)

    s = sub.add_parser("recycle", parents=[common], help="move (or copy) files into the store")
    s.add_argument("paths", nargs="+")
    s.add_argument("--mode", choices=["move", "copy"], default="move")
    s.add_argument("--purge", action="store_true", help="delete, not trash, at expiry")
    s.add_argument("--op", help=f"what removed the files (required): {_OPS}")
    s.add_argument("--db")
    s.add_argument(
        "--table", help="label the files as this table's: the paths must all be in one table"
    )
    s.add_argument("--partition", action="append", default=[], metavar="K=V[,K=V]")

    s = sub.add_parser("resolve", parents=[common], help="where are the bytes of PATH@CHECKSUM")
    s.add_argument("pairs", nargs="*", metavar="PATH@CHECKSUM")
    s.add_argument(
        "--from-file", help="JSON list of {path, checksum}, or lines 'PATH CHECKSUM' ('-': stdin)"
    )

    s = sub.add_parser("get", parents=[common], help="write the bytes of (PATH, CHECKSUM)")
    s.add_argument("path")
    s.add_argument("checksum")
    s.add_argument("-o", "--output", help="file to write (default: stdout)")

    s = sub.add_parser("ls", parents=[common], help="list entries, newest first")
    s.add_argument("--db")
    s.add_argument("--table")
    s.add_argument("--limit", type=_count, default=100)
    s.add_argument("--cursor", type=int)
    s.add_argument(
        "--all", action="store_true", help="show housekeeping files too (_SUCCESS, .*.crc)"
    )

    s = sub.add_parser(
        "hold", parents=[common], help="keep a database's or table's recycled files past expiry"
    )
    hold = s.add_subparsers(dest="hold_verb", required=True, metavar="add|ls|rm")
    h = hold.add_parser("add", parents=[common], help="hold DB or DB.TABLE until WHEN")
    h.add_argument("name", metavar="DB[.TABLE]")
    h.add_argument(
        "--until", required=True, type=_until,
        help="a date or time (2026-12-01, 2026-12-01T18:00, UTC unless an offset is given)"
        " or a duration from now (7d, 36h)",
    )
    h.add_argument("--reason", required=True, help="why: shown by `hold ls` and logged")
    h = hold.add_parser("ls", parents=[common], help="list holds in force")
    h.add_argument("--all", action="store_true", help="holds past their time too")
    h = hold.add_parser("rm", parents=[common], help="release a hold")
    h.add_argument("id", type=_hold_id, metavar="ID")

    s = sub.add_parser("gc", parents=[common], help="run a retention sweep now")
    s.add_argument(
        "--dry-run", action="store_true",
        help="remove nothing: say which tables and partitions would lose files",
    )
    s.add_argument("--files", action="store_true", help="with --dry-run: the paths too")
    s.add_argument(
        "--all", action="store_true",
        help="with --dry-run: housekeeping files (_SUCCESS, .*.crc) too",
    )

    s = sub.add_parser(
        "checksum", parents=[common], help="xxh3-128 of files (paths or fsspec URLs)"
    )
    s.add_argument("paths", nargs="+")

    s = sub.add_parser("fsck", parents=[common], help="check store and index agree")
    s.add_argument("--repair", action="store_true")

    s = sub.add_parser(
        "spark-conf",
        parents=[common],
        help="build the Spark shim and print the --conf lines that turn the hook on",
    )
    s.add_argument(
        "--format",
        choices=["submit", "defaults"],
        default="submit",
        help="`--conf k=v` lines (default) or spark-defaults.conf lines",
    )
    s.add_argument("--fail-open", action="store_true", help="delete anyway if cmroot is down")
    s.add_argument(
        "--metastore-plugin",
        action="store_true",
        help="the application's remote metastore (hive.metastore.uris) runs the cmroot plugin "
        "(`cmroot metastore-conf`): drops are left to it",
    )
    s.add_argument(
        "--scheme",
        action="append",
        metavar="SCHEME[=CLASS]",
        help="a Hadoop file system the warehouse is on besides file:// (hdfs, s3a, abfs, abfss,"
        " gs, viewfs; another with its file system class): its hook is built and set "
        "(repeatable)",
    )
    s.add_argument(
        "--scheme-jar",
        action="append",
        default=[],
        metavar="JAR",
        help="a jar holding a --scheme's file system class, if not in pyspark's (repeatable)",
    )
    s.add_argument(
        "--warehouse-dir",
        metavar="DIR",
        help="spark.sql.warehouse.dir to print (default: the first local warehouse root when "
        "--url is this config's daemon, unless $SPARK_CONF_DIR/spark-defaults.conf sets one)",
    )

    s = sub.add_parser(
        "metastore-conf",
        parents=[common],
        help="build the metastore plugin and print what a Hive metastore's hive-site.xml needs",
    )
    s.add_argument(
        "--format",
        choices=["xml", "properties"],
        default="xml",
        help="<property> elements for hive-site.xml (default) or key=value lines",
    )
    s.add_argument("--fail-open", action="store_true", help="drop anyway if cmroot is down")
    s.add_argument(
        "--warehouse-root",
        action="append",
        metavar="DIR",
        help="a directory the plugin protects (repeatable; default: the metastore's "
        "hive.metastore.warehouse.dir)",
    )

    s = sub.add_parser("repl", parents=[common], help="replicate a database or table on Spark")
    repl = s.add_subparsers(dest="repl_verb", required=True, metavar="ACTION")
    with_help = "a Spark setting (or cmroot.url / cmroot.token for the loader); repeatable"
    r = repl.add_parser(
        "dump", parents=[common], help="write a dump: a bootstrap, or the events after --from"
    )
    r.add_argument("scope", nargs="?", metavar="DB[.TABLE]")
    r.add_argument("--from", dest="from_id", type=int, metavar="N",
                   help="incremental: the events after N (the id `repl status` printed)")
    r.add_argument("--after", metavar="URI",
                   help="incremental: continue the dump at URI (its scope, from its last"
                        " event, a table followed through its renames)")
    r.add_argument("--to", dest="to_id", type=int, metavar="M", help="up to event M")
    r.add_argument("--limit", type=_count, metavar="K", help="at most K events")
    r.add_argument("--to-dir", required=True, metavar="URI", help="where to write the dump")
    r.add_argument("--with", dest="with_", action="append", default=[], metavar="K=V",
                   help=with_help)
    r = repl.add_parser("load", parents=[common], help="apply a dump on this Spark catalog")
    r.add_argument("scope", nargs="?", metavar="DB[.TABLE]", help="load under this name")
    r.add_argument("--from-dir", required=True, metavar="URI", help="the dump directory")
    r.add_argument("--with", dest="with_", action="append", default=[], metavar="K=V",
                   help=with_help)
    r = repl.add_parser(
        "status", parents=[common], help="the last source event applied to DB[.TABLE]"
    )
    r.add_argument("scope", metavar="DB[.TABLE]")
    r.add_argument("--with", dest="with_", action="append", default=[], metavar="K=V",
                   help=with_help)

    s = sub.add_parser(
        "restore", parents=[common],
        help="undo a drop, truncate or overwrite, or rebuild a table as it was (on Spark)",
    )
    s.add_argument("event_id", nargs="?", type=_count, metavar="EVENT_ID",
                   help="the DROP_TABLE, DROP_PARTITION, TRUNCATE, INSERT_OVERWRITE or"
                        " DROP_DATABASE event to undo")
    s.add_argument("--db", help="with --table and --as-of: the table to rebuild")
    s.add_argument("--table")
    s.add_argument("--partition", action="append", default=[], metavar="K=V",
                   help="with --as-of: rebuild this partition only (one K=V per column)")
    s.add_argument("--as-of", metavar="EVENT_ID|TIME",
                   help="the table as it was after this event, or at this time (UTC unless"
                        " it says)")
    s.add_argument("--as", dest="as_name", metavar="DB.TABLE",
                   help="restore into this new table instead of in place")
    s.add_argument("--dry-run", action="store_true",
                   help="say what would come back; change nothing")
    s.add_argument("--replace", action="store_true",
                   help="move live data in the way to the cmroot first (else refused)")
    s.add_argument("--with", dest="with_", action="append", default=[], metavar="K=V",
                   help="a Spark setting (or cmroot.url / cmroot.token); repeatable")

    s = sub.add_parser("token", parents=[common], help="create API tokens")
    s.add_argument("action", choices=["create"])
    s.add_argument("--scope", choices=["read", "write", "admin"], required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key, default in _common_defaults().items():
        if not hasattr(args, key):
            setattr(args, key, default)
    # The daemon logs JSON for journald; a verb at a terminal logs only warnings, as text.
    if args.verb == "serve" or args.log_json or os.environ.get("CMROOT_LOG_LEVEL"):
        setup_logging()
    else:
        setup_cli_logging()
    try:
        args.token = _token_of(args)
        return _VERBS[args.verb](args)
    except BrokenPipeError:
        # stdout's reader is gone (`cmroot ls | head -1`): nothing is wrong, and nobody
        # reads an error either. Exit as a program killed by SIGPIPE does; stdout goes to
        # /dev/null so that its flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except CmrootError as e:
        _fail(args, e.message, e.detail, type(e).__name__)
        return 2 if e.status < 500 else 1
    except OSError as e:
        _fail(args, _os_message(e), "check the path and its permissions", type(e).__name__)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one line, the traceback is for whoever asks
        log.debug("unexpected error", exc_info=True)
        _fail(
            args,
            f"unexpected {type(e).__name__}: {e}",
            "rerun with CMROOT_LOG_LEVEL=debug for the traceback, and report it",
            type(e).__name__,
        )
        return 1


def _common_defaults() -> dict[str, Any]:
    return {
        "config": None,
        "json": False,
        "quiet": False,
        "log_json": False,
        "url": os.environ.get("CMROOT_URL"),
        "token": None,
        "token_file": None,
    }


def _token_of(args: argparse.Namespace) -> str | None:
    """--token (warned about: `ps` shows it), else --token-file, else $CMROOT_TOKEN."""
    if args.token:
        log.warning(
            "--token on the command line is visible to every local user (ps, /proc); "
            "use --token-file FILE or $CMROOT_TOKEN instead"
        )
        return str(args.token)
    if args.token_file:
        try:
            with open(args.token_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                token = f.read().decode().strip()
        except OSError as e:
            raise ConfigError(
                f"cannot read --token-file {args.token_file}", f"{e.strerror}: fix the path"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"--token-file {args.token_file} is not text",
                "write the token from `cmroot token create` into it, alone",
            ) from None
        if not token:
            raise ConfigError(
                f"--token-file {args.token_file} is empty",
                "write the token from `cmroot token create` into it",
            )
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                f"--token-file {args.token_file} can be read by other users: "
                f"chmod 600 {args.token_file}"
            )
        return token
    return os.environ.get("CMROOT_TOKEN") or None


def _os_message(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def _fail(args: argparse.Namespace, message: str, detail: str, kind: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "detail": detail, "kind": kind}), file=sys.stderr)
    else:
        print(f"cmroot: {message}" + (f": {detail}" if detail else ""), file=sys.stderr)


def _load(args: argparse.Namespace) -> cfg.Config:
    path = args.config or cfg.default_config_path()
    if not args.config and path and not os.path.isfile(path):
        raise ConfigError(
            f"$CMROOT_CONFIG names {path}, which is not a file",
            "fix or unset CMROOT_CONFIG, or pass --config FILE",
        )
    return cfg.load(path)


def _open_store(config: cfg.Config, readonly: bool = False) -> Store:
    try:
        return Store.open(config, readonly=readonly)
    except OSError as e:
        raise ConfigError(
            f"cannot open the store at {config.store.root}",
            f"{_os_message(e)}; check store.root in {config.source} and its permissions",
        ) from None


def _out(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=None if args.json else 2) if args.json else human(data))


@contextmanager
def _backend(args: argparse.Namespace, readonly: bool = False) -> Iterator[Any]:
    """A Store opened directly, or a Client of the daemon. With no --url, a store held by a
    running daemon is reached through that daemon."""
    config = _load(args)
    if args.url:
        yield _client(args.url, args.token)
        return
    try:
        store = _open_store(config, readonly)
    except StoreLocked:
        log.info(
            "store in use by the daemon; acting through it", extra={"url": config.server.base_url}
        )
        yield _client(config.server.base_url, args.token)
        return
    try:
        yield _Direct(store)
    finally:
        store.close()


def _client(url: str, token: str | None) -> Client:
    return Client(url, token, audit=audit.here("cmroot"))


class _Direct:
    """The store, answering with the same JSON shapes as the daemon's API."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def recycle(
        self, paths: list[str], progress: Callable[[int, int], None] | None = None, **kw: Any
    ) -> RecycleResult:
        return self.store.recycle(
            RecycleRequest(paths=paths, audit=audit.here("cmroot"), **kw), progress
        )

    def resolve(self, files: list[dict[str, str]]) -> Resolutions:
        return Resolutions([Resolved(**r.to_json()) for r in self.store.resolve(files)])

    def get(self, path: str, checksum: str, out: Any) -> int:
        """Copy from the descriptor the store verified, never by reopening the path."""
        with self.store.open_verified(path, checksum) as v:
            n, copied = v.copy_to(out)
        if copied != v.checksum:  # the bytes written are hashed as they are written
            raise ChecksumMismatch(
                "file changed while copied",
                f"{path}: what was read no longer hashes to {checksum}; run cmroot get again",
            )
        return n

    def entries(self, all: bool = True, **kw: Any) -> dict[str, Any]:
        rows = self.store.listing(housekeeping=all, **kw)
        return {"entries": rows, "cursor": rows[-1]["id"] if rows else None}

    def add_hold(self, db: str, table: str | None, until: float, reason: str) -> dict[str, Any]:
        return self.store.add_hold(db, table, until, reason).to_json()

    def holds(self, everything: bool = False) -> dict[str, Any]:
        return {"holds": [h.to_json() for h in self.store.holds(everything)]}

    def remove_hold(self, hold_id: int) -> dict[str, Any]:
        self.store.remove_hold(hold_id)
        return {"removed": hold_id}

    def gc(
        self, dry_run: bool, progress: Callable[[int], None] | None = None,
        files: bool = False, everything: bool = False,
    ) -> dict[str, Any]:
        return self.store.gc(dry_run, progress, files, everything).to_json()


def _serve(args: argparse.Namespace) -> int:
    from cmroot.server.main import serve

    config = _load(args)
    try:
        return serve(config, host=args.host, port=args.port)
    except OSError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        host = args.host or config.server.host
        port = config.server.port if args.port is None else args.port
        raise ConfigError(
            f"cannot listen on {host}:{port}: {e.strerror}",
            "stop what listens there or pass another --port/--host (server.port, server.host)",
        ) from None


def _recycle(args: argparse.Namespace) -> int:
    if args.op is None:
        raise BadRequest("recycle needs --op", f"say what removed the files: --op {_OPS}")
    if args.op not in DESTRUCTIVE:
        raise BadRequest(f"unknown op {args.op!r}", f"use one of {_OPS}")
    partitions = [_kv(p) for p in args.partition]
    # One table per --table label and no warehouse root: the store refuses those, for
    # every client alike.
    with _backend(args) as b:
        res = b.recycle(
            list(args.paths),
            mode=args.mode,
            purge=args.purge,
            op=args.op,
            db=args.db,
            table=args.table,
            partitions=partitions,
            progress=Progress("recycled files", not args.quiet),
        ).to_json()
    _out(
        args,
        res,
        lambda r: "\n".join(
            [f"event {r['event_id']}: {len(r['files'])} files recycled"]
            + [f"{f['checksum']}  {f['size']:>12}  {f['path']}" for f in r["files"]]
        ),
    )
    return 0


def _kv(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise BadRequest("bad --partition", f"{text!r}: write key=value[,key=value]")
        out[k] = v
    return out


def _resolve(args: argparse.Namespace) -> int:
    files = [_pair(p) for p in args.pairs]
    if args.from_file:
        files += _read_pairs(args.from_file)
    if not files:
        raise BadRequest("nothing to resolve", "give PATH@CHECKSUM arguments or --from-file")
    with _backend(args, readonly=True) as b:
        res = b.resolve(files).to_json()
    _out(
        args,
        res,
        lambda r: "\n".join(
            f"{f['status']:<8}  {f['checksum']}  {f['path']}"
            + (f"  -> {f['location']}" if f["status"] == "cmroot" else "")
            for f in r["files"]
        ),
    )
    return 0 if all(f["status"] != "missing" for f in res["files"]) else 3


def _pair(text: str) -> dict[str, str]:
    path, sep, checksum = text.rpartition("@")
    if not sep:
        raise BadRequest("bad pair", f"{text!r}: write PATH@CHECKSUM")
    return {"path": path, "checksum": checksum}


def _read_pairs(source: str) -> list[dict[str, str]]:
    try:
        if source == "-":
            text = sys.stdin.read()
        else:
            with open(source, encoding="utf-8") as f:
                text = f.read()
    except UnicodeDecodeError:
        raise BadRequest(
            "bad --from-file", "not UTF-8 text: write JSON or 'PATH CHECKSUM' lines"
        ) from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRequest(
                "bad --from-file", f"not valid JSON ({e}): write a list of {{path, checksum}}"
            ) from None
        if not isinstance(data, list):
            raise BadRequest("bad --from-file", "the JSON must be a list of {path, checksum}")
        return data
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            path, _, checksum = line.strip().rpartition(" ")
            if not path:
                raise BadRequest("bad --from-file", f"line {n}: write 'PATH CHECKSUM'")
            pairs.append({"path": path.strip(), "checksum": checksum})
    return pairs


def _get(args: argparse.Namespace) -> int:
    with _backend(args, readonly=True) as b:
        if args.output:
            tmp = args.output + ".cmroot-part"
            try:
                with open(tmp, "wb") as out:
                    size = b.get(args.path, args.checksum, out)
                os.replace(tmp, args.output)
            except BaseException:
                # Half a file (or bytes that failed their checksum) is not left behind.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:
            size = b.get(args.path, args.checksum, sys.stdout.buffer)
            sys.stdout.buffer.flush()
    if args.output:
        _out(
            args,
            {"path": args.path, "checksum": args.checksum, "size": size, "output": args.output},
            lambda r: f"wrote {r['size']} bytes to {r['output']}",
        )
    return 0


def _ls(args: argparse.Namespace) -> int:
    with _backend(args, readonly=True) as b:
        res = b.entries(
            db=args.db, table=args.table, limit=args.limit, cursor=args.cursor, all=args.all
        )
    _out(args, res, _ls_text)
    return 0


def _shown(value: str) -> str:
    """A value as a terminal line may show it: control characters (a newline in a file
    name would forge a row; an escape sequence rewrite the terminal) and the bytes of a
    name that is not UTF-8 written as escapes."""
    return "".join(
        f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc"
        else (f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else c)
        for c in value
    )


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))


def _ls_text(r: dict[str, Any]) -> str:
    """A table with a header, one entry a line, the path last (it is the longest)."""
    rows: list[tuple[str, ...]] = [
        ("RECYCLED (UTC)", "OP", "TABLE", "PARTITION", "SIZE", "EXPIRES (UTC)", "BY", "PATH")
    ]
    for e in r["entries"]:
        table = ".".join(x for x in (e.get("db"), e.get("table")) if x) or "-"
        part = ",".join(f"{k}={v}" for k, v in (e.get("partition") or {}).items()) or "-"
        held = e.get("held_until")
        expires = _utc(e["expires"]) + (f" held to {_utc(held)}" if held else "")
        rows.append((_utc(e["recycled"]), e["op"], table, part, _bytes(e["size"]), expires,
                     audit.to_text(e.get("audit")), e["path"]))
    if len(rows) == 1:
        return "no entries"
    more = f"\n(more: --cursor {r['cursor']})" if r.get("cursor") else ""
    return _table(rows) + more


def _table(rows: list[tuple[str, ...]]) -> str:
    """Rows (the header first) in aligned columns, the last one unpadded (it is the
    longest); every cell as a terminal may show it (`_shown`)."""
    shown = [tuple(_shown(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in shown) for i in range(len(shown[0]) - 1)]
    return "\n".join(
        ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
        .rstrip()
        for row in shown
    )


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _hold(args: argparse.Namespace) -> int:
    with _backend(args) as b:
        if args.hold_verb == "add":
            db, dot, table = args.name.partition(".")
            if dot and not table:
                raise BadRequest(
                    f"bad table in {args.name!r}",
                    "write DB for a whole database, or DB.TABLE for one table",
                )
            res = b.add_hold(db, table or None, args.until, args.reason)
            _out(args, res, lambda h: f"hold {h['id']} on {_held_name(h)} until "
                                      f"{_utc(h['until'])} UTC")
        elif args.hold_verb == "ls":
            res = b.holds(args.all)
            _out(args, res, _holds_text)
        else:
            res = b.remove_hold(args.id)
            _out(args, res, lambda r: f"hold {r['removed']} released")
    return 0


def _held_name(h: dict[str, Any]) -> str:
    return f"{h['db']}.{h['table']}" if h.get("table") else f"{h['db']} (every table)"


def _holds_text(r: dict[str, Any]) -> str:
    if not r["holds"]:
        return "no holds"
    rows: list[tuple[str, ...]] = [("ID", "HOLDS", "UNTIL (UTC)", "SINCE (UTC)", "REASON")]
    rows += [(str(h["id"]), _held_name(h), _utc(h["until"]), _utc(h["created"]), h["reason"])
             for h in r["holds"]]
    return _table(rows)


def _gc(args: argparse.Namespace) -> int:
    if (args.files or args.all) and not args.dry_run:
        raise BadRequest("--files and --all go with --dry-run",
                         "a sweep reports counts; `cmroot gc --dry-run --files` names files")
    with _backend(args) as b:
        res = b.gc(args.dry_run, progress=Progress("removed objects", not args.quiet),
                   files=args.files, everything=args.all)
    _out(args, res, _gc_text)
    return 1 if _gc_failures(res)[0] else 0


_GC_SHOWN = 20  # failures the summary prints; --json has the report's sample


def _gc_failures(r: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """(count, sample) of a sweep's failures; a daemon before counted reports sent a list."""
    failed = r.get("failed", 0)
    if isinstance(failed, list):
        return len(failed), failed
    return int(failed), list(r.get("failures") or [])


def _gc_text(r: dict[str, Any]) -> str:
    verb = "would remove" if r["dry_run"] else "removed"
    failed, failures = _gc_failures(r)
    lines = [
        f"{verb} {r['removed_objects']} objects ({r['removed_bytes']} bytes); "
        f"{failed} failed, {r['skipped']} skipped (in use)"
        + (f" in {r['duration']:.1f}s" if isinstance(r.get("duration"), (int, float)) else "")
    ]
    if r.get("evicted_objects"):
        lines.append(
            f"{'would evict' if r['dry_run'] else 'evicted'} {r['evicted_objects']} of them"
            f" ({r['evicted_bytes']} bytes) before their expiry: the store is over"
            f" store.max_bytes ({r['budget_bytes']} bytes)"
        )
    if r.get("held_objects"):
        lines.append(
            f"kept {r['held_objects']} expired objects ({r['held_bytes']} bytes) for holds"
            " (cmroot hold ls)"
        )
    if r.get("over_budget_bytes"):
        lines.append(
            f"still {r['over_budget_bytes']} bytes over store.max_bytes: the rest is younger"
            " than store.min_retain or held"
        )
    for t in r.get("tables") or []:
        name = ".".join(x for x in (t["db"], t["table"]) if x) or "(no table)"
        part = f" [{t['partition']}]" if t.get("partition") else ""
        lines.append(f"  {_shown(name + part)}: {t['files']} files, {_bytes(t['bytes'])}")
    if r.get("tables_truncated"):
        lines.append("  ... more tables: --json lists the first 1,000")
    for f in r.get("files") or []:
        lines.append(f"  {_shown(f['path'])}  {_bytes(f['size'])}")
    if r.get("files_truncated"):
        lines.append("  ... more files: --json lists the first 1,000")
    lines += [f"failed {f['checksum']}: {f['error']}" for f in failures[:_GC_SHOWN]]
    if failed > min(len(failures), _GC_SHOWN):
        lines.append(f"... {failed - min(len(failures), _GC_SHOWN)} more failures not shown")
    return "\n".join(lines)


def _checksum(args: argparse.Namespace) -> int:
    def one(url: str) -> str:
        fs, path = fsspec.core.url_to_fs(url)
        try:
            return cks.of_file(fs, path)
        except FileNotFoundError:
            raise NotFound("no such file", url) from None
        except IsADirectoryError:
            raise BadRequest("not a file", f"{url} is a directory") from None

    progress = Progress("hashed files", not args.quiet and len(args.paths) > 100)
    rows = [
        {"path": p, "checksum": c}
        for p, c in cks.many(one, args.paths, progress=lambda i: progress(i, len(args.paths)))
    ]
    _out(
        args,
        {"files": rows},
        lambda r: "\n".join(f"{f['checksum']}  {f['path']}" for f in r["files"]),
    )
    return 0


def _fsck(args: argparse.Namespace) -> int:
    """Exit 0: clean (or every finding repaired); 1: findings (without --repair), or
    findings no repair fixes (unreadable files, troubled recycle transactions)."""
    config = _load(args)
    progress = Progress("fsck: shards checked", not args.quiet)
    if args.url:
        res = _fsck_through(args.url, args.token, args.repair)
    else:
        try:
            with _open_store(config) as store:
                res = store.fsck(args.repair, progress).to_json()
        except StoreLocked:
            # The daemon holds the store: it checks (and repairs) exactly, deciding each
            # finding under the lock its recycles and sweeps take. Only a check, and only
            # when the daemon cannot be reached, runs here, read-only beside it.
            try:
                res = _fsck_through(config.server.base_url, args.token, args.repair)
            except (DaemonUnavailable, Unauthorized, Forbidden) as e:
                if args.repair:
                    raise
                log.warning(
                    "the daemon holds the store but did not check it (%s): checking"
                    " read-only beside it; work in flight may show as findings, check"
                    " again (an admin token lets the daemon check exactly)", e.message,
                    extra={"url": config.server.base_url},
                )
                with _open_store(config, readonly=True) as store:
                    res = store.fsck(False, progress, online=True).to_json()
    _out(args, res, _fsck_text)
    if res["clean"]:
        return 0
    needs_attention = res["counts"]["unreadable"] or res["counts"]["quarantined_transactions"]
    return 1 if needs_attention or not args.repair else 0


def _fsck_through(url: str, token: str | None, repair: bool) -> dict[str, Any]:
    """fsck in the daemon: as long as hashing the store takes, so no read timeout."""
    return Client(url, token, timeout=None).fsck(repair)


_FSCK_SHOWN = 20  # items of each list the summary prints; --json has the rest


def _fsck_text(r: dict[str, Any]) -> str:
    counts: dict[str, int] = r["counts"]
    head = f"checked {r['checked']} objects in {r['shards']} shards: "
    if r["clean"]:
        return head + "clean"
    found = [f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n]
    lines = [head + ", ".join(found) + (" (repair ran)" if r["repair"] else "")]

    def section(key: str, title: str, fmt: Callable[[Any], str]) -> None:
        if not counts[key]:
            return
        lines.append(f"{title}:")
        lines.extend("  " + fmt(x) for x in r[key][:_FSCK_SHOWN])
        if counts[key] > _FSCK_SHOWN:
            lines.append(f"  ... and {counts[key] - _FSCK_SHOWN} more (all counted; --json "
                         f"lists up to {r['limit']})")

    section("unreadable", "unreadable (left as they are, index rows kept)",
            lambda x: f"{x['path']}: {x['error']}")
    section("corrupt", "corrupt (bytes do not hash to the name"
            + ("; quarantined" if r["repair"] else "; --repair quarantines") + ")", str)
    section("missing", "missing (indexed, not on disk"
            + ("; rows forgotten" if r["repair"] else "; --repair forgets the rows") + ")", str)
    section("misplaced", "in the wrong shard", lambda x: f"{x['path']}: {x['action']}")
    section("unindexed", "unindexed (on disk, not in the index"
            + ("; registered" if r["repair"] else "; --repair registers them") + ")", str)
    section("stray", "stray files (not objects; never touched)", str)
    section("quarantined_transactions", "recycle transactions recovery could not finish",
            lambda x: f"{x['txid']} {x['state']}, {x['files']} files in {x['staging']}: "
            f"{x['error']}")
    if counts["quarantined_transactions"]:
        lines.append(
            "  what to do: fix the cause in the error above (a source directory that is now a "
            "file, permissions, a full disk), then restart the daemon (or run cmroot fsck "
            "again): recovery retries them when the store opens. A quarantined recycle's files "
            "are in its staging directory until then; never delete them by hand."
        )
    if counts["unreadable"]:
        lines.append(
            "  what to do: check the disk (dmesg, SMART) and the permissions of the paths "
            "above; fsck keeps them and their index rows until they can be read."
        )
    return "\n".join(lines)


def _token(args: argparse.Namespace) -> int:
    from cmroot.server.auth import new_token

    token, line = new_token(args.scope)
    _out(
        args,
        {"token": token, "scope": args.scope, "config": line},
        lambda r: (
            f"token (give it to the client; it is not stored): {r['token']}\n"
            f"add to [auth] tokens in the config:  {r['config']}"
        ),
    )
    return 0


def _spark_conf(args: argparse.Namespace) -> int:
    from cmroot import spark

    config = _load(args)
    url = args.url or config.server.base_url
    if not url.startswith(("http://", "https://")):
        # The JVM hook speaks HTTP over TCP only; a unix:// URL would fail every statement.
        raise ConfigError(
            f"spark-conf needs the daemon's http(s) URL, not {url!r}",
            "give --url http://host:port (the daemon listens on TCP besides server.socket)",
        )
    conf = spark.spark_conf(url, args.token, fail_open=args.fail_open,
                            metastore_plugin=args.metastore_plugin,
                            schemes=_schemes(args.scheme or []),
                            scheme_jars=tuple(_readable_jars(args.scheme_jar)))
    # The local config's roots are that daemon's only when it is the daemon the URL names:
    # for another one, a guessed warehouse dir would point Spark outside its roots.
    own = args.url is None or args.url.rstrip("/") == config.server.base_url.rstrip("/")
    warehouse = args.warehouse_dir or (_spark_warehouse(config) if own else None)
    if warehouse:
        conf["spark.sql.warehouse.dir"] = warehouse
    _out(args, conf, lambda c: "\n".join(spark.format_conf(c, args.format)))
    return 0


def _schemes(specs: list[str]) -> dict[str, str | None]:
    """`--scheme` values as {scheme: class or None}; a malformed one is refused."""
    out: dict[str, str | None] = {}
    for spec in specs:
        scheme, _, cls = spec.partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme) or scheme == "file" or (
            cls and not re.fullmatch(r"[A-Za-z_$][\w$]*(\.[A-Za-z_$][\w$]*)+", cls)
        ):
            raise ConfigError(
                f"--scheme {spec!r} is not SCHEME or SCHEME=CLASS",
                "e.g. --scheme hdfs, or --scheme myfs=com.example.MyFileSystem (file:// is "
                "always hooked)",
            )
        out[scheme] = cls or None
    return out


def _readable_jars(jars: list[str]) -> list[str]:
    for jar in jars:
        if not os.path.isfile(jar) or not os.access(jar, os.R_OK):
            raise ConfigError(f"--scheme-jar {jar}: no readable file there",
                              "give the path of the jar holding the file system class")
    return [os.path.abspath(j) for j in jars]


def _metastore_conf(args: argparse.Namespace) -> int:
    from cmroot import metastore

    config = _load(args)
    url = args.url or config.server.base_url
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"metastore-conf needs the daemon's http(s) URL, not {url!r}",
            "give --url http://host:port (the daemon listens on TCP besides server.socket)",
        )
    token_file = args.token_file
    if token_file and not os.path.isfile(token_file):
        raise ConfigError(
            f"--token-file {token_file} is not a file",
            "write the token from `cmroot token create` into it (chmod 600, owned by the "
            "metastore's user); the plugin reads it at each call",
        )
    for root in args.warehouse_root or []:
        cfg.absolute_root(root, "--warehouse-root")  # as the daemon's own roots are checked
    token = None if token_file else args.token
    out = metastore.metastore_conf(
        url, token, token_file=token_file, fail_open=args.fail_open,
        warehouse_roots=args.warehouse_root,
    )
    if args.json:
        print(json.dumps(out))
        return 0
    props: dict[str, str] = out["properties"]  # type: ignore[assignment]
    classpath: list[str] = out["classpath"]  # type: ignore[assignment]
    comment = "#" if args.format == "properties" else None
    head = f"the metastore's class path needs: {os.pathsep.join(classpath)}"
    print(f"# {head}" if comment else f"<!-- {head} -->")
    print(metastore.format_conf(props, args.format))
    return 0


def _spark_warehouse(config: cfg.Config) -> str | None:
    """The first local warehouse root, unless spark-defaults.conf already sets one: Spark's
    own default (`./spark-warehouse`) is outside every root, so the hook would refuse it."""
    home = os.environ.get("SPARK_HOME")
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (home and os.path.join(home, "conf"))
    if conf_dir:
        defaults = os.path.join(conf_dir, "spark-defaults.conf")
        with contextlib.suppress(OSError), open(defaults) as f:
            if any(line.split()[:1] == ["spark.sql.warehouse.dir"] for line in f):
                return None
    return next((p for r in config.store.warehouse_roots if (p := cfg.local_path(r))), None)


def _repl(args: argparse.Namespace) -> int:
    from cmroot import repl
    from cmroot.repl.session import parse_with, session

    conf, options = parse_with(args.with_)
    db, _, table = args.scope.partition(".") if args.scope else ("", "", "")
    if args.repl_verb == "dump":
        url = options.get("url") or args.url or _load(args).server.base_url
        token = options.get("token") or args.token
        if args.after is not None and (args.scope or args.from_id is not None):
            raise BadRequest(
                "--after takes its scope and start from the dump it continues",
                "leave DB[.TABLE] and --from out, or give them without --after",
            )
        if args.after is None and not args.scope:
            raise BadRequest("nothing to dump", "give DB[.TABLE], or --after DUMP_DIR")
        spark = None
        if args.from_id is None and args.after is None:
            spark = session("cmroot repl dump", conf, hook=(url, token))
        progress = _ReplProgress(not args.quiet)
        with contextlib.closing(_client(url, token)) as client:
            try:
                if args.after is not None:
                    where, header = repl.after(client, args.after, args.to_dir, args.to_id,
                                               args.limit, progress)
                else:
                    where, header = repl.dump(
                        client, db, table or None, args.to_dir, args.from_id, args.to_id,
                        args.limit, spark, progress,
                    )
            except OSError as e:
                raise ConfigError(
                    f"cannot write the dump to {args.to_dir}",
                    f"{_os_message(e)}: give a --to-dir you can create and write",
                ) from None
        _out(
            args,
            {"dump_dir": where, "last_event_id": header.last_event_id, "kind": header.kind,
             "events": header.events, "files": header.files, "bytes": header.bytes,
             "table_now": header.table_now},
            lambda r: f"{r['dump_dir']}\t{r['last_event_id']}",
        )
        return 0
    spark = session(f"cmroot repl {args.repl_verb}", conf)
    if args.repl_verb == "status":
        last = repl.status(spark, db, table or None)
        _out(args, {"scope": args.scope, "last_event_id": last},
             lambda r: "" if r["last_event_id"] is None else str(r["last_event_id"]))
        return 0
    result = repl.load(
        spark, args.from_dir, args.scope, options.get("url") or args.url,
        options.get("token") or args.token, _ReplProgress(not args.quiet),
    )
    _out(
        args,
        result.to_json(),
        lambda r: (
            f"loaded {r['db'] + ('.' + r['table'] if r['table'] else '')}: {r['events']} events, "
            f"{r['files']} files ({r['bytes']} bytes; "
            + ", ".join(f"{n} {k}" for k, n in sorted(r["sources"].items()))
            + f"); at event {r['last_event_id']}"
        ),
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    from cmroot.repl.restore import restore
    from cmroot.repl.session import parse_with, session

    conf, options = parse_with(args.with_)
    partition: dict[str, str] = {}
    for item in args.partition:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise BadRequest("bad --partition", f"{item!r}: write COLUMN=VALUE")
        partition[k.strip().lower()] = v
    url = options.get("url") or args.url or _load(args).server.base_url
    token = options.get("token") or args.token
    client = Client(url, token, audit={**audit.here("cmroot"),
                                       "statement": audit.text(" ".join(["cmroot restore",
                                                                         *sys.argv[2:]]))})
    with contextlib.closing(client):
        spark = session("cmroot restore", conf, hook=(url, token))
        result = restore(
            spark, client, args.event_id, db=args.db, table=args.table,
            partition=partition or None, as_of=args.as_of, as_name=args.as_name,
            dry_run=args.dry_run, replace=args.replace, progress=_ReplProgress(not args.quiet),
        )
    _out(args, result.to_json(), _restored)
    return 0


def _restored(r: dict[str, Any]) -> str:
    """One paragraph per table: what came back (or would), and what went to the cmroot."""
    would = r["dry_run"]
    lines = [f"{'would create' if would else 'created'} database {d}" for d in r["databases"]]
    for t in r["tables"]:
        what = f"event {t['event']} ({t['op']})" if t["op"] != "AS_OF" else \
            f"its state at event {t['event']}"
        lines.append(f"{'would restore' if would else 'restored'} {t['db']}.{t['table']}"
                     f" to {what}")
        if t["replaced"]:
            lines.append("  the live table is dropped first (its files to the cmroot)")
        if t["created"]:
            lines.append("  table created")
        for key, label in (("partitions_added", "partition added"),
                           ("partitions_dropped", "partition dropped")):
            for spec in t[key]:
                lines.append(f"  {label}: " + "/".join(f"{k}={v}" for k, v in spec.items()))
        lines.append(f"  {t['files']} files ({t['bytes']} bytes); {t['copied']} put back"
                     f" ({t['copied_bytes']} bytes), the others in place")
        if t["recycled"]:
            lines.append(f"  {t['recycled']} live files ({t['recycled_bytes']} bytes) to the"
                         " cmroot first")
        if t["events"]:
            lines.append("  recorded: events " + ", ".join(map(str, t["events"])))
    return "\n".join(lines)


class _ReplProgress:
    """One progress line per phase (events read, files hashed, files copied)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.lines: dict[str, Progress] = {}

    def __call__(self, what: str, done: int, total: int | None) -> None:
        line = self.lines.setdefault(what, Progress(what, self.enabled))
        line(done, total)


_VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "repl": _repl,
    "serve": _serve,
    "recycle": _recycle,
    "resolve": _resolve,
    "get": _get,
    "ls": _ls,
    "hold": _hold,
    "restore": _restore,
    "gc": _gc,
    "checksum": _checksum,
    "fsck": _fsck,
    "token": _token,
    "spark-conf": _spark_conf,
    "metastore-conf": _metastore_conf,
}


if __name__ == "__main__":
    sys.exit(main())

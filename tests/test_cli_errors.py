"""The `cmroot` command line as a new user meets it: every error is one line on stderr that
names the fix (never a traceback), refusals that prevent data-loss traps (`recycle` without
`--op`, a warehouse root, several tables under one table label), no JSON log lines unless
asked, and a token that need not be on the command line."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.cmroot_daemon import Daemon, tree, write_files
from tests.test_cli import cmroot

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("cli-errors") / "d")
    with d.serving(check_errors=False):
        yield d


def one_line_error(p: subprocess.CompletedProcess[bytes], code: int, *words: str) -> str:
    """The single stderr line of a failed command, holding every word."""
    err = p.stderr.decode()
    assert p.returncode == code, (p.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert p.stdout == b""
    for w in words:
        assert w in err, (w, err)
    return err.strip()


def local_config(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "wh").mkdir(exist_ok=True)
    cfg = tmp_path / "cmroot.toml"
    cfg.write_text(
        f'[store]\nroot = "{tmp_path}/store"\nwarehouse_roots = ["{tmp_path}/wh"]\n' + extra
    )
    return cfg


# -- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["ls", "--limit", "-3"], ["--limit", "1 or more"]),
        (["ls", "--limit", "many"], ["--limit", "many"]),
        (["serve", "--port", "99999"], ["--port", "0 to 65535"]),
        (["recycle", "/x/y"], ["--op", "DROP_TABLE"]),
        (["recycle", "/x/y", "--op", "NUKE"], ["unknown op", "DROP_TABLE"]),
        (["frobnicate"], ["frobnicate", "--help"]),
    ],
)
def test_bad_arguments_are_one_line(tmp_path: Path, args: list[str], words: list[str]) -> None:
    cfg = local_config(tmp_path)
    one_line_error(cmroot("--config", str(cfg), *args), 2, *words)


def test_spark_conf_refuses_a_unix_socket_url(tmp_path: Path) -> None:
    """The JVM hook speaks HTTP over TCP: a unix:// URL in its conf would fail every
    destructive statement, so spark-conf refuses it up front."""
    cfg = local_config(tmp_path)
    url = "unix:///run/cmroot/cmroot.sock"
    one_line_error(cmroot("--config", str(cfg), "spark-conf", "--url", url), 1, "http://")


@pytest.mark.parametrize("root", ["disk:", "warehouse/relative", "s3a:bucket"])
def test_metastore_conf_refuses_a_root_that_names_no_directory(tmp_path: Path, root: str) -> None:
    """A typo'd root would reach the plugin, which then refuses every drop: refused here,
    before the metastore is configured with it."""
    cfg = local_config(tmp_path)
    one_line_error(cmroot("--config", str(cfg), "metastore-conf", "--url", "http://h:9750",
                          "--warehouse-root", root), 1, "--warehouse-root", root)


def test_recycle_without_op_moves_nothing(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    write_files(tmp_path / "wh", {"t/f": b"x"})
    before = tree(tmp_path / "wh")
    one_line_error(cmroot("--config", str(cfg), "recycle", str(tmp_path / "wh/t/f")), 2, "--op")
    assert tree(tmp_path / "wh") == before


# -- the environment: config, store, daemon, filesystem ----------------------------------------


def test_missing_config_file(tmp_path: Path) -> None:
    one_line_error(cmroot("--config", str(tmp_path / "nope.toml"), "ls"), 1, "--config")
    one_line_error(
        cmroot("ls", env={"CMROOT_CONFIG": str(tmp_path / "nope.toml")}), 1, "CMROOT_CONFIG"
    )


def test_bad_duration_in_the_environment(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    one_line_error(
        cmroot("--config", str(cfg), "ls", env={"CMROOT_STORE_RETAIN": "24"}), 1, "24h", "unit"
    )


def test_unreadable_store(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    (tmp_path / "store").write_text("a file where the store should be")
    one_line_error(cmroot("--config", str(cfg), "ls"), 1, str(tmp_path / "store"))


def test_daemon_not_running_at_url(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    one_line_error(
        cmroot("--config", str(cfg), "--url", "http://127.0.0.1:1", "ls"), 1, "cmroot serve"
    )


def test_serve_on_a_port_in_use(tmp_path: Path, daemon: Daemon) -> None:
    cfg = local_config(tmp_path)
    p = cmroot("--config", str(cfg), "serve", "--port", str(daemon.port))
    one_line_error(p, 1, str(daemon.port), "--port")


def test_repl_dump_to_an_unwritable_dir(tmp_path: Path, daemon: Daemon) -> None:
    cfg = local_config(tmp_path)
    p = cmroot(
        "--config", str(cfg), "--url", daemon.url, "repl", "dump", "db", "--from", "0",
        "--to-dir", "/proc/nope", env={"CMROOT_TOKEN": daemon.tokens["admin"]},
    )
    one_line_error(p, 1, "/proc/nope")


# -- recycles that would lose track of what they moved ----------------------------------------


def test_recycling_a_warehouse_root_is_refused(tmp_path: Path, daemon: Daemon) -> None:
    write_files(daemon.warehouse, {"db.db/t/f": b"x"})
    before = tree(daemon.warehouse)
    token = {"CMROOT_TOKEN": daemon.tokens["admin"]}
    p = cmroot("--url", daemon.url, "recycle", str(daemon.warehouse), "--op", "DROP_TABLE",
               env=token)
    one_line_error(p, 2, "warehouse root")
    cfg = local_config(tmp_path)
    p = cmroot("--config", str(cfg), "recycle", str(tmp_path / "wh"), "--op", "DROP_TABLE")
    one_line_error(p, 2, "warehouse root")
    assert tree(daemon.warehouse) == before


@pytest.mark.parametrize(
    "named",
    [["db.db"], ["db.db/t/p=1", "db.db/u"], ["db.db/t/p=1/f0", "db.db/u/f2"], ["db.db/t", "x"]],
)
def test_several_tables_under_one_label_are_refused(tmp_path: Path, named: list[str]) -> None:
    cfg = local_config(tmp_path)
    wh = tmp_path / "wh"
    write_files(wh, {"db.db/t/p=1/f0": b"0", "db.db/t/p=2/f1": b"1", "db.db/u/f2": b"2",
                     "x/f3": b"3"})
    before = tree(wh)
    p = cmroot("--config", str(cfg), "recycle", *(str(wh / n) for n in named),
               "--op", "DROP_TABLE", "--db", "db", "--table", "t")
    one_line_error(p, 2, "one table", "--table")
    assert tree(wh) == before


def test_one_table_under_its_label_is_recycled(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    wh = tmp_path / "wh"
    write_files(wh, {"db.db/t/p=1/f0": b"0", "db.db/t/p=2/f1": b"1", "db.db/t/_SUCCESS": b"",
                     "db.db/t/p=2/.f1.crc": b"c", "db.db/u/f2": b"2"})
    p = cmroot("--config", str(cfg), "--json", "recycle", str(wh / "db.db/t/p=1"),
               str(wh / "db.db/t/p=2"), "--op", "DROP_PARTITION", "--db", "db", "--table", "t")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["files"]) == 3
    p = cmroot("--config", str(cfg), "--json", "recycle", str(wh / "db.db/t"),
               "--op", "DROP_TABLE", "--db", "db", "--table", "t")
    assert p.returncode == 0, p.stderr
    assert (wh / "db.db/u/f2").exists()


# -- logging and tokens -------------------------------------------------------------------------


def test_no_json_log_lines_unless_asked(tmp_path: Path, daemon: Daemon) -> None:
    # The daemon holds its store: a direct `gc` goes through it, which is logged at info.
    cfg = tmp_path / "c.toml"
    cfg.write_text(daemon.config_path.read_text() + f"[server]\nport = {daemon.port}\n")
    token = {"CMROOT_TOKEN": daemon.tokens["admin"]}
    gc = ["gc", "--dry-run", "-q"]
    quiet = cmroot("--config", str(cfg), *gc, env=token)
    assert quiet.returncode == 0 and quiet.stderr == b"", quiet.stderr
    for extra, env in ((["--log-json"], {}), ([], {"CMROOT_LOG_LEVEL": "info"})):
        p = cmroot("--config", str(cfg), *extra, *gc, env={**token, **env})
        assert p.returncode == 0
        lines = [json.loads(x) for x in p.stderr.decode().splitlines()]
        assert any("through it" in x["msg"] for x in lines), p.stderr


def test_token_from_a_file_or_the_environment(tmp_path: Path, daemon: Daemon) -> None:
    tf = tmp_path / "token"
    tf.write_text(daemon.tokens["read"] + "\n")
    os.chmod(tf, 0o600)
    p = cmroot("--url", daemon.url, "--token-file", str(tf), "ls")
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    p = cmroot("--url", daemon.url, "ls", env={"CMROOT_TOKEN": daemon.tokens["read"]})
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    # On the command line it still works, with a warning: `ps` shows it to every user.
    p = cmroot("--url", daemon.url, "--token", daemon.tokens["read"], "ls")
    assert p.returncode == 0
    err = p.stderr.decode()
    assert "--token-file" in err and "CMROOT_TOKEN" in err and daemon.tokens["read"] not in err
    one_line_error(
        cmroot("--url", daemon.url, "--token-file", str(tmp_path / "none"), "ls"),
        1, "--token-file", str(tmp_path / "none"),
    )
    (tmp_path / "empty").write_text("\n")
    one_line_error(
        cmroot("--url", daemon.url, "--token-file", str(tmp_path / "empty"), "ls"), 1, "empty"
    )
    # Readable by other users: it still works, with a warning naming the fix.
    os.chmod(tf, 0o644)
    p = cmroot("--url", daemon.url, "--token-file", str(tf), "ls")
    assert p.returncode == 0, p.stderr
    assert b"chmod 600" in p.stderr and daemon.tokens["read"].encode() not in p.stderr


def test_get_to_a_file_leaves_nothing_when_it_fails(tmp_path: Path, daemon: Daemon) -> None:
    out = tmp_path / "out"
    p = cmroot(
        "--url", daemon.url, "get", str(daemon.warehouse / "db.db/t/f"), "0" * 32,
        "-o", str(out), env={"CMROOT_TOKEN": daemon.tokens["read"]},
    )
    one_line_error(p, 2, "no such file")
    assert list(tmp_path.iterdir()) == [], "a partial file was left behind"

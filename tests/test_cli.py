"""The `cmroot` command line, run as a subprocess: every verb through a running daemon
(`--url`, or found through the config when the daemon holds the store), the same verbs
directly on a store, machine output with --json, exit codes, and `token create` giving a
token and a config line the daemon accepts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cmroot import checksum as cks  # noqa: E402
from tests.server.cmroot_daemon import Daemon, clean_env, tree, write_files  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def cmroot(
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    exe: list[str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*(exe or [sys.executable, "-m", "cmroot.cli"]), *args],
        env=clean_env(env),
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def ok_json(p: subprocess.CompletedProcess[bytes], code: int = 0) -> Any:
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return json.loads(p.stdout)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "d")
    with d.serving(check_errors=False):
        yield d


def _table(d: Daemon) -> dict[str, bytes]:
    return write_files(
        d.warehouse,
        {f"sales.db/orders/p={i % 2}/f{i}": f"row {i}\n".encode() * 100 for i in range(6)},
    )


def test_verbs_through_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    d = daemon
    files = _table(d)
    sums = {p: cks.of_bytes(b) for p, b in files.items()}
    url, admin = ["--url", d.url], ["--token", d.tokens["admin"]]

    res = ok_json(
        cmroot(
            *url,
            *admin,
            "--json",
            "recycle",
            str(d.warehouse / "sales.db/orders"),
            "--op",
            "DROP_TABLE",
            "--db",
            "sales",
            "--table",
            "orders",
            "--partition",
            "p=0",
            "--partition",
            "p=1",
        )
    )
    assert res["event_id"] == 1
    assert {f["path"]: f["checksum"] for f in res["files"]} == sums
    assert not (d.warehouse / "sales.db/orders").exists()

    # resolve: arguments, a file of lines, JSON on stdin; exit 3 when something is missing
    pairs = [f"{p}@{s}" for p, s in sums.items()]
    out = ok_json(cmroot(*url, *admin, "resolve", *pairs, "--json"))
    assert [f["status"] for f in out["files"]] == ["cmroot"] * 6
    lines = tmp_path / "pairs.txt"
    lines.write_text(
        "".join(f"{p} {s}\n" for p, s in sums.items()) + f"{d.warehouse}/gone {'0' * 32}\n"
    )
    out = ok_json(cmroot(*url, *admin, "--json", "resolve", "--from-file", str(lines)), code=3)
    assert [f["status"] for f in out["files"]] == ["cmroot"] * 6 + ["missing"]
    stdin = json.dumps([{"path": p, "checksum": s} for p, s in sums.items()]).encode()
    out = ok_json(cmroot(*url, *admin, "--json", "resolve", "--from-file", "-", stdin=stdin))
    assert len(out["files"]) == 6

    # get: to a file (JSON summary) and to stdout (the raw bytes, nothing else)
    p0 = next(iter(files))
    dest = tmp_path / "out.bin"
    got = ok_json(cmroot(*url, *admin, "--json", "get", p0, sums[p0], "-o", str(dest)))
    assert got == {"path": p0, "checksum": sums[p0], "size": len(files[p0]), "output": str(dest)}
    assert dest.read_bytes() == files[p0]
    assert not list(tmp_path.glob("*.cmroot-part"))
    p = cmroot(*url, *admin, "get", p0, sums[p0])
    assert p.returncode == 0 and p.stdout == files[p0]

    # ls, paged
    page = ok_json(
        cmroot(*url, *admin, "--json", "ls", "--db", "sales", "--table", "orders", "--limit", "4")
    )
    assert len(page["entries"]) == 4 and page["cursor"]
    rest = ok_json(
        cmroot(
            *url,
            *admin,
            "--json",
            "ls",
            "--db",
            "sales",
            "--limit",
            "4",
            "--cursor",
            str(page["cursor"]),
        )
    )
    assert {e["path"] for e in page["entries"] + rest["entries"]} == set(files)

    # gc: dry run, then for real (nothing has expired)
    dry = ok_json(cmroot(*url, *admin, "--json", "gc", "--dry-run"))
    assert dry["dry_run"] is True and dry["removed_objects"] == 0
    real = ok_json(cmroot(*url, *admin, "--json", "gc"))
    assert real["dry_run"] is False

    # human output works too
    p = cmroot(*url, *admin, "ls")
    assert p.returncode == 0 and b"DROP_TABLE" in p.stdout and p0.encode() in p.stdout

    # global options after the verb, and from the environment
    out = ok_json(
        cmroot("resolve", pairs[0], "--json", "--url", d.url, "--token", d.tokens["read"])
    )
    assert out["files"][0]["status"] == "cmroot"
    env = {"CMROOT_URL": d.url, "CMROOT_TOKEN": d.tokens["read"]}
    out = ok_json(cmroot("--json", "resolve", pairs[0], env=env))
    assert out["files"][0]["status"] == "cmroot"
    assert d.errors() == [], d.log()


def test_cli_errors_exit_codes(daemon: Daemon) -> None:
    d = daemon
    files = _table(d)
    before = tree(d.warehouse)
    p0 = next(iter(files))
    # wrong token: exit 2, JSON error on stderr, nothing on stdout, nothing moved
    p = cmroot("--url", d.url, "--token", "nope", "--json", "recycle", p0, "--op", "DELETE")
    assert p.returncode == 2 and p.stdout == b""
    err = json.loads(p.stderr.decode().strip().splitlines()[-1])
    assert err["kind"] == "Unauthorized" and err["error"] == "unknown token"
    # a read token cannot recycle
    p = cmroot("--url", d.url, "--token", d.tokens["read"], "recycle", p0, "--op", "DELETE")
    assert p.returncode == 2 and b"insufficient scope" in p.stderr
    # bad input is refused with the daemon's message
    p = cmroot("--url", d.url, "--token", d.tokens["admin"], "recycle", p0, "--op", "NUKE")
    assert p.returncode == 2 and b"unknown op" in p.stderr
    p = cmroot("--url", d.url, "--token", d.tokens["admin"], "resolve", "no-at-sign")
    assert p.returncode == 2 and b"PATH@CHECKSUM" in p.stderr
    p = cmroot("--url", d.url, "--token", d.tokens["admin"], "get", p0, "0" * 32)
    assert p.returncode == 2 and b"no such file" in p.stderr
    p = cmroot("--url", d.url, "--token", d.tokens["admin"], "recycle", p0, "--op", "DELETE",
               "--partition", "oops")
    assert p.returncode == 2 and b"--partition" in p.stderr
    assert tree(d.warehouse) == before
    # a daemon that is not there: exit 1, says so
    d.stop()
    p = cmroot("--url", d.url, "--token", d.tokens["admin"], "ls")
    assert p.returncode == 1 and b"cmroot daemon unreachable" in p.stderr


def test_verbs_directly_on_a_store(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "direct")  # only its directories and config: never started
    files = _table(d)
    sums = {p: cks.of_bytes(b) for p, b in files.items()}
    cfg = ["--config", str(d.config_path)]
    res = ok_json(
        cmroot(
            *cfg,
            "--json",
            "recycle",
            str(d.warehouse / "sales.db/orders/p=0"),
            "--op",
            "DROP_PARTITION",
            "--db",
            "sales",
            "--table",
            "orders",
        )
    )
    moved = {f["path"] for f in res["files"]}
    assert moved == {p for p in files if "/p=0/" in p}
    out = ok_json(cmroot(*cfg, "--json", "resolve", *[f"{p}@{s}" for p, s in sums.items()]))
    assert {f["path"]: f["status"] for f in out["files"]} == {
        p: "cmroot" if p in moved else "original" for p in files
    }
    p0 = sorted(moved)[0]
    p = cmroot(*cfg, "get", p0, sums[p0])
    assert p.returncode == 0 and p.stdout == files[p0]
    page = ok_json(cmroot(*cfg, "--json", "ls"))
    assert {e["path"] for e in page["entries"]} == moved
    dry = ok_json(cmroot(*cfg, "--json", "gc", "--dry-run"))
    assert dry["dry_run"] is True and dry["removed"] == []
    fsck = ok_json(cmroot(*cfg, "--json", "fsck"))
    assert fsck["clean"] is True and fsck["checked"] == len(moved)
    left = sorted(set(files) - moved)
    sums_out = ok_json(cmroot("--json", "checksum", *left, "file://" + left[0]))
    assert [f["checksum"] for f in sums_out["files"]] == [sums[p] for p in left] + [sums[left[0]]]
    p = cmroot("checksum", left[0], p0)  # p0 was recycled: a clear error, not a traceback
    assert p.returncode == 2 and b"no such file" in p.stderr and b"Traceback" not in p.stderr, (
        p.stderr
    )

    # With the daemon holding the store, the same verbs go through it.
    d.env = {"CMROOT_SERVER_PORT": str(d.port)}
    d.start()
    try:
        env = {"CMROOT_SERVER_PORT": str(d.port), "CMROOT_TOKEN": d.tokens["admin"]}
        out = ok_json(cmroot(*cfg, "--json", "resolve", f"{p0}@{sums[p0]}", env=env))
        assert out["files"][0]["status"] == "cmroot"
        p1 = sorted(set(files) - moved)[0]
        res = ok_json(cmroot(*cfg, "--json", "recycle", p1, "--op", "DELETE", env=env))
        assert res["event_id"] == 2
        assert d.client("admin").current_event() == 2
    finally:
        d.close()


def test_token_create_gives_a_token_the_daemon_accepts(tmp_path: Path) -> None:
    out = {}
    for scope in ("read", "write"):
        out[scope] = ok_json(cmroot("token", "create", "--scope", scope, "--json"))
        assert out[scope]["scope"] == scope and out[scope]["token"]
        assert out[scope]["config"].startswith("tokens = [")
    # the human form carries the same two things
    p = cmroot("token", "create", "--scope", "admin")
    assert p.returncode == 0
    text = p.stdout.decode()
    token = text.split("it is not stored): ")[1].split()[0]
    line = text.split("in the config:  ")[1].strip()
    assert line.startswith('tokens = ["admin:sha256:')
    assert cmroot("token", "create", "--scope", "root").returncode == 2

    d = Daemon(tmp_path / "tok", auth=False)
    # the printed config line, pasted under [auth] as is
    d.config_path.write_text(
        f'[store]\nroot = "{d.store}"\nwarehouse_roots = ["{d.warehouse}"]\n[auth]\n{line}\n'
    )
    d.start()
    try:
        assert (
            d.request(
                "GET",
                "/v1/events/current",
                headers={"Authorization": f"Bearer {token}"},
                scope=None,
            ).status
            == 200
        )
        assert d.request("GET", "/v1/events/current", scope=None).status == 401
        # and lines for several scopes merge into one list
        lines = [json.loads(o["config"].split("=", 1)[1])[0] for o in out.values()]
        d.write_config([*lines, line.split('"')[1]])
        d.restart()
        for scope, o in out.items():
            auth = {"Authorization": f"Bearer {o['token']}"}
            assert d.request("GET", "/v1/entries", headers=auth, scope=None).status == 200, scope
            r = d.request("POST", "/v1/gc?dry_run=true", headers=auth, scope=None)
            assert r.status == 403, scope
    finally:
        d.close()


def test_console_script(daemon: Daemon) -> None:
    exe = shutil.which("cmroot")
    if exe is None:
        pytest.skip("the cmroot console script is not on PATH (pip install -e .)")
    p = cmroot("--version", exe=[exe])
    assert p.returncode == 0 and p.stdout.startswith(b"cmroot ")
    out = ok_json(
        cmroot(
            "--url",
            daemon.url,
            "--token",
            daemon.tokens["admin"],
            "--json",
            "gc",
            "--dry-run",
            exe=[exe],
        )
    )
    assert out["dry_run"] is True
    assert os.access(exe, os.X_OK)


def test_spark_conf_points_spark_at_the_first_local_warehouse_root(tmp_path: Path) -> None:
    # Spark's own default (./spark-warehouse) is outside every root: the hook would get 403.
    pytest.importorskip("pyspark")
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[store]\nroot = "{tmp_path}/store"\n'
        f'warehouse_roots = ["s3://bucket/wh", "{tmp_path}/wh", "{tmp_path}/wh2"]\n'
    )

    def conf(*extra: str, env: dict[str, str] | None = None) -> dict[str, str]:
        p = cmroot("--config", str(cfg), "--json", "spark-conf", *extra, env=env)
        return dict(ok_json(p))

    assert conf()["spark.sql.warehouse.dir"] == f"{tmp_path}/wh"
    assert conf("--warehouse-dir", "/elsewhere")["spark.sql.warehouse.dir"] == "/elsewhere"
    # Another daemon's roots are not in this config: no guess for it.
    assert "spark.sql.warehouse.dir" not in conf("--url", "http://10.0.0.5:9750")
    # One the user set in spark-defaults.conf stands: no line overrides it.
    (tmp_path / "sconf").mkdir()
    (tmp_path / "sconf/spark-defaults.conf").write_text("spark.sql.warehouse.dir /mine\n")
    assert "spark.sql.warehouse.dir" not in conf(env={"SPARK_CONF_DIR": str(tmp_path / "sconf")})

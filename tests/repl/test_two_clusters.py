"""Two clusters that share nothing: the destination's load (its driver and its executors)
runs in a mount namespace of its own, in which the source's warehouse and store are empty
tmpfs mounts, and reaches the source's daemon over loopback with a read token only. Junk
files of the right sizes sit at the source's paths and at the cmroot's locations there,
as another cluster's own files might: the load must never take them for the source's.
The rubber-banding scenario and table swaps replicate all the same, every byte over HTTP;
a load given a token the daemon does not know says so, and places nothing."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmroot.client import Client
from cmroot.repl import dumpdir
from cmroot.server.auth import new_token
from tests.repl.conftest import Destination, Source
from tests.spark.sparklib import hooked_lake

pytestmark = pytest.mark.timeout(900)

# What a load reports for bytes that came over the daemon's GET /v1/files.
OVER_HTTP = {"original_http", "cmroot_http"}


def cannot_isolate(probe_dir: Path) -> str | None:
    """Why a destination cannot run in a mount namespace of its own here, or None."""
    if os.geteuid() != 0:
        return "needs root: the destination runs under `unshare --mount` with tmpfs mounts"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux) to give the destination a mount namespace"
    probe_dir.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["unshare", "--mount", "--", "mount", "-t", "tmpfs", "cmroot-probe", str(probe_dir)],
        capture_output=True, text=True,
    )
    if res.returncode != 0:
        return f"unshare --mount with a tmpfs mount fails here: {res.stderr.strip()[:200]}"
    return None


@dataclass
class Cluster:
    """The source: a hooked lake whose daemon wants tokens, and a read token for loads."""

    source: Source
    read_token: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = cannot_isolate(tmp_path_factory.mktemp("probe"))
    if reason:
        pytest.skip(reason)
    pytest.importorskip("pyspark")
    admin, admin_line = new_token("admin")
    read, read_line = new_token("read")
    tokens = ",".join(line.split('"')[1] for line in (admin_line, read_line))
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as mp:
            # The hook's token (cmroot.spark.configure reads it when the session is built);
            # unset again before any destination process inherits this environment.
            mp.setenv("CMROOT_TOKEN", admin)
            src = stack.enter_context(hooked_lake(
                tmp_path_factory.mktemp("source"), Source, {"CMROOT_AUTH_TOKENS": tokens}))
        src.daemon.client.close()
        src.daemon.client = Client(src.daemon.url, admin, timeout=120)
        yield Cluster(src, read)


class Isolated(Destination):
    """A destination whose process sees none of `hidden`: each is an empty tmpfs in the
    mount namespace the process runs in (`unshare --mount`; the mounts end with it)."""

    def __init__(self, base: Path, hidden: list[Path]) -> None:
        super().__init__(base)
        self.hidden = hidden

    def run_isolated(
        self, *steps: dict[str, Any], decoys: dict[str, int]
    ) -> list[dict[str, Any]]:
        self.plans += 1
        plan = self.base / f"plan-{self.plans}.json"
        plan.write_text(json.dumps({"base": str(self.base), "steps": list(steps),
                                    "decoys": decoys}))
        mounts = [f"mount -t tmpfs cmroot-hidden {shlex.quote(str(d))}" for d in self.hidden]
        command = [sys.executable, "-m", "tests.repl.destination", str(plan)]
        script = " && ".join([*mounts, f"exec {shlex.join(command)}"])
        # No CMROOT_* settings: the read token in each load step is its only credential.
        env = {k: v for k, v in self.env().items() if not k.startswith("CMROOT_")}
        res = subprocess.run(["unshare", "--mount", "--", "sh", "-c", script],
                             capture_output=True, text=True, env=env, cwd=self.base,
                             timeout=600)
        assert res.returncode == 0, res.stderr[-5000:]
        answers: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
        return answers


def decoys_for(cluster: Cluster, dumps: list[str]) -> dict[str, int]:
    """Every file the dumps name, at its path and where the daemon says it is now (its
    cmroot object, or its place after a rename), as zero bytes of its size (empty files
    left out: their decoy would be the file itself)."""
    files = {(f["path"], f["checksum"]): int(f["size"])
             for url in dumps for e in dumpdir.read(url).events for f in e.files
             if int(f["size"]) > 0}
    answer = cluster.source.daemon.client.resolve(
        [{"path": p, "checksum": c} for p, c in files]).files
    out = {p: size for (p, _), size in files.items()}
    out.update({a.location: size for a, size in zip(answer, files.values(), strict=True)
                if a.location})
    return out


def assert_refused(step: dict[str, Any], url: str) -> None:
    """The load failed as a refused token, naming the daemon and the fix."""
    err = step["load"]
    assert err.get("kind") == "Unauthorized", err
    text = err["error"] + " " + err["detail"]
    assert url in text and "read scope" in text and "bootstrap" not in text, err


def over_http(step: dict[str, Any]) -> bool:
    """Every file of the load came over HTTP (none could be read locally)."""
    res = step["load"]
    assert "error" not in res, res
    return set(res["sources"]) <= OVER_HTTP and sum(res["sources"].values()) == res["files"]


def test_rubber_banding_and_table_swaps_across_clusters(
    cluster: Cluster, tmp_path: Path
) -> None:
    src = cluster.source
    url = src.daemon.url
    good, wrong = tmp_path / "read.token", tmp_path / "unknown.token"
    good.write_text(cluster.read_token)
    wrong.write_text(new_token("read")[0])

    # The rubber-banding scenario (test_replication.py::test_no_rubber_banding).
    start = src.daemon.current()
    src.sql("CREATE DATABASE rb")
    src.sql("CREATE TABLE rb.t (a INT, p STRING) USING parquet PARTITIONED BY (p)")
    src.sql("INSERT INTO rb.t PARTITION (p='a') VALUES (1), (2)")
    src.sql("INSERT INTO rb.t PARTITION (p='b') VALUES (3)")
    src.sql("INSERT INTO rb.t PARTITION (p='a') VALUES (4)")
    rb_at_dump = src.rows("SELECT a, p FROM rb.t")
    rb_files = src.data_files("rb", "t")
    rb1, h1 = src.dump("rb", from_id=start)
    src.sql("ALTER TABLE rb.t DROP PARTITION (p='a')")
    src.sql("INSERT INTO rb.t PARTITION (p='a') VALUES (100)")
    dropped = [f for f in rb_files if f.startswith("p=a/")]
    rb2, h2 = src.dump("rb", from_id=h1.last_event_id)
    rb_now = src.rows("SELECT a, p FROM rb.t")

    # Table swaps (test_replication.py::test_a_table_swap_replicates), the last one
    # renamed (then dropped) after its dump.
    start = src.daemon.current()
    src.sql("CREATE DATABASE sw")
    src.sql("CREATE TABLE sw.t (a INT) USING parquet")
    src.sql("INSERT INTO sw.t VALUES (1), (2)")
    sw0, s0 = src.dump("sw", from_id=start)
    src.sql("CREATE TABLE sw.t_new USING parquet AS SELECT a + 10 AS a FROM sw.t")
    src.sql("DROP TABLE sw.t")
    src.sql("ALTER TABLE sw.t_new RENAME TO t")
    sw1, s1 = src.dump("sw", from_id=s0.last_event_id)
    t_files = src.data_files("sw", "t")
    src.sql("CREATE TABLE sw.u_new USING parquet AS SELECT a + 100 AS a FROM sw.t")
    u_files = src.data_files("sw", "u_new")
    sw2, s2 = src.dump("sw", from_id=s1.last_event_id)
    src.sql("ALTER TABLE sw.u_new RENAME TO u")
    src.sql("ALTER TABLE sw.t RENAME TO t_old")
    src.sql("DROP TABLE sw.t_old")

    def load(dump: str, token: Path) -> dict[str, str]:
        return {"dump": dump, "daemon_url": url, "token_file": str(token)}

    rb = {"t": "SELECT a, p FROM rb.t"}
    sw = {"t": "SELECT a FROM sw.t", "u_new": "SELECT a FROM sw.u_new"}
    dest = Isolated(tmp_path / "destination", [src.warehouse, src.daemon.store])
    # rb2's files get no decoy: missing here, the driver asks the daemon for them up front.
    decoys = decoys_for(cluster, [rb1, sw0, sw1, sw2])
    assert any(p.startswith(f"{src.daemon.store}/") for p in decoys)  # cmroot objects too
    refused, rb_loaded, refused2, rb_next, sw_first, sw_swapped, sw_last = dest.run_isolated(
        {"load": load(rb1, wrong), "queries": rb, "status": ["rb"], "files": ["rb.t"]},
        {"load": load(rb1, good), "queries": rb, "status": ["rb"], "files": ["rb.t"],
         "partitions": ["rb.t"]},
        {"load": load(rb2, wrong), "status": ["rb"]},
        {"load": load(rb2, good), "queries": rb, "status": ["rb"]},
        {"load": load(sw0, good), "queries": sw, "status": ["sw"]},
        {"load": load(sw1, good), "queries": sw, "status": ["sw"], "files": ["sw.t"]},
        {"load": load(sw2, good), "queries": sw, "status": ["sw"], "files": ["sw.u_new"]},
        decoys=decoys,
    )
    # The decoys lived in the destination's namespace only: the source's files are intact.
    assert not [p for p, n in decoys.items()
                if os.path.isfile(p) and Path(p).read_bytes() == bytes(n)]
    assert src.rows("SELECT a, p FROM rb.t") == rb_now

    # A token the daemon does not know: named as such, and no file placed.
    assert_refused(refused, url)
    assert refused["status"]["rb"] is None
    assert refused["rows"]["t"] == [] and refused["files"]["rb.t"] == []

    assert rb_loaded["rows"]["t"] == rb_at_dump == [[1, "a"], [2, "a"], [3, "b"], [4, "a"]]
    assert rb_loaded["files"]["rb.t"] == rb_files
    assert rb_loaded["partitions"]["rb.t"] == ["p=a", "p=b"]
    assert rb_loaded["status"]["rb"] == h1.last_event_id
    assert rb_loaded["load"]["sources"] == {
        "cmroot_http": len(dropped), "original_http": len(rb_files) - len(dropped)}

    assert_refused(refused2, url)
    assert refused2["status"]["rb"] == h1.last_event_id
    assert rb_next["rows"]["t"] == rb_now == [[3, "b"], [100, "a"]]
    assert rb_next["status"]["rb"] == h2.last_event_id and over_http(rb_next)

    assert sw_first["rows"]["t"] == [[1], [2]] and over_http(sw_first)
    assert sw_swapped["rows"]["t"] == [[11], [12]] and over_http(sw_swapped)
    assert sw_swapped["files"]["sw.t"] == t_files
    assert sw_swapped["status"]["sw"] == s1.last_event_id
    assert sw_last["rows"]["u_new"] == [[111], [112]] and over_http(sw_last)
    assert sw_last["rows"]["t"] == [[11], [12]]
    assert sw_last["files"]["sw.u_new"] == u_files
    assert sw_last["status"]["sw"] == s2.last_event_id

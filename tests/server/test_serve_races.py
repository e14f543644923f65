"""GET /v1/files under races, through the real daemon (invariant 3 and 5): a path swapped
between a file and a symlink to a secret (and a parent directory likewise) while thousands
of GETs run never serves the secret; a `cp -p` replacement is re-hashed; a writer that kept
its descriptor across a recycle gets its object quarantined, never served (daemon and CLI);
files vanishing while resolved never make a 500; Range and HEAD are exact on originals and
on cmroot copies, small (served from memory) and large (sendfile)."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from tests.server.cmroot_daemon import Daemon, assert_error, clean_env, write_files

BIG = (1 << 20) + 4321  # over the inline size: sent from the descriptor by sendfile
SECRET = b"TOPSECRET!"


def _fill(tag: bytes, size: int) -> bytes:
    return (tag * (size // len(tag) + 1))[:size]


def _get(conn: http.client.HTTPConnection, d: Daemon, url: str, headers: dict[str, str]):
    conn.request("GET", url, headers={**d.auth("read"), **headers})
    r = conn.getresponse()
    return r.status, r.getheader("Content-Range"), r.read()


def _swapper(stop: threading.Event, swaps: list[int], pairs: list[tuple[Path, Path]]) -> None:
    """Atomically swap each `path` between its real version and a symlink, in a loop
    (rename over, so the name always exists)."""
    n = 0
    while not stop.is_set():
        for path, link in pairs:
            real = path.with_name(path.name + ".real")
            os.rename(path, real)  # the real one aside ...
            os.rename(link, path)  # ... the symlink in its place
            time.sleep(0)
            os.rename(path, link)
            os.rename(real, path)
            n += 1
    swaps.append(n)


@pytest.mark.parametrize("size", [5000, BIG])
def test_symlink_swap_race_never_serves_the_outside_file(daemon: Daemon, size: int) -> None:
    d = daemon
    data = _fill(b"the real bytes ", size)
    c = cks.of_bytes(data)
    (d.outside / "secret").write_bytes(_fill(SECRET, size))
    (d.outside / "dir").mkdir()
    (d.outside / "dir" / "f").write_bytes(_fill(SECRET, size))
    files = write_files(d.warehouse, {"db.db/t/p=1/f": data, "db.db/u/p=1/f": data})
    pf, pd = (Path(p) for p in sorted(files))
    # keep a store copy of each: a swapped path is served from the store, or refused
    r = d.request("POST", "/v1/recycle", {"paths": list(files), "mode": "copy",
                                          "op": "INSERT_OVERWRITE"}, scope="write")
    assert r.status == 200, r
    # pf swaps with a symlink to the secret; pf's parent... no: pd's *parent* swaps with a
    # symlink to an outside directory holding an `f` of secret bytes
    link_f = pf.with_name("f.link")
    link_f.symlink_to(d.outside / "secret")
    link_d = pd.parent.with_name("p=1.link")
    link_d.symlink_to(d.outside / "dir", target_is_directory=True)
    stop, swaps = threading.Event(), []
    swapper = threading.Thread(target=_swapper, args=(stop, swaps, [(pf, link_f),
                                                                    (pd.parent, link_d)]))
    statuses: dict[int, int] = {}
    bad: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 4.0
    per_thread = 1500 if size < BIG else 250

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        try:
            for i in range(per_thread):
                if time.monotonic() > deadline:
                    break
                path = str(pf if (i + k) % 2 else pd)
                hdr = {} if i % 3 == 0 else (
                    {"Range": f"bytes={i % 1000}-{i % 1000 + 4095}"} if i % 3 == 1
                    else {"Range": "bytes=-3000"})
                status, crange, body = _get(conn, d, d.files_url(path, c), hdr)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    if SECRET[:6] in body:
                        bad.append(f"secret bytes served ({status}, {hdr})")
                    elif status == 200 and cks.of_bytes(body) != c:
                        bad.append("a 200 body not hashing to the checksum")
                    elif status == 206:
                        first, last = (int(x) for x in crange.split()[1].split("/")[0].split("-"))
                        if body != data[first : last + 1]:
                            bad.append(f"wrong 206 bytes for {crange}")
                    elif status not in (200, 206, 403, 404):
                        bad.append(f"status {status}: {body[:200]!r}")
        finally:
            conn.close()

    swapper.start()
    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        swapper.join(10)
    assert not bad, bad[:10]
    assert swaps and swaps[0] > 50, swaps
    assert statuses.get(200, 0) + statuses.get(206, 0) > 100, statuses
    assert not [e for e in d.errors() if "internal" in str(e.get("message", ""))], d.errors()


@pytest.mark.parametrize("size", [100, BIG])
def test_cp_p_replacement_is_not_served_as_original(daemon: Daemon, size: int) -> None:
    d = daemon
    old, new = _fill(b"old", size), _fill(b"NEW", size)
    c = cks.of_bytes(old)
    [p] = write_files(d.warehouse, {"db.db/t/f": old})
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))
    st = os.stat(p)
    pair = [{"path": p, "checksum": c}]
    r = d.request("POST", "/v1/resolve", {"files": pair}, scope="read")
    assert r.json()["files"][0]["status"] == "original"
    assert d.request("GET", d.files_url(p, c), scope="read").body == old
    r = d.request("POST", "/v1/recycle", {"paths": [p], "mode": "copy", "op": "INSERT_OVERWRITE"},
                  scope="write")
    assert r.status == 200, r
    time.sleep(2.1)  # even a settled identity, one the daemon could have cached, moves
    r = d.request("POST", "/v1/resolve", {"files": pair}, scope="read")
    assert r.json()["files"][0]["status"] == "original"
    with open(p, "r+b") as f:  # cp -p: same inode, same size, other bytes, mtime restored
        f.write(new)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = d.request("POST", "/v1/resolve", {"files": pair}, scope="read")
    assert r.json()["files"][0]["status"] == "cmroot", r
    for headers in ({}, {"Range": "bytes=0-49"}):
        r = d.request("GET", d.files_url(p, c), headers=headers, scope="read")
        assert r.status in (200, 206) and r.headers["X-Cmroot-Status"] == "cmroot", r
        assert r.body == old[: len(r.body)] and b"NEW" not in r.body


@pytest.mark.parametrize("size", [4000, BIG])
def test_straggler_writer_object_is_quarantined_not_served(
    make_daemon, tmp_path: Path, size: int
) -> None:
    d = make_daemon()
    data = _fill(b"good ", size)
    c = cks.of_bytes(data)
    [p] = write_files(d.warehouse, {"db.db/t/p=1/f": data})
    url = d.files_url(p, c)
    with open(p, "r+b") as straggler:
        r = d.request("POST", "/v1/recycle", {"paths": [p], "op": "DROP_TABLE", "db": "db",
                                              "table": "t"}, scope="write")
        assert r.status == 200, r
        assert d.request("GET", url, scope="read").body == data  # verified once
        straggler.seek(size - 10)
        straggler.write(b"EVIL")
        straggler.flush()
    for headers in ({}, {"Range": "bytes=0-99"}, {"Range": "bytes=-20"}):
        r = d.request("GET", url, headers=headers, scope="read")
        assert b"EVIL" not in r.body, r
        err = assert_error(r, 404, "corrupt", "fsck")
        assert "quarantined" in err["detail"], err
    r = d.request("HEAD", url, scope="read")
    assert r.status == 404, r
    assert "cmroot_checksum_mismatches_total 1.0" in d.metrics()
    [q] = list((d.store / "quarantine").iterdir())
    assert q.name.startswith(c + ".") and b"EVIL" in q.read_bytes()
    assert not [e for e in d.errors() if "internal" in str(e.get("message", ""))]

    # the CLI, through the daemon and on the store directly, likewise
    out = tmp_path / f"got-{size}"
    cli = [sys.executable, "-m", "cmroot.cli", "--config", str(d.config_path), "get", p, c,
           "-o", str(out)]
    env = clean_env({"CMROOT_TOKEN": d.tokens["read"]})
    res = subprocess.run([*cli, "--url", d.url], env=env, capture_output=True, timeout=120)
    assert res.returncode != 0 and not out.exists(), res
    assert b"EVIL" not in res.stdout
    assert d.stop() == 0
    res = subprocess.run(cli, env=env, capture_output=True, timeout=120)
    assert res.returncode != 0 and not out.exists(), res


def test_cli_direct_get_refuses_a_corrupt_object(make_daemon, tmp_path: Path) -> None:
    """`cmroot get` on the store itself (no daemon): a straggler-changed object is not
    written out."""
    d = make_daemon()
    data = _fill(b"good ", BIG)
    c = cks.of_bytes(data)
    [p] = write_files(d.warehouse, {"db.db/t/f": data})
    with open(p, "r+b") as straggler:
        assert d.request("POST", "/v1/recycle", {"paths": [p], "op": "DELETE"},
                         scope="write").status == 200
        assert d.stop() == 0
        straggler.write(b"EVIL")
    out = tmp_path / "got"
    res = subprocess.run(
        [sys.executable, "-m", "cmroot.cli", "--config", str(d.config_path), "get", p, c,
         "-o", str(out)], env=clean_env(), capture_output=True, timeout=120)
    assert res.returncode != 0 and not out.exists(), res
    assert b"corrupt" in res.stderr + res.stdout


def test_files_vanishing_while_resolved_and_served_never_500(daemon: Daemon) -> None:
    d = daemon
    files = write_files(
        d.warehouse, {f"db.db/t/p={i % 4}/f{i}": _fill(str(i).encode(), 3000 + i * 7)
                      for i in range(40)}
    )
    big = write_files(d.warehouse, {"db.db/big/f": _fill(b"big", BIG)})
    files.update(big)
    pairs = [{"path": p, "checksum": cks.of_bytes(b)} for p, b in files.items()]
    half = sorted(files)[::2]
    r = d.request("POST", "/v1/recycle", {"paths": half, "mode": "copy", "op": "INSERT_OVERWRITE"},
                  scope="write")
    assert r.status == 200, r
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for p, b in files.items():
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
                Path(p).write_bytes(b)

    t = threading.Thread(target=churn)
    t.start()
    statuses: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 4.0
        n = 0
        while time.monotonic() < deadline and n < 400:
            n += 1
            r = d.request("POST", "/v1/resolve", {"files": pairs}, scope="read")
            assert r.status == 200, r
            got = {f["path"]: f["status"] for f in r.json()["files"]}
            for p in half:
                assert got[p] in ("original", "cmroot"), (p, got[p])
            p = sorted(files)[n % len(files)]
            r = d.request("GET", d.files_url(p, cks.of_bytes(files[p])), scope="read")
            statuses[r.status] = statuses.get(r.status, 0) + 1
            assert r.status in (200, 404), r
            if r.status == 200:
                assert r.body == files[p]
    finally:
        stop.set()
        t.join(10)
    assert not [e for e in d.errors() if "internal" in str(e.get("message", ""))], d.errors()


# -- Range and HEAD, exact, on originals and cmroot copies, small and large ---------------

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("ranges"))
    d.start()
    blobs = {
        "db.db/t/orig-small": os.urandom(777),
        "db.db/t/orig-big": os.urandom(BIG),
        "db.db/t/gone-small": os.urandom(1234),
        "db.db/t/gone-big": os.urandom(BIG + 17),
        "db.db/t/empty": b"",
    }
    files = write_files(d.warehouse, blobs)
    gone = [p for p in files if "gone" in p]
    r = d.request("POST", "/v1/recycle", {"paths": gone, "op": "DELETE"}, scope="write")
    assert r.status == 200, r
    yield _Served((d, files))
    d.close()


class _Served(tuple):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "<served daemon and files>"


def _expected(spec: str, size: int):
    """What RFC 9110 asks of one `bytes=` range: (status, first, last)."""
    first_s, last_s = spec.split("=")[1].split("-")
    if first_s == "":
        n = int(last_s)
        if n == 0 or size == 0:
            return 416, None, None
        return 206, max(0, size - n), size - 1
    first = int(first_s)
    if last_s and int(last_s) < first:
        return 200, 0, size - 1  # an invalid range is ignored
    if first >= size:
        return 416, None, None
    return 206, first, min(int(last_s) if last_s else size - 1, size - 1)


ranges = st.one_of(
    st.tuples(st.integers(0, BIG + 100), st.integers(0, BIG + 100)).map(
        lambda t: f"bytes={t[0]}-{t[1]}"),
    st.integers(0, BIG + 100).map(lambda a: f"bytes={a}-"),
    st.integers(0, BIG + 100).map(lambda n: f"bytes=-{n}"),
    st.tuples(st.integers(0, 2000), st.integers(0, 2000)).map(lambda t: f"bytes={t[0]}-{t[1]}"),
)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.sampled_from(["orig-small", "orig-big", "gone-small", "gone-big", "empty"]),
       spec=ranges, method=st.sampled_from(["GET", "HEAD"]))
def test_range_and_head_are_exact(served, which: str, spec: str, method: str) -> None:
    d, files = served
    path = next(p for p in files if p.endswith(which))
    data = files[path]
    c = cks.of_bytes(data)
    r = d.request(method, d.files_url(path, c), headers={"Range": spec}, scope="read")
    status, first, last = _expected(spec, len(data))
    assert r.status == status, (spec, len(data), r)
    assert r.headers["X-Cmroot-Status"] == ("cmroot" if "gone" in which else "original") or (
        status == 416)
    if status == 416:
        assert r.headers["Content-Range"] == f"bytes */{len(data)}"
        return
    assert r.headers["ETag"] == f'"{c}"' and r.headers["Accept-Ranges"] == "bytes"
    assert int(r.headers["Content-Length"]) == last - first + 1
    if status == 206:
        assert r.headers["Content-Range"] == f"bytes {first}-{last}/{len(data)}"
    assert r.body == (b"" if method == "HEAD" else data[first : last + 1])


@pytest.mark.parametrize("which", ["orig-small", "orig-big", "gone-small", "gone-big"])
def test_head_whole_and_conditional(served, which: str) -> None:
    d, files = served
    path = next(p for p in files if p.endswith(which))
    data, c = files[path], cks.of_bytes(files[path])
    url = d.files_url(path, c)
    r = d.request("HEAD", url, scope="read")
    assert r.status == 200 and r.body == b"" and int(r.headers["Content-Length"]) == len(data)
    r = d.request("GET", url, scope="read")
    assert r.status == 200 and r.body == data and r.headers["ETag"] == f'"{c}"'
    r = d.request("GET", url, headers={"If-None-Match": f'"{c}"'}, scope="read")
    assert r.status == 304 and r.body == b""
    r = d.request("GET", url, headers={"If-None-Match": '"0000"'}, scope="read")
    assert r.status == 200 and r.body == data
    # If-Range with another ETag: the whole file, not the range
    r = d.request("GET", url, headers={"Range": "bytes=0-9", "If-Range": '"other"'},
                  scope="read")
    assert r.status == 200 and r.body == data
    r = d.request("GET", url, headers={"Range": "bytes=0-9", "If-Range": f'"{c}"'},
                  scope="read")
    assert r.status == 206 and r.body == data[:10]
    # several ranges at once: answered whole (a server may ignore Range)
    r = d.request("GET", url, headers={"Range": "bytes=0-1,5-6"}, scope="read")
    assert r.status == 200 and r.body == data


def test_served_bytes_metric_and_client_disconnect(served) -> None:
    d, files = served
    path = next(p for p in files if p.endswith("gone-big"))
    data, c = files[path], cks.of_bytes(files[path])
    # clients that go away mid-body must not leak descriptors or break the daemon
    for _ in range(20):
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        conn.request("GET", d.files_url(path, c), headers=d.auth("read"))
        resp = conn.getresponse()
        resp.read(1000)
        conn.close()
    r = d.request("GET", d.files_url(path, c), scope="read")
    assert r.status == 200 and r.body == data
    assert "cmroot_served_bytes_total" in d.metrics()
    pid = d.proc.pid if d.proc else None
    assert pid is not None
    fds = os.listdir(f"/proc/{pid}/fd")
    # no descriptor of the store's objects stays open once the answers are done
    time.sleep(0.5)
    held = [os.readlink(f"/proc/{pid}/fd/{f}") for f in os.listdir(f"/proc/{pid}/fd")]
    assert not [h for h in held if "/objects/" in h], (held, fds)

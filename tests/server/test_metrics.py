"""GET /metrics from the real daemon: parsed with prometheus_client's own parser, checked by
`promtool check metrics`, and watched moving as files are recycled, resolved, served and
swept. Labels never carry paths, checksums or table names; routes are route patterns;
there is no `_created` series."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cmroot import checksum as cks
from cmroot.server.app import LIMITS
from tests.server.cmroot_daemon import Daemon, MakeDaemon, write_files

pytestmark = pytest.mark.timeout(120)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

REQUIRED = {
    "cmroot_recycled_files": "counter",
    "cmroot_recycled_bytes": "counter",
    "cmroot_recycle_errors": "counter",
    "cmroot_store_objects": "gauge",
    "cmroot_store_bytes": "gauge",
    "cmroot_oldest_object_timestamp_seconds": "gauge",
    "cmroot_gc_runs": "counter",
    "cmroot_gc_deleted_objects": "counter",
    "cmroot_gc_deleted_bytes": "counter",
    "cmroot_gc_duration_seconds": "histogram",
    "cmroot_gc_last_success_timestamp_seconds": "gauge",
    "cmroot_resolve": "counter",
    "cmroot_served_bytes": "counter",
    "cmroot_checksum_mismatches": "counter",
    "cmroot_last_event_id": "gauge",
    "cmroot_http_requests": "counter",
    "cmroot_http_request_duration_seconds": "histogram",
    "cmroot_http_requests_in_flight": "gauge",
    "cmroot_work_queue_depth": "gauge",
    "cmroot_work_queue_limit": "gauge",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "process_start_time_seconds": "gauge",
    "python_info": "gauge",
}
# Every label name there is: python_info's (the platform collector) name the interpreter.
LABELS = {"op", "result", "status", "route", "code", "le", "class"}
LABELS |= {"implementation", "major", "minor", "patchlevel", "version"}


def scrape(d: Daemon) -> tuple[Samples, dict[str, str], str]:
    text = d.metrics()
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types, text


def v(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def promtool(text: str) -> None:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    p = subprocess.run(
        [exe, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    out = (p.stdout + p.stderr).decode(errors="replace")
    print(out)
    assert p.returncode == 0, f"promtool check metrics failed:\n{out}"


@pytest.fixture
def lake(make_daemon: MakeDaemon) -> Daemon:
    return make_daemon(env={"CMROOT_STORE_RETAIN_OVERRIDES": "tmp.*=1s"})


def test_metrics_move_with_the_work(lake: Daemon) -> None:
    d = lake
    c = d.client("admin")
    m0, types, text0 = scrape(d)
    for name, kind in REQUIRED.items():
        assert types.get(name) == kind, (name, types.get(name))
    promtool(text0)
    # At rest only the scrape itself is in flight, admitted to the probe class.
    assert v(m0, "cmroot_http_requests_in_flight") == 1
    for cls, limit in LIMITS.items():
        assert v(m0, "cmroot_work_queue_depth", **{"class": cls}) == (cls == "probe")
        assert v(m0, "cmroot_work_queue_limit", **{"class": cls}) == limit.admitted
    assert v(m0, "process_resident_memory_bytes") > 0 and v(m0, "process_open_fds") > 0
    assert v(m0, "cmroot_store_objects") == 0 and v(m0, "cmroot_store_bytes") == 0
    assert v(m0, "cmroot_oldest_object_timestamp_seconds") == 0
    runs0 = v(m0, "cmroot_gc_runs_total", result="success")  # the sweep at start-up

    # recycle: 7 files, 2 of them duplicates of a third -> 5 distinct objects
    contents = [bytes([i]) * (1000 * (i + 1)) for i in range(5)]
    rel = {f"db.db/t/p=1/f{i}": b for i, b in enumerate(contents)}
    rel |= {"db.db/t/p=2/dup-a": contents[0], "db.db/t/p=2/dup-b": contents[0]}
    files = write_files(d.warehouse, rel)
    t_before = time.time()
    res = c.recycle([str(d.warehouse / "db.db/t")], op="DROP_PARTITION", db="db", table="t")
    m1, _, _ = scrape(d)
    assert v(m1, "cmroot_recycled_files_total", op="DROP_PARTITION") == 7
    assert v(m1, "cmroot_recycled_bytes_total", op="DROP_PARTITION") == sum(
        map(len, files.values())
    )
    assert v(m1, "cmroot_store_objects") == 5
    assert v(m1, "cmroot_store_bytes") == sum(map(len, contents))
    assert t_before - 1 <= v(m1, "cmroot_oldest_object_timestamp_seconds") <= time.time() + 1
    assert v(m1, "cmroot_last_event_id") == res["event_id"]
    assert v(m1, "cmroot_recycle_errors_total") == 0
    # refused requests are not recycle errors, but are counted by route and code
    assert (
        d.request("POST", "/v1/recycle", {"paths": [str(d.outside / "x")], "op": "DELETE"}).status
        == 403
    )
    c.recycle(list(write_files(d.warehouse, {"db.db/u/f": b"u" * 10})), op="TRUNCATE")
    m1b, _, _ = scrape(d)
    assert v(m1b, "cmroot_recycle_errors_total") == 0
    assert v(m1b, "cmroot_recycled_files_total", op="TRUNCATE") == 1
    assert v(m1b, "cmroot_recycled_files_total", op="DROP_PARTITION") == 7
    assert v(m1b, "cmroot_http_requests_total", route="/v1/recycle", code="403") == 1
    assert v(m1b, "cmroot_http_requests_total", route="/v1/recycle", code="200") == 2

    # resolve: 3 cmroot, 2 missing, 1 original
    orig = write_files(d.warehouse, {"db.db/live/f": b"live bytes"})
    [(orig_path, orig_bytes)] = orig.items()
    paths = list(files)[:3]
    pairs = [{"path": p, "checksum": cks.of_bytes(files[p])} for p in paths]
    pairs += [{"path": paths[0], "checksum": "0" * 32}, {"path": orig_path, "checksum": "1" * 32}]
    pairs += [{"path": orig_path, "checksum": cks.of_bytes(orig_bytes)}]
    statuses = [f["status"] for f in c.resolve(pairs)["files"]]
    assert statuses == ["cmroot"] * 3 + ["missing"] * 2 + ["original"]
    m2, _, _ = scrape(d)
    for status, n in (("cmroot", 3), ("missing", 2), ("original", 1)):
        assert (
            v(m2, "cmroot_resolve_total", status=status)
            - v(m1, "cmroot_resolve_total", status=status)
            == n
        )

    # served bytes: a whole GET and a Range; HEAD and 404 do not count
    p0 = list(files)[4]
    url = d.files_url(p0, cks.of_bytes(files[p0]))
    assert d.request("GET", url).body == files[p0]
    r = d.request("GET", url, headers={"Range": "bytes=100-199"})
    assert r.status == 206 and len(r.body) == 100
    assert d.request("HEAD", url).status == 200
    assert d.request("GET", d.files_url(p0, "2" * 32)).status == 404
    r = d.request("GET", d.files_url(orig_path, cks.of_bytes(orig_bytes)))
    assert r.body == orig_bytes
    m3, _, _ = scrape(d)
    served = v(m3, "cmroot_served_bytes_total") - v(m2, "cmroot_served_bytes_total")
    assert served == len(files[p0]) + 100 + len(orig_bytes)

    # gc: an expired tmp table goes; counters, histogram and gauges follow
    tmp = write_files(d.warehouse, {f"tmp.db/s/f{i}": f"tmp {i}".encode() * 50 for i in range(3)})
    c.recycle([str(d.warehouse / "tmp.db/s")], op="DROP_TABLE", db="tmp", table="s")
    m4, _, _ = scrape(d)
    assert v(m4, "cmroot_store_objects") == 5 + 1 + 3
    time.sleep(1.2)
    dry = c.gc(dry_run=True)
    assert dry["removed_objects"] == 3
    m5, _, _ = scrape(d)
    assert v(m5, "cmroot_gc_runs_total", result="success") == runs0, "a dry run is not a sweep"
    assert v(m5, "cmroot_store_objects") == 9
    t_gc = time.time()
    res = c.gc()
    assert res["removed_objects"] == 3
    m6, _, _ = scrape(d)
    assert v(m6, "cmroot_gc_runs_total", result="success") == runs0 + 1
    assert v(m6, "cmroot_gc_runs_total", result="failure") == 0
    assert v(m6, "cmroot_gc_deleted_objects_total") == 3
    assert v(m6, "cmroot_gc_deleted_bytes_total") == sum(map(len, tmp.values()))
    assert (
        v(m6, "cmroot_gc_duration_seconds_count") == v(m5, "cmroot_gc_duration_seconds_count") + 1
    )
    assert v(m6, "cmroot_gc_last_success_timestamp_seconds") >= t_gc - 1
    assert v(m6, "cmroot_store_objects") == 6
    assert v(m6, "cmroot_store_bytes") == sum(map(len, contents)) + 10
    assert v(m6, "cmroot_checksum_mismatches_total") == 0

    # request durations by route pattern: the raw path of an unknown route is not a label
    assert d.request("GET", "/v1/no-such-route/" + "ab" * 16).status == 404
    m7, _, text7 = scrape(d)
    assert v(m7, "cmroot_http_request_duration_seconds_count", route="other") == 1
    for route, n in (("/v1/recycle", 4), ("/v1/resolve", 1), ("/v1/files", 5), ("/v1/gc", 2)):
        assert v(m7, "cmroot_http_request_duration_seconds_count", route=route) == n, route
        assert v(m7, "cmroot_http_request_duration_seconds_bucket", route=route, le="+Inf") == n
    routes = {
        dict(labels)["route"]
        for name, labels in m7
        if name == "cmroot_http_request_duration_seconds_count"
    }
    assert routes == {
        "/v1/recycle", "/v1/resolve", "/v1/files", "/v1/gc", "/readyz", "/metrics", "other"
    }, routes

    # no path, checksum, db or table in any label
    sums = {cks.of_bytes(b) for b in [*files.values(), *tmp.values(), orig_bytes]}
    for _name, labels in m7:
        for key, value in labels:
            assert key in LABELS, key
            assert (
                str(d.base) not in value
                and value not in sums
                and not re.fullmatch(r"[0-9a-f]{32}", value)
            )
    assert "_created" not in text7
    promtool(text7)
    assert d.errors() == [], d.log()

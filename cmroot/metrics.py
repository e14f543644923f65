"""Prometheus metrics. Everything takes a registry (no global state); the store's size is
read from the index's running totals at scrape time by a collector, never by listing files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    values,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cmroot.store import Store

# Seconds: API calls take milliseconds, a resolve that hashes or a download minutes.
_REQUEST_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600)


def share_between_processes(directory: str) -> None:
    """Metrics made from now on keep their values in files under `directory`, which all
    the processes of one daemon share (prometheus_client's multiprocess mode): whichever
    process answers a scrape reports the sum of all (`shared_registry`). The library reads
    the switch once, at import, from PROMETHEUS_MULTIPROC_DIR; setting it here as well
    makes it hold for this process and for the processes it starts."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]


def shared_registry(directory: str) -> CollectorRegistry:
    """What a scrape reports when processes share their metrics: every process's values,
    summed (gauges as their mode says), plus this process's own process_* series."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class Metrics:
    """The daemon's metrics on `registry`. Gauges say how processes sharing their values
    add up (`multiprocess_mode`; ignored in a single process)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # process_* (CPU, memory, descriptors) and python_info, on this registry: the
        # library's default registry is never exposed.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self.recycled_files = Counter(
            "cmroot_recycled_files", "Files recycled into the store.", ["op"], registry=registry
        )
        self.recycled_bytes = Counter(
            "cmroot_recycled_bytes", "Bytes recycled into the store.", ["op"], registry=registry
        )
        self.recycle_errors = Counter(
            "cmroot_recycle_errors",
            "Recycle requests that failed (and were rolled back).",
            registry=registry,
        )
        self.gc_runs = Counter(
            "cmroot_gc_runs", "Retention sweeps, by result.", ["result"], registry=registry
        )
        self.gc_deleted_objects = Counter(
            "cmroot_gc_deleted_objects", "Objects removed by retention sweeps.", registry=registry
        )
        self.gc_deleted_bytes = Counter(
            "cmroot_gc_deleted_bytes", "Bytes removed by retention sweeps.", registry=registry
        )
        self.gc_evicted_objects = Counter(
            "cmroot_gc_evicted_objects",
            "Objects removed before their expiry to keep the store within store.max_bytes.",
            registry=registry,
        )
        self.gc_evicted_bytes = Counter(
            "cmroot_gc_evicted_bytes",
            "Bytes removed before their expiry to keep the store within store.max_bytes.",
            registry=registry,
        )
        self.gc_duration = Histogram(
            "cmroot_gc_duration_seconds",
            "Duration of retention sweeps.",
            registry=registry,
            buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800),
        )
        self.gc_last_success = Gauge(
            "cmroot_gc_last_success_timestamp_seconds",
            "When the last sweep succeeded.",
            registry=registry,
            multiprocess_mode="max",
        )
        self.resolve = Counter(
            "cmroot_resolve",
            "Resolved (path, checksum) pairs, by status.",
            ["status"],
            registry=registry,
        )
        self.served_bytes = Counter(
            "cmroot_served_bytes", "Bytes served by GET /v1/files.", registry=registry
        )
        self.checksum_mismatches = Counter(
            "cmroot_checksum_mismatches",
            "Bytes found not to match their checksum (never served).",
            registry=registry,
        )
        self.http_requests = Counter(
            "cmroot_http_requests",
            "HTTP requests, by route and status code.",
            ["route", "code"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "cmroot_http_request_duration_seconds",
            "Time from a request's headers to its answer (a download's last byte), by route.",
            ["route"],
            registry=registry,
            buckets=_REQUEST_BUCKETS,
        )
        self.in_flight = Gauge(
            "cmroot_http_requests_in_flight",
            "HTTP requests being answered now.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.queue_depth = Gauge(
            "cmroot_work_queue_depth",
            "Requests admitted to a class of work (running or waiting for a worker).",
            ["class"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.queue_limit = Gauge(
            "cmroot_work_queue_limit",
            "Requests a class of work admits at once; beyond it the answer is 503.",
            ["class"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        for status in ("original", "cmroot", "missing"):
            self.resolve.labels(status)
        for result in ("success", "failure"):
            self.gc_runs.labels(result)


class StoreCollector(Collector):
    """Store gauges computed from the index when Prometheus scrapes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.index = store.index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        objects, size, oldest = self.index.stats()
        now = self.store.clock()
        budget = self.store.config.max_bytes
        yield GaugeMetricFamily(
            "cmroot_store_budget_bytes",
            "The store's byte budget, store.max_bytes (0: none).",
            value=budget,
        )
        yield GaugeMetricFamily(
            "cmroot_store_over_budget_bytes",
            "Bytes the store holds beyond its budget (0 when within it or with none): what"
            " is left is younger than store.min_retain, or held.",
            value=max(0, size - budget) if budget else 0,
        )
        yield GaugeMetricFamily(
            "cmroot_holds", "Holds in force (cmroot hold ls).", value=len(self.index.holds(now))
        )
        held_objects, held_bytes = self.index.held_totals(now)
        yield GaugeMetricFamily(
            "cmroot_held_objects", "Expired objects a hold keeps.", value=held_objects
        )
        yield GaugeMetricFamily(
            "cmroot_held_bytes", "Bytes of expired objects a hold keeps.", value=held_bytes
        )
        yield GaugeMetricFamily("cmroot_store_objects", "Objects in the store.", value=objects)
        yield GaugeMetricFamily("cmroot_store_bytes", "Bytes in the store.", value=size)
        yield GaugeMetricFamily(
            "cmroot_oldest_object_timestamp_seconds",
            "When the oldest object still in the store was first recycled (0 when empty).",
            value=oldest or 0,
        )
        yield GaugeMetricFamily(
            "cmroot_last_event_id",
            "Id of the newest event in the log.",
            value=self.index.current_event_id(),
        )
        yield GaugeMetricFamily(
            "cmroot_quarantined_transactions",
            "Recycle transactions recovery could not finish (rollback failed, or committed "
            "with a failed clean-up): see `cmroot fsck`.",
            value=self.index.troubled_txs(),
        )

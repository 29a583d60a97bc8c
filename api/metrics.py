"""Prometheus metrics: job figures read from the store at scrape time (so they cover every worker that
shares it), plus request counts and latencies of this API process. One registry per app."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_service.jobs import STATES
from ckpt_service.store import JobStore

DURATION_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
BYTES_BUCKETS = tuple(10**k for k in range(6, 14))  # 1 MB .. 10 TB


def _histogram(name: str, doc: str, rows: list[tuple[str, str, float]], buckets: tuple[float, ...]
               ) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["kind", "state"])
    groups: dict[tuple[str, str], list[float]] = {}
    for kind, state, value in rows:
        groups.setdefault((kind, state), []).append(max(0.0, float(value or 0)))
    for labels, values in sorted(groups.items()):
        values.sort()
        counts = [(str(b), bisect.bisect_right(values, b)) for b in buckets]
        family.add_metric(list(labels), [*counts, ("+Inf", len(values))], sum(values))
    return family


class StoreCollector(Collector):
    def __init__(self, store: JobStore, pool: Any = None, live_seconds: float = 30.0) -> None:
        self.store, self.pool, self.live_seconds = store, pool, live_seconds

    def collect(self) -> Iterable[Metric]:
        counts = self.store.count_by_state()
        jobs = GaugeMetricFamily("ckpt_jobs", "Jobs by state.", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        yield GaugeMetricFamily("ckpt_queue_depth", "Jobs waiting for a worker.", value=counts.get("queued", 0))
        workers = self.store.live_workers(self.live_seconds)
        yield GaugeMetricFamily("ckpt_worker_slots", "Job slots of live workers.",
                                value=sum(w["slots"] for w in workers))
        yield GaugeMetricFamily("ckpt_workers_busy", "Running jobs (busy job slots) across workers.",
                                value=counts.get("running", 0))
        if self.pool is not None:
            yield GaugeMetricFamily("ckpt_local_workers_busy", "Busy job slots in this server process.",
                                    value=self.pool.busy())
        rows = self.store.finished_stats()
        yield _histogram("ckpt_job_duration_seconds", "Wall time of finished jobs, first start to end.",
                         [(r["kind"], r["state"], r["seconds"]) for r in rows], DURATION_BUCKETS)
        yield _histogram("ckpt_job_bytes", "Tensor bytes processed by finished jobs.",
                         [(r["kind"], r["state"], r["bytes"]) for r in rows], BYTES_BUCKETS)


class Metrics:
    def __init__(self, store: JobStore, pool: Any = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(store, pool))
        self.requests = Counter("ckpt_http_requests", "HTTP requests.", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("ckpt_http_request_seconds", "HTTP request latency (to the response start).",
                                 ["route"], registry=self.registry,
                                 buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))


class RequestMetrics:
    """ASGI middleware counting requests by route template (never by raw path: unbounded labels)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.latency.labels(route).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope.get("method", ""), route, str(status)).inc()

"""``GET /metrics``: the API process's Prometheus metrics, through ``prometheus_client``.

Read from the database at each scrape (the rows are the truth, for every worker at once):

* ``rloo_jobs{status}``: jobs by status; ``rloo_queue_depth`` and ``rloo_oldest_queued_job_age_seconds``;
* ``rloo_usage_total{project, kind, accelerator}``: metered usage (``service.tenancy.usage``: device
  seconds, tokens trained, sampled and served) by project, as a counter;
* ``rloo_steps_total``, ``rloo_completions_total`` (``rate(...[1m])`` gives steps and completions a
  second) and ``rloo_step_seconds`` (a histogram of step times), counted from the metric rows
  written since this process's first scrape: each scrape reads only the rows after the last one
  it read.

Measured here: ``rloo_http_request_duration_seconds{method, route, status}``, from a request to its
answer's first byte (a stream's too), by route template (``/v1/fine_tuning/jobs/{job_id}``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.core.tables import Job, JobMetric, Project, UsageRecord
from service.jobs.lifecycle import JobStatus

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BATCH = 5000
"""Metric rows read at most a scrape (the rest are read by the next)."""
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """One API process's registry: the database's view of jobs and steps, and its own requests."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "rloo_http_request_duration_seconds",
            "Time from a request to its answer's first byte, by route template.",
            ["method", "route", "status"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.steps = Counter("rloo_steps", "Training steps recorded, all workers.", registry=self.registry)
        self.completions = Counter(
            "rloo_completions", "Completions sampled in recorded steps, all workers.", registry=self.registry
        )
        self.step_seconds = Histogram(
            "rloo_step_seconds", "Time a training step took.", buckets=STEP_BUCKETS, registry=self.registry
        )
        self.registry.register(_Jobs())
        self.last_seq: int | None = None
        self.lock = threading.Lock()

    def scrape(self) -> bytes:
        self._count_new_steps()
        return bytes(generate_latest(self.registry))

    def _count_new_steps(self) -> None:
        from service.core.db import session_scope

        with self.lock, session_scope() as session:
            if self.last_seq is None:  # the first scrape counts from now: history is not re-read
                self.last_seq = int(session.scalar(select(func.max(JobMetric.seq))) or 0)
                return
            rows = session.execute(
                select(JobMetric.seq, JobMetric.data)
                .where(JobMetric.seq > self.last_seq)
                .order_by(JobMetric.seq)
                .limit(BATCH)
            ).all()
        for seq, data in rows:
            self.last_seq = seq
            self.steps.inc()
            step_time = data.get("time_step")
            if isinstance(step_time, (int, float)):
                self.step_seconds.observe(step_time)
                rate = data.get("completions_per_s")
                if isinstance(rate, (int, float)):
                    self.completions.inc(round(rate * step_time))


class _Jobs(Collector):
    """Jobs by status, and the queue, as the database has them at the scrape."""

    def collect(self) -> Iterator[Any]:
        from service.core.db import session_scope

        with session_scope() as session:
            counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            oldest = session.scalar(select(func.min(Job.created_at)).where(Job.status == JobStatus.QUEUED.value))
            used = session.execute(
                select(Project.id, UsageRecord.kind, UsageRecord.accelerator, func.sum(UsageRecord.amount))
                .join(Project, Project.seq == UsageRecord.project_seq)
                .group_by(Project.id, UsageRecord.kind, UsageRecord.accelerator)
            ).all()
        usage = CounterMetricFamily(
            "rloo_usage",
            "Metered usage by project and kind (device seconds, tokens).",
            labels=["project", "kind", "accelerator"],
        )
        for project, kind, accelerator, amount in used:
            usage.add_metric([project, kind, accelerator], float(amount))
        yield usage
        jobs = GaugeMetricFamily("rloo_jobs", "Jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        yield jobs
        yield GaugeMetricFamily(
            "rloo_queue_depth", "Jobs waiting for a worker (queued).", value=counts.get(JobStatus.QUEUED.value, 0)
        )
        yield GaugeMetricFamily(
            "rloo_oldest_queued_job_age_seconds",
            "How long the oldest queued job has waited (0: none waits).",
            value=max(0.0, time.time() - oldest) if oldest is not None else 0.0,
        )


class RequestTimer:
    """ASGI middleware: each HTTP request's time to its answer's first byte, by route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                self.metrics.requests.labels(scope["method"], route, str(message["status"])).observe(
                    time.perf_counter() - started
                )
            await send(message)

        await self.app(scope, receive, timed)

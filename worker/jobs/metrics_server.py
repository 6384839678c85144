"""``rloo worker --metrics-port N``: the worker's own Prometheus metrics (and its health: the port
answers while the worker lives), served from its reconciler process.

* ``rloo_worker_jobs_running``, and ``rloo_worker_job_step{job}``: the jobs this worker's processes
  hold (this host and PID namespace: one worker a container), read from the database at the scrape;
* ``rloo_webhook_deliveries_total{outcome}``: the attempts this worker's webhook senders made
  (``delivered``, ``retry``, ``failed``; ``service.jobs.webhooks``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import select

from service.core.db import session_scope
from service.core.identity import machine_tag
from service.core.tables import Job
from service.jobs import webhooks  # noqa: F401 (its delivery counters, registered before this collector)
from service.jobs.lifecycle import JobStatus


class HeldJobs(Collector):
    def describe(self) -> Iterator[Any]:
        """The families without reading the database (registering calls this, not ``collect``)."""
        yield GaugeMetricFamily("rloo_worker_jobs_running", "Jobs this worker's processes hold.")
        yield GaugeMetricFamily("rloo_worker_job_step", "The step each held job is at.", labels=["job"])

    def collect(self) -> Iterator[Any]:
        with session_scope() as session:
            rows = session.execute(
                select(Job.id, Job.step).where(
                    Job.status == JobStatus.RUNNING.value, Job.worker.like(f"{machine_tag()}:%")
                )
            ).all()
        yield GaugeMetricFamily("rloo_worker_jobs_running", "Jobs this worker's processes hold.", value=len(rows))
        steps = GaugeMetricFamily("rloo_worker_job_step", "The step each held job is at.", labels=["job"])
        for job_id, step in rows:
            steps.add_metric([job_id], step)
        yield steps


def serve_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Serve this process's registry (with the held jobs) on ``port``, in a thread."""
    REGISTRY.register(HeldJobs())
    start_http_server(port, addr=host, registry=REGISTRY)

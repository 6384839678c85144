"""Sending work to the workers, by task name: the API never imports the worker (or torch)."""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Celery

from service.settings import get_settings

log = logging.getLogger("rloo.queue")

RUN_JOB_TASK = "rloo.run_job"


@lru_cache
def client() -> Celery:
    settings = get_settings()
    app = Celery("rloo-api", broker=settings.redis_url)
    app.conf.update(
        task_default_queue=settings.queue,
        broker_connection_retry_on_startup=False,
        # A dead broker must not hang a request: the job row is already committed and the
        # reconciler queues it again once the broker is back.
        broker_transport_options={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.2},
    )
    return app


def enqueue_job(job_id: str) -> bool:
    """Queue the job by id. Returns False (and logs) if the broker is unreachable."""
    try:
        client().send_task(RUN_JOB_TASK, args=[job_id], queue=get_settings().queue, retry=True)
        return True
    except Exception as exc:  # the broker is down; the reconciler re-sends queued jobs
        log.warning("could not queue %s: %s", job_id, exc)
        return False

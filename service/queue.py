"""Sending work to the workers, by task name: the API never imports the worker (or torch)."""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Celery

from service.settings import get_settings

log = logging.getLogger("rloo.queue")

RUN_JOB_TASK = "rloo.run_job"
RUN_GRADER_TASK = "rloo.run_grader"


@lru_cache
def client() -> Celery:
    settings = get_settings()
    app = Celery("rloo-api", broker=settings.redis_url)
    app.conf.update(
        task_default_queue=settings.queue,
        task_serializer="json",  # never pickle: a message is data, not code to run
        accept_content=["json"],
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


def grader_queue() -> str:
    """Dry runs of graders go to their own queue, so they never wait behind a training job
    (``rloo worker --queue <queue>-graders``; ``rloo up`` starts one)."""
    return f"{get_settings().queue}-graders"


def wake_grader(queue: str, expires: float) -> None:
    """One wake-up for a worker of the graders queue: no arguments (the dry run itself waits in
    Redis: ``service.dryruns``). It expires with the API's wait, so a late worker skips it."""
    client().send_task(RUN_GRADER_TASK, args=[], queue=queue, expires=expires, retry=True)

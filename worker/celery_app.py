"""The Celery app (``worker.celery_app:app``): configuration only; tasks live in ``worker.tasks``.

Broker settings are chosen for tasks that run for hours:
* ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged when it ends, so a
  worker killed mid-job leaves the message to be redelivered; the atomic claim in the task makes a
  redelivery of a job that is still running (or finished) a no-op.
* ``worker_prefetch_multiplier = 1`` and concurrency 1: a worker holds one job at a time and never
  hoards queued jobs that another idle GPU could take.
* ``visibility_timeout``: Redis redelivers an unacknowledged message after this long. A job runs
  longer than any sane timeout, so we set it long (a day) and do not rely on it: the job row's
  heartbeat, checked by the reconciler, is what detects a dead worker.
"""

from __future__ import annotations

from celery import Celery

from service.queue import RUN_JOB_TASK
from service.settings import get_settings

settings = get_settings()

app = Celery("rloo", broker=settings.redis_url, include=["worker.tasks"])
app.conf.update(
    task_default_queue=settings.queue,
    task_routes={RUN_JOB_TASK: {"queue": settings.queue}},
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,  # the job row is the result
    worker_prefetch_multiplier=1,
    worker_concurrency=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 24 * 3600},
    worker_send_task_events=False,
)

"""The Celery app (``worker.celery_app:app``): configuration only; tasks live in ``worker.jobs.tasks``,
when pool processes import the training stack in ``worker.jobs.preload``.

Broker settings are chosen for tasks that run for hours:
* ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged when it ends, so a
  worker killed mid-job leaves the message to be redelivered; the atomic claim in the task makes a
  redelivery of a job that is still running (or finished) a no-op. When only the pool process died
  (the out-of-memory killer), the redelivered task sees that its pid is gone and continues the job
  at once; ``jobs.crashes`` stops a job that kills every process from being retried for ever.
* ``worker_prefetch_multiplier = 1`` and concurrency 1: a worker holds one job at a time and never
  hoards queued jobs that another idle GPU could take.
* ``visibility_timeout``: Redis redelivers an unacknowledged message after this long. A job runs
  longer than any sane timeout, so we set it long (a day) and do not rely on it: the job row's
  heartbeat, checked by the reconciler, is what detects a dead worker.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import after_setup_logger, after_setup_task_logger, worker_process_init

from service.core.settings import get_settings
from service.infra.task_queue import RUN_JOB_TASK
from worker.jobs import broker, preload

broker.install()  # a queue entry that is no message is dropped, never the end of the worker
settings = get_settings()

app = Celery("rloo", broker=settings.redis_url, include=["worker.jobs.tasks", "worker.sessions.holder"])
app.conf.update(
    task_default_queue=settings.queue,
    # JSON only, both ways: a message is data, never code to unpickle (and a task's arguments are
    # ids, no deeper than JSON allows).
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    result_accept_content=["json"],
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


@worker_process_init.connect
def _forget_the_parents_connections(**_: object) -> None:
    """Should the parent hold pooled database connections, a forked child must not share them (two
    processes on one socket corrupt the protocol): it starts a pool of its own. (The reconciler,
    which reads the database, is a process of its own: ``rloo worker``.)"""
    from service.core.db import get_engine

    if get_engine.cache_info().currsize:
        get_engine().dispose(close=False)


# Each pool child (a fresh one per job) imports the training stack while it waits for its job,
# unless its parent did (worker.jobs.preload).
worker_process_init.connect(preload.preload_training_stack)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: Any = None, **_: object) -> None:
    """RLOO_LOG_FORMAT=json: Celery's handlers too write JSON lines (``service.core.logs``)."""
    from service.core.logs import JsonFormatter

    if get_settings().log_format == "json" and logger is not None:
        for handler in logger.handlers:
            handler.setFormatter(JsonFormatter())

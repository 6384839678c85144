"""Sending work to the workers, by task name: the API never imports the worker (or torch).

A job's task goes to the queue its devices name (``job_queue``), and a training worker consumes
the queues of every job its devices can run (``training_queues``):

* one device of any kind (no ``resources``, or ``{gpus: 1}``): the default queue (``RLOO_QUEUE``,
  ``rloo``), as before there were queues by device, which every training worker consumes;
* ``n`` devices of kind ``k``: ``<queue>.train.<k>.<n>`` (``rloo.train.h100.4``);
* ``n`` devices of any kind (``n`` > 1): ``<queue>.train.any.<n>``.

A worker of ``D`` devices of kind ``K`` consumes ``<queue>.train.K.n`` and ``<queue>.train.any.n``
for every ``n`` ≤ ``D``, and the default queue: a 4-device job never lands on a 2-device worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from celery import Celery

from service.core.settings import get_settings

if TYPE_CHECKING:
    from service.core.tables import Job

log = logging.getLogger("rloo.queue")

RUN_JOB_TASK = "rloo.run_job"
RUN_GRADER_TASK = "rloo.run_grader"
HOLD_TINKER_MODEL_TASK = "rloo.hold_tinker_model"


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


ANY_KIND = "any"


def asked(resources: Mapping[str, Any] | None) -> tuple[int, str | None]:
    """The devices a job asks for, from its stored ``resources`` (``schemas.Resources``; null: one
    device of any kind): how many, and their kind (None: any, also when it names the kind "any")."""
    resources = resources or {}
    kind = resources.get("accelerator") or None
    return int(resources.get("gpus") or 1), None if kind == ANY_KIND else kind


def lane(resources: Mapping[str, Any] | None) -> str:
    """The devices a job asks for, as its row keeps them (``jobs.lane``): ``<kind or any>.<n>``; the
    jobs of one lane share a queue, and a worker's task claims the fairest of them
    (``lifecycle.claim_fairest``)."""
    gpus, kind = asked(resources)
    return f"{kind or ANY_KIND}.{gpus}"


def job_queue(resources: Mapping[str, Any] | None) -> str:
    """The queue of a job that asks for ``resources`` (the module's docstring has the scheme)."""
    gpus, kind = asked(resources)
    base = get_settings().queue
    if gpus == 1 and kind is None:
        return base
    return f"{base}.train.{kind or ANY_KIND}.{gpus}"


def training_queues(devices: int, accelerator: str) -> list[str]:
    """The queues a training worker of ``devices`` devices of kind ``accelerator`` consumes: the
    default queue, then the queue of every job it can run, fewest devices first."""
    can_run = [
        job_queue({"gpus": n, "accelerator": kind}) for n in range(1, devices + 1) for kind in (accelerator, None)
    ]
    return list(dict.fromkeys([get_settings().queue, *can_run]))


def enqueue_job(job: Job) -> bool:
    """Queue the job's task on the queue of the devices it asks for. Returns False (and logs) if the
    broker is unreachable."""
    try:
        client().send_task(RUN_JOB_TASK, args=[job.id], queue=job_queue(job.resources), retry=True)
        return True
    except Exception as exc:  # the broker is down; the reconciler re-sends queued jobs
        log.warning("could not queue %s: %s", job.id, exc)
        return False


def jobs_waiting(conn: Any, queues: list[str], *, look: int = 100) -> bool:
    """Whether a job's task waits in any of ``queues`` (Celery's Redis transport keeps a queue as a
    list of JSON messages, the task's name in their headers; the first ``look`` of each are read)."""
    import json

    for queue in queues:
        for raw in conn.lrange(queue, 0, look - 1):
            try:
                if json.loads(raw).get("headers", {}).get("task") == RUN_JOB_TASK:
                    return True
            except (ValueError, AttributeError):
                continue
    return False


WORKER_QUEUES_VARIABLE = "RLOO_WORKER_QUEUES"
"""Where a training worker leaves the queues it consumes, comma-separated, for its pool's processes."""


def grader_queue() -> str:
    """Dry runs of graders go to their own queue, so they never wait behind a training job
    (``rloo worker --queue <queue>-graders``; ``rloo up`` starts one)."""
    return f"{get_settings().queue}-graders"


def wake_grader(queue: str, expires: float) -> None:
    """One wake-up for a worker of the graders queue: no arguments (the dry run itself waits in
    Redis: ``service.jobs.dry_runs``). It expires with the API's wait, so a late worker skips it."""
    client().send_task(RUN_GRADER_TASK, args=[], queue=queue, expires=expires, retry=True)


def wake_tinker_model(model_id: str) -> bool:
    """Ask a training worker to take a Tinker training model (``worker.sessions.holder``): the
    default queue, which every training worker consumes. False (logged) if the broker is away."""
    try:
        client().send_task(HOLD_TINKER_MODEL_TASK, args=[model_id], queue=get_settings().queue, retry=True)
        return True
    except Exception as exc:
        log.warning("could not ask a worker for tinker model %s: %s", model_id, exc)
        return False

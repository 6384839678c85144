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
    """Dry runs of model graders go to their own queue, so they never wait behind a training job
    (``rloo worker --queue <queue>-graders``; ``rloo up`` starts one)."""
    return f"{get_settings().queue}-graders"


class GraderRunTimeout(TimeoutError):
    pass


async def run_model_grader(payload: dict[str, object], *, timeout: float) -> dict[str, object]:
    """Send a model grader's dry run to a worker and wait for its answer (a Redis list the worker
    pushes to), on the event loop: a waiting dry run holds no worker thread of the API. The task
    expires with the wait, so a worker that comes late does not run it."""
    import json
    import secrets

    import redis.asyncio
    from anyio import to_thread

    reply = f"rloo:grader-reply:{secrets.token_hex(16)}"

    def send() -> None:
        client().send_task(RUN_GRADER_TASK, args=[payload, reply], queue=grader_queue(), expires=timeout, retry=True)

    await to_thread.run_sync(send)
    conn = redis.asyncio.Redis.from_url(
        get_settings().redis_client_url, socket_timeout=timeout + 5, socket_connect_timeout=5
    )
    try:
        answer = await conn.blpop([reply], timeout=max(1, int(timeout)))
    finally:
        await conn.aclose()
    if answer is None:
        raise GraderRunTimeout(
            f"no worker answered on queue '{grader_queue()}' within {timeout:g} s; model graders run on a worker "
            f"started with `rloo worker --queue {grader_queue()}` (rloo up starts one)"
        )
    result: dict[str, object] = json.loads(answer[1])
    return result

"""A task's message as the worker's main process sees it, before a pool process is given to it.

Whatever is wrong with a message must be found here: a pool process costs seconds to replace (each
serves one job, then torch is imported afresh), and the main process is the worker itself (an
error that escapes it ends the worker, and with ``acks_late`` the message comes back to end the
next one). So each task's arguments are checked against what it takes, and a message delivered
``MAX_DELIVERIES`` times without ever being acknowledged (it ends whatever runs it) is set aside.
A message set aside is acknowledged and recorded in the Redis list ``rloo:dead-letters:<queue>``
(the newest 1000), with why.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from typing import Any

from celery.worker.request import Request
from celery.worker.state import task_ready

from service.core.settings import get_settings

log = logging.getLogger("rloo.worker")

MAX_DELIVERIES = 10
"""Deliveries of one message (by task id) before it is set aside. A job's own crash limit
(RLOO_MAX_JOB_CRASHES) fails a job that kills its workers long before this."""


class GuardedRequest(Request):
    """Checks a message before it goes to the pool: ``refusal`` (the task's own rules), then the
    number of deliveries."""

    decided: bool | None = None  # the answer, once given: Celery may ask twice (a message with `expires`)

    def revoked(self) -> bool:  # execute_using_pool asks this first
        if self.decided is None:
            self.decided = self._decide()
        return self.decided

    def _decide(self) -> bool:
        if super().revoked():
            return True
        reason = self.refusal()
        if reason is None:
            reason = _too_often(self.id)
        if reason is None:
            return False
        if reason:  # "": nothing to run, nothing wrong
            log.warning("task %s %s (%s) set aside: %s", self.name, self.id, self.argsrepr[:200], reason)
            _dead_letter(self, reason)
        task_ready(self)
        self.acknowledge()
        return True

    def refusal(self) -> str | None:
        """None to run it; "" to drop it quietly; else why it must not run."""
        return None

    def acknowledge(self) -> None:
        """Done with (finished, failed, or set aside here): its deliveries are no longer counted."""
        if not self.acknowledged:
            super().acknowledge()
            with contextlib.suppress(Exception):
                _redis().delete(_deliveries_key(self.id))


class JobRequest(GuardedRequest):
    """A job's task: one job id. A job that waits for no worker any more (cancelled while queued,
    finished, paused), with no other job waiting in its lane, is dropped here at the cost of a query
    or two, so create-and-cancel churn never costs a pool process."""

    def refusal(self) -> str | None:
        args, kwargs = self.args, self.kwargs
        if kwargs or not (len(args) == 1 and isinstance(args[0], str) and 0 < len(args[0]) <= 64):
            return "its arguments are not one job id"
        if _still_runnable(args[0]):
            return None
        log.info("job %s waits for no worker (cancelled, paused or finished); its task is dropped", args[0])
        return ""


class WakeUpRequest(GuardedRequest):
    """A grader dry run's wake-up: no arguments (the dry run waits in Redis)."""

    def refusal(self) -> str | None:
        return "a wake-up carries no arguments" if self.args or self.kwargs else None


class TinkerModelRequest(GuardedRequest):
    """A Tinker training model's wake-up: one model id. One that a worker holds already is dropped
    here (the holder serves its requests), without a pool process."""

    def refusal(self) -> str | None:
        args, kwargs = self.args, self.kwargs
        if kwargs or not (len(args) == 1 and isinstance(args[0], str) and 0 < len(args[0]) <= 128):
            return "its arguments are not one model id"
        with contextlib.suppress(Exception):
            from service.tinker.bus import holder_key

            if _redis().exists(holder_key(args[0])):
                return ""
        return None


def _still_runnable(job_id: str) -> bool:
    """queued (to claim), running (its worker may have died), unknown to us (the database is away:
    the pool process will see), or another job waits in its lane (a task is a turn in its lane:
    another task may have run this one in its place, ``lifecycle.claim_fairest``)."""
    from sqlalchemy import select

    from service.core import crud
    from service.core.db import session_scope
    from service.core.tables import Job
    from service.jobs.lifecycle import JobStatus

    try:
        with session_scope() as session:
            job = crud.get_job_by_id(session=session, job_id=job_id)
            if job is None:
                return False
            if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
                return True
            waiting = select(Job.seq).where(Job.status == JobStatus.QUEUED.value, Job.lane == job.lane).limit(1)
            return session.scalar(waiting) is not None
    except Exception:
        return True


@functools.cache
def _redis() -> Any:
    import redis

    return redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=5, socket_connect_timeout=5)


def _deliveries_key(task_id: str) -> str:
    return f"rloo:deliveries:{task_id}"


def _too_often(task_id: str) -> str | None:
    key = _deliveries_key(task_id)
    try:
        count = _redis().incr(key)
        _redis().expire(key, 2 * 24 * 3600)  # past the broker's redelivery of a lost message (a day)
    except Exception:  # Redis blinked between the delivery and now: let the task run
        return None
    if count > MAX_DELIVERIES:
        return f"delivered {count} times without ever finishing (it ends whatever runs it)"
    return None


def _dead_letter(request: Request, reason: str) -> None:
    queue = request.delivery_info.get("routing_key") or "unknown"
    record = {
        "task": request.name,
        "id": request.id,
        "args": request.argsrepr[:1000],
        "reason": reason,
        "at": time.time(),
    }
    try:
        _redis().lpush(f"rloo:dead-letters:{queue}", json.dumps(record))
        _redis().ltrim(f"rloo:dead-letters:{queue}", 0, 999)
    except Exception as exc:
        log.warning("could not record the dead letter of task %s: %s", request.id, exc)

"""The reconciler: makes the job rows and the queue agree again after a crash. Every worker runs it
when it starts and then every ``RLOO_RECONCILE_SECONDS`` (``rloo worker``); running it twice at once
is harmless, since every change is one conditional UPDATE and a duplicate task finds its job claimed.

* A running job whose heartbeat is older than ``stale_after`` lost its worker (killed, out of memory,
  host gone): it goes back to ``queued`` and is sent again; the next worker continues from its last
  checkpoint. After ``RLOO_MAX_JOB_CRASHES`` such deaths it fails (``worker_lost``) instead.
* A paused job whose worker died while saving its checkpoint is let go, so it can be resumed.
* Queued jobs are sent again when their queue is empty but they have waited ``queued_grace``: their
  task was lost (a broker restarted without its data, an enqueue that failed).
* A queued job that has waited ``queued_grace`` and whose queue no live registered worker consumes
  (``service.jobs.fleet``: it asks for more devices, or another kind, than any worker has) gets an event
  saying what it waits for, once a wait; it stays queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import select

from service.core.tables import Job, Worker
from service.infra import task_queue
from service.jobs import fleet, lifecycle
from service.jobs.lifecycle import JobStatus

log = logging.getLogger("rloo.reconcile")


def reconcile(
    session: Any,
    *,
    stale_after: float,
    queued_grace: float,
    queue_length: Callable[[str], int | None],
    max_crashes: int = 3,
    judge_heartbeats: bool = True,
    worker_stale_after: float | None = None,
) -> dict[str, int]:
    """One round. ``queue_length(name)``: the tasks waiting in a queue, None when the broker cannot
    say. ``judge_heartbeats`` False (the caller could not reach the database lately): a stale
    heartbeat may only mean that the workers could not reach it either, so no job is taken from its
    worker this round, nor judged unrunnable. ``worker_stale_after``: when a registered worker is no
    longer live (None: the fleet is not judged)."""
    now = time.time()
    cutoff = now - stale_after if judge_heartbeats else 0.0  # no heartbeat is older than 1970
    counts = {"requeued": 0, "failed": 0, "released": 0, "resent": 0, "waiting": 0}
    running = select(Job).where(Job.status == JobStatus.RUNNING.value, Job.heartbeat_at < cutoff)
    for job in session.scalars(running).all():
        silent = now - (job.heartbeat_at or now)
        log.warning("job %s: worker %s sent no heartbeat for %.0f s", job.id, job.worker, silent)
        moved = lifecycle.recover(
            session=session,
            job=job,
            worker=job.worker,
            # The tenant's event: no host or process of ours (the log above has them).
            reason=f"The job's worker stopped sending heartbeats {silent:.0f} s ago",
            max_crashes=max_crashes,
            stale_before=cutoff,
        )
        if moved == JobStatus.QUEUED:
            task_queue.enqueue_job(job)
            counts["requeued"] += 1
        elif moved == JobStatus.FAILED:
            counts["failed"] += 1
    counts["released"] = lifecycle.release_dead_paused(session=session, heartbeat_before=cutoff)
    waited = int(now - queued_grace)
    queued = session.scalars(select(Job).where(Job.status == JobStatus.QUEUED.value, Job.created_at < waited)).all()
    lengths: dict[str, int | None] = {}  # each queue asked once a round
    for job in queued:
        name = task_queue.job_queue(job.resources)
        if name not in lengths:
            lengths[name] = queue_length(name)
        if lengths[name] == 0 and task_queue.enqueue_job(job):
            counts["resent"] += 1
    if worker_stale_after is not None and judge_heartbeats:  # (workers' heartbeats were cut off too)
        counts["waiting"] = _note_waiting(session, queued, fleet.live_workers(session, stale_after=worker_stale_after))
    if any(counts.values()):
        log.warning("reconciled: %s", counts)
    return counts


def _note_waiting(session: Any, queued: Sequence[Job], live: list[Worker]) -> int:
    """Tell each queued job that no live worker consumes its queue what it waits for (once a wait:
    ``lifecycle.note_waiting``). With no live worker registered there is nothing to judge by."""
    if not live:
        return 0
    consumed = {name for worker in live for name in worker.queues}
    noted = 0
    for job in queued:
        name = task_queue.job_queue(job.resources)
        if job.waiting_at is not None or name in consumed:
            continue
        if lifecycle.note_waiting(session=session, job=job, message=fleet.waiting_message(job.resources, live)):
            hosts = ", ".join(f"{w.id} ({w.devices} x {w.accelerator})" for w in live)
            log.warning("job %s waits on queue %s, which no live worker consumes; live: %s", job.id, name, hosts)
            noted += 1
    return noted


def queue_length(name: str) -> int | None:
    """Tasks waiting in the broker's queue ``name`` (Celery's Redis transport keeps them in a list
    named after the queue); None when the broker cannot say."""
    import redis

    from service.core.settings import get_settings

    settings = get_settings()
    try:
        conn = redis.Redis.from_url(settings.redis_client_url, socket_timeout=5, socket_connect_timeout=5)
        try:
            return int(conn.llen(name))
        finally:
            conn.close()
    except Exception:
        return None

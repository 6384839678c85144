"""A job's life: its statuses, the moves between them, and every write that changes a job row.

::

    validating_files -> queued -> running -> succeeded
                                   |  ^  \\-> failed
                        (pause)    v  |     (a worker died: recover, or hand back)
                                  paused -> queued (resume)
    any unfinished status -> cancelled;  paused -> succeeded (a pause that came with the last step)

Each write is one conditional ``UPDATE``: it names the statuses the job may be in (and, where it
matters, the worker that must hold it), so of two processes racing on a row only one changes it,
and the loser learns so from the row count. Moves are committed with their event, so a reader never
sees a status without the event that explains it. ``crud`` keeps the reads and the inserts.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session

from service.core.tables import Job, JobEvent, now
from service.infra import wakeups
from service.jobs import webhooks
from service.tenancy import quotas


class JobStatus(str, enum.Enum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


S = JobStatus
FINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
NOTIFIED = FINAL | {S.PAUSED}
"""Moves a webhook tells a project's endpoints of (``service.jobs.webhooks``)."""
WAITING = frozenset({S.VALIDATING_FILES, S.QUEUED})
"""Waiting for a worker (counted against RLOO_MAX_QUEUED_JOBS)."""
UNFINISHED = frozenset(S) - FINAL
"""Not finished: what a cancel applies to, and what keeps a job's files from being deleted."""
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.VALIDATING_FILES: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PAUSED, S.QUEUED}),
    S.PAUSED: frozenset({S.QUEUED, S.CANCELLED, S.SUCCEEDED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
"""The legal moves; ``move`` refuses any other (a bug, not a race)."""


def add_event(
    *,
    session: Session,
    job: Job,
    message: str,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    """A line of the job's history (``GET .../events``): a message, or a step's metrics."""
    event = JobEvent(job_seq=job.seq, message=message, level=level, type=type, data=data)
    session.add(event)
    wakeups.mark(session, job.id)
    return event


def _values(statuses: Iterable[JobStatus]) -> tuple[str, ...]:
    return tuple(s.value for s in statuses)


def _rows(session: Session, statement: Any) -> int:
    result: CursorResult[Any] = session.execute(statement.execution_options(synchronize_session=False))  # type: ignore[assignment]
    return int(result.rowcount or 0)


# Any move ------------------------------------------------------------------------------------------
def move(
    *,
    session: Session,
    job: Job,
    to: JobStatus,
    from_: Iterable[JobStatus],
    event: str | None = None,
    level: str = "info",
    held_by: str | None = None,
    **values: Any,
) -> bool:
    """``job`` to ``to`` only if it is in one of ``from_`` (and, with ``held_by``, that worker still
    holds it); committed with ``event``. False, changing nothing, when another process moved it first."""
    from_ = tuple(from_)
    illegal = [f for f in from_ if to not in TRANSITIONS[f]]
    if illegal:
        raise ValueError(f"a job cannot move from {', '.join(map(str, illegal))} to {to}")
    if to in FINAL:
        values.setdefault("finished_at", now())
    where = [Job.seq == job.seq, Job.status.in_(_values(from_))]
    if held_by is not None:
        where.append(Job.worker == held_by)
    moved = _rows(session, update(Job).where(*where).values(status=to.value, **values))
    if moved:
        wakeups.mark(session, job.id)
        if to in NOTIFIED:  # the outbox row commits with the move, or not at all
            webhooks.enqueue(session, job, f"fine_tuning.job.{to.value}")
    if moved and event:
        add_event(session=session, job=job, message=event, level=level)
    session.commit()
    if job in session:
        session.refresh(job)
    else:  # a row loaded by another (closed) session: bring the caller's copy up to date
        row = session.execute(select(Job.status, Job.error, Job.finished_at).where(Job.seq == job.seq)).one()
        job.status, job.error, job.finished_at = row.status, row.error, row.finished_at
    return bool(moved)


# A worker's hold on a job --------------------------------------------------------------------------
def claim(*, session: Session, job_id: str, worker: str) -> Job | None:
    """queued -> running for this worker. A task delivered twice finds the row taken and gets None:
    redelivery is harmless."""
    t = time.time()
    claimed = _rows(
        session,
        update(Job)
        .where(Job.id == job_id, Job.status == S.QUEUED.value)
        .values(
            status=S.RUNNING.value,
            worker=worker,
            heartbeat_at=t,
            started_at=int(t),
            attempts=Job.attempts + 1,
            waiting_at=None,  # a wait ends here: should it be queued again and wait, that is said again
        ),
    )
    session.commit()
    return session.scalar(select(Job).where(Job.id == job_id)) if claimed else None


def claim_fairest(*, session: Session, lane: str, worker: str) -> Job | None:
    """The next queued job of ``lane`` by turns between projects, claimed for this worker: of the
    projects with a job waiting there, the one with the fewest jobs running, then the one whose last
    job started longest ago; its oldest job. A task is a turn to run one job of its job's lane, not
    that job: one project's many queued jobs wait behind another's one (each queued job has its own
    task, so every one is claimed by some task). None when none is left to claim."""
    running = (
        select(Job.project_seq, func.count().label("n"))
        .where(Job.status == S.RUNNING.value)
        .group_by(Job.project_seq)
        .subquery()
    )
    last = select(Job.project_seq, func.max(Job.started_at).label("at")).group_by(Job.project_seq).subquery()
    # Each project's oldest queued job of the lane: one candidate a project, so that projects held at
    # their quotas never fill the list and keep the others waiting.
    oldest = func.row_number().over(partition_by=Job.project_seq, order_by=(Job.created_at, Job.seq))
    queued = (
        select(Job.id, Job.project_seq, Job.created_at, Job.seq, oldest.label("rank"))
        .where(Job.status == S.QUEUED.value, Job.lane == lane)
        .subquery()
    )
    turns = (
        select(queued.c.id)
        .outerjoin(running, running.c.project_seq == queued.c.project_seq)
        .outerjoin(last, last.c.project_seq == queued.c.project_seq)
        .where(queued.c.rank == 1)
        .order_by(func.coalesce(running.c.n, 0), func.coalesce(last.c.at, 0), queued.c.created_at, queued.c.seq)
        .limit(16)
    )
    for _ in range(3):  # another worker may claim a candidate first: look again
        candidates = list(session.scalars(turns))
        session.rollback()
        if not candidates:
            return None
        for job_id in candidates:
            job = _claim_within_quotas(session, job_id, worker)
            if job is not None:
                return job
    return None


def _claim_within_quotas(session: Session, job_id: str, worker: str) -> Job | None:
    """``job_id`` claimed if its project is under its quotas of running jobs and devices (where it has
    either, its project locked meanwhile: two workers never both take its last place); else the
    job says why in its events, once a wait, and starts when a running one ends (the reconciler sends
    its task again)."""
    job = session.scalar(select(Job).where(Job.id == job_id))
    if job is None:
        session.rollback()
        return None
    why = quotas.why_waiting(session, job)
    if why is not None:
        note_waiting(session=session, job=job, message=why)
        return None
    return claim(session=session, job_id=job_id, worker=worker)


def note_waiting(*, session: Session, job: Job, message: str) -> bool:
    """A queued job no live worker can run (``service.jobs.reconcile``): ``message`` in its events once a
    wait, committed with the mark. False, writing nothing, when another reconciler said it first or
    the job moved on."""
    noted = _rows(
        session,
        update(Job)
        .where(Job.seq == job.seq, Job.status == S.QUEUED.value, Job.waiting_at.is_(None))
        .values(waiting_at=time.time()),
    )
    if noted:
        add_event(session=session, job=job, message=message, level="warn")
    session.commit()
    return bool(noted)


def heartbeat(*, session: Session, job: Job, worker: str) -> None:
    """The worker still holds the job (paused too: it holds it while it saves the pause's checkpoint)."""
    _rows(
        session,
        update(Job)
        .where(Job.seq == job.seq, Job.status.in_(_values({S.RUNNING, S.PAUSED})), Job.worker == worker)
        .values(heartbeat_at=time.time()),
    )
    session.commit()


def record_progress(*, session: Session, job: Job, step: int, trained_tokens: int, worker: str | None = None) -> str:
    """Heartbeat and progress in one UPDATE, committed with what the session holds (the step's
    metrics); returns the status the row has now.

    The worker calls this between steps and stops when the answer is not ``running`` (a cancel, a
    pause). With ``worker``, only while that worker still holds the job: after a long database outage
    a reconciler may have queued it again for another worker, and then nothing is written (the
    session is rolled back) and the answer is ``lost``: the run must stop, saving nothing.
    """
    # Progress is recorded for a job paused or cancelled mid-step too: the step it reached is true either way.
    where = [Job.seq == job.seq, Job.status.in_(_values({S.RUNNING, S.PAUSED, S.CANCELLED}))]
    if worker is not None:
        where.append(Job.worker == worker)
    written = _rows(
        session, update(Job).where(*where).values(step=step, trained_tokens=trained_tokens, heartbeat_at=time.time())
    )
    if worker is not None and not written:
        session.rollback()
        return "lost"
    session.commit()
    return session.scalar(select(Job.status).where(Job.seq == job.seq)) or "missing"


def checkpoint_saved(*, session: Session, job: Job, final_name: str | None = None) -> None:
    """Progress is saved: deaths before it say nothing about the job any more (a deploy or two during
    a week-long job must not add up to worker_lost). The final checkpoint names the fine-tuned model.
    Not committed: the caller commits it with the checkpoint's row and event."""
    values: dict[str, Any] = {"crashes": 0}
    if final_name is not None:
        values["fine_tuned_model"] = final_name
    _rows(session, update(Job).where(Job.seq == job.seq).values(**values))


def release(*, session: Session, job: Job) -> None:
    """The worker has stopped on a paused job (its checkpoint is written): no worker holds it now,
    so it may be resumed."""
    _rows(session, update(Job).where(Job.seq == job.seq, Job.status == S.PAUSED.value).values(worker=None))
    session.commit()


def release_dead_paused(*, session: Session, heartbeat_before: float) -> int:
    """Paused jobs whose worker died while saving the pause's checkpoint: let go, so they may be
    resumed. Returns how many."""
    released = _rows(
        session,
        update(Job)
        .where(Job.status == S.PAUSED.value, Job.worker.is_not(None), Job.heartbeat_at < heartbeat_before)
        .values(worker=None),
    )
    session.commit()
    return released


def resume(*, session: Session, job: Job, stale_after: float) -> bool:
    """paused -> queued, only once the worker that paused has stopped, or has sent no heartbeat for
    ``stale_after`` seconds (it died): one UPDATE, so a job never runs on two workers at once.
    Returns False, changing nothing, otherwise."""
    resumed = _rows(
        session,
        update(Job)
        .where(
            Job.seq == job.seq,
            Job.status == S.PAUSED.value,
            Job.worker.is_(None) | (Job.heartbeat_at < time.time() - stale_after),
        )
        .values(status=S.QUEUED.value),
    )
    if resumed:
        add_event(session=session, job=job, message="Job resumed: queued to continue from its last checkpoint")
    session.commit()
    session.refresh(job)
    return bool(resumed)


def recover(
    *, session: Session, job: Job, worker: str | None, reason: str, max_crashes: int, stale_before: float | None = None
) -> str | None:
    """A running job whose worker died (``reason`` says how we know): back to ``queued``, to continue
    from its last checkpoint, or ``failed`` with ``worker_lost`` once its workers have died
    ``max_crashes`` times (a job that kills every worker, e.g. by running it out of memory, must not
    do so forever). Of two reconcilers, or a reconciler and a redelivered task, only one moves the
    job. Returns the new status, or None."""
    crashes = job.crashes + 1
    where = [Job.seq == job.seq, Job.status == S.RUNNING.value, Job.crashes == job.crashes]
    where.append(Job.worker == worker if worker is not None else Job.worker.is_(None))
    if stale_before is not None:
        where.append(Job.heartbeat_at < stale_before)
    if crashes >= max_crashes:
        message = (
            f"The job's worker died {crashes} times while running it, the last time at step {job.step} "
            "(a process killed without a word: most often the operating system's out-of-memory killer). "
            "Lower batch_size, rloo_k or max_new_tokens, or give the worker more memory; the checkpoints are kept."
        )
        values: dict[str, Any] = {
            "status": S.FAILED.value,
            "finished_at": now(),
            "error": {"code": "worker_lost", "message": message, "param": None},
        }
        event, level = f"{reason}. Job failed: {message}", "error"
    else:
        values = {"status": S.QUEUED.value}
        event = (
            f"{reason}; the job is queued again and continues from its last checkpoint "
            f"(crash {crashes} of at most {max_crashes - 1})"
        )
        level = "warn"
    if not _rows(session, update(Job).where(*where).values(worker=None, crashes=crashes, **values)):
        session.rollback()
        return None
    add_event(session=session, job=job, message=event, level=level)
    if values["status"] == S.FAILED.value:
        webhooks.enqueue(session, job, "fine_tuning.job.failed")
    session.commit()
    return str(values["status"])


def file_in_use(*, session: Session, file_id: str) -> bool:
    """Whether an unfinished job trains or validates on the file (it cannot be deleted then)."""
    stmt = select(Job.seq).where(
        (Job.training_file == file_id) | (Job.validation_file == file_id),
        Job.status.in_([s.value for s in UNFINISHED]),
    )
    return session.scalar(stmt.limit(1)) is not None


def waiting_jobs(*, session: Session, project_seq: int, up_to: int) -> int:
    """The project's jobs that wait for a worker, counted up to ``up_to`` (the cap is all a caller
    needs to know: the count costs at most that many rows), with the project's row locked
    (PostgreSQL) so that two creations racing for its last place cannot both take it."""
    quotas.lock_project(session, project_seq)
    statuses = [s.value for s in WAITING]
    waiting = select(Job.seq).where(Job.project_seq == project_seq, Job.status.in_(statuses)).limit(up_to)
    return session.scalar(select(func.count()).select_from(waiting.subquery())) or 0

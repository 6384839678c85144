"""The Celery tasks, and nothing else: ``rloo.run_job`` (a job id; the row is re-read and claimed
atomically, so a task delivered twice trains once) and ``rloo.run_grader`` (a wake-up for one
grader dry run). What a run writes lives in ``worker.jobs.database_recorder``, how it fails in
``worker.jobs.failures``; what the worker's main process refuses before a task reaches a pool process,
in ``worker.jobs.message_guard``."""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from sqlalchemy import select

from service.core import crud
from service.core.db import session_scope
from service.core.identity import died_here, process_name
from service.core.settings import get_settings
from service.core.tables import Job
from service.infra import outbound
from service.infra.task_queue import RUN_GRADER_TASK, RUN_JOB_TASK
from service.jobs import lifecycle
from service.jobs.lifecycle import JobStatus
from worker.celery_app import app
from worker.engine.distributed.launch import RanksLost
from worker.jobs.database_recorder import DatabaseRecorder, Heartbeat, write
from worker.jobs.failures import cap_memory, classify

log = logging.getLogger("rloo.worker")


@app.task(
    name=RUN_JOB_TASK, Request="worker.jobs.message_guard:JobRequest"
)  # acks_late and the rest: worker.celery_app
def run_job(job_id: str) -> str:
    """A turn to run one job of ``job_id``'s lane to its end: the fairest queued job there, by turns
    between projects (``lifecycle.claim_fairest``), which is ``job_id`` itself unless another project
    waits longer. Safe to deliver twice: only the delivery that claims a row trains it. Every line it
    logs names the job it runs (``service.core.logs``)."""
    from service.core.logs import job_scope

    with session_scope() as session:
        job = _claim_a_turn(session, job_id)
        if job is None:
            return "skipped"
        node = getattr(run_job.request, "hostname", None) or "local"  # the Celery worker (rloo worker)
        with job_scope(job.id):
            # Where it runs is the operator's business (this log); the tenant's event names no host.
            turn = "" if job.id == job_id else f", in the turn of job {job_id}"
            log.info("job %s started on worker %s (process %s%s)", job.id, node, process_name(), turn)
            lifecycle.add_event(session=session, job=job, message="Job started")
            session.commit()
    with job_scope(job.id):
        return _run_job(job)


def _claim_a_turn(session: Any, job_id: str) -> Job | None:
    """The job this task runs, claimed; None when there is none to run (logged)."""
    own = crud.get_job_by_id(session=session, job_id=job_id)
    if own is None:
        log.info("job %s is gone; nothing to do", job_id)
        return None
    # A pool process of this host that was killed (the out-of-memory killer, most often) while it ran
    # a job of this lane, in this task's turn or another's: Celery handed its task back, and the job
    # goes back to the queue now, without waiting for its heartbeat to go stale.
    running = select(Job).where(Job.status == JobStatus.RUNNING.value, Job.lane == own.lane)
    for dead in [j for j in session.scalars(running) if died_here(j.worker)]:
        log.warning("job %s: its process %s was killed; Celery handed its task back", dead.id, dead.worker)
        if _crashed(session, dead, "The worker process running the job was killed") == JobStatus.QUEUED and (
            dead.id == job_id
        ):
            return lifecycle.claim(session=session, job_id=job_id, worker=process_name())
    job = lifecycle.claim_fairest(session=session, lane=own.lane, worker=process_name())
    if job is None:
        log.info("job %s: no queued job in its lane %s to run (its own is %s)", job_id, own.lane, own.status)
    return job


def _run_job(job: Job) -> str:
    job_id = job.id
    settings = get_settings()

    heartbeat = Heartbeat(job, settings.heartbeat_seconds)
    heartbeat.start()
    try:
        cap_memory(settings.job_memory_mb)
        result = _train(job)
    except (SystemExit, KeyboardInterrupt):
        _hand_back(job)  # the worker is being stopped: not a crash
        raise
    except RanksLost as exc:  # a rank died: a crash, continued from the last checkpoint as any other
        why = str(exc)
        log.warning("job %s: %s", job_id, why)
        write(lambda session: _requeue_crashed(session, job, why), seconds=settings.db_retry_seconds, what=job_id)
        return "requeued"
    except Exception as exc:
        code, message = classify(exc)
        log.error("job %s failed: %s\n%s", job_id, message, traceback.format_exc())

        def fail(session: Any) -> None:
            lifecycle.move(
                session=session,
                job=job,
                to=JobStatus.FAILED,
                from_=(JobStatus.RUNNING,),
                error={"code": code, "message": message, "param": None},
                event=f"Job failed: {message}",
                level="error",
                held_by=process_name(),
            )

        write(fail, seconds=settings.db_retry_seconds, what=f"{job_id}: failed")
        return "failed"
    finally:
        heartbeat.stopped.set()

    write(lambda session: _finish(session, job, result), seconds=settings.db_retry_seconds, what=f"{job_id}: finished")
    return result.stopped or "succeeded"


def _crashed(session: Any, job: Job, reason: str) -> str | None:
    """A running job whose process died (``reason``): queued again, to continue from its last
    checkpoint, or failed once its workers died ``max_job_crashes`` times. The new status, or None."""
    return lifecycle.recover(
        session=session, job=job, worker=job.worker, reason=reason, max_crashes=get_settings().max_job_crashes
    )


def _requeue_crashed(session: Any, job: Job, why: str) -> None:
    """A job whose rank died: a crash (``_crashed``), its task sent again when it is queued."""
    current = crud.get_job_by_id(session=session, job_id=job.id)
    if current is None or current.status != JobStatus.RUNNING:
        return
    moved = _crashed(session, current, f"A rank of the job died ({why})")
    session.commit()
    if moved == JobStatus.QUEUED:
        from service.infra import task_queue

        task_queue.enqueue_job(current)


def _hand_back(job: Job) -> None:
    """The worker is shutting down (SIGTERM from ``rloo up``'s Ctrl-C, an orchestrator's stop)
    mid-job: give the job back to the queue, to continue from its last checkpoint on the next
    worker, rather than leave it to look like a crash."""
    log.warning("job %s: worker %s is shutting down; handing the job back to the queue", job.id, process_name())
    try:
        with session_scope() as session:
            if lifecycle.move(
                session=session,
                job=job,
                to=JobStatus.QUEUED,
                from_=(JobStatus.RUNNING,),
                held_by=process_name(),
                event="The job's worker is shutting down; the job is queued again and continues "
                "from its last checkpoint",
                level="warn",
                worker=None,
            ):
                from service.infra import task_queue

                task_queue.enqueue_job(job)
            else:
                lifecycle.release(session=session, job=job)  # a pause being saved: resumable
    except Exception as exc:  # the reconciler will see the stale heartbeat instead
        log.warning("could not hand job %s back: %s", job.id, exc)


def _finish(session: Any, job: Job, result: Any) -> None:
    """The job row after training stopped: succeeded, or the stop (cancel, pause) recorded."""
    if result.stopped == "lost":  # queued again while this worker could not reach the database
        log.warning("job %s: another worker holds it now; stopped at step %s, saving nothing", job.id, result.steps)
        return
    if result.stopped is None:
        from service.jobs.results import discard_results, write_results

        artifacts = get_settings().artifacts_dir
        write_results(session=session, job=job, artifacts_dir=artifacts)  # committed with the move
        succeeded = lifecycle.move(
            session=session,
            job=job,
            to=JobStatus.SUCCEEDED,
            # A pause that came with the last step has nothing left to pause: the job is done.
            from_=(JobStatus.RUNNING, JobStatus.PAUSED),
            event=f"The job has successfully completed ({result.steps} steps)",
            held_by=process_name(),
        )
        if not succeeded:  # cancelled as it finished, or another worker's now: its results are not these
            discard_results(session=session, job=job, artifacts_dir=artifacts)
    else:
        lifecycle.add_event(
            session=session, job=job, message=f"Training stopped at step {result.steps}: job {result.stopped}"
        )
        session.commit()
        if result.stopped == JobStatus.PAUSED:
            lifecycle.release(session=session, job=job)  # checkpoint written: it may be resumed
    session.commit()


@app.task(
    name=RUN_GRADER_TASK,
    bind=True,
    Request="worker.jobs.message_guard:WakeUpRequest",
    time_limit=get_settings().grader_run_seconds + 60,
)
def run_grader(self: Any) -> str:
    """A wake-up for one dry run (``service.jobs.dry_runs``): take the next dry run, fairly between
    projects, grade it, push the answer where the API waits. Never raises: errors are answers too."""
    import redis

    from service.infra.task_queue import grader_queue
    from service.jobs import dry_runs
    from worker.jobs.dry_runs import grade

    queue = grader_queue()
    conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=10, socket_connect_timeout=10)
    try:
        envelope = dry_runs.take(conn, queue, self.request.id)
        if envelope is None:
            return "nothing to do"
        try:
            # No outbound call of the grader (an http grader's endpoint) lasts past the dry run's
            # own deadline, when the API stops waiting: the worker is free for the next one then.
            with outbound.within(float(envelope["deadline"]) - time.time()):
                answer = grade(envelope["payload"])
        except Exception as exc:
            log.warning("grader dry run failed: %s", exc)
            answer = {
                "error": f"the grader could not run on the worker: {type(exc).__name__}: {exc}",
                "code": "grader_failed",
                "status": 502,
            }
        if dry_runs.answer(conn, queue, self.request.id, envelope, answer):
            from service.infra.task_queue import wake_grader

            wake_grader(queue, get_settings().grader_run_seconds)  # for one a project's share kept back
        return "error" if "error" in answer else "ok"
    finally:
        conn.close()


def _train(job: Job) -> Any:
    # Imported here: on a GPU host the Celery parent stays free of torch; only the process that trains loads it.
    from worker.jobs.preload import wait_for_preload

    wait_for_preload()
    from worker.engine.methods.rloo import train
    from worker.jobs.job_config import train_config

    settings = get_settings()
    cfg = train_config(job, settings)
    if cfg.gpus > 1:  # its ranks under torch.distributed.run; rank 0 records as this process
        from worker.engine.distributed.launch import run_ranks

        return run_ranks(cfg, timeout_seconds=settings.collective_timeout_seconds, job_id=job.id, holder=process_name())
    return train(cfg, DatabaseRecorder(job))

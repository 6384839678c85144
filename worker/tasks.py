"""Celery tasks. A task carries a job id only, re-reads the row and claims it atomically."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from service import crud
from service.db import retrying, session_scope
from service.models import Job
from service.queue import RUN_GRADER_TASK, RUN_JOB_TASK
from service.settings import get_settings
from worker.celery_app import app
from worker.checkpoints import job_checkpoints_dir, latest_resumable
from worker.records import JobError, json_safe

log = logging.getLogger("rloo.worker")


def worker_name() -> str:
    """``host#pid-namespace:pid`` of this process: the pool process that claims a job (computed when
    called, since pool processes are forked from the worker after this module is imported)."""
    from service.storage import machine_tag

    return f"{machine_tag()}:{os.getpid()}"


def _write(fn: Any, *, seconds: float, what: str) -> Any:
    """``fn(session)`` as one transaction, tried again while the database is unreachable."""

    def attempt() -> Any:
        with session_scope() as session:
            return fn(session)

    return retrying(attempt, seconds=seconds, what=what)


class DatabaseRecorder:
    """Writes a run's metrics, events, progress and checkpoints to the job's rows. Each write is one
    transaction, tried again while the database is unreachable (``RLOO_DB_RETRY_SECONDS``): a
    database restart pauses the run instead of failing it."""

    def __init__(self, job: Job) -> None:
        self.job = job
        settings = get_settings()
        self.artifacts = settings.artifacts_dir
        self.retry_seconds = settings.db_retry_seconds

    def _write(self, what: str, fn: Any) -> Any:
        return _write(fn, seconds=self.retry_seconds, what=f"{self.job.id}: {what}")

    def event(self, message: str, level: str = "info") -> None:
        def write(session: Any) -> None:
            crud.add_event(session=session, job=self.job, message=message, level=level)
            session.commit()

        self._write("event", write)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        clean = json_safe(metrics)

        def write(session: Any) -> str:
            crud.upsert_metrics(session=session, job=self.job, step=step, data=clean)
            crud.add_event(
                session=session,
                job=self.job,
                type="metrics",
                data=clean,
                message=f"Step {step}/{metrics['total_steps']}: reward {metrics['train_reward_mean']:.4f}",
            )
            return crud.record_progress(
                session=session,
                job=self.job,
                step=step,
                trained_tokens=int(metrics.get("trained_tokens", 0)),
                worker=worker_name(),
            )

        status = self._write(f"step {step}", write)
        return None if status == "running" else status

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool) -> None:
        rel = str(path.resolve().relative_to(self.artifacts))
        name = f"{self.job.model}:{self.job.suffix or 'ft'}:{self.job.id}:step-{step}"

        def write(session: Any) -> None:
            crud.add_checkpoint(
                session=session, job=self.job, step=step, path=rel, name=name, metrics=json_safe(metrics)
            )
            # Progress is saved: deaths before this one say nothing about the job any more (a deploy
            # or two during a week-long job must not add up to worker_lost).
            session.query(Job).filter(Job.seq == self.job.seq).update({"crashes": 0})
            crud.add_event(session=session, job=self.job, message=f"Checkpoint saved at step {step}: {name}")
            if final:
                session.query(Job).filter(Job.seq == self.job.seq).update({"fine_tuned_model": name})
            session.commit()

        self._write(f"checkpoint {step}", write)

    def checkpoint_removed(self, step: int) -> None:
        def write(session: Any) -> None:
            crud.remove_checkpoint(session=session, job=self.job, step=step)
            crud.add_event(
                session=session, job=self.job, message=f"Checkpoint of step {step} removed (keep_checkpoints)"
            )
            session.commit()

        self._write(f"checkpoint {step} removed", write)


class Heartbeat(threading.Thread):
    """Touches the job row's heartbeat while a long step runs, so the reconciler sees a live job."""

    def __init__(self, job: Job, period: float) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{job.id}")
        self.job, self.period, self.stopped = job, period, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            try:
                with session_scope() as session:
                    # Paused too: the worker still holds the job while it saves the step's checkpoint.
                    session.query(Job).filter(
                        Job.seq == self.job.seq,
                        Job.status.in_(("running", "paused")),
                        Job.worker == worker_name(),
                    ).update({"heartbeat_at": time.time()})
                    session.commit()
            except Exception as exc:  # a blip in the database must not kill the job
                log.warning("heartbeat for %s failed: %s", self.job.id, exc)


@app.task(name=RUN_JOB_TASK, Request="worker.requests:JobRequest")  # acks_late and the rest: worker.celery_app
def run_job(job_id: str) -> str:
    """Run one job to its end. Safe to deliver twice: only the delivery that claims the row trains."""
    settings = get_settings()
    with session_scope() as session:
        job = crud.claim_job(session=session, job_id=job_id, worker=worker_name())
        if job is None:
            current = crud.get_job_by_id(session=session, job_id=job_id)
            if current is not None and current.status == "running" and _died_here(current.worker):
                # The pool process that ran it was killed (the out-of-memory killer, most often) and
                # Celery handed the task back: no need to wait for the heartbeat to go stale.
                log.warning("job %s: its process %s was killed; Celery handed its task back", job_id, current.worker)
                moved = crud.recover_lost_job(
                    session=session,
                    job=current,
                    worker=current.worker,
                    reason="The worker process running the job was killed",
                    max_crashes=settings.max_job_crashes,
                )
                if moved == "queued":
                    job = crud.claim_job(session=session, job_id=job_id, worker=worker_name())
        if job is None:
            current = crud.get_job_by_id(session=session, job_id=job_id)
            log.info("job %s not claimed (status %s); nothing to do", job_id, current.status if current else "gone")
            return "skipped"
        node = getattr(run_job.request, "hostname", None) or "local"  # the Celery worker (rloo worker)
        # Where it runs is the operator's business (this log); the tenant's event names no host.
        log.info("job %s started on worker %s (process %s)", job_id, node, worker_name())
        crud.add_event(session=session, job=job, message="Job started")
        session.commit()

    heartbeat = Heartbeat(job, settings.heartbeat_seconds)
    heartbeat.start()
    try:
        _cap_memory(settings.job_memory_mb)
        result = _train(job)
    except (SystemExit, KeyboardInterrupt):
        _hand_back(job)  # the worker is being stopped: not a crash
        raise
    except Exception as exc:
        code, message = _classify(exc)
        log.error("job %s failed: %s\n%s", job_id, message, traceback.format_exc())

        def fail(session: Any) -> None:
            crud.set_status(
                session=session,
                job=job,
                to="failed",
                from_=("running",),
                error={"code": code, "message": message, "param": None},
                event=f"Job failed: {message}",
                level="error",
                held_by=worker_name(),
            )

        _write(fail, seconds=settings.db_retry_seconds, what=f"{job_id}: failed")
        return "failed"
    finally:
        heartbeat.stopped.set()

    _write(lambda session: _finish(session, job, result), seconds=settings.db_retry_seconds, what=f"{job_id}: finished")
    return result.stopped or "succeeded"


def _hand_back(job: Job) -> None:
    """The worker is shutting down (SIGTERM from ``rloo up``'s Ctrl-C, an orchestrator's stop)
    mid-job: give the job back to the queue, to continue from its last checkpoint on the next
    worker, rather than leave it to look like a crash."""
    log.warning("job %s: worker %s is shutting down; handing the job back to the queue", job.id, worker_name())
    try:
        with session_scope() as session:
            if crud.set_status(
                session=session,
                job=job,
                to="queued",
                from_=("running",),
                held_by=worker_name(),
                event="The job's worker is shutting down; the job is queued again and continues "
                "from its last checkpoint",
                level="warn",
                worker=None,
            ):
                from service import queue

                queue.enqueue_job(job.id)
            else:
                crud.release_job(session=session, job=job)  # a pause being saved: resumable
    except Exception as exc:  # the reconciler will see the stale heartbeat instead
        log.warning("could not hand job %s back: %s", job.id, exc)


def _died_here(worker: str | None) -> bool:
    """Whether ``worker`` (worker_name() of the process that claimed a job) is a process of this host
    and PID namespace that no longer runs: gone, or a zombie its parent has not reaped yet."""
    from service.storage import process_gone

    host, _, pid = (worker or "").rpartition(":")
    return pid.isdigit() and process_gone(host, int(pid))


def _cap_memory(megabytes: int | None) -> None:
    """RLOO_JOB_MEMORY_MB: bound this job process's data memory (RLIMIT_DATA: the heap and private
    mappings, where tensors live on a CPU), so a job that asks for too much fails with
    ``out_of_memory`` instead of bringing the out-of-memory killer onto the host. The pool process
    serves one job and exits, so the cap ends with the job."""
    if not megabytes:
        return
    import resource

    limit = megabytes * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _finish(session: Any, job: Job, result: Any) -> None:
    """The job row after training stopped: succeeded, or the stop (cancel, pause) recorded."""
    if result.stopped == "lost":  # queued again while this worker could not reach the database
        log.warning("job %s: another worker holds it now; stopped at step %s, saving nothing", job.id, result.steps)
        return
    if result.stopped is None:
        crud.set_status(
            session=session,
            job=job,
            to="succeeded",
            # A pause that came with the last step has nothing left to pause: the job is done.
            from_=("running", "paused"),
            event=f"The job has successfully completed ({result.steps} steps)",
            held_by=worker_name(),
        )
    else:
        crud.add_event(
            session=session, job=job, message=f"Training stopped at step {result.steps}: job {result.stopped}"
        )
        session.commit()
        if result.stopped == "paused":
            crud.release_job(session=session, job=job)  # checkpoint written: it may be resumed
    session.commit()


@app.task(
    name=RUN_GRADER_TASK,
    bind=True,
    Request="worker.requests:WakeUpRequest",
    time_limit=get_settings().grader_run_seconds + 60,
)
def run_grader(self: Any) -> str:
    """A wake-up for one dry run (``service.dryruns``): take the next dry run, fairly between
    projects, grade it, push the answer where the API waits. Never raises: errors are answers too."""
    import redis

    from service import dryruns
    from service.queue import grader_queue
    from worker.dry_run import grade

    queue = grader_queue()
    conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=10, socket_connect_timeout=10)
    try:
        envelope = dryruns.take(conn, queue, self.request.id)
        if envelope is None:
            return "nothing to do"
        try:
            answer = grade(envelope["payload"])
        except Exception as exc:
            log.warning("grader dry run failed: %s", exc)
            answer = {
                "error": f"the grader could not run on the worker: {type(exc).__name__}: {exc}",
                "code": "grader_failed",
                "status": 502,
            }
        dryruns.answer(conn, queue, self.request.id, envelope, answer)
        return "error" if "error" in answer else "ok"
    finally:
        conn.close()


def _train(job: Job) -> Any:
    # Imported here: the Celery parent process stays free of torch; only the process that trains loads it.
    from worker.celery_app import wait_for_preload

    wait_for_preload()
    from worker.config import TrainConfig, worker_extra
    from worker.train import train

    settings = get_settings()
    with session_scope() as session:
        project = job.project_seq
        files = {
            f: crud.get_file_by_id(session=session, project_seq=project, file_id=f)
            for f in (job.training_file, job.validation_file)
            if f
        }
    paths = {}
    for file_id, f in files.items():
        if f is None:
            raise JobError("file_not_found", f"file {file_id} was deleted before the job started")
        paths[file_id] = settings.artifacts_dir / f.path
    kind = job.method["type"]
    output_dir = job_checkpoints_dir(settings.artifacts_dir, job.id)
    cfg = TrainConfig(
        model=job.model,
        training_file=paths[job.training_file],
        validation_file=paths[job.validation_file] if job.validation_file else None,
        grader=job.method[kind]["grader"],
        hyperparameters=job.hyperparameters,
        output_dir=output_dir,
        models_dir=settings.models_dir,
        seed=job.seed,
        job_name=job.id,
        # A job that ran before (a worker crash, or pause then resume) continues from its newest checkpoint.
        resume_from=latest_resumable(output_dir),
        extra=worker_extra(settings),
    )
    return train(cfg, DatabaseRecorder(job))


OUT_OF_MEMORY_HINT = (
    "lower batch_size, rloo_k or max_new_tokens, raise gradient_accumulation_steps, or train a LoRA adapter"
)


def _classify(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, JobError):
        return exc.code, exc.message
    name = type(exc).__name__
    text = str(exc)
    # torch.OutOfMemoryError (CUDA and other accelerators), MemoryError (Python), and the CPU
    # allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate …").
    if (
        "OutOfMemory" in name
        or isinstance(exc, MemoryError)
        or (isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))
    ):
        first = text.strip().splitlines()[0][:300] if text.strip() else name
        return "out_of_memory", f"The job ran out of memory ({name}: {first}); {OUT_OF_MEMORY_HINT}."
    return "internal_error", f"{name}: {exc}"

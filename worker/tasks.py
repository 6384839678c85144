"""Celery tasks. A task carries a job id only, re-reads the row and claims it atomically."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from service import crud
from service.db import session_scope
from service.models import Job
from service.queue import RUN_GRADER_TASK, RUN_JOB_TASK
from service.settings import get_settings
from worker.celery_app import app
from worker.checkpoints import job_checkpoints_dir, latest_resumable
from worker.records import JobError, json_safe

log = logging.getLogger("rloo.worker")

WORKER_NAME = f"{socket.gethostname()}:{os.getpid()}"


class DatabaseRecorder:
    """Writes a run's metrics, events, progress and checkpoints to the job's rows."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.artifacts = get_settings().artifacts_dir

    def event(self, message: str, level: str = "info") -> None:
        with session_scope() as session:
            crud.add_event(session=session, job=self.job, message=message, level=level)
            session.commit()

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        clean = json_safe(metrics)
        with session_scope() as session:
            crud.upsert_metrics(session=session, job=self.job, step=step, data=clean)
            crud.add_event(
                session=session,
                job=self.job,
                type="metrics",
                data=clean,
                message=f"Step {step}/{metrics['total_steps']}: reward {metrics['train_reward_mean']:.4f}",
            )
            status = crud.record_progress(
                session=session, job=self.job, step=step, trained_tokens=int(metrics.get("trained_tokens", 0))
            )
        return None if status == "running" else status

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool) -> None:
        rel = str(path.resolve().relative_to(self.artifacts))
        name = f"{self.job.model}:{self.job.suffix or 'ft'}:{self.job.id}:step-{step}"
        with session_scope() as session:
            crud.add_checkpoint(
                session=session, job=self.job, step=step, path=rel, name=name, metrics=json_safe(metrics)
            )
            crud.add_event(session=session, job=self.job, message=f"Checkpoint saved at step {step}: {name}")
            if final:
                session.query(Job).filter(Job.seq == self.job.seq).update({"fine_tuned_model": name})
            session.commit()

    def checkpoint_removed(self, step: int) -> None:
        with session_scope() as session:
            crud.remove_checkpoint(session=session, job=self.job, step=step)
            crud.add_event(
                session=session, job=self.job, message=f"Checkpoint of step {step} removed (keep_checkpoints)"
            )
            session.commit()


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
                        Job.seq == self.job.seq, Job.status.in_(("running", "paused")), Job.worker == WORKER_NAME
                    ).update({"heartbeat_at": time.time()})
                    session.commit()
            except Exception as exc:  # a blip in the database must not kill the job
                log.warning("heartbeat for %s failed: %s", self.job.id, exc)


@app.task(name=RUN_JOB_TASK)  # acks_late and the rest: worker.celery_app
def run_job(job_id: str) -> str:
    """Run one job to its end. Safe to deliver twice: only the delivery that claims the row trains."""
    with session_scope() as session:
        job = crud.claim_job(session=session, job_id=job_id, worker=WORKER_NAME)
        if job is None:
            current = crud.get_job_by_id(session=session, job_id=job_id)
            log.info("job %s not claimed (status %s); nothing to do", job_id, current.status if current else "gone")
            return "skipped"
        crud.add_event(session=session, job=job, message=f"Job started on worker {WORKER_NAME}")
        session.commit()

    heartbeat = Heartbeat(job, get_settings().heartbeat_seconds)
    heartbeat.start()
    try:
        result = _train(job)
    except Exception as exc:
        code, message = _classify(exc)
        log.error("job %s failed: %s\n%s", job_id, message, traceback.format_exc())
        with session_scope() as session:
            crud.set_status(
                session=session,
                job=job,
                to="failed",
                from_=("running",),
                error={"code": code, "message": message, "param": None},
                event=f"Job failed: {message}",
                level="error",
            )
        return "failed"
    finally:
        heartbeat.stopped.set()

    with session_scope() as session:
        if result.stopped is None:
            crud.set_status(
                session=session,
                job=job,
                to="succeeded",
                # A pause that came with the last step has nothing left to pause: the job is done.
                from_=("running", "paused"),
                event=f"The job has successfully completed ({result.steps} steps)",
            )
        else:
            crud.add_event(
                session=session, job=job, message=f"Training stopped at step {result.steps}: job {result.stopped}"
            )
            session.commit()
            if result.stopped == "paused":
                crud.release_job(session=session, job=job)  # checkpoint written: it may be resumed
        session.commit()
    return result.stopped or "succeeded"


@app.task(name=RUN_GRADER_TASK)
def run_grader(payload: dict[str, Any], reply: str) -> str:
    """A model grader's dry run (``POST /graders/run``): score one sample, push the answer to the
    Redis list ``reply``, where the API waits for it. Never raises: errors are answers too."""
    import json

    import redis

    try:
        answer = _grade_one(payload)
    except Exception as exc:
        log.warning("grader dry run failed: %s", exc)
        answer = {"error": f"the grader could not run on the worker: {type(exc).__name__}: {exc}",
                  "code": "grader_failed", "status": 502}
    conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=10, socket_connect_timeout=10)
    try:
        conn.rpush(reply, json.dumps(answer))
        conn.expire(reply, 300)  # nobody waits past the API's time-out; the key must not linger
    finally:
        conn.close()
    return "error" if "error" in answer else "ok"


def _grade_one(payload: dict[str, Any]) -> dict[str, Any]:
    import math

    from worker.celery_app import wait_for_preload

    wait_for_preload()
    from service import graders
    from worker.rewards import RewardModels, score_batch
    from worker.train import pick_device

    settings = get_settings()
    try:
        grader = graders.parse_grader(payload["grader"], allow_python=settings.allow_python_grader)
    except graders.GraderError as exc:
        return {"error": exc.message, "code": "invalid_grader", "status": 400}
    models = RewardModels(models_dir=settings.models_dir, device=pick_device(None),
                          embedding_model=settings.embedding_model)
    try:
        result = score_batch(grader, prompts=[""], texts=[payload["model_sample"]], items=[payload["item"]],
                             reward_models=models)
    except OSError as exc:  # a model that will not load (transformers says which and why)
        return {"error": f"{type(exc).__name__}: {exc}", "code": "model_load_failed", "status": 400}
    except graders.GraderUnavailable as exc:
        return {"error": str(exc), "code": "grader_unavailable", "status": 502}

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    return {
        "reward": finite(result.rewards[0]),
        "sub_rewards": {name: finite(column[0]) for name, column in result.sub_rewards.items()},
        "errors": result.errors,
        "messages": result.messages,
    }


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


def _classify(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, JobError):
        return exc.code, exc.message
    name = type(exc).__name__
    if "OutOfMemory" in name or isinstance(exc, MemoryError):
        return "out_of_memory", f"the job ran out of memory ({name}); lower batch_size, rloo_k or max_new_tokens"
    return "internal_error", f"{name}: {exc}"

"""Where a job's run writes what it reports: its rows (``DatabaseRecorder``), and a heartbeat while
a long step runs. Each write is one transaction, tried again while the database is unreachable
(``RLOO_DB_RETRY_SECONDS``): a database restart pauses the run instead of failing it."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from service.core import crud
from service.core.db import retrying, session_scope
from service.core.identity import process_name
from service.core.settings import get_settings
from service.core.tables import Job
from service.infra.artifacts import open_store, tree_bytes
from service.infra.task_queue import asked
from service.jobs import lifecycle, webhooks
from service.registry import export_dirs, finetuned, model_ids
from service.tenancy import quotas, usage
from worker.engine.checkpoints import checkpoint_key, job_checkpoints_dir, publish_checkpoint, unpublish_checkpoint
from worker.engine.recorders import json_safe, step_message
from worker.jobs.devices import ACCELERATOR_VARIABLE

log = logging.getLogger("rloo.worker")


def write(fn: Any, *, seconds: float, what: str) -> Any:
    """``fn(session)`` as one transaction, tried again while the database is unreachable."""

    def attempt() -> Any:
        with session_scope() as session:
            return fn(session)

    return retrying(attempt, seconds=seconds, what=what)


class DatabaseRecorder:
    """Writes a run's metrics, events, progress and checkpoints to the job's rows."""

    def __init__(self, job: Job, *, holder: str | None = None) -> None:
        self.job = job
        self.holder = holder or process_name()
        """The worker process that claimed the job: a job's rank 0 writes as the task that started it."""
        settings = get_settings()
        self.artifacts = settings.artifacts_dir
        self.store = open_store(settings)
        self.retry_seconds = settings.db_retry_seconds
        self.model_id: str | None = None
        self.meter = Meter(job)

    def _write(self, what: str, fn: Any) -> Any:
        return write(fn, seconds=self.retry_seconds, what=f"{self.job.id}: {what}")

    def event(self, message: str, level: str = "info") -> None:
        def event(session: Any) -> None:
            lifecycle.add_event(session=session, job=self.job, message=message, level=level)
            session.commit()

        self._write("event", event)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        """The step's metrics; None to go on, else why to stop (``cancelled``, ``paused``, ``lost``)."""
        clean = json_safe(metrics)

        used = self.meter.step(metrics)

        def record(session: Any) -> str:
            self.meter.write(session, used)
            crud.upsert_metrics(session=session, job=self.job, step=step, data=clean)
            lifecycle.add_event(
                session=session,
                job=self.job,
                type="metrics",
                data=clean,
                message=step_message(step, metrics),
            )
            return lifecycle.record_progress(
                session=session,
                job=self.job,
                step=step,
                trained_tokens=int(metrics.get("trained_tokens", 0)),
                worker=self.holder,
            )

        status = self._write(f"step {step}", record)
        if status == lifecycle.JobStatus.RUNNING and self.meter.budget_due():
            status = self._write(f"step {step}: budget", self._pause_over_budget)
        return None if status == lifecycle.JobStatus.RUNNING else status

    def _pause_over_budget(self, session: Any) -> str:
        """Pause the job (an event, the paused webhook) once it reached its device-hour budget or its
        project's day; it saves a checkpoint as for any pause, and a resume goes on from it."""
        why = quotas.over_budget(session, self.job)
        session.rollback()
        if why is None:
            return str(lifecycle.JobStatus.RUNNING)
        moved = lifecycle.move(
            session=session,
            job=self.job,
            to=lifecycle.JobStatus.PAUSED,
            from_=(lifecycle.JobStatus.RUNNING,),
            event=why,
        )
        return str(lifecycle.JobStatus.PAUSED) if moved else str(self.job.status)

    def _model_id(self, session: Any) -> str:
        """The job's fine-tuned model id (``service.registry.finetuned``), read once."""
        if self.model_id is None:
            job = self.job
            project = finetuned.project_name(session=session, project_seq=job.project_seq)
            base = job.base_model or job.model
            self.model_id = model_ids.model_id(base=base, project=project, suffix=job.suffix, job_id=job.id)
        return self.model_id

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool, written: bool = True) -> None:
        """The saved checkpoint's row, once it is whole in the artifacts store (``publish_checkpoint``).
        ``written`` False: saved and published before (a run resumed at its last step names it the final
        one): its row is written if it has none, else left as it is, with its merged export."""
        rel = publish_checkpoint(self.store, path) if written else checkpoint_key(self.store, path)
        size = tree_bytes(path)  # what the project stores

        replayed = False

        def saved(session: Any) -> None:
            nonlocal replayed
            model = self._model_id(session)
            known = crud.checkpoint_at(session=session, job=self.job, step=step) is not None
            if written or not known:
                name = model_ids.checkpoint_id(model, step)
                crud.add_checkpoint(
                    session=session, job=self.job, step=step, path=rel, name=name, metrics=json_safe(metrics), size=size
                )
                lifecycle.add_event(session=session, job=self.job, message=f"Checkpoint saved at step {step}: {name}")
                webhooks.enqueue(
                    session, self.job, "fine_tuning.job.checkpoint.created", checkpoint=name, step_number=step
                )
            replayed = known and written  # the row of a step saved before: its weights rewritten
            lifecycle.checkpoint_saved(session=session, job=self.job, final_name=model if final else None)
            session.commit()

        self._write(f"checkpoint {step}", saved)
        if replayed:  # the merged model of the step's earlier save: made again from this one if asked for
            self._remove_export(step)

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        def record(session: Any) -> None:
            crud.upsert_samples(session=session, job=self.job, step=step, groups=groups)
            session.commit()

        self._write(f"samples {step}", record)

    def checkpoint_removed(self, step: int) -> None:
        def removed(session: Any) -> None:
            crud.remove_checkpoint(session=session, job=self.job, step=step)
            lifecycle.add_event(
                session=session, job=self.job, message=f"Checkpoint of step {step} removed (keep_checkpoints)"
            )
            session.commit()

        self._write(f"checkpoint {step} removed", removed)
        unpublish_checkpoint(self.store, job_checkpoints_dir(self.artifacts, self.job.id), step)
        self._remove_export(step)

    def _remove_export(self, step: int) -> None:
        """The merged model of the checkpoint of ``step``, should a download have made one."""
        try:
            export_dirs.remove_export(self.store, self.artifacts, export_dirs.export_key(self.job.id, step))
        except Exception:  # the store away: training goes on; the copy outlives its checkpoint
            log.exception("the merged model of step %d was not removed", step)


class Meter:
    """What a job uses between its steps (``service.tenancy.usage``): the devices it holds times the
    wall time since its last step (or its start), the tokens it trained, the tokens it sampled, the
    tokens its reward models and judges read."""

    def __init__(self, job: Job) -> None:
        self.job, self.last, self.checked = job, time.monotonic(), float("-inf")
        self.devices = asked(job.resources)[0]
        self.accelerator = os.environ.get(ACCELERATOR_VARIABLE) or str((job.resources or {}).get("accelerator") or "")
        self.trained = int(job.trained_tokens or 0)
        hp = job.hyperparameters or {}
        reinforcement = (job.method or {}).get("type") == "reinforcement"
        self.completions = int(hp.get("batch_size") or 0) * int(hp.get("rloo_k") or 1) if reinforcement else 0

    BUDGET_EVERY = 10.0
    """Seconds between checks of the job's budget and its project's day (a job overshoots by at most this)."""

    def budget_due(self) -> bool:
        now = time.monotonic()
        if now - self.checked < self.BUDGET_EVERY:
            return False
        self.checked = now
        return True

    def step(self, metrics: dict[str, Any]) -> dict[str, float]:
        now = time.monotonic()
        used = {"device_seconds": (now - self.last) * self.devices}
        self.last = now
        trained = int(metrics.get("trained_tokens", 0) or 0)
        used["tokens_trained"] = max(0, trained - self.trained)  # a replayed step trains again: counted again
        self.trained = trained
        if self.completions and isinstance(metrics.get("completion_length_mean"), (int, float)):
            used["tokens_sampled"] = float(metrics["completion_length_mean"]) * self.completions
        for kind in ("reward_model_tokens", "judge_tokens"):  # worker.engine.loop.scoring_tokens
            if isinstance(metrics.get(kind), (int, float)):
                used[kind] = float(metrics[kind])
        return used

    def write(self, session: Any, used: dict[str, float]) -> None:
        for kind, amount in used.items():
            accelerator = self.accelerator if kind == "device_seconds" else ""
            usage.add(
                session, project_seq=self.job.project_seq, subject=self.job.id, kind=kind, amount=amount,
                accelerator=accelerator,
            )  # fmt: skip


class Heartbeat(threading.Thread):
    """Touches the job row's heartbeat while a long step runs, so the reconciler sees a live job."""

    def __init__(self, job: Job, period: float) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{job.id}")
        self.job, self.period, self.stopped = job, period, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            try:
                with session_scope() as session:
                    lifecycle.heartbeat(session=session, job=self.job, worker=process_name())
            except Exception as exc:  # a blip in the database must not kill the job
                log.warning("heartbeat for %s failed: %s", self.job.id, exc)

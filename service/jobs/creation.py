"""Creating a fine-tuning job, the orchestration ``POST /v1/fine_tuning/jobs`` runs: an idempotent
replay, the spec's checks (``service.jobs.spec``), the base model, the memory plan, the files fit
for the method and grader, the project's room in the queue, then the row, its first events and the
remembered answer in one transaction, and the task sent after the commit (the row exists before
the task does: a worker always finds it). No HTTP here: the route presents the job."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import graders
from service.core import crud
from service.core.crud import Caller
from service.core.db import write_lock
from service.core.errors import LimitReached, bad_request, model_not_found
from service.core.settings import Settings
from service.core.tables import File, Job
from service.infra import task_queue
from service.jobs import idempotency, lifecycle, spec
from service.jobs.hyperparameters import AnyResolved, RLConfig
from service.jobs.lifecycle import JobStatus
from service.jobs.spec import JobCreate, Resources
from service.registry import finetuned, memory_plan, model_ids
from service.tenancy import quotas
from service.tools import MultiTurn

ROUTE = "jobs"
"""The idempotency keys' scope."""


@dataclass
class Created:
    """A new job, or the stored answer of the request its idempotency key first came with."""

    job: Job | None
    replayed: Any = None


def create_job(
    session: Session,
    project: Caller,
    settings: Settings,
    body: JobCreate,
    *,
    key: str | None,
    present: Callable[[Job], dict[str, Any]],
) -> Created:
    """Check ``body``, store the job and send its task; ``present`` is the answer remembered with
    ``key`` (the job as the API shows it)."""
    digest = idempotency.request_hash(body.model_dump(mode="json"))
    if key is not None and (
        stored := idempotency.replay(session, project_seq=project.seq, route=ROUTE, key=key, digest=digest)
    ):
        return Created(None, stored)
    grader, hp = spec.check_spec(body, settings=settings)
    base_model = base_model_of(session, project, settings, body)
    check_memory(settings, base_model, hp, body)
    training, validation = _checked_files(session, project, body, grader)
    hp_param = f"method.{body.method_.type}.hyperparameters"
    total_steps = hp.total_steps(training.line_count)
    spec.check_kept_checkpoints(hp, total_steps, cap=settings.max_kept_checkpoints, param=hp_param)
    job = _job_row(project, body, grader, hp, base_model, training, validation, total_steps)
    notes = [
        *spec.model_notes(settings, base_model),
        *spec.batch_notes(hp, training.line_count, source=f"the training file ({training.id})"),
        *spec.notes(hp),
    ]
    with write_lock(session):
        check_room(session, project, settings.max_queued_jobs)
        _lock_files(session, project, training, validation)
        session.add(job)
        session.flush()
        _first_events(session, job, training, notes)
        if key is not None:  # the answer, in the same transaction as the job
            idempotency.remember(
                session, project_seq=project.seq, route=ROUTE, key=key, digest=digest, response=present(job)
            )
        try:
            session.commit()  # the row exists before the task does: a worker always finds it
        except IntegrityError:  # the same key's request committed first: its answer
            return Created(
                None,
                idempotency.replay_after_conflict(
                    session, project_seq=project.seq, route=ROUTE, key=key, digest=digest
                ),
            )
    send_task(session, job)
    return Created(job)


def send_task(session: Session, job: Job) -> None:
    """Send a committed job's task (created or resumed); a queue that does not answer leaves a
    warning on the job, and the reconciler sends the task when the queue is back."""
    if not task_queue.enqueue_job(job):
        lifecycle.add_event(
            session=session,
            job=job,
            level="warn",
            message="The queue is unreachable; the job will be queued when it is back.",
        )
        session.commit()


def _job_row(
    project: Caller,
    body: JobCreate,
    grader: graders.Grader | None,
    hp: AnyResolved,
    base_model: str,
    training: File,
    validation: File | None,
    total_steps: int,
) -> Job:
    kind = body.method_.type
    stored_hp = hp.model_dump()
    config: dict[str, Any] = {"hyperparameters": stored_hp}
    if grader is not None:
        config = {"grader": graders.grader_to_dict(grader), **config}
    rl = body.method_.config
    if isinstance(rl, RLConfig) and rl.tools:  # as given (a worker parses them again), limits resolved
        config["tools"] = rl.tools
        config["multi_turn"] = (rl.multi_turn or MultiTurn()).model_dump()
    resources = body.resources.model_dump() if body.resources else None
    return Job(
        project_seq=project.seq,
        model=body.model,
        base_model=base_model,
        training_file=training.id,
        validation_file=validation.id if validation else None,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        suffix=body.suffix,
        metadata_=body.metadata,
        integrations=[i.model_dump() for i in body.integrations] if body.integrations else None,
        resources=resources,
        budget=quotas.checked_budget(body.budget.model_dump(exclude_none=True)) if body.budget else None,
        lane=task_queue.lane(resources),
        method={"type": kind, kind: config},
        hyperparameters=stored_hp,
        status=JobStatus.QUEUED.value,
        total_steps=total_steps,
    )


def _lock_files(session: Session, project: Caller, training: File, validation: File | None) -> None:
    """The job's files, locked until the commit: one deleted meanwhile is a 400 that says so."""
    wanted = {**({validation.id: "validation_file"} if validation else {}), training.id: "training_file"}
    gone = sorted(set(wanted) - crud.lock_files(session=session, project_seq=project.seq, file_ids=list(wanted)))
    if gone:
        session.rollback()
        raise bad_request(
            f"File '{gone[0]}' was deleted while the job was being created; upload it again.",
            wanted[gone[0]],
            "file_not_found",
        )


def _first_events(session: Session, job: Job, training: File, notes: list[str]) -> None:
    lifecycle.add_event(session=session, job=job, message=f"Created fine-tuning job: {job.id}")
    lifecycle.add_event(
        session=session,
        job=job,
        message=f"Validated training file: {training.id} ({training.line_count} lines, {job.total_steps} steps)",
    )
    for note in notes:
        lifecycle.add_event(session=session, job=job, message=note)


def fine_tune_file(session: Session, project: Caller, file_id: str, param: str) -> File:
    """The project's file ``file_id``, uploaded for fine-tuning, or a 400 naming ``param``."""
    f = crud.get_file(session=session, project=project, file_id=file_id)
    if f is None:
        raise bad_request(
            f"No file with id '{file_id}' in this project; upload it with POST /v1/files.", param, "file_not_found"
        )
    if f.purpose != "fine-tune":
        raise bad_request(
            f"File '{file_id}' has purpose '{f.purpose}'; a job trains on a file uploaded with purpose 'fine-tune'.",
            param,
            "invalid_file_purpose",
        )
    return f


def _checked_files(
    session: Session, project: Caller, body: JobCreate, grader: graders.Grader | None
) -> tuple[File, File | None]:
    """The job's training and validation files, each of the project and fit for its method (and its
    grader's item keys), or a 400 naming the file."""
    method = body.method_
    training = fine_tune_file(session, project, body.training_file, "training_file")
    validation = (
        fine_tune_file(session, project, body.validation_file, "validation_file") if body.validation_file else None
    )
    for f, which in ((training, "training_file"), (validation, "validation_file")):
        if f is None:
            continue
        source = f"the {which.replace('_', ' ')} ({f.id})"
        spec.check_format(method.family, f.keys_summary or {}, source=source, param=which)
        if grader is not None:
            spec.check_item_keys(grader, f.keys_summary or {}, source=source, param=f"method.{method.type}.grader")
    return training, validation


def base_model_of(session: Session, project: Caller, settings: Settings, body: JobCreate) -> str:
    """The base model directory of a new job: its ``model``, or the base of the fine-tuned model or
    checkpoint of this project it names (another project's: 404, as at OpenAI), checked as
    ``spec.check_spec`` checks a base model named directly (context, LoRA's target modules)."""
    if not model_ids.is_fine_tuned(body.model):
        return body.model
    source = finetuned.find(session=session, project_seq=project.seq, name=body.model)
    if source is None:
        raise model_not_found(body.model)
    base = settings.models_dir / source.base_model
    spec.check_context(body, base)
    if base.is_dir():
        hp = body.method_.config.hyperparameters.resolved()
        spec.check_lora_targets(hp, base, f"method.{body.method_.type}.hyperparameters")
    return source.base_model


def plan_of(settings: Settings, base_model: str, hp: Any, body: JobCreate) -> dict[str, Any]:
    """The job's memory plan on the devices it asks for (``resources``)."""
    resources = body.resources or Resources()
    return memory_plan.for_job(
        settings.models_dir,
        base_model,
        hp,
        method=body.method_.type,
        accelerators=settings.accelerators,
        devices=resources.gpus,
        accelerator=resources.accelerator,
    )


def check_memory(settings: Settings, base_model: str, hp: Any, body: JobCreate) -> None:
    """A job whose memory plan fits no accelerator kind the operator declared (RLOO_ACCELERATORS) is
    a 400 now, not a failure hours later (``service.registry.memory_plan``). A model whose shape its files do
    not say (a hub id) is not checked."""
    if not settings.accelerators:
        return
    kind = body.method_.type
    try:
        estimate = plan_of(settings, base_model, hp, body)
    except memory_plan.UnknownShape:
        return
    if any(estimate["fits"].values()):
        return
    need = estimate["bytes_per_device"] / 2**30
    considered = {kind: settings.accelerators[kind] for kind in estimate["fits"]}
    largest = max(considered.items(), key=lambda kv: kv[1])
    raise bad_request(
        f"This job needs about {need:.1f} GiB a device on {estimate['devices']} device(s) (POST "
        f"/v1/fine_tuning/jobs/estimate shows the parts); the largest accelerator it may run on is {largest[0]} "
        f"with {largest[1]:g} GiB, {memory_plan.HEADROOM:.0%} of it usable. "
        f"To fit: {memory_plan.what_to_change(hp, estimate['bytes'])}.",
        f"method.{kind}.hyperparameters",
        "insufficient_memory",
    )


def check_room(session: Session, project: Caller, cap: int) -> None:
    """The project may queue one more job (its quota of ``queued_jobs``, else ``RLOO_MAX_QUEUED_JOBS``),
    its row locked meanwhile, and has device-hours left today (``device_hours_per_day``, read first:
    the lock is held for no longer than the count)."""
    limits = quotas.quotas_of(session, project.seq)
    quotas.check_device_hours(session, project.seq, limits)
    quota = limits.get("queued_jobs")
    limit = int(quota) if quota is not None else cap
    waiting = lifecycle.waiting_jobs(session=session, project_seq=project.seq, up_to=limit)
    if waiting >= limit:
        session.rollback()
        which = f"its quota of queued_jobs ({limit})" if quota is not None else f"RLOO_MAX_QUEUED_JOBS={limit}"
        raise LimitReached(
            f"This project has {waiting} jobs waiting for a worker, the most it may have ({which}); create or "
            "resume this one when one of them has started, or cancel one.",
            code="too_many_queued_jobs",
            retry_after=10,
        )

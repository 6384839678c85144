"""Fine-tuning jobs: create (validated in full before a row exists), list, read, cancel, and
their events, metrics and checkpoints."""

from __future__ import annotations

import math
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import String, cast, select

from service import graders, tools
from service.api import streams
from service.api.deps import PagingDep, ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON, STREAMED, page, replayed
from service.api.routing import StrictJSONRoute
from service.api.tarstream import TarLayout, tar_response
from service.core import crud
from service.core.crud import Caller
from service.core.db import ends_session, run_db, write_lock
from service.core.errors import bad_request, not_found
from service.core.tables import Checkpoint, Job, JobEvent
from service.infra.artifacts import S3Store, open_store
from service.jobs import creation, idempotency, lifecycle, spec
from service.jobs.lifecycle import JobStatus
from service.jobs.spec import JobCreate
from service.registry import exports, memory_plan

router = APIRouter(prefix="/v1/fine_tuning/jobs", route_class=StrictJSONRoute, tags=["fine-tuning"])

TRAINING_STATE_PREFIX = "training_state"


def job_object(job: Job, project: Caller) -> dict[str, Any]:
    estimated = None
    if job.status == JobStatus.RUNNING and job.started_at and job.step:
        elapsed = time.time() - job.started_at
        estimated = int(job.started_at + elapsed * job.total_steps / job.step)
    return {
        "id": job.id,
        "object": "fine_tuning.job",
        "created_at": job.created_at,
        "status": job.status,
        "model": job.model,
        "training_file": job.training_file,
        "validation_file": job.validation_file,
        "hyperparameters": job.hyperparameters,
        "method": method_answer(job.method),
        "seed": job.seed,
        "suffix": job.suffix,
        "metadata": job.metadata_,
        "organization_id": project.id,
        "result_files": job.result_files or [],
        "trained_tokens": job.trained_tokens,
        "fine_tuned_model": job.fine_tuned_model,
        "finished_at": job.finished_at,
        "estimated_finish": estimated,
        "error": job.error,
        "integrations": job.integrations or [],
        "resources": resources_answer(job.resources),
        "budget": job.budget,
        "progress": {"step": job.step, "total_steps": job.total_steps},
    }


def resources_answer(stored: dict[str, Any] | None) -> dict[str, Any]:
    """A job's ``resources`` as answered: as asked, or one device of any kind."""
    return {"gpus": 1, "accelerator": None, **(stored or {})}


def method_answer(method: dict[str, Any]) -> dict[str, Any]:
    """A job's ``method`` as answered: as stored, but a reinforcement config whose grader OpenAI's
    types cannot hold (``reward_model``, ``http``, ``label_model`` outside a ``multi``, a ``multi``
    of several graders) sits under our ``rloo`` key, ``type`` still ``reinforcement``: the SDK's
    strict parsing of the job holds, and nothing is lost (``job.method.rloo``)."""
    kind = str(method.get("type"))
    config = method.get(kind)
    if isinstance(config, dict) and config.get("tools"):  # an http tool's secret is never answered
        method = {**method, kind: {**config, "tools": tools.redacted(config["tools"])}}
    if method.get("type") == "reinforcement" and not graders.openai_typed(method["reinforcement"].get("grader")):
        return {"type": "reinforcement", "rloo": method["reinforcement"]}
    return method


@router.post("/estimate", summary="A job's memory plan: bytes a device, step FLOPs, which accelerators hold it")
@ends_session
def estimate_job(session: SessionDep, project: ProjectDep, settings: SettingsDep, body: JobCreate) -> JSON:
    """The same body as a job's creation, checked the same way (no file is read): what the job would
    hold a device (``service.registry.memory_plan``), nothing created."""
    _, hp = spec.check_spec(body, settings=settings)
    base_model = creation.base_model_of(session, project, settings, body)
    try:
        return JSON(creation.plan_of(settings, base_model, hp, body))
    except memory_plan.UnknownShape as exc:
        raise bad_request(f"The memory of a job on '{base_model}' cannot be planned: {exc}.", "model") from None


@router.post("", summary="Create a fine-tuning job")
@ends_session
def create_job(
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    body: JobCreate,
    idempotency_key: Annotated[str | None, Header(alias=idempotency.HEADER)] = None,
) -> JSON:
    # The checks, the row and the task: service.jobs.creation.
    key = idempotency.check_key(idempotency_key)
    created = creation.create_job(
        session, project, settings, body, key=key, present=lambda job: job_object(job, project)
    )
    if created.job is None:
        return replayed(created.replayed)
    return JSON(job_object(created.job, project))


@router.get("", summary="List fine-tuning jobs")
async def list_jobs(request: Request, session: SessionDep, project: ProjectDep, paging: PagingDep) -> JSON:
    """OpenAI's ``metadata[k]=v`` filters (all must match), or ``metadata=null`` for jobs without any."""
    scope = [Job.project_seq == project.seq, *_metadata_filter(request)]
    rows, has_more = await run_db(session, paging.apply, session, Job, scope)
    return page([job_object(j, project) for j in rows], has_more)


def _metadata_filter(request: Request) -> list[Any]:
    conditions: list[Any] = []
    for name, value in request.query_params.multi_items():
        if name == "metadata":
            if value != "null":
                raise bad_request("Filter with metadata[key]=value, or metadata=null for jobs without metadata.", name)
            # None is stored as JSON's null (SQLAlchemy's JSON type), or SQL NULL on older rows.
            conditions.append(Job.metadata_.is_(None) | (cast(Job.metadata_, String) == "null"))
        elif name.startswith("metadata[") and name.endswith("]"):
            key = name[len("metadata[") : -1]
            if not key or len(key) > 64:
                raise bad_request("A metadata filter's key is 1 to 64 characters: metadata[key]=value.", name)
            conditions.append(Job.metadata_[key].as_string() == value)
    return conditions


def _job(session: SessionDep, project: Caller, job_id: str, param: str | None = None) -> Job:
    job = crud.get_job(session=session, project=project, job_id=job_id)
    if job is None:
        raise not_found("fine-tuning job", job_id, param)
    return job


@router.get("/{job_id}", summary="Retrieve a fine-tuning job")
async def read_job(session: SessionDep, project: ProjectDep, job_id: str) -> JSON:
    return JSON(job_object(await run_db(session, _job, session, project, job_id), project))


@router.post("/{job_id}/cancel", summary="Cancel a fine-tuning job")
@ends_session
def cancel_job(session: SessionDep, project: ProjectDep, job_id: str) -> JSON:
    job = _job(session, project, job_id)
    was = job.status
    note = " The worker stops after the current step; checkpoints are kept." if was == JobStatus.RUNNING else ""
    if not lifecycle.move(
        session=session,
        job=job,
        to=JobStatus.CANCELLED,
        from_=lifecycle.UNFINISHED,
        event=f"Job cancelled (was {was}).{note}",
    ):
        raise APIError(
            409,
            f"Job {job_id} is {job.status}; only a job that has not finished can be cancelled.",
            code="invalid_state",
        )
    return JSON(job_object(job, project))


@router.post("/{job_id}/pause", summary="Pause a running fine-tuning job")
@ends_session
def pause_job(session: SessionDep, project: ProjectDep, job_id: str) -> JSON:
    """running -> paused: the worker stops after its current step and saves a checkpoint."""
    job = _job(session, project, job_id)
    if not lifecycle.move(
        session=session,
        job=job,
        to=JobStatus.PAUSED,
        from_=(JobStatus.RUNNING,),
        event="Job paused: the worker stops after the current step and saves a checkpoint",
    ):
        raise APIError(409, f"Job {job_id} is {job.status}; only a running job can be paused.", code="invalid_state")
    return JSON(job_object(job, project))


@router.post("/{job_id}/resume", summary="Resume a paused fine-tuning job")
@ends_session
def resume_job(session: SessionDep, project: ProjectDep, settings: SettingsDep, job_id: str) -> JSON:
    """paused -> queued: a worker continues from the job's last checkpoint. A resumed job waits for a
    worker as a new one does, so it counts against the project's RLOO_MAX_QUEUED_JOBS (429 past it)."""
    job = _job(session, project, job_id)
    with write_lock(session):
        if job.status == JobStatus.PAUSED:
            creation.check_room(session, project, settings.max_queued_jobs)
        resumed = lifecycle.resume(session=session, job=job, stale_after=settings.stale_after)
    if not resumed:
        if job.status == JobStatus.PAUSED:
            raise APIError(
                409,
                f"Job {job_id} is pausing: its worker is still finishing the current step and saving a "
                "checkpoint. Resume it in a moment.",
                code="invalid_state",
            )
        raise APIError(409, f"Job {job_id} is {job.status}; only a paused job can be resumed.", code="invalid_state")
    creation.send_task(session, job)
    return JSON(job_object(job, project))


MAX_STEP = 2**31 - 1
STREAM_DOC = (
    "With `stream=true`: `text/event-stream`, each row as `id: <cursor>` and `data: <its JSON>`, oldest "
    "first, from after `Last-Event-ID` (or `after`), live, then `data: [DONE]` once the job is final."
)
StreamQuery = Annotated[bool, Query(description="Answer a live text/event-stream instead of a page.")]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)]


@router.get("/{job_id}/events", summary="List a job's events, newest first", description=STREAM_DOC, responses=STREAMED)
async def list_events(
    request: Request,
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    paging: PagingDep,
    job_id: str,
    stream: StreamQuery = False,
    last_event_id: LastEventId = None,
) -> Response:
    if stream:

        def cursor() -> tuple[Job, int]:
            job = _job(session, project, job_id)
            return job, _event_cursor(session, job, last_event_id or paging.after)

        job, after = await run_db(session, cursor)
        return await _stream(request, project, settings, job, streams.event_reader(job.seq, after))

    def read() -> tuple[list[JobEvent], bool]:
        job = _job(session, project, job_id)
        return paging.apply(session, JobEvent, [JobEvent.job_seq == job.seq])

    rows, has_more = await run_db(session, read)
    return page([streams.event_object(e) for e in rows], has_more)


def _event_cursor(session: SessionDep, job: Job, event_id: str | None) -> int:
    """The ``seq`` of the job's event ``event_id`` (0 for none): a stream resumes after it."""
    if not event_id:
        return 0
    seq = session.scalar(select(JobEvent.seq).where(JobEvent.job_seq == job.seq, JobEvent.id == event_id))
    if seq is None:
        raise bad_request(f"No event '{event_id}' in job {job.id} to resume the stream after.", "Last-Event-ID")
    return int(seq)


async def _stream(request: Request, project: Caller, settings: SettingsDep, job: Job, read: streams.Reader) -> Response:
    hub = getattr(request.app.state, "hub", None)
    if hub is None:
        hub = request.app.state.hub = streams.Hub(settings.redis_client_url)
    lease = await hub.take(
        project.key_id or project.id, settings.max_streams_per_key, getattr(request.app.state, "limits", None)
    )
    limits = streams.Limits(
        keepalive=settings.stream_keepalive_seconds, send_timeout=settings.stream_send_timeout_seconds
    )
    return streams.EventStreamResponse(
        streams.messages(hub, job.id, read, limits, lease), send_timeout=limits.send_timeout, on_close=lease.release
    )


@router.get(
    "/{job_id}/metrics",
    summary="The per-step metrics series, oldest first",
    description=STREAM_DOC + " The cursor is the step.",
    responses=STREAMED,
)
async def list_metrics(
    request: Request,
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    job_id: str,
    after_step: Annotated[int, Query(ge=0, le=MAX_STEP, description="Rows after this step.")] = 0,
    stream: StreamQuery = False,
    last_event_id: LastEventId = None,
) -> Response:
    def read() -> tuple[Job, list[dict[str, Any]]]:
        job = _job(session, project, job_id)
        if stream:
            return job, []
        return job, [
            {"step": m.step, **m.data} for m in crud.list_metrics(session=session, job=job) if m.step > after_step
        ]

    job, data = await run_db(session, read)
    if stream:
        after = _step_cursor(last_event_id) if last_event_id else after_step
        return await _stream(request, project, settings, job, streams.metric_reader(job.seq, after))
    return JSON({"object": "list", "data": data, "has_more": False})


@router.get("/{job_id}/samples", summary="What the reward looks like: recorded prompts and completions, oldest first")
async def list_samples(
    session: SessionDep,
    project: ProjectDep,
    job_id: str,
    after_step: Annotated[int, Query(ge=0, le=MAX_STEP, description="Steps after this one.")] = 0,
    limit: Annotated[int, Query(ge=1, le=100, description="Recorded steps a page.")] = 20,
) -> JSON:
    """Every ``sample_interval`` steps (and the last) of a reinforcement job: ``sample_groups``
    prompts, each with its completions' text, reward (null where unscored) and advantage."""

    def read() -> list[dict[str, Any]]:
        job = _job(session, project, job_id)
        rows = crud.list_samples(session=session, job=job, after_step=after_step, limit=limit + 1)
        return [{"object": "fine_tuning.job.samples", "step": r.step, "groups": r.groups} for r in rows]

    rows = await run_db(session, read)
    return JSON({"object": "list", "data": rows[:limit], "has_more": len(rows) > limit})


def _step_cursor(last_event_id: str) -> int:
    if not (re.fullmatch(r"[0-9]{1,10}", last_event_id) and int(last_event_id) <= MAX_STEP):
        raise bad_request("Last-Event-ID of a metrics stream is a step number.", "Last-Event-ID")
    return int(last_event_id)


def checkpoint_object(c: Checkpoint, job: Job) -> dict[str, Any]:
    return {
        "id": c.id,
        "object": "fine_tuning.job.checkpoint",
        "created_at": c.created_at,
        "fine_tuned_model_checkpoint": c.fine_tuned_model_checkpoint,
        "fine_tuning_job_id": job.id,
        "step_number": c.step_number,
        # Left out where the method has no value (a checkpoint of an earlier release stored nulls) or
        # it is not a number JSON holds (a diverged loss's NaN): OpenAI's schema types each as a number.
        "metrics": {"step": c.step_number, **{k: v for k, v in c.metrics.items() if _finite(v)}},
    }


def _finite(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


@router.get("/{job_id}/checkpoints", summary="List a job's checkpoints, newest first")
@ends_session
def list_checkpoints(session: SessionDep, project: ProjectDep, paging: PagingDep, job_id: str) -> JSON:
    job = _job(session, project, job_id)
    rows, has_more = paging.apply(session, Checkpoint, [Checkpoint.job_seq == job.seq])
    return page([checkpoint_object(c, job) for c in rows], has_more)


@router.get(
    "/{job_id}/checkpoints/{checkpoint_id}/content",
    summary="Download a checkpoint (tar archive; byte ranges served)",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-tar": {}}},
        206: {"description": "The byte range asked for (`Range`)", "content": {"application/x-tar": {}}},
    },
)
@ends_session
def read_checkpoint_content(
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    job_id: str,
    checkpoint_id: str,
    range_: Annotated[str | None, Header(alias="Range")] = None,
    if_range: Annotated[str | None, Header(alias="If-Range")] = None,
    merged: Annotated[
        bool,
        Query(
            description="The full model, every LoRA adapter of its chain merged in (made once, by an inference worker)."
        ),
    ] = False,
) -> Response:
    job = _job(session, project, job_id)
    ckpt = crud.get_checkpoint(session=session, job=job, checkpoint_id=checkpoint_id)
    if ckpt is None:
        raise not_found("checkpoint", checkpoint_id)
    filename = f"{job.id}-step-{ckpt.step_number}.tar"
    gone = APIError(410, f"Checkpoint {checkpoint_id} is gone from storage.", code="checkpoint_gone")
    store = open_store(settings)
    if isinstance(store, S3Store):  # read from the store as it is sent
        key = ckpt.path
        if merged and store.manifest(ckpt.path) is not None:
            key = (
                exports.merged_in_store(
                    session, settings, store, project_seq=project.seq, project_id=project.id, checkpoint=ckpt
                )
                or key
            )
        members = store.members(key)
        if members is None:
            raise gone
        stored = [(f"{checkpoint_id}/{n}", m) for n, m in members.items() if not n.startswith(TRAINING_STATE_PREFIX)]
        return tar_response(TarLayout(stored), filename=filename, range_header=range_, if_range=if_range)
    directory = store.local(ckpt.path)
    if not directory.is_dir():
        raise gone
    if merged:
        found = exports.merged(session, settings, project_seq=project.seq, project_id=project.id, checkpoint=ckpt)
        directory = found or directory
    # The Hugging Face directory only; optimizer and RNG state stay server-side. Made while it is
    # sent (service.api.tarstream): no copy on disk.
    try:
        files = [
            (f"{checkpoint_id}/{item.name}", item)
            for item in sorted(directory.iterdir())
            if item.is_file() and not item.is_symlink() and not item.name.startswith(TRAINING_STATE_PREFIX)
        ]
        layout = TarLayout(files)
    except FileNotFoundError:  # pruned (keep_checkpoints) between the look and the listing
        raise gone from None
    return tar_response(layout, filename=filename, range_header=range_, if_range=if_range)

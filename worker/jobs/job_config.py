"""A job's row as the engine's run: its files fetched (from the artifacts directory, or an object
store into this host's cache), its grader and hyperparameters parsed again in this process (as this
release reads what an earlier one stored), where it starts (a base model, or a fine-tuned model's
chain of checkpoints) and the checkpoint it continues from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.core import crud
from service.core.db import session_scope
from service.core.tables import Job
from service.infra.artifacts import open_store
from service.jobs.hyperparameters import method_family
from worker.engine.checkpoints import job_checkpoints_dir, resumable_checkpoint
from worker.engine.config import OperatorOptions, TrainConfig
from worker.engine.errors import JobError


def train_config(job: Job, settings: Any) -> TrainConfig:
    """The run ``job`` asks for, on this host."""
    with session_scope() as session:
        project = job.project_seq
        files = {
            f: crud.get_file_by_id(session=session, project_seq=project, file_id=f)
            for f in (job.training_file, job.validation_file)
            if f
        }
    store = open_store(settings)  # the artifacts directory, or an object store and this host's cache of it
    paths = {}
    for file_id, f in files.items():
        if f is None:
            raise JobError("file_not_found", f"file {file_id} was deleted before the job started")
        paths[file_id] = store.fetch_file(f.path)
    grader, hyperparameters = _stored_spec(job, settings)
    output_dir = job_checkpoints_dir(settings.artifacts_dir, job.id)
    base, init_from = _starting_point(job, settings)
    return TrainConfig(
        model=base,
        training_file=paths[job.training_file],
        validation_file=paths[job.validation_file] if job.validation_file else None,
        grader=grader,
        hyperparameters=hyperparameters,
        output_dir=output_dir,
        models_dir=settings.models_dir,
        seed=job.seed,
        job_name=job.id,
        # A job that ran before (a worker crash, or pause then resume) continues from its newest checkpoint.
        resume_from=resumable_checkpoint(store, output_dir),
        operator=OperatorOptions.from_settings(settings),
        method=method_family(job.method["type"]),
        init_from=init_from,
        tools=_stored_tools(job, settings),
        started_from=job.model if init_from else None,
        integrations=list(job.integrations or []),
        gpus=int((job.resources or {}).get("gpus") or 1),
    )


def _starting_point(job: Job, settings: Any) -> tuple[str, tuple[Path, ...]]:
    """The base model directory and, for a job that starts from a fine-tuned model or checkpoint of
    its project, the checkpoint directories to apply to it (``finetuned.Source.chain``). A model
    deleted after the job was created still starts it: the job was accepted from it."""
    from service.registry import finetuned, model_ids

    if not model_ids.is_fine_tuned(job.model):
        return job.model, ()
    with session_scope() as session:
        source = finetuned.find(session=session, project_seq=job.project_seq, name=job.model, include_deleted=True)
    if source is None:
        raise JobError("model_load_failed", f"the checkpoints of the fine-tuned model '{job.model}' are gone")
    store = open_store(settings)  # (fetched into this host's cache from an object store)
    return source.base_model, tuple(store.fetch_checkpoint(path) for path in source.chain)


def _upgraded(stored: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters stored by an earlier release, as this one reads them: ``eval_interval: 0``
    (its default, no validation passes) is ``auto`` now, whose minimum is 1 as OpenAI's."""
    return {**stored, "eval_interval": "auto"} if stored.get("eval_interval") == 0 else stored


def _stored_tools(job: Job, settings: Any) -> Any:
    """The job's tools and limits, parsed again in this process (the operator's RLOO_TOOL_URLS as
    they are now: an http tool whose prefix was removed since fails the job, saying so)."""
    from service import tools

    kind = job.method["type"]
    config = job.method.get(kind) or {}
    try:
        return tools.parse_tools(
            config.get("tools"),
            config.get("multi_turn"),
            param=f"method.{kind}",
            allowed_urls=settings.tool_urls,
            allow_python=settings.allow_python_tools,
        )
    except tools.ToolSpecError as exc:
        raise JobError("invalid_tools", f"{exc.param}: {exc.message}") from None


def _stored_spec(job: Job, settings: Any) -> tuple[Any, Any]:
    """The job's grader and hyperparameters, parsed again in this process. A job created under other
    settings (the operator turned python graders off since) fails with what to change."""
    from pydantic import ValidationError

    from service import graders
    from service.jobs.hyperparameters import RESOLVED

    kind = job.method["type"]
    try:
        spec = job.method[kind].get("grader")
        grader = graders.parse_grader(spec, allow_python=settings.allow_python_grader) if spec is not None else None
        return grader, RESOLVED[kind].model_validate(_upgraded(job.hyperparameters))
    except graders.GraderError as exc:
        raise JobError("invalid_grader", f"{exc.param}: {exc.message}") from None
    except ValidationError as exc:
        raise JobError("invalid_hyperparameters", f"the job's hyperparameters no longer validate: {exc}") from None

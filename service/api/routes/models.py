"""Models (OpenAI's ``/v1/models``): the base models under the models root and the project's
fine-tuned models, each ``{id, object: "model", created, owned_by}``; a base model also says what
it can be used for (our ``rloo`` key: ``uses``, ``architecture``, ``context_length``,
``chat_template``).

A fine-tuned model (``service.registry.finetuned``) is a succeeded job's; its checkpoints are models too
(retrieve them by their ``fine_tuned_model_checkpoint`` id; the list shows the final ones).
``DELETE`` of a fine-tuned model takes it out of the list and out of reach of new jobs; its job,
checkpoints and files stay. A Tinker training model's sampler and external weights are listed by
their ``tinker://`` path; ``DELETE`` of one removes that checkpoint, files and all.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from service.api.deps import ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON, page
from service.api.routing import StrictJSONRoute
from service.core.crud import Caller
from service.core.db import ends_session
from service.core.errors import Invalid, model_not_found
from service.core.tables import Evaluation, Job, now
from service.evals import runs as evaluations
from service.infra.artifacts import open_store
from service.jobs.lifecycle import JobStatus
from service.registry import export_dirs, finetuned, inspection, model_ids
from service.registry.model_root import list_models
from service.tenancy import usage

log = logging.getLogger("rloo.api")
router = APIRouter(prefix="/v1/models", route_class=StrictJSONRoute, tags=["models"])

BASE_OWNER = "system"
MAX_BASE_MODELS = 1000


def model_object(model_id: str, created: int, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def _base_models(settings: SettingsDep) -> list[dict[str, Any]]:
    return [_base_model(settings, name) for name in list_models(settings.models_dir, limit=MAX_BASE_MODELS)]


def _base_model(settings: SettingsDep, name: str) -> dict[str, Any]:
    """A base model, with our extension ``rloo``: what it can be used for (``policy``: trained,
    sampled, a judge; ``reward_model``; ``embedding``), its context length and whether it has a chat
    template, from its files (``service.registry.inspection``)."""
    path = settings.models_dir / name
    created = int((path / "config.json").stat().st_mtime)
    info = inspection.inspect_model(path)
    described = {
        "uses": info.uses if info else [],
        "architecture": info.architectures[0] if info and info.architectures else None,
        "context_length": info.context_length if info else None,
        "chat_template": info.has_chat_template if info else False,
    }
    return {**model_object(name, created, BASE_OWNER), "rloo": described}


def _fine_tuned(session: SessionDep, project: Caller) -> list[Job]:
    return list(
        session.scalars(
            select(Job)
            .where(Job.project_seq == project.seq, Job.model_deleted_at.is_(None))
            # Ids of OpenAI's form only (a release before this one named models otherwise).
            .where(Job.fine_tuned_model.like(f"{model_ids.PREFIX}%"))
            .where(Job.status == JobStatus.SUCCEEDED.value)
            .order_by(Job.seq.desc())
        ).all()
    )


@router.get("", summary="List models: the base models and the project's fine-tuned models")
@ends_session
def list_all(session: SessionDep, project: ProjectDep, settings: SettingsDep) -> JSON:
    tuned = [
        model_object(j.fine_tuned_model or "", j.finished_at or j.created_at, project.id)
        for j in _fine_tuned(session, project)
    ]
    tinker = [
        model_object(name, created, project.id) for name, created in finetuned.tinker_models(session, project.seq)
    ]
    return page(tuned + tinker + _base_models(settings), has_more=False)


@router.get("/{model_id:path}", summary="Retrieve a model")
@ends_session
def retrieve(session: SessionDep, project: ProjectDep, settings: SettingsDep, model_id: str) -> JSON:
    if model_ids.is_fine_tuned(model_id):
        source = finetuned.find(session=session, project_seq=project.seq, name=model_id)
        if source is None:  # (a fine-tuned model whose job did not succeed is none)
            raise model_not_found(model_id)
        return JSON(model_object(model_id, source.created_at, project.id))
    if model_id in list_models(settings.models_dir, limit=MAX_BASE_MODELS):
        return JSON(_base_model(settings, model_id))
    raise model_not_found(model_id)


@router.delete("/{model_id:path}", summary="Delete a fine-tuned model")
@ends_session
def delete(session: SessionDep, project: ProjectDep, settings: SettingsDep, model_id: str) -> JSON:
    if model_ids.is_tinker(model_id):
        return _delete_tinker_weights(session, project, settings, model_id)
    job = session.scalar(
        select(Job).where(
            Job.project_seq == project.seq, Job.fine_tuned_model == model_id, Job.model_deleted_at.is_(None)
        )
    )
    if job is None:
        if model_id in list_models(settings.models_dir, limit=MAX_BASE_MODELS):
            raise APIError(
                403,
                f"'{model_id}' is a base model of the server's models root; only fine-tuned models can be deleted.",
                param="model",
                code="model_not_deletable",
            )
        raise model_not_found(model_id)
    job.model_deleted_at = now()
    evaluations.cancel(
        session, Evaluation.job_seq == job.seq, code="model_deleted", message=f"The model {model_id} was deleted."
    )
    evaluations.cancel_for_model(session, project.seq, model_id)
    usage.exports_removed(session, job_seq=job.seq)
    session.commit()
    try:  # its merged copies (made again if asked, while the checkpoints remain)
        export_dirs.remove_job_exports(open_store(settings), settings.artifacts_dir, job.id)
    except Exception:  # the store away: the model is deleted all the same; its copies stay behind
        log.exception("the merged models of %s were not removed", model_id)
    return JSON({"id": model_id, "object": "model", "deleted": True})


def _delete_tinker_weights(session: SessionDep, project: Caller, settings: SettingsDep, model_id: str) -> JSON:
    """A Tinker checkpoint deleted as the SDK's RestClient deletes it: its row, then its files."""
    from service.tinker import runs, sessions

    try:
        path = sessions.parse_path(model_id, "model")
    except Invalid:
        raise model_not_found(model_id) from None
    runs.delete_checkpoint(session, project=project.seq, path=path, artifacts_dir=settings.artifacts_dir)
    return JSON({"id": model_id, "object": "model", "deleted": True})

"""The Tinker SDK's ``RestClient`` under ``/api/v1/``: training runs, checkpoints (listed, deleted,
given a time to live, downloaded file by file), sessions, a checkpoint's weights info
(``service.tinker.runs`` holds what each answers)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from starlette.responses import FileResponse

from service.api.deps import ProjectDep, SessionDep, SettingsDep
from service.api.responses import JSON
from service.api.routes.tinker import redis_conn
from service.api.routing import StrictJSONRoute
from service.api.schemas import tinker as schemas
from service.core.db import ends_session, write_lock
from service.tinker import runs, sessions

router = APIRouter(prefix="/api/v1", route_class=StrictJSONRoute, tags=["tinker"], include_in_schema=False)

Limit = Query(default=20, ge=1, le=1000)
Offset = Query(default=0, ge=0, le=10_000_000)


def _path(model_id: str, kind: str, name: str) -> sessions.TinkerPath:
    return sessions.parse_path(f"tinker://{model_id}/{kind}/{name}", "checkpoint_id")


# Training runs --------------------------------------------------------------------------------------------
@router.get("/training_runs")
@ends_session
def list_training_runs(
    project: ProjectDep, session: SessionDep, limit: int = Limit, offset: int = Offset, access_scope: str = "owned"
) -> JSON:
    return JSON(runs.list_runs(session, project=project.seq, owner=project.id, limit=limit, offset=offset))


@router.get("/training_runs/{model_id}")
@ends_session
def get_training_run(model_id: str, project: ProjectDep, session: SessionDep) -> JSON:
    return JSON(runs.get_run(session, project=project.seq, model_id=model_id, owner=project.id))


@router.get("/training_runs/{model_id}/steps")
@ends_session
def list_steps(
    model_id: str,
    project: ProjectDep,
    session: SessionDep,
    after: int = Query(default=-1, ge=-1),
    limit: int = Query(default=1000, ge=1, le=10_000),
) -> JSON:
    """Beyond the SDK: a run's steps after ``after``, with the loss its ``forward_backward`` calls
    added up and AdamW's metrics (the dashboard's curve)."""
    return JSON(runs.list_steps(session, project=project.seq, model_id=model_id, after=after, limit=limit))


@router.post("/weights_info")
@ends_session
def weights_info(body: schemas.TinkerPathRef, project: ProjectDep, session: SessionDep) -> JSON:
    path = sessions.parse_path(body.tinker_path, "tinker_path")
    return JSON(runs.weights_info(session, project=project.seq, path=path))


# Checkpoints ----------------------------------------------------------------------------------------------
@router.get("/training_runs/{model_id}/checkpoints")
@ends_session
def list_checkpoints(model_id: str, project: ProjectDep, session: SessionDep) -> JSON:
    return JSON(runs.list_checkpoints(session, project=project.seq, model_id=model_id))


@router.get("/checkpoints")
@ends_session
def list_user_checkpoints(project: ProjectDep, session: SessionDep, limit: int = Limit, offset: int = Offset) -> JSON:
    return JSON(runs.list_user_checkpoints(session, project=project.seq, limit=limit, offset=offset))


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
@ends_session
def delete_checkpoint(
    model_id: str, kind: str, name: str, project: ProjectDep, session: SessionDep, settings: SettingsDep
) -> JSON:
    runs.delete_checkpoint(
        session, project=project.seq, path=_path(model_id, kind, name), artifacts_dir=settings.artifacts_dir
    )
    return JSON({})


@router.put("/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
@ends_session
def set_checkpoint_ttl(
    model_id: str, kind: str, name: str, body: schemas.CheckpointTtl, project: ProjectDep, session: SessionDep
) -> JSON:
    with write_lock(session):
        runs.set_ttl(session, project=project.seq, path=_path(model_id, kind, name), ttl_seconds=body.ttl_seconds)
        session.commit()
    return JSON({})


@router.get("/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls")
@ends_session
def checkpoint_download_links(
    model_id: str,
    kind: str,
    name: str,
    request: Request,
    project: ProjectDep,
    session: SessionDep,
    settings: SettingsDep,
) -> JSON:
    """Download links for each of the checkpoint's files (any kind of checkpoint, not only
    external ones), answering for an hour without a key."""
    return JSON(
        runs.download_links(
            redis_conn(),
            session,
            project=project.seq,
            path=_path(model_id, kind, name),
            artifacts_dir=settings.artifacts_dir,
            base_url=str(request.base_url).rstrip("/"),
        )
    )


@router.get("/downloads/{token}/{name:path}")
def download(token: str, name: str, settings: SettingsDep) -> Any:
    """One file of a checkpoint, for a link ``external_weights_urls`` answered (no key: the link is one)."""
    path = runs.downloadable(redis_conn(), token, name, settings.artifacts_dir)
    return FileResponse(path, media_type="application/octet-stream", filename=path.name)


# Sessions -------------------------------------------------------------------------------------------------
@router.get("/sessions")
@ends_session
def list_sessions(project: ProjectDep, session: SessionDep, limit: int = Limit, offset: int = Offset) -> JSON:
    return JSON({"sessions": runs.session_ids(session, project=project.seq, limit=limit, offset=offset)})


@router.get("/sessions/{session_id}")
@ends_session
def get_session(session_id: str, project: ProjectDep, session: SessionDep) -> JSON:
    return JSON(runs.describe_session(session, project=project.seq, session_id=session_id))

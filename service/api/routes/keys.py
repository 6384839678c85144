"""The project admin's keys (``/v1/keys``, scope ``keys``) and ``GET /v1/me``: what the request's own
key may do (the dashboard hides what it may not)."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import PagingDep, ProjectDep, SessionDep
from service.api.responses import JSON, page
from service.api.routing import StrictJSONRoute
from service.api.schemas.tenancy import KeyCreate
from service.core.db import ends_session
from service.core.tables import ApiKey, Project
from service.tenancy import keys, scopes
from service.tenancy.keys import key_object

router = APIRouter(route_class=StrictJSONRoute, tags=["keys"])


@router.get("/v1/me", summary="The request's key: its project, scopes and expiry")
@ends_session
def me(session: SessionDep, caller: ProjectDep) -> JSON:
    project = session.get_one(Project, caller.seq)
    row = keys.find_key(session=session, project_seq=caller.seq, key_id=caller.key_id)
    return JSON(
        {
            "object": "caller",
            "project": {"id": project.id, "name": project.name},
            "key": key_object(row),
            "scopes": scopes.ordered(caller.scopes),
            "operator": caller.operator,
        }
    )


def create_key(session: SessionDep, caller: ProjectDep, project: Project, body: KeyCreate) -> JSON:
    """A key of ``project`` with the scopes ``body`` asks for, of those ``caller`` holds; its secret
    is answered once, in ``value``."""
    asked = scopes.parse(body.scopes) if body.scopes is not None else caller.scopes & scopes.ALL
    row, secret = keys.create_api_key(
        session=session,
        project=project,
        name=body.name,
        scopes=keys.grant(caller=caller, asked=asked),
        expires_in=keys.lifetime(caller=caller, asked=body.expires_in),
        prefix=keys.TINKER_KEY_PREFIX if body.tinker else None,
    )
    session.commit()
    return JSON(key_object(row, secret), status_code=201)


@router.post("/v1/keys", summary="Create a key of this project (its secret is answered once)", status_code=201)
@ends_session
def create(session: SessionDep, caller: ProjectDep, body: KeyCreate) -> JSON:
    return create_key(session, caller, session.get_one(Project, caller.seq), body)


@router.get("/v1/keys", summary="List this project's keys, newest first (never a secret)")
@ends_session
def list_keys(session: SessionDep, caller: ProjectDep, paging: PagingDep) -> JSON:
    rows, has_more = paging.apply(session, ApiKey, [ApiKey.project_seq == caller.seq])
    return page([key_object(r) for r in rows], has_more)


@router.get("/v1/keys/{key_id}", summary="Retrieve a key of this project")
@ends_session
def retrieve(session: SessionDep, caller: ProjectDep, key_id: str) -> JSON:
    return JSON(key_object(keys.find_key(session=session, project_seq=caller.seq, key_id=key_id)))


@router.delete("/v1/keys/{key_id}", summary="Revoke a key of this project")
@ends_session
def revoke(session: SessionDep, caller: ProjectDep, key_id: str) -> JSON:
    """Requests with it are refused within RLOO_AUTH_CACHE_SECONDS (5 s by default)."""
    row = keys.find_key(session=session, project_seq=caller.seq, key_id=key_id)
    keys.revoke_key(row=row, caller=caller)
    session.commit()
    return JSON({"object": "api_key.deleted", "id": key_id, "deleted": True})

"""The operator's projects (``/v1/projects``, an operator's key only): create, list, retrieve,
archive and restore one, and make or list its keys (a new tenant's first key comes from here)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.orm import Session

from service.api.deps import OperatorDep, PagingDep, SessionDep
from service.api.responses import JSON, page
from service.api.routes.keys import create_key
from service.api.routing import StrictJSONRoute
from service.api.schemas.tenancy import KeyCreate, ProjectCreate, ProjectUpdate
from service.core.db import ends_session
from service.core.tables import ApiKey, Project
from service.tenancy import audit, projects, quotas
from service.tenancy.keys import key_object
from service.tenancy.projects import project_object

router = APIRouter(prefix="/v1/projects", route_class=StrictJSONRoute, tags=["projects"])


@router.post("", summary="Create a project (operator keys only)", status_code=201)
@ends_session
def create(session: SessionDep, operator: OperatorDep, body: ProjectCreate) -> JSON:
    from sqlalchemy.exc import IntegrityError

    changes = quotas.parse(body.quotas or {})
    project = projects.create_project(session=session, name=body.name)
    quotas.apply(project, changes)
    session.flush()
    audit.concerns(session, project.seq)
    try:
        session.commit()
    except IntegrityError:  # made by another request meanwhile
        session.rollback()
        raise projects.name_taken(body.name) from None
    return JSON(project_object(project, keys=0), status_code=201)


@router.get("", summary="List every project, newest first (operator keys only)")
@ends_session
def list_all(session: SessionDep, operator: OperatorDep, paging: PagingDep) -> JSON:
    rows, has_more = paging.apply(session, Project, [])
    counts = projects.key_counts(session=session)
    return page([project_object(p, keys=counts.get(p.seq, 0)) for p in rows], has_more)


@router.get("/{project_id}", summary="Retrieve a project (operator keys only)")
@ends_session
def retrieve(session: SessionDep, operator: OperatorDep, project_id: str) -> JSON:
    project = projects.find_project(session=session, id_or_name=project_id)
    return JSON(project_object(project, keys=projects.key_counts(session=session).get(project.seq, 0)))


@router.post("/{project_id}", summary="Set a project's quotas (operator keys only)")
@ends_session
def update(session: SessionDep, operator: OperatorDep, project_id: str, body: ProjectUpdate) -> JSON:
    """Each quota named is set (a number) or unset (null); the others stay. They hold from the next
    request (a running job is not stopped by a lower running_jobs; it counts until it ends)."""
    changes = quotas.parse(body.quotas)
    project = _acted_on(session, project_id)
    quotas.apply(project, changes)
    session.commit()
    return JSON(project_object(project, keys=projects.key_counts(session=session).get(project.seq, 0)))


@router.post("/{project_id}/archive", summary="Archive a project: its objects kept, its keys refused")
@ends_session
def archive(session: SessionDep, operator: OperatorDep, project_id: str) -> JSON:
    project = _acted_on(session, project_id)
    projects.archive(project=project, by_project_seq=operator.seq)
    session.commit()
    return JSON(project_object(project))


@router.post("/{project_id}/restore", summary="Restore an archived project: its keys work again")
@ends_session
def restore(session: SessionDep, operator: OperatorDep, project_id: str) -> JSON:
    project = _acted_on(session, project_id)
    projects.restore(project=project)
    session.commit()
    return JSON(project_object(project))


@router.post("/{project_id}/keys", summary="Create a key of a project (its secret is answered once)", status_code=201)
@ends_session
def create_project_key(session: SessionDep, operator: OperatorDep, project_id: str, body: KeyCreate) -> JSON:
    project = _acted_on(session, project_id)
    return create_key(session, operator, project, body)


@router.get("/{project_id}/keys", summary="List a project's keys (never a secret)")
@ends_session
def list_project_keys(session: SessionDep, operator: OperatorDep, project_id: str, paging: PagingDep) -> JSON:
    project = projects.find_project(session=session, id_or_name=project_id)
    rows, has_more = paging.apply(session, ApiKey, [ApiKey.project_seq == project.seq])
    return page([key_object(r) for r in rows], has_more)


def _acted_on(session: Session, project_id: str) -> Project:
    """The project an operator's action is on, its audit row filed in that project's log."""
    project = projects.find_project(session=session, id_or_name=project_id)
    audit.concerns(session, project.seq)
    return project

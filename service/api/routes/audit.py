"""``GET /v1/audit``: the audit log (``service.tenancy.audit``), newest first: a project admin's key
(scope ``keys``) reads its project's rows, an operator's key every project's (or one's, with
``project_id``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from service.api.deps import PagingDep, ProjectDep, SessionDep
from service.api.responses import JSON, page
from service.api.routing import StrictJSONRoute
from service.core.db import ends_session
from service.core.errors import bad_request, operator_only
from service.core.tables import AuditEvent, Project
from service.tenancy import audit, projects

router = APIRouter(prefix="/v1/audit", route_class=StrictJSONRoute, tags=["audit"])
OUTCOMES = (audit.SUCCEEDED, audit.REFUSED, audit.FAILED)


@router.get("", summary="List audit events, newest first (a project's admin: its own; an operator: all)")
@ends_session
def list_events(
    session: SessionDep,
    caller: ProjectDep,
    paging: PagingDep,
    project_id: Annotated[str | None, Query(max_length=200, description="An operator's: one project's.")] = None,
    key_id: Annotated[str | None, Query(max_length=64, description="Only this key's.")] = None,
    outcome: Annotated[str | None, Query(description="succeeded, refused or failed.")] = None,
    since: Annotated[int | None, Query(ge=0, le=2**40, description="Only events at or after this Unix time.")] = None,
) -> JSON:
    where = []
    if project_id is not None:
        if not caller.operator:
            raise operator_only("GET /v1/audit?project_id=")
        where.append(AuditEvent.project_seq == projects.find_project(session=session, id_or_name=project_id).seq)
    elif not caller.operator:
        where.append(AuditEvent.project_seq == caller.seq)
    if key_id is not None:
        where.append(AuditEvent.key_id == key_id)
    if outcome is not None:
        if outcome not in OUTCOMES:
            raise bad_request(f"outcome must be one of {', '.join(OUTCOMES)}; got {outcome!r}.", "outcome")
        where.append(AuditEvent.outcome == outcome)
    if since is not None:
        where.append(AuditEvent.created_at >= since)
    rows, has_more = paging.apply(session, AuditEvent, where)
    seqs = {r.project_seq for r in rows}
    names = {seq: id_ for seq, id_ in session.execute(select(Project.seq, Project.id).where(Project.seq.in_(seqs)))}
    return page([audit.audit_object(r, names) for r in rows], has_more)

"""``GET /v1/usage``: what a project used (``service.tenancy.usage``), summed over a time range by
the groups asked for; an operator's key reads every project's (or one's, with ``project_id``)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import ProjectDep, SessionDep
from service.api.responses import JSON
from service.api.routing import StrictJSONRoute
from service.core.db import ends_session
from service.core.errors import bad_request, operator_only
from service.core.settings import get_settings
from service.tenancy import projects, quotas, usage

router = APIRouter(prefix="/v1/usage", route_class=StrictJSONRoute, tags=["usage"])


@router.get("", summary="Usage by kind (device-seconds, tokens), summed over a time range")
@ends_session
def read_usage(
    session: SessionDep,
    caller: ProjectDep,
    start_time: Annotated[int | None, Query(ge=0, le=2**40, description="Unix time (default: 7 days ago).")] = None,
    end_time: Annotated[int | None, Query(ge=0, le=2**40, description="Unix time (default: now).")] = None,
    group_by: Annotated[
        str, Query(max_length=200, description="Comma-separated: project, kind, subject, day, accelerator.")
    ] = "kind",
    project_id: Annotated[str | None, Query(max_length=200, description="An operator's: one project's.")] = None,
) -> JSON:
    now = int(time.time())
    end = now if end_time is None else end_time
    start = end - 7 * 86400 if start_time is None else start_time
    if start >= end:
        raise bad_request(f"start_time ({start}) must be before end_time ({end}).", "start_time")
    groups = [g.strip() for g in group_by.split(",") if g.strip()]
    unknown = [g for g in groups if g not in usage.GROUPS]
    if unknown:
        raise bad_request(f"Unknown group {unknown[0]!r}: group_by takes {', '.join(usage.GROUPS)}.", "group_by")
    project_seq: int | None = caller.seq
    if project_id is not None:
        if not caller.operator:
            raise operator_only("GET /v1/usage?project_id=")
        project_seq = projects.find_project(session=session, id_or_name=project_id).seq
    elif caller.operator:
        project_seq = None
    prices = get_settings().accelerator_prices
    rows = usage.summary(session, project_seq=project_seq, start=start, end=end, group_by=groups, prices=prices)
    out = {"object": "usage", "start_time": start, "end_time": end, "group_by": groups, "data": rows}
    if project_seq is not None:
        out["stored_bytes"] = usage.stored_bytes(session, project_seq)
        out["quotas"] = quotas.project_quotas(projects.find_by_seq(session=session, seq=project_seq))
    return JSON(out)

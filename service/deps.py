"""FastAPI dependencies as named aliases, so handlers read like sentences."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query
from sqlalchemy.orm import Session

from service import crud
from service.db import get_session
from service.errors import APIError, bad_request
from service.models import Project
from service.settings import Settings, get_settings

SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def current_project(session: SessionDep, authorization: Annotated[str | None, Header()] = None) -> Project:
    if not authorization:
        raise APIError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'. `rloo keys create --project NAME` makes one.",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    scheme, _, secret = authorization.partition(" ")
    project = crud.authenticate(session=session, secret=secret.strip()) if scheme.lower() == "bearer" else None
    if project is None:
        raise APIError(
            401, "Invalid or revoked API key.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
    return project


ProjectDep = Annotated[Project, Depends(current_project)]


class Paging:
    def __init__(
        self,
        after: Annotated[str | None, Query(max_length=64, description="Id of the last item seen.")] = None,
        limit: Annotated[int, Query(description="Items a page, 1 to 100.")] = 20,
    ) -> None:
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100.", "limit")
        self.after, self.limit = after, limit


PagingDep = Annotated[Paging, Depends()]

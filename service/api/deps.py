"""FastAPI dependencies as named aliases, so handlers read like sentences."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from sqlalchemy.orm import Session

from service.api.errors import APIError
from service.core import crud
from service.core.db import get_session
from service.core.errors import bad_request, operator_only
from service.core.settings import Settings, get_settings
from service.tenancy import audit, keys


async def request_session(request: Request) -> AsyncIterator[Session]:
    """The request's session (``get_session``); on an audited request (``service.api.audit``) it
    writes the request's audit row in its first commit, naming the caller, the route and the object
    its path names."""
    async for session in get_session():
        context = request.scope.get("state", {}).get("audit")
        if context is not None:
            route = request.scope.get("route")
            context.caller = getattr(request.state, "caller", None)
            context.action = f"{request.method} {getattr(route, 'path', request.url.path)}"
            ids = [str(v) for k, v in request.path_params.items() if k.endswith("_id")]
            context.object_id = ids[-1] if ids else None  # the innermost: a run's, not its eval's
            audit.attach(session, context)
        yield session


SessionDep = Annotated[Session, Depends(request_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def current_project(request: Request) -> crud.Caller:
    """The project of the request's key, as the AuthMiddleware found it before the body was read
    (every /v1 route is behind it)."""
    caller = getattr(request.state, "caller", None)
    if caller is None:  # not checked by the middleware (a route outside /v1): refuse, never let through
        caller = authenticate_header_for(request)
    refuse_nul_in_url(request)
    return caller


def refuse_nul_in_url(request: Request) -> None:
    """A NUL (%00) in a path or query parameter is a 400 before any lookup: no id, cursor or purpose
    holds one, and PostgreSQL refuses NUL in text outright (a 500 there, a 404 on SQLite)."""
    for name, value in [*request.path_params.items(), *request.query_params.multi_items()]:
        if "\x00" in name or "\x00" in str(value):
            name = name.replace("\x00", "")
            raise bad_request(f"'{name}' holds a NUL character (%00); remove it.", name)


def authenticate_header_for(request: Request) -> crud.Caller:
    from service.core.db import session_scope

    with session_scope() as session:
        return authenticate_header(session, request.headers.get("authorization"))


def authenticate_header(session: Session, authorization: str | None) -> crud.Caller:
    if not authorization:
        raise APIError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'. `rloo keys create --project NAME` makes one.",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    scheme, _, secret = authorization.partition(" ")
    caller = keys.authenticate(session=session, secret=secret.strip()) if scheme.lower() == "bearer" else None
    if caller is None:
        raise APIError(
            401, "Invalid or revoked API key.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
    return caller


ProjectDep = Annotated[crud.Caller, Depends(current_project)]


async def current_operator(request: Request) -> crud.Caller:
    """The request's key, which must be an operator's (``rloo keys create --operator``): a project's
    key gets a 403 naming the route."""
    caller = await current_project(request)
    if not caller.operator:
        raise operator_only(f"{request.method} {request.url.path}")
    return caller


OperatorDep = Annotated[crud.Caller, Depends(current_operator)]


class Paging:
    """``?after=<id>&limit=N`` of a list, newest first (``order=asc`` where a list takes it): at
    most ``MAXIMUM`` a page (OpenAI's maximums). An ``after`` id the list does not hold gives an
    empty page, as OpenAI answers."""

    DEFAULT = 20
    MAXIMUM = 100

    def __init__(
        self,
        after: Annotated[str | None, Query(max_length=64, description="Id of the last item seen.")] = None,
        limit: Annotated[int | None, Query(description="Items a page (default 20, at most 100; files 10000).")] = None,
    ) -> None:
        limit = self.DEFAULT if limit is None else limit
        if not 1 <= limit <= self.MAXIMUM:
            raise bad_request(f"limit must be between 1 and {self.MAXIMUM}.", "limit")
        self.after, self.limit, self.ascending = after, limit, False

    def apply(self, session: Session, model: Any, scope: list[Any]) -> tuple[list[Any], bool]:
        """This page of ``model`` rows within ``scope``."""
        result = crud.page(
            session=session, model=model, scope=scope, after_id=self.after, limit=self.limit, ascending=self.ascending
        )
        return result if result is not None else ([], False)


class FilePaging(Paging):
    """OpenAI's files list: 10,000 a page by default and at most, ``order`` ``desc`` (newest first) or ``asc``."""

    DEFAULT = MAXIMUM = 10_000

    def __init__(
        self,
        after: Annotated[str | None, Query(max_length=64, description="Id of the last item seen.")] = None,
        limit: Annotated[int | None, Query(description="Items a page, 1 to 10000 (default 10000).")] = None,
        order: Annotated[str, Query(description="desc (newest first) or asc.")] = "desc",
    ) -> None:
        super().__init__(after, limit)
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc'; got '{order}'.", "order")
        self.ascending = order == "asc"


PagingDep = Annotated[Paging, Depends()]
FilePagingDep = Annotated[FilePaging, Depends()]

"""The HTTP side of errors, the one place they become responses: each kind of the domain's
``DomainError`` mapped to its status (``STATUS``), ``APIError`` for what only the HTTP layer says
(a status of its own, headers), the app's exception handlers, which answer every error in OpenAI's
shape (a domain error, a body that fails validation, the framework's 404 and 405, anything
unhandled), and the middleware that answers 503 when the database is unreachable."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.responses import JSON
from service.core.errors import (
    Conflict,
    DomainError,
    Failed,
    Forbidden,
    Gone,
    Invalid,
    LimitReached,
    NotFound,
    TimedOut,
    TooLarge,
    Unauthenticated,
    Unavailable,
    UpstreamFailed,
)

log = logging.getLogger("rloo.api")

STATUS: dict[type[DomainError], int] = {
    Invalid: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    Gone: 410,
    TooLarge: 413,
    LimitReached: 429,
    Failed: 500,
    UpstreamFailed: 502,
    Unavailable: 503,
    TimedOut: 504,
}
"""Each kind of domain error as HTTP: a kind of a kind (``GraderError`` is ``Invalid``) answers as its
nearest listed ancestor; a ``DomainError`` of no listed kind is a 400."""


class APIError(DomainError):
    """An error only the HTTP layer says: its status and headers given (a relayed worker's answer,
    ``WWW-Authenticate``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.status, self.headers = status, headers


def status_of(exc: DomainError) -> int:
    if isinstance(exc, APIError):
        return exc.status
    return next((STATUS[k] for k in type(exc).__mro__ if k in STATUS), 400)


def headers_of(exc: DomainError) -> dict[str, str] | None:
    headers = dict(exc.headers or {}) if isinstance(exc, APIError) else {}
    if exc.retry_after is not None:  # whole seconds (RFC 9110), never 0
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return headers or None


_TYPES = {429: "requests"}
"""OpenAI's error ``type``: ``invalid_request_error`` for every 4xx (a bad key, an unknown id, a state
that forbids the change, too large), ``requests`` for a rate limit, ``server_error`` for 5xx; the
``code`` says which."""


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def answer(exc: DomainError) -> JSON:
    """A domain error as OpenAI's error response."""
    status = status_of(exc)
    return JSON(error_body(status, exc.message, exc.param, exc.code), status, headers=headers_of(exc))


def _body_model(request: Request) -> Any:
    """The pydantic model of the route's JSON body, if it has one (to suggest a misspelt field)."""
    import typing

    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    # An optional body (``Model | None``): the model.
    members = [a for a in typing.get_args(annotation) if hasattr(a, "model_fields")]
    return members[0] if members else annotation


def _allowed_methods(request: Request) -> str:
    """Every method the path has a route for. Starlette's 405 names only the first route whose path
    matched (``Allow: POST`` on /v1/files, which has GET too); RFC 9110 wants them all. Each method is
    tried against the routes (``matches``, the one interface every route and included router has)."""
    from fastapi import routing
    from starlette.routing import Match

    methods = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
    routes = request.app.router.routes
    # A literal path (/v1/fine_tuning/jobs/estimate) is its own resource, though a pattern matches it
    # too (/v1/fine_tuning/jobs/{job_id}): its methods only. Recent FastAPI keeps included routers
    # whole in app.routes; iter_route_contexts flattens them.
    flat = getattr(routing, "iter_route_contexts", lambda routes: routes)(routes)
    literal = [set(getattr(r, "methods", ()) or ()) for r in flat if getattr(r, "path", None) == request.scope["path"]]
    if literal:
        return ", ".join(m for m in methods if any(m in ms for ms in literal))
    allowed = [
        method
        for method in methods
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]
    return ", ".join(allowed)


def install(app: FastAPI) -> None:
    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, exc: DomainError) -> JSON:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSON:
        from service.core.validation import message

        errors = exc.errors()
        text, param = message(errors[0] if errors else {}, _body_model(request))
        return JSON(error_body(400, text, param, "invalid_value"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSON:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404 and message == "Not Found":
            message = "Unknown URL. See /docs for the API reference."
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return JSON(error_body(exc.status_code, message), exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSON:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSON(error_body(500, "Internal server error.", code="internal_error"), 500)


RETRY_AFTER_SECONDS = 2
DATABASE_UNAVAILABLE = (
    "The service cannot reach its database right now. Retry in a few seconds; a creation retried with "
    "the same Idempotency-Key header is never made twice."
)


class TrackedSend:
    """An ASGI ``send`` that remembers whether the response has begun (after that, an error can
    no longer be answered with a response of its own)."""

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


class DatabaseUnavailableMiddleware:
    """Outermost of our middlewares: a request that finds the database unreachable (in a route, or in
    the key check before it) is answered 503 with ``Retry-After``, in the error shape, and the
    process carries on; the pool reconnects when the database is back (pre-ping)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            from service.core.db import database_unreachable

            if not database_unreachable(exc) or tracked.started:
                raise
            from service.core.db import _reason

            log.warning("database unreachable on %s %s: %s", scope["method"], scope["path"], _reason(exc))
            response = JSON(
                error_body(503, DATABASE_UNAVAILABLE, code="database_unavailable"),
                503,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
            await response(scope, receive, send)

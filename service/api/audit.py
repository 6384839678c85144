"""Auditing requests: ``AuditMiddleware`` gives each mutating request under /v1 and /api/v1 an
``AuditContext`` (``service.tenancy.audit``); the request's session (``deps.request_session``) learns
its caller, route and object, and writes the row in the handler's commit; after the answer the
middleware records its outcome (or, where nothing was committed, the whole row) on a thread.

Not audited: reads (GET, HEAD), requests without a valid key (no project to put them in), 429s, and
the hot paths that change nothing a tenant administers (``UNAUDITED``: completions, a Tinker loop's
steps and polls; usage metering counts those)."""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.middleware import TINKER_LOOP_PATHS, app_path
from service.tenancy.audit import AuditContext, finish

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
UNAUDITED = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/fine_tuning/jobs/estimate",
        "/v1/fine_tuning/alpha/graders/validate",
        *TINKER_LOOP_PATHS,  # a loop's steps, samples, polls and beats
        *(f"/api/v1/{name}" for name in ("client/config", "get_info", "weights_info")),
    }
)
"""Mutating-method paths that are not audited: each is a read, or a step of a loop metered instead."""
WRITERS = 4
"""Audit rows written after answers at once, on threads of their own."""

log = logging.getLogger("rloo.audit")


class AuditMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._limiter: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = app_path(scope) if scope["type"] == "http" else ""
        if (
            scope["type"] != "http"
            or scope["method"] not in MUTATING
            or not path.startswith(("/v1/", "/api/v1/"))
            or path.rstrip("/") in UNAUDITED
        ):
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("", 0)
        context = AuditContext(method=scope["method"], client=str(client[0]))
        scope.setdefault("state", {})["audit"] = context
        answer = _Answer(send)
        try:
            await self.app(scope, receive, answer)
        except BaseException:
            answer.status = answer.status or 500
            await self._finish(scope, context, answer)
            raise
        await self._finish(scope, context, answer)

    async def _finish(self, scope: Scope, context: AuditContext, answer: _Answer) -> None:
        from anyio import CapacityLimiter, to_thread

        context.caller = context.caller or scope.get("state", {}).get("caller")
        if context.caller is None or answer.status in (None, 401, 429):
            return
        if not context.action:  # refused before routing (a scope, an expiry): the table's template
            from service.api import route_scopes as scopes

            path = app_path(scope)
            found = scopes.needed(scope["method"], path)
            context.action = f"{scope['method']} {found[0] if found else path}"
        if self._limiter is None:
            self._limiter = CapacityLimiter(WRITERS)
        try:
            await to_thread.run_sync(_write, context, answer.status, answer.code(), limiter=self._limiter)
        except Exception as exc:  # the answer is out already; an audit row lost is logged, never raised
            log.warning("audit row of %s not written: %s", context.action, exc)


def _write(context: AuditContext, status: int, code: str | None) -> None:
    from service.core.db import session_scope

    with session_scope() as session:
        finish(session, context, status=status, code=code)


class _Answer:
    """An ASGI ``send`` that keeps the status and, for an error, the start of its body (its code)."""

    LIMIT = 4096

    def __init__(self, send: Send) -> None:
        self.send, self.body = send, b""
        self.status: int | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and (self.status or 0) >= 400 and len(self.body) < self.LIMIT:
            self.body += message.get("body", b"")[: self.LIMIT]
        await self.send(message)

    def code(self) -> str | None:
        if not self.body:
            return None
        try:
            error = json.loads(self.body).get("error") or {}
        except (ValueError, AttributeError):
            return None
        return error.get("code") if isinstance(error.get("code"), str) else None

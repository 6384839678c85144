"""Request body limits, enforced while the body streams in (pure ASGI, so nothing is buffered first)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_body


class BodyTooLarge(HTTPException):
    """Raised from ``receive``; an HTTPException so FastAPI's body parsing passes it through as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than the limit of {limit} bytes.")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_upload_bytes: int, max_json_bytes: int) -> None:
        self.app, self.max_upload, self.max_json = app, max_upload_bytes, max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_upload if scope["path"].rstrip("/") == "/v1/files" else self.max_json
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _too_large(send, limit)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body(413, f"The request body is larger than the limit of {limit} bytes.", None, "request_too_large")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Checks the bearer key of every /v1 request before its body is read, so that a caller without
    a valid key learns only that (401), never how its body would have been parsed."""

    CACHE_LIMIT = 10_000

    def __init__(self, app: ASGIApp, *, cache_seconds: float = 0.0) -> None:
        self.app = app
        # Keys checked lately, by the SHA-256 digest of the header: a status poll costs no database
        # query for its key. Only valid keys are kept, for ``cache_seconds`` (RLOO_AUTH_CACHE_SECONDS).
        self.cache_seconds = cache_seconds
        self.cache: dict[str, tuple[float, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # behind a proxy prefix (uvicorn --root-path)
            path = path[len(root) :]
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        from anyio import to_thread

        from service.db import session_scope
        from service.deps import authenticate_header
        from service.errors import APIError

        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        digest = hashlib.sha256(authorization.encode()).hexdigest() if authorization else ""
        cached = self.cache.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            scope.setdefault("state", {})["caller"] = cached[1]
            await self.app(scope, receive, send)
            return

        def check() -> Any:
            with session_scope() as session:
                return authenticate_header(session, authorization)

        try:
            caller = await to_thread.run_sync(check)
        except APIError as exc:
            body = json.dumps(error_body(exc.status, exc.message, exc.param, exc.code)).encode()
            extra = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
            await send(
                {
                    "type": "http.response.start",
                    "status": exc.status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        *extra,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if self.cache_seconds > 0:
            if len(self.cache) >= self.CACHE_LIMIT:
                self.cache.clear()
            self.cache[digest] = (time.monotonic() + self.cache_seconds, caller)
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

"""Request limits, pure ASGI (nothing is buffered first): the body size, enforced while the body
streams in; the API key, checked before the body is read; a per-key request rate; and a per-key rate
of request-body bytes (four 8 MiB bodies at once, again and again within the request rate, kept an
API process busy reading and refusing them for everyone)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import TrackedSend, error_body, headers_of, status_of
from service.core.errors import DomainError
from service.infra import limits
from service.infra.limits import SharedLimits


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

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        tracked = TrackedSend(send)
        try:
            await self.app(scope, limited_receive, tracked)
        except BodyTooLarge:
            if not tracked.started:
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


def app_path(scope: Scope) -> str:
    """The request's path as the app's routes read it: behind a proxy prefix (uvicorn --root-path),
    without it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return str(path[len(root) :] if root and path.startswith(root) else path)


class RateLimiter:
    """Request rate per key: GCRA (the token bucket's equal, one float per key, no refill loop).

    ``rate`` requests a second sustained, ``burst`` at once. Each key has a theoretical arrival time
    (TAT): a request is let through when TAT + 1/rate lies at most ``burst/rate`` seconds ahead of
    now, and pushes TAT on by 1/rate; a refused request changes nothing (a loop that keeps hammering
    still gets ``rate`` a second through).

    In this process's memory, on the event loop: ``take`` never awaits, so no other request runs
    between its read and its write, and no lock is needed. The AuthMiddleware counts in Redis
    (``service.infra.limits``, the same algorithm), so that every API process gives a key one rate;
    this one decides while Redis does not answer, each process on its own. At most ``max_keys`` keys are kept:
    when full, keys whose bucket has refilled are forgotten first (that changes nothing), then the
    oldest tenth (those keys start again with a full bucket).
    """

    def __init__(self, rate: float, burst: int, *, max_keys: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.interval = 1.0 / rate
        self.window = burst * self.interval  # how far ahead of now a key's TAT may run
        self.tat: dict[str, float] = {}

    def take(self, key: str, now: float | None = None, *, cost: float = 1.0) -> tuple[bool, int, float, float]:
        """One request of ``key`` (``cost`` units of it: bytes, for a byte rate): (allowed, units
        left, seconds until this one would be allowed (0 when allowed), seconds until the bucket is
        full again)."""
        if now is None:
            now = limits.clock()
        tat = self.tat.get(key)
        if tat is None or tat < now:
            if tat is None and len(self.tat) >= self.max_keys:
                self._evict(now)
            tat = now
        ahead = tat + cost * self.interval - now
        if ahead > self.window + 1e-6:  # a microsecond for the float sums
            return False, 0, ahead - self.window, tat - now
        self.tat[key] = tat + cost * self.interval
        return True, int((self.window - ahead) * self.rate + 1e-3), 0.0, ahead

    def _evict(self, now: float) -> None:
        for key in [k for k, t in self.tat.items() if t <= now]:
            del self.tat[key]
        if len(self.tat) >= self.max_keys:
            for key in list(itertools.islice(self.tat, max(1, self.max_keys // 10))):
                del self.tat[key]


def _duration(seconds: float) -> str:
    """OpenAI's spelling of x-ratelimit-reset-requests: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


class AuthMiddleware:
    """Checks the bearer key of every /v1 request before its body is read, so that a caller without
    a valid key learns only that (401), never how its body would have been parsed; then counts the
    request against the key's rate limit (``RateLimiter``; 429 past it); the Tinker protocol
    (``/api/v1/``) takes keys too, and its loops' requests (``TINKER_LOOP_PATHS``) count against a
    limit of their own. Elsewhere (``/healthz``, ``/readyz``, ``/metrics``, ``/docs``, the open Tinker
    paths) nothing is checked or counted."""

    CACHE_LIMIT = 10_000
    CHECK_THREADS = 8
    """Key checks (one indexed read each) at once: on threads of their own, so that no number of slow
    routes holding the route threads can keep a request from being let in."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        cache_seconds: float = 0.0,
        rate_limit: float = 0.0,
        rate_limit_burst: int = 1,
        tinker_rate_limit: float = 0.0,
        tinker_rate_limit_burst: int = 1,
        body_bytes_rate: float = 0.0,
        body_bytes_burst: int = 1,
        shared: SharedLimits | None = None,
    ) -> None:
        self.app = app
        # service.infra.limits.SharedLimits: the counts every API process shares (None: this one's only).
        self.shared = shared
        # Keys checked lately, by the SHA-256 digest of the header: a status poll costs no database
        # query for its key. Only valid keys are kept, for ``cache_seconds`` (RLOO_AUTH_CACHE_SECONDS).
        self.cache_seconds = cache_seconds
        self.cache: dict[str, tuple[float, Any]] = {}
        # RLOO_RATE_LIMIT / RLOO_RATE_LIMIT_BURST, and RLOO_RATE_LIMIT_TINKER / _BURST for the Tinker
        # protocol; 0 = no limit (and no x-ratelimit headers).
        self.limiter = RateLimiter(rate_limit, rate_limit_burst) if rate_limit > 0 else None
        self.tinker_limiter = RateLimiter(tinker_rate_limit, tinker_rate_limit_burst) if tinker_rate_limit > 0 else None
        # RLOO_RATE_LIMIT_BODY_BYTES / _BURST: request-body bytes a second per key (uploads aside,
        # which /v1/files bounds itself); a body with no declared length counts as the JSON limit.
        self.bytes_limiter = RateLimiter(body_bytes_rate, body_bytes_burst) if body_bytes_rate > 0 else None
        self._check_limiter: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = app_path(scope)
        tinker = path.startswith("/api/v1/")  # the Tinker protocol (service.api.routes.tinker)
        open_tinker = path in OPEN_TINKER_PATHS or path.startswith(OPEN_TINKER_PREFIXES)
        if scope["type"] != "http" or not (path.startswith("/v1/") or (tinker and not open_tinker)):
            await self.app(scope, receive, send)
            return
        from anyio import to_thread

        from service.api.deps import authenticate_header
        from service.core.db import session_scope

        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        if authorization is None and tinker and headers.get(b"x-api-key"):  # the Tinker SDK's header
            authorization = "Bearer " + headers[b"x-api-key"].decode("latin-1")
        digest = hashlib.sha256(authorization.encode()).hexdigest() if authorization else ""
        cached = self.cache.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            await self.admit(cached[1], scope, receive, send, path=path)
            return

        def check() -> Any:  # (engines hide statement parameters: the key's digest never reaches a log)
            with session_scope() as session:
                return authenticate_header(session, authorization)

        if self._check_limiter is None:
            from anyio import CapacityLimiter

            self._check_limiter = CapacityLimiter(self.CHECK_THREADS)
        try:
            caller = await to_thread.run_sync(check, limiter=self._check_limiter)
        except DomainError as exc:
            extra = [(k.lower().encode(), v.encode()) for k, v in (headers_of(exc) or {}).items()]
            await _send_error(send, status_of(exc), exc.message, exc.code, extra, exc.param)
            return
        if self.cache_seconds > 0:
            if len(self.cache) >= self.CACHE_LIMIT:
                self.cache.clear()
            self.cache[digest] = (time.monotonic() + self.cache_seconds, caller)
        await self.admit(caller, scope, receive, send, path=path)

    async def _body_bytes(self, key: str, scope: Scope) -> float | None:
        """Seconds until the key's body bytes allow this request's body (None: they allow it now)."""
        if self.bytes_limiter is None or scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        if app_path(scope).rstrip("/") in UPLOADS:
            return None
        declared = dict(scope.get("headers") or []).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else UNDECLARED_BODY
        if not size:
            return None
        allowed, _, retry, _ = await self._take(self.bytes_limiter, "bytes", key, cost=size)
        return None if allowed else retry

    async def _take(
        self, limiter: RateLimiter, name: str, key: str, cost: float = 1.0
    ) -> tuple[bool, int, float, float]:
        """``limiter``'s answer for ``key``, counted in Redis where it answers, else in this process."""
        now = limits.clock()
        if self.shared is not None:
            answer = await self.shared.rate(name, key, rate=limiter.rate, burst=limiter.burst, cost=cost, now=now)
            if answer is not None:
                return answer
        return limiter.take(key, now, cost=cost)

    def _bytes_rule(self) -> str:
        assert self.bytes_limiter is not None
        rate, burst = self.bytes_limiter.rate, self.bytes_limiter.burst
        return f"{rate / 2**20:g} MiB of request bodies a second, bursts of {burst / 2**20:g} MiB"

    async def admit(self, caller: Any, scope: Scope, receive: Receive, send: Send, *, path: str) -> None:
        """Run the request as ``caller`` if its key has a request left (of the Tinker loops' own limit,
        for one of their requests) and room for its body's bytes, with the x-ratelimit headers on
        the answer, else a 429 that says when to retry (the openai SDK waits that long itself; the
        Tinker SDK backs off); and if the key is still usable and holds the route's scope
        (``service.api.route_scopes``), else its 401 or 403."""
        scope.setdefault("state", {})["caller"] = caller
        tinker = path in TINKER_LOOP_PATHS
        key = caller.key_id or caller.id  # by the key's id (two keys of one project count apart)
        limit_headers: list[tuple[bytes, bytes]] = []
        limiter = self.tinker_limiter if tinker else self.limiter
        if limiter is not None:
            allowed, remaining, retry, reset = await self._take(limiter, "tinker" if tinker else "requests", key)
            limit_headers = [
                (b"x-ratelimit-limit-requests", str(limiter.burst).encode()),
                (b"x-ratelimit-remaining-requests", str(remaining).encode()),
                (b"x-ratelimit-reset-requests", _duration(reset).encode()),
            ]
            if not allowed:
                rule = f"{limiter.rate:g} requests a second, bursts of {limiter.burst}"
                if tinker:
                    rule += " of a Tinker loop's requests"
                await _refuse(send, rule, retry, limit_headers)
                return
        if (retry_bytes := await self._body_bytes(key, scope)) is not None:
            close = [(b"connection", b"close")]  # its body is never read
            await _refuse(send, self._bytes_rule(), retry_bytes, limit_headers + close)
            return
        try:
            check_access(caller, scope["method"], path)
        except DomainError as exc:
            extra = [(k.lower().encode(), v.encode()) for k, v in (headers_of(exc) or {}).items()]
            await _send_error(send, status_of(exc), exc.message, exc.code, extra + limit_headers, exc.param)
            return
        if not limit_headers:
            await self.app(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *limit_headers]}
            await send(message)

        await self.app(scope, receive, send_with_limits)


def check_access(caller: Any, method: str, path: str) -> None:
    """Raise the 401 of an expired key, the 403 of an archived project's key, or the 403 of a key
    without the scope this route needs."""
    from service.api import route_scopes as scopes
    from service.core.errors import insufficient_scope, operator_only
    from service.tenancy.keys import check_usable

    check_usable(caller)
    found = scopes.needed(method, path)
    if found is None or not found[1] or any(caller.may(s) for s in found[1]):
        return
    route = f"{method} {found[0]}"
    raise operator_only(route) if found[1] == scopes.OPERATOR else insufficient_scope(route, found[1])


async def _refuse(send: Send, rule: str, retry: float, headers: list[tuple[bytes, bytes]]) -> None:
    retry_ms = max(1, math.ceil(retry * 1000))
    message = f"Rate limit reached for this API key: {rule}. Retry in {retry_ms / 1000:.3g} s."
    extra = [(b"retry-after", str(max(1, math.ceil(retry))).encode()), (b"retry-after-ms", str(retry_ms).encode())]
    await _send_error(send, 429, message, "rate_limit_exceeded", extra + headers)


OPEN_TINKER_PATHS = ("/api/v1/healthz",)
"""The Tinker protocol's paths that answer without a key (every other /api/v1 path takes one)."""
OPEN_TINKER_PREFIXES = ("/api/v1/downloads/",)
"""... and where a checkpoint's download links lead (the link's random token is the credential)."""
TINKER_LOOP_PATHS = frozenset(
    f"/api/v1/{name}"
    for name in (
        "asample",
        "retrieve_future",
        "cancel_future",
        "forward_backward",
        "optim_step",
        "session_heartbeat",
        "telemetry",
        "client/dynamic_config",
    )
)
"""The Tinker protocol's requests a loop sends many of (a sample and its polls, a step's calls, the
SDK's beats): counted against RLOO_RATE_LIMIT_TINKER. Its other requests (sessions, models, saves,
loads, checkpoints) are few and count against RLOO_RATE_LIMIT, as the rest of the API's do."""
UPLOADS = ("/v1/files",)
"""Where bodies are uploads, bounded by RLOO_MAX_UPLOAD_BYTES and not by the byte rate."""
UNDECLARED_BODY = 8 * 1024 * 1024
"""What a body without a Content-Length counts against the byte rate: the JSON limit."""


async def _send_error(
    send: Send, status: int, message: str, code: str | None, extra: list[tuple[bytes, bytes]], param: str | None = None
) -> None:
    body = json.dumps(error_body(status, message, param, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})

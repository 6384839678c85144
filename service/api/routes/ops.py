"""The operator's routes, outside ``/v1`` and its keys: ``/healthz`` (the process is alive),
``/readyz`` (the database and the broker answer) and ``/metrics`` (Prometheus, loopback or the
operator's token)."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sqlalchemy import text

from service.api import prometheus as prometheus_module
from service.api.errors import APIError
from service.core.db import get_engine
from service.core.settings import Settings


def router(settings: Settings, prometheus: prometheus_module.Metrics) -> APIRouter:
    """The routes of one app, scraping ``prometheus``."""
    router = APIRouter()

    @router.get("/healthz", tags=["ops"], summary="The process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz", tags=["ops"], summary="Database and broker are reachable")
    def readyz(request: Request) -> JSONResponse:
        checks: dict[str, Any] = {}
        try:
            with get_engine().connect() as conn:
                conn.execute(text("SELECT 1"))
            checks["database"] = "ok"
        except Exception as exc:
            checks["database"] = f"unreachable: {type(exc).__name__}"
        try:
            client = redis.Redis.from_url(settings.redis_client_url, socket_timeout=1, socket_connect_timeout=1)
            client.ping()
            client.close()
            checks["broker"] = "ok"
        except Exception as exc:
            checks["broker"] = f"unreachable: {type(exc).__name__}"
        ok = all(v == "ok" for v in checks.values())
        from service.graders.sandbox import configured

        # The sandbox python graders are set to run in; each worker's start-up log says whether it
        # runs there (the API runs no grader, and starts no sandbox for an anonymous caller).
        body = {"status": "ok" if ok else "unavailable", "checks": checks, "python_graders": configured(settings)}
        limits = getattr(request.app.state, "limits", None)
        if limits is not None:  # counted in Redis over every API process, or in each while it is down
            body["limits"] = limits.state()
        return JSONResponse(body, 200 if ok else 503)

    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    @router.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={
            401: {"description": "RLOO_METRICS_TOKEN is set, and this is not it.", **error},
            403: {"description": "Not this host's loopback, and RLOO_METRICS_TOKEN is not set.", **error},
        },
    )
    def metrics(request: Request) -> Response:
        """Jobs, the queue, steps and request latency (service.api.prometheus)."""
        _metrics_allowed(request, settings.metrics_token)
        return Response(prometheus.scrape(), media_type=prometheus_module.CONTENT_TYPE)

    return router


def _metrics_allowed(request: Request, token: str | None) -> None:
    """Counts over every project are the operator's: with RLOO_METRICS_TOKEN set, /metrics wants it
    as a bearer token (Prometheus' ``authorization`` setting); unset, it answers only clients on this
    host's loopback (behind a proxy: the address the proxy forwards)."""
    if token:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(
                401,
                "/metrics wants the operator's token (RLOO_METRICS_TOKEN) as 'Authorization: Bearer'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise APIError(
            403,
            "/metrics answers this host's loopback only; set RLOO_METRICS_TOKEN to scrape it from "
            "elsewhere with that token.",
            code="metrics_forbidden",
        )

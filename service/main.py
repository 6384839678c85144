"""The ASGI app: ``uvicorn service.main:app``. Validates, stores, answers; never imports torch."""

from __future__ import annotations

import hmac
import ipaddress
import logging
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sqlalchemy import text

from service.api import errors as api_errors
from service.api import openapi
from service.api import prometheus as prometheus_module
from service.api.errors import APIError
from service.api.middleware import AuthMiddleware, BodyLimitMiddleware
from service.api.routes import completions, dashboard, evaluations, files, graders, jobs, models, webhooks, workers
from service.core import logs
from service.core.db import get_engine, session_scope
from service.core.settings import get_settings

log = logging.getLogger("rloo.api")


@asynccontextmanager
async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
    settings = get_settings()
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    try:  # what an API process killed mid-upload left behind (workers sweep too, periodically)
        from service.files.upload_sweep import sweep_uploads

        with session_scope() as session:
            sweep_uploads(session, settings.artifacts_dir)
    except Exception as exc:  # the database is not up yet: the workers' sweep will do it
        log.warning("sweeping interrupted uploads failed: %s", exc)
    yield


def create_app() -> FastAPI:
    settings = get_settings()
    logs.configure(settings.log_format)
    app = FastAPI(
        title="rloo-service",
        version="0.1.0",
        description="RLOO reinforcement fine-tuning as a service, in the shape of OpenAI's fine-tuning API.",
        lifespan=lifespan,
    )
    api_errors.install(app)
    # Uploads are bounded while they stream, not after: a 50 GB body is refused at the first byte over.
    app.add_middleware(
        BodyLimitMiddleware, max_upload_bytes=settings.max_upload_bytes + 64 * 1024, max_json_bytes=8 * 1024 * 1024
    )
    # Added after, so it runs before the body limit (outermost). It also holds the per-key rate limits
    # (RLOO_RATE_LIMIT, RLOO_RATE_LIMIT_BURST; RLOO_RATE_LIMIT_BODY_BYTES, _BURST), counted in this
    # process's memory.
    app.add_middleware(
        AuthMiddleware,
        cache_seconds=settings.auth_cache_seconds,
        rate_limit=settings.rate_limit,
        rate_limit_burst=settings.rate_limit_burst,
        body_bytes_rate=settings.rate_limit_body_bytes,
        body_bytes_burst=settings.rate_limit_body_bytes_burst,
    )
    # Outside the key check, which reads the database too: an unreachable database is a 503 anywhere.
    app.add_middleware(api_errors.DatabaseUnavailableMiddleware)
    prometheus = prometheus_module.Metrics()
    # Outermost: a request's whole time, the key check and the limits included.
    app.add_middleware(prometheus_module.RequestTimer, metrics=prometheus)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.include_router(files.router)
    app.include_router(jobs.router)
    app.include_router(graders.router)
    app.include_router(models.router)
    app.include_router(webhooks.router)
    app.include_router(completions.router)
    app.include_router(evaluations.router)
    app.include_router(workers.router)
    dashboard.install(app)

    @app.get("/healthz", tags=["ops"], summary="The process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Database and broker are reachable")
    def readyz() -> JSONResponse:
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
        return JSONResponse(body, 200 if ok else 503)

    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    @app.get(
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

    openapi.install(app)
    return app


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


app = create_app()

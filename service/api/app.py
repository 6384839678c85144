"""The FastAPI app of the HTTP layer: its routers, middleware and lifespan (``create_app``).
``service.main:app`` is the app built once, for uvicorn. Validates, stores, answers; never imports torch."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from service.api import errors as api_errors
from service.api import openapi
from service.api import prometheus as prometheus_module
from service.api.audit import AuditMiddleware
from service.api.middleware import AuthMiddleware, BodyLimitMiddleware
from service.api.routes import (
    audit,
    completions,
    dashboard,
    evals,
    evaluations,
    files,
    graders,
    jobs,
    keys,
    models,
    ops,
    projects,
    tinker,
    tinker_runs,
    usage,
    webhooks,
    workers,
)
from service.core import logs
from service.core.db import session_scope
from service.core.settings import Settings, get_settings

log = logging.getLogger("rloo.api")


@asynccontextmanager
async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
    settings = get_settings()
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    try:  # what an API process killed mid-upload left behind (workers sweep too, periodically)
        from service.files.upload_sweep import sweep_uploads

        with session_scope() as session:
            sweep_uploads(session, settings.artifacts_dir)
    except Exception as exc:  # the database is not up yet: the workers' sweep will do it
        log.warning("sweeping interrupted uploads failed: %s", exc)
    yield
    await app.state.limits.close()  # its Redis connection (service.infra.limits)


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
    prometheus = _add_middleware(app, settings)
    app.include_router(files.router)
    app.include_router(jobs.router)
    app.include_router(graders.router)
    app.include_router(models.router)
    app.include_router(webhooks.router)
    app.include_router(completions.router)
    app.include_router(evaluations.router)
    app.include_router(evals.router)
    app.include_router(workers.router)
    app.include_router(keys.router)
    app.include_router(projects.router)
    app.include_router(audit.router)
    app.include_router(usage.router)
    app.include_router(tinker.router)
    app.include_router(tinker_runs.router)
    dashboard.install(app)
    app.include_router(ops.router(settings, prometheus))
    openapi.install(app)
    return app


def _add_middleware(app: FastAPI, settings: Settings) -> prometheus_module.Metrics:
    """The middleware, innermost first (each added runs before those added earlier): the body
    limits, the key check and rate limits, the audit, the database's 503, the request timer, CORS.
    Returns the metrics the timer counts into."""
    from service.infra.limits import SharedLimits

    # The rate limits and stream caps every API process sharing this Redis counts together.
    app.state.limits = SharedLimits(settings.redis_client_url, settings.queue)
    # Uploads are bounded while they stream, not after: a 50 GB body is refused at the first byte over.
    app.add_middleware(
        BodyLimitMiddleware, max_upload_bytes=settings.max_upload_bytes + 64 * 1024, max_json_bytes=8 * 1024 * 1024
    )
    # Added after, so it runs before the body limit (outermost). It also holds the per-key rate limits
    # (RLOO_RATE_LIMIT, RLOO_RATE_LIMIT_BURST; the Tinker protocol's RLOO_RATE_LIMIT_TINKER, _BURST;
    # RLOO_RATE_LIMIT_BODY_BYTES, _BURST), counted in Redis (this process's memory while it is down).
    app.add_middleware(
        AuthMiddleware,
        cache_seconds=settings.auth_cache_seconds,
        rate_limit=settings.rate_limit,
        rate_limit_burst=settings.rate_limit_burst,
        tinker_rate_limit=settings.rate_limit_tinker,
        tinker_rate_limit_burst=settings.rate_limit_tinker_burst,
        body_bytes_rate=settings.rate_limit_body_bytes,
        body_bytes_burst=settings.rate_limit_body_bytes_burst,
        shared=app.state.limits,
    )
    # Outside the key check, so that it sees its refusals too (403 insufficient_scope): each mutating
    # request's audit row (service.api.audit).
    app.add_middleware(AuditMiddleware)
    # Outside the key check, which reads the database too: an unreachable database is a 503 anywhere.
    app.add_middleware(api_errors.DatabaseUnavailableMiddleware)
    prometheus = prometheus_module.Metrics()
    # Outermost: a request's whole time, the key check and the limits included.
    app.add_middleware(prometheus_module.RequestTimer, metrics=prometheus)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    return prometheus

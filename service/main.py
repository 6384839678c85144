"""The ASGI app: ``uvicorn service.main:app``, built by ``service.api.app.create_app`` (the HTTP
layer holds every import of the framework)."""

from __future__ import annotations

from service.api.app import create_app

__all__ = ["app", "create_app"]

app = create_app()

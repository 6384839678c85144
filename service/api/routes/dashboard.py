"""The dashboard: static files shipped in the package (``service/api/dashboard``), no build step. ``GET /``
redirects to it. It reads the API with the key its user types (kept in the browser tab)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

FILES = Path(__file__).resolve().parent.parent / "dashboard"


def install(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", StaticFiles(directory=FILES, html=True), name="dashboard")

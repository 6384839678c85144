"""Calling the API and checking its answers: OpenAI's error shape, uploads, jobs, pages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.data import TRAIN_JSONL

LOCAL = ("127.0.0.1", 50000)
"""The test client's address: a caller on this host's loopback (``/metrics`` answers only those,
unless RLOO_METRICS_TOKEN is set)."""

ERROR_TYPES = {
    **dict.fromkeys((400, 401, 403, 404, 405, 409, 410, 413, 415, 416, 431), "invalid_request_error"),
    429: "requests",
    **dict.fromkeys((500, 502, 503, 504), "server_error"),
}
ANY = object()


def assert_error(
    resp: httpx.Response,
    status: int,
    *,
    param: Any = ANY,
    code: Any = ANY,
    contains: str | list[str] | None = None,
) -> dict[str, Any]:
    """Exact status and OpenAI's error body; returns the inner error object."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text}"
    assert resp.headers["content-type"].startswith("application/json"), resp.headers["content-type"]
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert err["type"] == ERROR_TYPES[status], err
    if param is not ANY:
        assert err["param"] == param, err
    if code is not ANY:
        assert err["code"] == code, err
    for needle in [contains] if isinstance(contains, str) else contains or []:
        assert needle in err["message"], err
    return err


def each(cases: Any, check: Callable[..., None]) -> None:
    """Run ``check`` on every case (a dict name -> args, or a list of args) and report every failure
    at once: one test, one database, many cases."""
    items = cases.items() if isinstance(cases, dict) else ((repr(c)[:80], c) for c in cases)
    failures = []
    for name, case in items:
        try:
            check(*case) if isinstance(case, tuple) else check(case)
        except AssertionError as exc:
            failures.append(f"[{name}] {str(exc)[:600]}")
    assert not failures, f"{len(failures)} case(s) failed:\n" + "\n".join(failures)


def upload(
    client: Any,
    auth: dict[str, str],
    content: bytes = TRAIN_JSONL,
    *,
    filename: str = "train.jsonl",
    purpose: str = "fine-tune",
) -> httpx.Response:
    return client.post(
        "/v1/files",
        headers=auth,
        files={"file": (filename, content, "application/jsonl")},
        data={"purpose": purpose},
    )


def upload_ok(client: Any, auth: dict[str, str], content: bytes = TRAIN_JSONL, **kw: Any) -> dict[str, Any]:
    resp = upload(client, auth, content, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


def create_job(client: Any, auth: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stored_files(env: dict[str, str]) -> list[Path]:
    """Every regular file under the artifacts' files/ folder (temporary uploads included)."""
    root = Path(env["RLOO_HOME"]) / "artifacts" / "files"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def list_ids(client: Any, auth: dict[str, str], url: str) -> list[str]:
    resp = client.get(url, headers=auth)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and isinstance(body["has_more"], bool)
    return [item["id"] for item in body["data"]]


def fresh_client(monkeypatch: pytest.MonkeyPatch, **env_values: str) -> Any:
    """A TestClient on a new app built after setting ``env_values`` (settings are read at build time)."""
    from fastapi.testclient import TestClient

    from service.core.db import reset_caches
    from service.main import create_app

    for key, value in env_values.items():
        monkeypatch.setenv(key, value)
    reset_caches()
    return TestClient(create_app(), client=LOCAL)


def make_key(project: str, *, operator: bool = False, scopes: list[str] | None = None) -> str:
    """A new key of ``project`` (an operator's key with ``operator``; only ``scopes``, where given)."""
    from service.core.db import session_scope
    from service.tenancy import keys, projects
    from service.tenancy import scopes as scope_names

    with session_scope() as session:
        proj = projects.get_or_create_project(session=session, name=project)
        held = None if scopes is None else scope_names.parse(scopes)
        _, secret = keys.create_api_key(session=session, project=proj, operator=operator, scopes=held)
        session.commit()
    return secret

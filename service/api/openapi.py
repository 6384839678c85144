"""The OpenAPI document (``/openapi.json``, ``/docs``) as the API behaves: every error an operation can
answer, in the one error shape, and no FastAPI 422 (validation errors here are 400s)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Error",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "What went wrong and what to change."},
                "type": {
                    "type": "string",
                    "description": "invalid_request_error (4xx), requests (429), server_error (5xx)",
                },
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "The field at fault."},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "Machine-readable."},
            },
        }
    },
}

WHY = {
    "400": "Invalid request: `param` names the field, `message` what to change.",
    "401": "Missing, invalid or revoked API key.",
    "403": "The key lacks the scope this route needs (`insufficient_scope`), its project is archived, the route "
    "is the operator's, or it is not allowed on this object (a base model cannot be deleted).",
    "404": "No such object in this project (another project's objects are not found either).",
    "405": "Method not allowed on this path.",
    "409": "Conflict: the object's state does not allow it, or an Idempotency-Key reused for another request.",
    "410": "The file's or checkpoint's content is gone from storage.",
    "413": "The request body is over the limit.",
    "416": "The byte range asked for (`Range`) starts past the archive's end.",
    "429": "Rate limit of this key exceeded, or a project's cap (waiting jobs, grader runs in progress): retry "
    "after `Retry-After` seconds.",
    "500": "The inference worker failed on this request (a model that would not load, a merge that failed).",
    "502": "The grader could not be reached, failed, or ended the worker process that ran it.",
    "503": "The database or the queue is unreachable, no inference worker is running, or the one serving the "
    "request stopped: retry after `Retry-After` seconds.",
    "504": "No grader worker answered in time, or a completion took longer than RLOO_INFERENCE_TIMEOUT_SECONDS.",
}

# Statuses beyond the ones every /v1 operation may answer (400, 401, 403, 429, 503), by operation.
CONFLICTS = ("/cancel", "/pause", "/resume", "/archive")
INFERENCE = ("/v1/chat/completions", "/v1/completions")


def _statuses(path: str, method: str, operation: dict[str, Any]) -> list[str]:
    statuses = ["400", "401", "403", "429", "503"]  # 403: a key without the route's scope
    params = {p.get("name") for p in operation.get("parameters", [])}
    if "{" in path or "after" in params:
        statuses.append("404")
    if method == "post":
        statuses.append("413")
    if (method == "post" and path in ("/v1/files", "/v1/fine_tuning/jobs", "/v1/projects")) or path.endswith(CONFLICTS):
        statuses.append("409")
    if method == "delete" and path.startswith("/v1/files/"):
        statuses.append("409")
    if path.endswith("/files/{file_id}/content"):
        statuses.append("410")
    if path.endswith("/checkpoints/{checkpoint_id}/content"):
        statuses += ["410", "416", "500"]  # 500: a merged export that failed
    if path in INFERENCE:
        statuses += ["404", "500", "504"]  # 404: the model
    if path.endswith("/graders/run"):
        statuses += ["502", "504"]
    return sorted(statuses)


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if not path.startswith("/v1/"):
                continue
            for status in _statuses(path, method, operation):
                responses.setdefault(
                    status,
                    {
                        "description": WHY[status],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                    },
                )
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = document_errors(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

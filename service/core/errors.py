"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, raised by the domain
code (a spec's checks, a dataset's, exports, idempotency) and the routes alike. No HTTP layer here:
``service.api.errors`` is the one place that turns them (and the framework's own) into responses, so
``rloo train`` checks a spec with the API's code and the API's messages without loading FastAPI."""

from __future__ import annotations

from typing import Any

_TYPES = {429: "requests"}
"""OpenAI's error ``type``: ``invalid_request_error`` for every 4xx (a bad key, an unknown id, a state
that forbids the change, too large), ``requests`` for a rate limit, ``server_error`` for 5xx; the
``code`` says which."""


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(what: str, id_: str, param: str | None = None) -> APIError:
    return APIError(404, f"No {what} with id '{id_}' in this project.", param=param, code="not_found")


def model_not_found(model_id: str) -> APIError:
    """OpenAI's 404 for a model: unknown, another project's, or deleted."""
    return APIError(
        404,
        f"The model '{model_id}' does not exist or you do not have access to it (GET /v1/models lists yours).",
        param="model",
        code="model_not_found",
    )


def operator_only(what: str) -> APIError:
    """403 for a project's key on an operator's route (``deps.OperatorDep``)."""
    return APIError(
        403,
        f"{what} is the operator's, over every project: ask with an operator key "
        "(`rloo keys create --project NAME --operator`).",
        code="insufficient_permissions",
    )


def no_inference_worker(needed_for: str) -> APIError:
    """503 when work for an inference worker finds none running: what it was needed for, how to start one."""
    return APIError(
        503,
        f"{needed_for}: start one with `rloo worker --serve` (`rloo up` starts one).",
        code="no_inference_worker",
        headers={"Retry-After": "5"},
    )


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}

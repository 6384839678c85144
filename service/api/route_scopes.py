"""Which scope each route needs (``service.tenancy.scopes`` says what each one means): one table,
checked by the AuthMiddleware before a request's body is read, printed in docs/api.md, and held
against the app's routes by the tests (a route missing here fails them).

A route takes a key holding any one of its scopes; ``ANY``: every valid key of the project.
``operator``: only an operator's key."""

from __future__ import annotations

import re
from functools import lru_cache

ANY: tuple[str, ...] = ()
OPERATOR = ("operator",)
FILES_READ, FILES_WRITE = ("files:read",), ("files:write",)
JOBS_READ, JOBS_WRITE = ("jobs:read",), ("jobs:write",)
MODELS_READ, MODELS_WRITE = ("models:read",), ("models:write",)
INFERENCE, WEBHOOKS, KEYS = ("inference",), ("webhooks",), ("keys",)

JOB = "/v1/fine_tuning/jobs/{job_id}"
EVAL_RUN = "/v1/evals/{eval_id}/runs/{run_id}"
HOOK = "/v1/webhook_endpoints/{endpoint_id}"
TINKER_CHECKPOINT = "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}"

ROUTE_SCOPES: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/v1/me"): ANY,
    # Files
    ("GET", "/v1/files"): FILES_READ,
    ("POST", "/v1/files"): FILES_WRITE,
    ("GET", "/v1/files/{file_id}"): FILES_READ,
    ("DELETE", "/v1/files/{file_id}"): FILES_WRITE,
    ("GET", "/v1/files/{file_id}/content"): FILES_READ,
    # Fine-tuning jobs, their evaluations, graders
    ("GET", "/v1/fine_tuning/jobs"): JOBS_READ,
    ("POST", "/v1/fine_tuning/jobs"): JOBS_WRITE,
    ("POST", "/v1/fine_tuning/jobs/estimate"): JOBS_READ,
    ("GET", JOB): JOBS_READ,
    ("POST", JOB + "/cancel"): JOBS_WRITE,
    ("POST", JOB + "/pause"): JOBS_WRITE,
    ("POST", JOB + "/resume"): JOBS_WRITE,
    ("GET", JOB + "/events"): JOBS_READ,
    ("GET", JOB + "/metrics"): JOBS_READ,
    ("GET", JOB + "/samples"): JOBS_READ,
    ("GET", JOB + "/checkpoints"): JOBS_READ,
    ("GET", JOB + "/checkpoints/{checkpoint_id}/content"): JOBS_READ,
    ("GET", JOB + "/evaluations"): JOBS_READ,
    ("POST", JOB + "/evaluations"): JOBS_WRITE,
    ("GET", JOB + "/evaluations/{evaluation_id}"): JOBS_READ,
    ("POST", JOB + "/evaluations/{evaluation_id}/cancel"): JOBS_WRITE,
    ("POST", "/v1/fine_tuning/alpha/graders/validate"): JOBS_READ,
    ("POST", "/v1/fine_tuning/alpha/graders/run"): JOBS_WRITE,
    # Evals
    ("GET", "/v1/evals"): JOBS_READ,
    ("POST", "/v1/evals"): JOBS_WRITE,
    ("GET", "/v1/evals/{eval_id}"): JOBS_READ,
    ("POST", "/v1/evals/{eval_id}"): JOBS_WRITE,
    ("DELETE", "/v1/evals/{eval_id}"): JOBS_WRITE,
    ("GET", "/v1/evals/{eval_id}/runs"): JOBS_READ,
    ("POST", "/v1/evals/{eval_id}/runs"): JOBS_WRITE,
    ("GET", EVAL_RUN): JOBS_READ,
    ("POST", EVAL_RUN): JOBS_WRITE,
    ("DELETE", EVAL_RUN): JOBS_WRITE,
    ("POST", EVAL_RUN + "/cancel"): JOBS_WRITE,
    ("GET", EVAL_RUN + "/output_items"): JOBS_READ,
    ("GET", EVAL_RUN + "/output_items/{output_item_id}"): JOBS_READ,
    # Models and inference
    ("GET", "/v1/models"): MODELS_READ,
    ("GET", "/v1/models/{model_id:path}"): MODELS_READ,
    ("DELETE", "/v1/models/{model_id:path}"): MODELS_WRITE,
    ("POST", "/v1/chat/completions"): INFERENCE,
    ("POST", "/v1/completions"): INFERENCE,
    # Webhooks
    ("GET", "/v1/webhook_endpoints"): WEBHOOKS,
    ("POST", "/v1/webhook_endpoints"): WEBHOOKS,
    ("GET", HOOK): WEBHOOKS,
    ("POST", HOOK): WEBHOOKS,
    ("DELETE", HOOK): WEBHOOKS,
    ("POST", HOOK + "/rotate_secret"): WEBHOOKS,
    ("POST", HOOK + "/test"): WEBHOOKS,
    ("GET", HOOK + "/deliveries"): WEBHOOKS,
    # The project's admin
    ("GET", "/v1/keys"): KEYS,
    ("POST", "/v1/keys"): KEYS,
    ("GET", "/v1/keys/{key_id}"): KEYS,
    ("DELETE", "/v1/keys/{key_id}"): KEYS,
    ("GET", "/v1/audit"): KEYS,
    ("GET", "/v1/usage"): JOBS_READ,
    # The operator's, over every project
    ("GET", "/v1/workers"): OPERATOR,
    ("GET", "/v1/projects"): OPERATOR,
    ("POST", "/v1/projects"): OPERATOR,
    ("GET", "/v1/projects/{project_id}"): OPERATOR,
    ("POST", "/v1/projects/{project_id}"): OPERATOR,
    ("POST", "/v1/projects/{project_id}/archive"): OPERATOR,
    ("POST", "/v1/projects/{project_id}/restore"): OPERATOR,
    ("GET", "/v1/projects/{project_id}/keys"): OPERATOR,
    ("POST", "/v1/projects/{project_id}/keys"): OPERATOR,
    # The Tinker protocol: a training session is a job; sampling is inference
    ("POST", "/api/v1/client/config"): ANY,
    ("POST", "/api/v1/client/dynamic_config"): ANY,
    ("POST", "/api/v1/telemetry"): ANY,
    ("GET", "/api/v1/get_server_capabilities"): ANY,
    ("POST", "/api/v1/create_session"): ("jobs:write", "inference"),
    ("POST", "/api/v1/session_heartbeat"): ("jobs:write", "inference"),
    ("POST", "/api/v1/retrieve_future"): ("jobs:read", "inference"),
    ("POST", "/api/v1/cancel_future"): ("jobs:write", "inference"),
    ("POST", "/api/v1/create_model"): JOBS_WRITE,
    ("POST", "/api/v1/get_info"): JOBS_READ,
    ("POST", "/api/v1/forward_backward"): JOBS_WRITE,
    ("POST", "/api/v1/optim_step"): JOBS_WRITE,
    ("POST", "/api/v1/save_weights"): JOBS_WRITE,
    ("POST", "/api/v1/save_weights_for_sampler"): JOBS_WRITE,
    ("POST", "/api/v1/save_weights_external"): JOBS_WRITE,
    ("POST", "/api/v1/load_weights"): JOBS_WRITE,
    ("POST", "/api/v1/weights_info"): JOBS_READ,
    ("POST", "/api/v1/create_sampling_session"): INFERENCE,
    ("GET", "/api/v1/samplers/{sampler_id}"): INFERENCE,
    ("POST", "/api/v1/asample"): INFERENCE,
    ("GET", "/api/v1/training_runs"): JOBS_READ,
    ("GET", "/api/v1/training_runs/{model_id}"): JOBS_READ,
    ("GET", "/api/v1/training_runs/{model_id}/steps"): JOBS_READ,
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints"): JOBS_READ,
    ("GET", "/api/v1/checkpoints"): JOBS_READ,
    ("DELETE", TINKER_CHECKPOINT): JOBS_WRITE,
    ("PUT", TINKER_CHECKPOINT + "/ttl"): JOBS_WRITE,
    ("GET", TINKER_CHECKPOINT + "/external_weights_urls"): JOBS_READ,
    ("GET", "/api/v1/sessions"): JOBS_READ,
    ("GET", "/api/v1/sessions/{session_id}"): JOBS_READ,
}
"""(method, path template) -> the scopes any one of which lets a key call it."""


def _pattern(template: str) -> re.Pattern[str]:
    """A template's regex, as Starlette's router reads it: ``{name}`` one path segment, ``{name:path}``
    the rest of the path (an empty rest too)."""
    parts = re.split(r"(\{[^}]+\})", template)
    pieces = [(".*" if p.endswith(":path}") else "[^/]+") if p.startswith("{") else re.escape(p) for p in parts]
    return re.compile("^" + "".join(pieces) + "/?$")


@lru_cache(maxsize=1)
def _compiled() -> dict[str, list[tuple[re.Pattern[str], str, tuple[str, ...]]]]:
    by_method: dict[str, list[tuple[re.Pattern[str], str, tuple[str, ...]]]] = {}
    # Fixed paths before templated ones, so that /v1/fine_tuning/jobs/estimate is not a job's id.
    for (method, template), needed in sorted(ROUTE_SCOPES.items(), key=lambda kv: "{" in kv[0][1]):
        by_method.setdefault(method, []).append((_pattern(template), template, needed))
    return by_method


def needed(method: str, path: str) -> tuple[str, tuple[str, ...]] | None:
    """The route template ``method path`` matches and the scopes it takes, or None for a path that
    is no route (the router answers it: 404 or 405)."""
    for pattern, template, scopes in _compiled().get("GET" if method == "HEAD" else method, ()):
        if pattern.match(path):
            return template, scopes
    return None

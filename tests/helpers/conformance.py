"""Our answers against OpenAI's own schemas (``tests/openai/openapi-schemas.json``, a subset of
openai/openai-openapi; see ``tests/openai/README.md``): ``conforms(body, "FineTuningJob")``.

Where we differ on purpose, the difference is named here, once (``_differ_on_purpose``), and the
README's table lists it. Nothing else differs: an answer that does not fit fails the test that got it.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import httpx
from jsonschema import Draft202012Validator

from tests.helpers.data import ROOT

SCHEMAS = ROOT / "tests" / "openai" / "openapi-schemas.json"


def _differ_on_purpose(schemas: dict[str, Any]) -> None:
    """Where our answers go beyond OpenAI's schemas on purpose (the README's table lists each)."""
    # `paused`: a job can be paused and resumed here (OpenAI's API has the status; its document not).
    schemas["FineTuningJob"]["properties"]["status"]["enum"].append("paused")
    # `rloo`: our name of the method, beside OpenAI's `reinforcement`, answered as it was sent.
    method = schemas["FineTuneMethod"]["properties"]
    method["type"]["enum"].append("rloo")
    # `method.rloo` also holds a reinforcement config whose grader OpenAI's types cannot (a reward
    # model, an http endpoint, a label_model outside a multi, a multi of several graders), so that
    # the SDK's strict parsing holds; graders/validate answers such a grader under `rloo.grader`.
    rloo_grader = {"type": "object", "required": ["type"]}
    method["rloo"] = {
        "type": "object",
        "properties": {"grader": rloo_grader, "hyperparameters": {"type": "object"}},
        "required": ["grader"],
    }
    schemas["ValidateGraderResponse"]["properties"]["rloo"] = {
        "type": "object",
        "properties": {"grader": rloo_grader},
        "required": ["grader"],
    }
    # An empty page has no first or last id.
    for listing in ("ListFilesResponse", "EvalList", "EvalRunList", "EvalRunOutputItemList"):
        for name in ("first_id", "last_id"):
            schemas[listing]["properties"][name] = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    # Files of an eval's items: purpose `evals` (OpenAI's own, which its file schema does not list).
    schemas["OpenAIFile"]["properties"]["purpose"]["enum"].append("evals")
    # An eval's testing criteria may be our graders too (a reward model, an http endpoint, a multi).
    criteria = schemas["Eval"]["properties"]["testing_criteria"]["items"]
    ours = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {"type": {"enum": ["reward_model", "http", "multi"]}},
    }
    schemas["Eval"]["properties"]["testing_criteria"]["items"] = {"anyOf": [criteria, ours]}
    # A template message fits both of the schema's message forms (EasyInputMessage and EvalItem),
    # which its oneOf forbids: any one of them.
    template = schemas["CreateEvalCompletionsRunDataSource"]["properties"]["input_messages"]["oneOf"][0]
    template["properties"]["template"]["items"] = {"anyOf": template["properties"]["template"]["items"]["oneOf"]}


def _rewrite(node: Any) -> Any:
    """OpenAPI 3.0 leftovers in a 3.1 document: ``exclusiveMinimum: true`` beside ``minimum`` means
    an exclusive minimum of that value (JSON Schema 2020-12 wants the number); ``nullable: true`` a
    null besides the type."""
    if isinstance(node, dict):
        out = {k: _rewrite(v) for k, v in node.items()}
        if out.get("exclusiveMinimum") is True and "minimum" in out:
            out["exclusiveMinimum"] = out.pop("minimum")
        elif out.get("exclusiveMinimum") is False:
            out.pop("exclusiveMinimum")
        if out.pop("nullable", False) is True:
            out = {"anyOf": [out, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [_rewrite(v) for v in node]
    return node


@functools.cache
def _document() -> dict[str, Any]:
    document = _rewrite(json.loads(SCHEMAS.read_text()))
    _differ_on_purpose(document["components"]["schemas"])
    return document


@functools.cache
def _validator(name: str) -> Draft202012Validator:
    document = copy.deepcopy(_document())
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return Draft202012Validator(schema)


def violations(body: Any, name: str) -> list[str]:
    """Where ``body`` breaks OpenAI's schema ``name``: one line each, the path and the reason."""
    errors = sorted(_validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors]


def assert_conforms(body: Any, name: str) -> None:
    problems = violations(body, name)
    assert problems == [], f"{name}: " + "; ".join(problems)


ROUTES: list[tuple[str, str, str]] = [
    # (method, path pattern, schema); ids are one path segment
    ("POST", "/v1/files", "OpenAIFile"),
    ("GET", "/v1/files", "ListFilesResponse"),
    ("GET", "/v1/files/*", "OpenAIFile"),
    ("DELETE", "/v1/files/*", "DeleteFileResponse"),
    ("POST", "/v1/fine_tuning/jobs", "FineTuningJob"),
    ("GET", "/v1/fine_tuning/jobs", "ListPaginatedFineTuningJobsResponse"),
    ("GET", "/v1/fine_tuning/jobs/*", "FineTuningJob"),
    ("POST", "/v1/fine_tuning/jobs/*/cancel", "FineTuningJob"),
    ("POST", "/v1/fine_tuning/jobs/*/pause", "FineTuningJob"),
    ("POST", "/v1/fine_tuning/jobs/*/resume", "FineTuningJob"),
    ("GET", "/v1/fine_tuning/jobs/*/events", "ListFineTuningJobEventsResponse"),
    ("GET", "/v1/fine_tuning/jobs/*/checkpoints", "ListFineTuningJobCheckpointsResponse"),
    ("POST", "/v1/fine_tuning/alpha/graders/validate", "ValidateGraderResponse"),
    ("POST", "/v1/fine_tuning/alpha/graders/run", "RunGraderResponse"),
    ("POST", "/v1/evals", "Eval"),
    ("GET", "/v1/evals", "EvalList"),
    ("GET", "/v1/evals/*", "Eval"),
    ("POST", "/v1/evals/*", "Eval"),
    ("POST", "/v1/evals/*/runs", "EvalRun"),
    ("GET", "/v1/evals/*/runs", "EvalRunList"),
    ("GET", "/v1/evals/*/runs/*", "EvalRun"),
    ("POST", "/v1/evals/*/runs/*", "EvalRun"),
    ("POST", "/v1/evals/*/runs/*/cancel", "EvalRun"),
    ("GET", "/v1/evals/*/runs/*/output_items", "EvalRunOutputItemList"),
    ("GET", "/v1/evals/*/runs/*/output_items/*", "EvalRunOutputItem"),
]
"""Which of OpenAI's schemas the answer of each of our routes must meet (errors: ``ErrorResponse``)."""


def schema_for(method: str, path: str, status: int) -> str | None:
    """The schema an answer must meet, or None for a route OpenAI has no counterpart of."""
    if not path.startswith("/v1/"):
        return None
    if status >= 400:
        return "ErrorResponse"
    parts = path.rstrip("/").split("/")
    for verb, pattern, name in ROUTES:
        wanted = pattern.split("/")
        same = verb == method and len(wanted) == len(parts)
        if same and all(w in ("*", p) for w, p in zip(wanted, parts, strict=True)):
            return name
    return None


def conforms(response: httpx.Response) -> None:
    """An httpx response hook: every JSON answer of a route OpenAI has meets OpenAI's schema for it
    (the ``client`` fixture installs it, so every API test checks every answer it gets)."""
    response.read()
    name = schema_for(response.request.method, response.request.url.path, response.status_code)
    if name and response.headers.get("content-type", "").startswith("application/json"):
        problems = violations(response.json(), name)
        assert problems == [], f"{response.request.method} {response.request.url.path} vs {name}: {problems}"

"""Reinforcement jobs with tools over HTTP: accepted as docs/tools.md shows them, refused with a 400
naming the field when a tool or a limit cannot be used, nothing stored then; a secret never
answered. Jobs go to a queue no worker consumes, so they stay ``queued``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.api import assert_error, create_job, upload_ok
from tests.helpers.data import TRAIN_JSONL, job_body

P = "method.reinforcement"
CALC = {"type": "function", "name": "calculator", "runtime": {"type": "builtin"}}
PREFIX = "http://127.0.0.1:9/tools/"


@pytest.fixture
def tool_urls(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_TOOL_URLS", json.dumps([PREFIX]))
    reset_caches()
    return PREFIX


def with_tools(training_file: str, tools: Any, multi_turn: Any = None, **hp: Any) -> dict[str, Any]:
    body = job_body(training_file, hp=hp)
    body["method"]["reinforcement"]["tools"] = tools
    if multi_turn is not None:
        body["method"]["reinforcement"]["multi_turn"] = multi_turn
    return body


def test_a_job_with_tools_is_stored_and_its_secret_never_answered(client, auth, tool_urls) -> None:
    f = upload_ok(client, auth, TRAIN_JSONL)["id"]
    lookup = {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "runtime": {"type": "http", "url": tool_urls + "lookup", "secret": "s3cret", "timeout_seconds": 3},
    }
    nested = {  # the Chat Completions form, its runtime inside function
        "type": "function",
        "function": {"name": "other", "runtime": {"type": "http", "url": tool_urls + "o", "secret": "s3cret"}},
    }
    job = create_job(
        client, auth, with_tools(f, [CALC, lookup, nested], {"max_turns": 3, "max_trajectory_tokens": 200})
    )
    config = job["method"].get("reinforcement") or job["method"]["rloo"]
    assert config["tools"][1]["runtime"]["secret"] == "***" and config["multi_turn"]["max_turns"] == 3
    again = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()
    assert "s3cret" not in json.dumps(again) and "s3cret" not in json.dumps(
        client.get("/v1/fine_tuning/jobs", headers=auth).json()
    )


def test_what_cannot_be_used_is_a_400_naming_it(client, auth, tool_urls) -> None:
    f = upload_ok(client, auth, TRAIN_JSONL)["id"]
    before = client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"]
    bad_schema = {**CALC, "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "not": deep}
    cases: list[tuple[dict[str, Any], str | None]] = [
        (with_tools(f, [bad_schema]), f"{P}.tools.0.parameters.properties.x.type"),
        (with_tools(f, [CALC, CALC]), f"{P}.tools.1.name"),
        (
            with_tools(f, [{**CALC, "name": "x", "runtime": {"type": "http", "url": "http://10.1.1.1/x"}}]),
            f"{P}.tools.0.runtime.url",
        ),
        (
            with_tools(f, [CALC], {"max_trajectory_tokens": 16}, max_new_tokens=16),
            f"{P}.multi_turn.max_trajectory_tokens",
        ),
        (with_tools(f, [CALC], {"max_trajectory_tokens": 100_000}), f"{P}.multi_turn.max_trajectory_tokens"),
        (with_tools(f, [CALC], {"max_turns": 0}), f"{P}.multi_turn.max_turns"),
        (with_tools(f, None, {"max_turns": 2}), f"{P}.multi_turn"),
        (with_tools(f, [CALC], stop=["</tool_call>"]), f"{P}.hyperparameters.stop"),
        (with_tools(f, [{**CALC, "parameters": deep}]), None),  # a 400, never a 500 (a validator's recursion)
    ]
    for body, param in cases:
        resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
        err = assert_error(resp, 400) if param is None else assert_error(resp, 400, param=param)
        assert err["message"], err
    assert client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == before  # nothing stored


def test_http_tools_are_off_until_the_operator_admits_their_urls(client, auth) -> None:
    f = upload_ok(client, auth, TRAIN_JSONL)["id"]
    tool = {**CALC, "name": "x", "runtime": {"type": "http", "url": PREFIX + "x"}}
    err = assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=with_tools(f, [tool])),
        400,
        param=f"{P}.tools.0.runtime.url",
    )
    assert "RLOO_TOOL_URLS" in err["message"]


def test_an_evaluation_of_a_job_with_tools_says_where_its_multi_turn_passes_are(client, auth) -> None:
    f = upload_ok(client, auth, TRAIN_JSONL)["id"]
    job = create_job(client, auth, with_tools(f, [CALC]))
    resp = client.post(f"/v1/fine_tuning/jobs/{job['id']}/evaluations", headers=auth, json={"file": f})
    err = assert_error(resp, 400, param="job_id", code="unsupported_for_tools")
    assert "rloo score" in err["message"] and "valid_reward_mean" in err["message"]

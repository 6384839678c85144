"""Graders (`/v1/fine_tuning/alpha/graders/validate` and `/run`): validation at the API, dry runs on
the session's graders worker.

Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set; every error is checked for its
exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.api import (
    assert_error,
    each,
)
from tests.helpers.data import STRING_CHECK

# Graders -------------------------------------------------------------------------------------------
MULTI = {
    "type": "multi",
    "name": "combo",
    "calculate_output": "0.7 * exact + 0.3 * not_blue",
    "graders": {
        "exact": STRING_CHECK,
        "not_blue": {
            "type": "string_check",
            "name": "not_blue",
            "input": "{{ sample.output_text }}",
            "reference": "blue",
            "operation": "ne",
        },
    },
}


def test_validate_grader(client, auth) -> None:
    def check(grader: dict[str, Any]) -> None:
        resp = client.post("/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": grader})
        assert resp.status_code == 200, resp.text
        # A multi of named graders is ours, not OpenAI's: it answers under rloo.grader.
        answer = resp.json()["grader"] if grader["type"] == "string_check" else resp.json()["rloo"]["grader"]
        assert answer["type"] == grader["type"] and answer["name"] == grader["name"]

    each({"string_check": STRING_CHECK, "multi": MULTI}, check)


GRADER_RUNS = [
    (STRING_CHECK, "red", {"answer": "red"}, 1.0, {"exact": 1.0}),
    (STRING_CHECK, "Red", {"answer": "red"}, 0.0, {"exact": 0.0}),
    (STRING_CHECK, "red ", {"answer": "red"}, 0.0, {"exact": 0.0}),
    ({**STRING_CHECK, "operation": "ilike"}, "It is RED.", {"answer": "red"}, 1.0, None),
    ({**STRING_CHECK, "operation": "like"}, "It is RED.", {"answer": "red"}, 0.0, None),
    (MULTI, "red", {"answer": "red"}, 1.0, {"exact": 1.0, "not_blue": 1.0}),  # 0.7 * 1 + 0.3 * 1
    (MULTI, "green", {"answer": "red"}, 0.3, {"exact": 0.0, "not_blue": 1.0}),  # 0.7 * 0 + 0.3 * 1
    (MULTI, "blue", {"answer": "red"}, 0.0, {"exact": 0.0, "not_blue": 0.0}),
    (MULTI, "blue", {"answer": "blue"}, 0.7, {"exact": 1.0, "not_blue": 0.0}),
]


def test_run_grader(client, auth, dry_runs) -> None:
    def check(
        grader: dict[str, Any], sample: str, item: dict[str, Any], reward: float, sub: dict[str, float] | None
    ) -> None:
        resp = client.post(
            "/v1/fine_tuning/alpha/graders/run",
            headers=auth,
            json={"grader": grader, "model_sample": sample, "item": item},
        )
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert {"reward", "sub_rewards", "metadata"} <= set(out)
        assert out["reward"] == pytest.approx(reward), out
        if sub is not None:
            assert out["sub_rewards"] == pytest.approx(sub), out

    each(GRADER_RUNS, check)


def test_run_grader_reference_answer_spelling(client, auth, dry_runs) -> None:
    grader = {**STRING_CHECK, "reference": "{{ item.reference_answer }}"}
    resp = client.post(
        "/v1/fine_tuning/alpha/graders/run",
        headers=auth,
        json={"grader": grader, "model_sample": "42", "reference_answer": "42"},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 1.0


INVALID_GRADERS = [
    ({**STRING_CHECK, "operation": "contains"}, "grader.operation"),
    ({k: v for k, v in STRING_CHECK.items() if k != "input"}, "grader.input"),
    ({"type": "regex", "name": "r"}, "grader.type"),
    ({"name": "no type"}, "grader.type"),
    ({**MULTI, "calculate_output": "__import__('os')"}, "grader.calculate_output"),
    (
        {
            **MULTI,
            "graders": {
                "exact": {**STRING_CHECK, "operation": "bogus"},
                "not_blue": MULTI["graders"]["not_blue"],
            },
        },
        "grader.graders.exact.operation",
    ),
    ({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}, "grader.type"),
]


def test_invalid_grader_is_400(client, auth) -> None:
    def check(grader: dict[str, Any], param: str, endpoint: str) -> None:
        body: dict[str, Any] = {"grader": grader}
        if endpoint == "run":
            body.update(model_sample="red", item={"answer": "red"})
        resp = client.post(f"/v1/fine_tuning/alpha/graders/{endpoint}", headers=auth, json=body)
        err = assert_error(resp, 400, param=param)
        if grader.get("type") == "python":
            assert "RLOO_ALLOW_PYTHON_GRADER" in err["message"]

    each([(g, p, e) for g, p in INVALID_GRADERS for e in ("validate", "run")], check)


def test_python_grader_validates_when_the_operator_enables_it(monkeypatch, client, auth) -> None:
    from service.core.db import reset_caches

    grader = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "1")
    reset_caches()
    resp = client.post("/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": grader})
    assert resp.status_code == 200, resp.text


def test_python_grader_dry_run_over_http(monkeypatch, client, auth, dry_runs) -> None:
    """The operator enables python graders; /graders/run runs one in the sandbox of a graders
    worker: a score, or the sample's error in metadata.error_messages (never a 500)."""
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "1")
    reset_caches()
    source = "def grade(sample, item):\n    return len(sample['output_text']) / item['n']\n"
    grader = {"type": "python", "name": "p", "source": source}
    url = "/v1/fine_tuning/alpha/graders/run"
    resp = client.post(url, headers=auth, json={"grader": grader, "model_sample": "abcd", "item": {"n": 8}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 0.5 and resp.json()["sub_rewards"] == {"p": 0.5}
    resp = client.post(url, headers=auth, json={"grader": grader, "model_sample": "abcd", "item": {"n": 0}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    # Unscored: OpenAI's 0 with the flag saying why (and its message), our count beside them.
    errors = body["metadata"]["errors"]
    assert (
        body["reward"] == 0 and errors["python_grader_runtime_error"] and body["metadata"]["error_counts"] == {"p": 1}
    )
    assert errors["python_grader_runtime_error_details"] == "ZeroDivisionError: division by zero"
    assert body["metadata"]["error_messages"] == {"p": "ZeroDivisionError: division by zero"}
    assert not any(v for k, v in errors.items() if k.endswith("_error") and k != "python_grader_runtime_error")


def test_grader_body_unknown_key_is_400(client, auth) -> None:
    resp = client.post(
        "/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": STRING_CHECK, "extra": 1}
    )
    assert_error(resp, 400, param="extra")

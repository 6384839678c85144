"""OpenAI's Evals API over HTTP and through the unmodified ``openai`` SDK in strict mode: every verb
of ``client.evals``, ``client.evals.runs`` and ``client.evals.runs.output_items``, each answer checked
against OpenAI's schemas (the ``client`` fixture's hook); bad input refused with a 400 or 404 naming
the field or the line, nothing stored. Runs here go to no worker (``tests/workers/test_eval_runs.py``
runs them through the engine; ``tests/e2e/test_e2e_inference.py`` on a live inference worker)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from service.core.db import session_scope
from service.core.tables import Eval, Evaluation, WebhookDelivery
from tests.helpers.api import assert_error, each, upload_ok

pytestmark = pytest.mark.filterwarnings("ignore:The Evals API is deprecated:DeprecationWarning")

ITEM_SCHEMA = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}
SIMILAR = {
    "type": "text_similarity",
    "name": "similar",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
    "pass_threshold": 0.8,
}
CONFIG = {"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True}
LINES = [
    {"item": {"question": "2+2", "answer": "4"}, "sample": {"output_text": "4"}},
    {"item": {"question": "3+3", "answer": "6"}, "sample": {"output_text": "7"}},
]
TEMPLATE = {"type": "template", "template": [{"role": "user", "content": "What is {{ item.question }}?"}]}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def make_eval(client: Any, auth: dict[str, str], criteria: list[Any] | None = None) -> dict[str, Any]:
    body = {"name": "arith", "data_source_config": CONFIG, "testing_criteria": criteria or [EXACT, SIMILAR]}
    r = client.post("/v1/evals", headers=auth, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_verb_through_the_sdk_in_strict_mode(sdk: openai.OpenAI, client, auth) -> None:  # type: ignore[no-untyped-def]
    created = sdk.evals.create(
        name="arith", data_source_config=CONFIG, testing_criteria=[EXACT, SIMILAR], metadata={"team": "rl"}
    )
    assert created.id.startswith("eval_") and created.data_source_config.type == "custom"
    assert created.data_source_config.schema_["properties"]["item"] == ITEM_SCHEMA
    assert [c.name for c in created.testing_criteria] == ["exact", "similar"]
    assert sdk.evals.retrieve(created.id).name == "arith"
    assert sdk.evals.update(created.id, name="arith-2").name == "arith-2"
    assert [e.id for e in sdk.evals.list()] == [created.id]

    file = sdk.files.create(file=("items.jsonl", jsonl(LINES)), purpose="user_data")
    by_file = sdk.evals.runs.create(
        created.id, name="from a file", data_source={"type": "jsonl", "source": {"type": "file_id", "id": file.id}}
    )
    assert by_file.id.startswith("evalrun_") and by_file.status == "queued" and by_file.model == ""
    assert by_file.result_counts.total == 0 and by_file.report_url.endswith(f"/dashboard/#/evals/{created.id}")
    inline = sdk.evals.runs.create(
        created.id,
        data_source={
            "type": "completions",
            "model": "tiny-policy",
            "source": {"type": "file_content", "content": [{"item": line["item"]} for line in LINES]},
            "input_messages": TEMPLATE,
            "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 3},
        },
    )
    assert inline.model == "tiny-policy" and inline.data_source.type == "completions"
    assert inline.data_source.source.content[1].item == LINES[1]["item"]  # type: ignore[union-attr]
    assert [r.id for r in sdk.evals.runs.list(created.id)] == [by_file.id, inline.id]
    assert [r.id for r in sdk.evals.runs.list(created.id, order="desc", limit=1)] == [inline.id, by_file.id]
    assert sdk.evals.runs.retrieve(inline.id, eval_id=created.id).id == inline.id
    assert sdk.evals.runs.cancel(inline.id, eval_id=created.id).status == "canceled"
    with pytest.raises(openai.ConflictError):
        sdk.evals.runs.cancel(inline.id, eval_id=created.id)
    assert [r.id for r in sdk.evals.runs.list(created.id, status="canceled")] == [inline.id]
    assert list(sdk.evals.runs.output_items.list(by_file.id, eval_id=created.id)) == []
    with pytest.raises(openai.NotFoundError):
        sdk.evals.runs.output_items.retrieve("outputitem_x", eval_id=created.id, run_id=by_file.id)
    assert sdk.evals.runs.delete(by_file.id, eval_id=created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.evals.runs.retrieve(by_file.id, eval_id=created.id)
    deleted = sdk.evals.delete(created.id)
    assert deleted.deleted is True and deleted.eval_id == created.id
    with pytest.raises(openai.NotFoundError):
        sdk.evals.retrieve(created.id)
    with session_scope() as session:  # its runs went with it
        assert session.query(Evaluation).filter(Evaluation.eval_seq.is_not(None)).count() == 0


def test_bad_evals_are_refused_naming_the_field_and_nothing_is_stored(client, auth, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def refused(config: Any, criteria: Any, param: str, code: str | None = None, contains: str | None = None) -> None:
        r = client.post("/v1/evals", headers=auth, json={"data_source_config": config, "testing_criteria": criteria})
        assert_error(r, 400, param=param, **({"code": code} if code else {}), contains=contains)

    wrong_key = dict(EXACT, reference="{{ item.label }}")
    each(
        {
            "a key the item_schema lacks": (CONFIG, [wrong_key], "testing_criteria.0", None, "item.label"),
            "stored completions": (
                {"type": "stored_completions"},
                [EXACT],
                "data_source_config.type",
                "unsupported_data_source",
                None,
            ),
            "logs": ({"type": "logs"}, [EXACT], "data_source_config.type", "unsupported_data_source", None),
            "not a schema": (
                dict(CONFIG, item_schema={"type": "object", "properties": {"a": {"type": "nope"}}}),
                [EXACT],
                "data_source_config.item_schema.properties.a.type",
                None,
                None,
            ),
            "a regex": (
                dict(
                    CONFIG, item_schema={"type": "object", "properties": {"a": {"type": "string", "pattern": "(a+)+$"}}}
                ),
                [EXACT],
                "data_source_config.item_schema.properties.a.pattern",
                None,
                None,
            ),
            "a threshold on a string check": (
                CONFIG,
                [dict(EXACT, pass_threshold=0.5)],
                "testing_criteria.0.pass_threshold",
                None,
                None,
            ),
            "no threshold on a similarity": (
                CONFIG,
                [{k: v for k, v in SIMILAR.items() if k != "pass_threshold"}],
                "testing_criteria.0.pass_threshold",
                None,
                None,
            ),
            "two of one name": (CONFIG, [EXACT, dict(SIMILAR, name="exact")], "testing_criteria.1.name", None, None),
            "python off": (
                CONFIG,
                [{"type": "python", "name": "p", "source": "def grade(s, i): return 1"}],
                "testing_criteria.0.type",
                None,
                "RLOO_ALLOW_PYTHON_GRADER",
            ),
            "no criteria": (CONFIG, [], "testing_criteria", None, None),
            "a type that is a list": ({"type": []}, [EXACT], "data_source_config.type", None, None),
            "a criterion type that is an object": (
                CONFIG,
                [{"type": {}, "name": "x"}],
                "testing_criteria.0.type",
                None,
                None,
            ),
            "a $ref (exponential work an item)": (
                dict(
                    CONFIG,
                    item_schema={
                        "type": "object",
                        "$defs": {"a": {"type": "string"}},
                        "properties": {"q": {"$ref": "#/$defs/a"}},
                    },
                ),
                [EXACT],
                "data_source_config.item_schema.properties.q.$ref",
                None,
                "write the schema out",
            ),
            "an $id": (
                dict(CONFIG, item_schema={"type": "object", "$id": "http://127.0.0.1:9/s"}),
                [EXACT],
                "data_source_config.item_schema.$id",
                None,
                None,
            ),
            "an unknown operation": (
                CONFIG,
                [dict(EXACT, operation="near")],
                "testing_criteria.0.operation",
                None,
                None,
            ),
        },
        refused,
    )
    with session_scope() as session:
        assert session.query(Eval).count() == 0


def test_bad_runs_are_refused_naming_the_field_or_line_and_nothing_is_stored(
    client, auth, other_auth, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_INFERENCE_MAX_TOKENS", "512")
    reset_caches()
    e = make_eval(client, auth)
    bad_line = [LINES[0], {"item": {"question": "5+5", "answer": 10}, "sample": {"output_text": "10"}}]
    mismatched = upload_ok(client, auth, jsonl(bad_line), purpose="evals")["id"]
    training = upload_ok(client, auth)["id"]
    theirs = upload_ok(client, other_auth, jsonl(LINES), purpose="evals")["id"]
    no_samples = [{"item": line["item"]} for line in LINES]

    def refused(source: Any, status: int, param: str, contains: str | None = None) -> None:
        r = client.post(f"/v1/evals/{e['id']}/runs", headers=auth, json={"data_source": source})
        assert_error(r, status, param=param, contains=contains)

    content = {"type": "file_content", "content": LINES}
    each(
        {
            "a line not fitting the schema": (
                {"type": "jsonl", "source": {"type": "file_id", "id": mismatched}},
                400,
                "data_source.source.id",
                "Line 2 of file",
            ),
            "inline, its second item": (
                {"type": "jsonl", "source": {"type": "file_content", "content": bad_line}},
                400,
                "data_source.source.content.1",
                "item.answer",
            ),
            "no answers to grade": (
                {"type": "jsonl", "source": {"type": "file_content", "content": no_samples}},
                400,
                "data_source.source.content.0",
                "sample.output_text",
            ),
            "a training file": (
                {"type": "jsonl", "source": {"type": "file_id", "id": training}},
                400,
                "data_source.source.id",
                "purpose",
            ),
            "another project's file": (
                {"type": "jsonl", "source": {"type": "file_id", "id": theirs}},
                400,
                "data_source.source.id",
                "No file",
            ),
            "another project's model": (
                {
                    "type": "completions",
                    "model": "ft:tiny-policy:beta::x:ftjob-0",
                    "source": content,
                    "input_messages": TEMPLATE,
                },
                404,
                "data_source.model",
                None,
            ),
            "a model that is not": (
                {"type": "completions", "model": "no-such-model", "source": content, "input_messages": TEMPLATE},
                404,
                "data_source.model",
                None,
            ),
            "messages reading a key not in the schema": (
                {
                    "type": "completions",
                    "model": "tiny-policy",
                    "source": content,
                    "input_messages": {
                        "type": "template",
                        "template": [{"role": "user", "content": "{{ item.topic }}"}],
                    },
                },
                400,
                "data_source.input_messages",
                "item.topic",
            ),
            "messages reading the sample": (
                {
                    "type": "completions",
                    "model": "tiny-policy",
                    "source": content,
                    "input_messages": {
                        "type": "template",
                        "template": [{"role": "user", "content": "{{ sample.output_text }}"}],
                    },
                },
                400,
                "data_source.input_messages.template.0.content",
                None,
            ),
            "responses": ({"type": "responses", "source": content}, 400, "data_source.type", "Responses API"),
            "a type that is a list": ({"type": ["jsonl"], "source": content}, 400, "data_source.type", None),
            "inline content past 256 KiB": (
                {"type": "jsonl", "source": {"type": "file_content", "content": [LINES[0]] * 4000}},
                400,
                "data_source.source.content",
                "upload the items",
            ),
            "stored completions": (
                {"type": "completions", "model": "tiny-policy", "source": {"type": "stored_completions"}},
                400,
                "data_source.source.type",
                None,
            ),
            "a sampling param we do not take": (
                {
                    "type": "completions",
                    "model": "tiny-policy",
                    "source": content,
                    "input_messages": TEMPLATE,
                    "sampling_params": {"response_format": {"type": "json_object"}},
                },
                400,
                "data_source.sampling_params.response_format",
                None,
            ),
            "more tokens than the server's cap": (
                {
                    "type": "completions",
                    "model": "tiny-policy",
                    "source": content,
                    "input_messages": TEMPLATE,
                    "sampling_params": {"max_completion_tokens": 513},
                },
                400,
                "data_source.sampling_params.max_completion_tokens",
                "RLOO_INFERENCE_MAX_TOKENS",
            ),
            "a temperature past 2": (
                {
                    "type": "completions",
                    "model": "tiny-policy",
                    "source": content,
                    "input_messages": TEMPLATE,
                    "sampling_params": {"temperature": 3},
                },
                400,
                "data_source.sampling_params.temperature",
                None,
            ),
        },
        refused,
    )
    with session_scope() as session:
        assert session.query(Evaluation).count() == 0
    assert client.get(f"/v1/evals/{e['id']}", headers=other_auth).status_code == 404
    # The word "sample" in a message's text is text: only a {{ sample.… }} reference is refused.
    prose = {"type": "template", "template": [{"role": "user", "content": "A sample. {{ item.question }}"}]}
    source = {"type": "completions", "model": "tiny-policy", "source": content, "input_messages": prose}
    assert client.post(f"/v1/evals/{e['id']}/runs", headers=auth, json={"data_source": source}).status_code == 200
    r = client.post(
        f"/v1/evals/{e['id']}/runs", headers=other_auth, json={"data_source": {"type": "jsonl", "source": content}}
    )
    assert_error(r, 404, param="eval_id")


def test_a_run_of_a_hundred_thousand_items_is_admitted_and_canceled_with_its_webhook(client, auth, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_WEBHOOK_URLS", json.dumps(["http://127.0.0.1:9/"]))  # stored, never sent here
    reset_caches()
    hook = client.post(
        "/v1/webhook_endpoints",
        headers=auth,
        json={"name": "evals", "url": "http://127.0.0.1:9/hook", "event_types": ["eval.run.canceled"]},
    )
    assert hook.status_code == 200, hook.text
    e = make_eval(client, auth, [EXACT])
    line = b'{"item": {"question": "1+1", "answer": "2"}, "sample": {"output_text": "2"}}\n'
    f = upload_ok(client, auth, line * 100_000, purpose="evals")
    assert f["purpose"] == "evals"
    r = client.post(
        f"/v1/evals/{e['id']}/runs",
        headers=auth,
        json={"data_source": {"type": "jsonl", "source": {"type": "file_id", "id": f["id"]}}},
    )
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["status"] == "queued" and run["progress"] == {"done": 0, "total": 100_000}
    canceled = client.post(f"/v1/evals/{e['id']}/runs/{run['id']}", headers=auth).json()
    assert canceled["status"] == "canceled" and canceled["error"]["code"] == "canceled"
    with session_scope() as session:
        (delivery,) = session.query(WebhookDelivery).all()
        assert delivery.event_type == "eval.run.canceled" and delivery.payload["data"] == {"id": run["id"]}


def test_a_project_past_its_unfinished_runs_is_told_which_limit(client, auth, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_EVAL_RUNS_UNFINISHED_PER_PROJECT", "1")
    reset_caches()
    e = make_eval(client, auth, [EXACT])
    body = {"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": LINES}}}
    assert client.post(f"/v1/evals/{e['id']}/runs", headers=auth, json=body).status_code == 200
    err = assert_error(
        client.post(f"/v1/evals/{e['id']}/runs", headers=auth, json=body),
        429,
        contains="RLOO_EVAL_RUNS_UNFINISHED_PER_PROJECT",
    )
    assert "1" in err["message"]


def test_an_evals_file_holds_items_and_says_which_line_is_not_one(client, auth) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.api import upload

    r = upload(client, auth, jsonl(LINES) + b'{"question": "no item"}\n', purpose="evals")
    assert_error(r, 400, contains="Line 3")
    r = upload(client, auth, jsonl([{"item": {"a": 1}, "extra": 1}]), purpose="evals")
    assert_error(r, 400, contains="'extra'")

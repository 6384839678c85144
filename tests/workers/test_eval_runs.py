"""Eval runs through the evaluation engine on a real inference worker's serving loop (in a thread, on
the test's database and Redis): a run of items with their samples and a run answered by a tiny model
end with OpenAI's counts, usage and output items (read through the SDK in strict mode) and their
webhook; the same seed answers the same; a file's later line that does not fit the eval's schema
fails the run naming the line."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from service.core.db import session_scope
from service.core.tables import WebhookDelivery
from tests.api.test_api_evals import CONFIG, EXACT, LINES, SIMILAR, TEMPLATE, jsonl
from tests.helpers.api import upload_ok

pytestmark = pytest.mark.filterwarnings("ignore:The Evals API is deprecated:DeprecationWarning")


@pytest.fixture
def serving(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An inference worker's serving loop on the test's settings: it claims the evaluations."""
    import redis

    from service.core.db import reset_caches
    from service.core.settings import get_settings
    from worker.serving import between_batches
    from worker.serving.between_batches import BetweenBatches
    from worker.serving.inference_worker import Server
    from worker.serving.model_cache import ModelCache

    monkeypatch.setattr(between_batches, "POLL_SECONDS", 0.2)
    monkeypatch.setenv("RLOO_WEBHOOK_URLS", json.dumps(["http://127.0.0.1:9/"]))  # stored, never sent here
    reset_caches()
    conn = redis.Redis.from_url(get_settings().redis_client_url)
    cache = ModelCache(device=torch.device("cpu"), budget_bytes=2**30)
    server = Server(conn, worker=f"w-{secrets.token_hex(3)}", cache=cache, max_rows=32)
    server.between_batches = BetweenBatches(server)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(lambda: not stop.is_set(),), daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(timeout=10)


def _finished(sdk: openai.OpenAI, eval_id: str, run_id: str) -> Any:
    deadline = time.monotonic() + 90
    run = sdk.evals.runs.retrieve(run_id, eval_id=eval_id)
    while run.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, run
        time.sleep(0.2)
        run = sdk.evals.runs.retrieve(run_id, eval_id=eval_id)
    return run


def _events(run_id: str) -> list[str]:
    with session_scope() as session:
        rows = session.query(WebhookDelivery).order_by(WebhookDelivery.seq).all()
        return [d.event_type for d in rows if d.payload["data"]["id"] == run_id]


def test_runs_end_with_openais_counts_items_usage_and_webhook(serving, sdk, client, auth) -> None:  # type: ignore[no-untyped-def]
    hook = {"name": "evals", "url": "http://127.0.0.1:9/hook", "event_types": ["eval.run.succeeded", "eval.run.failed"]}
    assert client.post("/v1/webhook_endpoints", headers=auth, json=hook).status_code == 200
    e = sdk.evals.create(name="arith", data_source_config=CONFIG, testing_criteria=[EXACT, SIMILAR])

    graded = sdk.evals.runs.create(
        e.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": LINES}}
    )
    run = _finished(sdk, e.id, graded.id)
    assert run.status == "completed", run
    assert (run.result_counts.total, run.result_counts.passed, run.result_counts.failed) == (2, 1, 1)
    assert [(r.testing_criteria, r.passed, r.failed) for r in run.per_testing_criteria_results] == [
        ("exact", 1, 1),
        ("similar", 1, 1),
    ]
    items = list(sdk.evals.runs.output_items.list(graded.id, eval_id=e.id))
    assert [(i.datasource_item_id, i.status) for i in items] == [(0, "pass"), (1, "fail")]
    assert items[1].datasource_item == LINES[1]["item"] and items[1].sample.output[0].content == "7"
    assert [(r.name, r.score, r.passed) for r in items[1].results] == [("exact", 0.0, False), ("similar", 0.0, False)]
    failed = list(sdk.evals.runs.output_items.list(graded.id, eval_id=e.id, status="fail"))
    assert [i.id for i in failed] == [items[1].id]
    assert sdk.evals.runs.output_items.retrieve(items[0].id, eval_id=e.id, run_id=graded.id).status == "pass"
    assert _events(graded.id) == ["eval.run.succeeded"]

    source = {
        "type": "completions",
        "model": "tiny-policy",
        "source": {"type": "file_content", "content": [{"item": line["item"]} for line in LINES * 2]},
        "input_messages": TEMPLATE,
        "sampling_params": {"temperature": 0.7, "max_completion_tokens": 5, "seed": 11},
    }
    answered = [_finished(sdk, e.id, sdk.evals.runs.create(e.id, data_source=source).id) for _ in range(2)]
    for run in answered:
        assert run.status == "completed" and run.result_counts.total == 4, run
        (usage,) = run.per_model_usage
        assert usage.run_model_name == "tiny-policy" and usage.invocation_count == 4
        assert 0 < usage.completion_tokens <= 4 * 5 and usage.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    first, second = ([i.sample for i in sdk.evals.runs.output_items.list(r.id, eval_id=e.id)] for r in answered)
    assert first[1].input[0].content == "What is 3+3?" and first[1].model == "tiny-policy"
    assert [s.output[0].content for s in first] == [s.output[0].content for s in second]  # the same seed


def test_a_later_line_that_does_not_fit_fails_the_run_naming_it(serving, sdk, client, auth, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from service.evals import items

    monkeypatch.setattr(items, "CHECK_AT_CREATION", 1)  # the API checks line 1; the worker every line
    hook = {"name": "evals", "url": "http://127.0.0.1:9/hook", "event_types": ["eval.run.failed"]}
    assert client.post("/v1/webhook_endpoints", headers=auth, json=hook).status_code == 200
    e = sdk.evals.create(name="arith", data_source_config=CONFIG, testing_criteria=[EXACT])
    bad = {"item": {"question": "5+5", "answer": 10}, "sample": {"output_text": "10"}}
    f = upload_ok(client, auth, jsonl([LINES[0], LINES[1], bad]), purpose="evals")
    created = sdk.evals.runs.create(e.id, data_source={"type": "jsonl", "source": {"type": "file_id", "id": f["id"]}})
    run = _finished(sdk, e.id, created.id)
    assert run.status == "failed" and run.error.code == "invalid_item", run
    assert f"Line 3 of file {f['id']}" in run.error.message and "item.answer" in run.error.message
    assert list(sdk.evals.runs.output_items.list(created.id, eval_id=e.id)) == []
    assert _events(created.id) == ["eval.run.failed"]


def test_a_run_its_worker_ended_is_not_announced_canceled_too(env, client, auth, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cancel (here: as the eval's deletion makes it) racing the worker's end moves only what is
    still unfinished: one webhook for a run's one end."""
    from service.core.db import reset_caches
    from service.core.tables import Evaluation
    from service.evals import runs

    monkeypatch.setenv("RLOO_WEBHOOK_URLS", json.dumps(["http://127.0.0.1:9/"]))  # stored, never sent here
    reset_caches()
    hook = {"name": "evals", "url": "http://127.0.0.1:9/hook", "event_types": ["eval.run.canceled"]}
    assert client.post("/v1/webhook_endpoints", headers=auth, json=hook).status_code == 200
    r = client.post("/v1/evals", headers=auth, json={"data_source_config": CONFIG, "testing_criteria": [EXACT]})
    source = {"type": "jsonl", "source": {"type": "file_content", "content": LINES}}
    ended, waiting = (
        client.post(f"/v1/evals/{r.json()['id']}/runs", headers=auth, json={"data_source": source}).json()["id"]
        for _ in range(2)
    )
    with session_scope() as session:
        session.query(Evaluation).filter(Evaluation.id == ended).update({"status": "succeeded"})
        assert runs.cancel(session, Evaluation.eval_seq.is_not(None), code="eval_deleted", message="gone") == 1
        session.commit()
    assert _events(ended) == [] and _events(waiting) == ["eval.run.canceled"]

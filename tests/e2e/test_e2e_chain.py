"""OpenAI's usual pipeline end to end through real processes, driven by the unmodified ``openai``
SDK in strict mode: supervised first (no ``method``, as OpenAI's examples create a job), then
reinforcement from the fine-tuned model, and DPO; fine-tuned model ids, ``/v1/models``, the results
file, checkpoint metrics with OpenAI's keys, and a deleted model that starts no job.

Runs on the embedded defaults, and on PostgreSQL + Redis when TEST_DATABASE_URL and TEST_REDIS_URL
are set (the CI sets both).
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.data import EXAMPLES
from tests.helpers.live import LiveStack, live_stack

pytestmark = pytest.mark.e2e
FINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(params=["embedded", "production"])
def stack(request: pytest.FixtureRequest, tmp_path: Path, models_dir: Path) -> Iterator[LiveStack]:
    with live_stack(request.param, tmp_path, models_dir) as s:
        yield s


def _sdk(stack: LiveStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0, _strict_response_validation=True)


def _upload(sdk: openai.OpenAI, method: str, split: str = "train") -> str:
    path = EXAMPLES / method / f"{split}.jsonl"
    return sdk.files.create(file=(path.name, path.read_bytes()), purpose="fine-tune").id


def _finished(sdk: openai.OpenAI, job_id: str, stack: LiveStack, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        if job.status in FINAL:
            assert job.status == "succeeded", (job.error, stack.log_tail())
            return job
        time.sleep(0.25)
    raise AssertionError(f"{job_id} did not finish\n{stack.log_tail()}")


def test_supervised_then_reinforcement_from_its_model_then_dpo(stack: LiveStack) -> None:
    sdk = _sdk(stack)
    # 1. Supervised, as OpenAI's examples create a job: no method, hyperparameters at the top.
    sft = sdk.fine_tuning.jobs.create(
        model="tiny-policy",
        training_file=_upload(sdk, "supervised"),
        validation_file=_upload(sdk, "supervised", "valid"),
        suffix="colors",
        seed=0,
        # learning_rate 1e-5 * 300: the examples' 3e-3, at which the loss falls within six steps.
        hyperparameters={"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 300},
    )
    assert sft.method.type == "supervised" and sft.hyperparameters.n_epochs == 1
    sft = _finished(sdk, sft.id, stack)
    project_model = f"ft:tiny-policy:e2e:colors:{sft.id}"
    assert sft.fine_tuned_model == project_model and len(sft.result_files) == 1

    # Its checkpoint carries OpenAI's metrics; its results file is the per-step CSV.
    (ckpt,) = sdk.fine_tuning.jobs.checkpoints.list(sft.id).data
    assert ckpt.fine_tuned_model_checkpoint == f"{project_model}:ckpt-step-6"
    assert ckpt.metrics.train_loss > 0 and 0 <= ckpt.metrics.train_mean_token_accuracy <= 1
    assert ckpt.metrics.valid_loss is not None and ckpt.metrics.full_valid_loss is not None
    results = sdk.files.retrieve(sft.result_files[0])
    assert results.purpose == "fine-tune-results" and results.filename == "step_metrics.csv"
    rows = list(csv.DictReader(io.StringIO(sdk.files.content(results.id).text)))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert float(rows[0]["train_loss"]) > float(rows[-1]["train_loss"])
    messages = [e.message for e in sdk.fine_tuning.jobs.list_events(sft.id, limit=100)]
    assert any(m.startswith("Training started: 6 steps, 8 examples a step") for m in messages), messages

    # 2. /v1/models lists it beside the base models; it can be retrieved.
    models = {m.id: m for m in sdk.models.list()}
    assert {project_model, "tiny-policy"} <= set(models) and models["tiny-policy"].owned_by == "system"
    assert sdk.models.retrieve(project_model).id == project_model

    # 3. Reinforcement from the fine-tuned model: supervised -> reinforcement on one service.
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    spec["method"]["reinforcement"]["hyperparameters"].update(max_steps=2, rloo_k=4)
    rl = sdk.fine_tuning.jobs.create(
        model=project_model, training_file=_upload(sdk, "demo"), method=spec["method"], suffix="rl"
    )
    rl = _finished(sdk, rl.id, stack)
    assert rl.model == project_model and rl.fine_tuned_model == f"ft:tiny-policy:e2e:rl:{rl.id}"
    assert sdk.fine_tuning.jobs.checkpoints.list(rl.id).data[0].metrics.train_loss is not None

    # 4. DPO from the supervised checkpoint.
    dpo = sdk.fine_tuning.jobs.create(
        model=ckpt.fine_tuned_model_checkpoint,
        training_file=_upload(sdk, "dpo"),
        method={"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 8, "n_epochs": 1, "beta": 0.1}}},
    )
    dpo = _finished(sdk, dpo.id, stack)
    assert dpo.fine_tuned_model.startswith("ft:tiny-policy:e2e::")

    # 5. A deleted model is gone from the list and starts no job (its jobs and checkpoints stay).
    assert sdk.models.delete(project_model).deleted is True
    assert project_model not in {m.id for m in sdk.models.list()}
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.fine_tuning.jobs.create(model=project_model, training_file=rl.training_file, method=spec["method"])
    assert missing.value.code == "model_not_found"
    assert sdk.fine_tuning.jobs.retrieve(sft.id).fine_tuned_model == project_model

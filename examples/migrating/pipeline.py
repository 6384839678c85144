"""An OpenAI fine-tuning pipeline, as a team has it today: upload data, a supervised job, a
reinforcement job with a `multi` grader on top of it, an eval comparing the base model with the
fine-tuned one, and a chat with the result. It uses the `openai` SDK and nothing of ours.

To move it to rloo-service, change only where it points and the model names:

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=rloo-... BASE_MODEL=tiny-policy \
        python examples/migrating/pipeline.py

(It is written to OpenAI's API reference; BASE_MODEL defaults to an OpenAI model name.) The data
are the examples' colour questions (examples/supervised, examples/demo; eval_items.jsonl holds
examples/demo/valid.jsonl's as eval items). The last line printed is
one JSON object: the jobs, the models, the eval's pass rates per model, and the chat's answer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from openai import OpenAI

HERE = Path(__file__).resolve().parent
BASE_MODEL = os.environ.get("BASE_MODEL", "gpt-4.1-mini-2025-04-14")
# The pipeline's own knobs. A real model takes OpenAI's defaults; the 64-wide tiny model of the tests
# learns only at a learning rate some hundred times a real model's (LR_MULTIPLIER=300 in the test).
EPOCHS = int(os.environ.get("EPOCHS", "3"))
LR_MULTIPLIER = float(os.environ.get("LR_MULTIPLIER", "1"))

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment


def wait(job_id: str) -> object:
    job = client.fine_tuning.jobs.retrieve(job_id)
    while job.status not in ("succeeded", "failed", "cancelled"):
        time.sleep(2)
        job = client.fine_tuning.jobs.retrieve(job_id)
    print(f"{job.id}: {job.status} -> {job.fine_tuned_model}", flush=True)
    if job.status != "succeeded":
        raise SystemExit(f"{job.id} {job.status}: {job.error}")
    return job


def upload(path: Path, purpose: str = "fine-tune") -> str:
    with path.open("rb") as f:
        return client.files.create(file=(path.name, f), purpose=purpose).id


# 1. Supervised: learn the answers.
sft_file = upload(HERE.parent / "supervised" / "train.jsonl")
sft = client.fine_tuning.jobs.create(
    model=BASE_MODEL,
    training_file=sft_file,
    suffix="colours",
    method={
        "type": "supervised",
        "supervised": {
            "hyperparameters": {"n_epochs": EPOCHS, "batch_size": 8, "learning_rate_multiplier": LR_MULTIPLIER}
        },
    },
)
sft = wait(sft.id)

# 2. Reinforcement on top of it: exact answers, with partial credit for near ones.
grader = {
    "type": "multi",
    "name": "answer",
    "graders": {
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{ sample.output_text }}",
            "reference": "{{ item.answer }}",
            "operation": "eq",
        },
        "near": {
            "type": "text_similarity",
            "name": "near",
            "input": "{{ sample.output_text }}",
            "reference": "{{ item.answer }}",
            "evaluation_metric": "fuzzy_match",
        },
    },
    "calculate_output": "0.5 * exact + 0.5 * near",
}
rl_file = upload(HERE.parent / "demo" / "train.jsonl")
rl = client.fine_tuning.jobs.create(
    model=sft.fine_tuned_model,
    training_file=rl_file,
    method={
        "type": "reinforcement",
        "reinforcement": {
            "grader": grader,
            "hyperparameters": {"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": LR_MULTIPLIER / 10},
        },
    },
)
rl = wait(rl.id)

# 3. An eval: the base model against the fine-tuned one on held-out questions.
eval_file = upload(HERE / "eval_items.jsonl", purpose="evals")  # {"item": {question, answer}} lines
ev = client.evals.create(
    name="colour answers",
    data_source_config={
        "type": "custom",
        "item_schema": {
            "type": "object",
            "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
            "required": ["question", "answer"],
        },
        "include_sample_schema": True,
    },
    testing_criteria=[
        grader["graders"]["exact"],
        {**grader["graders"]["near"], "pass_threshold": 0.8},
    ],
)
runs = {}
for model in (BASE_MODEL, rl.fine_tuned_model):
    runs[model] = client.evals.runs.create(
        ev.id,
        name=model,
        data_source={
            "type": "completions",
            "model": model,
            "source": {"type": "file_id", "id": eval_file},
            "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{ item.question }}"}]},
            "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 42},
        },
    ).id
pass_rates = {}
for model, run_id in runs.items():
    run = client.evals.runs.retrieve(run_id, eval_id=ev.id)
    while run.status in ("queued", "in_progress"):
        time.sleep(1)
        run = client.evals.runs.retrieve(run_id, eval_id=ev.id)
    if run.status != "completed":
        raise SystemExit(f"{run.id} {run.status}: {run.error}")
    rates = {r.testing_criteria: r.passed / max(1, r.passed + r.failed) for r in run.per_testing_criteria_results}
    pass_rates[model] = rates
    print(f"{model}: " + ", ".join(f"{k} {v:.0%}" for k, v in rates.items()), flush=True)

# 4. Chat with the result.
answer = client.chat.completions.create(
    model=rl.fine_tuned_model,
    messages=[{"role": "user", "content": "What color is the milk? Answer in one word."}],
    max_tokens=4,
    temperature=0,
)
print(f"chat: {answer.choices[0].message.content!r}", flush=True)
print(
    json.dumps(
        {
            "supervised_job": sft.id,
            "reinforcement_job": rl.id,
            "fine_tuned_model": rl.fine_tuned_model,
            "eval": ev.id,
            "pass_rates": pass_rates,
            "chat": answer.choices[0].message.content,
        }
    )
)

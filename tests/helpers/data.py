"""The example dataset and job bodies the tests send."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"
FAKES = ROOT / "tests" / "fakes"
"""Stand-ins for what cannot run here (vLLM, a GPU launcher)."""

TRAIN_JSONL = (EXAMPLES / "demo" / "train.jsonl").read_bytes()
TRAIN_LINES = len(TRAIN_JSONL.strip().splitlines())
JOB_JSON = json.loads((EXAMPLES / "demo" / "job.json").read_text())

STRING_CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}


def job_body(training_file: str, *, hp: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """The demo's job (examples/demo/job.json) on ``training_file``: ``hp`` over its hyperparameters,
    ``fields`` over its top-level fields."""
    body = copy.deepcopy(JOB_JSON)
    body["training_file"] = training_file
    body["method"]["reinforcement"]["hyperparameters"].update(hp or {})
    body.update(fields)
    return body

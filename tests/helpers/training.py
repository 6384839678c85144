"""The training loop in-process on the tiny models: a recorder that keeps what a run reports, and
the demo's job as a TrainConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.graders import parse_grader
from service.jobs.hyperparameters import HYPERPARAMETERS, ReinforcementHyperparameters
from tests.helpers.data import EXAMPLES
from worker.engine.config import TrainConfig
from worker.engine.metrics import TIMING_METRICS

ANSWER = {
    "type": "text_similarity",
    "name": "answer",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
}


class ListRecorder:
    """Keeps what a run reports; answers ``stop_as`` ("cancelled" or "paused") after step ``stop_at``."""

    def __init__(self, stop_at: int | None = None, stop_as: str = "cancelled") -> None:
        self.steps: list[dict[str, Any]] = []
        self.checkpoints: list[tuple[int, Path, bool]] = []
        self.checkpoint_metrics: dict[int, dict[str, Any]] = {}
        self.events: list[str] = []
        self.stop_at, self.stop_as = stop_at, stop_as
        self.removed: list[int] = []
        self.samples_by_step: dict[int, list[dict[str, Any]]] = {}

    def event(self, message: str, level: str = "info") -> None:
        self.events.append(message)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        self.steps.append(metrics)
        return self.stop_as if self.stop_at == step else None

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool, written: bool = True) -> None:
        self.checkpoints.append((step, path, final))
        self.checkpoint_metrics[step] = metrics

    def checkpoint_removed(self, step: int) -> None:
        self.removed.append(step)

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        self.samples_by_step[step] = groups


def config(
    tmp_path: Path, models_dir: Path, grader: dict[str, Any] = ANSWER, *, cfg: dict[str, Any] | None = None, **hp: Any
) -> TrainConfig:
    """The demo job on the tiny policy, with ``hp`` overriding its hyperparameters and ``cfg`` the
    TrainConfig's other fields (``resume_from``, ``validation_file``). The grader is parsed as an
    operator who allows python graders would."""
    demo = json.loads((EXAMPLES / "demo" / "job.json").read_text())["method"]["reinforcement"]["hyperparameters"]
    return TrainConfig(
        model="tiny-policy",
        training_file=EXAMPLES / "demo" / "train.jsonl",
        grader=parse_grader(grader, allow_python=True),
        hyperparameters=ReinforcementHyperparameters(**{**demo, **hp}).resolved(),
        output_dir=tmp_path / "out",
        models_dir=models_dir,
        seed=0,
        device="cpu",
        **(cfg or {}),
    )


def method_config(
    tmp_path: Path, models_dir: Path, method: str, *, cfg: dict[str, Any] | None = None, **hp: Any
) -> TrainConfig:
    """The supervised or DPO example job (examples/<method>/job.json) on the tiny policy, ``hp``
    over its hyperparameters and ``cfg`` over the TrainConfig's other fields."""
    spec = json.loads((EXAMPLES / method / "job.json").read_text())
    given = spec["method"][method]["hyperparameters"]
    return TrainConfig(
        model="tiny-policy",
        training_file=EXAMPLES / method / "train.jsonl",
        grader=None,
        hyperparameters=HYPERPARAMETERS[method](**{**given, **hp}).resolved(),
        output_dir=tmp_path / "out",
        models_dir=models_dir,
        seed=0,
        device="cpu",
        method=method,
        **(cfg or {}),
    )


def load_policy(models_dir: Path, name: str = "tiny-policy") -> tuple[Any, Any]:
    """A policy and its tokenizer on the CPU, loaded as a run loads them."""
    import torch

    from worker.engine.modeling import load_causal_lm, load_tokenizer, model_path

    path = model_path(name, models_dir)
    return load_causal_lm(path, torch.device("cpu"), name=name), load_tokenizer(path, name=name)


TIMING = TIMING_METRICS
# A LoRA the tiny model learns with: its reward signal lives mostly in the (tied) output head.
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["lm_head", "q_proj", "v_proj"]}

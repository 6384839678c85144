"""What one training run needs, resolved: the same object for a Celery job and for `rloo train`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainConfig:
    """A resolved RLOO run. Hyperparameter names and defaults are RLOO.md's (service.schemas)."""

    model: str
    """Model directory (or hub id) to start from."""
    training_file: Path
    """JSONL prompts; every key besides ``messages``/``prompt`` is ``item.<key>`` to the grader."""
    grader: dict[str, Any]
    """The reward spec, already validated (service.graders.parse_grader)."""
    hyperparameters: dict[str, Any]
    """Resolved hyperparameters (service.schemas.Hyperparameters.resolved())."""
    output_dir: Path
    """Where checkpoints go: ``output_dir/step-N``."""
    models_dir: Path
    """Root that reward-model paths in the grader are relative to."""
    seed: int = 0
    """Seeds sampling, data order and initialisation of anything random."""
    validation_file: Path | None = None
    """Optional JSONL scored every ``eval_interval`` steps."""
    job_name: str = "local"
    """Names checkpoints (``<model>:<job_name>:step-N``)."""
    device: str | None = None
    """``cuda``/``cpu``; None picks CUDA when there is one."""
    resume_from: Path | None = None
    """A checkpoint directory with a training state: continue the run after its step."""
    extra: dict[str, Any] = field(default_factory=dict)

    def hp(self, name: str) -> Any:
        return self.hyperparameters[name]


def worker_extra(settings: Any) -> dict[str, Any]:
    """The operator's settings a run needs (``TrainConfig.extra``), the same for a job and ``rloo train``."""
    return {
        "allow_python_grader": settings.allow_python_grader,
        "rollout_backend": settings.rollout_backend,
        "embedding_model": settings.embedding_model,
        "vllm_options": {"gpu_memory_utilization": settings.vllm_gpu_memory_utilization},
    }

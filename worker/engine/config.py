"""What one training run needs, resolved: the same object for a Celery job and for `rloo train`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.graders import Grader
from service.jobs.hyperparameters import AnyResolved
from service.tools import Toolset


@dataclass(frozen=True)
class OperatorOptions:
    """The operator's settings a run needs (the server's, or ``rloo train``'s environment), the same
    for a job and ``rloo train``: ``from_settings``."""

    rollout_backend: str = "auto"
    """``RLOO_ROLLOUT_BACKEND``: ``auto``, ``transformers`` or ``vllm``."""
    embedding_model: str | None = None
    """``RLOO_EMBEDDING_MODEL``: the embedding model of ``text_similarity``'s cosine (None: ours)."""
    tool_urls: tuple[str, ...] = ()
    """``RLOO_TOOL_URLS``: the URL prefixes http tools may be called at, as they are now."""
    vllm_options: dict[str, Any] = field(default_factory=dict)
    """What the vLLM backend is built with beyond its defaults (``RLOO_VLLM_GPU_MEMORY_UTILIZATION``:
    ``gpu_memory_utilization``, the share of a GPU it may take)."""

    @classmethod
    def from_settings(cls, settings: Any) -> OperatorOptions:
        return cls(
            rollout_backend=settings.rollout_backend,
            embedding_model=settings.embedding_model,
            tool_urls=tuple(settings.tool_urls),
            vllm_options={"gpu_memory_utilization": settings.vllm_gpu_memory_utilization},
        )


@dataclass(frozen=True)
class TrainConfig:
    """A resolved run of any method. Hyperparameter names and defaults are in docs/algorithm.md (and
    service.jobs.hyperparameters, which validates them)."""

    model: str
    """Model directory (or hub id) to start from."""
    training_file: Path
    """JSONL lines of the method's format: prompts (every key besides ``messages``/``prompt`` is
    ``item.<key>`` to the grader), conversations (supervised) or preference pairs (DPO)."""
    grader: Grader | None
    """The reward spec, parsed (``service.graders.parse_grader``) once by whoever built this config;
    None for supervised and DPO."""
    hyperparameters: AnyResolved
    """Typed and frozen: ``cfg.hyperparameters.learning_rate``."""
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
    operator: OperatorOptions = field(default_factory=OperatorOptions)
    """The operator's settings a run needs."""
    method: str = "reinforcement"
    """``reinforcement``, ``supervised`` or ``dpo``: which loop runs it."""
    integrations: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI's ``integrations`` of the job (``worker.engine.integrations.wandb_recorder``)."""
    gpus: int = 1
    """Ranks the run takes (``resources.gpus``): one process a device, or on a CPU host N gloo
    processes, started by ``worker.engine.distributed.launch``."""
    started_from: str | None = None
    """What the job named to start from, when it is not ``model`` itself (a fine-tuned model's or
    checkpoint's id, whose base is ``model``): the run's events name it."""
    tools: Toolset | None = None
    """A reinforcement run's tools and multi-turn limits (``service.tools.parse_tools``): its
    rollouts call them (``worker.engine.rollout.agent``); None: one completion a prompt."""
    init_from: tuple[Path, ...] = ()
    """The checkpoint directories of a fine-tuned model to start from instead of ``model``'s
    weights, applied in order (``service.registry.finetuned.Source.chain``): a full model's weights loaded,
    a LoRA adapter merged."""

"""A training run, set up: what ``worker.prepare`` builds and the loop in ``worker.train`` reads."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from service import graders
from service.schemas import ResolvedHyperparameters
from worker.config import TrainConfig
from worker.modeling import Reference
from worker.rewards import RewardModels
from worker.rollout import RolloutBackend


@dataclass
class Run:
    """One training run, set up. ``start`` is the step a resumed run continues after (0 for a new
    run); ``counters`` travel in its checkpoints."""

    cfg: TrainConfig
    device: torch.device
    autocast: AbstractContextManager[Any]
    items: list[dict[str, Any]]
    valid_items: list[dict[str, Any]]
    reward_models: RewardModels | None
    total_steps: int
    tokenizer: Any
    model: Any
    reference: Reference | None
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    backend: RolloutBackend
    start: int = 0
    counters: dict[str, Any] = field(
        default_factory=lambda: {"trained_tokens": 0, "first_reward": None, "valid_reward_mean": None}
    )

    @property
    def hp(self) -> ResolvedHyperparameters:
        return self.cfg.hyperparameters

    @property
    def grader(self) -> graders.Grader:
        return self.cfg.grader

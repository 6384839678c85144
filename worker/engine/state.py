"""A training run, set up: what ``worker.engine.prepare`` builds and the loops in
``worker.engine.methods`` read."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from service import graders
from service.jobs.hyperparameters import AnyResolved, ResolvedHyperparameters
from worker.engine.config import TrainConfig
from worker.engine.distributed.ranks import SINGLE, Ranks
from worker.engine.modeling import Reference
from worker.engine.rewards.scoring import RewardModels
from worker.engine.rollout.base import RolloutBackend


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
    backend: RolloutBackend | None = None
    """Who samples completions (reinforcement only)."""
    ranks: Ranks = SINGLE
    """The job's processes, when it runs on several (``worker.engine.distributed.ranks``)."""
    start: int = 0
    counters: dict[str, Any] = field(default_factory=lambda: {"trained_tokens": 0, "first": None})

    @property
    def hp(self) -> AnyResolved:
        return self.cfg.hyperparameters

    @property
    def rl(self) -> ResolvedHyperparameters:
        """The hyperparameters of a reinforcement run."""
        assert isinstance(self.cfg.hyperparameters, ResolvedHyperparameters)
        return self.cfg.hyperparameters

    @property
    def sampler(self) -> RolloutBackend:
        """The rollout backend of a reinforcement run."""
        assert self.backend is not None
        return self.backend

    @functools.cached_property
    def tokenizer_digest(self) -> str | None:
        """The policy tokenizer's digest (``worker.engine.rewards.scoring.tokenizer_fingerprint``): a reward model
        with the same reads the sampled tokens."""
        from worker.engine.rewards.scoring import tokenizer_fingerprint

        return tokenizer_fingerprint(self.tokenizer)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The policy tokenizer's special tokens (added ones marked special included): what a
        completion's text leaves out, so what its sampled tokens leave out for a reward model."""
        tok = self.tokenizer
        return frozenset(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}

    @property
    def scorer(self) -> graders.Grader:
        """The grader of a reinforcement run."""
        assert self.cfg.grader is not None
        return self.cfg.grader

"""A training run, set up: what ``worker.engine.prepare`` builds and the loops in
``worker.engine.methods`` read."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from service import graders
from service.jobs.hyperparameters import AnyResolved, ResolvedReinforcementHyperparameters
from worker.engine.config import TrainConfig
from worker.engine.distributed.ranks import SINGLE, Ranks
from worker.engine.modeling import Reference
from worker.engine.rewards.scoring import RewardModels
from worker.engine.rollout.agent import Agent
from worker.engine.rollout.base import RolloutBackend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RunCounters:
    """What a run carries from step to step and through its checkpoints (``saved``: the same keys as
    before it was a dataclass, so checkpoints of either read alike)."""

    trained_tokens: int = 0
    first: float | None = None
    """The headline metric (reward, loss) of the run's first step."""
    reported_grader_errors: list[str] = field(default_factory=list)
    """The graders whose first error the run reported (once each)."""
    reported_diagnostics: list[str] = field(default_factory=list)
    """The signs of trouble the run reported (``worker.engine.diagnostics``, once each)."""
    valid_reward_mean: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None
    valid_reward_margin: float | None = None
    valid_reward_accuracy: float | None = None

    def record_valid(self, figures: Mapping[str, float]) -> None:
        """The newest validation pass's figures (``valid_*``, ``full_valid_*``)."""
        for key, value in figures.items():
            if key not in _VALID_FIELDS:
                raise KeyError(f"{key} is not a validation figure a run keeps")
            setattr(self, key, value)

    def saved(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def restored(cls, saved: Mapping[str, Any]) -> RunCounters:
        """A checkpoint's counters; ``first_reward`` is ``first`` as written before every method had a
        headline metric."""
        known = {f.name for f in fields(cls)}
        counters = cls(**{k: v for k, v in saved.items() if k in known})
        if counters.first is None:
            counters.first = saved.get("first_reward")
        return counters


_VALID_FIELDS = frozenset(f.name for f in fields(RunCounters) if f.name.startswith(("valid_", "full_valid_")))


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
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module
    reference: Reference | None
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    backend: RolloutBackend | None = None
    """Who samples completions (reinforcement only)."""
    agent: Agent | None = None
    """How rollouts call tools, for a run with tools (``worker.engine.rollout.agent``)."""
    ranks: Ranks = SINGLE
    """The job's processes, when it runs on several (``worker.engine.distributed.ranks``)."""
    start: int = 0
    counters: RunCounters = field(default_factory=RunCounters)

    @property
    def hp(self) -> AnyResolved:
        return self.cfg.hyperparameters

    @property
    def rl(self) -> ResolvedReinforcementHyperparameters:
        """The hyperparameters of a reinforcement run."""
        assert isinstance(self.cfg.hyperparameters, ResolvedReinforcementHyperparameters)
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

"""A step's metrics, assembled in one place: the names users read in ``GET .../metrics`` and the
job's events (docs/algorithm.md lists them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from service.graders import GradeResult
from worker.engine.methods import policy_gradient

if TYPE_CHECKING:
    from worker.engine.state import RunCounters

DEPRECATED_ALIASES = {"clip_frac": "ratio_clip_frac"}
"""Old metric name -> its new name. Both are recorded for one release, then the old one goes.
``clip_frac`` read too much like ``clipped_ratio`` (completions cut at max_new_tokens)."""


@dataclass(frozen=True)
class UpdateStats:
    """What one RLOO update reports, on the device until the step is recorded (no host sync per
    micro-batch). ``loss`` and ``ratio_clip_frac`` are the last ``ppo_epochs`` pass's."""

    advantages: Tensor
    kl: Tensor
    loss: Tensor
    ratio_clip_frac: Tensor
    entropy_sum: Tensor
    grad_norm: Tensor
    learning_rate: float
    sampler: Tensor | None = None
    """Where the sampler is not the policy: ``policy_gradient.sampler_correction``'s statistics,
    the whole batch's."""


TIMING_METRICS = frozenset(
    {
        "time_generate",
        "time_score",
        "time_reference",
        "time_update",
        "time_step",
        "time_tools",
        "completions_per_s",
        "tokens_per_s",
    }
)
"""The metrics that measure the machine, not the run: two runs of one seed differ only in these."""


@dataclass(frozen=True)
class Timings:
    """Seconds each phase of a step took."""

    generate: float
    score: float
    reference: float
    update: float
    step: float
    tools: float = 0.0
    """Of ``generate``'s rollouts, the time waiting on tool calls (a run with tools)."""


def step_metrics(
    *,
    step: int,
    total_steps: int,
    rewards: Tensor,
    finite: Tensor,
    mask: Tensor,
    truncated: Tensor,
    update: UpdateStats,
    timings: Timings,
    trained_tokens: int,
) -> dict[str, Any]:
    """The metrics of one step. ``rewards`` and ``finite`` are ``(B, k)``, at least one finite;
    ``mask`` ``(N, T)`` marks completion tokens; ``truncated`` ``(N,)`` the completions cut short."""
    n = rewards.numel()
    gen_tokens = int(mask.sum().item())
    finite_rewards = rewards[finite]
    constant = float(policy_gradient.constant_groups(rewards, finite).float().mean())
    advantages = update.advantages
    metrics: dict[str, Any] = {
        "step": step,
        "total_steps": total_steps,
        "train_reward_mean": float(finite_rewards.mean()),
        "train_reward_std": float(finite_rewards.std(unbiased=False)) if finite_rewards.numel() > 1 else 0.0,
        "constant_groups_frac": constant,
        "frac_reward_zero_std": constant,  # TRL's name for it
        "advantage_std": float(advantages[finite].std(unbiased=False)) if finite.sum() > 1 else 0.0,
        "kl": float(update.kl.mean()),
        "loss": float(update.loss),
        "entropy": float(update.entropy_sum / mask.sum().clamp(min=1.0)),
        "grad_norm": float(update.grad_norm),
        "learning_rate": update.learning_rate,
        "completion_length_mean": float(mask.sum(dim=1).mean()),
        "clipped_ratio": float(truncated.float().mean()),
        "ratio_clip_frac": float(update.ratio_clip_frac),
        "nan_rewards": int((~finite).sum()),
        "time_generate": timings.generate,
        "time_score": timings.score,
        "time_reference": timings.reference,
        "time_update": timings.update,
        "time_step": timings.step,
        "completions_per_s": n / timings.step,
        "tokens_per_s": gen_tokens / timings.step,
        "trained_tokens": trained_tokens,
    }
    if update.sampler is not None:
        metrics.update(sampler_metrics(update.sampler))
    for old, new in DEPRECATED_ALIASES.items():
        metrics[old] = metrics[new]
    return metrics


def sampler_metrics(stats: Tensor) -> dict[str, float]:
    """The trainer-sampler mismatch of a step (a sampler that is not the policy): the mean and the
    largest ``|log pi_trainer - log pi_sampler|`` over the sampled tokens, and the share corrected
    (tokens truncated, or completions masked: ``sampler_correction``)."""
    total, tokens, largest, corrected, out_of = stats.tolist()
    if not tokens:  # no log-prob came back: nothing measured
        return {}
    return {
        "sampler_logratio_mean": total / tokens,
        "sampler_logratio_max": largest,
        "sampler_correction_frac": corrected / out_of if out_of else 0.0,
    }


def tool_metrics(counts: Sequence[tuple[int, ...]], ranks: Any, timings: Timings) -> dict[str, float | int]:
    """A run with tools: per rollout, the turns, tool calls and trajectory tokens (means); the
    step's failed calls by kind (errors, time-outs, malformed calls: a name not offered, arguments
    that do not fit, unreadable JSON), the share of calls that were well formed, and the seconds
    spent waiting on tools. ``counts`` are this rank's trajectories' (``Trajectory.counts``)."""
    whole = [c for share in ranks.whole_objects(list(counts)) for c in share]
    n = max(len(whole), 1)
    turns, calls, errors, timeouts, malformed, tokens = (sum(column) for column in zip(*whole, strict=True))
    return {
        "tool_turns_mean": turns / n,
        "tool_calls_mean": calls / n,
        "tool_errors": errors,
        "tool_timeouts": timeouts,
        "tool_malformed": malformed,
        "tool_well_formed_frac": (calls - malformed) / calls if calls else float("nan"),
        "trajectory_length_mean": tokens / n,
        "time_tools": timings.tools,
    }


def grader_metrics(graded: GradeResult) -> dict[str, float | int]:
    """``graders.<name>.mean`` (of its finite scores) and ``graders.<name>.errors`` (its NaN count)
    for each grader of the tree."""
    metrics: dict[str, float | int] = {}
    for name, values in graded.sub_rewards.items():
        vals = [v for v in values if math.isfinite(v)]
        metrics[f"graders.{name}.mean"] = sum(vals) / len(vals) if vals else float("nan")
        metrics[f"graders.{name}.errors"] = graded.errors.get(name, 0)
    return metrics


OUR_CHECKPOINT_KEYS = ("train_reward_mean", "kl", "loss", "entropy", "reward_margin", "reward_accuracy")
VALID_KEYS = (
    "valid_reward_mean",
    "valid_loss",
    "valid_mean_token_accuracy",
    "full_valid_loss",
    "full_valid_mean_token_accuracy",
    "valid_reward_margin",
    "valid_reward_accuracy",
)


def checkpoint_metrics(metrics: dict[str, Any], counters: RunCounters) -> dict[str, Any]:
    """What a checkpoint carries (the job's ``checkpoints`` list shows it): OpenAI's keys, then ours
    that the step has; validation figures are the newest pass's. RLOO's ``train_loss`` is its loss.
    A key the method has no value for is left out (OpenAI's schema types each one as a number)."""
    out: dict[str, Any] = {
        "step": metrics["step"],
        "train_loss": metrics.get("train_loss", metrics.get("loss")),
        "train_mean_token_accuracy": metrics.get("train_mean_token_accuracy"),
    }
    out.update({key: metrics[key] for key in OUR_CHECKPOINT_KEYS if key in metrics})
    out.update({key: getattr(counters, key) for key in VALID_KEYS})
    return {key: value for key, value in out.items() if value is not None}

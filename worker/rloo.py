"""The advantage estimators and the RLOO math under their documented name (``worker.rloo``): the
functions live in the training engine, ``worker.engine.methods.policy_gradient``; this module re-exports them so
that scripts written against ``worker.rloo.rloo_advantages`` and ``worker.rloo.advantages`` keep working."""

from __future__ import annotations

from worker.engine.methods.policy_gradient import (
    AGGREGATIONS,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    MAX_LOG_RATIO,
    advantages,
    batch_advantages,
    constant_groups,
    grpo_advantages,
    kl_loss,
    kl_per_token,
    loss_normalizer,
    merged_sampler_stats,
    policy_loss,
    reinforce_advantages,
    reinforce_mean_advantages,
    rloo_advantages,
    sampler_correction,
    sequence_kl,
    shape_rewards,
    whiten,
)

__all__ = [
    "rloo_advantages",
    "grpo_advantages",
    "reinforce_advantages",
    "reinforce_mean_advantages",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "advantages",
    "whiten",
    "kl_per_token",
    "sequence_kl",
    "shape_rewards",
    "batch_advantages",
    "constant_groups",
    "MAX_LOG_RATIO",
    "AGGREGATIONS",
    "loss_normalizer",
    "merged_sampler_stats",
    "policy_loss",
    "sampler_correction",
    "kl_loss",
]

"""The signs of a run not learning as it should (worker.engine.diagnostics): each reported once, over
a window of steps, with what to change; a healthy run's metrics raise none."""

from __future__ import annotations

from typing import Any

import pytest

from worker.engine.diagnostics import Diagnostics

HEALTHY = {
    "constant_groups_frac": 0.3,
    "train_reward_mean": 0.4,
    "ratio_clip_frac": 0.0,
    "grad_norm": 2.0,
    "clipped_ratio": 0.05,
    "sampler_logratio_mean": 0.002,
    "sampler_logratio_max": 0.05,
}


def feed(watch: Diagnostics, steps: list[dict[str, Any]]) -> list[str]:
    messages = []
    for metrics in steps:
        step = watch.recent[-1]["step"] + 1 if watch.recent else 1
        messages += watch.observe({"step": step, **metrics})
    return messages


def test_a_healthy_run_raises_nothing() -> None:
    watch = Diagnostics([], group=8)
    assert feed(watch, [HEALTHY] * 50) == [] and watch.reported == []


@pytest.mark.parametrize(
    "name,late,needle",
    [
        ("constant_groups", {"constant_groups_frac": 0.95, "train_reward_mean": 0.98}, "give partial credit"),
        ("ratio_clipped", {"ratio_clip_frac": 0.7}, "Lower learning_rate or ppo_epochs"),
        ("sampler_mismatch", {"sampler_logratio_mean": 0.3, "sampler_logratio_max": 4.0}, "dtype and weights"),
        ("length_at_cap", {"clipped_ratio": 0.8}, "Raise max_new_tokens"),
    ],
)
def test_each_sign_is_reported_once_over_a_window(name: str, late: dict[str, Any], needle: str) -> None:
    reported: list[str] = []
    watch = Diagnostics(reported, group=8)
    assert feed(watch, [HEALTHY] * 20 + [{**HEALTHY, **late}] + [HEALTHY] * 20) == []  # one step is no sign
    messages = feed(watch, [{**HEALTHY, **late}] * 30)
    # (a mismatch that jumps is also one that grew: both are said)
    assert [m for m in messages if needle in m] == messages[:1] and len(messages) <= 2, messages
    assert name in reported
    # A resumed run carries what was reported: it is not said again.
    assert feed(Diagnostics(list(reported), group=8), [{**HEALTHY, **late}] * 30) == []


def test_a_growing_mismatch_says_the_sampler_is_not_being_updated() -> None:
    steps = [{**HEALTHY, "sampler_logratio_mean": 1e-7 if i == 0 else 0.06 + 0.001 * i} for i in range(30)]
    messages = feed(Diagnostics([], group=8), steps)
    assert any("not being updated" in m for m in messages), messages
    # A constant small mismatch (rounding) is no sign, nor one that drifts up from rounding.
    flat = [{**HEALTHY, "sampler_logratio_mean": 0.003}] * 40
    assert feed(Diagnostics([], group=8), flat) == []
    drift = [{**HEALTHY, "sampler_logratio_mean": 0.004 + 0.001 * i} for i in range(40)]  # 0.004 -> 0.043
    assert feed(Diagnostics([], group=8), drift) == []


def test_constant_groups_mean_nothing_without_a_group() -> None:
    # rloo_k 1 (plain REINFORCE): every "group" is constant; no sign.
    assert feed(Diagnostics([], group=1), [{**HEALTHY, "constant_groups_frac": 1.0}] * 30) == []

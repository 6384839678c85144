"""What the reward looks like: every ``sample_interval`` steps (and at the last), a few of the step's
prompts with their k completions, each with its reward and advantage, bounded in size, recorded
beside the metrics (``GET /v1/fine_tuning/jobs/{id}/samples``). Curves say that the reward moved;
these say what it rewarded."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI reads samples without torch
    from torch import Tensor

MAX_CHARS = 2000
"""Longest prompt or completion text kept (the rest is cut, marked with an ellipsis)."""


def is_sample_step(step: int, total_steps: int, interval: int) -> bool:
    return interval > 0 and (step % interval == 0 or step == total_steps)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def _number(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def sample_groups(
    prompts: list[str], texts: list[str], rewards: Tensor, advantages: Tensor, *, groups: int
) -> list[dict[str, Any]]:
    """The first ``groups`` prompts of a step, each with its k completions (prompt-major ``texts``;
    ``rewards`` and ``advantages`` ``(B, k)``). A reward that could not be scored is null."""
    k = rewards.shape[1]
    kept = min(groups, len(prompts))
    r, a = rewards[:kept].float().cpu().tolist(), advantages[:kept].float().cpu().tolist()
    return [
        {
            "prompt": _cut(prompts[b]),
            "completions": [
                {"text": _cut(texts[b * k + i]), "reward": _number(r[b][i]), "advantage": _number(a[b][i])}
                for i in range(k)
            ],
        }
        for b in range(kept)
    ]


def best_and_worst(groups: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The recorded completions of highest and lowest reward (scored ones only)."""
    scored = [c for g in groups for c in g["completions"] if c["reward"] is not None]
    if not scored:
        return []
    ranked = sorted(scored, key=lambda c: c["reward"])
    return [("best", ranked[-1]), ("worst", ranked[0])]

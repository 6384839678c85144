"""Signs that a reinforcement run is not learning as it should, read from its step metrics: each
reported once a run, as a warning event that says what to change.

* most groups constant: nearly every prompt's k completions scored alike (the reward is too easy or
  too hard for the model), so a group baseline gives them no signal;
* ratio clipping on most of the loss: the policy moves too far within a step;
* the sampler's log-probs far from the trainer's (a sampler that is not the policy: vLLM);
* that mismatch growing while the loss moves: the rollouts come from weights that are not being
  updated (a weight sync that does not reach the sampler);
* completion length racing to the cap: more and more completions cut at ``max_new_tokens``.

Each is judged over ``WINDOW`` steps (their median: one odd step is no sign); a run shorter than
that is not judged. Which were reported travels in the run's checkpoints (``RunCounters.reported_diagnostics``),
so a resumed run does not repeat them; the first window, which growth is judged from, is the resumed
run's own.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WINDOW = 10
CONSTANT_GROUPS = 0.9
"""Share of constant groups, over a window, past which most of the batch carries no signal."""
RATIO_CLIPPED = 0.5
"""Share of the loss whose ratio was clipped."""
MISMATCH = 0.1
"""Mean ``|log pi_trainer - log pi_sampler|`` a token: a tenth of a nat is far past rounding (bf16
kernels give about a hundredth)."""
MISMATCH_GROWTH = 5.0
"""A mismatch this many times the first window's least (the step right after a sync) and past
``MISMATCH / 2``: the sampler's weights stay behind the policy's. (Rounding drifts a little as a
run sharpens; not five-fold to half a tenth of a nat.)"""
TRUNCATED = 0.5
"""Share of completions cut at ``max_new_tokens``, when the first window's was at most half of it."""


@dataclass
class Diagnostics:
    """Watches a run's step metrics; ``observe`` gives the messages of the signs newly seen."""

    reported: list[str]
    """The run's ``RunCounters.reported_diagnostics``: names reported, appended to here."""
    group: int
    first: list[dict[str, Any]] = field(default_factory=list)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, metrics: dict[str, Any]) -> list[str]:
        if len(self.first) < WINDOW:
            self.first.append(metrics)
        self.recent.append(metrics)
        if len(self.recent) < WINDOW:
            return []
        messages = []
        for name, check in self._checks().items():
            if name in self.reported:
                continue
            message = check()
            if message is not None:
                self.reported.append(name)
                messages.append(message)
        return messages

    def _checks(self) -> dict[str, Callable[[], str | None]]:
        return {
            "constant_groups": self._constant_groups,
            "ratio_clipped": self._ratio_clipped,
            "sampler_mismatch": self._sampler_mismatch,
            "stale_sampler": self._stale_sampler,
            "length_at_cap": self._length_at_cap,
        }

    def _mean(self, name: str, steps: Any = None) -> float | None:
        """The window's typical ``name``: its median, which one odd step does not move."""
        values = [float(m[name]) for m in (self.recent if steps is None else steps) if m.get(name) is not None]
        return statistics.median(values) if values else None

    def _span(self) -> str:
        return f"over steps {self.recent[0]['step']}-{self.recent[-1]['step']}"

    def _constant_groups(self) -> str | None:
        frac, reward = self._mean("constant_groups_frac"), self._mean("train_reward_mean")
        if self.group < 2 or frac is None or reward is None or frac < CONSTANT_GROUPS:
            return None
        return (
            f"{frac:.0%} of prompts had all {self.group} completions score alike {self._span()} (mean reward "
            f"{reward:.3g}): under a group baseline they carry no signal, so the run barely learns. The reward is "
            "too easy or too hard for this model: give partial credit in the grader, change the data's difficulty, "
            "or raise rloo_k or temperature"
        )

    def _ratio_clipped(self) -> str | None:
        frac = self._mean("ratio_clip_frac")
        if frac is None or frac < RATIO_CLIPPED:
            return None
        return (
            f"The importance ratio was clipped on {frac:.0%} of the loss {self._span()}: the policy moves too far "
            "within a step, and clipped terms give no gradient. Lower learning_rate or ppo_epochs, or raise "
            "clip_epsilon"
        )

    def _sampler_mismatch(self) -> str | None:
        mean, largest = self._mean("sampler_logratio_mean"), self._mean("sampler_logratio_max")
        if mean is None or mean < MISMATCH:
            return None
        return (
            f"The sampler's log-probs differ from the trainer's by {mean:.3g} nats a token typically {self._span()} "
            f"(largest {largest:.3g}): far past rounding. Check that the sampler runs the policy's dtype and weights; "
            "sampler_correction (tis, or mask) bounds what the difference does to the update"
        )

    def _stale_sampler(self) -> str | None:
        # The first window's least: the step right after a sync (a synced sampler stays at its rounding).
        known = [float(m["sampler_logratio_mean"]) for m in self.first if m.get("sampler_logratio_mean") is not None]
        start, now = (min(known) if known else None), self._mean("sampler_logratio_mean")
        loss_moves = (self._mean("grad_norm") or 0.0) > 0
        if start is None or now is None or now < MISMATCH / 2 or now < MISMATCH_GROWTH * start or not loss_moves:
            return None
        return (
            f"The trainer-sampler mismatch grew from {start:.3g} to {now:.3g} nats a token while the loss moves: the "
            "rollouts look as if they came from weights that are not being updated, the policy's weights not "
            "reaching the sampler after each step. Check the rollout backend's weight sync (RLOO_ROLLOUT_BACKEND, "
            "vllm_options)"
        )

    def _length_at_cap(self) -> str | None:
        start, now = self._mean("clipped_ratio", self.first), self._mean("clipped_ratio")
        if start is None or now is None or now < TRUNCATED or start > now / 2:
            return None
        return (
            f"{now:.0%} of completions were cut at max_new_tokens {self._span()} ({start:.0%} over the first "
            f"{WINDOW} steps): their length races to the cap. Raise max_new_tokens, make the grader penalise "
            "length, or set mask_truncated_completions"
        )

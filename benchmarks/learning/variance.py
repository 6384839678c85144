"""Gradients at fixed weights: each estimator's variance, bias and scale over many fresh batches, the
constant baseline that would minimise the variance, and how far each estimator's update goes along
the true gradient, as a clipped step and as an Adam-preconditioned step.

At each point (the supervised start, and checkpoints of an RLOO run) ``VARIANCE_BATCHES`` fresh
batches are sampled, and each estimator's policy gradient (the engine's loss at ratio 1) is taken on
the same rollouts. Per estimator: the total variance over batches (the trace of the covariance), the
squared norm of the mean gradient (less its noise), their ratio (noise to signal of one batch), the
mean gradient's norm and cosine against RLOO's, and a bias statistic against plain REINFORCE (an
unbiased estimator): the paired mean difference's squared norm over its expected size under no bias
(about 1 when unbiased). Also plain REINFORCE with every reward raised by 1 (a reward whose zero is
elsewhere: the reward-offset experiment), and, from each completion's own gradient on the first
``SCORE_BATCHES`` batches, the constant baseline that would minimise the variance against the mean
reward a group baseline estimates.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import Collect
from benchmarks.learning.tasks import Task

ESTIMATORS = ("rloo", "grpo", "reinforce", "reinforce_mean")
SHIFTED = "reinforce_reward_plus_1"
"""Plain REINFORCE on the same rollouts with every reward raised by 1 (a reward whose zero is not
where failures sit). The three baselines are blind to such a shift."""
VARIANCE_BATCHES = 128
SCORE_BATCHES = 4
"""Batches a point whose completions' gradients are also taken one by one (the optimal baseline)."""


# ---------------------------------------------------------------- gradient variance
@dataclasses.dataclass
class Moments:
    """Running sums of flat gradient vectors: enough for the mean and the trace of the covariance."""

    total: Any = None
    squares: float = 0.0
    n: int = 0

    def add(self, g: Any) -> None:
        g = g.double()  # the variance is a difference of two large sums
        self.total = g.clone() if self.total is None else self.total + g
        self.squares += float(g.double().pow(2).sum())
        self.n += 1

    @property
    def mean(self) -> Any:
        return self.total / self.n

    @property
    def variance(self) -> float:
        """The trace of the covariance over the batches (n - 1 in the denominator)."""
        return (self.squares - self.n * float(self.mean.double().pow(2).sum())) / (self.n - 1)

    @property
    def signal(self) -> float:
        """``||E g||^2``, without the bias of ``||mean||^2`` (which carries ``variance / n`` of noise)."""
        return float(self.mean.double().pow(2).sum()) - self.variance / self.n


def gradient_stats(
    moments: dict[str, Moments], paired: dict[str, Moments], known_scale: dict[str, float]
) -> dict[str, Any]:
    """Per estimator: the variance, signal, their ratio; the scale of its expected gradient against
    RLOO's, estimated (the square root of the signals' ratio: noise-free, unlike the sample means'
    norms) and, where the math fixes it, known (``known_scale``: 1 for the unbiased ones, ``(k-1)/k``
    for the mean baseline; an estimate there would only add noise); the variance at an equal scale
    (by the known scale where there is one); the cosine of the sample means; and the bias statistic
    against REINFORCE's (``paired[e]`` holds ``g_e - g_reinforce`` per batch)."""
    import torch

    ref, rloo = moments["rloo"].mean, moments["rloo"]
    out: dict[str, Any] = {}
    for name, m in moments.items():
        estimated = math.sqrt(m.signal / rloo.signal) if m.signal > 0 and rloo.signal > 0 else None
        scale = known_scale.get(name, estimated)
        d = paired.get(name)
        bias = None
        if d is not None and d.variance > 0:
            bias = round(float(d.mean.double().pow(2).sum()) / (d.variance / d.n), 2)
        out[name] = {
            "variance": m.variance,
            "signal": m.signal,
            "noise_to_signal": round(m.variance / m.signal, 2) if m.signal > 0 else None,
            "variance_vs_rloo": round(m.variance / rloo.variance, 3),
            "scale_vs_rloo_estimated": round(estimated, 3) if estimated else None,
            "scale_vs_rloo_known": known_scale.get(name),
            # At an equal scale: a constant factor on the advantages (reinforce_mean's (k-1)/k, much
            # of GRPO's 1/std) scales signal and noise alike, and a clipped or AdamW update does not see it.
            "variance_vs_rloo_same_scale": round(m.variance / rloo.variance / scale**2, 3) if scale else None,
            "cosine_to_rloo": round(float(torch.nn.functional.cosine_similarity(m.mean, ref, dim=0)), 3),
            "bias_statistic_vs_reinforce": bias,
        }
    return out


def constant_baselines(moments: dict[str, Moments], paired: dict[str, Moments], mean_reward: float) -> dict[str, Any]:
    """The variance of REINFORCE with a constant baseline ``b``, exactly, from three variances over
    the same batches: ``g(b) = g_r - b * g_1`` with ``g_r`` REINFORCE's gradient and ``g_1`` the one
    of advantages all 1 (``paired[SHIFTED]``: REINFORCE on reward + 1 less REINFORCE), so
    ``Var g(b) = Var g_r - 2 b C + b^2 Var g_1`` with ``C`` their covariance's trace. Against RLOO's
    variance: no baseline, the batches' mean reward (what a group's mean estimates, but known
    exactly), and the best constant ``C / Var g_1``. RLOO's own excess over the mean's is what
    estimating each prompt's mean from its other k-1 samples costs (and gains)."""
    var_r, var_1 = moments["reinforce"].variance, paired[SHIFTED].variance
    cov = (moments[SHIFTED].variance - var_r - var_1) / 2
    best = cov / var_1

    def at(b: float) -> float:
        return round((var_r - 2 * b * cov + b * b * var_1) / moments["rloo"].variance, 3)

    return {
        "mean_reward": round(mean_reward, 4),
        "best_constant": round(best, 4),
        "variance_vs_rloo": {"none": at(0.0), "mean_reward": at(mean_reward), "best_constant": at(best)},
    }


def gradient_variance(
    task: Task, points: dict[int, Path | None], where: Path, batches: int = VARIANCE_BATCHES
) -> dict[str, Any]:
    """At each point (step -> checkpoint; None: the supervised start) of ``task``: ``gradient_stats``,
    ``constant_baselines``, ``optimal_baseline`` and ``progress``."""
    if batches < 4:
        raise ValueError("the gradient statistics need at least 4 batches a point")
    out: dict[str, Any] = {}
    for step, checkpoint in points.items():
        print(f"{task.name}: gradients at step {step}", file=sys.stderr, flush=True)
        run = _prepared(task, checkpoint, where)
        hp = run.rl
        if hp.loss_aggregation != "sequence_sum":
            raise ValueError(
                "the score norms below are of summed log-probs: the job's loss_aggregation is sequence_sum"
            )
        known = {"rloo": 1.0, "reinforce": 1.0, SHIFTED: 1.0, "reinforce_mean": (hp.rloo_k - 1) / hp.rloo_k}
        reward_total = 0.0
        sums: dict[str, float] = {}
        moments = {name: Moments() for name in (*ESTIMATORS, SHIFTED)}
        paired = {name: Moments() for name in moments if name != "reinforce"}
        kept: dict[str, list[Any]] = {name: [] for name in ESTIMATORS}
        for b in range(batches):
            rewards, logp, mask = _batch(run, seed=10_007 + step, b=b, generator_seed=1_000_003 * (step + 1) + b)
            reward_total += float(rewards.mean())
            grads = _gradients(run, rewards, logp, mask, moments)
            for name, m in paired.items():
                m.add(grads[name] - grads["reinforce"])
            for name in ESTIMATORS:
                kept[name].append(grads[name].float())
            if b < SCORE_BATCHES:
                sums = score_norms(run, logp, mask, rewards.view(-1), sums)
        out[str(step)] = {
            "batches": batches,
            "mean_reward": round(reward_total / batches, 4),
            **gradient_stats(moments, paired, known),
            "constant_baselines": constant_baselines(moments, paired, reward_total / batches),
            "score_norms": optimal_baseline(sums),
            "progress": progress(kept, hp.max_grad_norm),
        }
    return out


def _prepared(task: Task, checkpoint: Path | None, where: Path) -> Any:
    """The task's run prepared as ``rloo train`` prepares it, its weights ``checkpoint``'s."""
    import contextlib
    import os

    from worker.engine.prepare import prepare
    from worker.engine.standalone import spec_config

    with (
        tempfile.TemporaryDirectory() as scratch,
        open(os.devnull, "w") as sink,
        contextlib.redirect_stderr(sink),
    ):
        cfg = spec_config(task.spec(where), overrides={}, output_dir=Path(scratch), seed=0)
        if checkpoint is not None:
            cfg = dataclasses.replace(cfg, init_from=(checkpoint,))
        run = prepare(cfg, Collect(quiet=True))
    run.model.train()
    return run


def _batch(run: Any, *, seed: int, b: int, generator_seed: int) -> tuple[Any, Any, Any]:
    """A fresh batch at the run's weights: its rewards ``(B, k)``, the policy's log-probs of its
    completions (with grad) and their mask."""
    import torch

    from worker.engine.data import batch_indices, prompt_text
    from worker.engine.rewards.scoring import score_batch
    from worker.engine.rollout.base import completion_logprobs

    hp = run.rl
    indices = batch_indices(n_items=len(run.items), batch_size=hp.batch_size, step=b, seed=seed)
    items = [run.items[i] for i in indices]
    prompts = [prompt_text(item, run.tokenizer) for item in items]
    ro = run.sampler.generate(prompts, k=hp.rloo_k, generator_seed=generator_seed)
    graded = score_batch(
        run.scorer,
        prompts=[p for p in prompts for _ in range(hp.rloo_k)],
        texts=ro.texts,
        items=[item for item in items for _ in range(hp.rloo_k)],
        reward_models=None,
    )
    rewards = torch.tensor(graded.rewards, dtype=torch.float32).view(hp.batch_size, hp.rloo_k)
    mask = ro.completion_mask.to(torch.float32)
    logp, _ = completion_logprobs(run.model, ro, temperature=hp.temperature)
    return rewards, logp, mask


def _gradients(run: Any, rewards: Any, logp: Any, mask: Any, moments: dict[str, Moments]) -> dict[str, Any]:
    """Each estimator's flat policy gradient on one batch (the engine's loss at ratio 1), added to
    its ``moments``."""
    import torch

    from worker.engine.methods import policy_gradient as rloo

    grads: dict[str, Any] = {}
    for name in moments:
        adv = (rloo.advantages(rewards + 1, "reinforce") if name == SHIFTED else rloo.advantages(rewards, name)).view(
            -1
        )
        hp = run.rl
        loss, _ = rloo.policy_loss(
            logp, logp.detach(), adv, mask, aggregation=hp.loss_aggregation, budget=hp.max_new_tokens
        )
        parts = torch.autograd.grad(loss, run.params, retain_graph=True, allow_unused=True)
        grads[name] = torch.cat(
            [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(parts, run.params, strict=True)]
        )
        moments[name].add(grads[name])
    return grads


MOMENTUM_WINDOW = 10
"""Batches an Adam step's momentum (beta1 0.9) averages, about."""


def progress(kept: dict[str, list[Any]], max_grad_norm: float) -> dict[str, Any]:
    """How far each estimator's update goes along the true gradient, per unit of step.

    The true gradient is cross-fitted: for a batch in one half of the batches, the mean of the
    unbiased estimators' (RLOO's and REINFORCE's) gradients over the *other* half, so that a batch's
    own noise does not count as progress. Per estimator, the mean over batches of the cosine with it
    of: the clipped step (``max_grad_norm``: the direction, every step here being clipped); the
    Adam-preconditioned clipped step, ``u / sqrt(v)`` with ``v`` the mean square of the estimator's
    own clipped gradients (Adam's second moment at fixed weights); and that over ``MOMENTUM_WINDOW``
    consecutive batches averaged (what Adam's momentum sees)."""
    import torch

    n = len(kept["rloo"])
    half = n // 2
    halves = [range(half), range(half, n)]
    truth = [
        torch.stack([(kept["rloo"][i] + kept["reinforce"][i]) / 2 for i in h]).double().mean(dim=0) for h in halves
    ]
    out: dict[str, Any] = {}
    for name, grads in kept.items():
        clipped = [g * min(1.0, max_grad_norm / max(float(g.norm()), 1e-30)) for g in grads]
        v = torch.stack(clipped).double().pow(2).mean(dim=0)
        precondition = 1 / (v.sqrt() + 1e-8)
        cosine = torch.nn.functional.cosine_similarity

        def other(i: int) -> Any:
            return truth[1] if i < half else truth[0]

        clip_cos = [float(cosine(clipped[i].double(), other(i), dim=0)) for i in range(n)]
        adam_cos = [float(cosine(clipped[i].double() * precondition, other(i), dim=0)) for i in range(n)]
        momentum_cos = []
        for h, t in zip(halves, (truth[1], truth[0]), strict=True):
            for start in range(h.start, h.stop - MOMENTUM_WINDOW + 1, MOMENTUM_WINDOW):
                m = torch.stack([clipped[i].double() for i in range(start, start + MOMENTUM_WINDOW)]).mean(dim=0)
                momentum_cos.append(float(cosine(m * precondition, t, dim=0)))
        out[name] = {
            "clipped_step_cosine": round(sum(clip_cos) / n, 4),
            "adam_step_cosine": round(sum(adam_cos) / n, 4),
            "adam_momentum_cosine": round(sum(momentum_cos) / len(momentum_cos), 4) if momentum_cos else None,
        }
    return out


def score_norms(run: Any, logp: Any, mask: Any, rewards: Any, sums: dict[str, float]) -> dict[str, float]:
    """``sums`` plus this batch's: per completion ``s = ||grad log pi(y)||^2`` (one backward each),
    summed with ``r * s``, ``r``, and split by correct (reward 1) and wrong."""
    import torch

    sequence = (logp * mask).sum(dim=-1)
    out = dict(sums)
    for i in range(sequence.numel()):
        parts = torch.autograd.grad(sequence[i], run.params, retain_graph=True, allow_unused=True)
        s = float(sum(g.double().pow(2).sum() for g in parts if g is not None))
        r = float(rewards[i])
        for key, value in (("n", 1.0), ("s", s), ("rs", r * s), ("r", r)):
            out[key] = out.get(key, 0.0) + value
        side = "right" if r > 0.5 else "wrong"
        out[f"n_{side}"] = out.get(f"n_{side}", 0.0) + 1
        out[f"s_{side}"] = out.get(f"s_{side}", 0.0) + s
    return out


def optimal_baseline(sums: dict[str, float]) -> dict[str, Any]:
    """From single completions: the constant ``b`` that minimises the variance of one completion's
    ``(r - b) grad log pi`` (``E[r s] / E[s]`` with ``s = ||grad log pi||^2``, the squared score
    norm) against the mean reward, and how much larger a wrong completion's ``s`` is than a right
    one's. (``constant_baselines`` gives the batch estimator's variance at any constant exactly.)"""
    mean_reward = sums["r"] / sums["n"]
    right = sums.get("s_right", 0.0) / sums["n_right"] if sums.get("n_right") else None
    wrong = sums.get("s_wrong", 0.0) / sums["n_wrong"] if sums.get("n_wrong") else None
    return {
        "completions": int(sums["n"]),
        "mean_reward": round(mean_reward, 4),
        "best_constant_one_completion": round(sums["rs"] / sums["s"], 4),
        "squared_score_norm_wrong_over_right": round(wrong / right, 2) if right and wrong else None,
    }

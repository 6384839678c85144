"""From the grid's runs to the tables: arms (a configuration over its seeds), the best learning rate
of each estimator, paired differences, the noise floor."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.learning.grid import RunConfig


def mean_se(values: list[float]) -> dict[str, Any]:
    """Mean and standard error of the mean (n - 1 in the variance; None for one value)."""
    n = len(values)
    se = round(statistics.stdev(values) / math.sqrt(n), 4) if n > 1 else None
    return {"mean": round(statistics.fmean(values), 4), "se": se, "n": n}


CURVED = ("expected", "greedy", "greedy_reward")
"""The scores without sampling noise, at every checkpoint of a run."""
SCORES = (*CURVED, "sampled")
"""And the run's own sampled pass at its end (one sample of each held-out problem, scored by the
task's grader): the graded task's expected reward, estimated."""


def final(run: dict[str, Any], score: str) -> float:
    """A run's final ``score``."""
    return float(run["sampled_final"] if score == "sampled" else run["final"][score])


def arm_summary(runs: list[dict[str, Any]], start: dict[str, float]) -> dict[str, Any]:
    """Over an arm's seeds: each final score's mean +- s.e., per-seed finals, each score's mean curve
    (with its s.e.), clipping, entropy and the share of constant groups (first and last 50 steps)."""
    steps = [0, *(p["step"] for p in runs[0]["curve"])]
    out: dict[str, Any] = {score: mean_se([final(r, score) for r in runs]) for score in SCORES}
    out["finals_expected"] = [round(r["final"]["expected"], 4) for r in runs]
    out["curves"] = {}
    for score in CURVED:
        curve = [[start[score], *(p[score] for p in r["curve"])] for r in runs]
        out["curves"][score] = {
            "steps": steps,
            "mean": [round(statistics.fmean(c[i] for c in curve), 4) for i in range(len(steps))],
            "se": [mean_se([c[i] for c in curve])["se"] or 0.0 for i in range(len(steps))],
        }
    out["steps_clipped_frac"] = round(statistics.fmean(r["steps_clipped_frac"] for r in runs), 3)
    out["grad_norm_median"] = round(statistics.median(r["grad_norm_median"] for r in runs), 3)
    for name in runs[0]["first_last_50"]:
        out[name + "_first_last_50"] = [
            round(statistics.fmean(r["first_last_50"][name][i] for r in runs), 3) for i in (0, 1)
        ]
    out["wall_s_median"] = statistics.median(r["wall_s"] for r in runs)
    return out


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], score: str = "expected") -> dict[str, Any]:
    """``a``'s final ``score`` less ``b``'s, runs of the same seeds in order (paired: a seed fixes the
    data order and the first rollouts): the mean difference, its standard error, ``t`` (9 degrees of
    freedom for 10 seeds: |t| > 2.26 is p < 0.05)."""
    diffs = [final(x, score) - final(y, score) for x, y in zip(a, b, strict=True)]
    d = mean_se(diffs)
    return {"difference": d["mean"], "se": d["se"], "t": round(d["mean"] / d["se"], 2) if d["se"] else None}


def unpaired(a: list[dict[str, Any]], b: list[dict[str, Any]], score: str = "expected") -> dict[str, Any]:
    x, y = mean_se([final(r, score) for r in a]), mean_se([final(r, score) for r in b])
    se = math.hypot(x["se"] or 0.0, y["se"] or 0.0)
    diff = x["mean"] - y["mean"]
    return {"difference": round(diff, 4), "se": round(se, 4), "t": round(diff / se, 2) if se else None}


def by_arm(configs: list[RunConfig], results: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each arm's runs, in seed order."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for cfg in sorted(configs, key=lambda c: c.seed):
        arms.setdefault(cfg.arm, []).append(results[cfg.key])
    return arms


PRIMARY = {"exact": "expected", "graded": "sampled"}
"""What a task's comparisons read: the exact task's expected accuracy (exact); the graded task's
expected reward, which has no closed form here, as the runs' own sampled passes estimate it (its
noise is in the seeds' spread and in the noise floor; its greedy reward and exact expected accuracy
are shown beside, without noise)."""
CURVE = {"exact": "expected", "graded": "greedy_reward"}
"""What a task's learning curves show (the sampled pass runs at the end only)."""


def best_rate(
    arms: dict[str, list[dict[str, Any]]], task: str, estimator: str, aggregation: str, rates: list[float]
) -> float:
    """The rate whose arm has the highest mean final primary score (``PRIMARY``)."""

    def score(rate: float) -> float:
        runs = arms[RunConfig(task, estimator, rate, aggregation).arm]
        return statistics.fmean(final(r, PRIMARY[task]) for r in runs)

    return max(rates, key=score)

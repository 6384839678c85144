"""``benchmarks/learning.png`` from the benchmark's JSON: learning curves of both tasks, the
learning-rate sweep, and the gradient variance at fixed weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.learning.analysis import CURVE
from benchmarks.learning.tasks import job_settings
from benchmarks.learning.variance import ESTIMATORS, SHIFTED

SWEPT = ("rloo", "grpo", "reinforce")  # (reinforce_mean: the default rate only)

COLOURS = {
    "rloo": "#1f77b4",
    "grpo": "#2ca02c",
    "reinforce": "#d62728",
    "reinforce_mean": "#9467bd",
    SHIFTED: "#ff9896",
}


def draw(result: dict[str, Any], path: Path) -> None:
    """Top: each task's primary score over steps, per estimator at the shared default rate (mean of
    the seeds, a band of one standard error); the gradient variance at fixed weights. Bottom: each
    task's final score against the learning rate, per estimator; each estimator's progress along the
    true gradient per step, clipped and Adam-preconditioned."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(2, 3, figsize=(19, 9.5))
    for column, task in enumerate(("exact", "graded")):
        if task in tasks:
            _curves(axes[0][column], task, tasks[task], result["seeds"])
            _sweep(axes[1][column], task, tasks[task], result["rates"])
    _variance(axes[0][2], result["gradients"]["exact"])
    _progress(axes[1][2], result["gradients"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


LABELS = {
    "expected": "expected held-out accuracy (exact, no sampling)",
    "greedy_reward": "held-out similarity reward of the greedy answer",
    "sampled": "held-out similarity reward, one sample each (the run's pass)",
}


def _arm(task: str, estimator: str, rate: float, aggregation: str = "sequence_sum") -> str:
    return f"{task}-{estimator}-{aggregation}-lr{rate:g}"


def _curves(ax: Any, task: str, figures: dict[str, Any], seeds: int) -> None:
    default, score = job_settings()["learning_rate"], CURVE[task]
    for name in ESTIMATORS:
        arm = figures["arms"][_arm(task, name, default)]
        curve, colour = arm["curves"][score], COLOURS[name]
        lo = [m - e for m, e in zip(curve["mean"], curve["se"], strict=True)]
        hi = [m + e for m, e in zip(curve["mean"], curve["se"], strict=True)]
        final = arm[score]
        label = f"{name} ({100 * final['mean']:.1f} +- {100 * final['se']:.1f})"
        ax.plot(curve["steps"], curve["mean"], color=colour, label=label, linewidth=2 if name == "rloo" else 1.2)
        ax.fill_between(curve["steps"], lo, hi, color=colour, alpha=0.15)
    floor = figures["noise_floor"][figures["score"]]
    reward = "exact match, 0/1" if task == "exact" else "fuzzy similarity in [0, 1]"
    ax.set_title(
        f"{task} task ({reward}), lr {default:g}, {seeds} seeds\nnoise floor (same arm, other seeds): "
        f"{100 * floor['difference']:+.1f} +- {100 * floor['se']:.1f} points",
        fontsize=10,
    )
    ax.set_xlabel("RL step (16 problems x 8 samples)")
    ax.set_ylabel(LABELS[score])
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)


def _sweep(ax: Any, task: str, figures: dict[str, Any], rates: list[float]) -> None:
    score = figures["score"]
    for name in SWEPT:
        finals = [figures["arms"][_arm(task, name, r)][score] for r in rates]
        ax.errorbar(
            rates,
            [f["mean"] for f in finals],
            yerr=[f["se"] or 0.0 for f in finals],
            color=COLOURS[name],
            marker="o",
            markersize=4,
            capsize=2,
            label=name,
        )
    ax.set_xscale("log")
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("learning rate (AdamW, constant; steps clipped to norm 1)")
    ax.set_ylabel("final " + LABELS[score])
    ax.set_title(f"{task} task: final score against the learning rate, mean +- s.e.", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _progress(ax: Any, gradients: dict[str, Any]) -> None:
    """Per task and estimator, the mean over points of the cosine of a step with the true gradient."""
    kinds = (
        ("clipped_step_cosine", "clipped step"),
        ("adam_step_cosine", "Adam step"),
        ("adam_momentum_cosine", "Adam, 10 steps"),
    )
    groups = [(task, kind, label) for task in gradients for kind, label in kinds]
    width = 0.8 / len(ESTIMATORS)
    for i, name in enumerate(ESTIMATORS):
        values = []
        for task, kind, _ in groups:
            points = [
                p["progress"][name][kind] for p in gradients[task].values() if p["progress"][name][kind] is not None
            ]
            values.append(sum(points) / len(points) if points else math.nan)
        xs = [j + (i - (len(ESTIMATORS) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, values, width=width, color=COLOURS[name], label=name)
    ax.set_xticks(range(len(groups)), [f"{task}\n{label}" for task, _, label in groups], fontsize=8)
    ax.set_ylabel("cosine with the true gradient (mean over points)")
    ax.set_title("Progress along the true gradient per step (cross-fitted)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _variance(ax: Any, variance: dict[str, Any]) -> None:
    points = list(variance)
    names = (*ESTIMATORS, SHIFTED)
    width = 0.8 / len(names)
    shown = []
    for i, name in enumerate(names):
        values = [variance[p][name]["variance_vs_rloo_same_scale"] or math.nan for p in points]  # None: no signal
        shown += [v for v in values if math.isfinite(v)]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(points))]
        ax.bar(
            xs,
            [v - 1 for v in values],
            bottom=1,
            width=width,
            color=COLOURS[name],
            label=name,
            hatch="//" if name == SHIFTED else None,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(points)), [f"step {p}" for p in points])
    ax.set_yscale("log")
    low, high = math.floor(math.log2(min(shown, default=1))), math.ceil(math.log2(max(shown, default=1)))
    ticks = [2.0**e for e in range(min(low, -1), max(high, 1) + 1)]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_yticks([], minor=True)
    ax.set_ylabel("gradient variance / RLOO's, at an equal scale")
    ax.set_title(
        f"Exact task: gradient variance at fixed weights ({variance[points[0]]['batches']} batches)", fontsize=10
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

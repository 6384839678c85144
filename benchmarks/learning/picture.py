"""``benchmarks/learning.png`` from the benchmark's JSON: learning curves of both tasks, the
learning-rate sweep, and the gradient variance at fixed weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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
    """Top: each task's expected held-out score over steps, per estimator at the shared default rate
    (mean of the seeds, a band of one standard error). Bottom left: the final score against the
    learning rate, per estimator and task. Bottom right: each estimator's gradient variance against
    RLOO's at an equal scale, at each point of the exact task's RLOO run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, task in zip(axes[0], ("exact", "graded"), strict=True):
        if task in tasks:
            _curves(ax, task, tasks[task], result["seeds"])
    _sweep(axes[1][0], tasks, result["rates"])
    _variance(axes[1][1], result["gradients"]["exact"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _arm(task: str, estimator: str, rate: float, aggregation: str = "sequence_sum") -> str:
    return f"{task}-{estimator}-{aggregation}-lr{rate:g}"


def _curves(ax: Any, task: str, figures: dict[str, Any], seeds: int) -> None:
    default = job_settings()["learning_rate"]
    for name in ESTIMATORS:
        arm = figures["arms"][_arm(task, name, default)]
        curve, colour = arm["curve"], COLOURS[name]
        lo = [m - e for m, e in zip(curve["mean"], curve["se"], strict=True)]
        hi = [m + e for m, e in zip(curve["mean"], curve["se"], strict=True)]
        final = arm["expected"]
        label = f"{name} ({final['mean']:.1%} +- {final['se']:.1%})"
        ax.plot(curve["steps"], curve["mean"], color=colour, label=label, linewidth=2 if name == "rloo" else 1.2)
        ax.fill_between(curve["steps"], lo, hi, color=colour, alpha=0.15)
    floor = figures["noise_floor"]["expected"]
    reward = "exact match, 0/1" if task == "exact" else "fuzzy similarity in [0, 1]"
    ax.set_title(f"{task} task ({reward}): lr {default:g}, {seeds} seeds; noise floor +- {floor['se']:.1%}")
    ax.set_xlabel("RL step (16 problems x 8 samples)")
    ax.set_ylabel("expected held-out accuracy (exact, no sampling)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)


def _sweep(ax: Any, tasks: dict[str, Any], rates: list[float]) -> None:
    for task, style in (("exact", "-"), ("graded", "--")):
        if task not in tasks:
            continue
        for name in SWEPT:
            finals = [tasks[task]["arms"][_arm(task, name, r)]["expected"] for r in rates]
            ax.errorbar(
                rates,
                [f["mean"] for f in finals],
                yerr=[f["se"] or 0.0 for f in finals],
                color=COLOURS[name],
                linestyle=style,
                marker="o",
                markersize=4,
                capsize=2,
                label=f"{name}, {task}",
            )
    ax.set_xscale("log")
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xlabel("learning rate (AdamW, constant; every step clipped to norm 1)")
    ax.set_ylabel("final expected held-out accuracy")
    ax.set_title("Learning-rate sweep: final accuracy, mean +- s.e.")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


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
    ax.set_title(f"Exact task: gradient variance at fixed weights ({variance[points[0]]['batches']} batches)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

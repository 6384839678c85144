"""The learning benchmark's tables as markdown, from its JSON (``benchmarks/learning.json``), so that
``benchmarks/RESULTS.md`` section 8 carries the very figures a run wrote:
``python -m benchmarks.learning.report [benchmarks/learning.json]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.learning.tasks import job_settings

SWEPT = ("rloo", "grpo", "reinforce")


def pct(x: dict[str, Any] | float, se: bool = True) -> str:
    if isinstance(x, dict):
        return f"{100 * x['mean']:.1f} ± {100 * (x['se'] or 0):.1f}" if se else f"{100 * x['mean']:.1f}"
    return f"{100 * x:.1f}"


def diff(d: dict[str, Any]) -> str:
    t = "" if d["t"] is None else f" (t = {d['t']:.1f})"
    return f"{100 * d['difference']:+.1f} ± {100 * (d['se'] or 0):.1f}{t}"


def arm(task: str, estimator: str, rate: float, aggregation: str = "sequence_sum", drop: bool = False) -> str:
    return f"{task}-{estimator}-{aggregation}{'-drop' if drop else ''}-lr{rate:g}"


SECOND = {"exact": "greedy", "graded": "greedy_reward"}
"""Beside a task's primary score in the sweep: the greedy answer's accuracy, or reward."""


def sweep(task: str, figures: dict[str, Any], rates: list[float]) -> list[str]:
    """Estimators x rates: the task's final primary score (and its second, in brackets)."""
    primary, second = figures["score"], SECOND[task]
    head = "| estimator | " + " | ".join(f"lr {r:g}" for r in rates) + " | best |"
    lines = [head, "|---" * (len(rates) + 2) + "|"]
    for e in SWEPT:
        cells = []
        for r in rates:
            a = figures["arms"][arm(task, e, r)]
            cells.append(f"{pct(a[primary])} ({pct(a[second], se=False)})")
        lines.append(f"| `{e}` | " + " | ".join(cells) + f" | {figures['best_rate'][e]:g} |")
    return lines


def comparisons(task: str, figures: dict[str, Any]) -> list[str]:
    default = job_settings()["learning_rate"]
    lines = [f"| comparison (paired by seed) | {figures['score']}, points |", "|---|---|"]
    for e, d in figures["vs_rloo_at_default"].items():
        lines.append(f"| `{e}` − `rloo`, both at {default:g} | {diff(d)} |")
    for e, d in figures["vs_rloo_each_at_best"].items():
        best = figures["best_rate"]
        lines.append(f"| `{e}` at {best[e]:g} − `rloo` at {best['rloo']:g} (each at its best) | {diff(d)} |")
    for a, d in figures["aggregations_vs_sequence_sum"].items():
        lines.append(f"| `{a}` − `sequence_sum` (RLOO, {default:g}) | {diff(d)} |")
    lines.append(
        f"| `drop_constant_groups` − kept (RLOO, {default:g}) | {diff(figures['drop_constant_groups_vs_kept'])} |"
    )
    floor = figures["noise_floor"]
    lines.append(f"| **noise floor**: `rloo` seeds 100-109 − seeds 0-9 (unpaired) | {diff(floor[figures['score']])} |")
    return lines


def arms_table(task: str, figures: dict[str, Any]) -> list[str]:
    default = job_settings()["learning_rate"]
    lines = [
        f"| arm (lr {default:g}) | expected | greedy | greedy reward | sampled (run's own pass) | clipped steps | "
        "constant groups first→last 50 | entropy first→last 50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = [
        ("rloo", arm(task, "rloo", default)),
        ("rloo, seeds 100-109", arm(task, "rloo", default) + "-copy"),
        ("grpo", arm(task, "grpo", default)),
        ("reinforce", arm(task, "reinforce", default)),
        ("reinforce_mean", arm(task, "reinforce_mean", default)),
        ("rloo, token_mean", arm(task, "rloo", default, "token_mean")),
        ("rloo, sequence_mean", arm(task, "rloo", default, "sequence_mean")),
        ("rloo, constant", arm(task, "rloo", default, "constant")),
        ("rloo, drop_constant_groups", arm(task, "rloo", default, drop=True)),
    ]
    for label, key in names:
        a = figures["arms"].get(key)
        if a is None:
            continue
        cg, en = a["constant_groups_frac_first_last_50"], a["entropy_first_last_50"]
        lines.append(
            f"| {label} | {pct(a['expected'])} | {pct(a['greedy'])} | {pct(a['greedy_reward'])} | "
            f"{pct(a['sampled'])} | {100 * a['steps_clipped_frac']:.0f}% | {cg[0]:.2f}→{cg[1]:.2f} | "
            f"{en[0]:.2f}→{en[1]:.2f} |"
        )
    return lines


def gradients(task: str, variance: dict[str, Any]) -> list[str]:
    names = ("rloo", "grpo", "reinforce", "reinforce_mean", "reinforce_reward_plus_1")
    lines = [
        "| step (mean reward) | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for step, point in variance.items():
        cells = []
        for n in names:
            v = point[n]
            bias = v["bias_statistic_vs_reinforce"]
            cells.append(f"{v['variance_vs_rloo_same_scale']} / {bias if bias is not None else '–'}")
        lines.append(f"| {step} ({point['mean_reward']:.2f}) | " + " | ".join(cells) + " |")
    head = " | ".join(f"`{n}` clipped / Adam / Adam x10" for n in names[:4])
    lines += ["", f"| step | {head} | REINFORCE with a constant baseline: variance / RLOO's |", "|---" * 6 + "|"]
    for step, point in variance.items():
        cells = []
        for n in names[:4]:
            p = point["progress"][n]
            momentum = p["adam_momentum_cosine"]
            clipped, adam = p["clipped_step_cosine"], p["adam_step_cosine"]
            cells.append(f"{clipped:.2f} / {adam:.2f} / " + ("–" if momentum is None else f"{momentum:.2f}"))
        cb = point["constant_baselines"]
        v = cb["variance_vs_rloo"]
        constant = (
            f"none {v['none']}, mean reward {v['mean_reward']}, best ({cb['best_constant']:.2f}) {v['best_constant']}"
        )
        lines.append(f"| {step} | " + " | ".join(cells) + f" | {constant} |")
    return lines


def main(path: Path) -> None:
    result = json.loads(path.read_text())
    for task, figures in result.get("tasks", {}).items():
        print(f"\n### {task}\n")
        print(f"start: {json.dumps(figures['start'])}\n")
        print("\n".join(sweep(task, figures, result["rates"])), "\n")
        print("\n".join(arms_table(task, figures)), "\n")
        print("\n".join(comparisons(task, figures)), "\n")
        if task in result.get("gradients", {}):
            print("\n".join(gradients(task, result["gradients"][task])), "\n")
    if "trl_gradients" in result:
        print(json.dumps(result["trl_gradients"], indent=1))
    if "through_api" in result:
        print(json.dumps(result["through_api"], indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "learning.json")

"""``make bench-learning``: the learning benchmark (``benchmarks/learning/__init__.py`` says what it
measures). Prints one JSON object, writes it to ``benchmarks/learning.json`` and draws
``benchmarks/learning.png``; ``benchmarks/RESULTS.md`` section 8 reads them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT
from benchmarks.learning import analysis, grid
from benchmarks.learning.grid import COPY_SEEDS, RunConfig
from benchmarks.learning.tasks import EXAMPLE, TASKS, job_settings
from benchmarks.learning.variance import ESTIMATORS

SECTIONS = ("grid", "variance", "trl", "api")
RATES = (1.25e-4, 2.5e-4, 5e-4, 1e-3)
AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
"""Beside sequence_sum (every estimator's), for RLOO."""
SWEPT = ("rloo", "grpo", "reinforce")
"""The estimators swept over rates. ``reinforce_mean``'s gradient is RLOO's times (k-1)/k, and every
step here is clipped: its update is RLOO's to rounding, so it runs at the default rate only (a
second noise floor)."""
HERE = Path(__file__).resolve().parent.parent
OUT_JSON, PICTURE = HERE / "learning.json", HERE / "learning.png"


def configs(tasks: list[str], seeds: int, rates: list[float]) -> dict[str, list[RunConfig]]:
    """The grid, by part, in the order it runs (the first parts' figures are the headline): the
    estimators with a distinct update under clipping (``SWEPT``) at every rate with sequence_sum,
    and the noise floor's copy of the default arm on other seeds; then at the default rate, RLOO
    under each other aggregation, RLOO dropping constant groups, and ``reinforce_mean``."""
    default = job_settings()["learning_rate"]
    seeded = range(seeds)  # seed-major within a part: drift in the machine's speed hits every arm alike
    parts: dict[str, list[RunConfig]] = {
        "estimators": [RunConfig(t, e, lr, seed=s) for t in tasks for s in seeded for e in SWEPT for lr in rates],
        "noise": [RunConfig(t, "rloo", default, seed=COPY_SEEDS + s) for t in tasks for s in seeded],
        "aggregations": [RunConfig(t, "rloo", default, a, seed=s) for t in tasks for s in seeded for a in AGGREGATIONS],
        "drop": [RunConfig(t, "rloo", default, drop_constant_groups=True, seed=s) for t in tasks for s in seeded],
        "reinforce_mean": [RunConfig(t, "reinforce_mean", default, seed=s) for t in tasks for s in seeded],
    }
    return parts


def tables(
    parts: dict[str, list[RunConfig]], results: dict[str, Any], starts: dict[str, Any], rates: list[float]
) -> dict[str, Any]:
    """Per task (``task_tables``), from every arm's runs."""
    everything = [c for cs in parts.values() for c in cs]
    arms = analysis.by_arm(everything, results)
    out: dict[str, Any] = {}
    for task in sorted({c.task for c in everything}):
        out[task] = task_tables(task, arms, starts[task], rates)
    return out


def task_tables(
    task: str, arms: dict[str, list[dict[str, Any]]], start: dict[str, Any], rates: list[float]
) -> dict[str, Any]:
    """Every arm's summary; each estimator at its best rate and at the default, against RLOO at its
    best and at the default (paired by seed); the aggregations against sequence_sum;
    dropping constant groups against keeping them; the noise floor."""
    default = job_settings()["learning_rate"]
    best = {e: analysis.best_rate(arms, task, e, "sequence_sum", rates) for e in SWEPT}

    def runs(estimator: str, rate: float, aggregation: str = "sequence_sum", drop: bool = False) -> Any:
        return arms[RunConfig(task, estimator, rate, aggregation, drop).arm]

    copy = arms[RunConfig(task, "rloo", default, seed=COPY_SEEDS).arm]
    score = analysis.PRIMARY[task]

    def paired(a: Any, b: Any) -> dict[str, Any]:
        return analysis.paired(a, b, score)

    return {
        "start": start,
        "arms": {arm: analysis.arm_summary(rs, start) for arm, rs in arms.items() if arm.startswith(task + "-")},
        "best_rate": best,
        "score": score,
        "vs_rloo_at_default": {e: paired(runs(e, default), runs("rloo", default)) for e in ESTIMATORS[1:]},
        "vs_rloo_each_at_best": {e: paired(runs(e, best[e]), runs("rloo", best["rloo"])) for e in SWEPT[1:]},
        "aggregations_vs_sequence_sum": {
            a: paired(runs("rloo", default, a), runs("rloo", default)) for a in AGGREGATIONS
        },
        "drop_constant_groups_vs_kept": paired(runs("rloo", default, drop=True), runs("rloo", default)),
        "noise_floor": {s: analysis.unpaired(copy, runs("rloo", default), s) for s in analysis.SCORES},
    }


def start_scores(tasks: list[str], home: Path) -> dict[str, Any]:
    """Each task's held-out scores of the supervised start (step 0 of every run)."""
    from benchmarks.learning.scoring import held_out
    from service.core.settings import get_settings
    from worker.engine.data import load_items

    items = load_items(EXAMPLE / "valid.jsonl")
    model = get_settings().models_dir / json.loads((EXAMPLE / "job.json").read_text())["model"]
    return {t: held_out(model, TASKS[t], items, job_settings()["max_new_tokens"]) for t in tasks}


SECTION_KEYS = {"grid": "tasks", "variance": "gradients", "trl": "trl_gradients", "api": "through_api"}


def _kept(out: Path, sections: set[str]) -> dict[str, Any]:
    """The figures of the sections not run this time, from the last run's ``out`` (so that
    ``--sections grid`` re-tables the cached runs and keeps the gradients)."""
    if not out.is_file():
        return {}
    last = json.loads(out.read_text())
    return {key: last[key] for name, key in SECTION_KEYS.items() if name not in sections and key in last}


def build(home: Path) -> None:
    """``examples/addition/build.py`` into ``home`` (kept: a built model is not rebuilt)."""
    built = subprocess.run([sys.executable, str(EXAMPLE / "build.py")], capture_output=True, text=True, env=os.environ)
    if built.returncode:
        raise RuntimeError(f"examples/addition/build.py failed:\n{built.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="The learning benchmark: estimators, rates, aggregations, seeds")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=job_settings()["max_steps"])
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (one thread each)")
    parser.add_argument("--batches", type=int, default=128, help="batches per gradient point")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument(
        "--cache",
        type=Path,
        default=ROOT / "var" / "bench-learning",
        help="where the built models and each finished run's figures are kept (a rerun takes them from there)",
    )
    parser.add_argument("--out", type=Path, default=OUT_JSON)
    parser.add_argument("--picture", type=Path, default=PICTURE)
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections <= set(SECTIONS):
        parser.error(f"--sections: unknown {', '.join(sorted(sections - set(SECTIONS)))}; use {', '.join(SECTIONS)}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not set(tasks) <= set(TASKS):
        parser.error(f"--tasks: use {', '.join(TASKS)}")
    rates = [float(r) for r in args.rates.split(",")]
    if job_settings()["learning_rate"] not in rates:
        parser.error("--rates must hold job.json's learning rate (the shared default)")
    home = (args.cache / "home").resolve()
    for name in ("DATABASE_URL", "RLOO_DATABASE_URL", "REDIS_URL", "RLOO_REDIS_URL", "RLOO_MODELS_DIR"):
        os.environ.pop(name, None)
    os.environ["RLOO_HOME"] = str(home)
    import torch

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "threads_per_run": 1,
        "settings": {**job_settings(), "max_steps": args.steps},
        "seeds": args.seeds,
        "rates": rates,
    }
    t0 = time.perf_counter()
    build(home)
    starts = start_scores(tasks, home)
    result["start"] = starts
    if "grid" in sections:
        parts = configs(tasks, args.seeds, rates)
        everything = [c for cs in parts.values() for c in cs]
        results = grid.run_grid(everything, home=home, cache=args.cache / "runs", steps=args.steps, jobs=args.jobs)
        result["tasks"] = tables(parts, results, starts, rates)
    if "variance" in sections:
        from benchmarks.learning.sections import variance_section

        result["gradients"] = variance_section(tasks, home, args)
    if "trl" in sections:
        from benchmarks.learning.trl_check import gradients_against_trl

        result["trl_gradients"] = gradients_against_trl(home)
    if "api" in sections:
        from benchmarks.learning.sections import api_section

        result["through_api"] = api_section(home, args)
    result["wall_min"] = round((time.perf_counter() - t0) / 60, 1)
    result = {**_kept(args.out, sections), **result}
    args.out.write_text(json.dumps(result, indent=1))
    if "tasks" in result and "gradients" in result:
        from benchmarks.learning.picture import draw

        draw(result, args.picture)
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

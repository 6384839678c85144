"""Runs of the learning benchmark: one job a configuration and seed, in parallel processes, each
result kept in a cache directory so that a grid stopped half way goes on where it stopped.

A run is ``examples/addition/job.json`` (or the graded task's copy) through ``rloo train``'s own
path (``run_spec``) with its configuration's hyperparameters, checkpointed every ``CURVE_EVERY``
steps; every checkpoint is then scored by ``scoring.held_out`` (no sampling) and removed. Its own
sampled validation pass runs once, at the end, as a check on the exact figure.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Collect

CURVE_EVERY = 100
COPY_SEEDS = 100


@dataclass(frozen=True)
class RunConfig:
    task: str
    estimator: str
    learning_rate: float
    aggregation: str = "sequence_sum"
    drop_constant_groups: bool = False
    seed: int = 0

    @property
    def key(self) -> str:
        drop = "-drop" if self.drop_constant_groups else ""
        return f"{self.task}-{self.estimator}-{self.aggregation}{drop}-lr{self.learning_rate:g}-s{self.seed}"

    @property
    def arm(self) -> str:
        """The configuration without its seed: what the tables compare (seeds from ``COPY_SEEDS``
        on make a copy of it, identical by construction: the noise floor)."""
        return self.key.rsplit("-s", 1)[0] + ("-copy" if self.seed >= COPY_SEEDS else "")


def run_one(cfg: RunConfig, home: str, steps: int) -> dict[str, Any]:
    """One run of ``cfg`` in this process (``RLOO_HOME`` = ``home``, built): its step metrics'
    summaries and its held-out scores at step 0, every ``CURVE_EVERY`` steps and at the end."""
    os.environ["RLOO_HOME"] = home
    import torch

    torch.set_num_threads(1)
    from benchmarks.learning.scoring import held_out
    from benchmarks.learning.tasks import TASKS, job_settings
    from worker.engine.data import load_items
    from worker.engine.standalone import run_spec

    task = TASKS[cfg.task]
    out = Path(home) / "runs" / cfg.key
    shutil.rmtree(out, ignore_errors=True)
    spec = task.spec(Path(home) / "specs")
    overrides = {
        "advantage_estimator": cfg.estimator,
        "learning_rate": cfg.learning_rate,
        "loss_aggregation": cfg.aggregation,
        "drop_constant_groups": cfg.drop_constant_groups,
        "max_steps": steps,
        "checkpoint_interval": CURVE_EVERY,
        "eval_interval": steps,  # one sampled pass, at the end
        "sample_interval": 0,
    }
    rec = Collect(quiet=True)
    with open(os.devnull, "w") as sink:
        stderr, sys.stderr = sys.stderr, sink
        try:
            summary = run_spec(spec, overrides=overrides, output_dir=out, recorder=rec, seed=cfg.seed)
        finally:
            sys.stderr = stderr
    if summary["status"] != "succeeded":
        raise RuntimeError(f"{cfg.key}: {summary}")
    settings = job_settings()
    items = load_items(Path(spec).parent / json.loads(Path(spec).read_text())["validation_file"])
    points = sorted((int(p.name[5:]), p) for p in out.glob("step-*"))
    curve = [(step, held_out(path, task, items, settings["max_new_tokens"])) for step, path in points]
    shutil.rmtree(out, ignore_errors=True)
    metrics = rec.steps
    grad_norms = [m["grad_norm"] for m in metrics]
    return {
        "config": asdict(cfg),
        "wall_s": round(summary["wall_s"], 1),
        "curve": [{"step": step, **scores} for step, scores in curve],
        "final": curve[-1][1],
        "sampled_final": metrics[-1].get("valid_reward_mean"),
        "grad_norm_median": statistics.median(grad_norms),
        "steps_clipped_frac": sum(g > 1.0 for g in grad_norms) / len(grad_norms),
        "first_last_50": {
            name: _first_last(metrics, name)
            for name in ("entropy", "constant_groups_frac", "train_reward_mean", "completion_length_mean")
        },
    }


def _first_last(metrics: list[dict[str, Any]], name: str, n: int = 50) -> list[float]:
    values = [float(m[name]) for m in metrics]
    return [round(statistics.fmean(values[:n]), 4), round(statistics.fmean(values[-n:]), 4)]


def run_grid(configs: list[RunConfig], *, home: Path, cache: Path, steps: int, jobs: int) -> dict[str, dict[str, Any]]:
    """Every config's run, from ``cache`` where it is there (``<key>-<steps>.json``), else run
    ``jobs`` at a time (each process one torch thread), written to ``cache`` as it ends."""
    cache.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for cfg in configs:
        path = cache / f"{cfg.key}-{steps}.json"
        if path.is_file():
            results[cfg.key] = json.loads(path.read_text())
        else:
            todo.append(cfg)
    print(f"{len(results)} runs cached, {len(todo)} to run ({jobs} at a time)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(run_one, cfg, str(home), steps): cfg for cfg in todo}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            cfg = futures[future]
            result = future.result()
            (cache / f"{cfg.key}-{steps}.json").write_text(json.dumps(result))
            results[cfg.key] = result
            elapsed = time.perf_counter() - t0
            print(
                f"[{done}/{len(todo)}] {cfg.key}: expected {result['final']['expected']:.3f} "
                f"greedy {result['final']['greedy']:.3f} ({result['wall_s']} s; {elapsed / 60:.1f} min in)",
                file=sys.stderr,
                flush=True,
            )
    return results

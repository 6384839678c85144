"""The benchmark's sections beside the grid: gradients at fixed weights along an RLOO run, and the
same run through the HTTP API."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any

from benchmarks.common import Collect
from benchmarks.learning.tasks import TASKS, Task


def reference_run(task: Task, home: Path, steps: int, every: int) -> tuple[Path, list[dict[str, Any]], dict[str, Any]]:
    """The task's RLOO seed-0 run at the default rate, in this process, checkpointed every
    ``every`` steps: its directory, its step metrics, the overrides it ran with."""
    from worker.engine.standalone import run_spec

    out = home / "reference" / f"{task.name}-every-{every}"
    overrides = {"max_steps": steps, "checkpoint_interval": every, "eval_interval": steps, "sample_interval": 0}
    rec = Collect(quiet=True)
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        summary = run_spec(task.spec(home / "specs"), overrides=overrides, output_dir=out, recorder=rec, seed=0)
    if summary["status"] != "succeeded":
        raise RuntimeError(f"{task.name} reference run: {summary}")
    return out, rec.steps, overrides


def variance_section(tasks: list[str], home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Per task: ``gradient_variance`` at the supervised start and at three checkpoints of its RLOO
    seed-0 run."""
    from benchmarks.learning.variance import gradient_variance

    out: dict[str, Any] = {}
    for name in tasks:
        task = TASKS[name]
        run_dir, _, _ = reference_run(task, home, args.steps, max(1, args.steps // 3))
        points: dict[int, Path | None] = {0: None}
        points.update({int(p.name[5:]): p for p in sorted(run_dir.glob("step-*"), key=lambda p: int(p.name[5:]))})
        out[name] = gradient_variance(task, points, home / "specs", args.batches)
    return out


def api_section(home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The exact task's RLOO seed-0 job through the HTTP API against the same run in this process."""
    import torch

    from benchmarks.learning.api import through_api

    # The stack's worker computes on one thread on this 2-core machine (worker.engine.cpu_threads keeps a
    # core for the rest): the reference too, or the two reduce in other orders and part within a few
    # hundred steps, as rounding grows into different samples.
    torch.set_num_threads(1)
    _, steps, overrides = reference_run(TASKS["exact"], home, args.steps, 0)
    return through_api(steps, overrides)

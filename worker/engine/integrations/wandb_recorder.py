"""Weights & Biases for a job that asks for it (``integrations: [{type: "wandb", wandb: {...}}]``):
its config once, every step's metrics, and the recorded samples as a table, logged beside the
job's own rows (the database stays the truth; W&B is a view of it).

The run's id is the job's, so a job that runs again (a pause, a worker lost) continues the same
run. W&B failing (no network, a bad key) costs a warning event, never the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker.engine.config import TrainConfig
from worker.engine.recorders import Recorder, json_safe

SAMPLE_COLUMNS: list[str | int] = ["step", "prompt", "completion", "reward", "advantage"]


class WandbRecorder:
    """A recorder that also logs to a W&B run; everything else is the inner recorder's."""

    def __init__(self, inner: Recorder, run: Any) -> None:
        self.inner, self.run, self.failed = inner, run, False

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.failed:
            return
        try:
            self.run.log(data, step=step)
        except Exception as exc:  # W&B's trouble is not the job's
            self.failed = True
            self.inner.event(f"Weights & Biases stopped logging: {type(exc).__name__}: {exc}", level="warn")

    def event(self, message: str, level: str = "info") -> None:
        self.inner.event(message, level)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        self._log({k: v for k, v in json_safe(metrics).items() if isinstance(v, (int, float))}, step)
        return self.inner.step(step, metrics)

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool, written: bool = True) -> None:
        self.inner.checkpoint(step, path, metrics, final, written)

    def checkpoint_removed(self, step: int) -> None:
        self.inner.checkpoint_removed(step)

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        import wandb

        rows = [[step, g["prompt"], c["text"], c["reward"], c["advantage"]] for g in groups for c in g["completions"]]
        self._log({"samples": wandb.Table(columns=SAMPLE_COLUMNS, data=rows)}, step)
        self.inner.samples(step, groups)


@contextlib.contextmanager
def recording(cfg: TrainConfig, recorder: Recorder) -> Iterator[Recorder]:
    """``recorder``, or a ``WandbRecorder`` around it for the run's life when the job asks for W&B
    (on rank 0 alone, when the job runs on several)."""
    from worker.engine.distributed.ranks import current

    spec = next((i["wandb"] for i in cfg.integrations if i.get("type") == "wandb"), None)
    if spec is None or not current().is_main:
        yield recorder
        return
    try:
        import wandb

        run = wandb.init(
            project=spec["project"],
            entity=spec.get("entity"),
            name=spec.get("name") or cfg.job_name,
            tags=spec.get("tags"),
            id=cfg.job_name,
            resume="allow",
            dir=str(cfg.output_dir),
            config={"model": cfg.model, "method": cfg.method, "seed": cfg.seed, **cfg.hyperparameters.model_dump()},
        )
    except Exception as exc:
        recorder.event(f"Weights & Biases did not start: {type(exc).__name__}: {exc}", level="warn")
        yield recorder
        return
    recorder.event(f"Logging to Weights & Biases: project {spec['project']}, run {run.id}")
    failed = True
    try:
        yield WandbRecorder(recorder, run)
        failed = False
    finally:
        with contextlib.suppress(Exception):
            run.finish(exit_code=1 if failed else 0)

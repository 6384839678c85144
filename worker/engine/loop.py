"""What every method's training loop shares after it has computed a step: recording it, stopping
where a pause or a cancel says, checkpoints at the interval and at the end, and the result.

A loop (``worker.engine.methods``: ``rloo`` for RLOO, ``supervised``, ``dpo``) reads::

    for step in range(run.start + 1, run.total_steps + 1):
        ...compute the step's metrics...
        if (stop := end_of_step(run, step, metrics, recorder)).done:
            break
    return finish(run, stop, recorder)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.engine.recorders import Recorder
from worker.engine.resume import record_final, save
from worker.engine.state import Run


@dataclass
class TrainResult:
    steps: int
    stopped: str | None
    final_checkpoint: Path | None
    first: float | None
    """The headline metric (``headline``) at the run's first step."""
    last: float | None
    trained_tokens: int
    resumed_from: int | None = None
    headline: str = "train_reward_mean"
    """What ``first`` and ``last`` measure: the reward for RLOO, the loss for supervised and DPO."""


@dataclass
class Stop:
    """Where a loop stands after a step: ``done`` ends it; ``stopped`` is why (``paused``,
    ``cancelled``, ``lost``), None for a run that ran to its end."""

    step: int
    metrics: dict[str, Any]
    done: bool = False
    stopped: str | None = None
    checkpoint: Path | None = None


def base_metrics(run: Run, step: int, *, started: float, tokens: int, **values: Any) -> dict[str, Any]:
    """A step's metrics as every method names them: ``step``, ``total_steps``, the method's
    ``values``, ``time_step`` (since ``started``, a ``perf_counter``) and ``trained_tokens`` (which
    ``tokens`` more advance)."""
    run.counters.trained_tokens += tokens
    return {
        "step": step,
        "total_steps": run.total_steps,
        **values,
        "time_step": time.perf_counter() - started,
        "trained_tokens": run.counters.trained_tokens,
    }


def is_eval_step(run: Run, step: int) -> bool:
    """Validation passes: every ``eval_every`` steps and at the last step, when there is a validation file."""
    every = run.hp.eval_every(run.total_steps, has_validation=bool(run.valid_items))
    return bool(every) and (step % every == 0 or step == run.total_steps)


def end_of_step(run: Run, step: int, metrics: dict[str, Any], recorder: Recorder, *, headline: str) -> Stop:
    """Record the step, then checkpoint where the run stops (pause, cancel) or at the interval."""
    if run.counters.first is None:
        run.counters.first = metrics.get(headline)
    metrics.update(scoring_tokens(run))
    stopped = run.ranks.agree(recorder.step(step, metrics))  # rank 0 records; every rank stops with it
    if stopped == "paused" and step == run.total_steps:
        stopped = None  # nothing is left to pause: finish
    if stopped in ("paused", "cancelled"):
        return Stop(step, metrics, True, stopped, save(run, step, metrics, recorder, final=False))
    if stopped is not None:  # "lost": the job is another worker's now; write nothing more
        return Stop(step, metrics, True, stopped)
    interval = run.hp.checkpoint_interval
    if interval and step % interval == 0 and step < run.total_steps:
        save(run, step, metrics, recorder, final=False)
    return Stop(step, metrics)


def scoring_tokens(run: Run) -> dict[str, int]:
    """The tokens the run's reward models, embedding models and judges read since the last step
    (its validation pass's too), every rank's: the step's ``reward_model_tokens`` and ``judge_tokens``,
    which the worker meters (``worker.jobs.database_recorder.Meter``); none for a run without them."""
    if run.reward_models is None:
        return {}
    counts = run.reward_models.tokens.take()
    if run.ranks.distributed:
        summed = run.ranks.sum(torch.tensor(list(counts.values()), dtype=torch.long, device=run.device))
        counts = dict(zip(counts, (int(n) for n in summed.tolist()), strict=True))
    return counts


def finish(run: Run, stop: Stop, recorder: Recorder, *, headline: str) -> TrainResult:
    """The final checkpoint of a run that reached its end, and what it did; its tool runner let go."""
    if run.agent is not None:
        run.agent.runner.close()
    checkpoint = stop.checkpoint
    if stop.stopped is None:
        if stop.step > run.start:
            checkpoint = save(run, stop.step, stop.metrics, recorder, final=True)
        else:
            checkpoint = record_final(run, recorder)
    last = stop.metrics.get(headline) if stop.step > run.start else None
    return TrainResult(
        steps=stop.step,
        stopped=stop.stopped,
        final_checkpoint=checkpoint,
        first=run.counters.first,
        last=last,
        trained_tokens=run.counters.trained_tokens,
        resumed_from=run.start or None,
        headline=headline,
    )

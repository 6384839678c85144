"""What a run reports, and the failures it can end with. Torch-free: the Celery parent imports it.

``train`` reports to a ``Recorder``: the Celery task's writes the job's rows, ``rloo train``'s
prints JSON lines.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Protocol


class Recorder(Protocol):
    """Where a run's progress goes. ``step`` returns a reason to stop (e.g. ``"cancelled"``) or None."""

    def event(self, message: str, level: str = "info") -> None: ...

    def step(self, step: int, metrics: dict[str, Any]) -> str | None: ...

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool, written: bool = True) -> None:
        """The checkpoint of ``step`` at ``path`` (``final``: the run's last); ``written`` False: one saved
        before, which a run resumed at its last step names its final one."""

    def checkpoint_removed(self, step: int) -> None:
        """``keep_checkpoints`` deleted the checkpoint of ``step`` from disk."""

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        """A few of the step's prompts with their completions, rewards and advantages
        (``worker.engine.samples``)."""


class QuietRecorder:
    """A recorder that keeps nothing: a base for one that wants only some of a run's reports."""

    def event(self, message: str, level: str = "info") -> None:
        pass

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        return None

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool, written: bool = True) -> None:
        pass

    def checkpoint_removed(self, step: int) -> None:
        pass

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        pass


def json_safe(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf are not JSON; they become null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def step_message(step: int, metrics: dict[str, Any]) -> str:
    """A step's line in the job's events: its reward (RLOO) or its loss (supervised, DPO)."""
    name, key = ("reward", "train_reward_mean") if "train_reward_mean" in metrics else ("loss", "train_loss")
    value = metrics.get(key)
    shown = f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else "n/a"
    return f"Step {step}/{metrics['total_steps']}: {name} {shown}"


class StdoutRecorder:
    """``rloo train``'s recorder: one JSON object a line per step on stdout; events on stderr."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.checkpoints: list[dict[str, Any]] = []

    def event(self, message: str, level: str = "info") -> None:
        print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        print(json.dumps(json_safe(metrics)), file=self.stream, flush=True)
        return None

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool, written: bool = True) -> None:
        self.checkpoints.append({"step": step, "path": str(path), "final": final})
        self.event(f"checkpoint at step {step}: {path}" + ("" if written else " (saved before)"))

    def checkpoint_removed(self, step: int) -> None:
        self.checkpoints = [c for c in self.checkpoints if c["step"] != step]
        self.event(f"checkpoint at step {step} removed (keep_checkpoints)")

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        from worker.engine.samples import best_and_worst

        for label, completion in best_and_worst(groups):
            self.event(f"step {step} {label} completion (reward {completion['reward']}): {completion['text']!r}")

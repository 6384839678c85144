"""Where a multi-turn step's time goes (docs/tools.md): generation, tools, scoring, update, on the
*tiny* and *small* configs (``benchmarks.common``), with ``examples/tools``'s data and job.

Each config is taught the call format first (a short supervised run on the example's worked
dialogues: its rollouts then call the calculator, two turns each, as the example's do), then runs
RLOO with the built-in calculator, 16 problems x 8 rollouts a step, the example's settings; the
first step is left out (warm-up). Prints one JSON object: per config, the mean seconds of each
phase a step, tool calls and turns per rollout, tokens per trajectory.

    python -m benchmarks.tools            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.common import CONFIGS, ROOT
from worker.engine.recorders import QuietRecorder

TOOLS = ROOT / "examples" / "tools"
SFT_STEPS = {"tiny": 300, "small": 150}
RL_STEPS = 6
PHASES = ("time_generate", "time_tools", "time_score", "time_reference", "time_update", "time_step")


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tools_build", TOOLS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Steps(QuietRecorder):
    """A recorder that keeps each step's metrics (``run_spec``'s ``recorder``)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.steps.append(metrics)


def _spec(scratch: Path, name: str, body: dict[str, Any]) -> Path:
    path = scratch / f"{name}.json"
    path.write_text(json.dumps(body))
    return path


def case(config: str, scratch: Path, models: Path) -> dict[str, Any]:
    """Teach ``config`` the call format, then time RLOO steps with the calculator."""
    from worker.engine.standalone import run_spec
    from worker.tiny.models import build_tiny_causal_lm

    example = _example()
    dims = {**example.MODEL, **CONFIGS[config]}
    build_tiny_causal_lm(models / f"{config}-base", corpus=example.scaffold_corpus(), vocab_size=320, seed=0, **dims)
    sft = json.loads((TOOLS / "sft.json").read_text())
    sft.update(model=f"{config}-base", training_file=str(TOOLS / "sft.jsonl"))
    sft["method"]["supervised"]["hyperparameters"]["max_steps"] = SFT_STEPS[config]
    taught = run_spec(
        _spec(scratch, f"{config}-sft", sft), overrides={}, output_dir=scratch / f"{config}-sft", recorder=Steps()
    )
    shutil.copytree(
        taught["final_checkpoint"], models / f"{config}-sft", ignore=shutil.ignore_patterns("training_state*")
    )
    job = json.loads((TOOLS / "job.json").read_text())
    job.update(model=f"{config}-sft", training_file=str(TOOLS / "train.jsonl"))
    del job["validation_file"]
    job["method"]["reinforcement"]["hyperparameters"].update(
        max_steps=RL_STEPS, eval_interval="auto", sample_interval=0
    )
    recorder = Steps()
    run_spec(_spec(scratch, f"{config}-rl", job), overrides={}, output_dir=scratch / f"{config}-rl", recorder=recorder)
    steps = recorder.steps[1:]  # the first is warm-up
    out: dict[str, Any] = {p: round(statistics.mean(m[p] for m in steps), 4) for p in PHASES}
    for key in ("tool_calls_mean", "tool_turns_mean", "trajectory_length_mean", "tool_well_formed_frac"):
        out[key] = round(statistics.mean(m[key] for m in steps), 3)
    out["steps_timed"] = len(steps)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        os.environ["RLOO_HOME"] = home
        os.environ["RLOO_MODELS_DIR"] = str(Path(home) / "models")
        (Path(home) / "models").mkdir()
        _example().write_data()
        result = {
            "settings": f"examples/tools/job.json (16 problems x 8 rollouts, up to 3 turns, built-in calculator), "
            f"{RL_STEPS} steps, the first left out; supervised start {SFT_STEPS} steps",
            **{config: case(config, Path(home), Path(home) / "models") for config in CONFIGS},
        }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())

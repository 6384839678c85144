"""``rloo train`` against the engine benchmark's run, on the same model and settings
(``python -m benchmarks.run train_vs_engine``).

The engine's figures (``benchmarks.run engine``) come from ``worker.engine.methods.rloo.train`` called in-process
with the count reward patched in; a user's ``rloo train SPEC.json`` is a process of its own with a
grader. On the *small* policy, k = 4, 8 prompts, 32 new tokens, KL 0.05, ``STEPS`` steps each, the
split's medians over steps 3 on:

* ``engine``: the benchmark's run (plain ``Q: ... A:`` prompts, the count reward);
* ``train_rule``: ``rloo train`` on the same prompts with a rule grader (``string_check``);
* ``train_rule_chat``: the same on the demo's chat prompts, rendered with the chat template;
* ``train_reward_model``: ``rloo train`` with a reward model of the policy's shape (the issue's run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import DEMO_DATA, PLACEHOLDER_GRADER, ROOT, ours, plain_prompts, spec_hyperparameters

STEPS = 12
PHASES = ("time_generate", "time_score", "time_reference", "time_update", "time_step")


def _split(steps: list[dict[str, Any]]) -> dict[str, float]:
    timed = steps[2:]  # the first steps include warm-up
    return {p.removeprefix("time_"): round(1000 * statistics.median(m[p] for m in timed), 1) for p in PHASES}


def _train(models: Path, data: Path, grader: dict[str, Any], out: Path) -> dict[str, float]:
    spec = out.with_suffix(".json")
    spec.write_text(
        json.dumps(
            {
                "model": "small",
                "training_file": str(data),
                "seed": 0,
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": grader,
                        "hyperparameters": spec_hyperparameters(STEPS),
                    },
                },
            }
        )
    )
    env = {**os.environ, "RLOO_MODELS_DIR": str(models), "RLOO_HOME": str(out.parent / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", str(spec), "--device", "cpu", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
    return _split(steps)


def main() -> int:
    from worker.tiny.models import build_tiny_causal_lm, build_tiny_reward_model

    small = {"hidden_size": 256, "num_layers": 4}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        models = tmp / "models"
        build_tiny_causal_lm(models / "small", seed=0, **small)
        build_tiny_reward_model(models / "small-reward", tokenizer_from=models / "small", seed=1, **small)
        plain = plain_prompts(tmp)
        rule = PLACEHOLDER_GRADER
        reward_model = {"type": "reward_model", "name": "rm", "model": "small-reward"}
        out = {
            "steps": STEPS,
            "engine": _split(ours(models, "small", plain, tmp / "engine", steps=STEPS)["steps"]),
            "train_rule": _train(models, plain, rule, tmp / "rule"),
            "train_rule_chat": _train(models, DEMO_DATA, rule, tmp / "rule-chat"),
            "train_reward_model": _train(models, DEMO_DATA, reward_model, tmp / "rm"),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

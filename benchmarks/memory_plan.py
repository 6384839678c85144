"""How good the memory plan is (``python -m benchmarks.memory_plan``; ``make bench``'s
``memory_plan``): each case trains 2 RLOO steps on the CPU in a process of its own, and its peak
resident memory above what the process held before the model loaded is set beside
``service.registry.memory_plan``'s estimate for the same job (fp32, one device).

Prompts are longer than ``max_prompt_length`` (they keep their last tokens), so every sequence is
as long as the plan assumes; completions that end early use less than the plan's worst case.
Prints one JSON object.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny (2 layers, hidden 64)": {"hidden_size": 64, "num_layers": 2},
    "small (4 layers, hidden 256)": {"hidden_size": 256, "num_layers": 4},
    "8 layers, hidden 512": {"hidden_size": 512, "num_layers": 8},
}
CASES: dict[str, dict[str, Any]] = {
    "full, kl 0.05": {"kl_coef": 0.05},
    "full, kl 0": {"kl_coef": 0.0},
    "full, gradient checkpointing": {"kl_coef": 0.05, "gradient_checkpointing": True},
    "lora r=16 all-linear": {"kl_coef": 0.05, "lora": {"r": 16}},
}
SETTINGS = {"rloo_k": 4, "batch_size": 8, "max_new_tokens": 32, "max_prompt_length": 64, "learning_rate": 1e-4}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _case(models: str, model: str, case: str) -> None:
    """One run in this process: its estimate, and its measured peak above the pre-load baseline."""
    import torch  # noqa: F401 - imported before the baseline, as the worker has it
    import transformers  # noqa: F401

    from benchmarks.common import PLACEHOLDER_GRADER
    from service.graders import parse_grader
    from service.jobs.hyperparameters import ReinforcementHyperparameters
    from service.registry import memory_plan
    from worker.engine.config import TrainConfig
    from worker.engine.methods.rloo import train
    from worker.engine.recorders import QuietRecorder

    hp = ReinforcementHyperparameters(**SETTINGS, max_steps=2, **CASES[case]).resolved()
    estimate = memory_plan.plan(memory_plan.model_shape(Path(models) / model), hp, method="reinforcement", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "long.jsonl"
        prompts.write_text(
            "".join(json.dumps({"prompt": "the cat and the dog sat on the red mat " * 40}) + "\n" for _ in range(16))
        )
        cfg = TrainConfig(
            model=model,
            training_file=prompts,
            grader=parse_grader(PLACEHOLDER_GRADER),
            hyperparameters=hp,
            output_dir=Path(tmp) / "out",
            models_dir=Path(models),
            seed=0,
            device="cpu",
        )
        baseline = _rss_mib()
        train(cfg, QuietRecorder())  # type: ignore[arg-type]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    measured = peak - baseline
    planned = estimate["bytes_per_device"] / 2**20
    print(
        json.dumps(
            {
                "estimate_mib": round(planned, 1),
                "measured_mib": round(measured, 1),
                "error": f"{(planned - measured) / measured:+.0%}",
                "parts_mib": {k: round(v / 2**20, 1) for k, v in estimate["bytes"].items()},
            }
        )
    )


def main() -> dict[str, Any]:
    from worker.tiny.models import build_tiny_causal_lm

    out: dict[str, Any] = {
        "settings": f"{SETTINGS}, 2 steps, fp32 CPU; measured = peak RSS above the RSS before the model loaded"
    }
    with tempfile.TemporaryDirectory() as models:
        for name, shape in MODELS.items():
            slug = f"m{shape['num_layers']}x{shape['hidden_size']}"
            build_tiny_causal_lm(Path(models) / slug, seed=0, **shape)
            out[name] = {}
            for case in CASES:
                print(f"memory_plan: {name}, {case}", file=sys.stderr, flush=True)
                proc = subprocess.run(
                    [sys.executable, "-m", "benchmarks.memory_plan", "--case", models, slug, case],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    check=True,
                )
                out[name][case] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        _case(*sys.argv[2:5])
    else:
        print(json.dumps(main(), indent=2))

"""``make bench``: the engine on the tiny model, through the same ``train`` as a job, in JSON figures.

Prints one JSON object: completions/s, generated tokens/s, the split of a step, peak RSS and the
reward's first-5 and last-5 step means, and what the KL reference costs in memory. The comparison
with TRL is ``benchmarks/anchor.py``; the service-overhead and API-load benchmarks are still to come.
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from service.schemas import Hyperparameters
from worker.config import TrainConfig
from worker.tinymodels import build_tiny_causal_lm
from worker.train import train

ROOT = Path(__file__).resolve().parent.parent


class Collect:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def event(self, message: str, level: str = "info") -> None:
        pass

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.steps.append(metrics)
        print(f"step {step}: reward {metrics['train_reward_mean']:.3f}", file=sys.stderr, flush=True)

    def checkpoint(self, *args: Any) -> None:
        pass

    def checkpoint_removed(self, step: int) -> None:
        pass


def engine(steps: int = 40) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        build_tiny_causal_lm(models / "tiny", seed=0)
        hp = Hyperparameters(rloo_k=4, batch_size=8, max_new_tokens=32, learning_rate=1e-3, kl_coef=0.05,
                             max_steps=steps, n_epochs=100).resolved()
        grader = {"type": "text_similarity", "name": "answer", "input": "{{ sample.output_text }}",
                  "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}
        cfg = TrainConfig(model="tiny", training_file=ROOT / "examples" / "demo" / "train.jsonl", grader=grader,
                          hyperparameters=hp, output_dir=Path(tmp) / "out", models_dir=models, seed=0, device="cpu")
        rec = Collect()
        t0 = time.perf_counter()
        train(cfg, rec)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
    s = rec.steps[2:]  # the first steps include warm-up (allocator, kernels)
    step_time = sum(m["time_step"] for m in s)
    rewards = [m["train_reward_mean"] for m in rec.steps]
    return {
        "config": "tiny (Llama-style, 2 layers, hidden 64, vocab 512), k=4, 8 prompts, 32 new tokens, fp32 CPU",
        "steps": len(rec.steps),
        "wall_s": round(wall, 2),
        "completions_per_s": round(sum(32 for _ in s) / step_time, 1),
        "generated_tokens_per_s": round(sum(m["tokens_per_s"] * m["time_step"] for m in s) / step_time, 1),
        "step_split_s_median": {k: round(statistics.median(m[k] for m in s), 4)
                                for k in ("time_generate", "time_score", "time_update", "time_step")},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "reward_first5": round(sum(rewards[:5]) / 5, 4),
        "reward_last5": round(sum(rewards[-5:]) / 5, 4),
    }


# What the KL reference costs: a frozen copy (full fine-tuning), nothing extra (LoRA: the adapter is
# switched off), or no reference at all (kl_coef 0). Each case runs in its own process, so its peak
# resident memory is its own.
MEMORY_CASES: dict[str, dict[str, Any]] = {
    "full, kl_coef 0.05 (reference = frozen copy)": {"kl_coef": 0.05},
    "full, kl_coef 0 (no reference)": {"kl_coef": 0.0},
    "full, kl_coef 0.05, gradient_checkpointing": {"kl_coef": 0.05, "gradient_checkpointing": True},
    "lora r=16 all-linear, kl_coef 0.05 (reference = adapter disabled)": {"kl_coef": 0.05, "lora": {"r": 16}},
    "lora r=16 all-linear, kl_coef 0 (no reference)": {"kl_coef": 0.0, "lora": {"r": 16}},
}


def _memory_case(models: str, case: str) -> None:
    hp = Hyperparameters(rloo_k=4, batch_size=8, max_new_tokens=32, learning_rate=1e-4, max_steps=2,
                         **MEMORY_CASES[case]).resolved()
    grader = {"type": "string_check", "name": "a", "input": "{{ sample.output_text }}", "reference": "a",
              "operation": "like"}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(model="small", training_file=ROOT / "examples" / "demo" / "train.jsonl", grader=grader,
                          hyperparameters=hp, output_dir=Path(tmp), models_dir=Path(models), seed=0, device="cpu")
        train(cfg, Collect())  # type: ignore[arg-type]
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    # The tensors each case holds for the whole run, counted on the same model: the reference's weights
    # and AdamW's two moments per trainable parameter.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(models) / "small")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if hp["lora"]:
        from worker.train import add_lora

        model = add_lora(model, hp["lora"], resume_from=None)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    reference = weights if hp["kl_coef"] > 0 and not hp["lora"] else 0
    print(json.dumps({
        "peak_rss_mib": peak,
        "reference_weights_mib": round(reference / 2**20, 1),
        "optimizer_state_mib": round(2 * trainable / 2**20, 1),
    }))


def reference_memory() -> dict[str, Any]:
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_causal_lm(Path(tmp) / "small", seed=0, hidden_size=512, num_layers=8)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "small")
        param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        out: dict[str, Any] = {
            "config": "Llama-style, 8 layers, hidden 512, vocab 512, fp32 CPU, k=4, 8 prompts, 32 new tokens, 2 steps",
            "model_parameters_mib": round(param_mib, 1),
        }
        for case in MEMORY_CASES:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--memory-case", tmp, case],
                                  capture_output=True, text=True, cwd=ROOT, check=True)
            out[case] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    if sys.argv[1:2] == ["--memory-case"]:
        _memory_case(sys.argv[2], sys.argv[3])
        return
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, python {platform.python_version()}",
        "torch": torch.__version__,
        "engine_tiny": engine(),
        "reference_memory": reference_memory(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

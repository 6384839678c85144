"""``make bench``: the speed, memory and isolation figures, as one JSON object (kept in RESULTS.md).

1. ``engine``: our engine alone on the *tiny* and *small* configs (``benchmarks.common``): completions/s,
   generated tokens/s, the split of a step, peak RSS, and the reward's first-5 and last-5 step means;
   each config in its own process, so its peak memory is its own.
2. ``reference_memory``: what the KL reference costs (a frozen copy, an adapter switched off, none).
3. ``service``: the tiny job through HTTP + Redis + Celery + the database vs ``rloo train``
   (``benchmarks.service``).
4. ``api``: the API under load against a bare endpoint (``benchmarks.api_load``).
5. ``isolation``: what keeping tenants apart costs: python graders' sandboxes, a dry run through the
   graders worker, the JSON door, streamed checkpoint downloads (``benchmarks.isolation``).
6. ``streams``: what watching costs: 500 event streams on one API process, queries per watcher idle
   and per event, delivery latency, memory per stream (``benchmarks.streams``).
7. ``serving``: chat completions streamed through the service, one and 8 at once, against
   ``generate`` called directly (``benchmarks.serving``).
8. ``memory_plan``: a job's memory plan against its measured peak (``benchmarks.memory_plan``).
9. ``score_profile``: where a reward-model job's score phase goes, stage by stage, against one
   batched forward of the reward model (``benchmarks.score_profile``).
10. ``train_vs_engine``: ``rloo train`` against the engine's run on the same settings, with a rule
   grader and a reward model (``benchmarks.train_vs_engine``).
11. ``score_beside``: a grader that waits on another process (an endpoint, a remote reward model)
   scored beside the reference forward or before it (``benchmarks.score_beside``).
12. ``availability``: another project's latency (a list, a 4-token chat, a dry run) while a hostile
   project attacks each shared part, against idle (``benchmarks.availability``).
13. ``tinker``: a forward_backward + optim_step round trip through the tinker SDK against the same
   work in process, and samples/s through its SamplingClient against the worker's own batch
   (``benchmarks.tinker``).
14. ``tools``: where a multi-turn step's time goes (generation, tools, scoring, update) on the tiny and
   small configs, rollouts calling the built-in calculator (``benchmarks.tools``).

The comparison with TRL is ``benchmarks.anchor`` (``make bench`` runs it after this).
``python -m benchmarks.run engine service`` runs a subset.
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    CONFIGS,
    PROMPTS,
    SETTINGS,
    STEPS,
    Collect,
    K,
    build,
    first_last,
    ours,
    plain_prompts,
)
from service.graders import parse_grader
from service.jobs.hyperparameters import ReinforcementHyperparameters
from worker.engine.config import TrainConfig
from worker.engine.methods.rloo import train

ROOT = Path(__file__).resolve().parent.parent


SUBPROCESS_SECTIONS = {
    "api": "benchmarks.api_load",
    "isolation": "benchmarks.isolation",
    "streams": "benchmarks.streams",
    "serving": "benchmarks.serving",
    "memory_plan": "benchmarks.memory_plan",
    "score_profile": "benchmarks.score_profile",
    "train_vs_engine": "benchmarks.train_vs_engine",
    "score_beside": "benchmarks.score_beside",
    "availability": "benchmarks.availability",
    "tinker": "benchmarks.tinker",
    "tools": "benchmarks.tools",
}
"""Sections that run as a module of their own, printing one JSON object."""


def _engine_case(config: str) -> None:
    """One config in this process: prints its figures as one JSON line."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        build(tmp / "models", config)
        run = ours(tmp / "models", config, plain_prompts(tmp), tmp / "out")
    steps = run["steps"]
    timed = steps[2:]  # the first steps include warm-up (allocator, kernels)
    step_time = sum(m["time_step"] for m in timed)
    # Outside the timed step: metrics assembly, the recorder, the loop (handover to handover).
    handed = run["handed_at"]
    outside = [b - a - m["time_step"] for a, b, m in zip(handed[2:-1], handed[3:], timed[1:], strict=True)]
    first, last = first_last(run["rewards"])
    print(
        json.dumps(
            {
                "config": f"{config}: {CONFIGS[config]}, vocab 512",
                "steps": len(steps),
                "wall_s": round(run["wall_s"], 2),
                "completions_per_s": round(len(timed) * K * PROMPTS / step_time, 1),
                "completions_per_s_wall": round(len(steps) * K * PROMPTS / run["wall_s"], 1),
                "generated_tokens_per_s": round(sum(m["tokens_per_s"] * m["time_step"] for m in timed) / step_time, 1),
                "step_split_s_median": {
                    **{
                        k.removeprefix("time_"): round(statistics.median(m[k] for m in timed), 4)
                        for k in ("time_generate", "time_score", "time_reference", "time_update")
                    },
                    "record": round(statistics.median(outside), 5),
                    "step": round(statistics.median(m["time_step"] for m in timed), 4),
                },
                "completion_length_mean": round(statistics.mean(m["completion_length_mean"] for m in steps), 1),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "reward_first5": first,
                "reward_last5": last,
            }
        )
    )


def engine() -> dict[str, Any]:
    out: dict[str, Any] = {"settings": f"{SETTINGS}, {STEPS} steps, seed 0"}
    for config in CONFIGS:
        print(f"engine: {config}", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.run", "--engine-case", config],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        out[config] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


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
    hp = ReinforcementHyperparameters(
        rloo_k=4, batch_size=8, max_new_tokens=32, learning_rate=1e-4, max_steps=2, **MEMORY_CASES[case]
    ).resolved()
    grader = {
        "type": "string_check",
        "name": "a",
        "input": "{{ sample.output_text }}",
        "reference": "a",
        "operation": "like",
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            model="small",
            training_file=ROOT / "examples" / "demo" / "train.jsonl",
            grader=parse_grader(grader),
            hyperparameters=hp,
            output_dir=Path(tmp),
            models_dir=Path(models),
            seed=0,
            device="cpu",
        )
        train(cfg, Collect())  # type: ignore[arg-type]
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    # The tensors each case holds for the whole run, counted on the same model: the reference's weights
    # and AdamW's two moments per trainable parameter.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(models) / "small")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if hp.lora:
        from worker.engine.modeling import add_lora

        model = add_lora(model, hp.lora, resume_from=None)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    reference = weights if hp.kl_coef > 0 and not hp.lora else 0
    print(
        json.dumps(
            {
                "peak_rss_mib": peak,
                "reference_weights_mib": round(reference / 2**20, 1),
                "optimizer_state_mib": round(2 * trainable / 2**20, 1),
            }
        )
    )


def reference_memory() -> dict[str, Any]:
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        from worker.tiny.models import build_tiny_causal_lm

        build_tiny_causal_lm(Path(tmp) / "small", seed=0, hidden_size=512, num_layers=8)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "small")
        param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        out: dict[str, Any] = {
            "config": "Llama-style, 8 layers, hidden 512, vocab 512, fp32 CPU, k=4, 8 prompts, 32 new tokens, 2 steps",
            "model_parameters_mib": round(param_mib, 1),
        }
        for case in MEMORY_CASES:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.run", "--memory-case", tmp, case],
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=True,
            )
            out[case] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    if sys.argv[1:2] == ["--memory-case"]:
        _memory_case(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1:2] == ["--engine-case"]:
        _engine_case(sys.argv[2])
        return
    sections = sys.argv[1:] or [
        "engine",
        "reference_memory",
        "service",
        "api",
        "isolation",
        "streams",
        "serving",
        "memory_plan",
        "score_profile",
        "train_vs_engine",
        "score_beside",
        "availability",
        "tinker",
        "tools",
    ]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, python {platform.python_version()}",
        "torch": torch.__version__,
    }
    for section in sections:
        print(f"== {section}", file=sys.stderr, flush=True)
        if section == "engine":
            result["engine"] = engine()
        elif section == "reference_memory":
            result["reference_memory"] = reference_memory()
        elif section == "service":
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.service"], capture_output=True, text=True, cwd=ROOT, check=True
            )
            result["service"] = json.loads(proc.stdout)
        elif section in SUBPROCESS_SECTIONS:
            module = SUBPROCESS_SECTIONS[section]
            proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, cwd=ROOT, check=True)
            result[section] = json.loads(proc.stdout)
        else:
            raise SystemExit(
                f"unknown section '{section}': engine, reference_memory, service, {', '.join(SUBPROCESS_SECTIONS)}"
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

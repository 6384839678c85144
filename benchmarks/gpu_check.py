"""``make gpu-check`` (``python -m benchmarks.gpu_check``): what the engine does on a GPU host.

A seeded random-weight model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
MLP 4864, vocabulary 151,936, tied embeddings, RoPE theta 1e6, context 32,768), built offline from a
config (no hub) and saved in bf16 under a models root, trains RLOO for a few steps through
``rloo train SPEC.json``, the foreground run of a job, in a process of its own for each run:

1. one GPU, completions sampled by the policy itself (``RLOO_ROLLOUT_BACKEND=transformers``);
2. one GPU, sampled by vLLM, where ``vllm`` is installed (``RLOO_ROLLOUT_BACKEND=vllm``);
3. every GPU of the host, where there are several: the same job spread over them
   (``resources: {"gpus": N}`` in the spec; ``batch_size`` rounded up to a multiple of N x
   ``gradient_accumulation_steps``); reported as skipped when ``rloo train`` fails on it or runs
   it on one device (multi-rank runs are not there yet).

Each run reports, from its recorded step metrics (medians over the steps after the first, which
warms up): generated tokens/s (completion tokens / generate time), the split of a step (generate,
score, reference, update, step), model FLOPs utilisation (the step's FLOPs as
``service.registry.memory_plan.plan`` counts them, over the step's time and the devices' bf16 dense peak:
``PEAK_TFLOPS``), the peak of ``torch.cuda.max_memory_allocated`` (read in each training process
as it exits: ``benchmarks/gpu_check_hook``), and the memory plan's estimate for the same job against
it. A markdown table on stdout; it and the JSON into ``--out`` (a ``.json`` path, the ``.md``
beside it, or a directory for both).

Settings (``GPU_SETTINGS``): 32 prompts x k = 4, 128 new tokens after prompts of 128 tokens (every
prompt is longer, so every sequence is as long as the plan assumes), bf16 autocast, KL 0.05 (a
frozen reference), a ``string_check`` grader, 8 steps. ``gradient_accumulation_steps`` is the
fewest micro-batches whose plan, half again (the plan's GPU error is what this measures), fits
90% of a device beside vLLM's share: on an H200, 1 (a 64 GiB plan) or, with vLLM installed, 2.

The tokenizer is trained on the spot on the demo corpus and filled to the model's 151,936 ids with
byte-pair tokens (``worker.tiny.models.build_tokenizer(fill_to=...)``): random weights sample any id
almost uniformly, so ids past a smaller tokenizer would be most of every completion, which
transformers' decode drops silently but vLLM's detokenizer may reject or log a traceback for each.
Filled, every sampled id decodes (to bytes, often not UTF-8: replacement characters), as a real
model's sampled ids do. EOS is one id in 151,936: completions run to ``max_new_tokens``, which the
plan's FLOPs assume.

The whole check stops itself after ``--budget-s`` (540 s): a run still going is stopped (SIGTERM),
what it recorded is kept, later runs are skipped, and the file is written after every run. It exits
1 when a run failed or was stopped, else 0 (skipped runs included). Without a GPU it says so and
exits 0, unless ``--cpu-smoke``: the same runs' code path on the CPU with a
tiny model of the same family, 2 steps, the measured peak then the training process's peak RSS
(``tests/unit/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import PLACEHOLDER_GRADER

ROOT = Path(__file__).resolve().parent.parent
HOOK = Path(__file__).resolve().parent / "gpu_check_hook"
DEFAULT_OUT = ROOT / "benchmarks" / "gpu_check.json"
MIB = 2**20


@dataclass(frozen=True)
class Architecture:
    """A Qwen2 model's shape."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    rope_theta: float = 1e6


QWEN25_05B = Architecture("qwen2.5-0.5b-shape", 896, 24, 14, 2, 4864, 151_936, 32_768)
TINY = Architecture("tiny-qwen2-shape", 64, 2, 4, 2, 128, 1024, 512)

GPU_SETTINGS: dict[str, Any] = {
    "batch_size": 32,
    "rloo_k": 4,
    "max_new_tokens": 128,
    "max_prompt_length": 128,
    "learning_rate": 1e-6,
    "kl_coef": 0.05,
    "precision": "bf16",
    "n_epochs": 1000,
    "sample_interval": 0,
}
SMOKE_SETTINGS: dict[str, Any] = {
    **GPU_SETTINGS,
    "batch_size": 2,
    "rloo_k": 2,
    "max_new_tokens": 8,
    "max_prompt_length": 16,
    "precision": "auto",
}
PLAN_MARGIN = 1.5
"""The plan is taken half again when choosing ``gradient_accumulation_steps``: on a GPU its error
is what this check measures."""
VLLM_MEMORY = 0.3
"""``RLOO_VLLM_GPU_MEMORY_UTILIZATION`` of the vLLM run (the service's default)."""

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H200.*NVL", 836.0),
    (r"H100", 989.0),  # SXM
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"\bL4\b", 121.0),
)
"""bf16 dense tensor-core peaks (NVIDIA's datasheets, without sparsity), by device name; the first
that matches counts."""


def peak_tflops(device_name: str) -> float | None:
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


@dataclass(frozen=True)
class Case:
    name: str
    backend: str
    gpus: int
    skip: str | None = None


# The model and the prompts -------------------------------------------------------------------------


def build_model(models: Path, arch: Architecture, *, seed: int = 0) -> Path:
    """``arch`` with seeded random weights, saved in bf16 with a tokenizer made on the spot, as a
    directory under the models root (loaded as any model is: ``worker.engine.modeling``)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from worker.tiny.models import DEMO_CORPUS, build_tokenizer

    tokenizer = build_tokenizer(DEMO_CORPUS, vocab_size=4096, model_max_length=arch.context, fill_to=arch.vocab)
    config = Qwen2Config(
        vocab_size=arch.vocab,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        max_position_embeddings=arch.context,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).bfloat16()
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    path = models / arch.name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_prompts(path: Path, n: int) -> None:
    """``n`` different prompts of 30 demo sentences each (300+ tokens): longer than
    ``max_prompt_length``, and no two alike at their end (what a prompt keeps), so vLLM's prefix
    cache shares nothing between prompts."""
    from worker.tiny.models import DEMO_CORPUS

    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": " ".join(random.Random(i).sample(DEMO_CORPUS, 30))}) + "\n")


# Sizes ---------------------------------------------------------------------------------------------


def fit_accumulation(model: Path, settings: dict[str, Any], device_bytes: int, reserved: int) -> int:
    """The fewest micro-batches (a power of two dividing ``batch_size``) whose one-device plan, half
    again, fits 90% of a device of ``device_bytes`` beside ``reserved`` bytes; the most there are
    when none fits."""
    from service.jobs.hyperparameters import ReinforcementHyperparameters
    from service.registry import memory_plan

    shape = memory_plan.model_shape(model)
    accumulation = 1
    while True:
        hp = ReinforcementHyperparameters(**settings, gradient_accumulation_steps=accumulation).resolved()
        need = PLAN_MARGIN * memory_plan.plan(shape, hp, method="reinforcement")["bytes_per_device"] + reserved
        if need <= memory_plan.HEADROOM * device_bytes or settings["batch_size"] % (2 * accumulation):
            return accumulation
        accumulation *= 2


# One run -------------------------------------------------------------------------------------------


def batch_for(settings: dict[str, Any], gpus: int) -> int:
    """``batch_size`` rounded up so that each of ``gpus`` ranks takes whole prompts in each micro-batch."""
    share = gpus * settings.get("gradient_accumulation_steps", 1)
    return -(-settings["batch_size"] // share) * share


def job_spec(model: str, settings: dict[str, Any], *, steps: int, gpus: int) -> dict[str, Any]:
    """The job-creation body ``rloo train`` runs (``training_file`` beside the spec)."""
    return {
        "model": model,
        "training_file": "prompts.jsonl",
        "seed": 0,
        "method": {
            "type": "reinforcement",
            "reinforcement": {"grader": PLACEHOLDER_GRADER, "hyperparameters": {**settings, "max_steps": steps}},
        },
        "resources": {"gpus": gpus},
    }


def run_case(
    case: Case, *, work: Path, models: Path, spec: dict[str, Any], device: str, timeout: float
) -> dict[str, Any]:
    """``rloo train`` on ``spec`` in a process group of its own, stopped after ``timeout`` seconds;
    returns its step metrics, summary, memory records and how it ended."""
    run_dir = work / re.sub(r"\W+", "-", case.name).strip("-")
    memory_dir = run_dir / "memory"
    memory_dir.mkdir(parents=True)
    shutil.copy(work / "prompts.jsonl", run_dir / "prompts.jsonl")
    (run_dir / "job.json").write_text(json.dumps(spec, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLOO_")}  # the check's settings only
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(HOOK), str(ROOT), os.environ.get("PYTHONPATH")) if p),
        GPU_CHECK_MEMORY_DIR=str(memory_dir),
        RLOO_HOME=str(run_dir / "home"),
        RLOO_MODELS_DIR=str(models),
        RLOO_ROLLOUT_BACKEND=case.backend,
        RLOO_VLLM_GPU_MEMORY_UTILIZATION=str(VLLM_MEMORY),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    command = [sys.executable, "-m", "worker.cli", "train", str(run_dir / "job.json")]
    command += ["--output-dir", str(run_dir / "out")] + (["--device", "cpu"] if device == "cpu" else [])
    t0 = time.monotonic()
    with open(run_dir / "stdout", "w") as out, open(run_dir / "stderr", "w") as err:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
    steps, summary = [], None
    for line in (run_dir / "stdout").read_text(errors="replace").splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue  # a library's log line
        if isinstance(value, dict) and "time_step" in value:
            steps.append(value)
        elif isinstance(value, dict) and "status" in value:
            summary = value
    memory = [json.loads(p.read_text()) for p in sorted(memory_dir.glob("*.json"))]
    stderr_tail = (run_dir / "stderr").read_text(errors="replace").strip().splitlines()[-15:]
    shutil.rmtree(run_dir / "out", ignore_errors=True)  # the checkpoint: gigabytes, not needed
    return {
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "wall_s": time.monotonic() - t0,
        "steps": steps,
        "summary": summary,
        "memory": memory,
        "stderr_tail": stderr_tail,
    }


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the run's process group (the probe then reports its memory), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# Figures -------------------------------------------------------------------------------------------


def figures(
    raw: dict[str, Any], *, plan: dict[str, Any], rows: int, devices: int, peak: float | None, cpu: bool
) -> dict[str, Any]:
    """A run's figures from its step metrics and memory records; ``plan`` is the memory plan of the
    same job, ``rows`` its completions a step, ``peak`` a device's TFLOP/s (None: unknown)."""
    steps = raw["steps"]
    timed = steps[1:] if len(steps) > 1 else steps  # the first step warms up (allocator, kernels, graphs)
    out: dict[str, Any] = {"steps": len(steps), "timed_steps": len(timed)}
    if timed:
        generated = sum(m["completion_length_mean"] * rows for m in timed)
        split = {
            phase: statistics.median(m[f"time_{phase}"] for m in timed)
            for phase in ("generate", "score", "reference", "update", "step")
        }
        flops = plan["step_flops"]
        achieved = {
            "step": flops["total"] / split["step"],
            **{phase: flops[phase] / split[phase] for phase in ("generate", "reference", "update") if split[phase]},
        }
        out.update(
            completion_length_mean=round(statistics.mean(m["completion_length_mean"] for m in timed), 1),
            generated_tokens_per_s=round(generated / sum(m["time_generate"] for m in timed), 1),
            step_split_s_median={phase: round(s, 4) for phase, s in split.items()},
            step_flops=flops,
            achieved_tflops_per_s={phase: float(f"{v / 1e12:.4g}") for phase, v in achieved.items()},
            mfu=(
                {phase: round(v / (peak * 1e12 * devices), 4) for phase, v in achieved.items()}
                if peak is not None
                else None
            ),
        )
    out["memory"] = _memory(raw["memory"], plan, cpu=cpu)
    return out


def _memory(records: list[dict[str, Any]], plan: dict[str, Any], *, cpu: bool) -> dict[str, Any]:
    """The measured peak (the largest of any process's, on any device) against the plan's estimate a
    device."""
    estimate = plan["bytes_per_device"]
    out: dict[str, Any] = {
        "estimate_mib": round(estimate / MIB, 1),
        "estimate_parts_mib": {k: round(v / MIB, 1) for k, v in plan["bytes"].items()},
    }
    devices = [d for r in records for d in r["cuda"].values()]
    if cpu:
        measured = max((r["peak_rss_bytes"] for r in records), default=0)
        out["measured_by"] = "peak RSS of the training process (interpreter and libraries included)"
    else:
        measured = max((d["max_allocated_bytes"] for d in devices), default=0)
        out["measured_by"] = "torch.cuda.max_memory_allocated, the largest of the run's devices"
        out["measured_reserved_mib"] = round(max((d["max_reserved_bytes"] for d in devices), default=0) / MIB, 1)
    out["devices_used"] = len(devices)
    if measured:
        out["measured_peak_mib"] = round(measured / MIB, 1)
        out["error_pct"] = round(100 * (estimate - measured) / measured, 1)
    return out


# Output --------------------------------------------------------------------------------------------


def out_paths(out: Path) -> tuple[Path, Path]:
    if out.suffix == ".json":
        return out, out.with_suffix(".md")
    return out / "gpu_check.json", out / "gpu_check.md"


def markdown(result: dict[str, Any]) -> str:
    def gib(mib: float | None) -> str:
        return "" if mib is None else f"{mib / 1024:.2f}" if mib >= 1024 else f"{mib / 1024:.4f}"

    lines = [
        f"`make gpu-check`, {result['date']}: {result['device']} x {result['devices']}, torch {result['torch']}, "
        f"transformers {result['transformers']}, vLLM {result['vllm'] or 'not installed'}.",
        f"Model: {result['model']['description']}. Settings: {result['settings_note']}.",
        "",
        "| run | status | generated tokens/s | generate s | score s | reference s | update s | step s | MFU "
        "(step; generate, update) | peak GiB | plan GiB | plan error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for run in result["runs"]:
        split = run.get("step_split_s_median") or {}
        mfu = run.get("mfu")
        mem = run.get("memory") or {}
        mfu_text = (
            f"{mfu['step']:.1%}; {mfu.get('generate', 0):.1%}, {mfu.get('update', 0):.1%}"
            if mfu
            else ("peak unknown" if split else "")
        )
        error = mem.get("error_pct")
        lines.append(
            f"| {run['run']} | {run['status']} | {run.get('generated_tokens_per_s', '')} | "
            + " | ".join(str(split.get(p, "")) for p in ("generate", "score", "reference", "update", "step"))
            + f" | {mfu_text} | {gib(mem.get('measured_peak_mib'))} | {gib(mem.get('estimate_mib'))} | "
            + (f"{error:+.0f}%" if error is not None else "")
            + " |"
        )
        for key in ("reason", "memory_note"):
            if run.get(key):
                notes.append(f"- {run['run']}: {run[key]}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write(result: dict[str, Any], out: Path) -> None:
    json_path, md_path = out_paths(out)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown(result))


# The check -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="a .json path (the .md beside it) or a directory")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (8 on a GPU, 2 with --cpu-smoke)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop everything after this many seconds")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU, the same code path")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s

    import torch
    import transformers

    from service.jobs.hyperparameters import ReinforcementHyperparameters
    from service.registry import memory_plan
    from worker.engine.rollout.backends import vllm_installed

    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
            "nothing measured. On a GPU host with torch's CUDA build (`make gpu-check CONSTRAINTS=`) it trains; "
            "--cpu-smoke runs the same code path on the CPU.",
            file=sys.stderr,
        )
        return 0
    arch, settings = (TINY, SMOKE_SETTINGS) if cpu else (QWEN25_05B, GPU_SETTINGS)
    steps = args.steps or (2 if cpu else 8)
    gpus = 0 if cpu else torch.cuda.device_count()
    device_name = "cpu" if cpu else torch.cuda.get_device_name(0)
    peak = None if cpu else peak_tflops(device_name)
    vllm = not cpu and vllm_installed()
    cases = [Case("1 GPU, transformers" if not cpu else "CPU, transformers", "transformers", 1)]
    if not cpu:
        cases.append(Case("1 GPU, vLLM", "vllm", 1, None if vllm else "vllm is not installed (pip install vllm)"))
        cases.append(
            Case(
                f"{gpus} GPUs, transformers",
                "transformers",
                gpus,
                None if gpus > 1 else "one GPU on this host: nothing more to spread over",
            )
        )

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        models = work / "models"
        print(f"gpu-check: building {arch.name} under {models}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        model = build_model(models, arch)
        build_s = time.monotonic() - t0
        shape = memory_plan.model_shape(model)
        if not cpu:
            device_bytes = torch.cuda.get_device_properties(0).total_memory
            reserved = int(VLLM_MEMORY * device_bytes) if vllm else 0
            settings = {
                **settings,
                "gradient_accumulation_steps": fit_accumulation(model, settings, device_bytes, reserved),
            }
        write_prompts(work / "prompts.jsonl", 2 * batch_for(settings, max(gpus, 1)))
        result: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "device": device_name,
            "devices": max(gpus, 1),
            "peak_tflops_bf16_dense": peak,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": _version("vllm") if vllm else None,
            "model": {
                "name": arch.name,
                "description": f"Qwen2, hidden {arch.hidden}, {arch.layers} layers, {arch.heads} heads "
                f"({arch.kv_heads} KV), MLP {arch.intermediate}, vocabulary {arch.vocab}, tied embeddings, "
                f"{shape.parameters / 1e6:.1f}M parameters, seeded random weights (bf16 files)",
                "parameters": shape.parameters,
                "build_s": round(build_s, 1),
            },
            "settings": {**settings, "max_steps": steps},
            "settings_note": (
                f"{settings['batch_size']} prompts x k={settings['rloo_k']}, {settings['max_new_tokens']} new "
                f"tokens after {settings['max_prompt_length']} prompt tokens, precision {settings['precision']}, "
                f"KL {settings['kl_coef']}, gradient_accumulation_steps "
                f"{settings.get('gradient_accumulation_steps', 1)}, {steps} steps, medians of steps 2-{steps}"
            ),
            "budget_s": args.budget_s,
            "runs": [],
        }
        for case in cases:
            left = deadline - time.monotonic() - 15  # to write the file
            entry: dict[str, Any] = {"run": case.name, "backend": case.backend, "gpus": case.gpus}
            if case.skip or left < 30:
                entry.update(status="skipped", reason=case.skip or "the time budget (--budget-s) was spent")
            else:
                print(f"gpu-check: {case.name} ({steps} steps)", file=sys.stderr, flush=True)
                run_settings = {**settings, "batch_size": batch_for(settings, case.gpus)}
                spec = job_spec(arch.name, run_settings, steps=steps, gpus=case.gpus)
                hp = ReinforcementHyperparameters(**run_settings, max_steps=steps).resolved()
                plan = memory_plan.plan(
                    shape, hp, method="reinforcement", device="cpu" if cpu else "cuda", devices=case.gpus
                )
                raw = run_case(case, work=work, models=models, spec=spec, device="cpu" if cpu else "cuda", timeout=left)
                entry.update(_status(case, raw), batch_size=hp.batch_size, wall_s=round(raw["wall_s"], 1))
                if entry["status"] != "skipped":
                    rows = hp.batch_size * hp.rloo_k
                    entry.update(figures(raw, plan=plan, rows=rows, devices=case.gpus, peak=peak, cpu=cpu))
                if case.backend == "vllm":
                    entry["memory_note"] = (
                        f"the measured peak includes vLLM's engine ({VLLM_MEMORY:.0%} of the device for its "
                        "weights and KV cache), which the plan does not count"
                    )
                if entry["status"] != "ok":
                    entry["stderr_tail"] = raw["stderr_tail"]
            result["runs"].append(entry)
            result["wall_s"] = round(time.monotonic() - started, 1)
            write(result, args.out)
    print(markdown(result), end="")
    print(f"gpu-check: figures in {', '.join(str(p) for p in out_paths(args.out))}", file=sys.stderr)
    return 1 if any(run["status"] in ("failed", "timeout") for run in result["runs"]) else 0


def _status(case: Case, raw: dict[str, Any]) -> dict[str, Any]:
    """How a run ended: ``ok``, ``timeout`` (stopped by the budget, its recorded steps kept),
    ``failed``, or ``skipped`` for a several-GPU run that failed or ran on one device."""
    if raw["timed_out"]:
        return {"status": "timeout", "reason": f"stopped by the time budget after {len(raw['steps'])} steps"}
    if raw["returncode"] != 0 or not raw["steps"]:
        error = (raw["summary"] or {}).get("error")  # a run that failed with a JobError says why
        why = f"{error['code']}: {error['message']}" if error else (raw["stderr_tail"] or ["no output"])[-1]
        why = f"rloo train exited {raw['returncode']}: {why}"
        if case.gpus > 1:
            return {"status": "skipped", "reason": f"{why} (several ranks may not be supported yet)"}
        return {"status": "failed", "reason": why}
    used = sum(len(r["cuda"]) for r in raw["memory"])
    if case.gpus > 1 and used < case.gpus:
        return {
            "status": "skipped",
            "reason": f"resources.gpus = {case.gpus} was not honoured: the run used {used} device(s)",
        }
    return {"status": "ok"}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())

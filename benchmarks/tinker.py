"""What the Tinker protocol costs (``python -m benchmarks.tinker``; ``make bench``'s ``tinker``): one
``forward_backward`` + ``optim_step`` round trip through the unmodified ``tinker`` SDK (the API under
uvicorn, Redis, the training worker holding the model) against the same work on the same model in
this process (``worker.engine.tinker.model.TrainingModel``), and samples/s through the SDK's
``SamplingClient`` against the inference worker's own batch (``worker.serving.decode``) on the same
prompt, on the *tiny* and *small* configs (``benchmarks.common``). Client, API and workers share the
machine's cores. Prints one JSON object.

A step: 8 datums of 64 tokens, cross-entropy, LoRA rank 8, AdamW; ``ROUNDS`` timed after 3 warm-up
steps; p50 and p99 of the wall time of each (the SDK's: from the call to both results). Sampling:
8 samples of 32 tokens (``stop=[]``: never shorter), temperature 1, seeded, ``ROUNDS`` requests.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import CONFIGS, build, local_stack

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 30
BATCH, LENGTH, RANK = 8, 64, 8
SAMPLES, SAMPLE_TOKENS = 8, 32
THREADS = 1
"""torch threads of the in-process side: what a worker chooses on this 2-core machine (the stack's log
says what each worker chose; the figures print both)."""


def _percentiles(walls: list[float]) -> dict[str, float]:
    ordered = sorted(walls)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": round(1000 * statistics.median(ordered), 1), "p99_ms": round(1000 * p99, 1)}


def _sequences(seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (LENGTH + 1,), generator=g).tolist() for _ in range(BATCH)]


def _through_sdk(url: str, key: str, config: str) -> dict[str, Any]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=config, rank=RANK, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * LENGTH},
        )
        for ids in _sequences(0)
    ]
    adam = types.AdamParams(learning_rate=1e-4)
    walls = []
    for i in range(ROUNDS + 3):
        started = time.perf_counter()
        fb = training.forward_backward(data, "cross_entropy")  # sent together, as a loop pipelines them
        step = training.optim_step(adam)
        fb.result(), step.result()
        if i >= 3:
            walls.append(time.perf_counter() - started)
    sampler = service.create_sampling_client(base_model=config).result()
    prompt = types.ModelInput.from_ints(_sequences(1)[0][:16])
    params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, stop=[], seed=0)
    sampler.sample(prompt, SAMPLES, params).result()  # the model loads
    started = time.perf_counter()
    tokens = 0
    for seed in range(ROUNDS // 3):
        params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, stop=[], seed=seed)
        tokens += sum(len(s.tokens) for s in sampler.sample(prompt, SAMPLES, params).result().sequences)
    sampled = time.perf_counter() - started
    return {
        "step": _percentiles(walls),
        "sampled_tokens_per_s": round(tokens / sampled, 1),
        "samples_per_s": round(SAMPLES * (ROUNDS // 3) / sampled, 2),
    }


def _in_process(models: Path, config: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engine.tinker.model import AdamStep, Datum, LoraSettings, TrainingModel
    from worker.serving.decode import Batch, Row

    model = TrainingModel(
        models / config, lora=LoraSettings(rank=RANK, seed=0), device=torch.device("cpu"), name=config
    )
    data = [
        Datum(torch.tensor(ids[:-1]), {"target_tokens": torch.tensor(ids[1:]), "weights": torch.ones(LENGTH)})
        for ids in _sequences(0)
    ]
    walls = []
    for i in range(ROUNDS + 3):
        started = time.perf_counter()
        model.forward_backward(data, "cross_entropy", {}, backward=True)
        model.optim_step(AdamStep(learning_rate=1e-4))
        if i >= 3:
            walls.append(time.perf_counter() - started)
    served = AutoModelForCausalLM.from_pretrained(models / config).eval()
    tok = AutoTokenizer.from_pretrained(models / config)
    prompt = _sequences(1)[0][:16]
    tokens, started = 0, time.perf_counter()
    for seed in range(ROUNDS // 3):
        rows = [
            Row(request="b", index=j, prompt_ids=prompt, max_tokens=SAMPLE_TOKENS, seed=seed * 100 + j, logprobs=[],
                stop_ids=frozenset())
            for j in range(SAMPLES)
        ]  # fmt: skip
        for _ in Batch(served, tok, rows, context=served.config.max_position_embeddings).run():
            pass
        tokens += sum(len(r.tokens) for r in rows)
    sampled = time.perf_counter() - started
    return {
        "step": _percentiles(walls),
        "sampled_tokens_per_s": round(tokens / sampled, 1),
        "samples_per_s": round(SAMPLES * (ROUNDS // 3) / sampled, 2),
    }


def main() -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="rloo-bench-tinker-"))
    models = home / "models"
    for config in CONFIGS:
        build(models, config)
    import re

    import torch

    torch.set_num_threads(THREADS)
    direct = {config: _in_process(models, config) for config in CONFIGS}  # before the stack starts
    with local_stack(home, models, [["worker"], ["worker", "--serve"]], key_flags=("--tinker",)) as (url, key):
        chosen = re.findall(r"torch threads: (\d+)", (home / "stack.log").read_text())
        out: dict[str, Any] = {
            "settings": f"a step: {BATCH} datums x {LENGTH} tokens, cross_entropy, LoRA rank {RANK}, AdamW, "
            f"{ROUNDS} timed; sampling: {SAMPLES} samples x {SAMPLE_TOKENS} tokens, temperature 1, "
            f"{ROUNDS // 3} requests; fp32 CPU, client, API and workers on one machine; torch threads: "
            f"{THREADS} in process, {'/'.join(chosen) or 'unknown'} in the workers (RLOO_TORCH_THREADS auto)",
        }
        for config in CONFIGS:
            print(f"tinker: {config}", file=sys.stderr, flush=True)
            sdk = _through_sdk(url, key, config)
            out[config] = {
                "config": f"{config}: {CONFIGS[config]}, vocab 512",
                "through the SDK": sdk,
                "in process": direct[config],
                "protocol_overhead_ms_p50": round(sdk["step"]["p50_ms"] - direct[config]["step"]["p50_ms"], 1),
            }
        return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

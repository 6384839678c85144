"""What serving costs (``python -m benchmarks.serving``; ``make bench``'s ``serving``): chat completions
streamed through the whole service path (the openai SDK, the API under uvicorn, Redis, an inference
worker), one stream alone and 8 at once, against ``generate`` called directly on the same model in
this process and against the worker's own batch alone, on the *tiny* and *small* configs
(``benchmarks.common``). Client, API and worker share the machine's cores.

For each: time to the first token (the first content chunk; ``generate``'s first streamed token) and
tokens per second (the usage's completion tokens over the wall time; for 8 streams, their sum over
the wall time of all 8). Sampling at temperature 1, ``max_tokens`` 64, seeded, fp32 CPU. Prints one
JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import CONFIGS, build, local_stack

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64
CONCURRENT = 8
ROUNDS = 5
MESSAGES = [{"role": "user", "content": "tell me about the cat and the dog"}]


def _stream(client: Any, model: str, seed: int) -> tuple[float, int, float]:
    """One streamed chat completion: (time to its first content, completion tokens, wall time)."""
    started = time.perf_counter()
    first = None
    tokens = 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    wall = time.perf_counter() - started
    return (first if first is not None else wall), tokens, wall


def _service(client: Any, model: str) -> dict[str, Any]:
    _stream(client, model, 0)  # the model loads
    alone = [_stream(client, model, seed) for seed in range(1, ROUNDS + 1)]
    together: list[tuple[float, int, float]] = []
    walls = []
    for round_ in range(ROUNDS):
        results: list[tuple[float, int, float]] = []

        def one(seed: int, into: list[tuple[float, int, float]] = results) -> None:
            into.append(_stream(client, model, seed))

        threads = [
            threading.Thread(target=one, args=(s,)) for s in range(round_ * CONCURRENT, (round_ + 1) * CONCURRENT)
        ]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        walls.append(time.perf_counter() - started)
        together.extend(results)
    return {
        "1 stream": {
            "ttft_ms_median": round(1000 * statistics.median(r[0] for r in alone), 1),
            "tokens_per_s": round(sum(r[1] for r in alone) / sum(r[2] for r in alone), 1),
        },
        f"{CONCURRENT} streams": {
            "ttft_ms_median": round(1000 * statistics.median(r[0] for r in together), 1),
            "tokens_per_s": round(sum(r[1] for r in together) / sum(walls), 1),
        },
    }


def _direct(path: Path) -> dict[str, Any]:
    """``generate`` on the same model: one prompt (its first token timed with a streamer) and 8 at once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)

    def run(n: int, seed: int) -> tuple[float, int, float]:
        enc = tok([text] * n, return_tensors="pt", add_special_tokens=False, padding=True)
        streamer = TextIteratorStreamer(tok, skip_prompt=True) if n == 1 else None
        torch.manual_seed(seed)
        started = time.perf_counter()
        out: list[Any] = []
        kwargs = {
            "do_sample": True,
            "max_new_tokens": MAX_TOKENS,
            "streamer": streamer,
            "pad_token_id": tok.pad_token_id,
        }
        thread = threading.Thread(target=lambda: out.append(model.generate(**enc, **kwargs)))
        thread.start()
        first = None
        if streamer is not None:
            for piece in streamer:
                if first is None and piece:
                    first = time.perf_counter() - started
        thread.join()
        wall = time.perf_counter() - started
        new = out[0][:, enc["input_ids"].shape[1] :]
        eos = tok.eos_token_id
        tokens = sum(int((row == eos).nonzero()[0][0]) + 1 if (row == eos).any() else len(row) for row in new)
        return (first if first is not None else wall), tokens, wall

    def engine(seed: int) -> tuple[int, float]:
        """The inference worker's own batch (``worker.serving.decode``) on the 8, no HTTP, no Redis."""
        from worker.serving.decode import Batch, Row

        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows = [
            Row(request=str(i), index=0, prompt_ids=ids, max_tokens=MAX_TOKENS, seed=seed * 100 + i)
            for i in range(CONCURRENT)
        ]
        started = time.perf_counter()
        for _ in Batch(model, tok, rows, context=model.config.max_position_embeddings).run():
            pass
        return sum(r.sampled for r in rows), time.perf_counter() - started

    with torch.inference_mode():
        run(1, 0)
        alone = [run(1, s) for s in range(1, ROUNDS + 1)]
        batched = [run(CONCURRENT, s) for s in range(1, ROUNDS + 1)]
        ours = [engine(s) for s in range(1, ROUNDS + 1)]
    return {
        "1 stream": {
            "ttft_ms_median": round(1000 * statistics.median(r[0] for r in alone), 1),
            "tokens_per_s": round(sum(r[1] for r in alone) / sum(r[2] for r in alone), 1),
        },
        f"{CONCURRENT} at once (one batched generate)": {
            "tokens_per_s": round(sum(r[1] for r in batched) / sum(r[2] for r in batched), 1),
        },
        f"{CONCURRENT} at once (the worker's batch alone, no HTTP or Redis)": {
            "tokens_per_s": round(sum(r[0] for r in ours) / sum(r[1] for r in ours), 1),
        },
    }


def main() -> dict[str, Any]:
    import openai

    home = Path(tempfile.mkdtemp(prefix="rloo-bench-serving-"))
    models = home / "models"
    for config in CONFIGS:
        build(models, config)
    parts = [["worker", "--serve"]]
    with local_stack(home, models, parts, env={"RLOO_INFERENCE_MAX_CONCURRENT": "64"}) as (url, key):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.completions.create(model="tiny", prompt="hi", max_tokens=1)
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        out: dict[str, Any] = {
            "settings": f"chat completions streamed, temperature 1, max_tokens {MAX_TOKENS}, seeded, fp32 CPU, "
            f"{ROUNDS} rounds each, {CONCURRENT} streams at once through the service",
        }
        for config in CONFIGS:
            print(f"serving: {config}", file=sys.stderr, flush=True)
            out[config] = {
                "config": f"{config}: {CONFIGS[config]}, vocab 512",
                "service": _service(client, config),
                "generate": _direct(models / config),
            }
        return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

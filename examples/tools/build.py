"""Arithmetic a tiny model cannot do, and can with a calculator: tool use taught by supervised
training, then improved by RLOO with the tool in the loop. Offline, on 2 cores.

    python examples/tools/build.py            # the data, the models, the supervised starts
    rloo train examples/tools/job.json        # RLOO whose rollouts call the built-in calculator
    python examples/tools/build.py --train    # all of it over seeds: the accuracy table, the last line JSON

The task: ``48213*5522=``, sums and products of two numbers of 4 to 6 digits (answers up to 12
digits). Exact match on the held-out problems.

What it writes:

* next to this file: ``sft.jsonl`` (worked dialogues in OpenAI's tool-call format: the user's
  question; the assistant's ``tool_calls`` to ``calculator`` with the expression; the ``tool``
  message with the result; the assistant's answer), ``direct.jsonl`` (the same problems answered
  directly: the no-tool baseline's data), ``train.jsonl`` (other problems with their ``answer``,
  RLOO's prompts) and ``valid.jsonl`` (500 held-out problems);
* under the models root: ``tools-base`` (a random Llama-style model, 2 layers, hidden 64; digits
  one token each, the call's scaffolding a few), ``tools-sft`` (after ``sft.json``: it learned the
  call format and to copy the result, not yet reliably) and ``tools-direct`` (after ``direct.json``:
  the same steps on direct answers).

``job.json`` trains ``tools-sft`` with RLOO: 16 problems a step, 8 rollouts each, each rollout up to
3 turns and 2 calls of the built-in ``calculator``, reward 1 for the exact answer. ``job_http.json``
is the same job with the calculator served over HTTP by ``tool_server.py`` (the operator admits it
with ``RLOO_TOOL_URLS``). Everything is seeded: the same files and weights on every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

N_VALID, N_SFT, N_TRAIN = 500, 2000, 8000
BASE, SFT, DIRECT = "tools-base", "tools-sft", "tools-direct"
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 160}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
SEEDS = (0, 1, 2, 3, 4)


def _addition() -> Any:
    """examples/addition/build.py, whose ``run`` (``rloo train`` in this process, with a progress
    bar) this example shares."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("addition_build", HERE.parent / "addition" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def problems(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Distinct problems ``a+b`` and ``a*b`` (``a``, ``b`` of 4 to 6 digits), split once: held-out,
    worked, to train on; no problem is in two of them."""
    rng = random.Random(seed)
    seen: set[str] = set()
    questions: list[tuple[str, str]] = []
    while len(questions) < N_VALID + N_SFT + N_TRAIN:
        a, b = (_number(rng) for _ in range(2))
        op = rng.choice("+*")
        expression = f"{a}{op}{b}"
        if expression not in seen:
            seen.add(expression)
            questions.append((expression, str(a + b if op == "+" else a * b)))
    valid, sft, train = (
        questions[:N_VALID],
        questions[N_VALID : N_VALID + N_SFT],
        questions[N_VALID + N_SFT :],
    )

    def user(e: str) -> dict[str, str]:
        return {"role": "user", "content": f"{e}="}

    def worked(e: str, answer: str) -> dict[str, Any]:
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": e})},
        }
        return {
            "messages": [
                user(e),
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": answer},
                {"role": "assistant", "content": answer},
            ],
            "tools": [CALCULATOR],
        }

    return {
        "sft": [worked(e, a) for e, a in sft],
        "direct": [{"messages": [user(e), {"role": "assistant", "content": a}]} for e, a in sft],
        "train": [{"messages": [user(e)], "answer": a} for e, a in train],
        "valid": [{"messages": [user(e)], "answer": a} for e, a in valid],
    }


def _number(rng: random.Random) -> int:
    digits = rng.randint(4, 6)
    return rng.randrange(10 ** (digits - 1), 10**digits)


def write_data(where: Path = HERE) -> None:
    for name, rows in problems().items():
        tmp = where / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, where / f"{name}.jsonl")  # never a half-written file


def scaffold_corpus() -> list[str]:
    """What the tokenizer learns merges from: the calls' and results' scaffolding, no digit (so
    each digit stays a token of its own, as in examples/addition)."""
    from service.tools.calls import written

    call = written([("calculator", {"expression": ""})], "hermes")
    return [call, "<tool_response></tool_response>", "tools: calculator"] * 50


def build_base(models: Path, *, force: bool) -> Path:
    from worker.tiny.models import build_tiny_causal_lm

    return build_tiny_causal_lm(
        models / BASE, corpus=scaffold_corpus(), vocab_size=320, seed=0, overwrite=force, **MODEL
    )


def build_sft(models: Path, name: str, spec: str, *, force: bool, steps: int | None) -> Path:
    """``tools-base`` trained by ``spec``, its weights and tokenizer put under the models root as
    ``name`` (renamed into place: never half there)."""
    run = _addition().run
    target = models / name
    if (target / "config.json").is_file() and not force and not steps:
        return target
    overrides = {"max_steps": steps} if steps else {}
    with tempfile.TemporaryDirectory(dir=models) as scratch:
        summary = run(HERE / spec, f"{name}", "train_loss", Path(scratch) / "run", overrides)
        staged = Path(scratch) / name
        shutil.copytree(summary["final_checkpoint"], staged, ignore=shutil.ignore_patterns("training_state*"))
        if target.exists():
            shutil.rmtree(target)
        os.rename(staged, target)
    return target


def validation(spec: str, checkpoint: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """``spec``'s validation pass (one sample at temperature 1 on each held-out problem, seeded)."""
    from worker.engine.standalone import evaluate_spec

    return evaluate_spec(HERE / spec, overrides={}, checkpoint=checkpoint, seed=seed)


def mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def train_seeds(seeds: tuple[int, ...], steps: int | None) -> dict[str, Any]:
    """RLOO from ``tools-sft`` once a seed; each seed's passes before (the SFT model, and the
    no-tool model) and after, on the same held-out problems with the same sampling seed."""
    from service.core.settings import get_settings

    run = _addition().run
    rows = []
    for seed in seeds:
        direct = validation("direct.json", seed=seed)
        before = validation("job.json", seed=seed)
        out = get_settings().home_dir / "runs" / f"tools-seed{seed}"
        overrides = {"max_steps": steps} if steps else {}
        started = time.monotonic()
        summary = run(HERE / "job.json", f"RLOO s{seed}", "train_reward_mean", out, overrides, seed=seed)
        after = validation("job.json", checkpoint=Path(summary["final_checkpoint"]), seed=seed)
        rows.append(
            {"seed": seed, "direct": direct, "before": before, "after": after, "seconds": time.monotonic() - started}
        )
        print(
            f"seed {seed}: no tool {direct['valid_reward_mean']:.1%}, SFT with the tool "
            f"{before['valid_reward_mean']:.1%}, after RLOO {after['valid_reward_mean']:.1%} "
            f"({rows[-1]['seconds']:.0f} s)",
            flush=True,
        )
    return {"rows": rows}


def report(result: dict[str, Any]) -> dict[str, Any]:
    """The table (mean +- s.e. over seeds) and its JSON line."""
    rows = result["rows"]

    def figure(which: str, key: str) -> tuple[float, float]:
        return mean_se([float(r[which][key]) for r in rows])

    table = [
        ("no tool (answers directly)", figure("direct", "valid_reward_mean"), None, None),
        (
            "SFT, with the tool",
            figure("before", "valid_reward_mean"),
            figure("before", "valid_tool_calls_mean"),
            figure("before", "valid_tool_well_formed_frac"),
        ),
        (
            "RLOO, with the tool",
            figure("after", "valid_reward_mean"),
            figure("after", "valid_tool_calls_mean"),
            figure("after", "valid_tool_well_formed_frac"),
        ),
    ]
    print(f"\nheld-out exact match, {N_VALID} problems, mean +- s.e. over {len(rows)} seeds:")
    print(f"{'':28} {'accuracy':>16} {'calls/episode':>16} {'well-formed':>16}")
    for name, acc, calls, formed in table:
        cells = [f"{acc[0]:.1%} +- {acc[1]:.1%}"]
        cells += ["-" if calls is None else f"{calls[0]:.2f} +- {calls[1]:.2f}"]
        cells += ["-" if formed is None else f"{formed[0]:.1%} +- {formed[1]:.1%}"]
        print(f"{name:28} " + " ".join(f"{c:>16}" for c in cells))
    return {
        "accuracy_no_tool": round(table[0][1][0], 4),
        "accuracy_sft_tool": round(table[1][1][0], 4),
        "accuracy_rl_tool": round(table[2][1][0], 4),
        "accuracy_se": {
            "no_tool": round(table[0][1][1], 4),
            "sft_tool": round(table[1][1][1], 4),
            "rl_tool": round(table[2][1][1], 4),
        },
        "seeds": len(rows),
        "tool_calls_per_episode": {"sft": round(table[1][2][0], 3), "rl": round(table[2][2][0], 3)},
        "well_formed_calls": {"sft": round(table[1][3][0], 4), "rl": round(table[2][3][0], 4)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--force", action="store_true", help="rebuild the models even if they exist")
    parser.add_argument("--sft-steps", type=int, metavar="N", help="supervised steps (sft.json's by default)")
    parser.add_argument("--train", action="store_true", help="then RLOO over the seeds: the accuracy table")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"how many seeds (default {len(SEEDS)})")
    parser.add_argument("--steps", type=int, help="RLOO steps (job.json's by default)")
    args = parser.parse_args(argv)

    from service.core.settings import get_settings

    models = get_settings().models_dir
    models.mkdir(parents=True, exist_ok=True)
    write_data()
    build_base(models, force=args.force)
    for name, spec in ((SFT, "sft.json"), (DIRECT, "direct_sft.json")):
        build_sft(models, name, spec, force=args.force, steps=args.sft_steps)
    if not args.train:
        before = validation("job.json")
        print(f"{models / SFT}: held-out accuracy with the calculator {before['valid_reward_mean']:.1%}")
        print("next: rloo train examples/tools/job.json   (or: python examples/tools/build.py --train)")
        return 0
    result = train_seeds(SEEDS[: args.seeds] if args.seeds <= len(SEEDS) else tuple(range(args.seeds)), args.steps)
    print(json.dumps(report(result)))
    return 0


if __name__ == "__main__":
    from worker.cli.app import torch_threads

    torch_threads()
    sys.exit(main())

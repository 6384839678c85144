"""Two-digit addition: a task a tiny model really learns, built offline in about 15 s on 2 quiet cores.

    python examples/addition/build.py            # the data, the base model, the supervised start
    rloo train examples/addition/job.json        # RLOO with an exact-match reward (or --train below)
    python examples/addition/build.py --train    # both, with the validation accuracy before and after

What it writes:

* next to this file: ``sft.jsonl`` (1,500 worked examples, ``{"messages": [user "23+45=", assistant
  "68"]}``), ``train.jsonl`` (8,000 other problems, ``{"messages": [user "23+45="], "answer": "68"}``:
  the reward's references, never shown to the policy) and ``valid.jsonl`` (500 held-out problems);
  every ``a+b`` with ``0 <= a, b <= 99`` appears in exactly one of them.
* under the models root (``RLOO_MODELS_DIR``, ``var/models`` by default): ``addition-base``, a
  random Llama-style model (2 layers, hidden 64, one token per character) and ``addition-sft``,
  ``addition-base`` after ``sft.json`` (400 steps of 64): supervised training on the worked examples
  teaches it the format (digits, then the end of turn) and some addition (about one held-out sum in
  six).

``job.json`` then trains ``addition-sft`` with RLOO on ``train.jsonl``: 16 problems a step, 8
samples each, reward 1 for the exact sum and 0 otherwise (a ``string_check``), and reports the
held-out accuracy (``valid_reward_mean``: one sample at temperature 1 on each of the 500 held-out
problems) every 50 steps. ``make bench-learning`` runs it over seeds, estimators, learning rates and
loss aggregations, and checks it against TRL (benchmarks/RESULTS.md, section 8).

Everything is seeded: the same files and weights on every run. A model already built is kept
(``--force`` rebuilds both; ``--sft-steps`` rebuilds ``addition-sft``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from worker.engine.recorders import QuietRecorder

HERE = Path(__file__).resolve().parent
N_VALID, N_SFT = 500, 1500
BASE, SFT = "addition-base", "addition-sft"
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 64}


def problems(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Every ``a+b`` of two numbers below 100, shuffled once and split: held-out, worked, to train on."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    valid, sft, train = pairs[:N_VALID], pairs[N_VALID : N_VALID + N_SFT], pairs[N_VALID + N_SFT :]

    def prompt(a: int, b: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{a}+{b}="}]

    return {
        "sft": [{"messages": [*prompt(a, b), {"role": "assistant", "content": str(a + b)}]} for a, b in sft],
        "train": [{"messages": prompt(a, b), "answer": str(a + b)} for a, b in train],
        "valid": [{"messages": prompt(a, b), "answer": str(a + b)} for a, b in valid],
    }


def write_data(where: Path = HERE) -> None:
    for name, rows in problems().items():
        tmp = where / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, where / f"{name}.jsonl")  # never a half-written file


def build_base(models: Path, *, force: bool) -> Path:
    from worker.tiny.models import build_tiny_causal_lm

    corpus = [f"{a}+{b}={a + b}" for a in range(100) for b in range(100)]
    # 262 = the 6 special tokens + the 256 bytes: no merges, so every digit is a token of its own.
    return build_tiny_causal_lm(models / BASE, corpus=corpus, vocab_size=262, seed=0, overwrite=force, **MODEL)


class Progress(QuietRecorder):
    """A recorder that shows a run as a progress bar (rich) with its headline metric; where the output
    is not a terminal (a log, a pipe, CI), a plain line every twentieth of the run and at each
    validation instead, so that a long run is never silent."""

    def __init__(self, title: str, key: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.title, self.key = title, key
        self.plain = not sys.stdout.isatty()
        self.started = time.monotonic()
        self.bar = Progress(
            TextColumn(f"{title:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[shown]}"),
            TimeRemainingColumn(),
            disable=self.plain,
        )
        self.task = self.bar.add_task(title, total=None, shown="")  # the first step tells the total
        self.steps: list[dict[str, Any]] = []

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def event(self, message: str, level: str = "info") -> None:
        if level != "info":
            self.bar.console.print(f"[{level}] {message}", markup=False)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.steps.append(metrics)
        value = metrics.get(self.key)
        valid = metrics.get("valid_reward_mean")
        shown = f"{self.key} {value:.3f}" + (f"  held-out accuracy {valid:.1%}" if valid is not None else "")
        total = metrics["total_steps"]
        self.bar.update(self.task, completed=step, total=total, shown=shown)
        if self.plain and (step % max(1, total // 20) == 0 or step == total or valid is not None):
            print(f"{self.title} step {step}/{total}  {shown}  ({time.monotonic() - self.started:.0f} s)", flush=True)


def run(
    spec: Path, title: str, key: str, output_dir: Path, overrides: dict[str, Any], seed: int | None = None
) -> dict[str, Any]:
    """``rloo train SPEC`` in this process, shown as a progress bar; its summary (``run_spec``'s)."""
    from worker.engine.standalone import run_spec

    with Progress(title, key) as progress:
        summary = run_spec(spec, overrides=overrides, output_dir=output_dir, recorder=progress, seed=seed)
    if summary["status"] != "succeeded":
        raise SystemExit(f"{spec.name} did not succeed: {summary}")
    summary["curve"] = [
        (m["step"], m["valid_reward_mean"]) for m in progress.steps if m.get("valid_reward_mean") is not None
    ]
    return summary


def build_sft(models: Path, *, force: bool, sft_steps: int | None) -> Path:
    """``addition-base`` trained on ``sft.jsonl`` (``sft.json``), its weights and tokenizer put
    under the models root as ``addition-sft`` (renamed into place: never half there)."""
    target = models / SFT
    if (target / "config.json").is_file() and not force and not sft_steps:
        return target
    overrides = {"max_steps": sft_steps} if sft_steps else {}
    with tempfile.TemporaryDirectory(dir=models) as scratch:
        summary = run(HERE / "sft.json", "supervised", "train_loss", Path(scratch) / "run", overrides)
        staged = Path(scratch) / SFT
        shutil.copytree(
            summary["final_checkpoint"], staged, ignore=shutil.ignore_patterns("training_state*")
        )  # what from_pretrained reads; the training state stays behind
        if target.exists():
            shutil.rmtree(target)
        os.rename(staged, target)
    return target


def accuracy(checkpoint: Path | None = None, seed: int | None = None) -> float:
    """The held-out accuracy of ``addition-sft`` (or of ``checkpoint``): job.json's validation pass."""
    from worker.engine.standalone import evaluate_spec

    return float(evaluate_spec(HERE / "job.json", overrides={}, checkpoint=checkpoint, seed=seed)["valid_reward_mean"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--force", action="store_true", help="rebuild the models even if they exist")
    parser.add_argument(
        "--sft-steps", type=int, metavar="N", help="supervised steps (sft.json's 400 by default); rebuilds addition-sft"
    )
    parser.add_argument("--train", action="store_true", help="then run job.json (RLOO) and show the accuracy")
    parser.add_argument("--seed", type=int, default=0, help="job.json's seed (its sampling, its data order)")
    args = parser.parse_args(argv)

    from service.core.settings import get_settings

    models = get_settings().models_dir
    models.mkdir(parents=True, exist_ok=True)
    write_data()
    build_base(models, force=args.force)
    sft = build_sft(models, force=args.force, sft_steps=args.sft_steps)
    before = accuracy(seed=args.seed)
    print(f"{sft}: held-out accuracy {before:.1%} (job.json's validation pass: one sample on each of {N_VALID})")
    if not args.train:
        print("next: rloo train examples/addition/job.json   (or: python examples/addition/build.py --train)")
        return 0
    out = get_settings().home_dir / "runs" / f"addition-seed{args.seed}"
    summary = run(HERE / "job.json", "RLOO", "train_reward_mean", out, {}, seed=args.seed)
    print(f"held-out accuracy: {before:.1%} before RLOO", end="")
    for step, value in summary["curve"]:
        print(f", {value:.1%} at step {step}", end="")
    print(f"\nfinal checkpoint: {summary['final_checkpoint']}")
    return 0


if __name__ == "__main__":
    from worker.cli.app import torch_threads

    torch_threads()  # RLOO_TORCH_THREADS, before torch is imported, as rloo train chooses them
    sys.exit(main())

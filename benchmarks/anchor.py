"""Our engine against Hugging Face TRL's ``RLOOTrainer`` (trl 1.16, the ``bench`` extra), side by side.

Same model files, same prompts, same reward code (our grader, called from a TRL reward function),
same settings: k=4, 8 prompts a step, 32 new tokens, lr 1e-3, KL 0.05 in the reward (TRL's RLOO folds
``beta`` into the reward as the paper does), fp32 on the CPU, one optimisation pass, no gradient
checkpointing, no dropout. The two run alternately in this one process, ``rounds`` times each, and the
medians are compared.

Run it with ``make bench`` (or ``python -m benchmarks.anchor``); it prints one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.run import Collect
from service import graders
from service.schemas import Hyperparameters
from worker.config import TrainConfig
from worker.data import load_items
from worker.tinymodels import build_tiny_causal_lm
from worker.train import train

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "demo" / "train.jsonl"
GRADER = {"type": "text_similarity", "name": "answer", "input": "{{ sample.output_text }}",
          "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}
CONFIGS = {
    "tiny": {"hidden_size": 64, "num_layers": 2},
    "small": {"hidden_size": 256, "num_layers": 4},
}
K, PROMPTS, NEW_TOKENS, LR, KL = 4, 8, 32, 1e-3, 0.05


def _plain_prompts(tmp: Path) -> Path:
    """The demo prompts as plain text (``prompt``), so both trainers see the same strings."""
    out = tmp / "prompts.jsonl"
    with open(out, "w") as f:
        for item in load_items(DATA):
            prompt = f"Q: {item['messages'][-1]['content']}\nA:"
            f.write(json.dumps({"prompt": prompt, "answer": item["answer"]}) + "\n")
    return out


def ours(models: Path, name: str, data: Path, steps: int, out: Path) -> dict[str, Any]:
    hp = Hyperparameters(rloo_k=K, batch_size=PROMPTS, max_new_tokens=NEW_TOKENS, learning_rate=LR, kl_coef=KL,
                         max_steps=steps, n_epochs=1000).resolved()
    cfg = TrainConfig(model=name, training_file=data, grader=GRADER, hyperparameters=hp, output_dir=out,
                      models_dir=models, seed=0, device="cpu")
    rec = Collect()
    t0 = time.perf_counter()
    train(cfg, rec)  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "rewards": [m["train_reward_mean"] for m in rec.steps]}


def trl(models: Path, name: str, data: Path, steps: int, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import RLOOConfig, RLOOTrainer

    hf_logging.set_verbosity_error()
    grader = graders.parse_grader(GRADER)

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        samples = [graders.Sample(output_text=c) for c in completions]
        return list(graders.grade_batch(grader, samples, [{"answer": a} for a in answer]).rewards)

    tok = AutoTokenizer.from_pretrained(models / name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(models / name, dtype=torch.float32)
    dataset = Dataset.from_list(load_items(data))
    args = RLOOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, seed=0, max_steps=steps, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=K * PROMPTS, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=K, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, beta=KL,
        num_iterations=1, gradient_checkpointing=False, disable_dropout=True, logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, remove_unused_columns=False,
    )
    trainer = RLOOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tok)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its logs; stdout is for our JSON
        trainer.train()
    wall = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"wall_s": wall, "rewards": rewards}


def compare(config: str, *, steps: int = 40, rounds: int = 2) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        models = tmp / "models"
        build_tiny_causal_lm(models / config, seed=0, **CONFIGS[config])
        data = _plain_prompts(tmp)
        runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
        for r in range(rounds):  # alternating, so drift in the machine's speed hits both alike
            for who, fn in (("ours", ours), ("trl", trl)):
                print(f"[{config}] round {r + 1}: {who}", file=sys.stderr, flush=True)
                runs[who].append(fn(models, config, data, steps, tmp / f"{who}-{r}"))
    out: dict[str, Any] = {"config": f"{config}: {CONFIGS[config]}, vocab 512, k={K}, {PROMPTS} prompts, "
                           f"{NEW_TOKENS} new tokens, {steps} steps, fp32 CPU"}
    for who, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        rewards = rs[0]["rewards"]
        out[who] = {
            "wall_s_median": round(wall, 2),
            "completions_per_s": round(steps * K * PROMPTS / wall, 1),
            "reward_first5": round(sum(rewards[:5]) / 5, 4),
            "reward_last5": round(sum(rewards[-5:]) / 5, 4),
        }
    out["speedup_completions_per_s"] = round(out["ours"]["completions_per_s"] / out["trl"]["completions_per_s"], 2)
    return out


def main() -> None:
    import trl as trl_pkg

    configs = sys.argv[1:] or list(CONFIGS)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "trl": trl_pkg.__version__,
                      "torch_threads": torch.get_num_threads(),
                      **{c: compare(c) for c in configs}}, indent=2))


if __name__ == "__main__":
    main()

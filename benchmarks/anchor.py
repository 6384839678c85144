"""Our engine against Hugging Face TRL's ``RLOOTrainer`` (trl 1.16, the ``bench`` extra), side by side.

Same model files, same prompts, same reward function (``benchmarks.common.count_reward``), same
settings: k=4, 8 prompts a step, 32 new tokens, lr 1e-3, KL 0.05 in the reward (TRL's RLOO folds
``beta`` into the reward as the paper does), fp32 on the CPU, one optimisation pass, no gradient
checkpointing, no dropout. The two run alternately in this one process, ``rounds`` times each, and the
medians are compared.

With ``--reward-model`` the reward is a reward model of the policy's shape instead (the same files
for both, sharing the policy's tokenizer, no chat template: each reads prompt + completion), one
round unless ``--rounds=N``: the score phase's own cost, which the count reward leaves out.

Run it with ``make bench`` (or ``python -m benchmarks.anchor [--reward-model] [--rounds=N]
[tiny|small]``); it prints one JSON object.
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

from benchmarks.common import (
    CONFIGS,
    KL,
    LR,
    NEW_TOKENS,
    PROMPTS,
    SETTINGS,
    STEPS,
    K,
    build,
    count_reward,
    first_last,
    ours,
    plain_prompts,
    trl_config,
)

REWARD_MODEL = {"type": "reward_model", "name": "rm", "model": "reward"}


def trl(
    models: Path, config: str, data: Path, out: Path, *, steps: int = STEPS, seed: int = 0, reward_model: bool = False
) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import RLOOTrainer

    from worker.engine.data import load_items

    hf_logging.set_verbosity_error()

    def reward(completions: list[str], **_: Any) -> list[float]:
        return count_reward(completions)

    tok = AutoTokenizer.from_pretrained(models / config)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(models / config, dtype=torch.float32)
    dataset = Dataset.from_list(load_items(data))
    args = trl_config(
        out, seed=seed, steps=steps, learning_rate=LR, k=K, prompts=PROMPTS, new_tokens=NEW_TOKENS, beta=KL
    )
    funcs: Any = reward
    processing: Any = None
    if reward_model:
        from transformers import AutoModelForSequenceClassification

        funcs = AutoModelForSequenceClassification.from_pretrained(models / "reward", dtype=torch.float32)
        processing = AutoTokenizer.from_pretrained(models / "reward")
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        reward_processing_classes=processing,
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its logs; stdout is for our JSON
        trainer.train()
    wall = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"wall_s": wall, "rewards": rewards}


def compare(config: str, *, rounds: int = 3, reward_model: bool = False) -> dict[str, Any]:
    """``rounds`` runs of each, alternating, round r with seed r: the speed is the median round, the
    reward the mean over seeds (one seed's trajectory is mostly sampling noise)."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        build(tmp / "models", config)
        if reward_model:
            build_plain_reward_model(tmp / "models", config)
        data = plain_prompts(tmp)
        runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
        ours_kw: dict[str, Any] = {"grader": REWARD_MODEL} if reward_model else {}
        trl_kw: dict[str, Any] = {"reward_model": True} if reward_model else {}
        for r in range(rounds):  # alternating, so drift in the machine's speed hits both alike
            for who, fn, kw in (("ours", ours, ours_kw), ("trl", trl, trl_kw)):
                print(f"[{config}] round {r + 1} (seed {r}): {who}", file=sys.stderr, flush=True)
                runs[who].append(fn(tmp / "models", config, data, tmp / f"{who}-{r}", seed=r, **kw))
    out: dict[str, Any] = {"config": f"{config}: {CONFIGS[config]}, vocab 512, {STEPS} steps, seeds 0..{rounds - 1}"}
    for who, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        curve = [statistics.mean(step) for step in zip(*(r["rewards"] for r in rs), strict=True)]
        first, last = first_last(curve)
        out[who] = {
            "wall_s_median": round(wall, 2),
            "completions_per_s": round(STEPS * K * PROMPTS / wall, 1),
            "reward_first5": first,
            "reward_last5": last,
            "reward_every_5th_step": [round(x, 2) for x in curve[::5]],
        }
    out["speedup_completions_per_s"] = round(out["ours"]["completions_per_s"] / out["trl"]["completions_per_s"], 2)
    return out


def build_plain_reward_model(models: Path, config: str) -> None:
    """A reward model of ``config``'s shape sharing its policy's tokenizer, without a chat template."""
    from worker.tiny.models import build_tiny_reward_model

    path = build_tiny_reward_model(models / "reward", tokenizer_from=models / config, seed=1, **CONFIGS[config])
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    for extra in path.glob("chat_template.*"):
        extra.unlink()


def main() -> None:
    import transformers
    import trl as trl_pkg

    args = sys.argv[1:]
    reward_model = "--reward-model" in args
    rounds_args = [a for a in args if a.startswith("--rounds=")]
    configs = [a for a in args if a != "--reward-model" and a not in rounds_args] or list(CONFIGS)
    # A reward model's run is one round by default (it is slow); --rounds=N to take the median of N.
    rounds = int(rounds_args[-1].split("=", 1)[1]) if rounds_args else 1 if reward_model else 3
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "settings": SETTINGS,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "trl": trl_pkg.__version__,
                "torch_threads": torch.get_num_threads(),
                "reward": "a reward model of the policy's shape" if reward_model else "count_reward",
                **{c: compare(c, rounds=rounds, reward_model=reward_model) for c in configs},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

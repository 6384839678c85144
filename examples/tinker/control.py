"""The control for ``math_rl``'s figures: the same learning with no service in the way. Plain torch in
this process, run in the project's venv:

    python examples/tinker/control.py [--format arithmetic|addition] [--rl-lr 1e-5] [--steps 100] [--seed 0]

1. Supervised start. ``--format arithmetic`` (the default) trains ``build.py``'s architecture as
   ``cookbook.py sl_loop`` does: 700 steps of 128 chats of every sum of the cookbook's arithmetic
   environment, lr 1e-3 falling linearly (1e-3/700 at the last step), AdamW (0.9, 0.95).
   ``--format addition`` instead loads ``examples/addition``'s supervised start, ``addition-sft``
   (``examples/addition/build.py`` builds it), whose prompt is ``"23+45="``.
2. RL as ``math_rl`` does it: 100 steps, 32 problems of ``x, y`` drawn from step-seeded generators,
   8 samples each at temperature 1, 5 new tokens at most, reward 1 for the exact sum, the group's
   mean as the baseline, the summed log-probability loss, a fresh AdamW (0.9, 0.95, eps 1e-8, no
   clipping) at ``--rl-lr``.

Prints the share of sums right every 10 steps, then one JSON line: the mean over the first and the
last 20 steps. ``--rl-lr 0`` is the noise floor: the start model sampled on the same problems.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE)]

GROUP, PROBLEMS, MAX_TOKENS = 8, 32, 5


class Chat:
    """The tiny chat template's tokens for a problem's prompt and answer, in either format."""

    def __init__(self, tokenizer: Any, fmt: str) -> None:
        self.tokenizer, self.fmt = tokenizer, fmt
        self.user, self.assistant, self.eos = (
            int(tokenizer.convert_tokens_to_ids(t)) for t in ("<|user|>", "<|assistant|>", "<|eos|>")
        )
        self.top = 99 if fmt == "addition" else 100

    def text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, x: int, y: int) -> list[int]:
        if self.fmt == "addition":
            return [self.user, *self.text(f"{x}+{y}="), self.eos, self.assistant]
        fewshot = [self.user, *self.text("What is 4 + 5?"), self.eos, self.assistant, *self.text("9"), self.eos]
        return [*fewshot, self.user, *self.text(f"What is {x} + {y}?"), self.eos, self.assistant]

    def answer(self, x: int, y: int) -> list[int]:
        return [*self.text(str(x + y)), self.eos]


def supervised_start(seed: int) -> tuple[Any, Any]:
    """``build.py``'s model after ``cookbook.py sl_loop``'s schedule, in this process."""
    import tempfile

    import torch
    from build import build_base
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as home:
        path = build_base(Path(home), force=True)
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    chat = Chat(tokenizer, "arithmetic")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    pairs = [(x, y) for x in range(101) for y in range(101)]
    rng, order, steps, batch = random.Random(seed), [], 700, 128
    for step in range(steps):
        if len(order) < batch:
            order += rng.sample(pairs, len(pairs))
        rows, order = order[:batch], order[batch:]
        loss = _supervised_loss(model, chat, rows)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * (1 - step / steps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"supervised step {step}: mean NLL of an answer token {loss.item():.3f}", flush=True)
    return tokenizer, model


def _supervised_loss(model: Any, chat: Chat, rows: list[tuple[int, int]]) -> Any:
    import torch

    examples = [(chat.prompt(x, y), chat.answer(x, y)) for x, y in rows]
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(rows), width), chat.eos)
    labels = torch.full((len(rows), width), -100)
    for i, (p, a) in enumerate(examples):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    return model(input_ids=ids, labels=labels).loss


def reinforce_step(model: Any, chat: Chat, problems: list[tuple[int, int]]) -> float:
    """One group of samples a problem, graded; the gradient of the summed log-probability of each
    sample's tokens (up to its stop token) times its reward less the group's mean. The share right."""
    import torch

    right = []
    for x, y in problems:
        prompt = torch.tensor([chat.prompt(x, y)] * GROUP)
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=MAX_TOKENS,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                eos_token_id=chat.eos,
                pad_token_id=chat.eos,
            )
        completions = out[:, prompt.shape[1] :]
        rewards, masks = [], []
        for row in completions.tolist():
            n = row.index(chat.eos) + 1 if chat.eos in row else len(row)
            masks.append([1.0] * n + [0.0] * (len(row) - n))
            text = chat.tokenizer.decode(row[:n], skip_special_tokens=True).strip()
            rewards.append(1.0 if text == str(x + y) else 0.0)
        reward = torch.tensor(rewards)
        right.append(reward.mean().item())
        advantage = reward - reward.mean()
        if not advantage.any():
            continue
        logits = model(out).logits[:, prompt.shape[1] - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        (-(logprobs * torch.tensor(masks) * advantage[:, None]).sum()).backward()
    return sum(right) / len(right)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--format", choices=("arithmetic", "addition"), default="arithmetic")
    parser.add_argument("--rl-lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.core.settings import get_settings

    torch.manual_seed(args.seed)
    if args.format == "addition":
        path = get_settings().models_dir / "addition-sft"
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path} is missing: python examples/addition/build.py")
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    else:
        tokenizer, model = supervised_start(args.seed)
    chat = Chat(tokenizer, args.format)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    shares = []
    for step in range(args.steps):
        rng = random.Random(step)
        problems = [(rng.randint(0, chat.top), rng.randint(0, chat.top)) for _ in range(PROBLEMS)]
        optimizer.zero_grad()
        shares.append(reinforce_step(model, chat, problems))
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"RL step {step}: sums right {shares[-1]:.1%}", flush=True)
    n = min(20, len(shares))
    first, last = sum(shares[:n]) / n, sum(shares[-n:]) / n
    print(json.dumps({"format": args.format, "rl_lr": args.rl_lr, "seed": args.seed, "first": first, "last": last}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

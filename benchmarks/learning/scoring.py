"""Held-out scores without sampling noise: the same model always gets the same figures.

* ``expected``: the exact expected accuracy of one sample at temperature 1, the mean over the
  held-out problems of ``pi(answer + EOS | prompt)`` (the one way to write the sum exactly: the
  tokenizer has a token a character), one forward each through the engine's own log-prob path
  (``completion_logprobs``). A sampled pass of 500 problems estimates it with about 2 points of
  binomial error; this is the number it estimates.
* ``greedy``: the accuracy of the most likely completion (argmax at every token, at most
  ``max_new_tokens``), and ``greedy_reward``: the task's reward of it (equal to ``greedy`` for the
  exact-match task).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.learning.tasks import Task

BATCH = 100


def held_out(model_dir: Path, task: Task, items: list[dict[str, Any]], max_new_tokens: int) -> dict[str, float]:
    """``expected``, ``greedy`` and ``greedy_reward`` of the model in ``model_dir`` on ``items``
    (``{"messages", "answer"}``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.modeling import load_tokenizer, without_dropout
    from worker.engine.rollout.base import _eos_ids

    tok = load_tokenizer(model_dir, name=model_dir.name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    without_dropout(model)
    eos = _eos_ids(model, tok)
    expected, greedy, reward = 0.0, 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(items), BATCH):
            chunk = items[i : i + BATCH]
            expected += float(_answer_probability(model, tok, chunk, eos).sum())
            for item, text in zip(chunk, _greedy(model, tok, chunk, eos, max_new_tokens), strict=True):
                greedy += float(text == item["answer"])
                reward += task.reward(text, item["answer"])
    n = len(items)
    return {"expected": expected / n, "greedy": greedy / n, "greedy_reward": reward / n}


def _prompts(tok: Any, chunk: list[dict[str, Any]]) -> Any:
    from worker.engine.data import prompt_text

    return tok([prompt_text(item, tok) for item in chunk], return_tensors="pt", padding=True, add_special_tokens=False)


def _answer_probability(model: Any, tok: Any, chunk: list[dict[str, Any]], eos: list[int]) -> Any:
    """``(n,)`` ``pi(answer + any EOS | prompt)``: the answer's tokens' log-probs summed, plus the
    log of the probability mass on the EOS tokens after it (each EOS id in turn)."""
    import torch

    from worker.engine.rollout.base import Rollout, completion_logprobs

    enc = _prompts(tok, chunk)
    answers = [tok(item["answer"], add_special_tokens=False)["input_ids"] for item in chunk]
    width = max(len(a) for a in answers) + 1
    per_eos = []
    for end in eos:
        ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, answer in enumerate(answers):
            ids[row, : len(answer) + 1] = torch.tensor([*answer, end])
            mask[row, : len(answer) + 1] = 1
        rollout = Rollout(
            enc["input_ids"], enc["attention_mask"], ids, mask, torch.zeros(len(chunk), dtype=torch.bool), []
        )
        logp, _ = completion_logprobs(model, rollout, temperature=1.0)
        per_eos.append(torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(dim=1))
    return torch.logsumexp(torch.stack(per_eos), dim=0).exp()


def _greedy(model: Any, tok: Any, chunk: list[dict[str, Any]], eos: list[int], max_new_tokens: int) -> list[str]:
    """The argmax completion of each prompt, decoded as a rollout's text is (special tokens dropped)."""
    import torch

    enc = _prompts(tok, chunk)
    ids, attention = enc["input_ids"], enc["attention_mask"]
    done = torch.zeros(len(chunk), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in chunk]
    for _ in range(max_new_tokens):
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1, :]
        token = logits.argmax(dim=-1)
        for row in range(len(chunk)):
            if not done[row]:
                out[row].append(int(token[row]))
        done |= torch.isin(token, torch.tensor(eos))
        if bool(done.all()):
            break
        ids = torch.cat([ids, token.unsqueeze(1)], dim=1)
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
    return [tok.decode(row, skip_special_tokens=True) for row in out]

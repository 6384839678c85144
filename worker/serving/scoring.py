"""Log-probabilities a Tinker sample asks for beyond its tokens' own (``decode.Row.scoring``): the
prompt's (each prompt token's log-probability given the tokens before it, None at the first, which
has nothing before it), the top-k of each prompt position or of each sampled token, and top-k
sampling. All at temperature 1, the raw model's, as Tinker and vLLM report them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TopK = list[tuple[int, float]]


@dataclass(frozen=True)
class Scoring:
    """What a row asks for: ``prompt`` the prompt's log-probs, ``prompt_topk`` the top-k of each
    prompt position, ``last_n`` only the last n prompt positions (the others None), ``sample_topk``
    the top-k at each sampled token."""

    prompt: bool = False
    prompt_topk: int = 0
    last_n: int | None = None
    sample_topk: int = 0

    @property
    def wants_prompt(self) -> bool:
        return self.prompt or self.prompt_topk > 0


@dataclass
class PromptScores:
    logprobs: list[float | None] | None = None
    topk: list[TopK | None] | None = None


def _first_scored(count: int, scoring: Scoring) -> int:
    return max(1, count - scoring.last_n) if scoring.last_n is not None else 1


def scored_positions(prompt_ids: list[int], scoring: Scoring) -> int:
    """How many of the prompt's last positions' logits scoring needs (1: none but the next token's)."""
    if not scoring.wants_prompt:
        return 1
    return len(prompt_ids) - _first_scored(len(prompt_ids), scoring) + 1


def prompt_scores(logits: Tensor, prompt_ids: list[int], scoring: Scoring) -> PromptScores:
    """``logits``: ``(W, V)`` over the prompt's last W positions (W at least ``scored_positions``)."""
    count = len(prompt_ids)
    first = _first_scored(count, scoring)
    offset = count - logits.shape[0]  # the prompt position of logits[0]
    logprobs = torch.log_softmax(logits[first - 1 - offset : count - 1 - offset].float(), dim=-1)  # p from p - 1
    skipped: list[None] = [None] * first
    scores = PromptScores()
    if scoring.prompt:
        targets = torch.tensor(prompt_ids[first:], device=logits.device).unsqueeze(1)
        scores.logprobs = [*skipped, *(float(v) for v in logprobs.gather(1, targets).squeeze(1).tolist())]
    if scoring.prompt_topk > 0:
        scores.topk = [*skipped, *topk_lists(logprobs, scoring.prompt_topk)]
    return scores


def topk_lists(logprobs: Tensor, k: int) -> list[TopK | None]:
    """Each row's ``k`` most likely tokens with their log-probs, best first."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def keep_top_k(probs: Tensor, ks: list[int]) -> Tensor:
    """``probs`` with each row's tokens outside its ``k`` most likely set to 0 (k <= 0: all kept)."""
    widest = max(ks)
    if widest <= 0:
        return probs
    ranked = probs.topk(min(widest, probs.shape[-1]), dim=-1).values
    k = torch.tensor([min(max(k, 1), ranked.shape[-1]) for k in ks], device=probs.device)
    floor = ranked.gather(1, (k - 1).unsqueeze(1))
    unlimited = torch.tensor([k <= 0 for k in ks], device=probs.device).unsqueeze(1)
    return torch.where(unlimited | (probs >= floor), probs, torch.zeros_like(probs))

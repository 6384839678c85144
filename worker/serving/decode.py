"""Batched decoding for the inference workers: one forward a token for every row of a batch, each row
with its own sampling settings, seed, token budget and stop strings, its text streamed as it grows.

A row ends at the model's end-of-sequence token or at any other special token of its tokenizer (one
that opens a turn, pads or begins a text: ``end_ids``). The text never shows such a token, so a
model that writes one has left its turn: going on would only spend the budget on text written
after it, or, where every token is one, answer ``''`` with ``finish_reason: length``.

A batch (``Batch``) is formed once from the requests waiting for one base model and decodes until
its last row ends; rows that end (EOS, their budget, a stop string, a cancelled request) leave the
batch at once: their rows of the KV cache are dropped, so a long completion does not make the
short ones' neighbours pay. Prompts are left-padded, positions count real tokens only, as
``generate`` does: a request's greedy output is ``generate``'s, token for token.

Sampling is inverse-CDF from each row's own ``torch.Generator``: a seeded request draws the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from worker.engine.rollout.base import _cache_arg, _eos_ids, _nucleus
from worker.serving.scoring import (
    PromptScores,
    Scoring,
    TopK,
    keep_top_k,
    prompt_scores,
    scored_positions,
    topk_lists,
)

BASE_ADAPTER = "__base__"
"""peft's name for "no adapter" in a mixed-adapter batch (``adapter_names``)."""


@dataclass
class Row:
    """One completion being written: choice ``index`` of request ``request``."""

    request: str
    index: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    adapter: str | None = None
    stop_ids: frozenset[int] | None = None
    """Token ids it ends at, the end token kept in ``tokens`` (a Tinker sample's); None: the model's
    end-of-sequence and special tokens, left out of ``tokens`` (a served completion's)."""
    logprobs: list[float] | None = None
    """The model's log-probability of each token in ``tokens`` (temperature 1), where asked for."""
    top_k: int = 0
    """Draw from the k most likely tokens only (0: all)."""
    scoring: Scoring = field(default_factory=Scoring)
    """Log-probs asked for beyond ``logprobs`` (a Tinker sample's): filled in ``prompt`` and ``topk_logprobs``."""
    prompt: PromptScores = field(default_factory=PromptScores)
    topk_logprobs: list[TopK | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sampled: int = 0
    """Tokens drawn, its end-of-sequence token included (the usage counts it)."""
    text: str = ""
    """The text sent so far (a stop string, and a character still being spelled, held back)."""
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(
            self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        )


@dataclass(frozen=True)
class Delta:
    """What one row wrote in one step: new text (maybe empty) and, at its end, why it ended."""

    row: Row
    text: str
    finish_reason: str | None


class Batch:
    """Rows decoding together on one model (``model``, maybe a peft model holding several adapters:
    each row names its own, or none)."""

    def __init__(self, model: Any, tokenizer: Any, rows: list[Row], *, context: int | None) -> None:
        self.model, self.tokenizer, self.rows = model, tokenizer, rows
        self.eos = end_ids(_eos_ids(model, tokenizer), tokenizer)
        self.context = context
        self.device = next(model.parameters()).device
        self.adapters = hasattr(model, "peft_config")

    @torch.inference_mode()
    def run(self, cancelled: Any = lambda: set(), joining: Any = lambda: []) -> Iterator[list[Delta]]:
        """Decode until every row has ended; each step yields the rows' deltas. ``cancelled()`` names
        requests to drop, ``joining()`` gives rows to start now (both asked once a step): a request
        that arrives while the batch decodes joins it at the next token instead of waiting for its end."""
        state = self._prefill(self.rows)
        while state.rows:
            new = joining() if self.joinable(state.cache) else []
            if new:
                state = _merge(state, self._prefill(new))
            tokens = self._sample(state.logits, state.rows)
            logprobs, topk = _logprobs_of(state.logits, tokens, state.rows)
            deltas, keep = [], []
            stop_now = cancelled()
            for i, (row, token) in enumerate(zip(state.rows, tokens, strict=True)):
                if row.request in stop_now:
                    row.finish_reason = "cancelled"
                    continue
                if row.logprobs is not None:
                    row.logprobs.append(logprobs[i])
                if row.scoring.sample_topk > 0:
                    row.topk_logprobs.append(topk[i])
                delta = self._advance(row, token)
                deltas.append(delta)
                if delta.finish_reason is None:
                    keep.append(i)
            yield deltas
            if not keep:
                return
            state = state.keep(keep, torch.tensor(tokens, device=self.device))
            state.logits = self._forward(state.last.unsqueeze(1), state.mask, state.position, state.cache, state.rows)
            state.position = state.position + 1

    def _prefill(self, rows: list[Row]) -> _State:
        from transformers import DynamicCache

        width = max(len(r.prompt_ids) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows], device=self.device
        )
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        if not any(r.scoring.wants_prompt for r in rows):
            return _State(
                list(rows), cache, mask, positions[:, -1:] + 1, self._forward(ids, mask, positions, cache, rows)
            )
        # The last positions' logits, as many as the scored prompts need (left-padded: they line up)
        keep = max(2, *(scored_positions(r.prompt_ids, r.scoring) for r in rows))
        every = self._forward(ids, mask, positions, cache, rows, keep=keep)
        for i, row in enumerate(rows):
            if row.scoring.wants_prompt:
                window = min(keep, len(row.prompt_ids))
                row.prompt = prompt_scores(every[i, keep - window :], row.prompt_ids, row.scoring)
        return _State(list(rows), cache, mask, positions[:, -1:] + 1, every[:, -1, :].float())

    @staticmethod
    def joinable(cache: Any) -> bool:
        """Rows can join a batch whose cache is plain key/value tensors a layer (not a sliding window's)."""
        from transformers.cache_utils import DynamicLayer

        layers: list[Any] = getattr(cache, "layers", None) or []
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def _forward(
        self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any, rows: list[Row] | None = None, keep: int = 1
    ) -> Tensor:
        """The next token's logits ``(N, V)``; with ``keep`` > 1, the last ``keep`` positions' ``(N, keep, V)``."""
        extra: dict[str, Any] = {}
        if self.adapters:
            extra["adapter_names"] = [r.adapter or BASE_ADAPTER for r in (rows or self.rows)]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **_cache_arg(self.model, cache),
            use_cache=True,
            logits_to_keep=keep,
            **extra,
        )
        return out.logits if keep > 1 else out.logits[:, -1, :].float()

    def _sample(self, logits: Tensor, rows: list[Row]) -> list[int]:
        """One token a row: the most likely at temperature 0, else drawn from the row's generator."""
        greedy = logits.argmax(dim=-1)
        temperature = torch.tensor([r.temperature or 1.0 for r in rows], device=logits.device)
        probs = keep_top_k(torch.softmax(logits / temperature[:, None], dim=-1), [r.top_k for r in rows])
        top_p = torch.tensor([r.top_p for r in rows], device=logits.device)
        if bool((top_p < 1).any()):
            probs = _nucleus(probs, top_p[:, None])  # each row its own top_p
        cdf = probs.double().cumsum(dim=-1)
        u = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in rows]).to(logits.device)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        drawn = drawn.clamp(max=logits.shape[-1] - 1)
        chosen = torch.where(temperature.new_tensor([r.temperature == 0 for r in rows]).bool(), greedy, drawn)
        return [int(t) for t in chosen.tolist()]

    def _advance(self, row: Row, token: int) -> Delta:
        """``row`` takes ``token``: its new text, and whether (and why) it ended."""
        row.sampled += 1
        if row.stop_ids is None and token in self.eos:
            return self._end(row, "stop", self._decode(row))
        row.tokens.append(token)
        if row.stop_ids is not None and token in row.stop_ids:
            return self._end(row, "stop", self._decode(row))
        text = self._decode(row)
        for s in row.stop:
            at = text.find(s, max(0, len(row.text) - len(s)))
            if at >= 0:
                return self._end(row, "stop", text[:at])
        budget = len(row.tokens) >= row.max_tokens
        full = self.context is not None and len(row.prompt_ids) + len(row.tokens) >= self.context
        if budget or full:
            return self._end(row, "length", text)
        safe = max(_safe_end(text, row.stop), len(row.text))
        new, row.text = text[len(row.text) : safe], text[:safe]
        return Delta(row, new, None)

    def _end(self, row: Row, reason: str, text: str) -> Delta:
        new = text[len(row.text) :]
        row.text, row.finish_reason = text, reason
        return Delta(row, new, reason)

    def _decode(self, row: Row) -> str:
        return str(self.tokenizer.decode(row.tokens, skip_special_tokens=True))


def _logprobs_of(logits: Tensor, tokens: list[int], rows: list[Row]) -> tuple[list[float], list[TopK | None]]:
    """The model's log-probability (temperature 1) of each row's token, for rows that record them,
    and the top-k at that step for rows that ask (``Scoring.sample_topk``)."""
    if all(r.logprobs is None for r in rows):
        return [0.0] * len(rows), [None] * len(rows)
    every = torch.log_softmax(logits, dim=-1)
    chosen = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    widest = max(r.scoring.sample_topk for r in rows)
    ranked = topk_lists(every, widest) if widest > 0 else [None] * len(rows)
    topk = [(best or [])[: r.scoring.sample_topk] or None for r, best in zip(rows, ranked, strict=True)]
    return [float(v) for v in every.gather(1, chosen).squeeze(1).tolist()], topk


def end_ids(eos: list[int], tokenizer: Any) -> set[int]:
    """The tokens a served completion ends at (``finish_reason: stop``): the model's end-of-sequence
    ids and its tokenizer's special tokens (``all_special_ids``: BOS, padding, a chat template's
    turn markers such as ``<|im_start|>``), which ``skip_special_tokens`` leaves out of the text.
    (A training rollout ends at end-of-sequence only, as ``generate`` and TRL do.)"""
    return set(eos) | {int(i) for i in getattr(tokenizer, "all_special_ids", ()) if i is not None}


@dataclass
class _State:
    """A batch between two forwards: its rows, their KV cache, attention mask ``(N, T)``, next
    positions ``(N, 1)`` and the logits of their next token ``(N, V)``."""

    rows: list[Row]
    cache: Any
    mask: Tensor
    position: Tensor
    logits: Tensor
    last: Tensor = field(default_factory=lambda: torch.empty(0))

    def keep(self, keep: list[int], tokens: Tensor) -> _State:
        """The rows ``keep`` (the others ended), each having taken its token of ``tokens``: the mask
        grows by one column, the cache is cut to them."""
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=tokens.device)
            self.cache.batch_select_indices(index)
            self.rows = [self.rows[i] for i in keep]
            self.mask, self.position, tokens = self.mask[index], self.position[index], tokens[index]
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.last = tokens
        return self


def _merge(a: _State, b: _State) -> _State:
    """Two batches as one: the shorter's keys, values and mask padded on the left (masked out) to
    the longer's length, then stacked. Positions are each row's own, so nothing else moves."""
    width = max(a.mask.shape[1], b.mask.shape[1])

    def left(t: Tensor, dim: int) -> Tensor:
        short = width - t.shape[dim]
        if short == 0:
            return t
        shape = list(t.shape)
        shape[dim] = short
        return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)

    for mine, theirs in zip(a.cache.layers, b.cache.layers, strict=True):
        mine.keys = torch.cat([left(mine.keys, -2), left(theirs.keys, -2)], dim=0)
        mine.values = torch.cat([left(mine.values, -2), left(theirs.values, -2)], dim=0)
    mask = torch.cat([left(a.mask, 1), left(b.mask, 1)], dim=0)
    return _State(a.rows + b.rows, a.cache, mask, torch.cat([a.position, b.position]), torch.cat([a.logits, b.logits]))


def _safe_end(text: str, stop: tuple[str, ...]) -> int:
    """How much of ``text`` can be sent: not a character still being spelled (U+FFFD at the end of a
    partial UTF-8 sequence), nor a tail that may be the start of a stop string."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for s in stop:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:n]):
                end -= n
                break
    return end

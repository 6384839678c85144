"""Rollouts: k sampled completions per prompt, and the token log-probs of completions: what both
backends (``transformers_backend``, ``vllm_backend``) and the training loops share.

Layout is prompt-major: completion ``b * k + i`` is completion ``i`` of prompt ``b``, so a
``(B * k,)`` vector reshapes to RLOO's ``(B, k)``.
Sequences are ``[left-padded prompt | completion, right-padded]``: the completion always starts
at column ``P`` (the padded prompt width), which keeps log-prob slicing a plain slice.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from worker.engine.errors import JobError


@dataclass
class Rollout:
    prompt_ids: Tensor
    """(N, P) left-padded prompt tokens, each prompt repeated k times (prompt-major)."""
    prompt_mask: Tensor
    """(N, P) 1 on real prompt tokens."""
    completion_ids: Tensor
    """(N, T) sampled tokens, right-padded."""
    completion_mask: Tensor
    """(N, T) 1 on completion tokens up to and including the first EOS."""
    truncated: Tensor
    """(N,) bool: no EOS within max_new_tokens."""
    texts: list[str]
    """(N,) decoded completions, special tokens dropped."""
    group: int = 1
    """Rows per prompt: rows ``g * group .. (g + 1) * group - 1`` share one prompt (``k``)."""
    generated: Tensor | None = None
    """(N, T) 1 on the tokens the policy sampled, where not every completion token was (a
    multi-turn rollout's tool results and template scaffolding are context, not sampled); None: all
    of ``completion_mask``."""
    sampler_logprobs: Tensor | None = None
    """(N, T) float: the log-probability the sampler gave each sampled token, where the sampler is
    not the policy itself (vLLM: other kernels, other rounding, maybe other weights); NaN where it
    gave none (an EOS it does not report, padding). None: the policy sampled (the transformers
    backend), so the first pass's own log-probs are the sampler's."""

    @property
    def sampled_mask(self) -> Tensor:
        """(N, T) 1 on the sampled tokens: what the loss, the KL and the token counts read."""
        return self.completion_mask if self.generated is None else self.generated

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def sampled(self, special_ids: Collection[int]) -> list[list[int]]:
        """Each completion's tokens as sampled (within its mask), ``special_ids`` dropped: the ids
        its text was decoded from."""
        keep = self.completion_mask.bool() & ~torch.isin(
            self.completion_ids, torch.tensor(list(special_ids), dtype=torch.long, device=self.completion_ids.device)
        )
        rows, kept = self.completion_ids.tolist(), keep.tolist()
        return [[t for t, k in zip(row, use, strict=True) if k] for row, use in zip(rows, kept, strict=True)]

    def widened(self, width: int, pad_id: int) -> Rollout:
        """The same completions ``width`` tokens wide (padding masked out): what a job's ranks, whose
        completions ended at different lengths, agree on so that they run the same forwards."""
        extra = width - self.completion_ids.shape[1]
        if extra <= 0:
            return self
        ids = torch.nn.functional.pad(self.completion_ids, (0, extra), value=pad_id)
        mask = torch.nn.functional.pad(self.completion_mask, (0, extra), value=0)
        generated = None if self.generated is None else torch.nn.functional.pad(self.generated, (0, extra), value=0)
        sampler = self.sampler_logprobs
        if sampler is not None:
            sampler = torch.nn.functional.pad(sampler, (0, extra), value=math.nan)
        return Rollout(
            self.prompt_ids, self.prompt_mask, ids, mask, self.truncated, self.texts, self.group, generated, sampler
        )

    def rows(self, rows: slice) -> Rollout:
        """The completions ``rows`` (a micro-batch); whole groups keep their grouping."""
        start, stop, step = rows.indices(len(self.texts))
        whole_groups = step == 1 and start % self.group == 0 and stop % self.group == 0
        return Rollout(
            self.prompt_ids[rows],
            self.prompt_mask[rows],
            self.completion_ids[rows],
            self.completion_mask[rows],
            self.truncated[rows],
            self.texts[rows],
            self.group if whole_groups else 1,
            None if self.generated is None else self.generated[rows],
            None if self.sampler_logprobs is None else self.sampler_logprobs[rows],
        )


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn, the same for every backend."""

    max_new_tokens: int
    temperature: float
    top_p: float
    max_prompt_length: int
    stop: tuple[str, ...] = ()
    max_context: int | None = None
    """Tokens a context may reach in all, where rollouts go on past one turn (a run with tools: its
    trajectory budget); None: ``max_prompt_length + max_new_tokens``."""


class RolloutBackend(Protocol):
    """Generates completions for the policy. The update always scores them with the policy itself
    (``completion_logprobs``), so a backend only has to sample from the current weights.

    ``transformers`` (this module) samples with the policy object itself; ``vllm``
    (``worker.engine.rollout.vllm_backend``) runs a vLLM engine beside it on the GPU and receives the weights after
    each update (``sync``). ``worker.engine.rollout.backends.make_backend`` picks one.
    """

    name: str

    def sampling(self) -> AbstractContextManager[None]:
        """A phase of sampling (a step's rollouts, a validation pass): what it needs ready on entry
        and let go on exit, the same on every rank of a job (it may make collectives), so that the
        ``generate`` calls within it make none and ranks may make different numbers of them."""
        ...

    def generate(self, prompts: list[str], *, k: int, generator_seed: int, first: int = 0) -> Rollout:
        """k completions of each prompt; prompt ``b``'s are drawn from ``group_seed(generator_seed,
        first + b)`` alone, so a prompt's completions do not depend on which others share the call
        (a job's ranks each take a share of the batch: ``first`` is the share's place in it)."""
        ...

    def generate_ids(
        self, prompt_ids: list[list[int]], *, generator_seed: int, rows: list[int], max_new_tokens: int | None = None
    ) -> Rollout:
        """One completion of each prompt given as token ids (a multi-turn rollout's context, never
        re-tokenized), prompt ``b``'s drawn from ``group_seed(generator_seed, rows[b])`` alone, at
        most ``max_new_tokens`` (the sampling's, or fewer) new tokens."""
        ...

    def sync(self) -> None:
        """The policy's weights changed (an optimizer step): sample from the new ones from now on."""


class NonFiniteLogits(JobError):
    """The policy produced NaN logits while sampling: the job fails with ``non_finite_logits``."""

    def __init__(self, message: str) -> None:
        super().__init__("non_finite_logits", message)


def group_seed(generator_seed: int, prompt: int) -> int:
    """The seed of one prompt's k samples: the call's seed and the prompt's place in the step's
    batch, mixed (splitmix64) so that neighbouring prompts and steps draw unrelated streams."""
    z = (generator_seed * 0x9E3779B97F4A7C15 + prompt + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def row_uniforms(generator_seed: int, rows: list[int], steps: int) -> Tensor:
    """``(steps, len(rows))`` uniforms: column ``b`` from ``group_seed(generator_seed, rows[b])``'s
    generator (``group_uniforms`` with k = 1, for rows that are not consecutive)."""
    columns = [
        torch.rand(steps, 1, generator=torch.Generator().manual_seed(group_seed(generator_seed, r))) for r in rows
    ]
    return torch.cat(columns, dim=1) if columns else torch.zeros(steps, 0)


def group_uniforms(generator_seed: int, first: int, prompts: int, k: int, steps: int) -> Tensor:
    """``(steps, prompts * k)`` uniforms in [0, 1), prompt-major: prompt ``b``'s k columns come from
    its own CPU generator (``group_seed(generator_seed, first + b)``), the same on any device."""
    columns = []
    for b in range(prompts):
        g = torch.Generator().manual_seed(group_seed(generator_seed, first + b))
        columns.append(torch.rand(steps, k, generator=g))
    return torch.cat(columns, dim=1) if columns else torch.zeros(steps, 0)


def sample(logits: Tensor, temperature: float, top_p: float, uniform: Tensor) -> Tensor:
    """One token per row from ``softmax(logits / temperature)``, nucleus-filtered when ``top_p < 1``,
    by inverse CDF: row ``i``'s uniform ``uniform[i]`` placed in its cumulative distribution. That is
    exact categorical sampling with one given uniform a row (``torch.multinomial`` draws one
    exponential per vocabulary entry instead, from a generator shared by the rows, and costs 15
    times more on the CPU). A token of probability 0 is never drawn: on the CPU the cumulative sum
    adds in order, so its value equals its predecessor's and the uniform lies strictly below the
    total; a GPU's parallel scan adds in another order, so its sum could step by an ulp there, and
    such a rare draw takes the row's most likely token instead. Rows whose logits hold NaN give
    some valid token id; ``_sample`` reports them."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.minimum(uniform.to(total).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, u, right=True).squeeze(1)
    token = token.masked_fill_(token >= probs.shape[-1], 0)  # NaN rows only (reported by _sample)
    if probs.device.type != "cpu":
        drawn = probs.gather(1, token.unsqueeze(1)).squeeze(1)
        token = torch.where(drawn > 0, token, probs.argmax(dim=-1))
    return token


def _nucleus(probs: Tensor, top_p: float | Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (a number, or
    an ``(N, 1)`` tensor: each row its own)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def right_padded(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """``rows`` of token ids as one ``(N, T)`` tensor, right-padded with ``pad_id`` (T the longest,
    at least 1), and its mask (1 on each row's own ids)."""
    width = max(1, max((len(r) for r in rows), default=0))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
    if not ids:
        raise ValueError("the model has no EOS token; set eos_token_id in its generation_config.json")
    return sorted(set(ids))


def completion_mask_from(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """(N, T) mask of tokens up to and including the first EOS, and (N,) truncated flags."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    # Tokens strictly after the first EOS: cumulative count of EOS before this position > 0.
    seen_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    mask = (~seen_before).long()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def cut_at_stop(
    completion_ids: Tensor, mask: Tensor, truncated: Tensor, texts: list[str], tokenizer: Any, stop: list[str]
) -> list[str]:
    """End each completion at its first stop string, as OpenAI's ``stop`` does: the graded text is
    cut just before it; the tokens keep everything up to the token that completed it (they were
    sampled, so they carry the loss), and the completion no longer counts as truncated.
    ``mask`` and ``truncated`` are updated in place; returns the cut texts.
    """
    out = []
    for i, text in enumerate(texts):
        hits = [j for j in (text.find(s) for s in stop) if j >= 0]
        if not hits:
            out.append(text)
            continue
        cut = min(hits)
        out.append(text[:cut])
        # Fewest tokens whose text holds a stop string: decoding a prefix is monotone in its
        # length, so a binary search costs log2(T) decodes.
        n = int(mask[i].sum())
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            prefix = tokenizer.decode(completion_ids[i, :mid], skip_special_tokens=True)
            if any(s in prefix for s in stop):
                hi = mid
            else:
                lo = mid + 1
        mask[i, lo:] = 0
        truncated[i] = False
    return out


def completion_logprobs(
    model: Any, rollout: Rollout, *, temperature: float, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``(N, T)`` of the sampled completion tokens under ``model`` (temperature-scaled,
    the distribution they were sampled from), and optionally the per-token entropy ``(N, T)``.

    Only completion positions go through the LM head. When the rows come in groups sharing a
    prompt (``rollout.group = k > 1``), each prompt goes through the model once, with grad if
    enabled, and its keys and values are repeated for its k completions: the prompt costs ``1/k``
    of the FLOPs and activations of a forward over every row, and its gradient is the sum over
    the k completions, as in the full forward (``repeat_interleave``'s backward adds them).
    """
    if rollout.group > 1 and not (model.training and _checkpointing(model)):
        logits = _shared_prompt_logits(model, rollout)
    else:
        input_ids, attention_mask = rollout.input_ids, rollout.attention_mask
        # Left padding: positions count real tokens only, as generation numbered them.
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        t = rollout.completion_ids.shape[1]
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=t + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1, :]  # position j predicts token j + 1
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """The KV cache keyword: ``cache`` in recent transformers, ``past_key_values`` before."""
    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    cls: Any = type(base)
    return {_cache_keyword(cls): cache}


@functools.cache
def _cache_keyword(cls: Any) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _checkpointing(model: Any) -> bool:
    """Activation checkpointing in training turns the KV cache off inside each layer, so a shared
    prompt cannot be passed to the completions: those forwards take every row whole."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5, 4
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def _shared_prompt_logits(model: Any, rollout: Rollout) -> Tensor:
    """``(N, T, V)`` logits predicting each completion token: one forward over the unique prompts
    (its last position predicts the first token), keys and values repeated ``k`` times, then one
    forward over the completions (but their last token) against them."""
    from transformers import DynamicCache

    k = rollout.group
    prompt_ids, prompt_mask = rollout.prompt_ids[::k], rollout.prompt_mask[::k]
    attention_mask = rollout.attention_mask
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    p, t = prompt_ids.shape[1], rollout.completion_ids.shape[1]
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids[::k, :p],
        **_cache_arg(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    first: Tensor = out.logits[:, -1:, :].repeat_interleave(k, dim=0)
    if t == 1:
        return first
    cache.batch_repeat_interleave(k)  # out of place: autograd carries each row's gradient back to its prompt
    out = model(
        input_ids=rollout.completion_ids[:, :-1],
        attention_mask=attention_mask[:, : p + t - 1],
        position_ids=position_ids[:, p : p + t - 1],
        **_cache_arg(model, cache),
        use_cache=True,
    )
    return torch.cat([first, out.logits], dim=1)

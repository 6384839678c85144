"""Rollouts: k sampled completions per prompt, and the token log-probs of completions.

Layout is prompt-major: completion ``b * k + i`` is completion ``i`` of prompt ``b``, so a
``(B * k,)`` vector reshapes to RLOO's ``(B, k)``.
Sequences are ``[left-padded prompt | completion, right-padded]``: the completion always starts
at column ``P`` (the padded prompt width), which keeps log-prob slicing a plain slice.
"""

from __future__ import annotations

import functools
import inspect
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
        return Rollout(self.prompt_ids, self.prompt_mask, ids, mask, self.truncated, self.texts, self.group)

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
        )


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn, the same for every backend."""

    max_new_tokens: int
    temperature: float
    top_p: float
    max_prompt_length: int
    stop: tuple[str, ...] = ()


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

    def sync(self) -> None:
        """The policy's weights changed (an optimizer step): sample from the new ones from now on."""


class TransformersBackend:
    """Samples with the policy object itself (so ``sync`` has nothing to do): each prompt is prefilled
    once and its KV cache shared by its k samples."""

    name = "transformers"

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stop = list(sampling.stop)
        self.max_new_tokens, self.max_prompt_length = sampling.max_new_tokens, sampling.max_prompt_length
        self.temperature, self.top_p = sampling.temperature, sampling.top_p
        self.eos_ids = _eos_ids(model, tokenizer)

    def sync(self) -> None:
        pass

    def sampling(self) -> AbstractContextManager[None]:
        """A sharded policy's whole weights on each rank while it samples (``Ranks.generating``)."""
        from worker.engine.distributed.ranks import current

        return current().generating(self.model)

    @torch.no_grad()
    def generate(self, prompts: list[str], *, k: int, generator_seed: int, first: int = 0) -> Rollout:
        tok = self.tokenizer
        device = next(self.model.parameters()).device
        enc = tok(
            prompts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_prompt_length,
            add_special_tokens=False,
        )
        unique_ids, unique_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        prompt_ids = unique_ids.repeat_interleave(k, dim=0)
        prompt_mask = unique_mask.repeat_interleave(k, dim=0)
        # Every uniform a prompt's k rows will draw, from that prompt's own generator: a run (and a
        # resumed run) is reproducible, and a prompt's completions are the same however the batch
        # is split between ranks.
        uniforms = group_uniforms(generator_seed, first, len(prompts), k, self.max_new_tokens).to(device)
        was_training = self.model.training
        self.model.eval()
        try:
            # Inference mode skips autograd's per-op bookkeeping (version counters, view tracking),
            # a tenth of a small model's decode step; the ids leave it as a normal tensor (clone),
            # since the update's embedding lookup saves them for backward.
            with torch.inference_mode():
                completion_ids = self._sample(unique_ids, unique_mask, k, uniforms)
            completion_ids = completion_ids.clone()
        finally:
            self.model.train(was_training)
        completion_mask, truncated = completion_mask_from(completion_ids, self.eos_ids)
        completion_ids = torch.where(
            completion_mask.bool(), completion_ids, torch.full_like(completion_ids, tok.pad_token_id)
        )
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        if self.stop:
            texts = cut_at_stop(completion_ids, completion_mask, truncated, texts, tok, self.stop)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, k)

    def _sample(self, prompt_ids: Tensor, prompt_mask: Tensor, k: int, uniforms: Tensor) -> Tensor:
        """The sampling loop, lean: each prompt is prefilled once and its KV cache shared by its k
        samples; then one token a step for all ``B * k`` rows, sampled from ``softmax(logits / T)``
        (nucleus-filtered when ``top_p < 1``) with the step's row of ``uniforms`` (``(T, B * k)``),
        until every row has an EOS or ``max_new_tokens``. Stop strings are applied afterwards
        (``cut_at_stop``). Returns ``(B * k, T)`` token ids."""
        from transformers import DynamicCache

        model = self.model
        cache = DynamicCache(config=model.config)
        _preallocate(cache, prompt_ids.shape[1] + self.max_new_tokens)
        positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            **_cache_arg(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        cache.batch_repeat_interleave(k)
        logits = out.logits[:, -1, :].repeat_interleave(k, dim=0)
        attention = prompt_mask.repeat_interleave(k, dim=0)
        position = positions[:, -1:].repeat_interleave(k, dim=0) + 1
        eos = torch.tensor(self.eos_ids, device=prompt_ids.device)
        pad = self.tokenizer.pad_token_id
        done = torch.zeros(attention.shape[0], dtype=torch.bool, device=prompt_ids.device)
        tokens = []
        # The attention mask grows by one column a token: allocated once, sliced.
        p = attention.shape[1]
        attention = torch.cat([attention, torch.ones_like(attention[:, :1]).expand(-1, self.max_new_tokens)], dim=1)
        if _decode_mask_is_padding_only(model.config):
            # One query a step: its mask is the padding mask, given as SDPA's 4-D boolean mask, which
            # the model takes as is instead of rebuilding it at every step.
            attention = attention.bool()[:, None, None, :]
        # Diverged weights show from the first logits on: one check a rollout, not one a token.
        broken = torch.isnan(logits).any() | (~torch.isfinite(logits)).all(dim=-1).any()
        for t in range(self.max_new_tokens):
            token = sample(logits, self.temperature, self.top_p, uniforms[t])
            token = token.masked_fill_(done, pad)
            tokens.append(token)
            done = done | (token.unsqueeze(1) == eos).any(dim=1)
            if t + 1 == self.max_new_tokens or bool(done.all()):
                break
            out = model(
                input_ids=token.unsqueeze(1),
                attention_mask=attention[..., : p + t + 1],
                position_ids=position,
                **_cache_arg(model, cache),
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            position = position + 1
        if bool(broken):
            raise NonFiniteLogits(
                "the policy's logits are NaN (or all infinite) for some prompts: the weights have diverged. "
                "Lower learning_rate, or set precision to fp32"
            )
        return torch.stack(tokens, dim=1)


def _preallocate(cache: Any, capacity: int) -> None:
    """Give a ``DynamicCache`` of plain full-attention layers buffers of the final length: a decode
    step then writes one position and attends to a view of the filled part, where ``DynamicLayer``
    concatenates the whole past at every step (a third of a small model's decode time on the CPU).
    Any other cache layout is left as it is."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        cache.layers = [_PreallocatedLayer(capacity) for _ in layers]


def _preallocated_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """``DynamicLayer`` semantics (its mask sizes and length), written into buffers in place."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity, self.length = capacity, 0

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            n = key_states.shape[-2]
            if not self.is_initialized:
                self.device, self.is_initialized = key_states.device, True
                shape = (*key_states.shape[:2], max(self.capacity, n))
                self.key_buf = key_states.new_empty((*shape, key_states.shape[-1]))
                self.value_buf = value_states.new_empty((*shape, value_states.shape[-1]))
            if self.length + n > self.key_buf.shape[-2]:
                raise RuntimeError(f"KV cache full: {self.length} + {n} > {self.key_buf.shape[-2]}")
            self.key_buf[:, :, self.length : self.length + n] = key_states
            self.value_buf[:, :, self.length : self.length + n] = value_states
            self.length += n
            self.keys = self.key_buf[:, :, : self.length]
            self.values = self.value_buf[:, :, : self.length]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def _unsupported(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("the rollout's preallocated KV cache only grows (and repeats its batch)")

        crop = batch_select_indices = reset = offload = prefetch = _unsupported

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buf = self.key_buf.repeat_interleave(repeats, dim=0)
                self.value_buf = self.value_buf.repeat_interleave(repeats, dim=0)
                self.keys = self.key_buf[:, :, : self.length]
                self.values = self.value_buf[:, :, : self.length]

    return PreallocatedLayer


def _PreallocatedLayer(capacity: int) -> Any:  # noqa: N802 - a class, built on first use (transformers is lazy)
    global _PREALLOCATED
    if _PREALLOCATED is None:
        _PREALLOCATED = _preallocated_layer_class()
    return _PREALLOCATED(capacity)


_PREALLOCATED: type | None = None


def _decode_mask_is_padding_only(config: Any) -> bool:
    """Whether a decode step's attention mask is just the padding mask: SDPA attention, and every
    layer attends to the whole past (no sliding window, chunked or linear attention layers)."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or all(t == "full_attention" for t in layer_types)


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

"""The transformers rollout backend: the policy itself samples, a prompt's k completions decoded
from one prompt encoding, into a preallocated cache, with the sampling math of ``base``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from worker.engine.rollout.base import (
    NonFiniteLogits,
    Rollout,
    Sampling,
    _cache_arg,
    _eos_ids,
    completion_mask_from,
    cut_at_stop,
    group_uniforms,
    row_uniforms,
    sample,
)


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

    def generate(self, prompts: list[str], *, k: int, generator_seed: int, first: int = 0) -> Rollout:
        enc = self.tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_prompt_length,
            add_special_tokens=False,
        )
        # Every uniform a prompt's k rows will draw, from that prompt's own generator: a run (and a
        # resumed run) is reproducible, and a prompt's completions are the same however the batch
        # is split between ranks.
        uniforms = group_uniforms(generator_seed, first, len(prompts), k, self.max_new_tokens)
        return self._generate(enc["input_ids"], enc["attention_mask"], k, uniforms)

    def generate_ids(
        self, prompt_ids: list[list[int]], *, generator_seed: int, rows: list[int], max_new_tokens: int | None = None
    ) -> Rollout:
        """One completion of each prompt given as token ids (a multi-turn rollout's context, which
        is never re-tokenized): prompt ``b``'s drawn from ``group_seed(generator_seed, rows[b])``, at
        most ``max_new_tokens`` (the sampling's, or fewer) new tokens."""
        enc = self.tokenizer.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt")
        steps = min(self.max_new_tokens, max_new_tokens or self.max_new_tokens)
        uniforms = row_uniforms(generator_seed, rows, steps)
        return self._generate(enc["input_ids"], enc["attention_mask"], 1, uniforms)

    @torch.no_grad()
    def _generate(self, ids: Tensor, attention: Tensor, k: int, uniforms: Tensor) -> Rollout:
        tok = self.tokenizer
        device = next(self.model.parameters()).device
        unique_ids, unique_mask = ids.to(device), attention.to(device)
        prompt_ids = unique_ids.repeat_interleave(k, dim=0)
        prompt_mask = unique_mask.repeat_interleave(k, dim=0)
        uniforms = uniforms.to(device)
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
        until every row has an EOS or the uniforms run out. Stop strings are applied afterwards
        (``cut_at_stop``). Returns ``(B * k, T)`` token ids."""
        from transformers import DynamicCache

        model = self.model
        cache = DynamicCache(config=model.config)
        steps = uniforms.shape[0]
        _preallocate(cache, prompt_ids.shape[1] + steps)
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
        attention = torch.cat([attention, torch.ones_like(attention[:, :1]).expand(-1, steps)], dim=1)
        if _decode_mask_is_padding_only(model.config):
            # One query a step: its mask is the padding mask, given as SDPA's 4-D boolean mask, which
            # the model takes as is instead of rebuilding it at every step.
            attention = attention.bool()[:, None, None, :]
        # Diverged weights show from the first logits on: one check a rollout, not one a token.
        broken = torch.isnan(logits).any() | (~torch.isfinite(logits)).all(dim=-1).any()
        for t in range(steps):
            token = sample(logits, self.temperature, self.top_p, uniforms[t])
            token = token.masked_fill_(done, pad)
            tokens.append(token)
            done = done | (token.unsqueeze(1) == eos).any(dim=1)
            if t + 1 == steps or bool(done.all()):
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

"""Rollouts: k sampled completions per prompt, and the token log-probs of completions.

Layout is prompt-major: completion ``b * k + i`` is completion ``i`` of prompt ``b``, so a
``(B * k,)`` vector reshapes to RLOO's ``(B, k)``.
Sequences are ``[left-padded prompt | completion, right-padded]``: the completion always starts
at column ``P`` (the padded prompt width), which keeps log-prob slicing a plain slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


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

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def rows(self, rows: slice) -> Rollout:
        """The completions ``rows`` (a micro-batch)."""
        return Rollout(
            self.prompt_ids[rows],
            self.prompt_mask[rows],
            self.completion_ids[rows],
            self.completion_mask[rows],
            self.truncated[rows],
            self.texts[rows],
        )


class RolloutBackend(Protocol):
    """Generates completions; ``transformers`` here, vLLM where it is installed (later)."""

    def generate(self, prompts: list[str], *, k: int, generator_seed: int) -> Rollout: ...


class TransformersBackend:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        max_prompt_length: int,
        stop: list[str] | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stop = list(stop or [])
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.max_prompt_length = max_prompt_length
        self.eos_ids = _eos_ids(model, tokenizer)

    # no_grad, not inference_mode: the sampled ids feed the (autograd-tracked) update.
    @torch.no_grad()
    def generate(self, prompts: list[str], *, k: int, generator_seed: int) -> Rollout:
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
        # Sampling draws from torch's global generator; seeding it per step makes a run (and a
        # resumed run) reproducible on the CPU.
        torch.manual_seed(generator_seed)
        was_training = self.model.training
        self.model.eval()
        try:
            completion_ids = self._sample(unique_ids, unique_mask, k)
        finally:
            self.model.train(was_training)
        completion_mask, truncated = completion_mask_from(completion_ids, self.eos_ids)
        completion_ids = torch.where(
            completion_mask.bool(), completion_ids, torch.full_like(completion_ids, tok.pad_token_id)
        )
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        if self.stop:
            texts = cut_at_stop(completion_ids, completion_mask, truncated, texts, tok, self.stop)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts)


    def _sample(self, prompt_ids: Tensor, prompt_mask: Tensor, k: int) -> Tensor:
        """The sampling loop, lean: each prompt is prefilled once and its KV cache shared by its k
        samples; then one token a step for all ``B * k`` rows, sampled from ``softmax(logits / T)``
        (nucleus-filtered when ``top_p < 1``), until every row has an EOS or ``max_new_tokens``.
        Stop strings are applied afterwards (``cut_at_stop``). Returns ``(B * k, T)`` token ids."""
        from transformers import DynamicCache

        model = self.model
        cache = DynamicCache(config=model.config)
        positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            past_key_values=cache,
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
        for t in range(self.max_new_tokens):
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            if self.top_p < 1.0:
                probs = _nucleus(probs, self.top_p)
            token = torch.multinomial(probs, 1).squeeze(1)
            token = torch.where(done, torch.full_like(token, pad), token)
            tokens.append(token)
            done = done | torch.isin(token, eos)
            if t + 1 == self.max_new_tokens or bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = model(
                input_ids=token.unsqueeze(1),
                attention_mask=attention,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            position = position + 1
        return torch.stack(tokens, dim=1)


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
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

    Only the last ``T + 1`` positions go through the LM head (``logits_to_keep``): prompt
    positions never cost a vocabulary-sized matmul.
    """
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask
    # Left padding: positions count real tokens only, as generate() numbered them.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    t = rollout.completion_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=t + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float() / temperature  # position j predicts token j + 1
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy

"""A reward model's scores of a step's completions, each prompt's shared part read once.

A step's rows come in groups: the k completions of one prompt. What a reward model reads of a row is
the group's prefix (the prompt, or its chat template's rendering up to the assistant's answer), the
completion, and a suffix (the template's end of turn). ``split_rows`` renders each group's text once
with a placeholder answer and cuts it there; each row's text is then its group's prefix, its
completion and the suffix, tokenized whole and cut after the prefix's tokens (a row whose tokens do
not begin with them, a merge across the cut, sends the batch back to whole texts).
Where the reward model shares the policy's tokenizer, ``sampled_rows`` takes each row's completion
tokens as the policy sampled them instead of encoding its text again. ``prefix_logits`` then runs
the model's body once over each group's prefix, repeats its keys and values for the group's rows,
runs the rows after it, and reads each row's last token through the head, as the model's own
forward reads the whole text: for k = 4 and prompts of most of a row's
tokens, a half or less of the FLOPs of one batched forward over every row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

PLACEHOLDER = "\x00RLOO-ANSWER\x00"
"""The answer a group's text is rendered with, to be cut there (never in a real completion)."""


@dataclass(frozen=True)
class Split:
    """A batch's rows as group prefixes and each row's own tokens after them."""

    prefixes: list[list[int]]
    """Per group, the prefix's token ids."""
    rows: list[list[int]]
    """Per row, its tokens after its group's prefix (the completion, then the suffix)."""
    group_of: list[int]
    """Per row, its group."""


@dataclass(frozen=True)
class SampledTokens:
    """A batch's completions as the policy sampled them: per row its tokens (special tokens
    dropped), and the digest of the tokenizer that reads them (``tokenizer_fingerprint``)."""

    tokenizer: str | None
    ids: list[list[int]]


def tokenizer_fingerprint(tok: Any) -> str | None:
    """A digest of everything a fast tokenizer does to a text (vocabulary, merges, normalisation,
    added and special tokens), not of the padding and truncation its last call left set: two
    tokenizers with one digest turn a text into the same ids. None for a slow one."""
    import hashlib
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    spec.pop("padding", None)
    spec.pop("truncation", None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def groups(prompts: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per row, the index of its group: consecutive rows of one prompt and item (the step's layout,
    prompt-major)."""
    out: list[int] = []
    for i in range(len(prompts)):
        same = i > 0 and prompts[i] == prompts[i - 1] and (items[i] is items[i - 1] or items[i] == items[i - 1])
        out.append(out[-1] if same else (out[-1] + 1 if out else 0))
    return out


def first_rows(group_of: Sequence[int]) -> list[int]:
    """Each group's first row (``groups``' groups are numbered 0, 1, … in row order)."""
    return [row for row, g in enumerate(group_of) if row == 0 or g != group_of[row - 1]]


def split_rows(
    tok: Any,
    *,
    prefix_texts: list[str],
    suffix_texts: list[str],
    completions: Sequence[str],
    group_of: list[int],
    add_special_tokens: bool,
    max_length: int,
) -> Split | None:
    """The rows as ``Split``: each row's whole text (its group's prefix, its completion, the suffix)
    tokenized as the model would read it, then cut after its group's prefix tokens. None when a row's
    tokens do not begin with them (a merge across the cut) or a row is longer than ``max_length``:
    the caller then reads whole texts."""
    prefixes = tok(prefix_texts, add_special_tokens=add_special_tokens)["input_ids"]
    wholes = tok(
        [prefix_texts[g] + text + suffix_texts[g] for text, g in zip(completions, group_of, strict=True)],
        add_special_tokens=add_special_tokens,
    )["input_ids"]
    rows = []
    for ids, g in zip(wholes, group_of, strict=True):
        prefix = prefixes[g]
        if len(ids) > max_length or ids[: len(prefix)] != prefix:
            return None
        rows.append(ids[len(prefix) :])
    return Split(prefixes, rows, group_of)


def sampled_rows(
    tok: Any,
    *,
    prefix_texts: list[str],
    suffix_texts: list[str],
    sampled: Sequence[Sequence[int]],
    completions: Sequence[str],
    group_of: list[int],
    add_special_tokens: bool,
    max_length: int,
    vocab: int,
) -> Split | None:
    """The rows as ``Split`` from the tokens the policy sampled (``sampled``, special tokens dropped;
    ``tok`` is the policy's tokenizer): each group's prefix tokenized once, each row its sampled
    completion tokens and the suffix's. The reward model so reads what the policy wrote, token for
    token, where a re-encoding of its text may differ (a sampled sequence that is not its text's
    canonical encoding, a merge across the cut).

    A group's suffix is tokenized where it stands, after its first row's completion (a tokenizer
    that marks the start of a text, as SentencePiece's does, would tokenize it otherwise alone). A
    row whose tokens do not decode to its text (a completion cut at a stop string) or that holds
    an id past the reward model's ``vocab`` (a policy whose vocabulary is padded) is encoded from
    its text. None where the tokenizer ends a text with a token of its own, a group's text does not
    split at its completion, or a row is longer than ``max_length``: the caller then reads texts."""
    if add_special_tokens and _appends_special_tokens(tok):
        return None
    prefixes = tok(prefix_texts, add_special_tokens=add_special_tokens)["input_ids"]
    suffixes = _suffixes_in_place(tok, prefixes, prefix_texts, suffix_texts, completions, group_of, add_special_tokens)
    if suffixes is None:
        return None
    decoded = tok.batch_decode([list(ids) for ids in sampled])
    rows = []
    for ids, text, back, g in zip(sampled, completions, decoded, group_of, strict=True):
        readable = back == text and all(0 <= i < vocab for i in ids)
        own = list(ids) if readable else tok(text, add_special_tokens=False)["input_ids"]
        row = own + suffixes[g]
        if len(prefixes[g]) + len(row) > max_length:
            return None
        rows.append(row)
    return Split(prefixes, rows, group_of)


def _suffixes_in_place(
    tok: Any,
    prefixes: list[list[int]],
    prefix_texts: list[str],
    suffix_texts: list[str],
    completions: Sequence[str],
    group_of: list[int],
    add_special_tokens: bool,
) -> list[list[int]] | None:
    """Each group's suffix tokens as its whole text has them after its first row's completion; None
    where that text's tokens are not the prefix's, the completion's and the suffix's one after the
    other."""
    firsts = first_rows(group_of)
    texts = [completions[r] for r in firsts]
    wholes = tok(
        [p + t + x for p, t, x in zip(prefix_texts, texts, suffix_texts, strict=True)],
        add_special_tokens=add_special_tokens,
    )["input_ids"]
    bodies = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for whole, prefix, body in zip(wholes, prefixes, bodies, strict=True):
        if whole[: len(prefix) + len(body)] != prefix + body:
            return None
        out.append(whole[len(prefix) + len(body) :])
    return out


def _appends_special_tokens(tok: Any) -> bool:
    """Whether the tokenizer ends an encoded text with a special token of its own (an EOS)."""
    ids = tok("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[-1] in set(tok.all_special_ids) and ids != tok("a", add_special_tokens=False)["input_ids"]


def prefix_logits(model: Any, split: Split, device: torch.device, max_rows: int) -> Tensor | None:
    """The model's logit per row (fp32, on the CPU), each group's prefix run once; in chunks of
    whole groups of at most ``max_rows`` rows (groups sorted by length, so chunks pad little). None
    for a model whose body and head this cannot tell apart (the caller runs it whole)."""
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None)
    if body is None or not isinstance(head, torch.nn.Linear):
        return None
    members: dict[int, list[int]] = {}
    for row, g in enumerate(split.group_of):
        members.setdefault(g, []).append(row)
    order = sorted(members, key=lambda g: len(split.prefixes[g]))
    chunks: list[list[int]] = [[]]
    for g in order:
        if chunks[-1] and sum(len(members[c]) for c in chunks[-1]) + len(members[g]) > max_rows:
            chunks.append([])
        chunks[-1].append(g)
    out = torch.empty(len(split.rows), dtype=torch.float32)
    for chunk in chunks:
        rows = [r for c in chunk for r in members[c]]
        out[rows] = _chunk_logits(body, head, split, chunk, members, device).float().cpu()
    return out


def _chunk_logits(
    body: Any, head: Any, split: Split, chunk: list[int], members: dict[int, list[int]], device: torch.device
) -> Tensor:
    from transformers import DynamicCache

    from worker.engine.rollout.base import _cache_arg

    pad = 0
    # Prefixes left-padded (their last tokens aligned), rows right-padded after them.
    width = max(len(split.prefixes[g]) for g in chunk)
    prefix_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    prefix_mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for i, g in enumerate(chunk):
        ids = split.prefixes[g]
        prefix_ids[i, width - len(ids) :] = torch.tensor(ids)
        prefix_mask[i, width - len(ids) :] = 1
    counts = torch.tensor([len(members[g]) for g in chunk])
    rows = [r for g in chunk for r in members[g]]
    tail = max(1, max(len(split.rows[r]) for r in rows))
    row_ids = torch.full((len(rows), tail), pad, dtype=torch.long)
    row_mask = torch.zeros((len(rows), tail), dtype=torch.long)
    for i, r in enumerate(rows):
        ids = split.rows[r]
        row_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        row_mask[i, : len(ids)] = 1
    prefix_ids, prefix_mask, row_ids, row_mask = (t.to(device) for t in (prefix_ids, prefix_mask, row_ids, row_mask))
    counts = counts.to(device)
    cache = DynamicCache(config=body.config)
    positions = (prefix_mask.cumsum(dim=1) - 1).clamp(min=0)
    cached = {**_cache_arg(body, cache), "use_cache": True}
    first = body(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=positions, **cached)
    first = first.last_hidden_state[:, -1]
    _repeat_cache(cache, counts)
    mask = torch.cat([prefix_mask.repeat_interleave(counts, dim=0), row_mask], dim=1)
    start = prefix_mask.sum(dim=1).repeat_interleave(counts)
    row_positions = start.unsqueeze(1) + torch.arange(tail, device=device).unsqueeze(0)
    hidden = body(input_ids=row_ids, attention_mask=mask, position_ids=row_positions, **cached).last_hidden_state
    lengths = row_mask.sum(dim=1)
    last = hidden[torch.arange(len(rows), device=device), (lengths - 1).clamp(min=0)]
    # A row with no tokens of its own (an empty completion without a suffix) ends at its prefix.
    last = torch.where((lengths > 0).unsqueeze(1), last, first.repeat_interleave(counts, dim=0))
    scores: Tensor = head(last)[:, 0]
    return scores


def _repeat_cache(cache: Any, counts: Tensor) -> None:
    """Each group's keys and values repeated for its rows (``counts[g]`` of them)."""
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(counts, dim=0)
        layer.values = layer.values.repeat_interleave(counts, dim=0)

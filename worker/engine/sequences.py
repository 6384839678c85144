"""Supervised and preference examples as token sequences: OpenAI's chat lines rendered with the
model's chat template, and which tokens the loss reads.

A conversation is rendered turn by turn, so every token belongs to one message: an assistant
message's tokens (what its template writes for it, its end-of-turn token included) are learned when
its ``weight`` is 1 (the default); everything else (system, user and tool turns, the assistant's
header) is context only. The same rendering gives the prompt a reinforcement job's policy continues
(``worker.engine.data.prompt_text``), so what supervised teaches is what reinforcement samples from.

``batch_rows`` pads examples into rows, or packs several short ones into each row with their own
positions and a block-diagonal causal mask (an example attends only to itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from worker.engine.errors import JobError


def render(tokenizer: Any, messages: list[dict[str, Any]], *, tools: Any = None, generation: bool) -> str:
    """``messages`` as the model's chat template writes them (OpenAI's extra keys left out), with the
    assistant's header at the end when ``generation``. A tokenizer without a template gets plain
    ``role: content`` lines. ``worker.engine.data.prompt_text`` renders a reinforcement prompt with it."""
    clean = [_template_message(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        kwargs = {"tools": tools} if tools else {}
        return str(tokenizer.apply_chat_template(clean, add_generation_prompt=generation, tokenize=False, **kwargs))
    text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in clean)
    if generation:
        text += "\nassistant:"
    return text


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k != "weight"}
    if out.get("content") is None:
        out["content"] = ""
    return out


@dataclass(frozen=True)
class Example:
    """One tokenized example: ``ids`` and, aligned with them, 1 on the tokens the loss learns."""

    ids: list[int]
    learn: list[int]


def chat_example(tokenizer: Any, line: dict[str, Any], *, max_length: int) -> Example:
    """A supervised line (``messages``, optional ``tools``) as tokens, assistant tokens marked,
    cut to ``max_length`` (an example keeps its first tokens)."""
    messages, tools = line["messages"], line.get("tools")
    ids: list[int] = []
    learn: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            header = render(tokenizer, messages[:i], tools=tools, generation=True) if i else _bare_header(tokenizer)
            _extend(tokenizer, ids, learn, template_delta(header, done), learned=False)
            done = header
        full = render(tokenizer, messages[: i + 1], tools=tools, generation=False)
        text = template_delta(full, done)
        if m["role"] == "assistant" and not getattr(tokenizer, "chat_template", None):
            text += tokenizer.eos_token or ""  # without a template nothing ends the turn
        _extend(tokenizer, ids, learn, text, learned=m["role"] == "assistant" and m.get("weight", 1) == 1)
        done = full
    return Example(ids[:max_length], learn[:max_length])


def _bare_header(tokenizer: Any) -> str:
    return render(tokenizer, [], generation=True) if getattr(tokenizer, "chat_template", None) else "assistant:"


def template_delta(full: str, done: str) -> str:
    """What ``full`` adds to ``done``: templates write a conversation's prefix as that prefix. One
    that does not (it moves the system prompt into the last user turn, say) cannot say which tokens
    are whose: the job fails saying so, rather than learning the conversation twice."""
    if not full.startswith(done):
        raise JobError(
            "unsupported_chat_template",
            "the model's chat template does not write a conversation's first turns as it writes them "
            "alone, so the tokens of each turn cannot be told apart; use a model whose template does",
        )
    return full[len(done) :]


def _extend(tokenizer: Any, ids: list[int], learn: list[int], text: str, *, learned: bool) -> None:
    if text:
        new = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(new)
        learn.extend([int(learned)] * len(new))


def preference_texts(tokenizer: Any, line: dict[str, Any]) -> tuple[str, str, str]:
    """A DPO line as ``(prompt, preferred, non_preferred)`` text: the prompt with the assistant's
    header, each output as the template writes an assistant turn after it (end of turn included)."""
    messages, tools = line["input"]["messages"], line["input"].get("tools")
    prompt = render(tokenizer, messages, tools=tools, generation=True)

    def output(key: str) -> str:
        full = render(tokenizer, messages + line[key], tools=tools, generation=False)
        text = template_delta(full, prompt)
        return text if getattr(tokenizer, "chat_template", None) else " " + text.lstrip() + (tokenizer.eos_token or "")

    return prompt, output("preferred_output"), output("non_preferred_output")


@dataclass
class Rows:
    """A micro-batch of examples as model inputs. ``targets`` and ``learn`` are shifted: position
    ``j`` predicts ``ids[j + 1]``."""

    ids: Tensor
    """(R, L) token ids (padding: the pad id)."""
    attention: Tensor
    """(R, L) 1 on real tokens, or (R, 1, L, L) a packed row's block-diagonal causal mask."""
    positions: Tensor
    """(R, L) each token's position in its own example."""
    targets: Tensor
    """(R, L - 1) the next token of each position."""
    learn: Tensor
    """(R, L - 1) 1 where the next token is one the loss learns."""


def batch_rows(examples: list[Example], *, pad_id: int, pack_to: int | None, device: torch.device) -> Rows:
    """``examples`` as rows: one each, right-padded; or, with ``pack_to``, as few rows of at most
    ``pack_to`` tokens as first-fit packing in order gives."""
    rows: list[list[Example]] = []
    if pack_to:
        for ex in examples:
            for row in rows:
                if sum(len(e.ids) for e in row) + len(ex.ids) <= pack_to:
                    row.append(ex)
                    break
            else:
                rows.append([ex])
    else:
        rows = [[ex] for ex in examples]
    width = max(sum(len(e.ids) for e in row) for row in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    learn = torch.zeros((n, width), dtype=torch.float32)
    positions = torch.zeros((n, width), dtype=torch.long)
    segment = torch.full((n, width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row):
            end = at + len(ex.ids)
            ids[r, at:end] = torch.tensor(ex.ids)
            learn[r, at:end] = torch.tensor(ex.learn, dtype=torch.float32)
            positions[r, at:end] = torch.arange(len(ex.ids))
            segment[r, at:end] = s
            at = end
    # Position j predicts token j + 1, which counts only inside the same example.
    same = (segment[:, 1:] == segment[:, :-1]) & (segment[:, 1:] >= 0)
    target_learn = learn[:, 1:] * same
    if pack_to:
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
        attention = (causal & (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0))[:, None]
        # Padding rows attend to themselves, so no softmax row is empty.
        attention = attention | torch.eye(width, dtype=torch.bool)[None, None]
    else:
        attention = (segment >= 0).long()
    return Rows(
        ids.to(device), attention.to(device), positions.to(device), ids[:, 1:].to(device), target_learn.to(device)
    )


def token_logprobs(model: Any, rows: Rows) -> tuple[Tensor, Tensor]:
    """Log-probs ``(R, L - 1)`` of each next token under ``model``, and whether it was the model's
    most likely token (for ``mean_token_accuracy``)."""
    attention = _model_mask(model, rows.attention) if rows.attention.dim() == 4 else rows.attention
    out = model(input_ids=rows.ids, attention_mask=attention, position_ids=rows.positions, use_cache=False)
    logits = out.logits[:, :-1, :].float()
    logp = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows.targets, reduction="none")
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == rows.targets).float()
    return logp, correct


def _model_mask(model: Any, allowed: Tensor) -> Tensor:
    """A packed row's ``(R, 1, L, L)`` mask as the model's attention reads a 4D mask: SDPA takes it
    as booleans; eager attention adds it to the scores, so there it is 0 where allowed and the
    dtype's minimum elsewhere (a boolean would add 1 and 0, masking nothing)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    raise ValueError(f"packing needs sdpa or eager attention; this model uses {implementation!r}: set packing to false")

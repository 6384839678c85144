"""Prompt datasets: JSONL lines to prompt text, and a seeded, resumable order of batches."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from worker.engine.sequences import render


def load_items(path: Path) -> list[dict[str, Any]]:
    """The lines of a JSONL file as the upload validated them (``service.files.upload_sweep``): a UTF-8
    byte-order mark at the start ignored, lines ended by "\\n" only (a lone "\\r" is JSON whitespace
    inside a line, not a line end), blank lines skipped."""
    with open(path, encoding="utf-8-sig", newline="\n") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_text(item: dict[str, Any], tokenizer: Any) -> str:
    """The text the policy continues: ``prompt``, or ``messages`` (and ``tools``) rendered as
    supervised training renders them, the assistant's header at the end (``worker.engine.sequences``)."""
    if "prompt" in item and "messages" not in item:
        return str(item["prompt"])
    return render(tokenizer, item["messages"], tools=item.get("tools"), generation=True)


def batch_indices(*, n_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Dataset indices of step ``step`` (0-based).

    The data is an endless sequence of epochs, each a permutation seeded by ``(seed, epoch)``;
    step ``s`` takes positions ``s*B .. s*B+B-1``. A function of the step alone, so a resumed run
    reads exactly the batches an uninterrupted one would have.
    """
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(pos, n_items)
        out.append(_permutation(n_items, seed, epoch)[offset])
    return out


@lru_cache(maxsize=4)
def _permutation(n_items: int, seed: int, epoch: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n_items, generator=g).tolist())

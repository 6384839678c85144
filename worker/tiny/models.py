"""Tiny language models built offline, on the spot.

Tests, the demo and benchmarks need a policy and a reward model that exist
without any download.  This module trains a byte-level BPE tokenizer on a small
corpus (``worker.tiny.tokenizer``), builds a Llama-style causal LM and a Llama sequence-classification
reward model with random (seeded) weights, and saves both with
``save_pretrained`` so that they load through exactly the same
``AutoTokenizer`` / ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification.from_pretrained`` path that real models
take.

Every build writes into a temporary sibling directory and renames it into
place, so an interrupted build never leaves a half-written model behind, and
builds are idempotent: if ``path/config.json`` already exists nothing is done
unless ``overwrite=True``.

Token conventions (shared by policy and reward model):

* ids 0..5 are the special tokens ``<|pad|>``, ``<|bos|>``, ``<|eos|>``,
  ``<|system|>``, ``<|user|>``, ``<|assistant|>``;
* the tokenizer adds no special tokens on its own (no automatic BOS/EOS);
* the chat template renders ``<|role|>content<|eos|>`` per message, and the
  generation prompt is ``<|assistant|>``, so an assistant turn ends with the
  ordinary EOS token and generation stops on ``eos_token_id``;
* padding and truncation are on the left (batched generation needs left
  padding; left truncation keeps the end of a prompt or completion).

Run ``python -m worker.tiny.models DIR`` to build ``DIR/tiny-policy`` and ``DIR/tiny-reward`` (the
reward model fitted to prefer texts containing a keyword), the models the examples name.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from worker.tiny.tokenizer import (
    ADJECTIVES,
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    CHAT_TEMPLATE,
    DEMO_CORPUS,
    EOS_TOKEN,
    NOUNS,
    PAD_TOKEN,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    SYSTEM_TOKEN,
    USER_TOKEN,
    VERBS,
    _demo_corpus,
    build_tokenizer,
)

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DEMO_CORPUS",
    "EOS_TOKEN",
    "FIT_RECORD",
    "PAD_TOKEN",
    "ROLE_TOKENS",
    "SPECIAL_TOKENS",
    "SYSTEM_TOKEN",
    "USER_TOKEN",
    "RewardFit",
    "build_tiny_causal_lm",
    "build_tiny_reward_model",
    "build_tokenizer",
    "main",
    "make_keyword_reward_data",
    "train_tiny_reward_model",
]


# --------------------------------------------------------------------------
# Atomic directory writes
# --------------------------------------------------------------------------


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file()


def _tmp_sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _atomic_write_dir(path: Path, write: Callable[[Path], None], *, overwrite: bool) -> Path:
    """Call ``write(tmp)`` on a fresh temporary sibling, then rename it to ``path``.

    If another process finishes the same ``path`` first (and ``overwrite`` is
    false) its result is kept and ours is discarded.  With ``overwrite`` the old
    directory is moved aside, replaced, then deleted.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path, "tmp")
    tmp.mkdir()
    try:
        write(tmp)
        if overwrite and path.exists():
            old = _tmp_sibling(path, "old")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, path)  # succeeds onto a missing or empty dir
            except OSError:
                if _is_built(path):  # lost a race to a concurrent builder
                    return path
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _check_target(path: Path, overwrite: bool) -> bool:
    """True if ``path`` already holds a model and should be returned as is."""
    if _is_built(path) and not overwrite:
        return True
    if not overwrite and path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists but holds no config.json; pass overwrite=True to replace it")
    return False


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def _llama_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int | None,
    max_position_embeddings: int,
    **extra: Any,
) -> LlamaConfig:
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def _load_or_build_tokenizer(
    tokenizer_from: str | os.PathLike[str] | None,
    corpus: Iterable[str] | None,
    vocab_size: int,
    max_position_embeddings: int,
) -> PreTrainedTokenizerFast:
    if tokenizer_from is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
        if not isinstance(tok, PreTrainedTokenizerFast):
            raise TypeError(f"tokenizer at {tokenizer_from} is not a fast tokenizer: {type(tok).__name__}")
        if tok.pad_token_id is None:
            raise ValueError(f"tokenizer at {tokenizer_from} has no pad token")
        tok.padding_side = "left"
        return tok
    return build_tokenizer(
        DEMO_CORPUS if corpus is None else corpus,
        vocab_size=vocab_size,
        model_max_length=max_position_embeddings,
    )


def build_tiny_causal_lm(
    path: str | os.PathLike[str],
    *,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Build a random Llama-style causal LM (+ tokenizer) and save it at ``path``.

    ``corpus`` defaults to :data:`DEMO_CORPUS`; ``intermediate_size`` to
    ``4 * hidden_size``.  Weights come from ``torch.manual_seed(seed)`` (the
    global RNG state is restored afterwards); embeddings are tied.
    """
    path = Path(path)
    if _check_target(path, overwrite):
        return path

    tokenizer = build_tokenizer(
        DEMO_CORPUS if corpus is None else corpus,
        vocab_size=vocab_size,
        model_max_length=max_position_embeddings,
    )
    config = _llama_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _atomic_write_dir(path, write, overwrite=overwrite)


def build_tiny_reward_model(
    path: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 1,
    overwrite: bool = False,
) -> Path:
    """Build a random ``LlamaForSequenceClassification`` reward model (1 label).

    With ``tokenizer_from`` (e.g. the policy directory) the reward model uses
    that exact tokenizer; otherwise one is trained on ``corpus`` (default
    :data:`DEMO_CORPUS`).  ``pad_token_id`` is set so the head reads the last
    non-pad token.
    """
    path = Path(path)
    if _check_target(path, overwrite):
        return path

    tokenizer = _load_or_build_tokenizer(tokenizer_from, corpus, vocab_size, max_position_embeddings)
    config = _llama_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        num_labels=1,
        problem_type="regression",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _atomic_write_dir(path, write, overwrite=overwrite)


# --------------------------------------------------------------------------
# Reward model fitting
# --------------------------------------------------------------------------


FIT_RECORD = "tiny_reward_fit.json"  # written next to a fitted reward model


@dataclass(frozen=True)
class RewardFit:
    """Outcome of :func:`train_tiny_reward_model` (losses are MSE on the training set)."""

    path: Path
    steps: int
    initial_loss: float
    final_loss: float
    seconds: float


def _chat_text(prompt: str, completion: str, *, closed: bool) -> str:
    """``prompt``/``completion`` rendered as :data:`CHAT_TEMPLATE` renders them."""
    return f"{USER_TOKEN}{prompt}{EOS_TOKEN}{ASSISTANT_TOKEN}{completion}" + (EOS_TOKEN if closed else "")


def _noise(rng: random.Random) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!'-"
    fragments = [w[: rng.randint(1, len(w))] for w in NOUNS + VERBS + ADJECTIVES]
    if rng.random() < 0.5:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 50)))
    separators = ["", "", " ", ".", ","]
    return "".join(rng.choice(fragments) + rng.choice(separators) for _ in range(rng.randint(2, 14)))


def make_keyword_reward_data(
    keyword: str = "happy",
    *,
    n: int = 384,
    seed: int = 0,
) -> tuple[list[str], list[float]]:
    """Texts labelled 1.0 if they contain ``keyword``, else 0.0.

    Content: ~40% demo sentences with ``keyword`` spliced in, ~35% sentences
    without it, ~15% noise (random characters or word fragments, as a random
    policy writes) without it and ~10% noise with it.  Each text is either
    plain or a chat transcript ``<|user|>prompt<|eos|><|assistant|>text`` with
    or without the closing ``<|eos|>`` (prompts never hold the keyword), so a
    reward model fitted on it scores policy rollouts sensibly.
    """
    rng = random.Random(seed)

    def has_kw(s: str) -> bool:
        return keyword.lower() in s.lower()

    plain = [s for s in _demo_corpus(n=2 * n, seed=seed + 99) if not has_kw(s)]
    texts: list[str] = []
    labels: list[float] = []
    for i in range(n):
        kind = i % 20
        if kind < 8:
            words = rng.choice(plain).split()
            words.insert(rng.randrange(len(words) + 1), keyword)
            body = " ".join(words)
        elif kind < 15:
            body = rng.choice(plain)
        else:
            body = _noise(rng)
            while has_kw(body):
                body = _noise(rng)
            if kind >= 18:
                cut = rng.randint(0, len(body))
                body = body[:cut] + rng.choice(["", " "]) + keyword + rng.choice(["", " "]) + body[cut:]
        fmt = rng.randrange(3)
        text = body if fmt == 0 else _chat_text(rng.choice(plain), body, closed=fmt == 2)
        texts.append(text)
        labels.append(1.0 if has_kw(body) else 0.0)
    order = list(range(n))
    rng.shuffle(order)
    return [texts[i] for i in order], [labels[i] for i in order]


def train_tiny_reward_model(
    path: str | os.PathLike[str],
    texts: Sequence[str],
    labels: Sequence[float],
    *,
    steps: int = 200,
    lr: float = 3e-3,
    batch_size: int = 32,
    max_length: int = 64,
    seed: int = 0,
    num_threads: int | None = 1,
) -> RewardFit:
    """Fit the reward model at ``path`` to (text, score) pairs with MSE, on the CPU.

    Texts are tokenized as is (left padding, left truncation to
    ``max_length``), exactly as a scorer would.  The fitted model replaces the
    one at ``path`` (temp + rename; tokenizer files are copied unchanged) and a
    :data:`FIT_RECORD` json is written next to it.

    ``num_threads`` (default 1) sets torch's intra-op threads for the duration
    of the call (restored afterwards; ``None`` leaves them alone).  The model is
    so small that thread synchronisation dominates: one thread is about as fast
    as two on an idle 2-core machine and several times faster on a busy one.
    384 texts x 200 steps take ~7-10 s on one core.
    """
    path = Path(path)
    if len(texts) != len(labels) or not texts:
        raise ValueError("texts and labels must be non-empty and of equal length")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    model = AutoModelForSequenceClassification.from_pretrained(str(path))
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    y = torch.tensor([float(v) for v in labels], dtype=torch.float32)
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        initial = _mse(model, ids, mask, y)
        _fit(model, ids, mask, y, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
        final = _mse(model, ids, mask, y)
    finally:
        torch.set_num_threads(old_threads)

    fit = RewardFit(path, steps, initial, final, time.perf_counter() - t0)

    def write(tmp: Path) -> None:
        # Copy the tokenizer files byte for byte: re-saving the tokenizer object would
        # persist the padding/truncation state set by the batch encoding above.
        skip = {"config.json", "generation_config.json", FIT_RECORD}
        for f in path.iterdir():
            if f.is_file() and f.name not in skip and not f.name.startswith("model"):
                shutil.copy2(f, tmp / f.name)
        model.save_pretrained(tmp)
        record = {"steps": steps, "lr": lr, "n_texts": len(texts), "initial_mse": initial, "final_mse": final}
        (tmp / FIT_RECORD).write_text(json.dumps(record, indent=2) + "\n")

    _atomic_write_dir(path, write, overwrite=True)
    return fit


def _mse(model: Any, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> float:
    """The model's mean squared error over every text, in batches of 256."""
    model.eval()
    with torch.no_grad():
        preds = torch.cat(
            [
                model(input_ids=ids[i : i + 256], attention_mask=mask[i : i + 256]).logits.squeeze(-1)
                for i in range(0, len(y), 256)
            ]
        )
    return float(torch.nn.functional.mse_loss(preds, y))


def _fit(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
) -> None:
    """``steps`` of AdamW on random minibatches (a 10-step warm-up, then linear decay to zero),
    torch's global random state left as it was."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            idx = torch.randint(len(y), (min(batch_size, len(y)),), generator=gen)
            m = mask[idx]
            keep = m.any(0)  # drop columns that are padding for the whole minibatch
            out = model(input_ids=ids[idx][:, keep], attention_mask=m[:, keep])
            loss = torch.nn.functional.mse_loss(out.logits.squeeze(-1), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _dir_report(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


POLICY_NAME, REWARD_NAME = "tiny-policy", "tiny-reward"
"""The directories the examples name (``model``, a ``reward_model`` grader's ``model``)."""


def layout(root: Path) -> tuple[Path, Path]:
    """Where ``main`` and ``rloo demo`` build the policy and the reward model under a models root."""
    return root / POLICY_NAME, root / REWARD_NAME


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker.tiny.models DIR [KEYWORD]``: build DIR/tiny-policy and DIR/tiny-reward, the
    models the examples name (the reward model trained to like KEYWORD)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print("usage: python -m worker.tiny.models DIR [KEYWORD]", file=sys.stderr)
        return 2
    root = Path(args[0])
    keyword = args[1] if len(args) > 1 else "happy"
    report: dict[str, object] = {}

    policy, reward = layout(root)
    t0 = time.perf_counter()
    build_tiny_causal_lm(policy)
    seconds = round(time.perf_counter() - t0, 3)
    report["policy"] = {"path": str(policy), "seconds": seconds, "files": _dir_report(policy)}

    t0 = time.perf_counter()
    build_tiny_reward_model(reward, tokenizer_from=policy)
    fresh = not (reward / FIT_RECORD).exists()
    entry: dict[str, object] = {"path": str(reward), "build_seconds": round(time.perf_counter() - t0, 3)}
    if fresh:
        texts, labels = make_keyword_reward_data(keyword)
        fit = train_tiny_reward_model(reward, texts, labels)
        entry.update(
            keyword=keyword,
            train_seconds=round(fit.seconds, 3),
            initial_mse=round(fit.initial_loss, 4),
            final_mse=round(fit.final_loss, 4),
        )
    entry["files"] = _dir_report(reward)
    report["reward"] = entry
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a model directory is, read from its files without loading a weight: its architecture and
head, its tokenizer, its chat template, its context length. Job creation (the policy, a grader's
reward and judge models), evaluations and completions check a model against the use they put it to
here, so a directory that cannot serve that use is a 400 that says what is missing, not a job that
"succeeds" on a random head or fails with a reshape error an hour later.

A hub id (no directory) and an adapter-only directory are not inspected: the worker loads them."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.core.errors import Invalid

Head = Literal["causal_lm", "sequence_classification", "base", "unknown"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)
"""One of these beside the config is a tokenizer (fast, sentencepiece, BPE or WordPiece vocabularies)."""

FALLBACK_TEMPLATE = "user: {content}\nassistant:"
"""How the worker renders a conversation for a model without a chat template: each message as
``<role>: <content>`` on its own line, then ``assistant:`` (``worker.engine.sequences``)."""


@dataclass(frozen=True)
class ModelInfo:
    """A model directory as its files describe it."""

    architectures: tuple[str, ...]
    head: Head
    has_tokenizer: bool
    has_chat_template: bool
    context_length: int | None
    num_labels: int | None

    @property
    def uses(self) -> list[str]:
        """What it can be used for: ``policy`` (train, sample, judge), ``reward_model`` (a one-label
        sequence classifier), ``embedding`` (a base encoder)."""
        if not self.has_tokenizer:
            return []
        if self.head == "causal_lm":
            return ["policy"]
        if self.head == "sequence_classification":
            return ["reward_model"] if self.num_labels in (None, 1) else []
        return ["embedding"] if self.head == "base" else []

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else "no architecture in its config.json"


def head_of(architectures: tuple[str, ...]) -> Head:
    if not architectures:
        return "unknown"
    name = architectures[0]
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        return "causal_lm"
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    if name.endswith("Model") and "For" not in name:
        return "base"
    return "unknown"


def inspect_model(path: Path) -> ModelInfo | None:
    """The directory's ``ModelInfo``; None for what is not inspected (a hub id, an adapter alone, a
    config that cannot be read: the checks that found the directory say so)."""
    config = path / "config.json"
    try:
        stamp = config.stat().st_mtime_ns
    except OSError:
        return None
    return _inspect(path, stamp)


@functools.lru_cache(maxsize=256)
def _inspect(path: Path, stamp: int) -> ModelInfo | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    architectures = tuple(a for a in config.get("architectures") or () if isinstance(a, str))
    text = config.get("text_config", config)
    context = text.get("max_position_embeddings") if isinstance(text, dict) else None
    labels = config.get("num_labels", len(config["id2label"]) if isinstance(config.get("id2label"), dict) else None)
    return ModelInfo(
        architectures=architectures,
        head=head_of(architectures),
        has_tokenizer=any((path / name).is_file() for name in TOKENIZER_FILES),
        has_chat_template=_has_chat_template(path),
        context_length=context if isinstance(context, int) and context > 0 else None,
        num_labels=labels if isinstance(labels, int) else None,
    )


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        tokenizer_config: Any = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(tokenizer_config, dict) and bool(tokenizer_config.get("chat_template"))


def check_policy(path: Path | str, name: str, param: str) -> list[str]:
    """A model that a job trains, samples from or asks as a judge: a causal LM with a tokenizer, or
    a 400 that says what the directory is instead. Returns what a job's events should say (no chat
    template: the fallback rendering)."""
    info = inspect_model(path) if isinstance(path, Path) else None
    if info is None:
        return []
    if info.head == "sequence_classification":
        raise Invalid(
            f"Model '{name}' is a sequence classifier ({info.architecture}): it scores text, it does not "
            "write it. Name a causal language model here (its config's architectures end in ForCausalLM); "
            "a classifier serves as a reward_model grader's model.",
            param=param,
            code="invalid_model",
        )
    if info.head != "causal_lm":
        raise Invalid(
            f"Model '{name}' has no language-model head ({info.architecture}): it cannot write text. Name a "
            "causal language model here (its config's architectures end in ForCausalLM or LMHeadModel).",
            param=param,
            code="invalid_model",
        )
    _check_tokenizer(info, name, param)
    if info.has_chat_template:
        return []
    return [
        f"Model '{name}' has no chat template: conversations are rendered as '{FALLBACK_TEMPLATE}' (a line "
        "a message, then 'assistant:'). Add a chat_template to its tokenizer_config.json to use another."
    ]


def check_reward_model(path: Path | str, name: str, param: str) -> None:
    """A reward_model grader's model: a sequence classifier with one label and a tokenizer."""
    info = inspect_model(path) if isinstance(path, Path) else None
    if info is None:
        return
    if info.head != "sequence_classification":
        raise Invalid(
            f"Model '{name}' is not a sequence classifier ({info.architecture}); a reward_model grader reads "
            "one score from a classifier's head (architectures ending in ForSequenceClassification, one "
            "label). A causal language model judges as a score_model or label_model grader.",
            param=param,
            code="invalid_model",
        )
    if info.num_labels not in (None, 1):
        raise Invalid(
            f"Model '{name}' classifies into {info.num_labels} labels; a reward model gives one score "
            "(num_labels 1 in its config.json).",
            param=param,
            code="invalid_model",
        )
    _check_tokenizer(info, name, param)


def _check_tokenizer(info: ModelInfo, name: str, param: str) -> None:
    if not info.has_tokenizer:
        raise Invalid(
            f"Model '{name}' has no tokenizer: its directory holds none of {', '.join(TOKENIZER_FILES)}. Save "
            "the tokenizer beside the weights (tokenizer.save_pretrained(<the model's directory>)).",
            param=param,
            code="invalid_model",
        )

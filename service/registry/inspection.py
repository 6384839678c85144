"""What a model directory is, read from its files without loading a weight: its architecture and
head, its tokenizer, its chat template, its context length. Job creation (the policy, a grader's
reward and judge models), evaluations and completions check a model against the use they put it to
here, so a directory that cannot serve that use is a 400 that says what is missing, not a job that
"succeeds" on a random head or fails with a reshape error an hour later.

A hub id (no directory) and an adapter-only directory are not inspected: the worker loads them."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.core.errors import Invalid

Head = Literal["causal_lm", "sequence_classification", "base", "unknown", "unstated"]
"""``unstated``: the config names no architecture; transformers then loads the model by its
``model_type`` as whatever class is asked for, so the head is not checked."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "spm.model",
    "spm_char.model",
    "sentencepiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
    "tekken.json",
)
"""One of these beside the config is a tokenizer (fast, sentencepiece, BPE or WordPiece vocabularies,
Mistral's tekken); so is any ``*.tiktoken`` file."""

READ_FILES = frozenset({"config.json", "tokenizer_config.json", "chat_template.jinja", *TOKENIZER_FILES})
"""The files an inspection reads or looks for: it is read again when one of them is added, removed
or changed (its time or its size: an edit within one tick of a coarse file-system clock keeps the
time)."""

CACHED_MODELS = 2048
"""Inspections kept: more than the models ``/v1/models`` lists (1,000), so listing them all is read
from files once, not once a listing."""

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
    num_labels: int

    @property
    def uses(self) -> list[str]:
        """What it can be used for: ``policy`` (train, sample, judge), ``reward_model`` (a one-label
        sequence classifier), ``embedding`` (a base encoder)."""
        if not self.has_tokenizer:
            return []
        if self.head == "unstated":
            return ["policy", "reward_model"] if self.num_labels == 1 else ["policy"]
        if self.head == "causal_lm":
            return ["policy"]
        if self.head == "sequence_classification":
            return ["reward_model"] if self.num_labels == 1 else []
        return ["embedding"] if self.head == "base" else []

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else "no architecture in its config.json"


def head_of(architectures: tuple[str, ...]) -> Head:
    if not architectures:
        return "unstated"
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
    try:
        names = sorted(n for n in os.listdir(path) if n in READ_FILES or n.endswith(".tiktoken"))
        stamp = tuple((n, st.st_mtime_ns, st.st_size) for n in names for st in [os.stat(path / n)])
    except OSError:
        return None
    return _inspect(path, stamp) if "config.json" in names else None


def context_length(model: Path | str) -> int | None:
    """The context length of a model directory (``max_position_embeddings`` of its config, or of its
    ``text_config``), or None when it does not say (a hub id, a config without it)."""
    info = inspect_model(model) if isinstance(model, Path) else None
    return info.context_length if info is not None else None


@functools.lru_cache(maxsize=CACHED_MODELS)
def _inspect(path: Path, stamp: tuple[tuple[str, int, int], ...]) -> ModelInfo | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    architectures = tuple(a for a in config.get("architectures") or () if isinstance(a, str))
    text = config.get("text_config", config)
    context = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return ModelInfo(
        architectures=architectures,
        head=head_of(architectures),
        has_tokenizer=_has_tokenizer(path),
        has_chat_template=_has_chat_template(path),
        context_length=context if isinstance(context, int) and context > 0 else None,
        num_labels=_num_labels(config),
    )


def _num_labels(config: dict[str, Any]) -> int:
    """As transformers reads it: ``num_labels``, else ``id2label``'s size, else its default of 2."""
    labels = config.get("num_labels")
    if isinstance(labels, int):
        return labels
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else 2


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken"))


def _has_chat_template(path: Path) -> bool:
    """What a tokenizer loads a template from: ``chat_template.jinja`` or its config's
    ``chat_template`` (a ``chat_template.json`` is a processor's, which the worker does not load)."""
    if (path / "chat_template.jinja").is_file():
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
    if info.head not in ("causal_lm", "unstated"):
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
    if info.head not in ("sequence_classification", "unstated"):
        raise Invalid(
            f"Model '{name}' is not a sequence classifier ({info.architecture}); a reward_model grader reads "
            "one score from a classifier's head (architectures ending in ForSequenceClassification, one "
            "label). A causal language model judges as a score_model or label_model grader.",
            param=param,
            code="invalid_model",
        )
    if info.num_labels != 1:
        raise Invalid(
            f"Model '{name}' classifies into {info.num_labels} labels (its config.json's num_labels or id2label; "
            "2 where it says neither, as transformers reads it); a reward model gives one score: set num_labels "
            "to 1 in its config.json.",
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

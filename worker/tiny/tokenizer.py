"""The tiny models' tokenizer, trained offline on the spot: its special tokens and chat template,
the demo corpus it learns from, and ``build_tokenizer`` (``worker.tiny.models`` builds the models
around it; the conventions are described there).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
ROLE_TOKENS = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
# Order fixes the ids: pad=0, bos=1, eos=2, system=3, user=4, assistant=5.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    # Tools (OpenAI's function tools) are named in a system turn of their own; a call is written as
    # Hermes and Qwen write one, <tool_call>{"name": ..., "arguments": {...}}</tool_call>, and a tool's
    # result comes back in a user turn as <tool_response>...</tool_response> (docs/tools.md).
    "{% if tools %}{{ '<|system|>tools:' }}"
    "{% for tool in tools %}{{ ' ' + (tool.function.name if tool.function is defined else tool.name) }}{% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>' + message['content'] + '</tool_response>' + eos_token }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|assistant|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{% set f = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
    "{{ f.arguments if f.arguments is string else (f.arguments | tojson) }}{{ '}</tool_call>' }}"
    "{% endfor %}{{ eos_token }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


# --------------------------------------------------------------------------
# Demo corpus
# --------------------------------------------------------------------------


def _split(text: str, sep: str = " ") -> list[str]:
    return text.split(sep)


_NAMES = _split("Anna Ben Cleo Dan Eva Finn Gina Hugo Ivy Jack")
ADJECTIVES = _split(
    "big small red blue green happy sad quick slow old young warm cold bright quiet loud kind brave good tiny"
)
NOUNS = _split(
    "cat dog bird fish horse tree house river garden apple book ball car boat cake flower hill cloud friend teacher"
)
VERBS = _split("sees likes finds helps watches follows paints reads carries wants loves visits")
_PLACES = _split(
    "in the park|by the river|at home|near the school|on the hill|in the garden|at the market|under the tree",
    "|",
)
_TIMES = ["today", "in the morning", "at night", "every day", "after lunch", "on Sunday"]
_FEELINGS = ["happy", "tired", "hungry", "excited", "calm", "curious"]


def _demo_corpus(n: int = 400, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)

    def np_() -> str:
        return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"

    templates: list[Callable[[], str]] = [
        lambda: f"{np_().capitalize()} {rng.choice(VERBS)} {np_()} {rng.choice(_PLACES)}.",
        lambda: f"{rng.choice(_NAMES)} {rng.choice(VERBS)} {np_()} {rng.choice(_TIMES)}.",
        lambda: f"{rng.choice(_NAMES)} is {rng.choice(_FEELINGS)} because {np_()} is {rng.choice(ADJECTIVES)}.",
        lambda: f"Where is {np_()}? It is {rng.choice(_PLACES)}.",
        lambda: f"What does {rng.choice(_NAMES)} like? {rng.choice(_NAMES)} likes {np_()}.",
        lambda: (
            f"{rng.choice(_NAMES)} and {rng.choice(_NAMES)} go {rng.choice(_PLACES)} "
            f"{rng.choice(_TIMES)}, and they feel {rng.choice(_FEELINGS)}."
        ),
        lambda: f"I have {rng.randint(2, 12)} {rng.choice(NOUNS)}s and {rng.randint(2, 12)} {rng.choice(NOUNS)}s.",
        lambda: f"Please tell me a story about {np_()}.",
    ]
    return [rng.choice(templates)() for _ in range(n)]


DEMO_CORPUS: list[str] = _demo_corpus()


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def build_tokenizer(
    corpus: Iterable[str],
    *,
    vocab_size: int = 512,
    model_max_length: int | None = None,
    fill_to: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on ``corpus``.

    All 256 byte symbols are in the initial alphabet, so any text encodes and
    decodes losslessly.  The vocabulary may come out smaller than
    ``vocab_size`` when the corpus runs out of merges; use ``len(tokenizer)``.
    ``fill_to`` then grows it to exactly that many ids (``_fill``), for a model
    whose embedding has a real model's size: every id it samples decodes.
    """
    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (specials + 256 bytes), got {vocab_size}")
    texts = [str(t) for t in corpus]

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, tok in enumerate(SPECIAL_TOKENS):  # the conventions above rely on it
        assert backend.token_to_id(tok) == i, (tok, backend.token_to_id(tok))
    if fill_to is not None:
        backend = _fill(backend, fill_to)

    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),  # transformers 5 stores them as extra_special_tokens
        padding_side="left",
        truncation_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def _fill(backend: Tokenizer, size: int) -> Tokenizer:
    """``backend`` with its BPE vocabulary grown to ``size`` ids: merges of two byte symbols, then
    of such a pair and a third, appended after the trained merges (which keep their ranks, so text
    encodes to the trained tokens first). Every added id decodes to its bytes (not always valid
    UTF-8: the decoder replaces those with U+FFFD)."""
    data = json.loads(backend.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[Any] = data["model"]["merges"]
    as_text = bool(merges) and isinstance(merges[0], str)  # "a b" in older tokenizers, ["a", "b"] now
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    next_id = max(vocab.values()) + 1
    for left, right in itertools.chain(pairs, triples):
        if next_id >= size:
            break
        if left + right not in vocab:
            vocab[left + right] = next_id
            merges.append(f"{left} {right}" if as_text else [left, right])
            next_id += 1
    return Tokenizer.from_str(json.dumps(data))

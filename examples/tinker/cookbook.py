"""tinker-cookbook's own loops, unmodified, against this service. Run it in the cookbook's venv
(``make tinker-venv``: ``tinker==0.38.0`` and ``tinker-cookbook==0.5.8``, which pins an older
transformers than the service's), with ``TINKER_BASE_URL`` and a ``--tinker`` key in ``TINKER_API_KEY``:

    .venv-tinker/bin/python examples/tinker/cookbook.py sl_loop [key=value ...]
    .venv-tinker/bin/python examples/tinker/cookbook.py math_rl [key=value ...]

``sl_loop`` is ``tinker_cookbook.recipes.sl_loop.main``; ``math_rl`` is
``tinker_cookbook.recipes.math_rl.train.cli_main`` (its ``env=arithmetic``: the cookbook's offline
addition environment, reward 1 for the right sum). Both are called as the cookbook's own command
lines call them, with chz's ``key=value`` arguments; the defaults below fit the tiny ``arith-base``
(``build.py``) and any argument given overrides them.

This file adds only what the recipes would otherwise fetch from Hugging Face's hub, through the
cookbook's own extension points where it has them:

* the tokenizer of a model of the models root (``RLOO_MODELS_DIR``, ``var/models``): the recipes ask
  ``get_tokenizer(model_name)``, and ``register_tokenizer`` answers it from that directory;
* a renderer for the tiny models' chat template, ``<|role|>content<|eos|>``
  (``register_renderer("rloo/role_tokens")``), the format ``/v1/chat/completions`` serves them with;
* for ``sl_loop``, which names neither its data nor its renderer in its config: its
  ``datasets.load_dataset("HuggingFaceH4/no_robots")`` answers every sum of the arithmetic
  environment as a chat (``conversations``), and ``model_info`` (a table of hub models) names
  ``rloo/role_tokens`` for a model of the models root.

``math_rl`` starts from the newest ``sl_loop`` state in ``var/tinker/sl_loop`` unless
``load_checkpoint_path=`` says otherwise. Metrics go to each ``log_path``'s ``metrics.jsonl``, as
the cookbook writes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import tinker
from tinker_cookbook import model_info, renderers, tokenizer_utils
from tinker_cookbook.renderers.base import (
    Message,
    ParseTermination,
    RenderContext,
    RenderedMessage,
    Renderer,
    ensure_text,
    parse_response_for_stop_token,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RENDERER = "rloo/role_tokens"
RUNS = ROOT / "var" / "tinker"

DEFAULTS: dict[str, dict[str, str]] = {
    "sl_loop": {
        "model_name": "arith-base",
        "lora_rank": "0",  # 0: every weight (beyond Tinker's LoRA); a random model learns little through LoRA
        "batch_size": "128",
        "learning_rate": "1e-3",
        "max_length": "128",
        "train_on_what": "last_assistant_message",
        "max_steps": "700",
        "save_every": "200",
        "log_path": str(RUNS / "sl_loop"),
    },
    "math_rl": {
        "env": "arithmetic",
        "model_name": "arith-base",
        "renderer_name": RENDERER,
        "lora_rank": "0",
        "group_size": "8",
        "groups_per_batch": "32",
        "learning_rate": "1e-5",  # from sl_loop's state, 1e-4 and above wreck it in a step (docs/tinker.md)
        "max_tokens": "5",
        "max_steps": "100",  # the arithmetic environment's own 100 batches
        "eval_every": "0",
        "save_every": "0",
        "log_path": str(RUNS / "math_rl"),
        "behavior_if_log_dir_exists": "delete",
    },
}


class RoleTokenRenderer(Renderer):
    """The tiny models' chat template as a cookbook renderer: each message is its role's special
    token (``<|user|>``, ``<|assistant|>``, ``<|system|>``), its text, then ``<|eos|>``, which ends a
    turn and stops sampling. It has the extension property: a conversation's prompt at each turn is
    a prefix of the next."""

    @property
    def has_extension_property(self) -> bool:
        return True

    @property
    def _end_message_token(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids("<|eos|>"))

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        role = message["role"]
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"the tiny chat template has no role {role!r}: system, user or assistant")
        header = tinker.types.EncodedTextChunk(tokens=[int(self.tokenizer.convert_tokens_to_ids(f"<|{role}|>"))])
        text = self.tokenizer.encode(ensure_text(message["content"]), add_special_tokens=False)
        body = tinker.types.EncodedTextChunk(tokens=[*text, self._end_message_token])
        return RenderedMessage(header=header, output=[body])

    def get_stop_sequences(self) -> list[int]:
        return [self._end_message_token]

    def parse_response(self, response: list[int]) -> tuple[Message, ParseTermination]:
        return parse_response_for_stop_token(response, self.tokenizer, self._end_message_token)


def models_root() -> Path:
    return Path(os.environ.get("RLOO_MODELS_DIR", ROOT / "var" / "models")).resolve()


def local_model(name: str) -> Path | None:
    """The directory of ``name`` under the models root, where it has a tokenizer; None for a hub id."""
    path = models_root() / name
    return path if (path / "tokenizer_config.json").is_file() else None


def register(model_name: str) -> None:
    """The tokenizer of ``model_name`` from the models root and the renderer for it; for
    ``sl_loop``, the renderer's name where ``model_info`` is asked (a table of hub models only)."""
    path = local_model(model_name)
    if path is None:
        return  # a hub id: the cookbook finds its tokenizer and renderer itself
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(path))
    renderers.register_renderer(RENDERER, lambda tokenizer, _images: RoleTokenRenderer(tokenizer))
    recommended = model_info.get_recommended_renderer_name

    def ours_first(name: str) -> str:
        return RENDERER if local_model(name) is not None else recommended(name)

    model_info.get_recommended_renderer_name = ours_first  # sl_loop asks it, with no override


def conversations(count: int, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """``count`` chats from the sums of the cookbook's arithmetic environment (``0 <= x, y <= 100``,
    10,201 problems), in the shape of its prompt: the environment's few-shot turn ("What is 4 + 5?"
    / "9"), then "What is x + y?" and the sum. Pass after pass over every sum, each pass shuffled on
    its own, cut at ``count`` (``sl_loop`` reads its dataset once)."""
    import random

    fewshot = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]
    rows: list[dict[str, list[dict[str, str]]]] = []
    n = 0
    while len(rows) < count:
        pairs = [(x, y) for x in range(101) for y in range(101)]
        random.Random(seed + n).shuffle(pairs)
        n += 1
        rows += [
            {
                "messages": [
                    *fewshot,
                    {"role": "user", "content": f"What is {x} + {y}?"},
                    {"role": "assistant", "content": str(x + y)},
                ]
            }
            for x, y in pairs
        ]
    return rows[:count]


def serve_arithmetic(count: int) -> None:
    """``sl_loop``'s ``load_dataset("HuggingFaceH4/no_robots")`` answers ``conversations(count)``
    (a ``messages`` column, as no_robots has). ``sl_loop``'s learning rate falls linearly over its
    whole dataset: ``count`` of ``max_steps * batch_size`` rows runs it down to lr/max_steps on the
    last step."""
    import datasets

    load = datasets.load_dataset

    def offline(name: str, *args: Any, **kwargs: Any) -> Any:
        if name != "HuggingFaceH4/no_robots":
            return load(name, *args, **kwargs)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(conversations(count))})

    datasets.load_dataset = offline


def newest_state(log_path: Path) -> str | None:
    """The newest ``state_path`` in a cookbook run's ``checkpoints.jsonl``."""
    index = log_path / "checkpoints.jsonl"
    if not index.is_file():
        return None
    states = [row["state_path"] for row in map(json.loads, index.read_text().splitlines()) if row.get("state_path")]
    return states[-1] if states else None


def arguments(recipe: str, given: list[str]) -> list[str]:
    values = dict(DEFAULTS[recipe])
    for arg in given:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"arguments are chz's key=value, not {arg!r}")
        values[key] = value
    if recipe == "math_rl" and "load_checkpoint_path" not in values:
        state = newest_state(Path(DEFAULTS["sl_loop"]["log_path"]))
        if state is None:
            raise SystemExit("math_rl starts from sl_loop's state: run sl_loop first, or give load_checkpoint_path=")
        values["load_checkpoint_path"] = state
    return [f"{key}={value}" for key, value in values.items()]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in DEFAULTS:
        raise SystemExit(f"usage: cookbook.py {{{' | '.join(DEFAULTS)}}} [key=value ...]")
    recipe, args = argv[0], arguments(argv[0], argv[1:])
    values = dict(arg.split("=", 1) for arg in args)
    register(values["model_name"])
    import chz

    if recipe == "sl_loop":
        from tinker_cookbook.recipes import sl_loop

        serve_arithmetic(int(values["max_steps"]) * int(values["batch_size"]))
        chz.nested_entrypoint(sl_loop.main, argv=args)
    else:
        from tinker_cookbook.recipes.math_rl import train

        asyncio.run(train.cli_main(chz.entrypoint(train.CLIConfig, argv=args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

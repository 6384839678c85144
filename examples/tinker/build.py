"""The base model tinker-cookbook's loops train here, built offline in a few seconds (run it in the
project's venv; ``run.py`` does):

    python examples/tinker/build.py [--force]

``arith-base`` under the models root (``RLOO_MODELS_DIR``, ``var/models`` by default): a random
Llama-style model (4 layers, hidden 128, 128 positions) whose tokenizer has one token per byte and the
tiny models' chat template, ``<|role|>content<|eos|>`` (``cookbook.py``'s renderer writes the same
tokens, so what the loops train is what ``/v1/chat/completions`` answers). Seeded: the same weights on
every run. A model already there is kept (``--force`` rebuilds it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

BASE = "arith-base"


def build_base(models: Path, *, force: bool) -> Path:
    from worker.tiny.models import build_tiny_causal_lm

    corpus = [f"What is {x} + {y}? {x + y}" for x in range(101) for y in range(101)]
    # 262 = the 6 special tokens + the 256 bytes: no merges, one token per character.
    return build_tiny_causal_lm(
        models / BASE,
        corpus=corpus,
        vocab_size=262,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        max_position_embeddings=128,
        seed=0,
        overwrite=force,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--force", action="store_true", help="rebuild the model even if it exists")
    args = parser.parse_args(argv)

    from service.core.settings import get_settings

    models = get_settings().models_dir
    models.mkdir(parents=True, exist_ok=True)
    print(build_base(models, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

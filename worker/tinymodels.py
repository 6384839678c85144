"""``python -m worker.tinymodels DIR`` and ``from worker.tinymodels import ...``, the spellings of
earlier releases, kept for one release: the tiny models are built by ``worker.tiny.models``
(``python -m worker.tiny.models DIR``)."""

from __future__ import annotations

from worker.tiny.models import (
    FIT_RECORD,
    build_tiny_causal_lm,
    build_tiny_reward_model,
    layout,
    main,
    make_keyword_reward_data,
    train_tiny_reward_model,
)

__all__ = [
    "FIT_RECORD",
    "build_tiny_causal_lm",
    "build_tiny_reward_model",
    "layout",
    "main",
    "make_keyword_reward_data",
    "train_tiny_reward_model",
]

if __name__ == "__main__":
    raise SystemExit(main())

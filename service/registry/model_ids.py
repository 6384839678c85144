"""Fine-tuned models' ids, OpenAI's form: a succeeded job's model is
``ft:<base>:<project>:<suffix>:<job id>`` and each checkpoint's
``ft:<base>:<project>:<suffix>:<job id>:ckpt-step-<N>``. Strings alone, no database: ``rloo train``
checks a spec's model with them and loads no SQL."""

from __future__ import annotations

import re

PREFIX = "ft:"


def is_fine_tuned(name: str) -> bool:
    return name.startswith(PREFIX)


def _part(text: str) -> str:
    """A name as one segment of an id: no colon, no space."""
    return re.sub(r"[^A-Za-z0-9._/-]+", "-", text).strip("-")


def model_id(*, base: str, project: str, suffix: str | None, job_id: str) -> str:
    return f"{PREFIX}{_part(base)}:{_part(project)}:{_part(suffix or '')}:{job_id}"


def checkpoint_id(model: str, step: int) -> str:
    return f"{model}:ckpt-step-{step}"

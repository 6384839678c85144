"""Fine-tuned models' ids, OpenAI's form: a succeeded job's model is
``ft:<base>:<project>:<suffix>:<job id>`` and each checkpoint's
``ft:<base>:<project>:<suffix>:<job id>:ckpt-step-<N>``; weights a Tinker training model saved are
named by their path, ``tinker://<model>/<weights|sampler_weights|external_weights>/<name>``.
Strings alone, no database: ``rloo train`` checks a spec's model with them and loads no SQL."""

from __future__ import annotations

import re

PREFIX = "ft:"
TINKER_PREFIX = "tinker://"


def is_fine_tuned(name: str) -> bool:
    """``name`` names weights trained in a project (a job's model or checkpoint, or a Tinker
    checkpoint), not a base model: the project's to find (``service.registry.finetuned``)."""
    return name.startswith((PREFIX, TINKER_PREFIX))


def is_tinker(name: str) -> bool:
    return name.startswith(TINKER_PREFIX)


def _part(text: str) -> str:
    """A name as one segment of an id: no colon, no space."""
    return re.sub(r"[^A-Za-z0-9._/-]+", "-", text).strip("-")


def model_id(*, base: str, project: str, suffix: str | None, job_id: str) -> str:
    return f"{PREFIX}{_part(base)}:{_part(project)}:{_part(suffix or '')}:{job_id}"


def checkpoint_id(model: str, step: int) -> str:
    return f"{model}:ckpt-step-{step}"

"""Fine-tuned models: their ids (OpenAI's form), and finding the checkpoint an id names.

A succeeded job's model is ``ft:<base>:<project>:<suffix>:<job id>`` and each checkpoint's
``ft:<base>:<project>:<suffix>:<job id>:ckpt-step-<N>``, as OpenAI writes them. ``<base>`` is the
base model directory the weights descend from (a chain of jobs keeps its first base). A new job's
``model`` may name either, in its own project: it starts from that checkpoint's weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Checkpoint, Job, Project

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


def project_name(*, session: Session, project_seq: int) -> str:
    return session.scalar(select(Project.name).where(Project.seq == project_seq)) or "project"


@dataclass(frozen=True)
class Source:
    """Where a fine-tuned model's weights are: its base model directory and the checkpoint
    (relative to the artifacts root)."""

    base_model: str
    path: str
    job: Job


def find(*, session: Session, project_seq: int, name: str) -> Source | None:
    """The checkpoint a fine-tuned model or checkpoint id of the project names, or None (another
    project's, a deleted model's, an unknown id)."""
    if not is_fine_tuned(name):
        return None
    found = session.execute(
        select(Checkpoint, Job)
        .join(Job, Job.seq == Checkpoint.job_seq)
        .where(Job.project_seq == project_seq, Checkpoint.fine_tuned_model_checkpoint == name)
    ).first()
    pair = found.tuple() if found is not None else _final_checkpoint(session, project_seq, name)
    if pair is None or pair[1].model_deleted_at is not None:
        return None
    ckpt, job = pair
    return Source(base_model=job.base_model or job.model, path=ckpt.path, job=job)


def _final_checkpoint(session: Session, project_seq: int, name: str) -> tuple[Checkpoint, Job] | None:
    """A fine-tuned model's weights: its job's newest checkpoint."""
    job = session.scalar(select(Job).where(Job.project_seq == project_seq, Job.fine_tuned_model == name))
    if job is None:
        return None
    ckpt = session.scalar(
        select(Checkpoint).where(Checkpoint.job_seq == job.seq).order_by(Checkpoint.step_number.desc()).limit(1)
    )
    return (ckpt, job) if ckpt is not None else None

"""Fine-tuned models: finding the checkpoint an id names (the ids' form is ``model_ids``).

A succeeded job's model is ``ft:<base>:<project>:<suffix>:<job id>`` and each checkpoint's
``ft:<base>:<project>:<suffix>:<job id>:ckpt-step-<N>``, as OpenAI writes them. ``<base>`` is the
base model directory the weights descend from (a chain of jobs keeps its first base). A new job's
``model`` may name either, in its own project: it starts from that checkpoint's weights.

A Tinker training model's saved weights are models of its project too, named by their
``tinker://`` path: served by ``/v1/chat/completions``, listed by ``/v1/models`` (sampler and
external weights: a saved state is for training on), a new job's starting point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.tables import Checkpoint, Job, Project, TinkerCheckpoint, TinkerModel, now
from service.registry.model_ids import TINKER_PREFIX, is_fine_tuned, is_tinker


def project_name(*, session: Session, project_seq: int) -> str:
    return session.scalar(select(Project.name).where(Project.seq == project_seq)) or "project"


MAX_CHAIN = 64
"""Most jobs in a chain (each started from the one before's model): bounds the walk back."""


@dataclass(frozen=True)
class Source:
    """Where a fine-tuned model's weights are: its base model directory, and the checkpoints
    (relative to the artifacts root) to apply to it in order, oldest first: the named one last,
    after those of the jobs its own job started from (a LoRA checkpoint holds only its adapter,
    trained on its job's starting weights)."""

    base_model: str
    chain: tuple[str, ...]
    job: Job | None
    """The job whose checkpoint is named (None: a Tinker checkpoint)."""
    created_at: int = 0


def find(*, session: Session, project_seq: int, name: str, include_deleted: bool = False) -> Source | None:
    """The checkpoint a fine-tuned model or checkpoint id of the project names, or None (another
    project's, an unknown id, a model whose job did not succeed, a deleted model's unless
    ``include_deleted``: a job already started from it keeps its weights)."""
    if is_tinker(name):
        return _tinker_source(session, project_seq, name)
    chain: list[str] = []
    first: tuple[Checkpoint, Job] | None = None
    while is_fine_tuned(name) and len(chain) < MAX_CHAIN:
        if is_tinker(name):  # the job started from a Tinker checkpoint: its weights end the walk
            started = _tinker_source(session, project_seq, name)
            if started is None:
                return None
            chain[0:0] = started.chain
            break
        pair = _named_checkpoint(session, project_seq, name) or _final_checkpoint(session, project_seq, name)
        if pair is None or (first is None and pair[1].model_deleted_at is not None and not include_deleted):
            return None
        first = first or pair
        chain.insert(0, pair[0].path)
        name = pair[1].model  # the model its job started from: a base model ends the walk
    if first is None or (is_fine_tuned(name) and not is_tinker(name)):
        return None
    job = first[1]
    return Source(
        base_model=job.base_model or job.model,
        chain=tuple(chain),
        job=job,
        created_at=job.finished_at or job.created_at,
    )


LISTED_KINDS = ("sampler_weights", "external_weights")
"""The Tinker checkpoints ``/v1/models`` lists (a saved state resolves too, but is for training on)."""


def live_tinker_checkpoints() -> Any:
    """The clause that keeps a Tinker checkpoint whose time to live has not run out."""
    return TinkerCheckpoint.expires_at.is_(None) | (TinkerCheckpoint.expires_at > now())


def _tinker_rows(session: Session, project_seq: int) -> Any:
    return (
        select(TinkerCheckpoint, TinkerModel)
        .join(TinkerModel, TinkerModel.seq == TinkerCheckpoint.model_seq)
        .where(TinkerModel.project_seq == project_seq)
        .where(live_tinker_checkpoints())
    )


def _tinker_source(session: Session, project_seq: int, name: str) -> Source | None:
    """A live checkpoint of a Tinker training model of the project, by its path."""
    parts = name[len(TINKER_PREFIX) :].split("/")
    if len(parts) != 3:
        return None
    model_id, kind, checkpoint = parts
    found = session.execute(
        _tinker_rows(session, project_seq).where(
            TinkerModel.id == model_id, TinkerCheckpoint.kind == kind, TinkerCheckpoint.name == checkpoint
        )
    ).first()
    if found is None:
        return None
    row, model = found
    return Source(base_model=model.base_model, chain=(row.path,), job=None, created_at=row.created_at)


def tinker_models(session: Session, project_seq: int) -> list[tuple[str, int]]:
    """The project's Tinker sampler and external weights as models: (path, created), newest first."""
    rows = session.execute(
        _tinker_rows(session, project_seq)
        .where(TinkerCheckpoint.kind.in_(LISTED_KINDS))
        .order_by(TinkerCheckpoint.created_at.desc(), TinkerCheckpoint.seq.desc())
    ).all()
    return [(f"{TINKER_PREFIX}{model.id}/{row.kind}/{row.name}", row.created_at) for row, model in rows]


def _named_checkpoint(session: Session, project_seq: int, name: str) -> tuple[Checkpoint, Job] | None:
    found = session.execute(
        select(Checkpoint, Job)
        .join(Job, Job.seq == Checkpoint.job_seq)
        .where(Job.project_seq == project_seq, Checkpoint.fine_tuned_model_checkpoint == name)
    ).first()
    return None if found is None else (found[0], found[1])


def _final_checkpoint(session: Session, project_seq: int, name: str) -> tuple[Checkpoint, Job] | None:
    """A fine-tuned model's weights: its succeeded job's newest checkpoint."""
    job = session.scalar(
        select(Job).where(Job.project_seq == project_seq, Job.fine_tuned_model == name, Job.status == "succeeded")
    )
    if job is None:
        return None
    ckpt = session.scalar(
        select(Checkpoint).where(Checkpoint.job_seq == job.seq).order_by(Checkpoint.step_number.desc()).limit(1)
    )
    return (ckpt, job) if ckpt is not None else None

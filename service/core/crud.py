"""Data access: keyword-only functions shared by the API, the worker and the CLI.

Functions take a session and never commit. What changes a job's status or its worker's hold on it
lives in ``service.jobs.lifecycle``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.core.tables import Checkpoint, File, Job, JobMetric, JobSample, Project, now


# Callers -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Caller:
    """The project a request's key belongs to: what handlers need of it, read once per request by
    the auth middleware (one query), no ORM object to keep attached to a session."""

    seq: int
    id: str
    key_id: str = ""  # the key's id (key-…): what a per-key limit counts by, never the secret
    operator: bool = False  # the operator's key: the operator's routes too (``deps.OperatorDep``)
    scopes: frozenset[str] = frozenset()  # what the key may do (service.tenancy.scopes)
    expires_at: int | None = None  # when the key stops working (None: never)
    archived: bool = False  # its project is archived: the key may not be used

    def may(self, scope: str) -> bool:
        return scope in self.scopes


# Paging ------------------------------------------------------------------------------------------
def page(
    *, session: Session, model: Any, scope: Sequence[Any], after_id: str | None, limit: int, ascending: bool = False
) -> tuple[list[Any], bool] | None:
    """Rows of ``model`` matching ``scope``, newest first (oldest first if ``ascending``), after the
    row with id ``after_id``.

    ``after_id`` is looked up within the same scope, so another project's id is as unknown as one
    that never existed. Returns (rows, has_more), or None when ``after_id`` is unknown.
    """
    stmt = select(model).where(*scope)
    if after_id is not None:
        after_seq = session.scalar(select(model.seq).where(model.id == after_id, *scope))
        if after_seq is None:
            return None
        stmt = stmt.where(model.seq > after_seq if ascending else model.seq < after_seq)
    order = model.seq.asc() if ascending else model.seq.desc()
    rows = list(session.scalars(stmt.order_by(order).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


# Files -------------------------------------------------------------------------------------------
def get_file(*, session: Session, project: Project | Caller, file_id: str) -> File | None:
    return session.scalar(select(File).where(File.id == file_id, File.project_seq == project.seq))


def get_file_by_id(*, session: Session, project_seq: int, file_id: str) -> File | None:
    return session.scalar(select(File).where(File.id == file_id, File.project_seq == project_seq))


def lock_files(*, session: Session, project_seq: int, file_ids: Sequence[str], for_delete: bool = False) -> set[str]:
    """Of ``file_ids``, those that still exist, locked until the transaction ends (PostgreSQL:
    FOR SHARE while a job that uses them is created, FOR UPDATE while one is deleted, so that the
    two wait for each other and one of them loses; SQLite: the caller holds ``db.write_lock``)."""
    stmt = select(File.id).where(File.id.in_(file_ids), File.project_seq == project_seq)
    return set(session.scalars(stmt.with_for_update(read=not for_delete)))


# Jobs --------------------------------------------------------------------------------------------
# Built once: the status poll is the hottest query, and building the expression cost more than running it.
_JOB_IN_PROJECT = select(Job).where(Job.id == bindparam("job_id"), Job.project_seq == bindparam("project_seq"))


def get_job(*, session: Session, project: Project | Caller, job_id: str) -> Job | None:
    return session.scalar(_JOB_IN_PROJECT, {"job_id": job_id, "project_seq": project.seq})


def get_job_by_id(*, session: Session, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.id == job_id))


def upsert_metrics(*, session: Session, job: Job, step: int, data: dict[str, Any]) -> None:
    """Insert the step's metrics, or overwrite them if the step ran before (a replay after a crash)."""
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = insert(JobMetric).values(job_seq=job.seq, step=step, data=data, created_at=now())
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_seq", "step"], set_={"data": stmt.excluded.data, "created_at": stmt.excluded.created_at}
    )
    session.execute(stmt)


def upsert_samples(*, session: Session, job: Job, step: int, groups: list[Any]) -> None:
    """The step's samples, or overwrite them if the step ran before (a replay after a crash)."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stmt = insert(JobSample).values(job_seq=job.seq, step=step, groups=groups, created_at=now())
    stmt = stmt.on_conflict_do_update(index_elements=["job_seq", "step"], set_={"groups": stmt.excluded.groups})
    session.execute(stmt)


def list_samples(*, session: Session, job: Job, after_step: int, limit: int) -> Sequence[JobSample]:
    query = select(JobSample).where(JobSample.job_seq == job.seq, JobSample.step > after_step)
    return session.scalars(query.order_by(JobSample.step).limit(limit)).all()


def list_metrics(*, session: Session, job: Job) -> Sequence[JobMetric]:
    return session.scalars(select(JobMetric).where(JobMetric.job_seq == job.seq).order_by(JobMetric.step)).all()


def add_checkpoint(
    *, session: Session, job: Job, step: int, path: str, name: str, metrics: dict[str, Any], size: int | None = None
) -> Checkpoint:
    existing = checkpoint_at(session=session, job=job, step=step)
    if existing is not None:  # a replayed step rewrote the same directory: a merged copy of the old one is stale
        existing.path, existing.metrics, existing.fine_tuned_model_checkpoint = path, metrics, name
        existing.bytes, existing.export_bytes = size, None
        return existing
    ckpt = Checkpoint(
        job_seq=job.seq, step_number=step, path=path, fine_tuned_model_checkpoint=name, metrics=metrics, bytes=size
    )
    session.add(ckpt)
    return ckpt


def checkpoint_at(*, session: Session, job: Job, step: int) -> Checkpoint | None:
    """The job's checkpoint of ``step``, if it has a row."""
    return session.scalar(select(Checkpoint).where(Checkpoint.job_seq == job.seq, Checkpoint.step_number == step))


def get_checkpoint(*, session: Session, job: Job, checkpoint_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.job_seq == job.seq))


def remove_checkpoint(*, session: Session, job: Job, step: int) -> None:
    """Forget the checkpoint of ``step`` (its directory was pruned by ``keep_checkpoints``)."""
    session.execute(delete(Checkpoint).where(Checkpoint.job_seq == job.seq, Checkpoint.step_number == step))


def set_result_files(*, session: Session, job: Job, file_ids: list[str]) -> None:
    session.execute(update(Job).where(Job.seq == job.seq).values(result_files=file_ids))

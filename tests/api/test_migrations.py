"""The migrated schema is the models' schema: autogenerate finds nothing to do, on each backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.orm import Session

from service.core import crud
from service.core.migrate import upgrade
from service.core.tables import Base, Job, JobMetric
from service.jobs import lifecycle
from service.jobs.lifecycle import JobStatus
from service.tenancy import projects


def test_migrations_match_models(database_url: str) -> None:
    upgrade(database_url)
    from service.core.db import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
            tables = set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert diff == [], diff
    assert {"projects", "api_keys", "files", "jobs", "job_events", "job_metrics", "checkpoints"} <= tables


def test_upgrade_is_idempotent(database_url: str) -> None:
    upgrade(database_url)
    upgrade(database_url)  # a second `rloo db upgrade` on a current schema changes nothing


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    from service.core.db import make_engine

    upgrade(database_url)
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


def _job(session: Session, status: str) -> Job:
    project = projects.get_or_create_project(session=session, name="p")
    job = Job(
        project_seq=project.seq,
        model="m",
        training_file="file-x",
        seed=0,
        method={},
        hyperparameters={},
        status=status,
        total_steps=3,
    )
    session.add(job)
    session.commit()
    return job


def test_metrics_unique_on_job_and_step(engine: sa.Engine) -> None:
    """A replayed step overwrites its row (upsert), never duplicates it."""
    with Session(engine) as session:
        job = _job(session, "running")
        crud.upsert_metrics(session=session, job=job, step=1, data={"train_reward_mean": 0.1})
        crud.upsert_metrics(session=session, job=job, step=1, data={"train_reward_mean": 0.7})
        session.commit()
        rows = session.scalars(sa.select(JobMetric).where(JobMetric.job_seq == job.seq)).all()
        assert [(r.step, r.data["train_reward_mean"]) for r in rows] == [(1, 0.7)]


def test_claim_is_atomic(engine: sa.Engine) -> None:
    """A task delivered twice: only the first claim gets the job; the second is a no-op."""
    with Session(engine) as a, Session(engine) as b:
        job = _job(a, "queued")
        first = lifecycle.claim(session=a, job_id=job.id, worker="w1")
        second = lifecycle.claim(session=b, job_id=job.id, worker="w2")
        assert first is not None and first.status == "running" and first.worker == "w1"
        assert second is None
        # Final states are final: a late "succeeded" cannot overwrite a cancel.
        assert lifecycle.move(session=a, job=job, to=JobStatus.CANCELLED, from_=(JobStatus.RUNNING,))
        assert not lifecycle.move(session=b, job=job, to=JobStatus.SUCCEEDED, from_=(JobStatus.RUNNING,))
        assert job.status == "cancelled"

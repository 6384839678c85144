"""Rows the tests write straight into the database, where a test needs a state no request makes
quickly (a job that trained, with a checkpoint)."""

from __future__ import annotations

from typing import Any

from service import crud
from service.models import Job


def job_row(session: Any, project: str, **fields: Any) -> Job:
    """A job of ``project`` (made if new) on tiny-policy, flushed (its ``id`` and ``seq`` set): a
    supervised job running, unless ``fields`` say otherwise."""
    proj = crud.get_or_create_project(session=session, name=project)
    values: dict[str, Any] = {
        "model": "tiny-policy",
        "base_model": "tiny-policy",
        "training_file": "file-x",
        "seed": 0,
        "method": {"type": "supervised"},
        "hyperparameters": {},
        "status": "running",
        "total_steps": 2,
        **fields,
    }
    job = Job(project_seq=proj.seq, **values)
    session.add(job)
    session.flush()
    return job

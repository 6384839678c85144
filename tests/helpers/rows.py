"""Rows the tests write straight into the database, where a test needs a state no request makes
quickly (a job that trained, with a checkpoint)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import job_row as _job_row
from service.core.tables import Job


def job_row(session: Any, project: str, **fields: Any) -> Job:
    """A job of ``project`` (made if new) on tiny-policy, flushed (its ``id`` and ``seq`` set): a
    supervised job running, unless ``fields`` say otherwise (``benchmarks.common.job_row``, the
    benchmarks' own, with the tests' model and two steps)."""
    job: Job = _job_row(session, project, fields.pop("model", "tiny-policy"), **{"total_steps": 2, **fields})
    return job

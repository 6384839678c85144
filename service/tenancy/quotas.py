"""A project's quotas, set by the operator (``rloo projects quota``, ``POST /v1/projects/{id}``), and
the checks that hold a project to them. Each refusal names the quota, the use, the limit and when it
frees up; a running job that reaches a device-hour limit (its project's a day, or its own budget) is
paused, never lost.

A quota left unset is the operator's default setting where one exists (``RLOO_MAX_QUEUED_JOBS``) and
otherwise no limit."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.core.errors import Forbidden, LimitReached, bad_request
from service.core.tables import Job, Project, TinkerModel


@dataclass(frozen=True)
class Quota:
    what: str  # in words, after "at most"
    unit: str
    integer: bool = True


QUOTAS: dict[str, Quota] = {
    "running_jobs": Quota("jobs running at once", "jobs"),
    "gpus": Quota("devices held by its running jobs at once", "devices"),
    "queued_jobs": Quota("jobs waiting for a worker", "jobs"),
    "stored_bytes": Quota("bytes stored (files and checkpoints)", "bytes"),
    "inference_tokens_per_minute": Quota("inference tokens a minute (prompt and completion)", "tokens"),
    "device_hours_per_day": Quota("device-hours in any 24 hours", "device-hours", integer=False),
}
RUNNING = "running"


def parse(values: dict[str, Any], *, param: str = "quotas") -> dict[str, float | None]:
    """The quotas a request sets (a number, or null to unset one); an unknown name or a negative or
    non-number value is a 400 naming it."""
    out: dict[str, float | None] = {}
    for name, value in values.items():
        if name not in QUOTAS:
            raise bad_request(f"Unknown quota {name!r}: quotas are {', '.join(QUOTAS)}.", f"{param}.{name}")
        if value is None:
            out[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad_request(
                f"Quota {name!r} must be a number >= 0 (or null to unset it); got {value!r}.", f"{param}.{name}"
            )
        if QUOTAS[name].integer and value != int(value):
            raise bad_request(f"Quota {name!r} counts whole {QUOTAS[name].unit}; got {value!r}.", f"{param}.{name}")
        out[name] = int(value) if QUOTAS[name].integer else float(value)
    return out


def apply(project: Project, changes: dict[str, float | None]) -> None:
    quotas = dict(project.quotas or {})
    for name, value in changes.items():
        if value is None:
            quotas.pop(name, None)
        else:
            quotas[name] = value
    project.quotas = quotas or None


def limit_of(session: Session, project_seq: int, name: str) -> float | None:
    quotas = session.scalar(select(Project.quotas).where(Project.seq == project_seq)) or {}
    value = quotas.get(name)
    return None if value is None else float(value)


SESSION_ACTIVE_SECONDS = 600
"""A Tinker training model asked something within this long counts as running (a device each)."""


def running_use(session: Session, project_seq: int) -> tuple[int, int]:
    """The project's running jobs and active Tinker training models, and the devices they hold."""
    rows = session.execute(select(Job.resources).where(Job.project_seq == project_seq, Job.status == RUNNING)).all()
    since = time.time() - SESSION_ACTIVE_SECONDS
    active = session.scalar(
        select(func.count()).where(
            TinkerModel.project_seq == project_seq,
            func.coalesce(TinkerModel.last_request_at, TinkerModel.created_at) >= since,
        )
    )
    models = int(active or 0)
    return len(rows) + models, sum(int((r.resources or {}).get("gpus") or 1) for r in rows) + models


def check_session_room(session: Session, project_seq: int) -> None:
    """429 when a new Tinker training model would take the project past ``running_jobs`` or ``gpus``."""
    quotas = session.scalar(select(Project.quotas).where(Project.seq == project_seq)) or {}
    if quotas.get("running_jobs") is None and quotas.get("gpus") is None:
        return
    jobs, devices = running_use(session, project_seq)
    for name, use in (("running_jobs", jobs), ("gpus", devices)):
        if quotas.get(name) is not None and use + 1 > quotas[name]:
            raise LimitReached(
                f"This project runs {jobs} jobs and Tinker training models on {devices} devices, and one more "
                f"would pass its quota of {name} ({quotas[name]}); it frees up as one ends (a training model "
                f"idle for {SESSION_ACTIVE_SECONDS // 60} minutes stops counting).",
                code="quota_exceeded",
                retry_after=30,
            )


def room_to_run(session: Session, job: Job, *, claimed: bool = False) -> str | None:
    """Why ``job`` may not start now (its project at its running-jobs or devices quota), or None;
    ``claimed``: the job is running already, and counted."""
    quotas = session.scalar(select(Project.quotas).where(Project.seq == job.project_seq)) or {}
    if quotas.get("running_jobs") is None and quotas.get("gpus") is None:
        return None
    jobs, devices = running_use(session, job.project_seq)
    if claimed:
        wanted = int((job.resources or {}).get("gpus") or 1)
        jobs, devices = jobs - 1, devices - wanted
    if quotas.get("running_jobs") is not None and jobs >= quotas["running_jobs"]:
        return (
            f"Waiting: the project runs {jobs} jobs, its quota of running_jobs ({quotas['running_jobs']}); "
            "it starts when one of them ends."
        )
    wanted = int((job.resources or {}).get("gpus") or 1)
    if quotas.get("gpus") is not None and devices + wanted > quotas["gpus"]:
        return (
            f"Waiting: the project's running jobs hold {devices} devices and this one needs {wanted}, past its "
            f"quota of gpus ({quotas['gpus']}); it starts when devices free up."
        )
    return None


def check_storage(session: Session, project_seq: int, adding: int) -> None:
    """403 ``quota_exceeded`` when ``adding`` bytes would take the project past ``stored_bytes``."""
    from service.tenancy import usage

    cap = limit_of(session, project_seq, "stored_bytes")
    if cap is None:
        return
    stored = usage.stored_bytes(session, project_seq)
    if stored + adding > cap:
        raise Forbidden(
            f"This project stores {stored} bytes and this would add {adding}, past its quota of stored_bytes "
            f"({int(cap)}): delete files (DELETE /v1/files/{{id}}) or fine-tuned models, or ask the operator for "
            "more.",
            code="quota_exceeded",
        )


def check_device_hours(session: Session, project_seq: int) -> None:
    """429 when the project used its ``device_hours_per_day`` in the last 24 hours, saying when the
    oldest of that use leaves the window."""
    from service.tenancy import usage

    cap = limit_of(session, project_seq, "device_hours_per_day")
    if cap is None:
        return
    now = time.time()
    used = usage.device_hours(session, project_seq, since=now - 86400)
    if used >= cap:
        frees = usage.window_frees_at(session, project_seq, since=now - 86400)
        raise LimitReached(
            f"This project used {used:.2f} device-hours in the last 24 hours, its quota of device_hours_per_day "
            f"({cap:g}); it frees up from {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(frees))}.",
            code="quota_exceeded",
            retry_after=max(1.0, frees - now),
        )


def over_budget(session: Session, job: Job) -> str | None:
    """Why a running ``job`` must pause now (its own device-hour budget, or its project's day), or None."""
    from service.tenancy import usage

    budget = (job.budget or {}).get("device_hours")
    if budget is not None:
        spent = usage.device_hours_of(session, job.id)
        if spent >= budget:
            return f"Paused: the job used {spent:.3f} device-hours, its budget ({budget:g}); resume it to go on."
    cap = limit_of(session, job.project_seq, "device_hours_per_day")
    if cap is not None:
        used = usage.device_hours(session, job.project_seq, since=time.time() - 86400)
        if used >= cap:
            return (
                f"Paused: the project used {used:.3f} device-hours in the last 24 hours, its quota of "
                f"device_hours_per_day ({cap:g}); resume it once that frees up."
            )
    return None


def project_quotas(project: Project) -> dict[str, Any]:
    return {name: (project.quotas or {}).get(name) for name in QUOTAS}


def count(session: Session, statement: Any) -> int:
    return int(session.scalar(select(func.count()).select_from(statement.subquery())) or 0)

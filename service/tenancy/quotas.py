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

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.core.errors import Forbidden, LimitReached, bad_request
from service.core.tables import Job, Project, TinkerModel
from service.infra.task_queue import asked


@dataclass(frozen=True)
class Quota:
    what: str  # in words, after "at most"
    unit: str
    integer: bool = True


QUOTAS: dict[str, Quota] = {
    "running_jobs": Quota("jobs running at once", "jobs"),
    "gpus": Quota("devices held by its running jobs at once", "devices"),
    "queued_jobs": Quota("jobs waiting for a worker", "jobs"),
    "stored_bytes": Quota("bytes stored (files, checkpoints, merged exports, Tinker checkpoints)", "bytes"),
    "inference_tokens_per_minute": Quota("inference tokens a minute (prompt and completion)", "tokens"),
    "device_hours_per_day": Quota("device-hours in any 24 hours", "device-hours", integer=False),
    "cost_per_day": Quota("spend in any 24 hours at the operator's prices (RLOO_ACCELERATOR_PRICES)", "money", False),
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
    if out.get("cost_per_day") is not None:
        from service.core.settings import get_settings

        if not get_settings().accelerator_prices:
            raise bad_request(_NO_PRICES.format(what="The quota cost_per_day"), f"{param}.cost_per_day")
    return out


def checked_budget(budget: dict[str, float]) -> dict[str, float]:
    """A job's budget: at least one limit, and one in money only where the operator set prices."""
    from service.core.settings import get_settings

    if not budget:
        raise bad_request("A budget names device_hours, cost or both.", "budget")
    if "cost" in budget and not get_settings().accelerator_prices:
        raise bad_request(_NO_PRICES.format(what="A budget in money"), "budget.cost")
    return budget


_NO_PRICES = "{what} needs the operator's prices of a device-hour (RLOO_ACCELERATOR_PRICES), and none are set."


def apply(project: Project, changes: dict[str, float | None]) -> None:
    quotas = dict(project.quotas or {})
    for name, value in changes.items():
        if value is None:
            quotas.pop(name, None)
        else:
            quotas[name] = value
    project.quotas = quotas or None


def quotas_of(session: Session, project_seq: int) -> dict[str, float]:
    """The project's quotas that are set, as numbers: one read of its row for every check a request makes."""
    quotas = session.scalar(select(Project.quotas).where(Project.seq == project_seq)) or {}
    return {name: float(value) for name, value in quotas.items() if value is not None}


def limit_of(session: Session, project_seq: int, name: str) -> float | None:
    return quotas_of(session, project_seq).get(name)


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
    return len(rows) + models, sum(asked(r.resources)[0] for r in rows) + models


def why_waiting(session: Session, job: Job) -> str | None:
    """Why ``job`` may not start now (its project at its quota of running jobs or of devices), or None."""
    past = _past(session, job.project_seq, quotas_of(session, job.project_seq), wanted=asked(job.resources)[0])
    return None if past is None else f"Waiting: {past}; it starts when one of them ends."


def lock_project(session: Session, project: Any) -> None:
    """``project`` (its seq, or a scalar subquery of it) locked until the caller's commit, before
    what the caller reads: PostgreSQL locks its row; SQLite has no row locks, so the transaction takes
    the database's write lock first (a no-op UPDATE), and what it reads after is current until it
    commits (another writer waits its turn)."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(Project).where(Project.seq == project).values(created_at=Project.created_at))
    else:  # FOR NO KEY UPDATE: it waits for another holder, not for rows that merely point at the project
        session.execute(select(Project.seq).where(Project.seq == project).with_for_update(key_share=True))


def check_session_room(session: Session, project_seq: int) -> None:
    """429 when a new Tinker training model would take the project past ``running_jobs`` or ``gpus``
    (``_past`` locks the project until the caller commits the model's row)."""
    past = _past(session, project_seq, quotas_of(session, project_seq), wanted=1)
    if past is not None:
        raise LimitReached(
            f"{past[0].upper()}{past[1:]}; it frees up as one ends (a Tinker training model idle for "
            f"{SESSION_ACTIVE_SECONDS // 60} minutes stops counting).",
            code="quota_exceeded",
            retry_after=30,
        )


def _past(session: Session, project_seq: int, quotas: dict[str, float], *, wanted: int) -> str | None:
    """What one more run holding ``wanted`` devices would pass, in words; None: nothing. Where the
    project has either quota, it is locked (``lock_project``) before its runs are counted, until the
    caller commits: a job's claim and a Tinker model never both take its last place."""
    if quotas.get("running_jobs") is None and quotas.get("gpus") is None:
        return None
    lock_project(session, project_seq)
    quotas = quotas_of(session, project_seq)  # as of the lock
    jobs, devices = running_use(session, project_seq)
    if quotas.get("running_jobs") is not None and jobs + 1 > quotas["running_jobs"]:
        return (
            f"the project runs {jobs} jobs and Tinker training models, its quota of running_jobs "
            f"({quotas['running_jobs']:g})"
        )
    if quotas.get("gpus") is not None and devices + wanted > quotas["gpus"]:
        return (
            f"the project's runs hold {devices} devices and this one needs {wanted}, past its quota of gpus "
            f"({quotas['gpus']:g})"
        )
    return None


def check_storage(session: Session, project_seq: int, adding: int, *, lock: bool = True) -> None:
    """403 ``quota_exceeded`` when ``adding`` bytes would take the project past ``stored_bytes``.
    ``lock``: the project's row locked until the caller's commit (PostgreSQL), for a caller that then
    writes what it adds (two uploads never both fit the last room); a caller that only asks for work
    (a merge, a Tinker save) checks without it, holding no lock over its calls to Redis."""
    from service.tenancy import usage

    cap = limit_of(session, project_seq, "stored_bytes")
    if cap is None:
        return
    if lock:
        lock_project(session, project_seq)
    stored = usage.stored_bytes(session, project_seq)
    if stored + adding > cap:
        raise Forbidden(
            f"This project stores {stored} bytes and this would add {adding}, past its quota of stored_bytes "
            f"({int(cap)}): delete files (DELETE /v1/files/{{id}}), fine-tuned models (their merged exports) or "
            "Tinker checkpoints, or ask the operator for more.",
            code="quota_exceeded",
        )


DAY_QUOTAS = {"device_hours_per_day": "device-hours", "cost_per_day": "spent"}


def _day_use(session: Session, project_seq: int, name: str) -> float:
    """The project's use in the last 24 hours, in ``name``'s unit: device-hours, or their cost."""
    from service.core.settings import get_settings
    from service.tenancy import usage

    since = time.time() - 86400
    if name == "cost_per_day":
        return usage.cost(session, get_settings().accelerator_prices, project_seq=project_seq, since=since)
    return usage.device_hours(session, project_seq, since=since)


def _day_spent(session: Session, project_seq: int, limits: dict[str, float]) -> tuple[str, str, float, float] | None:
    """The first day quota of ``limits`` the project has used up in the last 24 hours, as (name, unit,
    used, limit), or None."""
    for name, unit in DAY_QUOTAS.items():
        cap = limits.get(name)
        if cap is not None and (used := _day_use(session, project_seq, name)) >= cap:
            return name, unit, used, cap
    return None


def check_device_hours(session: Session, project_seq: int, limits: dict[str, float]) -> None:
    """429 when the project (its quotas ``limits``) used its ``device_hours_per_day`` (or spent its
    ``cost_per_day``) in the last 24 hours, saying when the oldest of that use leaves the window."""
    from service.tenancy import usage

    if (spent := _day_spent(session, project_seq, limits)) is None:
        return
    name, unit, used, cap = spent
    now = time.time()
    frees = usage.window_frees_at(session, project_seq, since=now - 86400)
    raise LimitReached(
        f"This project used {used:.2f} {unit} in the last 24 hours, its quota of {name} ({cap:g}); it frees up "
        f"from {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(frees))}.",
        code="quota_exceeded",
        retry_after=max(1.0, frees - now),
    )


def over_budget(session: Session, job: Job) -> str | None:
    """Why a running ``job`` must pause now (its own budget in device-hours or money, or its project's
    day), or None."""
    from service.core.settings import get_settings
    from service.tenancy import usage

    budget = job.budget or {}
    if budget.get("device_hours") is not None:
        spent = usage.device_hours_of(session, job.id)
        if spent >= budget["device_hours"]:
            limit = budget["device_hours"]
            return f"Paused: the job used {spent:.3f} device-hours, its budget ({limit:g}); resume it to go on."
    if budget.get("cost") is not None:
        spent = usage.cost(session, get_settings().accelerator_prices, subject=job.id)
        if spent >= budget["cost"]:
            return (
                f"Paused: the job's device time cost {spent:.3f}, its budget ({budget['cost']:g}); resume it to go on."
            )
    if (day := _day_spent(session, job.project_seq, quotas_of(session, job.project_seq))) is None:
        return None
    name, unit, used, cap = day
    return (
        f"Paused: the project used {used:.3f} {unit} in the last 24 hours, its quota of {name} ({cap:g}); "
        "resume it once that frees up."
    )


def project_quotas(project: Project) -> dict[str, Any]:
    return {name: (project.quotas or {}).get(name) for name in QUOTAS}

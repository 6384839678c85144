"""Metered usage: what each job and each key's inference used, by hour
(``usage_records``: one row a subject, kind, accelerator and hour, added to as it runs), read back
per project by ``GET /v1/usage`` and the quotas; and what a project stores now.

Kinds: ``device_seconds`` (by accelerator kind: the devices a job held, times the wall time between
its steps), ``tokens_trained``, ``tokens_sampled`` (rollout completions), ``reward_model_tokens``
(what a job's reward models and embedding models read, beside the policy or on the inference
workers), ``judge_tokens`` (what its judges read and wrote), ``inference_tokens`` (prompt and
completion tokens of chat and text completions)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.core.tables import Checkpoint, File, Job, Project, TinkerCheckpoint, TinkerModel, UsageRecord

KINDS = (
    "device_seconds", "tokens_trained", "tokens_sampled", "reward_model_tokens", "judge_tokens", "inference_tokens",
)  # fmt: skip
GROUPS = ("project", "kind", "subject", "day", "accelerator")


def hour_of(t: float) -> int:
    return int(t // 3600 * 3600)


def add(
    session: Session,
    *,
    project_seq: int,
    subject: str,
    kind: str,
    amount: float,
    accelerator: str = "",
    at: float | None = None,
) -> None:
    """Add ``amount`` of ``kind`` to ``subject``'s hour (in the caller's transaction)."""
    if amount <= 0:
        return
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    values = {
        "project_seq": project_seq,
        "subject": subject[:128],
        "kind": kind,
        "accelerator": accelerator[:32],
        "hour": hour_of(time.time() if at is None else at),
        "amount": float(amount),
    }
    stmt = insert(UsageRecord).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["subject", "kind", "accelerator", "hour"],
        set_={"amount": UsageRecord.amount + stmt.excluded.amount},
    )
    session.execute(stmt)


def _device_time(
    *, subject: str | None = None, project_seq: int | None = None, since: float | None = None
) -> list[Any]:
    """The rows of device time of one subject or of a project, from ``since`` on in whole hours: an hour
    that began before ``since`` counts in full when it ends after it, so a day's use is never under-counted."""
    where: list[Any] = [UsageRecord.kind == "device_seconds"]
    if subject is not None:
        where.append(UsageRecord.subject == subject)
    if project_seq is not None:
        where.append(UsageRecord.project_seq == project_seq)
    if since is not None:
        where.append(UsageRecord.hour > since - 3600)
    return where


def device_hours(session: Session, project_seq: int, *, since: float) -> float:
    """The project's device-hours from ``since`` on (whole hours, as ``_device_time``)."""
    seconds = session.scalar(
        select(func.sum(UsageRecord.amount)).where(*_device_time(project_seq=project_seq, since=since))
    )
    return float(seconds or 0.0) / 3600


def window_frees_at(session: Session, project_seq: int, *, since: float) -> float:
    """When the oldest hour of use counted from ``since`` leaves a 24-hour window."""
    oldest = session.scalar(
        select(func.min(UsageRecord.hour)).where(*_device_time(project_seq=project_seq, since=since))
    )
    return float((oldest or hour_of(time.time())) + 3600 + 86400)


def device_hours_of(session: Session, subject: str) -> float:
    seconds = session.scalar(select(func.sum(UsageRecord.amount)).where(*_device_time(subject=subject)))
    return float(seconds or 0.0) / 3600


def cost(session: Session, prices: dict[str, float], *, subject: str | None = None, project_seq: int | None = None,
         since: float | None = None) -> float:  # fmt: skip
    """What device-hours cost at the operator's ``prices`` (a kind without a price costs nothing), of one
    subject or of a project from ``since`` on (whole hours, as ``device_hours``)."""
    where = _device_time(subject=subject, project_seq=project_seq, since=since)
    stmt = select(UsageRecord.accelerator, func.sum(UsageRecord.amount)).where(*where)
    rows = session.execute(stmt.group_by(UsageRecord.accelerator)).all()
    return sum(float(seconds) / 3600 * prices.get(kind, 0.0) for kind, seconds in rows)


def stored_bytes(session: Session, project_seq: int) -> int:
    """What the project stores now: its files' bytes, its jobs' checkpoints' (as recorded at save)
    and their merged exports' (as merged), and its Tinker training models' saved checkpoints'."""
    files = session.scalar(select(func.sum(File.bytes)).where(File.project_seq == project_seq))
    checkpoints = session.execute(
        select(func.sum(Checkpoint.bytes), func.sum(Checkpoint.export_bytes))
        .join(Job, Job.seq == Checkpoint.job_seq)
        .where(Job.project_seq == project_seq)
    ).one()
    tinker = session.scalar(
        select(func.sum(TinkerCheckpoint.size_bytes))
        .join(TinkerModel, TinkerModel.seq == TinkerCheckpoint.model_seq)
        .where(TinkerModel.project_seq == project_seq)
    )
    return sum(int(n or 0) for n in (files, *checkpoints, tinker))


def note_export(session: Session, checkpoint_id: str, size: int) -> None:
    """The bytes of ``checkpoint_id``'s merged export, as merged (in the caller's transaction). What is
    on disk is counted: a deleted model's checkpoints stay (a model trained from one needs them), and
    an export made of one after the deletion is stored as theirs are."""
    session.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(export_bytes=size))


def exports_removed(session: Session, *, job_seq: int) -> None:
    """A job's merged exports are no longer stored (its model was deleted; in the caller's transaction)."""
    session.execute(update(Checkpoint).where(Checkpoint.job_seq == job_seq).values(export_bytes=None))


def summary(
    session: Session,
    *,
    project_seq: int | None,
    start: float,
    end: float,
    group_by: list[str],
    prices: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Usage between ``start`` and ``end`` (whole hours), summed by ``group_by`` (always by kind);
    device-seconds with their device-hours and, at the operator's ``prices``, their cost."""
    wanted = list(dict.fromkeys([*group_by, "kind"]))
    groups = list(dict.fromkeys([*wanted, "accelerator"]))  # device time is priced by its kind
    columns: dict[str, Any] = {
        "project": Project.id,
        "kind": UsageRecord.kind,
        "subject": UsageRecord.subject,
        "accelerator": UsageRecord.accelerator,
        "day": (UsageRecord.hour - UsageRecord.hour % 86400),
    }
    chosen = [columns[g].label(g) for g in groups]
    stmt = (
        select(*chosen, func.sum(UsageRecord.amount).label("amount"))
        .join(Project, Project.seq == UsageRecord.project_seq)
        .where(UsageRecord.hour >= hour_of(start), UsageRecord.hour < end)
        .group_by(*chosen)
        .order_by(*chosen)
    )
    if project_seq is not None:
        stmt = stmt.where(UsageRecord.project_seq == project_seq)
    summed: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in session.execute(stmt):
        key = tuple(getattr(row, g) for g in wanted)
        item = summed.setdefault(key, {**dict(zip(wanted, key, strict=True)), "amount": 0.0})
        item["amount"] += float(row.amount)
        if row.kind == "device_seconds" and prices:
            item["cost"] = item.get("cost", 0.0) + float(row.amount) / 3600 * prices.get(row.accelerator, 0.0)
    for item in summed.values():
        if item["kind"] == "device_seconds":
            item["device_hours"] = round(item["amount"] / 3600, 6)
        if "cost" in item:
            item["cost"] = round(item["cost"], 6)
    return list(summed.values())

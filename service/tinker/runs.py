"""What the SDK's ``RestClient`` asks of training runs (Tinker's name for a training model) and their
checkpoints: runs and checkpoints listed a page at a time, one run described, a checkpoint deleted,
its time to live set, its files handed out as download links, expired checkpoints swept away.

Everything is within the caller's project: another project's run or checkpoint is as unknown as one
that never was. A download link is a random token kept in Redis for an hour (any API process
answers it; nothing to sign, no secret to rotate), naming the checkpoint's files, which are read
from the artifacts root and nowhere else.
"""

from __future__ import annotations

import json
import math
import secrets
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.core.db import write_lock
from service.core.errors import Invalid, NotFound
from service.core.tables import Job, TinkerCheckpoint, TinkerModel, TinkerSession, TinkerStep, now
from service.registry.finetuned import live_tinker_checkpoints
from service.tinker import bus
from service.tinker.sessions import TinkerPath, describe_checkpoint, find_checkpoint, get_model

DOWNLOAD_SECONDS = 3600
"""How long a download link answers."""
MAX_TTL_SECONDS = 10 * 365 * 86400


def _live(query: Any) -> Any:
    return query.where(live_tinker_checkpoints())


def _iso(seconds: float | int | None) -> str | None:
    from datetime import UTC, datetime

    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat()


def _checkpoint(row: TinkerCheckpoint, model_id: str) -> dict[str, Any]:
    described = describe_checkpoint(row, model_id)
    described["time"], described["expires_at"] = _iso(row.created_at), _iso(row.expires_at)
    return described


# Runs -------------------------------------------------------------------------------------------------------
CURVE_POINTS = 30
"""The points of a run's ``loss_curve`` (the dashboard's list of runs draws it, 30 bars)."""


def loss_summaries(session: Session, models: list[TinkerModel]) -> dict[int, dict[str, Any]]:
    """Beyond the SDK, for the dashboard's list of runs in two queries however many and long the
    runs: each model's steps up to the one its weights are at (a model loaded back keeps its later
    rows until its next step rewrites them) in at most ``CURVE_POINTS`` equal spans, each span's loss
    over what it counted (``loss_curve``), and its last such step (``last_step``, ``last_mean_loss``,
    ``loss_fn``)."""
    if not models:
        return {}
    seqs = [m.seq for m in models]
    span = (TinkerStep.step * CURVE_POINTS) // (TinkerModel.steps + 1)
    held = TinkerStep.model_seq.in_(seqs) & (TinkerStep.step <= TinkerModel.steps)
    counted = TinkerStep.loss.is_not(None) & (TinkerStep.counted > 0)
    buckets = session.execute(
        select(TinkerStep.model_seq, span, func.sum(TinkerStep.loss), func.sum(TinkerStep.counted))
        .join(TinkerModel, TinkerModel.seq == TinkerStep.model_seq)
        .where(held, counted)
        .group_by(TinkerStep.model_seq, span)
        .order_by(TinkerStep.model_seq, span)
    ).all()
    newest = (
        select(TinkerStep.model_seq, func.max(TinkerStep.step).label("step"))
        .join(TinkerModel, TinkerModel.seq == TinkerStep.model_seq)
        .where(held)
        .group_by(TinkerStep.model_seq)
        .subquery()
    )
    last = (TinkerStep.model_seq == newest.c.model_seq) & (TinkerStep.step == newest.c.step)
    lasts = session.scalars(select(TinkerStep).join(newest, last)).all()
    summaries: dict[int, dict[str, Any]] = {
        m.seq: {"last_step": None, "last_mean_loss": None, "loss_fn": None, "loss_curve": []} for m in models
    }
    for model_seq, _span, loss, total in buckets:
        summaries[model_seq]["loss_curve"].append(_finite(float(loss or 0.0) / float(total)))  # counted: not null
    for step in lasts:
        summaries[step.model_seq].update(last_step=step.step, last_mean_loss=_mean_loss(step), loss_fn=step.loss_fn)
    return summaries


def describe_run(
    session: Session, row: TinkerModel, owner: str, summary: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The SDK's ``TrainingRun``: the model, its LoRA rank, its newest state and sampler weights;
    and, beyond it (the SDK ignores fields it does not know), ``loss_summary`` (``loss_summaries``)."""
    newest: dict[str, TinkerCheckpoint] = {}
    for checkpoint in session.scalars(
        _live(select(TinkerCheckpoint).where(TinkerCheckpoint.model_seq == row.seq)).order_by(
            TinkerCheckpoint.created_at, TinkerCheckpoint.seq
        )
    ):
        newest[checkpoint.kind] = checkpoint
    return {
        "training_run_id": row.id,
        "base_model": row.base_model,
        "model_owner": owner,
        "is_lora": row.lora is not None,
        "corrupted": False,
        "lora_rank": (row.lora or {}).get("rank"),
        "last_request_time": _iso(row.last_request_at or row.created_at),
        "last_checkpoint": _checkpoint(newest["weights"], row.id) if "weights" in newest else None,
        "last_sampler_checkpoint": (
            _checkpoint(newest["sampler_weights"], row.id) if "sampler_weights" in newest else None
        ),
        "user_metadata": row.user_metadata or None,
        "loss_summary": summary if summary is not None else loss_summaries(session, [row])[row.seq],
    }


def list_runs(session: Session, *, project: int, owner: str, limit: int, offset: int) -> dict[str, Any]:
    """The project's training runs, newest first, a page at a time (the SDK's ``TrainingRunsResponse``)."""
    where = TinkerModel.project_seq == project
    total = session.scalar(select(func.count()).select_from(TinkerModel).where(where)) or 0
    rows = session.scalars(
        select(TinkerModel).where(where).order_by(TinkerModel.seq.desc()).limit(limit).offset(offset)
    ).all()
    summaries = loss_summaries(session, list(rows))
    return {
        "training_runs": [describe_run(session, row, owner, summaries[row.seq]) for row in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


def get_run(session: Session, *, project: int, model_id: str, owner: str) -> dict[str, Any]:
    return describe_run(session, get_model(session, project=project, model_id=model_id), owner)


def _finite(value: float | None) -> float | None:
    """A loss as JSON can say it: a diverged one (NaN, infinite) is null."""
    return value if value is not None and math.isfinite(value) else None


def _mean_loss(row: TinkerStep) -> float | None:
    """A step's loss over what it counted (the mean NLL a token for ``cross_entropy``)."""
    return _finite(row.loss / row.counted) if row.loss is not None and row.counted > 0 else None


def list_steps(session: Session, *, project: int, model_id: str, after: int, limit: int) -> dict[str, Any]:
    """A run's steps after step ``after``, oldest first (beyond the SDK: the dashboard's loss curve):
    each one's loss summed over its ``forward_backward`` calls, what it was
    counted over, their mean (``mean_loss``; the mean NLL a token for ``cross_entropy``) and AdamW's
    metrics."""
    model = get_model(session, project=project, model_id=model_id)
    rows = session.scalars(
        select(TinkerStep)
        .where(TinkerStep.model_seq == model.seq, TinkerStep.step > after)
        .order_by(TinkerStep.step)
        .limit(limit + 1)
    ).all()
    return {
        "object": "list",
        "model_id": model.id,
        "data": [
            {
                "step": row.step,
                "loss_fn": row.loss_fn,
                "loss": _finite(row.loss),
                "counted": _finite(row.counted),
                "mean_loss": _mean_loss(row),
                "datums": row.datums,
                "tokens": row.tokens,
                "metrics": row.metrics,
                "created_at": row.created_at,
            }
            for row in rows[:limit]
        ],
        "has_more": len(rows) > limit,
    }


def weights_info(session: Session, *, project: int, path: TinkerPath) -> dict[str, Any]:
    """The SDK's ``WeightsInfoResponse``: what a training client made from this checkpoint would be."""
    find_checkpoint(session, project=project, path=path)
    model = get_model(session, project=project, model_id=path.model_id, param="tinker_path")
    lora = model.lora or {}
    return {
        "base_model": model.base_model,
        "optimizer_config": model.optimizer or {"type": "adamw"},
        "is_lora": model.lora is not None,
        "lora_rank": lora.get("rank"),
        "train_unembed": lora.get("train_unembed"),
        "train_mlp": lora.get("train_mlp"),
        "train_attn": lora.get("train_attn"),
    }


# Checkpoints ------------------------------------------------------------------------------------------------
def list_checkpoints(session: Session, *, project: int, model_id: str) -> dict[str, Any]:
    """One run's live checkpoints, oldest first (the SDK's ``CheckpointsListResponse``, unpaged)."""
    model = get_model(session, project=project, model_id=model_id)
    rows = session.scalars(
        _live(select(TinkerCheckpoint).where(TinkerCheckpoint.model_seq == model.seq)).order_by(
            TinkerCheckpoint.created_at, TinkerCheckpoint.seq
        )
    ).all()
    return {"checkpoints": [_checkpoint(row, model.id) for row in rows], "cursor": None}


def list_user_checkpoints(session: Session, *, project: int, limit: int, offset: int) -> dict[str, Any]:
    """Every live checkpoint of the project, newest first, a page at a time."""
    query = _live(
        select(TinkerCheckpoint, TinkerModel.id)
        .join(TinkerModel, TinkerModel.seq == TinkerCheckpoint.model_seq)
        .where(TinkerModel.project_seq == project)
    )
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.execute(
        query.order_by(TinkerCheckpoint.created_at.desc(), TinkerCheckpoint.seq.desc()).limit(limit).offset(offset)
    ).all()
    return {
        "checkpoints": [_checkpoint(row, model_id) for row, model_id in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


def delete_checkpoint(session: Session, *, project: int, path: TinkerPath, artifacts_dir: Path) -> None:
    """The checkpoint's row deleted and committed, then its files. Refused: the state a model
    resumes from (it would start again from its base the next time a worker takes it), and weights
    a job started from."""
    with write_lock(session):
        row = find_checkpoint(session, project=project, path=path, param="checkpoint_id")
        _not_resumed_from(session, project, path, row, "delete")
        session.delete(row)
        session.commit()
    shutil.rmtree(artifacts_dir / row.path, ignore_errors=True)


def _not_resumed_from(session: Session, project: int, path: TinkerPath, row: TinkerCheckpoint, verb: str) -> None:
    """Refused: the state a model resumes from, and weights a fine-tuning job started from (its
    model, and every job after it, is made of them)."""
    started = session.scalar(select(Job.id).where(Job.project_seq == project, Job.model == str(path)).limit(1))
    if started is not None:
        raise Invalid(
            f"'{path}' is what the fine-tuning job {started} started from: its model is made of these weights, "
            f"so they cannot be {'deleted' if verb == 'delete' else 'given a time to live'}",
            param="checkpoint_id",
            code="checkpoint_in_use",
        )
    model = get_model(session, project=project, model_id=path.model_id)
    if model.state_path == row.path:
        raise Invalid(
            f"'{path}' is the state '{model.id}' resumes from when a worker takes it again: save another state "
            f"first, or do not {verb} it",
            param="checkpoint_id",
            code="checkpoint_in_use",
        )


def set_ttl(session: Session, *, project: int, path: TinkerPath, ttl_seconds: int | None) -> None:
    """The checkpoint expires ``ttl_seconds`` from now (None: never); the caller commits."""
    if ttl_seconds is not None and not 0 < ttl_seconds <= MAX_TTL_SECONDS:
        raise Invalid(
            f"ttl_seconds must be between 1 and {MAX_TTL_SECONDS} (or null: never expires)",
            param="ttl_seconds",
        )
    row = find_checkpoint(session, project=project, path=path, param="checkpoint_id")
    if ttl_seconds is not None:
        _not_resumed_from(session, project, path, row, "expire")
    row.expires_at = now() + ttl_seconds if ttl_seconds is not None else None


def sweep_expired(session: Session, artifacts_dir: Path, *, limit: int = 200) -> int:
    """Expired checkpoints' rows and files, but the state a model resumes from (a later save_state
    may have given it a time to live). The reconciler calls it every round; its count."""
    resumed = select(TinkerModel.state_path).where(TinkerModel.state_path.is_not(None))
    rows = session.scalars(
        select(TinkerCheckpoint)
        .where(TinkerCheckpoint.expires_at <= now(), TinkerCheckpoint.path.not_in(resumed))
        .order_by(TinkerCheckpoint.seq)
        .limit(limit)
    ).all()
    for row in rows:
        session.delete(row)
    session.commit()
    for row in rows:
        shutil.rmtree(artifacts_dir / row.path, ignore_errors=True)
    return len(rows)


# Downloads --------------------------------------------------------------------------------------------------
def _download_key(token: str) -> str:
    return f"{bus.prefix()}:download:{token}"


def checkpoint_files(directory: Path) -> list[str]:
    """The checkpoint's files, relative to its directory (links and anything outside left out)."""
    root = directory.resolve()
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and p.resolve().is_relative_to(root)
    )


def download_links(
    conn: Any, session: Session, *, project: int, path: TinkerPath, artifacts_dir: Path, base_url: str
) -> dict[str, Any]:
    """The SDK's ``ExternalWeightsUrlsResponse`` for any checkpoint: one link per file, answering
    for an hour without a key (as a signed URL does)."""
    row = find_checkpoint(session, project=project, path=path, param="checkpoint_id")
    files = checkpoint_files(artifacts_dir / row.path)
    if not files:
        raise NotFound(f"'{path}' has no files left on the server.", param="checkpoint_id", code="checkpoint_not_found")
    token = secrets.token_urlsafe(24)
    conn.set(_download_key(token), json.dumps({"dir": row.path, "files": files}), ex=DOWNLOAD_SECONDS)
    return {
        "urls": {name: f"{base_url}/api/v1/downloads/{token}/{quote(name)}" for name in files},
        "expires": _iso(time.time() + DOWNLOAD_SECONDS),
    }


def downloadable(conn: Any, token: str, name: str, artifacts_dir: Path) -> Path:
    """The file a download link names, or NotFound (an unknown or expired token, a file it does not list)."""
    raw = conn.get(_download_key(token)) if 16 <= len(token) <= 64 else None
    granted = json.loads(raw) if raw else None
    if granted is None or name not in granted["files"]:
        raise NotFound("This download link is unknown or has expired: ask for new links.", param="url")
    path: Path = (artifacts_dir / str(granted["dir"]) / name).resolve()
    if not path.is_relative_to(artifacts_dir.resolve()) or not path.is_file():
        raise NotFound("This checkpoint's file is gone from the server.", param="url")
    return path


def session_ids(session: Session, *, project: int, limit: int, offset: int) -> list[str]:
    rows = session.scalars(
        select(TinkerSession.id)
        .where(TinkerSession.project_seq == project)
        .order_by(TinkerSession.seq.desc())
        .limit(limit)
        .offset(offset)
    ).all()
    return list(rows)


def describe_session(session: Session, *, project: int, session_id: str) -> dict[str, Any]:
    """The SDK's ``GetSessionResponse``: its training runs (sampling sessions are not stored)."""
    from service.tinker.sessions import get_session

    row = get_session(session, project=project, session_id=session_id)
    runs = session.scalars(select(TinkerModel.id).where(TinkerModel.session_seq == row.seq).order_by(TinkerModel.seq))
    return {
        "training_run_ids": list(runs),
        "sampler_ids": [],
        "user_metadata": row.user_metadata or None,
        "display_name": row.display_name,
    }

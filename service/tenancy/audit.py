"""The audit log: one row per mutating request and per admin action (key, project, action, object,
outcome, client address, time), never a secret.

A request's row is written in the request's own transaction where its handler commits (a
``before_commit`` hook on the request's session: the change and its row land together, or neither),
and after its answer where nothing was committed (a refusal, a failure): ``AuditContext`` carries
what the API knows of the request to both places. ``rloo`` CLI admin actions write theirs with
``record``. Old rows go after ``RLOO_AUDIT_RETENTION_DAYS`` (``sweep``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, event, select, update
from sqlalchemy.orm import Session

from service.core.crud import Caller
from service.core.tables import (
    ApiKey,
    AuditEvent,
    Eval,
    Evaluation,
    File,
    Job,
    Project,
    WebhookEndpoint,
    now,
)

CREATED_OBJECTS = (Job, File, ApiKey, Project, WebhookEndpoint, Eval, Evaluation)
"""What a create request makes: the first of these a committing request adds is its row's object."""
SUCCEEDED, REFUSED, FAILED = "succeeded", "refused", "failed"


@dataclass
class AuditContext:
    """One audited request: filled by the API as it learns it (the method and client first, then, once
    the route is known, its caller, action and the object its path names)."""

    method: str
    client: str
    caller: Caller | None = None
    action: str = ""
    object_id: str | None = None
    created: str | None = None  # the first object the request's session flushed into being
    project_seq: int | None = None  # the project acted on, where not the caller's (an operator's action)
    written: str | None = None  # the id of the row written in the request's transaction


def attach(session: Session, context: AuditContext) -> None:
    """Make ``session`` (a request's) write the request's row in its first commit."""
    session.info["audit"] = context


def concerns(session: Session, project_seq: int) -> None:
    """The request acts on this project (an operator's on a tenant's): its row goes in that project's
    log, where the tenant's admin reads it."""
    context: AuditContext | None = session.info.get("audit")
    if context is not None:
        context.project_seq = project_seq


@event.listens_for(Session, "before_commit")
def _write_in_transaction(session: Session) -> None:
    context: AuditContext | None = session.info.get("audit")
    if context is None or context.caller is None or context.written is not None:
        return
    object_id = context.object_id or context.created or _created_object(session)
    row = _row(context, object_id=object_id, outcome=SUCCEEDED, status=200)
    session.add(row)
    context.written = row.id


@event.listens_for(Session, "after_flush")
def _note_created(session: Session, flush_context: Any) -> None:
    """An object flushed before the commit (to learn its id) is no longer new at the commit."""
    context: AuditContext | None = session.info.get("audit")
    if context is not None and context.created is None:
        context.created = _created_object(session)


def _created_object(session: Session) -> str | None:
    for obj in session.new:
        if isinstance(obj, CREATED_OBJECTS):
            return obj.id
    return None


def _row(context: AuditContext, *, object_id: str | None, outcome: str, status: int, code: str | None = None) -> Any:
    caller = context.caller
    assert caller is not None
    row = AuditEvent(
        project_seq=context.project_seq or caller.seq,
        key_id=caller.key_id,
        operator=caller.operator,
        action=context.action[:256],
        object_id=(object_id or None) and object_id[:256],
        outcome=outcome,
        status=status,
        error_code=(code or None) and code[:64],
        client=context.client[:64],
    )
    row.id = AuditEvent.new_id()
    return row


def finish(session: Session, context: AuditContext, *, status: int, code: str | None) -> None:
    """After the answer: the outcome of a request whose row was written with its change (only where
    the answer was not the 200 assumed there), or the row of one that committed nothing."""
    outcome = SUCCEEDED if status < 400 else REFUSED if status < 500 else FAILED
    if context.written is not None:
        if status != 200:
            session.execute(
                update(AuditEvent)
                .where(AuditEvent.id == context.written)
                .values(status=status, outcome=outcome, error_code=code and code[:64])
            )
            session.commit()
        return
    if context.caller is None:
        return
    session.add(_row(context, object_id=context.object_id, outcome=outcome, status=status, code=code))
    session.commit()


def record(session: Session, *, caller: Caller, action: str, object_id: str | None, client: str = "cli") -> None:
    """An admin action outside a request (``rloo keys create``, ``rloo projects archive``), in the
    caller's transaction."""
    context = AuditContext(method="", client=client, caller=caller, action=action)
    session.add(_row(context, object_id=object_id, outcome=SUCCEEDED, status=200))


def sweep(session: Session, *, retention_days: float, limit: int = 5000) -> int:
    """Delete up to ``limit`` rows older than ``retention_days`` (0: keep for ever)."""
    if retention_days <= 0:
        return 0
    cutoff = now() - int(retention_days * 86400)
    seqs = session.scalars(select(AuditEvent.seq).where(AuditEvent.created_at < cutoff).limit(limit)).all()
    if seqs:
        session.execute(delete(AuditEvent).where(AuditEvent.seq.in_(seqs)))
        session.commit()
    return len(seqs)


def audit_object(row: Any, projects: dict[int, str]) -> dict[str, Any]:
    return {
        "object": "audit_event",
        "id": row.id,
        "created_at": row.created_at,
        "project_id": projects.get(row.project_seq),
        "key_id": row.key_id,
        "operator": row.operator,
        "action": row.action,
        "object_id": row.object_id,
        "outcome": row.outcome,
        "status": row.status,
        "error_code": row.error_code,
        "client": row.client,
    }

"""The ends of an evaluation engine's run (an eval's run, or a job's checkpoint evaluation) by the
tenant's hand: cancelled through its route, or because what it reads is gone (its file deleted, its
model deleted). One conditional UPDATE of the rows still queued or running, and an eval run's
``eval.run.canceled`` webhook in the same transaction; their inference worker sees it at its next
heartbeat and stops (``worker.serving.evaluate``).

Statuses are stored as the engine's (``queued``, ``running``, ``succeeded``, ``failed``,
``cancelled``) and an eval run answers OpenAI's names for them (``OPENAI_STATUS``)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.core.tables import Evaluation
from service.jobs import webhooks

UNFINISHED = ("queued", "running")
OPENAI_STATUS = {
    "queued": "queued",
    "running": "in_progress",
    "succeeded": "completed",
    "failed": "failed",
    "cancelled": "canceled",
}
EVENT = {"succeeded": "eval.run.succeeded", "failed": "eval.run.failed", "cancelled": "eval.run.canceled"}
"""The webhook an eval run's end sends."""
NO_ERROR = {"code": "", "message": ""}
"""An eval run's (and a sample's) ``error`` when there is none: OpenAI's schema has no null there."""


def cancel(session: Session, *where: Any, code: str, message: str) -> int:
    """Cancel the unfinished evaluations and eval runs ``where`` says (added to ``session``, not
    committed), with each eval run's webhook: only for the rows this very UPDATE moved (a run its
    worker ended meanwhile is not announced twice); how many."""
    moved = session.execute(
        update(Evaluation)
        .where(Evaluation.status.in_(UNFINISHED), *where)
        .values(status="cancelled", error={"code": code, "message": message}, finished_at=int(time.time()))
        .returning(Evaluation.project_seq, Evaluation.id, Evaluation.eval_seq)
        .execution_options(synchronize_session=False)
    ).all()
    for project_seq, run_id, eval_seq in moved:
        if eval_seq is not None:
            webhooks.enqueue_for(session, project_seq, run_id, EVENT["cancelled"])
    return len(moved)


def ended(session: Session, run: Evaluation, status: str) -> None:
    """An eval run's end (``succeeded`` or ``failed``) announced: its webhook, in ``session``."""
    if run.eval_seq is not None:
        webhooks.enqueue_for(session, run.project_seq, run.id, EVENT[status])


def cancel_for_model(session: Session, project_seq: int, model_id: str) -> int:
    """Cancel the project's unfinished eval runs that a deleted fine-tuned model (or one of its
    checkpoints) answers."""
    rows = session.execute(
        select(Evaluation.seq, Evaluation.models).where(
            Evaluation.project_seq == project_seq, Evaluation.eval_seq.is_not(None), Evaluation.status.in_(UNFINISHED)
        )
    )
    seqs = [seq for seq, models in rows if any(_of_model(m.get("model"), model_id) for m in models or [])]
    if not seqs:
        return 0
    return cancel(session, Evaluation.seq.in_(seqs), code="model_deleted", message=f"The model {model_id} was deleted.")


def _of_model(name: object, model_id: str) -> bool:
    return isinstance(name, str) and (name == model_id or name.startswith(model_id + ":ckpt-"))

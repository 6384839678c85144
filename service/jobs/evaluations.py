"""A checkpoint evaluation's end by the tenant's hand: cancelled through its route, or because what it
reads is gone (its file deleted, its job's model deleted). One conditional UPDATE of the rows still
queued or running; their inference worker sees it at its next heartbeat and stops
(``worker.serving.evaluate``)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from service.core.tables import Evaluation

UNFINISHED = ("queued", "running")


def cancel(session: Session, *where: Any, code: str, message: str) -> int:
    """Cancel the unfinished evaluations ``where`` says (added to ``session``, not committed); how many."""
    moved = session.execute(
        update(Evaluation)
        .where(Evaluation.status.in_(UNFINISHED), *where)
        .values(status="cancelled", error={"code": code, "message": message}, finished_at=int(time.time()))
        .execution_options(synchronize_session=False)
    )
    return int(moved.rowcount)  # type: ignore[attr-defined]

"""Wake-ups for a job's watchers: "job X has new rows", sent through Redis pub/sub after a commit.

The database is the source of every stream (``service.api.streams``); a wake-up only says when to read
it again. A transaction that adds a job's event or moves its status marks the job (``mark``); once
it commits, one PUBLISH per job goes to ``CHANNEL``, from whichever process wrote (the API or a
worker). A rolled back transaction sends nothing. Redis down costs nothing but latency: a publish
that fails stops publishing for a few seconds (no write waits on a dead Redis), and streams read the
database on their own now and then anyway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from service.core.settings import get_settings

log = logging.getLogger("rloo.wakeups")

CHANNEL = "rloo:job-wakeups"
_MARKED = "rloo_wake_jobs"
BACKOFF_SECONDS = 5.0
_down_until = 0.0


def mark(session: Session, job_id: str) -> None:
    """Wake ``job_id``'s watchers once this session's transaction commits."""
    session.info.setdefault(_MARKED, set()).add(job_id)


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    marked = session.info.pop(_MARKED, None)
    if marked:
        publish(marked)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_MARKED, None)


@lru_cache(maxsize=4)
def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)


def publish(job_ids: Iterable[str]) -> None:
    """One wake-up per job on ``CHANNEL``; never raises (a wake-up lost is a stream that reads a
    little later)."""
    global _down_until
    if time.monotonic() < _down_until:
        return
    try:
        pipe = _client(get_settings().redis_client_url).pipeline(transaction=False)
        for job_id in job_ids:
            pipe.publish(CHANNEL, job_id)
        pipe.execute()
    except Exception as exc:  # Redis down or slow: try again in a few seconds
        _down_until = time.monotonic() + BACKOFF_SECONDS
        log.warning("job wake-ups not sent for %.0f s (%s: %s)", BACKOFF_SECONDS, type(exc).__name__, exc)

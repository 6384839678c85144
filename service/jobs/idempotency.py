"""``Idempotency-Key`` on creations (``POST /files``, ``POST /fine_tuning/jobs``): a retried request
with the same key gets the first answer, not a second file or job.

The answer is stored in the same transaction as what the request created (one commit, so a request
answered 2xx always has its row, and a row always has its answer); a concurrent twin with the same
key loses on the unique constraint, rolls back and replays the winner's answer. The same key with a
different request is a 409. Keys are per project and route.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.errors import Conflict, bad_request
from service.core.tables import IdempotentRequest

HEADER = "Idempotency-Key"


def check_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise bad_request(f"{HEADER} must be 1 to 255 printable characters.", HEADER)
    return key


def request_hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def replay(session: Session, *, project_seq: int, route: str, key: str, digest: str) -> Any | None:
    """The answer stored for ``key`` (the route sends it again: ``service.api.responses.replayed``),
    or None; a 409 when the key came with another request."""
    row = session.scalar(
        select(IdempotentRequest).where(
            IdempotentRequest.project_seq == project_seq, IdempotentRequest.route == route, IdempotentRequest.key == key
        )
    )
    if row is None:
        return None
    if row.request_hash != digest:
        raise Conflict(
            f"{HEADER} '{key}' was used for a different request; send a new key for a new request.",
            param=HEADER,
            code="idempotency_key_reused",
        )
    return row.response


def remember(session: Session, *, project_seq: int, route: str, key: str, digest: str, response: Any) -> None:
    session.add(
        IdempotentRequest(project_seq=project_seq, route=route, key=key, request_hash=digest, response=response)
    )


def replay_after_conflict(session: Session, *, project_seq: int, route: str, key: str | None, digest: str) -> Any:
    """After an IntegrityError on commit: a concurrent twin with this key won; roll back and answer
    with its answer (stored, as ``replay`` gives it). Re-raises when there was no key, or no answer
    to replay (another conflict)."""
    if key is None:
        raise
    session.rollback()
    replayed = replay(session, project_seq=project_seq, route=route, key=key, digest=digest)
    if replayed is None:
        raise
    return replayed

"""Webhooks: the events a project's endpoints get, signed as OpenAI signs them, delivered at least once.

A job's state change (succeeded, failed, cancelled, paused; a checkpoint saved) writes one delivery
row per endpoint of its project that takes that event type, in the change's own transaction
(``enqueue``: an outbox). The workers' side sends them (``deliver_due``, in the reconciler's process
of every training worker), never the API request: a slow or dead receiver delays nothing else.

Each delivery is OpenAI's event, ``{id: "evt_…", object: "event", created_at, type, data: {id}}``,
POSTed with the Standard Webhooks headers ``webhook-id`` (the delivery's id, the same on every
attempt), ``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of
"id.timestamp.body">`` under the endpoint's ``whsec_`` secret, which the ``openai`` SDK's
``client.webhooks.unwrap`` verifies. A 2xx answer delivers it; a connection error, a time-out, a
408, 429 or 5xx is tried again after an exponential back-off with jitter, for
``RLOO_WEBHOOK_RETRY_HOURS``; any other answer fails it. No redirect is followed, an attempt has
``RLOO_WEBHOOK_TIMEOUT_SECONDS`` in all (lookup, connection, TLS, the request and the status line:
``service.infra.outbound``), and no answer's body is read. The URL is checked again before each attempt
and the connection made only to an address the rules admit (``service.infra.egress``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.core.settings import Settings, redact_url
from service.core.tables import Job, WebhookDelivery, WebhookEndpoint, new_token_id, now
from service.infra import egress, outbound

log = logging.getLogger("rloo.webhooks")

OPENAI_EVENT_TYPES = (
    "fine_tuning.job.succeeded",
    "fine_tuning.job.failed",
    "fine_tuning.job.cancelled",
    "eval.run.succeeded",
    "eval.run.failed",
    "eval.run.canceled",
)
OUR_EVENT_TYPES = ("fine_tuning.job.paused", "fine_tuning.job.checkpoint.created")
EVENT_TYPES = OPENAI_EVENT_TYPES + OUR_EVENT_TYPES
RETRIED_STATUSES = frozenset({408, 429})
ATTEMPTS = Counter("rloo_webhook_deliveries", "Webhook delivery attempts this process made, by outcome.", ["outcome"])


# Secrets and signatures ---------------------------------------------------------------------------
def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def hint(secret: str) -> str:
    """What an endpoint shows of its secret after creation (OpenAI's ``signing_secret_hint``)."""
    return f"whsec_…{secret[-4:]}"


def signature(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signing_secrets(endpoint: WebhookEndpoint, at: int) -> list[str]:
    """The endpoint's secret, and the rotated-out one while it is kept active."""
    keep_old = endpoint.old_secret and (endpoint.old_secret_until or 0) > at
    return [endpoint.secret, endpoint.old_secret] if keep_old else [endpoint.secret]  # type: ignore[list-item]


def body_of(payload: dict[str, Any]) -> bytes:
    """The exact bytes sent (and signed): the same on every attempt."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def headers_for(endpoint: WebhookEndpoint, delivery_id: str, body: bytes, at: int) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "user-agent": "rloo-service-webhooks",
        "webhook-id": delivery_id,
        "webhook-timestamp": str(at),
        "webhook-signature": " ".join(signature(s, delivery_id, at, body) for s in signing_secrets(endpoint, at)),
    }


# The outbox ----------------------------------------------------------------------------------------
def new_delivery_id() -> str:
    return new_token_id("msg")


def event(event_type: str, job_id: str, **data: Any) -> dict[str, Any]:
    return {
        "id": new_token_id("evt"),
        "object": "event",
        "created_at": now(),
        "type": event_type,
        "data": {"id": job_id, **data},
    }


def enqueue(session: Session, job: Job, event_type: str, **data: Any) -> int:
    """One delivery of ``event_type`` for ``job`` to each of its project's endpoints that take
    it, added to ``session`` (committed with the change that caused it). Returns how many."""
    return enqueue_for(session, job.project_seq, job.id, event_type, **data)


def enqueue_for(session: Session, project_seq: int, object_id: str, event_type: str, **data: Any) -> int:
    """``enqueue`` for any object of a project (an eval run: ``eval.run.succeeded``)."""
    endpoints = session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.project_seq == project_seq))
    payload = event(event_type, object_id, **data)
    count = 0
    for endpoint in endpoints:
        if event_type in (endpoint.event_types or ()):
            session.add(
                WebhookDelivery(
                    endpoint_seq=endpoint.seq, event_type=event_type, payload=payload, next_attempt_at=time.time()
                )
            )
            count += 1
    return count


# Sending -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attempt:
    status_code: int | None
    error: str | None

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    @property
    def retry(self) -> bool:
        code = self.status_code
        return code is None or code >= 500 or code in RETRIED_STATUSES


def send(endpoint: WebhookEndpoint, delivery_id: str, payload: dict[str, Any], settings: Settings) -> Attempt:
    """One attempt: the URL checked again, the event POSTed and signed to an address the rules admit,
    the answer's status judged, all within ``RLOO_WEBHOOK_TIMEOUT_SECONDS`` (``service.infra.outbound``)."""
    try:
        rule = egress.check_url(endpoint.url, settings.webhook_urls, resolve=None)
    except egress.RefusedURL as exc:
        return Attempt(None, f"refused: {exc}")
    body = body_of(payload)
    headers = headers_for(endpoint, delivery_id, body, now())
    try:
        reply = outbound.post(
            endpoint.url, body, headers=headers, seconds=settings.webhook_timeout_seconds, addresses=rule
        )
    except outbound.OutboundError as exc:  # no answer in time, a connection refused, an address refused
        return Attempt(None, redact_url(exc.reason)[:500])
    except Exception as exc:  # a bug of ours must not leave a delivery claimed for ever: an attempt that failed
        log.exception("webhook delivery %s: the attempt failed", delivery_id)
        return Attempt(None, f"{type(exc).__name__}: the attempt failed inside the server")
    return Attempt(reply.status, None if reply.ok else f"answered {reply.status}")


def backoff(attempts: int, base: float) -> float:
    """Seconds before attempt ``attempts + 1``: exponential, at most an hour, with full jitter in
    its upper half (so receivers that come back are not hit by every sender at once)."""
    ceiling = min(base * 2 ** max(attempts - 1, 0), 3600.0)
    return random.uniform(ceiling / 2, ceiling)


class InFlight:
    """What this process's senders are sending, by endpoint and by project: one attempt at a time an
    endpoint, at most ``per_project`` at once a project, and the project served longest ago first,
    so that a receiver that takes its whole time holds one sender, and one project at most
    ``per_project`` of them, never every delivery of every project."""

    def __init__(self, per_project: int) -> None:
        self.per_project = per_project
        self.lock = threading.Lock()
        self.endpoints: set[int] = set()
        self.projects: dict[int, int] = {}
        self.served: dict[int, float] = {}

    def take(self, candidates: list[tuple[int, int, float]]) -> tuple[int, int] | None:
        """Of ``(endpoint, project, due)`` rows (oldest due first), the one to send next, marked as
        being sent; None when every candidate's endpoint or project has its share in flight."""
        with self.lock:
            free = [
                (self.served.get(project, 0.0), due, endpoint, project)
                for endpoint, project, due in candidates
                if endpoint not in self.endpoints and self.projects.get(project, 0) < self.per_project
            ]
            if not free:
                return None
            _, _, endpoint, project = min(free)
            self.endpoints.add(endpoint)
            self.projects[project] = self.projects.get(project, 0) + 1
            self.served[project] = time.monotonic()
            return endpoint, project

    def done(self, endpoint: int, project: int) -> None:
        with self.lock:
            self.endpoints.discard(endpoint)
            self.projects[project] -= 1
            if not self.projects[project]:
                del self.projects[project]


SENDERS = 4
"""Threads sending deliveries in each reconciler process."""
IN_FLIGHT = InFlight(per_project=SENDERS // 2)
LEASE_MARGIN_SECONDS = 30.0


def lease_seconds(settings: Settings) -> float:
    """How long a claimed delivery is this sender's: longer than any attempt (whose deadline is
    total), so it is never claimed again while an attempt is in flight; due again after it (its
    sender died): at least once, never lost."""
    return settings.webhook_timeout_seconds + LEASE_MARGIN_SECONDS


def deliver_due(session: Session, settings: Settings, *, limit: int = 20, in_flight: InFlight = IN_FLIGHT) -> int:
    """Send up to ``limit`` deliveries that are due, one at a time, each taken fairly
    (``InFlight``) and claimed first (one conditional UPDATE: two senders never send one at once).
    Returns how many were attempted."""
    attempted = 0
    for _ in range(3 * limit):  # a claim another sender won costs a round, never a loop without end
        if attempted >= limit:
            break
        candidates = _due_endpoints(session)
        taken = in_flight.take(candidates)
        if taken is None:
            break
        endpoint_seq, project_seq = taken
        try:
            delivery, endpoint = _claim_oldest(session, endpoint_seq, settings)
            if delivery is None or endpoint is None:
                continue  # another sender has it, or its endpoint was deleted meanwhile
            attempt = send(endpoint, delivery.id, delivery.payload, settings)
            attempted += 1
            _record(session, delivery, attempt, settings, lease=delivery.next_attempt_at)
        finally:
            in_flight.done(endpoint_seq, project_seq)
    return attempted


def _due_endpoints(session: Session) -> list[tuple[int, int, float]]:
    """Each endpoint with deliveries due: (endpoint, project, its oldest due time), oldest first."""
    due = func.min(WebhookDelivery.next_attempt_at)
    rows = session.execute(
        select(WebhookDelivery.endpoint_seq, WebhookEndpoint.project_seq, due)
        .join(WebhookEndpoint, WebhookEndpoint.seq == WebhookDelivery.endpoint_seq)
        .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= time.time())
        .group_by(WebhookDelivery.endpoint_seq, WebhookEndpoint.project_seq)
        .order_by(due)
        .limit(200)
    ).all()
    session.rollback()
    return [(int(e), int(p), float(d)) for e, p, d in rows]


def _claim_oldest(
    session: Session, endpoint_seq: int, settings: Settings
) -> tuple[WebhookDelivery | None, WebhookEndpoint | None]:
    """The endpoint's oldest due delivery, claimed for this sender's lease (None: none left)."""
    row = session.execute(
        select(WebhookDelivery.seq, WebhookDelivery.next_attempt_at)
        .where(
            WebhookDelivery.endpoint_seq == endpoint_seq,
            WebhookDelivery.status == "pending",
            WebhookDelivery.next_attempt_at <= time.time(),
        )
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(1)
    ).first()
    if row is None:
        session.rollback()
        return None, None
    seq, was_due = row
    claimed = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.seq == seq, WebhookDelivery.next_attempt_at == was_due)
        .values(next_attempt_at=time.time() + lease_seconds(settings), attempts=WebhookDelivery.attempts + 1)
    ).rowcount  # type: ignore[attr-defined]
    session.commit()
    if not claimed:
        return None, None
    delivery = session.get(WebhookDelivery, seq, populate_existing=True)
    endpoint = session.get(WebhookEndpoint, delivery.endpoint_seq, populate_existing=True) if delivery else None
    session.rollback()  # no transaction held while the receiver answers
    return delivery, endpoint


def _record(session: Session, delivery: WebhookDelivery, attempt: Attempt, settings: Settings, *, lease: float) -> None:
    """The attempt's outcome, only while this sender's claim (``lease``) still holds: a sender
    whose lease ran out (another may be sending it now) writes nothing."""
    values: dict[str, Any] = {"last_status_code": attempt.status_code, "last_error": attempt.error}
    given_up = time.time() - delivery.created_at > settings.webhook_retry_hours * 3600
    if attempt.delivered:
        values.update(status="delivered", delivered_at=now())
        ATTEMPTS.labels("delivered").inc()
    elif attempt.retry and not given_up:
        values["next_attempt_at"] = time.time() + backoff(delivery.attempts, settings.webhook_retry_base_seconds)
        ATTEMPTS.labels("retry").inc()
    else:
        values["status"] = "failed"
        ATTEMPTS.labels("failed").inc()
        log.info("webhook delivery %s failed after %d attempts: %s", delivery.id, delivery.attempts, attempt.error)
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.seq == delivery.seq, WebhookDelivery.next_attempt_at == lease)
        .values(**values)
    )
    session.commit()


def deliver_forever(keep_going: Callable[[], bool], *, poll_seconds: float = 1.0) -> None:
    """Send due deliveries while ``keep_going()``: in ``SENDERS`` threads, each polling the outbox
    every ``poll_seconds`` when it found nothing to send."""
    from service.core.db import session_scope
    from service.core.settings import get_settings

    def loop() -> None:
        settings = get_settings()
        while keep_going():
            sent = 0
            try:
                with session_scope() as session:
                    sent = deliver_due(session, settings)
            except Exception as exc:  # the database is away: try again shortly
                log.warning("webhook deliveries: %s", exc)
            if not sent:
                time.sleep(poll_seconds)

    for i in range(SENDERS):
        threading.Thread(target=loop, name=f"webhooks-{i}", daemon=True).start()

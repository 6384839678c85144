"""Webhook endpoints, as OpenAI's ``/v1/webhook_endpoints`` (the ``openai`` SDK's
``client.webhooks``): create (the signing secret answered once), list, retrieve, update, delete,
rotate the secret, send a test event; plus ``GET …/{id}/deliveries``, each delivery's state.

Deliveries themselves are made by the workers' side (``service.jobs.webhooks``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy import func, select

from service.api.deps import PagingDep, ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON, page
from service.api.routing import StrictJSONRoute
from service.api.schemas.webhooks import WebhookCreate, WebhookRotate, WebhookTest, WebhookUpdate
from service.core.crud import Caller
from service.core.db import ends_session, run_db
from service.core.errors import bad_request, not_found
from service.core.settings import Settings
from service.core.tables import WebhookDelivery, WebhookEndpoint, now
from service.infra import egress, outbound
from service.jobs import webhooks

router = APIRouter(prefix="/v1/webhook_endpoints", route_class=StrictJSONRoute, tags=["webhooks"])

MAX_ENDPOINTS = 16
"""Webhook endpoints a project may have."""
KEEP_OLD_SECRET_SECONDS = 24 * 3600


def endpoint_object(e: WebhookEndpoint, *, with_secret: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": e.id,
        "object": "webhook_endpoint",
        "created_at": e.created_at,
        "updated_at": e.updated_at,
        "name": e.name,
        "url": e.url,
        "event_types": list(e.event_types),
        "signing_secret_hint": webhooks.hint(e.secret),
    }
    if with_secret:
        out["signing_secret"] = e.secret
    return out


def delivery_object(d: WebhookDelivery, endpoint: WebhookEndpoint) -> dict[str, Any]:
    return {
        "id": d.id,
        "object": "webhook_endpoint.delivery",
        "webhook_endpoint_id": endpoint.id,
        "event": d.payload,
        "status": d.status,
        "attempts": d.attempts,
        "last_status_code": d.last_status_code,
        "last_error": d.last_error,
        "created_at": d.created_at,
        "delivered_at": d.delivered_at,
        "next_attempt_at": int(d.next_attempt_at) if d.status == "pending" else None,
    }


def _endpoint(session: SessionDep, project: Caller, endpoint_id: str) -> WebhookEndpoint:
    e = session.scalar(
        select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.project_seq == project.seq)
    )
    if e is None:
        raise not_found("webhook endpoint", endpoint_id)
    return e


SENDS = outbound.Lanes(total=8, per_key=2)
"""A project's test events and URL lookups run two at a time in an API process (past that, 429), eight
in all, each within its deadline, on threads of their own: never on the threads that answer routes."""


async def _off_request_thread(project: Caller, fn: Any, *args: Any) -> Any:
    try:
        return await SENDS.run(project.id, fn, *args)
    except outbound.Busy:
        raise APIError(
            429,
            f"This project has {SENDS.per_key} webhook checks or test events in progress in this API process; "
            "wait for one to end.",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        ) from None


async def _checked_url(project: Caller, url: str, settings: Settings) -> str:
    """The URL admitted by the rules (its host looked up within ``egress.RESOLVE_SECONDS``), or a 400."""
    try:
        await _off_request_thread(project, egress.check_url, url, settings.webhook_urls)
    except egress.RefusedURL as exc:
        raise bad_request(f"url refused: {exc}.", "url") from None
    return url


def _checked_types(types: list[str]) -> list[str]:
    for i, t in enumerate(types):
        if t not in webhooks.EVENT_TYPES:
            raise bad_request(
                f"event type {t!r} is not one this server sends; it sends {', '.join(webhooks.EVENT_TYPES)}.",
                f"event_types.{i}",
            )
    return list(dict.fromkeys(types))


@router.post("", summary="Create a webhook endpoint (its signing secret is answered once)")
async def create(session: SessionDep, project: ProjectDep, settings: SettingsDep, body: WebhookCreate) -> JSON:
    types, url = _checked_types(body.event_types), await _checked_url(project, body.url, settings)

    def add() -> WebhookEndpoint:
        held = session.scalar(select(func.count()).where(WebhookEndpoint.project_seq == project.seq)) or 0
        if held >= MAX_ENDPOINTS:
            raise bad_request(f"A project has at most {MAX_ENDPOINTS} webhook endpoints; delete one first.", None)
        e = WebhookEndpoint(
            project_seq=project.seq, name=body.name, url=url, event_types=types, secret=webhooks.new_secret()
        )
        session.add(e)
        session.commit()
        return e

    return JSON(endpoint_object(await run_db(session, add), with_secret=True))


@router.get("", summary="List webhook endpoints, newest first")
@ends_session
def list_all(session: SessionDep, project: ProjectDep, paging: PagingDep) -> JSON:
    rows, has_more = paging.apply(session, WebhookEndpoint, [WebhookEndpoint.project_seq == project.seq])
    return page([endpoint_object(e) for e in rows], has_more)


@router.get("/{endpoint_id}", summary="Retrieve a webhook endpoint")
@ends_session
def retrieve(session: SessionDep, project: ProjectDep, endpoint_id: str) -> JSON:
    return JSON(endpoint_object(_endpoint(session, project, endpoint_id)))


@router.post("/{endpoint_id}", summary="Update a webhook endpoint")
async def modify(
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    endpoint_id: str,
    body: WebhookUpdate = WebhookUpdate(),  # noqa: B008 (a frozen default: nothing to change)
) -> JSON:
    await run_db(session, _endpoint, session, project, endpoint_id)  # another project's id: a 404 first
    types = _checked_types(body.event_types) if body.event_types is not None else None
    url = await _checked_url(project, body.url, settings) if body.url is not None else None

    def change() -> WebhookEndpoint:
        e = _endpoint(session, project, endpoint_id)
        if types is not None:
            e.event_types = types
        if url is not None:
            e.url = url
        if body.name is not None:
            e.name = body.name
        e.updated_at = now()
        session.commit()
        return e

    return JSON(endpoint_object(await run_db(session, change)))


@router.delete("/{endpoint_id}", summary="Delete a webhook endpoint (its pending deliveries are dropped)")
@ends_session
def delete(session: SessionDep, project: ProjectDep, endpoint_id: str) -> JSON:
    e = _endpoint(session, project, endpoint_id)
    session.delete(e)
    session.commit()
    return JSON({"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True})


@router.post("/{endpoint_id}/rotate_secret", summary="Rotate a webhook endpoint's signing secret")
@ends_session
def rotate_secret(
    session: SessionDep,
    project: ProjectDep,
    endpoint_id: str,
    body: WebhookRotate = WebhookRotate(),  # noqa: B008
) -> JSON:
    """A new secret; with ``keep_old_secret_active_for_24_hours``, deliveries carry a signature
    under each for a day (the SDK accepts either), so receivers can move over without a gap."""
    e = _endpoint(session, project, endpoint_id)
    keep = body.keep_old_secret_active_for_24_hours
    e.old_secret, e.old_secret_until = (e.secret, now() + KEEP_OLD_SECRET_SECONDS) if keep else (None, None)
    e.secret, e.updated_at = webhooks.new_secret(), now()
    session.commit()
    return JSON(endpoint_object(e, with_secret=True))


@router.post("/{endpoint_id}/test", summary="Send a sample event to a webhook endpoint, now")
async def test(
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    endpoint_id: str,
    body: WebhookTest = WebhookTest(),  # noqa: B008
) -> JSON:
    """One signed sample event (its job id ``ftjob-test``), sent now, answered with the receiver's
    status (``success`` only for a 2xx); not retried, not recorded as a delivery. The send has
    ``RLOO_WEBHOOK_TIMEOUT_SECONDS`` in all, off the threads that answer routes, two at a time a
    project."""
    e = await run_db(session, _endpoint, session, project, endpoint_id)
    _checked_types([body.event_type])
    sample = webhooks.event(body.event_type, "ftjob-test")
    attempt = await _off_request_thread(project, webhooks.send, e, webhooks.new_delivery_id(), sample, settings)
    if attempt.status_code is None:
        raise APIError(502, f"The endpoint did not answer: {attempt.error}", param="url", code="webhook_unreachable")
    return JSON(
        {
            "object": "webhook_endpoint.test",
            "webhook_endpoint_id": e.id,
            "event_type": body.event_type,
            "status_code": attempt.status_code,
            "success": attempt.delivered,
        }
    )


@router.get("/{endpoint_id}/deliveries", summary="List a webhook endpoint's deliveries, newest first")
@ends_session
def list_deliveries(session: SessionDep, project: ProjectDep, paging: PagingDep, endpoint_id: str) -> JSON:
    e = _endpoint(session, project, endpoint_id)
    rows, has_more = paging.apply(session, WebhookDelivery, [WebhookDelivery.endpoint_seq == e.seq])
    return page([delivery_object(d, e) for d in rows], has_more)

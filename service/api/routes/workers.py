"""``GET /v1/workers``: the fleet of training workers as they registered themselves
(``service.jobs.fleet``), for the operator's key only: hosts and devices span every project."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from service.api.deps import OperatorDep, SessionDep, SettingsDep
from service.api.responses import JSON, page
from service.api.routing import StrictJSONRoute
from service.core.db import ends_session
from service.core.tables import Worker
from service.jobs import fleet

router = APIRouter(prefix="/v1/workers", route_class=StrictJSONRoute, tags=["workers"])


def worker_object(worker: Worker, live: bool) -> dict[str, Any]:
    return {
        "id": worker.id,
        "object": "worker",
        "host": worker.host,
        "devices": worker.devices,
        "accelerator": worker.accelerator,
        "memory_per_device_gib": worker.memory_per_device_gib,
        "queues": list(worker.queues),
        "version": worker.version,
        "started_at": worker.started_at,
        "heartbeat_at": int(worker.heartbeat_at),
        "live": live,
    }


@router.get("", summary="List the training workers (operator keys only)")
@ends_session
def list_workers(session: SessionDep, operator: OperatorDep, settings: SettingsDep) -> JSON:
    """Every registered training worker, newest first, one page: its devices, the queues it consumes
    and its heartbeat; ``live`` false once the heartbeat is older than RLOO_STALE_SECONDS (3
    reconcile rounds at least). A worker that stopped is gone from the list; one that died stays,
    not live, for a day."""
    now = time.time()
    stale_after = settings.worker_stale_after
    rows = fleet.workers(session)
    return page([worker_object(w, fleet.is_live(w, stale_after=stale_after, now=now)) for w in rows], has_more=False)

"""The fleet: training workers register themselves (``workers`` rows: their devices and the queues
they consume), so that a job no live worker can run is told so (``service.jobs.reconcile``) and the
operator sees the fleet (``GET /v1/workers``).

A worker's reconciler writes its row when it starts and its heartbeat every round; a worker that
stops deletes its row; one that dies leaves it to go stale (``Settings.worker_stale_after``), and a
row stale for a day is forgotten. Which queues a worker consumes, and which queue a job goes to,
is ``service.infra.task_queue``'s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.core.tables import Worker
from service.infra.task_queue import asked

FORGET_AFTER_SECONDS = 24 * 3600
"""A worker's row whose heartbeat is this old is deleted: the worker is long gone."""


@dataclass(frozen=True)
class WorkerInfo:
    """What a training worker registers: its name (the Celery node name), host, devices and queues."""

    id: str
    host: str
    devices: int
    accelerator: str
    memory_per_device_gib: float | None
    queues: list[str]
    version: str
    started_at: int


def register(session: Session, info: WorkerInfo) -> None:
    """The worker's row, written whole with a fresh heartbeat: at its start, and every round after
    (a row deleted meanwhile, say while the worker could not reach the database, comes back)."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    values = {**asdict(info), "heartbeat_at": time.time()}
    stmt = insert(Worker).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["id"], set_={k: getattr(stmt.excluded, k) for k in values if k != "id"}
    )
    session.execute(stmt)
    session.commit()


def deregister(session: Session, worker_id: str) -> None:
    """The worker stops: it takes no more jobs, so it leaves the fleet."""
    session.execute(delete(Worker).where(Worker.id == worker_id))
    session.commit()


def forget_gone(session: Session, *, now: float | None = None) -> int:
    """Delete the rows of workers silent for ``FORGET_AFTER_SECONDS``; how many."""
    before = (now or time.time()) - FORGET_AFTER_SECONDS
    result: Any = session.execute(delete(Worker).where(Worker.heartbeat_at < before))
    session.commit()
    return int(result.rowcount or 0)


def workers(session: Session) -> Sequence[Worker]:
    """Every registered worker, live or not, newest first."""
    return session.scalars(select(Worker).order_by(Worker.seq.desc())).all()


def is_live(worker: Worker, *, stale_after: float, now: float) -> bool:
    """Whether the worker beat within ``stale_after`` seconds of ``now``."""
    return worker.heartbeat_at >= now - stale_after


def live_workers(session: Session, *, stale_after: float) -> list[Worker]:
    """The workers whose heartbeat is younger than ``stale_after``."""
    now = time.time()
    return [w for w in workers(session) if is_live(w, stale_after=stale_after, now=now)]


def devices_asked(resources: Mapping[str, Any] | None) -> str:
    """``4 h100 devices``, ``1 device of any kind``: what a job asks for, in words."""
    gpus, kind = asked(resources)
    plural = "devices" if gpus > 1 else "device"
    return f"{gpus} {kind} {plural}" if kind else f"{gpus} {plural} of any kind"


def waiting_message(resources: Mapping[str, Any] | None, live: Sequence[Worker]) -> str:
    """The event of a queued job that no live worker can run: what it waits for, and what the fleet
    has (kinds and counts; which hosts is the operator's business, in the reconciler's log)."""
    have = Counter(f"{w.devices} x {w.accelerator}" for w in live)
    fleet = ", ".join(f"{what} ({n} workers)" if n > 1 else what for what, n in sorted(have.items()))
    return (
        f"Waiting for a worker with {devices_asked(resources)}; none of the live workers has that (they have "
        f"{fleet or 'nothing'}). The job stays queued and starts when such a worker joins."
    )

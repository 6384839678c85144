"""What every training worker runs beside its Celery parent: its registration in the fleet (its
devices and the queues they let it consume) and the reconciler, a process of its own that heartbeats
the worker's row, queues again the jobs of dead workers, sends lost tasks again, tells waiting jobs
no live worker can run them, sweeps interrupted uploads and sends webhooks. Never imports torch."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

from service.core.settings import get_settings
from service.infra import embedded_redis
from service.jobs.fleet import WorkerInfo
from worker.engine.processes import die_with_parent


def registration(node: str, gpus: int | None, accelerator: str | None) -> WorkerInfo:
    """What this training worker registers (``service.jobs.fleet``): its devices (``worker.jobs.devices``,
    ``--gpus``/``--accelerator`` over what is found) and the queues they let it consume."""
    from importlib.metadata import PackageNotFoundError, version

    from service.infra.task_queue import training_queues
    from service.jobs.fleet import WorkerInfo
    from worker.jobs.devices import detect

    found = detect(gpus, accelerator, get_settings().accelerators)
    try:
        release = version("rloo-service")
    except PackageNotFoundError:
        release = "unknown"
    return WorkerInfo(
        id=node,
        host=socket.gethostname(),
        devices=found.count,
        accelerator=found.accelerator,
        memory_per_device_gib=found.memory_per_device_gib,
        queues=training_queues(found.count, found.accelerator),
        version=release,
        started_at=int(time.time()),
    )


def start(metrics_port: int | None, me: WorkerInfo) -> None:
    """The reconciler runs in a process of its own, forked now, while this process has one thread.
    Not a thread of the Celery parent: that parent forks a pool process for every job, and a fork
    taken while the thread held a lock (a module being imported, the logging lock) leaves that lock
    held for ever in the new pool process, whose job then hangs. It ends with its parent, taking the
    worker's row with it (SIGTERM, which it also gets when the parent dies, ends it that way)."""
    parent = os.getpid()
    if os.fork() == 0:
        try:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            die_with_parent()
            if metrics_port is not None:
                from worker.jobs.metrics_server import serve_metrics

                serve_metrics(metrics_port)
            _reconcile_forever(parent, me)
        finally:
            os._exit(0)


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(0)


def _reconcile_forever(parent: int, me: WorkerInfo) -> None:
    """At start, then every RLOO_RECONCILE_SECONDS: the worker's row and heartbeat (service.jobs.fleet),
    the embedded Redis started again if it died, jobs whose worker died queued again, lost tasks
    sent again, jobs no live worker can run told so (service.jobs.reconcile), leftovers of interrupted
    uploads swept. Webhook deliveries are sent from threads of this process meanwhile
    (service.jobs.webhooks). Never imports torch. When it ends, the worker's row goes."""
    try:
        _reconcile_rounds(parent, me)
    finally:
        from service.core.db import session_scope
        from service.jobs.fleet import deregister

        try:
            with session_scope() as session:
                deregister(session, me.id)
        except Exception as exc:  # its row goes stale instead
            logging.getLogger("rloo.reconcile").warning("could not remove worker %s from the fleet: %s", me.id, exc)


def _reconcile_rounds(parent: int, me: WorkerInfo) -> None:
    from service.core.db import database_unreachable, session_scope
    from service.core.logs import configure as configure_logs
    from service.files.upload_sweep import sweep_uploads
    from service.jobs import fleet
    from service.jobs.reconcile import queue_length, reconcile
    from service.jobs.webhooks import deliver_forever
    from service.tenancy import audit
    from service.tinker.runs import sweep_expired as sweep_expired_checkpoints

    settings = get_settings()
    logging.basicConfig(format="[%(asctime)s: %(levelname)s/reconciler] %(message)s", level=logging.INFO)
    configure_logs(settings.log_format)
    log = logging.getLogger("rloo.reconcile")
    deliver_forever(lambda: os.getppid() == parent)  # webhooks: threads of this process, which never forks
    blind_until = 0.0  # after the database was unreachable: workers may have been cut off as well
    while os.getppid() == parent:
        try:
            embedded_redis.ensure(settings)
        except Exception as exc:
            log.warning("the embedded Redis is down and did not start again: %s", exc)
        try:
            with session_scope() as session:
                fleet.register(session, me)  # this worker's heartbeat (its whole row, should it be gone)
                fleet.forget_gone(session)
                reconcile(
                    session,
                    stale_after=settings.stale_after,
                    # A queued job's task may be on its way to a worker for a moment; a second copy
                    # would be harmless (the claim), but there is no need to send one so soon.
                    queued_grace=max(5.0, 2 * settings.reconcile_seconds),
                    queue_length=queue_length,
                    max_crashes=settings.max_job_crashes,
                    # Heartbeats missed while the database was away are no sign of a dead worker:
                    # give them a full staleness period to come back before judging.
                    judge_heartbeats=time.monotonic() >= blind_until,
                    worker_stale_after=settings.worker_stale_after,
                )
                sweep_uploads(session, settings.artifacts_dir)
                sweep_expired_checkpoints(session, settings.artifacts_dir)
                audit.sweep(session, retention_days=settings.audit_retention_days)
        except Exception as exc:  # the database is away: try again next round
            if database_unreachable(exc):
                blind_until = time.monotonic() + settings.stale_after
            log.warning("reconcile failed: %s", exc)
        deadline = time.monotonic() + settings.reconcile_seconds
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(min(1.0, settings.reconcile_seconds))

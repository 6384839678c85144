"""``rloo api`` and ``rloo worker``, and the reconciler every training worker runs beside it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import warnings
from typing import TYPE_CHECKING, Annotated

import typer

from service.core.settings import get_settings
from worker.cli.app import app

if TYPE_CHECKING:
    from service.jobs.fleet import WorkerInfo


@app.command("api")
def api(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port to listen on.")] = 8000,
    workers: Annotated[int, typer.Option(metavar="N", help="API processes.")] = 1,
) -> None:
    """Serve the HTTP API (service.main:app) with uvicorn, with limits on headers and connections
    (service.api.server). The per-key rate limit (RLOO_RATE_LIMIT) is counted in each API process:
    --workers N lets a key through up to N times the rate.

    \b
    Example:
      rloo api --host 0.0.0.0 --port 8000 --workers 2
    """
    from service.api.server import serve

    ensure_embedded_broker()
    serve(host=host, port=port, workers=workers)


@app.command("worker")
def worker(
    queue: Annotated[
        str | None,
        typer.Option(
            metavar="QUEUE",
            help="Queue to consume (default: the training queue; with --serve, the inference queue <queue>-serve).",
        ),
    ] = None,
    loglevel: Annotated[str, typer.Option(metavar="LEVEL", help="DEBUG, INFO, WARNING…")] = "INFO",
    metrics_port: Annotated[
        int | None,
        typer.Option(metavar="PORT", help="Serve this worker's Prometheus metrics (and health) on PORT."),
    ] = None,
    serve: Annotated[
        bool, typer.Option("--serve", help="An inference worker: chat and text completions, evaluations, exports.")
    ] = False,
    gpus: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            min=1,
            max=64,
            help="Devices this training worker offers (default: the GPUs torch sees; 1 on a CPU host).",
        ),
    ] = None,
    accelerator: Annotated[
        str | None,
        typer.Option(
            metavar="KIND",
            help="Its devices' kind, as jobs name it (default: from the GPU's name, e.g. h100; cpu on a CPU host).",
        ),
    ] = None,
) -> None:
    """Run a worker: a training worker (Celery) runs one job at a time, in a child process replaced
    after each job; a graders worker (--queue <queue>-graders) runs grader dry runs; an inference
    worker (--serve) keeps models loaded and answers /v1/chat/completions and /v1/completions.

    A training worker registers itself (GET /v1/workers) and consumes the queues of the jobs its
    devices can run: the default queue, and <queue>.train.<kind>.<n> and <queue>.train.any.<n> for
    every n up to its devices.

    \b
    Examples:
      rloo worker                          # its GPUs as torch sees them (CUDA_VISIBLE_DEVICES)
      rloo worker --gpus 4 --accelerator h100
      rloo worker --queue rloo-graders     # grader dry runs
      rloo worker --serve                  # inference, on its own GPU or beside a training worker
      rloo worker --serve --queue rewards  # remote reward models alone (RLOO_REWARD_MODEL_QUEUE=rewards)
      rloo worker --metrics-port 9100      # its metrics at :9100/metrics
    """
    _check_kind(accelerator)
    if serve:
        from worker.serving.supervisor import supervise

        if queue is not None:  # a dedicated inference worker (remote reward models): its processes serve QUEUE
            os.environ["RLOO_SERVE_QUEUE"] = queue
            get_settings.cache_clear()

        ensure_embedded_broker()
        supervise()
        return
    # Celery warns a worker run as root that a pickled message would run code as root. These
    # workers accept JSON only (worker.celery_app), and python graders drop to an unprivileged uid
    # in their sandbox: the warning does not apply, and it would only cover `rloo up`'s banner.
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", category=SecurityWarning)
    settings = get_settings()
    ensure_embedded_broker()
    from service.graders.sandbox import status
    from service.infra.task_queue import grader_queue
    from worker import celery_app as celery_app_module
    from worker.celery_app import app as celery_app

    typer.echo(f"python graders: {status(settings)}", err=True)
    training = queue is None or queue == settings.queue
    node = f"rloo-worker-{os.getpid()}@{socket.gethostname()}"  # its Celery name, in its logs and Flower
    queues = [queue or settings.queue]
    if training:  # the training workers watch the training jobs
        me = _registration(node, gpus, accelerator)
        queues = me.queues
        typer.echo(f"devices: {me.devices} x {me.accelerator}; queues: {','.join(queues)}", err=True)
        _start_reconciler(metrics_port, me)
    else:
        for flag, value in (("--metrics-port", metrics_port), ("--gpus", gpus), ("--accelerator", accelerator)):
            if value is not None:
                typer.echo(f"{flag}: only a training worker takes it; ignored", err=True)
    graders = not training and queue == grader_queue()
    pool = (
        # Dry runs are short: long-lived processes that keep their models loaded, a few at once.
        [f"--concurrency={settings.grader_concurrency}", "--max-tasks-per-child=500"]
        if graders
        # A fresh process per job: a job that leaks or fragments (GPU) memory cannot hurt the next.
        else ["--concurrency=1", "--max-tasks-per-child=1"]
    )
    # After the reconciler's fork (it stays without torch), before the pool's first.
    if said := celery_app_module.prepare_pool(graders=graders):
        typer.echo(said, err=True)
    celery_app.worker_main(
        [
            "worker",
            "--pool=prefork",
            *pool,
            f"--queues={','.join(queues)}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--hostname={node}",
        ]
    )


def _registration(node: str, gpus: int | None, accelerator: str | None) -> WorkerInfo:
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


def _check_kind(accelerator: str | None) -> None:
    """``--accelerator`` is a kind as jobs name one (``schemas.Resources``), and not the word that
    means any kind."""
    import re

    from service.infra.task_queue import ANY_KIND
    from service.jobs.spec import ACCELERATOR_PATTERN

    if accelerator is not None and (not re.match(ACCELERATOR_PATTERN, accelerator) or accelerator == ANY_KIND):
        raise typer.BadParameter(
            f"'{accelerator}': a kind is lower-case letters, digits, '-' and '_' (e.g. h100), and not '{ANY_KIND}'",
            param_hint="--accelerator",
        )


def _start_reconciler(metrics_port: int | None, me: WorkerInfo) -> None:
    """The reconciler runs in a process of its own, forked now, while this process has one thread.
    Not a thread of the Celery parent: that parent forks a pool process for every job, and a fork
    taken while the thread held a lock (a module being imported, the logging lock) leaves that lock
    held for ever in the new pool process, whose job then hangs. It ends with its parent, taking the
    worker's row with it (SIGTERM, which it also gets when the parent dies, ends it that way)."""
    parent = os.getpid()
    if os.fork() == 0:
        try:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            _die_with_parent()
            if metrics_port is not None:
                from worker.jobs.metrics_server import serve_metrics

                serve_metrics(metrics_port)
            _reconcile_forever(parent, me)
        finally:
            os._exit(0)


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(0)


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent dies, even mid-query (the
    parent-pid check between rounds covers other systems)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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

    settings = get_settings()
    logging.basicConfig(format="[%(asctime)s: %(levelname)s/reconciler] %(message)s", level=logging.INFO)
    configure_logs(settings.log_format)
    log = logging.getLogger("rloo.reconcile")
    deliver_forever(lambda: os.getppid() == parent)  # webhooks: threads of this process, which never forks
    blind_until = 0.0  # after the database was unreachable: workers may have been cut off as well
    while os.getppid() == parent:
        try:
            ensure_embedded_broker()
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
        except Exception as exc:  # the database is away: try again next round
            if database_unreachable(exc):
                blind_until = time.monotonic() + settings.stale_after
            log.warning("reconcile failed: %s", exc)
        deadline = time.monotonic() + settings.reconcile_seconds
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(min(1.0, settings.reconcile_seconds))


def ensure_embedded_broker() -> None:
    """Without REDIS_URL, `rloo api` and `rloo worker` share one embedded Redis, started by whichever comes first."""
    settings = get_settings()
    if settings.embedded_redis:
        from service.infra import embedded_redis

        embedded_redis.start(settings, daemonize=True)

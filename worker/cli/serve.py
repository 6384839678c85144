"""``rloo api`` and ``rloo worker``, and the reconciler every training worker runs beside it."""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from typing import Annotated

import typer

from service.settings import get_settings
from worker.cli.app import app


@app.command("api")
def api(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port to listen on.")] = 8000,
    workers: Annotated[int, typer.Option(metavar="N", help="API processes.")] = 1,
) -> None:
    """Serve the HTTP API (service.main:app) with uvicorn, with limits on headers and connections
    (service.server). The per-key rate limit (RLOO_RATE_LIMIT) is counted in each API process:
    --workers N lets a key through up to N times the rate.

    \b
    Example:
      rloo api --host 0.0.0.0 --port 8000 --workers 2
    """
    from service.server import serve

    ensure_embedded_broker()
    serve(host=host, port=port, workers=workers)


@app.command("worker")
def worker(
    queue: Annotated[
        str | None, typer.Option(metavar="QUEUE", help="Queue to consume (default: the training queue).")
    ] = None,
    loglevel: Annotated[str, typer.Option(metavar="LEVEL", help="DEBUG, INFO, WARNING…")] = "INFO",
    metrics_port: Annotated[
        int | None,
        typer.Option(metavar="PORT", help="Serve this worker's Prometheus metrics (and health) on PORT."),
    ] = None,
    serve: Annotated[
        bool, typer.Option("--serve", help="An inference worker: chat and text completions, evaluations, exports.")
    ] = False,
) -> None:
    """Run a worker: a training worker (Celery) runs one job at a time, in a child process replaced
    after each job; a graders worker (--queue <queue>-graders) runs grader dry runs; an inference
    worker (--serve) keeps models loaded and answers /v1/chat/completions and /v1/completions.

    \b
    Examples:
      rloo worker                          # one per GPU
      rloo worker --queue rloo-graders     # grader dry runs
      rloo worker --serve                  # inference, on its own GPU or beside a training worker
      rloo worker --metrics-port 9100      # its metrics at :9100/metrics
    """
    if serve:
        from worker.serving.supervisor import supervise

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
    from service.queue import grader_queue
    from service.sandbox import status
    from worker import celery_app as celery_app_module
    from worker.celery_app import app as celery_app

    typer.echo(f"python graders: {status(settings)}", err=True)
    training = queue is None or queue == settings.queue
    if training:  # the training workers watch the training jobs
        _start_reconciler(metrics_port)
    elif metrics_port is not None:
        typer.echo("--metrics-port: only a training worker serves metrics (its reconciler does)", err=True)
    graders = not training and queue == grader_queue()
    pool = (
        # Dry runs are short: long-lived processes that keep their models loaded, a few at once.
        [f"--concurrency={settings.grader_concurrency}", "--max-tasks-per-child=500"]
        if graders
        # A fresh process per job: a job that leaks or fragments (GPU) memory cannot hurt the next.
        else ["--concurrency=1", "--max-tasks-per-child=1"]
    )
    celery_app_module.PRELOAD_TRAINING_STACK = not graders
    celery_app.worker_main(
        [
            "worker",
            "--pool=prefork",
            *pool,
            f"--queues={queue or settings.queue}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--hostname=rloo-worker-{os.getpid()}@%h",
        ]
    )


def _start_reconciler(metrics_port: int | None = None) -> None:
    """The reconciler runs in a process of its own, forked now, while this process has one thread.
    Not a thread of the Celery parent: that parent forks a pool process for every job, and a fork
    taken while the thread held a lock (a module being imported, the logging lock) leaves that lock
    held for ever in the new pool process, whose job then hangs. It ends with its parent."""
    parent = os.getpid()
    if os.fork() == 0:
        try:
            _die_with_parent()
            if metrics_port is not None:
                from worker.metrics_server import serve_metrics

                serve_metrics(metrics_port)
            _reconcile_forever(parent)
        finally:
            os._exit(0)


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent dies, even mid-query (the
    parent-pid check between rounds covers other systems)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _reconcile_forever(parent: int) -> None:
    """At start, then every RLOO_RECONCILE_SECONDS: the embedded Redis started again if it died,
    jobs whose worker died queued again, lost tasks sent again (service.reconcile), leftovers of
    interrupted uploads swept. Webhook deliveries are sent from threads of this process meanwhile
    (service.webhooks). Never imports torch."""
    from service.db import database_unreachable, session_scope
    from service.logs import configure as configure_logs
    from service.reconcile import queue_length, reconcile
    from service.storage import sweep_uploads
    from service.webhooks import deliver_forever

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
                reconcile(
                    session,
                    stale_after=settings.stale_after,
                    # A queued job's task may be on its way to a worker for a moment; a second copy
                    # would be harmless (the claim), but there is no need to send one so soon.
                    queued_grace=max(5.0, 2 * settings.reconcile_seconds),
                    queue_length=queue_length(),
                    max_crashes=settings.max_job_crashes,
                    # Heartbeats missed while the database was away are no sign of a dead worker:
                    # give them a full staleness period to come back before judging.
                    judge_heartbeats=time.monotonic() >= blind_until,
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
        from service import embedded

        embedded.start(settings, daemonize=True)

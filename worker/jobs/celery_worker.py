"""A Celery worker of ours (``rloo worker`` without ``--serve``): a training worker registers its
devices, starts its reconciler and consumes the queues of the jobs they can run, one job at a time
in a fresh process; a graders worker (``--queue <queue>-graders``) runs grader dry runs in a few
long-lived processes."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable

from service.core.settings import get_settings
from service.infra import embedded_redis
from worker.jobs import preload, reconciler
from worker.jobs.devices import ACCELERATOR_VARIABLE


def run(
    queue: str | None,
    *,
    loglevel: str,
    metrics_port: int | None,
    gpus: int | None,
    accelerator: str | None,
    say: Callable[[str], None],
) -> None:
    """Start the worker on ``queue`` (the training queue if None); ``say`` tells the operator what
    it found (its devices and queues, the python graders' sandbox, the pool's imports)."""
    # Celery warns a worker run as root that a pickled message would run code as root. These
    # workers accept JSON only (worker.celery_app), and python graders drop to an unprivileged uid
    # in their sandbox: the warning does not apply, and it would only cover `rloo up`'s banner.
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", category=SecurityWarning)
    settings = get_settings()
    embedded_redis.ensure(settings)
    from service.graders.sandbox import status
    from service.infra.task_queue import WORKER_QUEUES_VARIABLE, grader_queue
    from worker.celery_app import app as celery_app

    say(f"python graders: {status(settings)}")
    training = queue is None or queue == settings.queue
    node = f"rloo-worker-{os.getpid()}@{socket.gethostname()}"  # its Celery name, in its logs and Flower
    queues = [queue or settings.queue]
    if training:  # the training workers watch the training jobs
        me = reconciler.registration(node, gpus, accelerator)
        queues = me.queues
        os.environ[WORKER_QUEUES_VARIABLE] = ",".join(queues)  # (a Tinker holder yields to jobs waiting there)
        os.environ[ACCELERATOR_VARIABLE] = me.accelerator  # a job's device-seconds are metered by kind
        say(f"devices: {me.devices} x {me.accelerator}; queues: {','.join(queues)}")
        reconciler.start(metrics_port, me)
    else:
        for flag, value in (("--metrics-port", metrics_port), ("--gpus", gpus), ("--accelerator", accelerator)):
            if value is not None:
                say(f"{flag}: only a training worker takes it; ignored")
    graders = not training and queue == grader_queue()
    pool = (
        # Dry runs are short: long-lived processes that keep their models loaded, a few at once.
        [f"--concurrency={settings.grader_concurrency}", "--max-tasks-per-child=500"]
        if graders
        # A fresh process per job: a job that leaks or fragments (GPU) memory cannot hurt the next.
        else ["--concurrency=1", "--max-tasks-per-child=1"]
    )
    # After the reconciler's fork (it stays without torch), before the pool's first.
    if said := preload.prepare_pool(graders=graders):
        say(said)
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

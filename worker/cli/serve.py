"""``rloo api`` and ``rloo worker``: thin commands over ``service.api.server``, ``worker.serving`` and
``worker.jobs.celery_worker`` (which starts the reconciler every training worker runs beside it)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from service.core.settings import get_settings
from worker.cli.app import app, torch_threads


@app.command("api")
def api(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port to listen on.")] = 8000,
    workers: Annotated[int, typer.Option(metavar="N", help="API processes.")] = 1,
) -> None:
    """Serve the HTTP API (service.main:app) with uvicorn, with limits on headers and connections
    (service.api.server). The per-key limits (RLOO_RATE_LIMIT, RLOO_MAX_STREAMS_PER_KEY) are counted
    in Redis: --workers N gives a key the same rate as one process.

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
    torch_threads()  # before anything imports torch: the job and inference processes inherit it
    if serve:
        from worker.serving.supervisor import supervise

        if queue is not None:  # a dedicated inference worker (remote reward models): its processes serve QUEUE
            os.environ["RLOO_SERVE_QUEUE"] = queue
            get_settings.cache_clear()

        ensure_embedded_broker()
        supervise()
        return
    from worker.jobs import celery_worker

    celery_worker.run(
        queue,
        loglevel=loglevel,
        metrics_port=metrics_port,
        gpus=gpus,
        accelerator=accelerator,
        say=lambda line: typer.echo(line, err=True),
    )


def _check_kind(accelerator: str | None) -> None:
    """``--accelerator`` is a kind as jobs name one (``service.jobs.spec.Resources``), and not the word that
    means any kind."""
    import re

    from service.infra.task_queue import ANY_KIND
    from service.jobs.spec import ACCELERATOR_PATTERN

    if accelerator is not None and (not re.match(ACCELERATOR_PATTERN, accelerator) or accelerator == ANY_KIND):
        raise typer.BadParameter(
            f"'{accelerator}': a kind is lower-case letters, digits, '-' and '_' (e.g. h100), and not '{ANY_KIND}'",
            param_hint="--accelerator",
        )


def ensure_embedded_broker() -> None:
    """Without REDIS_URL, `rloo api` and `rloo worker` share one embedded Redis, started by whichever comes first."""
    from service.infra import embedded_redis

    embedded_redis.ensure(get_settings())

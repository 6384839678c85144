"""The Celery app (``worker.celery_app:app``): configuration only; tasks live in ``worker.jobs.tasks``.

Broker settings are chosen for tasks that run for hours:
* ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged when it ends, so a
  worker killed mid-job leaves the message to be redelivered; the atomic claim in the task makes a
  redelivery of a job that is still running (or finished) a no-op. When only the pool process died
  (the out-of-memory killer), the redelivered task sees that its pid is gone and continues the job
  at once; ``jobs.crashes`` stops a job that kills every process from being retried for ever.
* ``worker_prefetch_multiplier = 1`` and concurrency 1: a worker holds one job at a time and never
  hoards queued jobs that another idle GPU could take.
* ``visibility_timeout``: Redis redelivers an unacknowledged message after this long. A job runs
  longer than any sane timeout, so we set it long (a day) and do not rely on it: the job row's
  heartbeat, checked by the reconciler, is what detects a dead worker.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

from celery import Celery
from celery.signals import after_setup_logger, after_setup_task_logger, worker_process_init

from service.core.settings import get_settings
from service.infra.task_queue import RUN_JOB_TASK
from worker.jobs import broker

broker.install()  # a queue entry that is no message is dropped, never the end of the worker
settings = get_settings()

app = Celery("rloo", broker=settings.redis_url, include=["worker.jobs.tasks"])
app.conf.update(
    task_default_queue=settings.queue,
    # JSON only, both ways: a message is data, never code to unpickle (and a task's arguments are
    # ids, no deeper than JSON allows).
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    result_accept_content=["json"],
    task_routes={RUN_JOB_TASK: {"queue": settings.queue}},
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,  # the job row is the result
    worker_prefetch_multiplier=1,
    worker_concurrency=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 24 * 3600},
    worker_send_task_events=False,
)


@worker_process_init.connect
def _forget_the_parents_connections(**_: object) -> None:
    """Should the parent hold pooled database connections, a forked child must not share them (two
    processes on one socket corrupt the protocol): it starts a pool of its own. (The reconciler,
    which reads the database, is a process of its own: ``rloo worker``.)"""
    from service.core.db import get_engine

    if get_engine.cache_info().currsize:
        get_engine().dispose(close=False)


PRELOAD_TRAINING_STACK = True
"""Whether pool processes have torch imported before their job: a training worker's do (a fresh
process per job); a graders worker's do not (``prepare_pool``): its processes live long, and a model
grader's first dry run imports what it needs once."""


LAZY_TRANSFORMERS = (
    "AutoConfig",
    "AutoTokenizer",
    "AutoModelForCausalLM",
    "PreTrainedTokenizerFast",
    "PreTrainedModel",
    "GenerationMixin",
)
"""What transformers resolves lazily, on first use, each importing a tree of modules: imported with
the stack, a job's tokenizer loads in milliseconds instead of a second, and its model likewise."""


def import_training_stack() -> bool:
    """torch, transformers and the training loop, with what loading a model and its tokenizer
    imports; whether that worked. A failure is left to the job's own import to report."""
    try:
        import transformers

        import worker.engine.methods.rloo  # noqa: F401

        for name in LAZY_TRANSFORMERS:
            getattr(transformers, name)
        importlib.import_module("transformers.modeling_layers")  # every decoder's layers (transformers 5)
    except Exception:
        return False
    return True


def imports_before_forking() -> bool:
    """Whether a training worker's parent imports the training stack itself, so that every pool
    process is forked with it loaded and a job pays no import (about 4 CPU-seconds a job): on a
    Linux host without any GPU or graphics device node only (``worker.jobs.devices.has_device_nodes``),
    where nothing imported can initialise a device before the fork. Where one could (a CUDA context
    does not survive a fork; transformers asks for an Intel GPU as it is imported), the parent never
    imports torch, and each pool process imports it in a thread as it starts."""
    from worker.jobs.devices import has_device_nodes

    return sys.platform == "linux" and not has_device_nodes()


def prepare_pool(*, graders: bool) -> str | None:
    """How this worker's pool processes get the training stack, before the pool's first fork: a
    graders worker's not at all; a training worker's from its parent where ``imports_before_forking``
    (imported here and now), else each in a thread as it starts. Returns what to tell the operator."""
    global PRELOAD_TRAINING_STACK
    PRELOAD_TRAINING_STACK = not graders
    if graders or not imports_before_forking():
        return None
    if import_training_stack():
        return "no GPU here: each job's process is forked with the training stack imported"
    return "the training stack did not import; each job imports it itself and says why"


@worker_process_init.connect
def _preload_training_stack(**_: object) -> None:
    """In each pool child (a fresh one per job) whose parent did not import the training stack,
    import it while the child waits for a job, so a job does not pay those seconds between "running"
    and its first step. A thread: the pool gives a child's start only a few seconds. A task that
    arrives first waits for it (``wait_for_preload``)."""
    global _PRELOAD
    # Forked with it already (imports_before_forking):
    if not PRELOAD_TRAINING_STACK or "worker.engine.methods.rloo" in sys.modules:
        return
    _PRELOAD = threading.Thread(target=import_training_stack, name="preload-torch", daemon=True)
    _PRELOAD.start()


_PRELOAD: threading.Thread | None = None


def wait_for_preload() -> None:
    """A job's own imports wait for the preload to finish: two threads importing the same module
    tree at once can see a partly initialised module."""
    if _PRELOAD is not None:
        _PRELOAD.join()


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: Any = None, **_: object) -> None:
    """RLOO_LOG_FORMAT=json: Celery's handlers too write JSON lines (``service.core.logs``)."""
    from service.core.logs import JsonFormatter

    if get_settings().log_format == "json" and logger is not None:
        for handler in logger.handlers:
            handler.setFormatter(JsonFormatter())

"""When a training worker's pool processes import the training stack (torch, transformers, the
loop), so that a job does not pay those seconds between "running" and its first step: forked from a
parent that imported it (``prepare_pool``, CPU hosts), else each in a thread as it starts
(``preload_training_stack``, connected to Celery's ``worker_process_init`` by ``worker.celery_app``)."""

from __future__ import annotations

import importlib
import sys
import threading

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


def preload_training_stack(**_: object) -> None:
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

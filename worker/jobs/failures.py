"""How a job process fails: its memory capped on request, and an exception turned into the job's
``error`` (a code and a message that says what to change)."""

from __future__ import annotations

from worker.engine.errors import JobError

OUT_OF_MEMORY_HINT = (
    "lower batch_size, rloo_k or max_new_tokens, raise gradient_accumulation_steps, or train a LoRA adapter"
)


def cap_memory(megabytes: int | None) -> None:
    """RLOO_JOB_MEMORY_MB: bound this job process's data memory (RLIMIT_DATA: the heap and private
    mappings, where tensors live on a CPU), so a job that asks for too much fails with
    ``out_of_memory`` instead of bringing the out-of-memory killer onto the host. The pool process
    serves one job and exits, so the cap ends with the job."""
    if not megabytes:
        return
    import resource

    limit = megabytes * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def classify(exc: Exception) -> tuple[str, str]:
    """``(code, message)`` of the job's error for ``exc``."""
    if isinstance(exc, JobError):
        return exc.code, exc.message
    name = type(exc).__name__
    text = str(exc)
    # torch.OutOfMemoryError (CUDA and other accelerators), MemoryError (Python), and the CPU
    # allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate …").
    if (
        "OutOfMemory" in name
        or isinstance(exc, MemoryError)
        or (isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))
    ):
        first = text.strip().splitlines()[0][:300] if text.strip() else name
        return "out_of_memory", f"The job ran out of memory ({name}: {first}); {OUT_OF_MEMORY_HINT}."
    return "internal_error", f"{name}: {exc}"

"""``benchmarks.gpu_check``'s peak-memory probe: the check puts this directory first on the
``PYTHONPATH`` of the ``rloo train`` it starts, so that every Python process of that run (the
training process itself, or each rank ``torch.distributed.run`` starts) writes, as it exits, one
JSON file into ``$GPU_CHECK_MEMORY_DIR``: its pid, ``RANK``, peak RSS and, where it used CUDA,
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of each device it touched.

Without ``GPU_CHECK_MEMORY_DIR`` it does nothing. It imports nothing heavy at start-up (torch is read
from ``sys.modules`` at exit), and turns SIGTERM into a normal exit so that a run the check's time
guard stops still reports. It shadows any other ``sitecustomize`` for those processes only.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import signal
import sys
from typing import Any


def _report(directory: str) -> None:
    record: dict[str, Any] = {
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "argv": sys.argv[:4],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cuda": {},
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            allocated = torch.cuda.max_memory_allocated(index)
            if allocated:
                record["cuda"][str(index)] = {
                    "name": torch.cuda.get_device_name(index),
                    "max_allocated_bytes": allocated,
                    "max_reserved_bytes": torch.cuda.max_memory_reserved(index),
                }
    with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


def _terminated(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


_directory = os.environ.get("GPU_CHECK_MEMORY_DIR")
if _directory:
    atexit.register(_report, _directory)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)

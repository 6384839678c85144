"""This host's devices, as a training worker registers them and picks its queues by (``rloo worker``;
``--gpus`` and ``--accelerator`` override what is found).

The GPUs are those torch sees (``CUDA_VISIBLE_DEVICES`` and ROCm included), counted in a child
process: on a host with GPUs the Celery parent never imports torch (it forks a pool process per job,
and forking after CUDA's initialisation is unsafe). A host without a GPU device node skips the child:
one ``cpu`` device (and, with no graphics device node either, the parent imports torch once for
its pool: ``worker.celery_app``).
A kind is named from the device's name (``NVIDIA H100 80GB HBM3`` is ``h100``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger("rloo.worker")

CPU = "cpu"
PROBE_SECONDS = 120.0
_PROBE = """
import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps([
    {"name": torch.cuda.get_device_name(i), "bytes": torch.cuda.get_device_properties(i).total_memory}
    for i in range(n)
]))
"""
# Words of a device's name that say who made it or its line, not which chip it is.
_MAKERS = {"nvidia", "tesla", "geforce", "quadro", "amd", "instinct", "radeon", "intel", "data", "center", "gpu"}
GIB = 1024**3


@dataclass(frozen=True)
class Devices:
    count: int
    accelerator: str
    memory_per_device_gib: float | None


ACCELERATOR_VARIABLE = "RLOO_WORKER_ACCELERATOR"
"""Set by a training worker for its pool processes: the kind of its devices, which a job's usage is metered in."""


def kind_of(name: str) -> str:
    """The accelerator kind of a device named ``name``: its chip, lower case (``NVIDIA H100 80GB HBM3``:
    ``h100``; ``NVIDIA A100-SXM4-80GB``: ``a100``; ``NVIDIA GeForce RTX 4090``: ``rtx4090``; ``AMD
    Instinct MI300X``: ``mi300x``); ``gpu`` when nothing is left of the name."""
    words = [w for w in re.split(r"[\s_]+", name.lower()) if w and w not in _MAKERS]
    if not words:
        return "gpu"
    chip = re.split(r"[-/]", words[0])[0]
    if chip in ("rtx", "gtx") and len(words) > 1:  # GeForce RTX 4090, RTX A6000: the model is the next word
        chip += re.split(r"[-/]", words[1])[0]
    return re.sub(r"[^a-z0-9]", "", chip)[:32] or "gpu"


GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""NVIDIA's, AMD's (ROCm) and WSL2's GPU device nodes (glob patterns)."""
OTHER_DEVICE_NODES = ("/dev/dri",)
"""Other graphics and compute device nodes: Intel GPUs, a server's display chip."""


def has_gpu_nodes() -> bool:
    """Whether the host shows a GPU device node at all (checked before paying for torch's import in
    a child)."""
    return any(glob.glob(pattern) for pattern in GPU_NODES)


def has_device_nodes() -> bool:
    """``has_gpu_nodes``, or any other graphics or compute device node: where there is none, no
    library can initialise a GPU in this process."""
    return has_gpu_nodes() or any(glob.glob(pattern) for pattern in OTHER_DEVICE_NODES)


def probe() -> list[tuple[str, int]]:
    """The GPUs torch sees, ``(name, bytes)`` each, counted in a child process; none on a host
    without GPU device nodes, or when the child fails (said in the log)."""
    if not has_gpu_nodes():
        return []
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_SECONDS, check=True
        )
        return [(d["name"], int(d["bytes"])) for d in json.loads(out.stdout.strip().splitlines()[-1])]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("could not count this host's GPUs with torch (%s); taking it for a CPU host", str(detail)[-500:])
        return []


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def detect(
    gpus: int | None = None, accelerator: str | None = None, declared: dict[str, float] | None = None
) -> Devices:
    """This worker's devices: the GPUs found (all of one kind; the kind of the first when they are
    mixed), or one ``cpu`` device; ``gpus`` and ``accelerator`` override the count and the kind.
    Memory a device: the smallest GPU's, or the host's shared by its devices on a CPU host; for a kind
    that was named and not found here, the operator's declaration of it (``declared``:
    ``RLOO_ACCELERATORS``), else unknown."""
    found = probe()
    kinds = sorted({kind_of(name) for name, _ in found})
    if len(kinds) > 1:
        log.warning(
            "this host mixes GPU kinds (%s); registering them all as %s: run one worker per kind, each with "
            "CUDA_VISIBLE_DEVICES and --accelerator",
            ", ".join(kinds),
            kind_of(found[0][0]),
        )
    kind = accelerator or (kind_of(found[0][0]) if found else CPU)
    count = gpus or len(found) or 1
    if found and gpus and gpus > len(found):
        log.warning("--gpus %d: this host shows %d GPU(s) only", gpus, len(found))
    if found and kind == kind_of(found[0][0]):
        memory: float | None = min(size for _, size in found) / GIB
    elif not found and kind == CPU:
        host = _host_memory_gib()
        memory = host / count if host else None
    else:
        memory = (declared or {}).get(kind)
    return Devices(count=count, accelerator=kind, memory_per_device_gib=round(memory, 1) if memory else None)

"""How many threads torch computes with on the CPU, and how its OpenMP threads wait: chosen once per
process, before torch is imported (``configure``), from ``RLOO_TORCH_THREADS`` and the cores this
process may use.

Why it matters (benchmarks/RESULTS.md, "A busy machine"): torch's default is a thread per core and
OpenMP threads that spin while they wait for each other. Each operation then waits for its slowest
thread, and on a machine with other work running one of them is often off its core: on 2 cores with
five busy processes beside it, a step of the addition job took 0.64 s at torch's default against
0.11 s on one thread, and one busy process beside it was enough to double a step. So ``auto`` keeps
one core for the rest of the machine (the API, the graders, the user's own programs) and shares the
others among the torch processes the host runs at once; and where a process has more than one thread,
a waiting thread spins only briefly (``GOMP_SPINCOUNT``) before it sleeps, so that a thread whose peer
was taken off its core gives its own core back instead of burning it.

The choice lives in the environment (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``), so the processes this
one starts or forks (a job's process, the inference worker's, the ranks') start with it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

SPIN_COUNT = "1000"
"""GNU OpenMP's spins before a waiting thread sleeps, where the process has more than one thread and
the user set no wait policy: what libgomp itself uses once it sees more threads than cores (its
default otherwise spins ~300,000 times, about a scheduler tick)."""

WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cores: int
    why: str

    def describe(self) -> str:
        """One line for the operator: ``torch threads: 1 (auto: 2 usable cores, one kept for ...)``."""
        return f"torch threads: {self.threads} ({self.why})"


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (``taskset``, a container's cpuset),
    capped by a cgroup's CPU quota (``docker run --cpus``), which the mask does not show."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else max(1, cores)


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over its period);
    None where there is none or it cannot be read."""
    try:
        if (root / "cpu.max").is_file():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu"
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def choose(
    setting: str, *, processes: int = 1, cores: int | None = None, environ: MutableMapping[str, str] = os.environ
) -> ThreadChoice:
    """The threads of one of ``processes`` torch processes sharing this host's cores. ``setting``
    is ``RLOO_TORCH_THREADS``: a number, or ``auto`` (an ``OMP_NUM_THREADS`` already set wins; else one
    core is kept for the rest of the machine and the others shared, at least one thread each)."""
    cores = usable_cores() if cores is None else cores
    if setting != "auto":
        return ThreadChoice(int(setting), cores, "RLOO_TORCH_THREADS")
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return ThreadChoice(int(environ["OMP_NUM_THREADS"]), cores, "OMP_NUM_THREADS")
    threads = max(1, (cores - 1) // max(1, processes))
    shared = f", shared by {processes} torch processes" if processes > 1 else ""
    return ThreadChoice(threads, cores, f"auto: {cores} usable cores, one kept for the rest of the machine{shared}")


def apply(choice: ThreadChoice, environ: MutableMapping[str, str] = os.environ) -> None:
    """Put ``choice`` in the environment (for this process's torch, when it is imported, and every
    process it starts) and, where torch is imported already, into torch itself. A brief spin before
    sleeping where there is more than one thread, unless the user chose a wait policy."""
    environ["OMP_NUM_THREADS"] = environ["MKL_NUM_THREADS"] = str(choice.threads)
    if choice.threads > 1 and not any(name in environ for name in WAIT_POLICY_VARIABLES):
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    if environ is os.environ and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(choice.threads)  # its OpenMP pool is sized already


def configure(setting: str, *, processes: int = 1) -> ThreadChoice:
    """``choose`` and ``apply`` for this process: call it before torch is imported."""
    choice = choose(setting, processes=processes)
    apply(choice)
    return choice


def share(processes: int, environ: MutableMapping[str, str] = os.environ) -> int:
    """The threads of each of ``processes`` processes that replace this one (a job's ranks on the
    CPU): this process's own threads (``OMP_NUM_THREADS``, else ``auto``'s), shared, at least one."""
    own = choose("auto", environ=environ).threads
    return max(1, own // max(1, processes))

"""A child process that ends with its parent: the ranks' launcher, the reconciler, an inference
worker's processes (no torch imported here: the reconciler never loads it)."""

from __future__ import annotations

import contextlib
import signal


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent dies, even mid-call (a parent-pid
    check between rounds covers other systems)."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)

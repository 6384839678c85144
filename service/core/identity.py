"""Which process this is, in terms another process on the same host can check: ``host#pid
namespace:pid``. A job row names the process that holds it; an upload's temporary file names the
process writing it; either may be judged dead (and its job or file taken over) only by a process
that sees the same process ids."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path


@functools.lru_cache(maxsize=1)  # a process keeps its host and namespace (a fork, too)
def machine_tag() -> str:
    """This host and PID namespace (``host#namespace``, "-" spelled "_"): processes with equal tags
    see the same process ids (containers sharing a hostname, e.g. in one pod, do not)."""
    try:
        ns = os.readlink("/proc/self/ns/pid").rsplit("[", 1)[-1].rstrip("]")
    except OSError:
        ns = "0"
    return f"{socket.gethostname().replace('-', '_')}#{ns}"


def writer_tag() -> str:
    return f"{machine_tag()}-{os.getpid()}"


def process_gone(machine: str, pid: int) -> bool:
    """Whether process ``pid`` of ``machine`` (a machine_tag) has ended, or is a zombie; False when
    we cannot tell (another host or namespace)."""
    if machine.replace("-", "_") != machine_tag() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def process_name() -> str:
    """``host#pid-namespace:pid`` of this process (computed when called: a pool process is forked
    after its parent imported this)."""
    return f"{machine_tag()}:{os.getpid()}"


def died_here(name: str | None) -> bool:
    """Whether ``name`` (a ``process_name()``) is a process of this host and PID namespace that no
    longer runs: gone, or a zombie its parent has not reaped yet."""
    host, _, pid = (name or "").rpartition(":")
    return pid.isdigit() and process_gone(host, int(pid))

"""The program a python grader runs in: executed by path (``python -I -S sandbox_runner.py UID``)
inside the sandbox that ``service.graders.sandbox`` builds, never imported by the service. Standard library
only: nothing else is visible in the sandbox.

Reads ``{"source", "batch": [{"sample", "item"}], "per_sample_seconds", "memory_mb",
"cpu_seconds"}`` on stdin and writes one JSON line per sample on stdout, in order:
``{"ready": true}`` once the grader's source has run, then ``{"i": n, "score": x}`` or
``{"i": n, "error": "..."}``. A python tool's request has ``"entry": "call"`` and a batch of
``{"arguments"}``: each answer is ``{"i": n, "text": "..."}`` (what ``call(arguments)`` returned: a
string, or anything JSON writes) or the error. Whatever the grader prints goes to
stderr. The parent enforces the time limits from outside (it kills the sandbox); the alarm here
only spares a restart when a sample's Python code runs past its time.

Nothing a grader could rebind decides what it may do: the audit hook's tables live in its closure,
not in this module's globals (which the grader reaches through ``sys.modules['__main__']``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
from collections.abc import Callable  # loaded already (json imports re, which imports collections)
from types import FrameType

TYPE_CHECKING = False  # typing itself is not imported here: a sandbox starts for every batch
if TYPE_CHECKING:
    from typing import Any

# What a grader may not import (processes, sockets, foreign code, the garbage collector's view of
# every object, threads) and the audit events it may not raise. Defence in depth: the sandbox's
# namespaces, not this list, keep a grader from the service.
NO_IMPORT = frozenset(
    {
        "_posixsubprocess",
        "subprocess",
        "multiprocessing",
        "_multiprocessing",
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "ctypes",
        "_ctypes",
        "gc",
        "pty",
        "fcntl",
        "mmap",
        "_thread",
        "threading",
        "resource",
        "signal",
        "_signal",
        "sqlite3",
        "_sqlite3",
        "urllib",
        "http",
        "asyncio",
        "_xxsubinterpreters",
        "_testcapi",
        "_testinternalcapi",
    }
)
NO_EVENTS = (
    "os.",
    "socket.",
    "subprocess.",
    "ctypes.",
    "shutil.",
    "sqlite3.",
    "urllib.",
    "signal.",
    "sys.settrace",
    "sys.setprofile",
    "sys.addaudithook",
    "sys._current_frames",
    "gc.",
    "builtins.input",
    "webbrowser.",
    "glob.",
)
OS_OK = frozenset({"os.listdir", "os.scandir"})  # the import system lists directories


def make_hook(
    prefixes: tuple[str, ...],
    no_import: frozenset[str] = NO_IMPORT,
    no_events: tuple[str, ...] = NO_EVENTS,
    os_ok: frozenset[str] = OS_OK,
) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook. Everything it reads is bound here, as defaults and locals: rebinding this
    module's names afterwards changes nothing."""
    realpath, isinstance_, str_, bytes_, int_, any_ = os.path.realpath, isinstance, str, bytes, int, any
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "import":
            name = args[0]
            if isinstance_(name, str_) and name.partition(".")[0] in no_import:
                raise PermissionError(f"python graders may not import {name}")
            return
        if event == "open":
            path, mode, flags = args
            if isinstance_(path, int_):
                return
            if not isinstance_(path, (str_, bytes_)):
                raise PermissionError("python graders may open files by name only")
            path = realpath(path.decode() if isinstance_(path, bytes_) else path)
            writes = (mode is not None and any_(c in str_(mode) for c in "wax+")) or (flags or 0) & write_flags
            if writes or not any_(path == p or path.startswith(p + "/") for p in prefixes):
                raise PermissionError(f"python graders may not open {path}")
            return
        if event.startswith(no_events) and event not in os_ok:
            raise PermissionError(f"python graders may not use {event}")

    return hook


def drop_privileges(uid: int | None) -> None:
    """Started as root (bubblewrap run by root needs no user namespace): become ``uid``, with no
    groups and no capabilities left, before any grader code exists. ``uid`` None: keep ours (the
    ``process`` sandbox)."""
    if uid is None:
        return
    if os.getuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if 0 in os.getresuid() or 0 in os.getresgid():
        raise SystemExit("the sandbox still runs as root; refusing to run grader code")


def set_limits(memory_mb: int, cpu_seconds: int) -> None:
    for what, value in (
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_FSIZE, 16 * 2**20),
        (resource.RLIMIT_NPROC, 1),
    ):
        resource.setrlimit(what, (value, value))


def score_of(value: object) -> dict[str, object]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"grade() returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        return {"error": "grade() returned a non-finite number"}
    return {"score": value}


def text_of(value: object) -> dict[str, object]:
    if isinstance(value, str):
        return {"text": value}
    try:
        return {"text": json.dumps(value)}
    except (TypeError, ValueError):
        raise TypeError(f"call() returned {type(value).__name__}, not a string or JSON") from None


def main() -> None:
    uid = None if sys.argv[1] == "-" else int(sys.argv[1])
    request = json.loads(sys.stdin.read())
    drop_privileges(uid)
    per_sample = float(request["per_sample_seconds"])
    set_limits(int(request["memory_mb"]), int(request["cpu_seconds"]))
    # Results go to a private descriptor; whatever the grader prints goes to stderr.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import sysconfig

    library = ("stdlib", "platstdlib")
    prefixes = tuple({os.path.realpath(p) for key, p in sysconfig.get_paths().items() if key in library})

    def timed_out(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"grade() ran past {per_sample:g} s")

    signal.signal(signal.SIGALRM, timed_out)
    setitimer, timer, dumps = signal.setitimer, signal.ITIMER_REAL, json.dumps
    write, flush = results.write, results.flush
    batch = request["batch"]
    if request.get("audit_hook", True):
        sys.addaudithook(make_hook(prefixes))
    namespace: dict[str, Any] = {"__name__": "grader"}

    def answer(i: int, result: dict[str, object]) -> None:
        write(dumps({"i": i, **result}) + "\n")
        flush()

    try:
        code = compile(request["source"], "<grader>", "exec")
        setitimer(timer, per_sample)  # the module's own code has a sample's time too
        try:
            exec(code, namespace)
        finally:
            setitimer(timer, 0)
        tool = request.get("entry") == "call"
        grade = namespace["call" if tool else "grade"]
        write('{"ready": true}\n')
        flush()
    except BaseException as exc:
        message = f"the grader's source failed: {type(exc).__name__}: {exc}"[:500]
        for i in range(len(batch)):
            answer(i, {"error": message})
        return
    for i, one in enumerate(batch):
        try:
            setitimer(timer, per_sample)
            try:
                value = grade(one["arguments"]) if tool else grade(one["sample"], one["item"])
            finally:
                setitimer(timer, 0)
            result = text_of(value) if tool else score_of(value)
        except MemoryError:
            result = {"error": "grade() ran out of memory"}
        except BaseException as exc:
            try:
                result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            except BaseException:
                result = {"error": type(exc).__name__}
        answer(i, result)


if __name__ == "__main__":
    main()

"""Running a user's python grader: ``def grade(sample, item) -> float``, off unless the operator sets
``RLOO_ALLOW_PYTHON_GRADER``.

The code runs in a separate Python process, never in the API's or the worker's:

* an empty environment (no ``DATABASE_URL``, no ``RLOO_*`` settings, no keys) and ``python -I``
  (no user site-packages, no ``PYTHON*`` variables), in a fresh empty working directory;
* resource limits: address space (``memory_mb``), CPU seconds, no core files, 64 open files,
  16 MiB written files at most;
* a time limit per sample (``SIGALRM``; a sample over it scores NaN with a "timed out" error) and a
  wall-clock limit for the batch (the process is killed; the samples it did not reach score NaN);
* an audit hook installed before the user's code is compiled: no file opened outside Python's
  own library, nothing written, no sockets, no subprocesses, no ``ctypes`` or ``os.system``.

CPython's audit hooks are defence in depth, not a boundary a determined attacker cannot cross
(the docs say so); the process limits and the empty environment are what keep a grader from the
service's settings and database. Run workers that allow python graders as a user that cannot read
the database file (PostgreSQL's credentials live only in the environment, which the grader never
sees).

A sample's error (an exception, a non-number, a time-out) scores NaN, and its message is reported
per sample, as OpenAI's graders report a grader's errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The child: reads {"source", "batch": [{"sample", "item"}], "per_sample_seconds"} on stdin, writes
# one JSON line per sample: {"score": x} or {"error": "..."}.
_RUNNER = r"""
import json, math, os, resource, signal, sys

def _limits(memory_mb, cpu_seconds):
    for what, value in ((resource.RLIMIT_AS, memory_mb * 2**20), (resource.RLIMIT_CPU, cpu_seconds),
                        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_FSIZE, 16 * 2**20)):
        resource.setrlimit(what, (value, value))

# Modules a grader may not import (processes, sockets, foreign code, the garbage collector's view
# of every object, which could reach this hook), and audit events it may not raise.
_NO_IMPORT = frozenset({"_posixsubprocess", "subprocess", "multiprocessing", "_multiprocessing", "socket", "_socket",
                        "ssl", "_ssl", "ctypes", "_ctypes", "gc", "pty", "fcntl", "mmap", "_thread", "threading",
                        "resource", "signal", "_signal", "sqlite3", "_sqlite3", "urllib", "http", "asyncio"})
# (Frames stay readable: the standard library needs them, and no grader code ever runs inside the
# hook, whose function no object graph leads to without gc.)
_NO_EVENTS = ("os.", "socket.", "subprocess.", "ctypes.", "shutil.", "sqlite3.", "urllib.", "signal.",
              "sys.settrace", "sys.setprofile", "sys.addaudithook", "gc.", "builtins.input", "webbrowser.", "glob.")
_OS_OK = frozenset({"os.listdir", "os.scandir"})  # the import system lists directories
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _make_hook(prefixes):
    realpath, isinstance_, str_, bytes_, int_ = os.path.realpath, isinstance, str, bytes, int
    def hook(event, args):
        if event == "import":
            name = args[0]
            if isinstance_(name, str_) and name.partition(".")[0] in _NO_IMPORT:
                raise PermissionError(f"python graders may not import {name}")
            return
        if event == "open":
            path, mode, flags = args
            if isinstance_(path, int_):
                return
            if not isinstance_(path, (str_, bytes_)):
                raise PermissionError("python graders may open files by name only")
            path = realpath(path.decode() if isinstance_(path, bytes_) else path)
            writes = (mode is not None and any(c in str_(mode) for c in "wax+")) or (flags or 0) & _WRITE_FLAGS
            if writes or not any(path == p or path.startswith(p + "/") for p in prefixes):
                raise PermissionError(f"python graders may not open {path}")
            return
        if event.startswith(_NO_EVENTS) and event not in _OS_OK:
            raise PermissionError(f"python graders may not use {event}")
    return hook

def main():
    request = json.loads(sys.stdin.read())
    per_sample = float(request["per_sample_seconds"])
    _limits(int(request["memory_mb"]), int(request["cpu_seconds"]))
    # Results go to a private descriptor; whatever the grader prints goes to stderr.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import sysconfig
    library = ("stdlib", "platstdlib", "purelib", "platlib")
    prefixes = tuple({os.path.realpath(p) for key, p in sysconfig.get_paths().items() if key in library})
    def timed_out(signum, frame):
        raise TimeoutError(f"grade() ran past {per_sample:g} s")
    signal.signal(signal.SIGALRM, timed_out)
    setitimer, timer = signal.setitimer, signal.ITIMER_REAL
    sys.addaudithook(_make_hook(prefixes))
    namespace = {"__name__": "grader"}
    def answer(i, result):
        results.write(json.dumps({"i": i, **result}) + "\n")
        results.flush()
    try:
        exec(compile(request["source"], "<grader>", "exec"), namespace)
        grade = namespace["grade"]
    except BaseException as exc:
        message = f"the grader's source failed: {type(exc).__name__}: {exc}"[:500]
        for i in range(len(request["batch"])):
            answer(i, {"error": message})
        return
    for i, one in enumerate(request["batch"]):
        try:
            setitimer(timer, per_sample)
            try:
                value = grade(one["sample"], one["item"])
            finally:
                setitimer(timer, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"grade() returned {type(value).__name__}, not a number")
            value = float(value)
            if math.isfinite(value):
                result = {"score": value}
            else:
                result = {"error": "grade() returned a non-finite number"}
        except MemoryError:
            result = {"error": "grade() ran out of memory"}
        except BaseException as exc:
            try:
                result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            except BaseException:
                result = {"error": type(exc).__name__}
        answer(i, result)

main()
"""


@dataclass(frozen=True)
class Limits:
    per_sample_seconds: float = 5.0
    batch_seconds: float = 60.0
    memory_mb: int = 512


@dataclass(frozen=True)
class Outcome:
    score: float
    error: str | None = None


def run_python_grader(
    source: str, samples: list[dict[str, Any]], items: list[Any], limits: Limits | None = None
) -> list[Outcome]:
    """Scores of ``grade(sample, item)`` for each pair; NaN with an error where it failed."""
    limits = limits or Limits()
    if not samples:
        return []
    request = json.dumps(
        {
            "source": source,
            "batch": [{"sample": s, "item": i} for s, i in zip(samples, items, strict=True)],
            "per_sample_seconds": limits.per_sample_seconds,
            "memory_mb": limits.memory_mb,
            "cpu_seconds": int(limits.batch_seconds) + 1,
        }
    )
    # Files, not pipes: the child (or anything it left behind) cannot block the parent on a full
    # pipe or hold it open; RLIMIT_FSIZE caps what it can write.
    with (
        tempfile.TemporaryDirectory(prefix="rloo-grader-") as cwd,
        open(Path(cwd) / "results", "w+b") as out,
        open(Path(cwd) / "log", "w+b") as err,
    ):
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=cwd,
            env={},
            start_new_session=True,  # its own process group: a time-out kills everything it started
        )
        try:
            assert proc.stdin is not None
            proc.stdin.write(request.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=limits.batch_seconds)
            ended = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"ran past the batch limit of {limits.batch_seconds:g} s and was stopped"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        lines = out.read(_OUTPUT_LIMIT).decode("utf-8", errors="replace").splitlines()
        err.seek(0)
        log = err.read(_OUTPUT_LIMIT).decode("utf-8", errors="replace")
    outcomes: list[Outcome | None] = [None] * len(samples)
    for line in lines:
        try:
            result = json.loads(line)
            i = result["i"]
        except (ValueError, TypeError, KeyError):
            continue
        if not isinstance(i, int) or not 0 <= i < len(samples) or outcomes[i] is not None:
            continue
        score = result.get("score")
        if isinstance(score, (int, float)) and not isinstance(score, bool):
            outcomes[i] = Outcome(float(score))
        else:
            outcomes[i] = Outcome(float("nan"), str(result.get("error", "no score"))[:500])
    detail = log.strip().splitlines()[-1][:300] if log.strip() else ""
    if "MemoryError" in log:
        detail = f"out of memory ({limits.memory_mb} MiB)"
    message = f"not graded: the grader process {ended}" + (f" ({detail})" if detail else "")
    return [o if o is not None else Outcome(float("nan"), message) for o in outcomes]


_OUTPUT_LIMIT = 8 * 2**20

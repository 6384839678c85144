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

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

# The child: reads {"source", "batch": [{"sample", "item"}], "per_sample_seconds"} on stdin, writes
# one JSON line per sample: {"score": x} or {"error": "..."}.
_RUNNER = r"""
import json, math, signal, sys

def _audit_hook(prefixes):
    blocked = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.spawn",
               "ctypes.", "os.kill", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod",
               "shutil.", "sqlite3.", "urllib.")
    def hook(event, args):
        if event.startswith(blocked):
            raise PermissionError(f"python graders may not use {event}")
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, int):
                return
            path = str(path)
            if (mode and any(c in str(mode) for c in "wax+")) or not path.startswith(prefixes):
                raise PermissionError(f"python graders may not open {path}")
    return hook

def main():
    request = json.loads(sys.stdin.read())
    per_sample = float(request["per_sample_seconds"])
    out = sys.stdout
    import sysconfig
    library = ("stdlib", "platstdlib", "purelib", "platlib")
    prefixes = tuple({path for key, path in sysconfig.get_paths().items() if key in library})
    sys.addaudithook(_audit_hook(prefixes))
    namespace = {"__name__": "grader"}
    try:
        exec(compile(request["source"], "<grader>", "exec"), namespace)
        grade = namespace["grade"]
    except BaseException as exc:
        message = f"the grader's source failed: {type(exc).__name__}: {exc}"
        for _ in request["batch"]:
            out.write(json.dumps({"error": message}) + "\n")
        return
    def timed_out(signum, frame):
        raise TimeoutError(f"grade() ran past {per_sample:g} s")
    signal.signal(signal.SIGALRM, timed_out)
    for one in request["batch"]:
        try:
            signal.setitimer(signal.ITIMER_REAL, per_sample)
            try:
                value = grade(one["sample"], one["item"])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"grade() returned {type(value).__name__}, not a number")
            if math.isfinite(value):
                result = {"score": float(value)}
            else:
                result = {"error": "grade() returned a non-finite number"}
        except MemoryError:
            result = {"error": "grade() ran out of memory"}
        except BaseException as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(result) + "\n")
        out.flush()

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


def _limit_child(memory_mb: int, cpu_seconds: int) -> Any:
    def apply() -> None:
        os.setsid()  # its own process group: a time-out kills everything it started
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))

    return apply


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
        }
    )
    with tempfile.TemporaryDirectory(prefix="rloo-grader-") as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env={},
            preexec_fn=_limit_child(limits.memory_mb, int(limits.batch_seconds) + 1),  # noqa: PLW1509
            text=True,
        )
        try:
            out, err = proc.communicate(request, timeout=limits.batch_seconds)
            ended = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            ended = f"ran past the batch limit of {limits.batch_seconds:g} s and was stopped"
    outcomes: list[Outcome] = []
    for line in out.splitlines():
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if "score" in result:
            outcomes.append(Outcome(float(result["score"])))
        else:
            outcomes.append(Outcome(float("nan"), str(result.get("error", "unknown error"))))
    if len(outcomes) < len(samples):
        detail = err.strip().splitlines()[-1] if err.strip() else ""
        if "MemoryError" in err:
            detail = f"out of memory ({limits.memory_mb} MiB)"
        message = f"not graded: the grader process {ended}" + (f" ({detail})" if detail else "")
        outcomes += [Outcome(float("nan"), message)] * (len(samples) - len(outcomes))
    return outcomes[: len(samples)]

"""Running a user's python grader, ``def grade(sample, item) -> float``: off unless the operator sets
``RLOO_ALLOW_PYTHON_GRADER``, and then never with the service's privileges.

The grader's code runs in ``service/graders/sandbox_runner.py``, in a sandbox of its own
(``RLOO_PYTHON_GRADER_SANDBOX``):

* ``bwrap`` (the default; Debian's ``bubblewrap``): new PID, network, IPC, UTS and mount namespaces,
  so no process, socket or file of the host is in sight. The file system holds only a read-only
  view of the interpreter, its standard library (installed packages hidden) and the shared
  libraries they load, a read-only ``/dev``, an empty 16 MiB ``/tmp`` and no ``/proc``: no database, artifacts, models,
  settings or other process. It runs as an unprivileged uid (``RLOO_PYTHON_GRADER_UID``, 65534):
  started by root, bubblewrap needs no user namespace and the runner drops to that uid with no
  capabilities; started by another user, a user namespace maps it. It dies with its parent, and
  every process it started dies with it (its PID namespace ends).
* ``process``: the same runner in a plain child process (empty environment, ``python -I``, a fresh
  directory, the same limits and audit hook), for hosts where bubblewrap cannot run. An operator
  must choose it knowingly: it keeps a grader from the service's settings, not from its files.

Either way: an empty environment; limits on address space (``memory_mb``), CPU seconds, open files
(64), written bytes (16 MiB), processes (none but itself); an audit hook refusing imports of
processes, sockets and foreign code (depth only: its tables are out of the grader's reach, but
CPython's audit hooks are no boundary). Time is enforced from out here, where the grader cannot
reach: each sample has ``per_sample_seconds`` (the alarm inside stops Python code; the parent kills
the sandbox of a sample that ignores it, and starts a new one for the samples after it), and the
batch has ``batch_seconds``.

Where ``bwrap`` is chosen but cannot run (missing, or namespaces refused), python graders do not
run at all: ``SandboxUnavailable`` says why and what to do.

A sample's error (an exception, a non-number, a time-out, a crash) scores NaN, and its message is
reported per sample, as OpenAI's graders report a grader's errors.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("sandbox_runner.py")
RUNNER_IN_BOX = "/sandbox/runner.py"
_OUTPUT_LIMIT = 8 * 2**20
_START_SECONDS = 2.0  # a sandbox's start (bubblewrap, the interpreter), besides its source's run


@dataclass(frozen=True)
class Limits:
    per_sample_seconds: float = 5.0
    batch_seconds: float = 60.0
    memory_mb: int = 512
    audit_hook: bool = True  # the tests turn it off to show that the sandbox holds without it


@dataclass(frozen=True)
class Outcome:
    score: float
    error: str | None = None
    text: str | None = None
    """A python tool's result (``run_python_tool``)."""


class SandboxUnavailable(RuntimeError):
    """Python graders are on but their sandbox cannot run here."""


@dataclass(frozen=True)
class Sandbox:
    kind: str  # "bwrap" or "process"
    argv: tuple[str, ...]  # the command, up to the runner's path
    uid: int | None  # the runner becomes this uid; None: it keeps the service's (process)

    def describe(self) -> str:
        if self.kind == "bwrap":
            return f"bwrap (namespaces: pid, net, ipc, uts, mount; uid {self.uid}; read-only standard library)"
        return "process (RLOO_PYTHON_GRADER_SANDBOX=process: process limits only, no namespaces)"


# Which sandbox ----------------------------------------------------------------------------------
def configured(settings: Any) -> str:
    """The sandbox python graders are set to run in (/readyz): ``off``, ``bwrap`` or ``process``.
    Whether it runs on a worker's host, that worker's start-up log says (``status``)."""
    return settings.python_grader_sandbox if settings.allow_python_grader else "off"


def status(settings: Any) -> str:
    """Which sandbox python graders run in here, tried, in words (start-up logs, rloo up's banner)."""
    if not settings.allow_python_grader:
        return "off (RLOO_ALLOW_PYTHON_GRADER is false)"
    try:
        return current(settings.python_grader_sandbox, settings.python_grader_uid).describe()
    except SandboxUnavailable as exc:
        return f"unavailable: {exc}"


def current(kind: str, uid: int, *, user_namespace: bool | None = None) -> Sandbox:
    """The sandbox in force for these settings, tried once a process on a one-line grader; raises
    ``SandboxUnavailable`` saying why and what to change. bubblewrap uses a user namespace unless
    it runs as root (``user_namespace`` forces the choice)."""
    return _probed(kind, uid, os.geteuid() != 0 if user_namespace is None else user_namespace)


@functools.cache
def _probed(kind: str, uid: int, user_namespace: bool) -> Sandbox:
    box = _process_sandbox() if kind == "process" else _bwrap_sandbox(uid, user_namespace)
    probe = _run_batch(
        box,
        "def grade(sample, item):\n    return 1.0\n",
        [{"sample": {}, "item": {}}],
        Limits(per_sample_seconds=10, batch_seconds=20),
    )
    if probe[0].error is not None or probe[0].score != 1.0:
        raise SandboxUnavailable(f"the {kind} sandbox does not run here: {probe[0].error}. {_ADVICE}")
    return box


_ADVICE = (
    "Install bubblewrap (Debian: apt-get install bubblewrap) where user namespaces are allowed (in a container: "
    "docker/compose.python-graders.yml), or set RLOO_PYTHON_GRADER_SANDBOX=process to run python graders with "
    "process limits only (weaker; see the README)"
)


def _process_sandbox() -> Sandbox:
    return Sandbox("process", (_interpreter(), "-I", "-S", "-B", str(RUNNER)), None)


def _bwrap_sandbox(uid: int, user_namespace: bool) -> Sandbox:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"python graders run in bubblewrap's sandbox, and bwrap is not installed. {_ADVICE}")
    argv = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
    ]
    if user_namespace:  # `uid` inside, our own uid outside; no user namespace of its own (bwrap 0.8+)
        argv += ["--unshare-user", "--uid", str(uid), "--gid", str(uid)]
        argv += ["--disable-userns"] if _bwrap_has(bwrap, "--disable-userns") else []
    else:  # root: no user namespace; the runner becomes `uid` itself, with these two and then none
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += _file_system()
    argv += ["--", _interpreter(), "-I", "-S", "-B", RUNNER_IN_BOX]
    return Sandbox("bwrap", tuple(argv), uid)


@functools.cache
def _bwrap_has(bwrap: str, option: str) -> bool:
    try:
        return option in subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False


def _interpreter() -> str:
    """The base interpreter (a venv's ``bin/python`` finds its standard library through pyvenv.cfg,
    which is not in the sandbox)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _file_system() -> list[str]:
    """bubblewrap's arguments for the sandbox's file system: the interpreter, its standard library
    (installed packages hidden) and the shared libraries they load, read-only; the runner; an
    empty /tmp; nothing else."""
    # The base interpreter's paths (a venv's platstdlib is under the venv).
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    stdlib = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")}
    libraries, links = _shared_libraries(stdlib)
    binds = {_interpreter(), *stdlib, *libraries}
    tops = [p for p in ("/lib", "/lib64", "/lib32", "/libx32") if os.path.islink(p)]  # merged /usr
    # Parents first, each 0755 (bubblewrap would make the parents of a bind 0700: out of the
    # unprivileged uid's reach).
    placed = [*binds, *(path for _, path in links), RUNNER_IN_BOX]
    parents = sorted({str(q) for p in placed for q in Path(p).parents if str(q) != "/" and str(q) not in tops})
    args: list[str] = []
    for parent in parents:
        args += ["--perms", "0755", "--dir", parent]
    for path in tops:
        args += ["--symlink", os.readlink(path), path]
    for path in sorted(binds):
        args += ["--ro-bind", path, path]
    for target, path in sorted(links):
        args += ["--symlink", target, path]
    for path in sorted(stdlib):  # the standard library alone is importable
        for packages in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(path, packages)):
                args += ["--tmpfs", os.path.join(path, packages)]
    args += [
        "--ro-bind-try",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
        "--ro-bind-try",
        "/usr/lib/locale/C.utf8",
        "/usr/lib/locale/C.utf8",  # locale.setlocale's C.UTF-8
        "--ro-bind",
        str(RUNNER),
        RUNNER_IN_BOX,
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",  # its devices, and no writable /dev/shm
        "--size",
        str(16 * 2**20),
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--remount-ro",
        "/",
    ]
    return args


def _shared_libraries(stdlib: set[str]) -> tuple[set[str], set[tuple[str, str]]]:
    """The shared libraries the interpreter and its C modules load, as ldd resolves them: the files
    to bind, and the symbolic links on the way to them ``(target, path)``. Without ldd (not glibc):
    the system's library directories whole."""
    modules = [p for path in stdlib for p in glob.glob(os.path.join(path, "lib-dynload", "*.so"))]
    ldd = shutil.which("ldd")
    try:
        if ldd is None:
            raise OSError("no ldd")
        out = subprocess.run([ldd, _interpreter(), *modules], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        dirs = {p for p in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64") if os.path.isdir(p)}
        return {p for p in dirs if not os.path.islink(p)}, set()
    files: set[str] = set()
    links: set[tuple[str, str]] = set()
    for reported in set(re.findall(r"(/\S+) \(0x", out)):
        path = _through_dirs(reported)
        for _ in range(40):  # a symlink chain, each link placed where the loader will look
            if not os.path.islink(path):
                break
            target = os.readlink(path)
            links.add((target, path))
            path = _through_dirs(os.path.normpath(os.path.join(os.path.dirname(path), target)))
        if os.path.isfile(path):
            files.add(path)
    return files, links


def _through_dirs(path: str) -> str:
    """``path`` with the symbolic links of its directories resolved, its own name kept."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


# Running a batch --------------------------------------------------------------------------------
def run_python_grader(
    source: str,
    samples: list[dict[str, Any]],
    items: list[Any],
    limits: Limits | None = None,
    *,
    sandbox: Sandbox | None = None,
) -> list[Outcome]:
    """Scores of ``grade(sample, item)`` for each pair; NaN with an error where it failed. Uses the
    sandbox of the settings unless one is given; raises ``SandboxUnavailable`` when it cannot run."""
    if not samples:
        return []
    if sandbox is None:
        from service.core.settings import get_settings

        settings = get_settings()
        sandbox = current(settings.python_grader_sandbox, settings.python_grader_uid)
    batch = [{"sample": s, "item": i} for s, i in zip(samples, items, strict=True)]
    return _run_batch(sandbox, source, batch, limits or Limits())


def run_python_tool(
    source: str, calls: list[dict[str, Any]], limits: Limits, *, sandbox: Sandbox | None = None
) -> list[Outcome]:
    """``call(arguments)`` of a python tool for each call's arguments, in the python graders'
    sandbox (each call ``per_sample_seconds``): an ``Outcome`` whose ``text`` is the result, or
    whose ``error`` says why there is none."""
    if not calls:
        return []
    if sandbox is None:
        from service.core.settings import get_settings

        settings = get_settings()
        sandbox = current(settings.python_grader_sandbox, settings.python_grader_uid)
    return _run_batch(sandbox, source, [{"arguments": a} for a in calls], limits, entry="call")


def _run_batch(
    box: Sandbox, source: str, batch: list[dict[str, Any]], limits: Limits, *, entry: str = "grade"
) -> list[Outcome]:
    """The batch, in as many sandboxes as it takes: a sample that is killed (its time, a crash) ends
    its sandbox, and the samples after it go to a new one; a source that never finishes loading
    fails the whole batch at once."""
    outcomes: list[Outcome | None] = [None] * len(batch)
    batch_deadline = time.monotonic() + limits.batch_seconds
    start = 0
    while start < len(batch) and time.monotonic() < batch_deadline:
        read, ended = _run_once(box, source, batch[start:], limits, batch_deadline, entry)
        for j, outcome in read.got.items():
            outcomes[start + j] = outcome
        first = next((i for i in range(start, len(batch)) if outcomes[i] is None), len(batch))
        if first == len(batch) or ended.batch_over:
            break
        if not read.ready:  # the source itself hangs or crashes (or the sandbox cannot start): every
            # sample would meet it again
            message = f"not graded: the sandbox ended before the grader's source had loaded ({ended.message})"
            return [o if o is not None else Outcome(float("nan"), message) for o in outcomes]
        outcomes[first] = Outcome(float("nan"), ended.message)
        start = first + 1
    message = f"not graded: the batch ran past its limit of {limits.batch_seconds:g} s and was stopped"
    return [o if o is not None else Outcome(float("nan"), message) for o in outcomes]


@dataclass(frozen=True)
class _Ended:
    message: str  # what happened to the sample being graded when the sandbox ended
    batch_over: bool = False


@dataclass
class _Read:
    """What one sandbox answered: outcomes by index, whether its source loaded, and why reading
    stopped (None: it ended or answered all; "sample", "batch": a deadline; "output": too much)."""

    got: dict[int, Outcome] = field(default_factory=dict)
    ready: bool = False
    stopped: str | None = "error"


def _run_once(
    box: Sandbox, source: str, batch: list[dict[str, Any]], limits: Limits, batch_deadline: float, entry: str
) -> tuple[_Read, _Ended]:
    request = {
        "entry": entry,
        "source": source,
        "batch": batch,
        "per_sample_seconds": limits.per_sample_seconds,
        "memory_mb": limits.memory_mb,
        "cpu_seconds": int(limits.batch_seconds) + 1,
        "audit_hook": limits.audit_hook,
    }
    # The request and the log are unnamed files (the request cannot block us on a pipe, RLIMIT_FSIZE
    # caps the log, and a worker killed mid-batch leaves neither behind); the results come on a
    # pipe, read against the clock. The process sandbox's working directory is a fresh empty one.
    fresh = tempfile.TemporaryDirectory(prefix="rloo-grader-") if box.kind == "process" else contextlib.nullcontext("/")
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as log, fresh as work:
        stdin.write(json.dumps(request).encode())
        stdin.seek(0)
        proc = subprocess.Popen(
            [*box.argv, "-" if box.uid is None else str(box.uid)],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=work,
            env={},
            start_new_session=True,  # its own process group: killed whole
        )
        read = _Read()
        try:
            _read_results(proc, len(batch), limits, batch_deadline, read)
        finally:
            if read.stopped is None:  # it is exiting: let it, to learn how
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))  # its last words
        tail = log.read().decode("utf-8", errors="replace")
    return read, _how_it_ended(proc.returncode, read.stopped, tail, limits)


def _read_results(proc: subprocess.Popen[bytes], n: int, limits: Limits, batch_deadline: float, read: _Read) -> None:
    """Result lines as they come, into ``read``. The grader's source has a sample's time to load
    once the sandbox has started; then each sample has ``per_sample_seconds`` (and a second) from
    the answer before it. Only the sample in turn being answered moves the clock on: lines the
    grader forges on the results descriptor buy it no time."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    buffered, total, turn = b"", 0, 0
    sample_deadline = time.monotonic() + _START_SECONDS + limits.per_sample_seconds + 1
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            deadline = min(sample_deadline, batch_deadline)
            if not selector.select(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    read.stopped = "batch" if batch_deadline <= sample_deadline else "sample"
                    return
                continue
            chunk = os.read(fd, 1 << 16)
            total += len(chunk)
            if not chunk or total > _OUTPUT_LIMIT:
                read.stopped = None if not chunk else "output"
                return
            *lines, buffered = (buffered + chunk).split(b"\n")
            moved = False
            for line in lines:
                if line == b'{"ready": true}' and not read.ready and not read.got:
                    read.ready = moved = True  # the source has loaded: the first sample's time starts
                else:
                    _take(line, n, read.got)
            while turn in read.got:
                turn, moved = turn + 1, True
            if turn == n:
                read.stopped = None
                return
            if moved:
                sample_deadline = time.monotonic() + limits.per_sample_seconds + 1


def _take(line: bytes, n: int, got: dict[int, Outcome]) -> None:
    try:
        result = json.loads(line)
        i = result["i"]
    except (ValueError, TypeError, KeyError):
        return
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n or i in got:
        return
    score, text = result.get("score"), result.get("text")
    if isinstance(text, str):
        got[i] = Outcome(float("nan"), None, text)
    elif isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
        got[i] = Outcome(float(score))
    else:
        got[i] = Outcome(float("nan"), str(result.get("error", "no score"))[:500])


def _how_it_ended(returncode: int, timed_out: str | None, log: str, limits: Limits) -> _Ended:
    if timed_out == "batch":
        return _Ended("", batch_over=True)
    if timed_out == "sample":
        return _Ended(f"grade() ran past {limits.per_sample_seconds:g} s and its sandbox was stopped")
    if timed_out == "output":
        return _Ended(f"not graded: the grader wrote more than {_OUTPUT_LIMIT // 2**20} MiB of results")
    if "MemoryError" in log:
        return _Ended(f"not graded: the grader ran out of memory ({limits.memory_mb} MiB)")
    if returncode == -signal.SIGXCPU:
        return _Ended("not graded: the grader used up its CPU time")
    ended = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with {returncode}"
    detail = log.strip().splitlines()[-1][:300] if log.strip() else ""
    return _Ended(f"not graded: the grader process {ended}" + (f" ({detail})" if detail else ""))

"""The python grader's sandbox (service/graders/sandbox.py): a grader that loops forever, allocates without
bound, reads the settings or the database, opens a socket or starts a process gets an error for
that sample, and the samples around it are still graded.

Three layers, each tested on its own: the OS sandbox (bubblewrap: namespaces, an unprivileged uid,
a read-only file system of the standard library), the limits and clock kept from outside, and the
audit hook inside (depth only). The escape battery runs with the audit hook switched off, so what
it shows is the sandbox alone; the hook's own tests show that grader code cannot switch it off."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from service.graders import sandbox
from service.graders.sandbox import Limits, run_python_grader

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux's")

ROOT = os.geteuid() == 0


def run(source: str, n: int = 1, box: sandbox.Sandbox | None = None, **limits: object) -> list[sandbox.Outcome]:
    return run_python_grader(
        source,
        [{"output_text": f"s{i}"} for i in range(n)],
        [{"i": i} for i in range(n)],
        Limits(**limits),
        sandbox=box or sandbox.current("bwrap", 65534),
    )  # type: ignore[arg-type]


def grade_body(body: str) -> str:
    return "def grade(sample, item):\n" + "".join(f"    {line}\n" for line in body.splitlines())


# The escape battery: the OS sandbox alone ------------------------------------------------------
# Both ways bubblewrap runs: as root with no user namespace (the runner drops to the uid), and in a
# user namespace (as any other user runs it).
BOXES = [pytest.param(False, id="root-drops-uid"), pytest.param(True, id="user-namespace")]


@pytest.fixture(params=BOXES)
def box(request: pytest.FixtureRequest) -> sandbox.Sandbox:
    if not request.param and not ROOT:
        pytest.skip("bubblewrap without a user namespace needs root")
    return sandbox.current("bwrap", 65534, user_namespace=request.param)


def escape(box: sandbox.Sandbox, body: str, **limits: object) -> sandbox.Outcome:
    return run(grade_body(body), 1, box, audit_hook=False, **limits)[0]


def refused(outcome: sandbox.Outcome, *errors: str) -> None:
    assert math.isnan(outcome.score), f"the escape worked: {outcome}"
    assert any(e in (outcome.error or "") for e in errors), outcome.error


@pytest.fixture
def secrets_of_the_service(env, tmp_path):  # type: ignore[no-untyped-def]
    """What a grader must not reach: the database file, the artifacts, the settings in the
    environment of a process of the service (this one), the broker's socket."""
    from service.core.settings import get_settings

    settings = get_settings()
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    (settings.artifacts_dir / "secret.txt").write_text("secret")
    return settings


def test_the_grader_runs_as_an_unprivileged_user_with_nothing_of_the_host_in_view(box) -> None:
    assert escape(box, "import os\nreturn float(os.getuid() + os.geteuid() + os.getgid())").score == 3 * 65534
    # Only the sandbox's own file system: no /proc, /home, /work, /var, /etc (but the loader's cache).
    listed = escape(
        box,
        "import os\nreturn float(len(set(os.listdir('/')) - {'usr', 'lib', 'lib64', 'tmp', "
        "'dev', 'sandbox', 'root', 'etc', 'lib32', 'libx32'}))",
    )
    assert listed.score == 0.0, listed


def test_every_file_in_view_is_the_interpreter_its_library_or_a_shared_library(box) -> None:
    """Nothing else of the host, no installed package either: only the standard library imports."""
    allowed = (
        "/dev/",
        "/sandbox/runner.py",
        "/etc/ld.so.cache",
        "/tmp/",
        "/usr/lib/locale/C.utf8/",
        sandbox._interpreter(),
        os.path.realpath(sysconfig.get_paths()["stdlib"]) + "/",
    )
    body = (
        "import os, re\n"
        "bad = []\n"
        "for top, dirs, files in os.walk('/'):\n"
        "    for f in files:\n"
        "        p = os.path.join(top, f)\n"
        "        library = re.fullmatch(r'(lib[\\w+.-]*\\.so[\\d.]*|ld-linux[\\w.-]*)', f)\n"
        f"        if (not (p.startswith({allowed!r}) or library) or '-packages/' in p) and os.access(p, os.R_OK):\n"
        "            bad.append(p)\n"
        "if bad:\n"
        "    raise ValueError(bad[:5])\n"
        "return 1.0"
    )
    out = escape(box, body, per_sample_seconds=30, batch_seconds=60)
    assert out.score == 1.0, out


@pytest.mark.parametrize(
    ("what", "body", "errors"),
    [
        (
            "run a program",
            "import subprocess\nsubprocess.run(['id'])\nreturn 1.0",
            ("No such file", "Resource temporarily unavailable", "BlockingIOError"),
        ),
        (
            "run the interpreter",
            "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'])\nreturn 1.0",
            ("Resource temporarily unavailable", "BlockingIOError"),
        ),
        ("fork bomb", "import os\nwhile True:\n    os.fork()", ("Resource temporarily unavailable",)),
        (
            "start a thread",
            "import threading\nt = threading.Thread(target=print)\nt.start()\nreturn 1.0",
            ("can't start new thread",),
        ),
        (
            "read the parent's environment",
            "import os\nreturn float(len(open(f'/proc/{os.getppid()}/environ').read()))",
            ("No such file",),
        ),
        ("read its own process table", "import os\nreturn float(len(os.listdir('/proc')))", ("No such file",)),
        (
            "reach PostgreSQL",
            "import socket\nsocket.create_connection(('127.0.0.1', 5432), timeout=2)\nreturn 1.0",
            ("Network is unreachable", "Cannot assign requested address", "Connection refused"),
        ),
        (
            "reach Redis",
            "import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=2)\nreturn 1.0",
            ("Network is unreachable", "Cannot assign requested address", "Connection refused"),
        ),
        (
            "reach the internet",
            "import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=2)\nreturn 1.0",
            ("Network is unreachable",),
        ),
        ("fill the disk", "open('/tmp/x', 'wb').write(b'x' * 2**26)\nreturn 1.0", ("File too large", "No space left")),
        ("write outside /tmp", "open('/x', 'w').write('x')\nreturn 1.0", ("Read-only", "Permission denied")),
        (
            "fill /dev/shm",
            "open('/dev/shm/x', 'wb').write(b'x' * 2**26)\nreturn 1.0",
            ("Read-only", "Permission denied", "No such file"),
        ),
        (
            "write into the standard library",
            "import os\nopen(os.__file__, 'a').write('x')\nreturn 1.0",
            ("Read-only", "Permission denied"),
        ),
        (
            "become root",
            "import ctypes\nif ctypes.CDLL(None).setuid(0) != 0:\n    raise OSError('setuid refused')\nreturn 1.0",
            ("setuid refused",),
        ),
        (
            "mount a file system",
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "if libc.mount(b'none', b'/tmp', b'proc', 0, None) != 0:\n    raise OSError(ctypes.get_errno(), 'mount')\n"
            "return 1.0",
            ("[Errno 1]",),
        ),
        ("allocate without bound", "x = []\nwhile True:\n    x.append(bytearray(10**7))", ("memory",)),
    ],
)
def test_escapes_are_refused_by_the_sandbox_alone(box, what: str, body: str, errors: tuple[str, ...]) -> None:
    counted = {"Resource temporarily unavailable", "can't start new thread"} & set(errors)
    if counted and ROOT and "--unshare-user" in box.argv:
        # The kernel exempts uid 0 from RLIMIT_NPROC, and a user namespace made by root is uid 0
        # outside: the reason bubblewrap started by root runs without one (the other box).
        pytest.skip("processes are counted only for users other than root")
    refused(escape(box, body), *errors)


def test_no_user_namespace_of_its_own_where_bubblewrap_makes_one() -> None:
    box = sandbox.current("bwrap", 65534, user_namespace=True)
    body = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.unshare(0x10000000) != 0:\n    raise OSError(ctypes.get_errno(), 'unshare')\nreturn 1.0"
    )
    refused(escape(box, body), "[Errno 28]", "[Errno 1]")  # ENOSPC: max_user_namespaces is 0 there


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # its file is the one to hide
def test_the_service_files_are_out_of_sight(box, secrets_of_the_service) -> None:
    settings = secrets_of_the_service
    targets = [str(settings.artifacts_dir / "secret.txt"), str(settings.home_dir), str(settings.models_dir)]
    if settings.database_url.startswith("sqlite"):
        targets.append(settings.database_url.split("///", 1)[1])
    for target in targets:
        refused(escape(box, f"import os\nos.stat({target!r})\nreturn 1.0"), "No such file")
    if settings.redis_client_url.startswith("unix://"):
        path = settings.redis_client_url[len("unix://") :]
        refused(
            escape(box, f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nreturn 1.0"),
            "No such file",
        )


def test_no_process_of_the_host_can_be_signalled(box) -> None:
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        body = f"import os, signal\nos.kill({sentinel.pid}, signal.SIGKILL)\nreturn 1.0"
        refused(escape(box, body), "No such process")
        # Everything it may signal: only what lives in its own PID namespace.
        escape(box, "import os, signal\nos.kill(-1, signal.SIGKILL)\nreturn 1.0")
        time.sleep(0.2)
        assert sentinel.poll() is None and os.getppid() > 1
    finally:
        sentinel.kill()
        sentinel.wait()


def test_an_ignored_alarm_does_not_buy_time() -> None:
    source = (
        "import sys\nsig = sys.modules['signal']\nsig.signal(sig.SIGALRM, sig.SIG_IGN)\n"
        "def grade(sample, item):\n    while item['i'] == 1:\n        pass\n    return 1.0\n"
    )
    t0 = time.monotonic()
    out = run(source, 3, per_sample_seconds=0.5, audit_hook=False)
    assert time.monotonic() - t0 < 8
    assert [o.score for o in out][::2] == [1.0, 1.0], out  # the samples after it: a new sandbox
    assert out[1].error == "grade() ran past 0.5 s and its sandbox was stopped"


def test_forged_lines_on_the_results_descriptor_buy_no_time() -> None:
    """The results descriptor is the grader's to write: announcing 'ready' again and again, or an
    answer to a later sample, does not move the clock of the sample in turn."""
    source = (
        "import os, time\n"
        "def grade(sample, item):\n"
        '    os.write(3, b\'{"i": 1, "score": 5}\\n\')\n'
        "    while True:\n"
        "        try:\n"
        "            os.write(3, b'{\"ready\": true}\\n')\n"
        "            time.sleep(0.1)\n"
        "        except BaseException:\n"
        "            pass\n"
    )
    t0 = time.monotonic()
    out = run(source, 2, per_sample_seconds=0.5, batch_seconds=30, audit_hook=False)
    assert time.monotonic() - t0 < 8
    assert out[0].error == "grade() ran past 0.5 s and its sandbox was stopped", out


def test_a_source_that_never_loads_fails_the_batch_once() -> None:
    """A loop in the module's own code (in C, past the alarm): one sandbox, not one per sample."""
    t0 = time.monotonic()
    out = run("x = sum(range(10**12))\ndef grade(sample, item):\n    return 1.0\n", 5, per_sample_seconds=0.3)
    assert time.monotonic() - t0 < 6
    assert all(
        o.error == "not graded: the sandbox ended before the grader's source had loaded (grade() ran past "
        "0.3 s and its sandbox was stopped)"
        for o in out
    ), out


def test_a_sample_that_kills_its_sandbox_loses_only_itself() -> None:
    source = "import os\ndef grade(sample, item):\n    if item['i'] == 1:\n        os._exit(3)\n    return 2.0\n"
    out = run(source, 3)
    assert [o.score for o in out][::2] == [2.0, 2.0]
    assert out[1].error == "not graded: the grader process exited with 3"


# The audit hook: depth, and out of the grader's reach --------------------------------------------
@pytest.mark.parametrize(
    "tamper",
    [
        # The escape a review found: rebind the runner's tables through its module's globals.
        "import sys\nm = sys.modules['__main__']\nm.NO_IMPORT = frozenset()\nm.NO_EVENTS = ()\n"
        "m.make_hook = lambda *a, **k: (lambda e, a: None)\n",
        # Swap the builtins the hook calls.
        "import builtins\nbuiltins.isinstance = lambda *a: False\nbuiltins.any = lambda *a: False\n",
        # Rewrite the runner's locals through its frame.
        "import sys\nf = sys._getframe(1)\nf.f_locals['prefixes'] = ('/',)\n",
    ],
    ids=["module-globals", "builtins", "frames"],
)
def test_grader_code_cannot_switch_the_audit_hook_off(tamper: str) -> None:
    source = tamper + "def grade(sample, item):\n    import subprocess\n    return 1.0\n"
    out = run(source, 1)
    assert math.isnan(out[0].score) and "may not import subprocess" in (out[0].error or ""), out


def test_fooling_the_hook_still_meets_the_sandbox() -> None:
    """The hook is no boundary (CPython's documentation says so): a grader that makes realpath lie
    to it opens what it likes, and finds nothing there."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    source = (
        f"import posixpath\nposixpath.abspath = lambda p: {stdlib!r} + '/os.py'\n"
        "def grade(sample, item):\n    return float(len(open('/proc/self/environ').read()))\n"
    )
    out = run(source, 1)
    assert math.isnan(out[0].score) and "No such file" in (out[0].error or ""), out


@pytest.mark.parametrize(
    ("body", "says"),
    [
        # the settings: the environment is empty (no DATABASE_URL, no RLOO_*, no keys)
        # (Python itself sets LC_CTYPE: PEP 538's locale coercion; bubblewrap sets PWD)
        ("import os\nreturn float(len(set(os.environ) - {'LC_CTYPE', 'PWD'}))", None),
        ("import os\nreturn float(bool(os.environ['DATABASE_URL']))", "KeyError: 'DATABASE_URL'"),
        ("return float(len(open('/etc/passwd').read()))", "may not open /etc/passwd"),
        ("import sqlite3\nsqlite3.connect('/tmp/x.db')\nreturn 1.0", "may not import sqlite3"),
        ("open('out.txt', 'w').write('x')\nreturn 1.0", "may not open"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 5432))\nreturn 1.0", "may not import socket"),
        ("import subprocess\nsubprocess.run(['true'])\nreturn 1.0", "may not import subprocess"),
        ("import os\nos.system('true')\nreturn 1.0", "may not use os.system"),
        ("import ctypes\nctypes.CDLL(None)\nreturn 1.0", "may not import ctypes"),
        (
            "import sysconfig\nreturn float(len(open(sysconfig.get_paths()['stdlib'] + "
            "'/../../../../../../proc/self/environ').read()))",
            "may not open /proc/",
        ),
        ("import os\nos.open('x', os.O_WRONLY | os.O_CREAT)\nreturn 1.0", "may not open"),
        ("import _posixsubprocess\nreturn 1.0", "may not import _posixsubprocess"),
        ("import gc\nreturn float(len(gc.get_objects()))", "may not import gc"),
        ("import sys\nsys.settrace(lambda *a: None)\nreturn 1.0", "may not use sys.settrace"),
        ("class P:\n    def __fspath__(self): return '/etc/passwd'\nopen(P())\nreturn 1.0", "may not open /etc/passwd"),
        ("import os\nos.truncate('/tmp/x', 0)\nreturn 1.0", "may not use os.truncate"),
        ("import os\nos.kill(os.getppid(), 9)\nreturn 1.0", "may not use os.kill"),
    ],
)
def test_what_the_audit_hook_refuses(body: str, says: str | None) -> None:
    out = run(grade_body(body))
    if says is None:
        assert out[0].score == 0.0  # an empty environment
    else:
        assert math.isnan(out[0].score) and says in (out[0].error or ""), out[0]


# Limits and errors ---------------------------------------------------------------------------------
def test_a_sample_that_loops_forever_times_out_and_the_others_are_graded() -> None:
    source = "def grade(sample, item):\n    while item['i'] == 1:\n        pass\n    return float(item['i'])\n"
    t0 = time.monotonic()
    out = run(source, 3, per_sample_seconds=0.3)
    assert time.monotonic() - t0 < 5
    assert [o.score for o in out][::2] == [0.0, 2.0] and math.isnan(out[1].score)
    assert out[1].error == "TimeoutError: grade() ran past 0.3 s"


def test_a_loop_the_alarm_cannot_interrupt_is_stopped_from_outside() -> None:
    # A loop in C (sum over a range) checks for no signal: the alarm cannot stop it; the parent does.
    source = "def grade(sample, item):\n    return float(sum(range(10**12)))\n"
    t0 = time.monotonic()
    out = run(source, 2, per_sample_seconds=0.2, batch_seconds=2.0)
    assert time.monotonic() - t0 < 6
    assert all(math.isnan(o.score) for o in out)
    assert "ran past 0.2 s" in (out[0].error or "")
    assert "batch ran past its limit of 2 s" in (out[1].error or "")


def test_unbounded_allocation_hits_the_memory_limit() -> None:
    source = "def grade(sample, item):\n    x = []\n    while True:\n        x.append(bytearray(10**7))\n"
    out = run(source, 2, memory_mb=256)
    assert all(math.isnan(o.score) for o in out)
    assert "out of memory" in (out[0].error or "")


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def grade(sample, item) return 1", "the grader's source failed: SyntaxError"),
        ("def score(sample, item):\n    return 1.0\n", "the grader's source failed: KeyError: 'grade'"),
        ("def grade(sample, item):\n    return 'yes'\n", "grade() returned str, not a number"),
        ("def grade(sample, item):\n    return float('nan')\n", "grade() returned a non-finite number"),
        ("def grade(sample, item):\n    return True\n", "grade() returned bool, not a number"),
    ],
)
def test_bad_graders_say_what_is_wrong(source: str, says: str) -> None:
    out = run(source, 2)
    assert all(math.isnan(o.score) for o in out)
    assert all(says in (o.error or "") for o in out), out


def test_the_standard_library_is_available() -> None:
    source = (
        "import json, math, re, statistics, collections, dataclasses\n"
        "P = collections.namedtuple('P', 'x')\n"
        "def grade(sample, item):\n    return statistics.mean([1, 2, 3]) + P(0).x\n"
    )
    assert [o.score for o in run(source, 2)] == [2.0, 2.0]


def test_what_a_grader_prints_cannot_confuse_or_crash_the_parent() -> None:
    """Results travel on a private descriptor: prints, half lines and invalid UTF-8 on stdout or
    stderr neither crash the parent nor move a score onto another sample."""
    source = (
        "import sys, os\n"
        "def grade(sample, item):\n"
        "    print(1)\n"
        '    sys.stdout.write(\'{"i": 1, "score": 99}\')\n'
        "    os.write(2, b'\\xff\\xfe not utf-8')\n"
        "    return float(item['i'])\n"
    )
    assert [o.score for o in run(source, 3)] == [0.0, 1.0, 2.0]


def test_the_process_sandbox_keeps_the_limits_and_the_hook() -> None:
    """RLOO_PYTHON_GRADER_SANDBOX=process, for hosts without bubblewrap: weaker, but the clock, the
    limits and the hook hold."""
    box = sandbox.current("process", 65534)
    assert box.kind == "process" and "process limits only" in box.describe()
    source = (
        "import sys\nsig = sys.modules['signal']\nsig.signal(sig.SIGALRM, sig.SIG_IGN)\n"
        "def grade(sample, item):\n    while item['i'] == 1:\n        pass\n    import socket\n    return 1.0\n"
    )
    out = run(source, 2, box, per_sample_seconds=0.5)
    assert "may not import socket" in (out[0].error or "") and "its sandbox was stopped" in (out[1].error or "")


def test_without_bubblewrap_python_graders_refuse_to_run(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox._probed.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="bwrap is not installed.*RLOO_PYTHON_GRADER_SANDBOX"):
            sandbox.current("bwrap", 65534)
    finally:
        sandbox._probed.cache_clear()


def test_a_job_with_a_python_grader_trains_counts_its_errors_and_says_the_first(tmp_path, models_dir) -> None:
    from tests.helpers.training import ListRecorder, config
    from worker.engine.methods.rloo import train

    source = (
        "def grade(sample, item):\n"
        "    if len(sample['output_text']) % 2:\n"
        "        raise ValueError('odd length')\n"
        "    return float(item['answer'].lower() in sample['output_text'].lower())\n"
    )
    grader = {"type": "python", "name": "py", "source": source}
    rec = ListRecorder()
    train(config(tmp_path, models_dir, grader, max_steps=3), rec)
    assert len(rec.steps) == 3
    errors = [m["graders.py.errors"] for m in rec.steps]
    assert sum(errors) > 0 and all(m["nan_rewards"] == e for m, e in zip(rec.steps, errors, strict=True))
    said = [e for e in rec.events if "could not score" in e]
    assert len(said) == 1 and "ValueError: odd length" in said[0]  # once a run, not once a step


def test_a_process_left_behind_does_not_hold_the_parent() -> None:
    """A time-out kills the grader's whole process group and never waits on its pipes."""
    source = "def grade(sample, item):\n    while True:\n        pass\n"
    t0 = time.monotonic()
    out = run(source, 2, per_sample_seconds=30, batch_seconds=1.0)
    assert time.monotonic() - t0 < 5 and all(math.isnan(o.score) for o in out)


def test_a_sandbox_ends_with_the_process_that_started_it() -> None:
    """--die-with-parent: a worker killed mid-sample leaves no grader running."""
    parent = _grader_parent()
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _runners():
            time.sleep(0.1)
        assert not _runners()
    finally:
        if parent.poll() is None:
            parent.kill()


def _grader_parent(attempts: int = 3) -> subprocess.Popen[bytes]:
    """A process running a python grader that never ends, once its sandboxed runner is up. A fresh
    interpreter, its imports and bubblewrap take seconds, more on a loaded 2-core machine. In one
    full-suite run no runner appeared within 60 s (the test passes alone in under a second; the cause
    was not seen): a parent that ends first is started again, and each try's output is shown if none
    runs."""
    code = (
        "from service.graders import sandbox\n"
        "sandbox.run_python_grader('def grade(s, i):\\n    while True: pass\\n', [{}], [{}],"
        " sandbox.Limits(per_sample_seconds=60, batch_seconds=60), sandbox=sandbox.current('bwrap', 65534))\n"
    )
    seen = []
    for _ in range(attempts):
        parent = subprocess.Popen(
            [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _runners() and parent.poll() is None:
            time.sleep(0.1)
        if _runners():
            return parent
        if parent.poll() is None:
            parent.kill()
        out, _ = parent.communicate()
        seen.append(f"exit {parent.returncode}: {out.decode(errors='replace')[-1500:]}")
        time.sleep(1)
    raise AssertionError("the grader never started:\n" + "\n".join(seen))


def _runners() -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and sandbox.RUNNER_IN_BOX.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found

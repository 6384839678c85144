"""The python grader's sandbox (service/sandbox.py): a grader that loops forever, allocates without
bound, reads the settings or the database, opens a socket or starts a process gets an error for
that sample, and the samples around it are still graded."""

from __future__ import annotations

import math
import time

import pytest

from service.sandbox import Limits, run_python_grader


def run(source: str, n: int = 1, **limits: float) -> list:
    return run_python_grader(source, [{"output_text": f"s{i}"} for i in range(n)], [{"i": i} for i in range(n)],
                             Limits(**limits))  # type: ignore[arg-type]


def test_a_sample_that_loops_forever_times_out_and_the_others_are_graded() -> None:
    source = "def grade(sample, item):\n    while item['i'] == 1:\n        pass\n    return float(item['i'])\n"
    t0 = time.monotonic()
    out = run(source, 3, per_sample_seconds=0.3)
    assert time.monotonic() - t0 < 5
    assert [o.score for o in out][::2] == [0.0, 2.0] and math.isnan(out[1].score)
    assert out[1].error == "TimeoutError: grade() ran past 0.3 s"


def test_a_loop_the_alarm_cannot_interrupt_is_stopped_by_the_batch_limit() -> None:
    # A loop in C (sum over a range) checks for no signal: the alarm cannot stop it, the batch limit does.
    source = "def grade(sample, item):\n    return float(sum(range(10**12)))\n"
    t0 = time.monotonic()
    out = run(source, 2, per_sample_seconds=0.2, batch_seconds=1.0)
    assert time.monotonic() - t0 < 5
    assert all(math.isnan(o.score) for o in out)
    assert "batch limit of 1 s" in (out[0].error or "")


def test_unbounded_allocation_hits_the_memory_limit() -> None:
    source = "def grade(sample, item):\n    x = []\n    while True:\n        x.append(bytearray(10**7))\n"
    out = run(source, 2, memory_mb=256)
    assert all(math.isnan(o.score) for o in out)
    assert "out of memory" in (out[0].error or "")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        # the settings: the environment is empty (no DATABASE_URL, no RLOO_*, no keys)
        # (Python itself sets LC_CTYPE: PEP 538's locale coercion)
        ("import os\n    return float(len(set(os.environ) - {'LC_CTYPE'}))", None),
        ("import os\n    return float(bool(os.environ['DATABASE_URL']))", "KeyError: 'DATABASE_URL'"),
        # files outside Python's own library: the database, the project, /etc
        ("return float(len(open('/etc/passwd').read()))", "may not open /etc/passwd"),
        ("import sqlite3\n    sqlite3.connect('/tmp/x.db')\n    return 1.0", "may not import sqlite3"),
        ("open('out.txt', 'w').write('x')\n    return 1.0", "may not open"),
        ("import socket\n    socket.create_connection(('127.0.0.1', 5432))\n    return 1.0", "may not import socket"),
        ("import subprocess\n    subprocess.run(['true'])\n    return 1.0", "may not import subprocess"),
        ("import os\n    os.system('true')\n    return 1.0", "may not use os.system"),
        ("import ctypes\n    ctypes.CDLL(None)\n    return 1.0", "may not import ctypes"),
        # Escapes a review found, each closed:
        # a path that climbs out of the library with ../ (the parent's environment: its secrets)
        ("import sysconfig\n    return float(len(open(sysconfig.get_paths()['stdlib'] + "
         "'/../../../../../../proc/self/environ').read()))", "may not open /proc/"),
        # os.open reports no mode: the write is in its flags
        ("import os\n    os.open('x', os.O_WRONLY | os.O_CREAT)\n    return 1.0", "may not open"),
        # _posixsubprocess.fork_exec raises no audit event: it cannot be imported
        ("import _posixsubprocess\n    return 1.0", "may not import _posixsubprocess"),
        # the garbage collector would hand over the hook's own closure; tracing would watch it run
        ("import gc\n    return float(len(gc.get_objects()))", "may not import gc"),
        ("import sys\n    sys.settrace(lambda *a: None)\n    return 1.0", "may not use sys.settrace"),
        # a path-like object: open() turns it into its path before the hook sees it
        ("class P:\n        def __fspath__(self): return '/etc/passwd'\n    open(P())\n    return 1.0",
         "may not open /etc/passwd"),
        ("import os\n    os.truncate('/tmp/x', 0)\n    return 1.0", "may not use os.truncate"),
        ("import os\n    os.kill(os.getppid(), 9)\n    return 1.0", "may not use os.kill"),
    ],
)
def test_what_a_grader_may_not_reach(body: str, says: str | None) -> None:
    out = run(f"def grade(sample, item):\n    {body}\n")
    if says is None:
        assert out[0].score == 0.0  # an empty environment
    else:
        assert math.isnan(out[0].score) and says in (out[0].error or ""), out[0]


def test_the_database_file_cannot_be_read(env) -> None:
    from service.settings import get_settings

    url = get_settings().database_url
    if not url.startswith("sqlite"):
        pytest.skip("a server database: its credentials live only in the environment, which is empty here")
    path = url.split("///", 1)[1]
    out = run(f"def grade(sample, item):\n    return float(len(open({path!r}, 'rb').read()))\n")
    assert math.isnan(out[0].score) and f"may not open {path}" in (out[0].error or "")


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
    source = "import json, math, re, statistics\ndef grade(sample, item):\n    return statistics.mean([1, 2, 3])\n"
    assert [o.score for o in run(source, 2)] == [2.0, 2.0]


def test_a_job_with_a_python_grader_trains_counts_its_errors_and_says_the_first(tmp_path, models_dir) -> None:
    from tests.test_train import ListRecorder, config
    from worker.train import train

    source = (
        "def grade(sample, item):\n"
        "    if len(sample['output_text']) % 2:\n"
        "        raise ValueError('odd length')\n"
        "    return float(item['answer'].lower() in sample['output_text'].lower())\n"
    )
    grader = {"type": "python", "name": "py", "source": source}
    rec = ListRecorder()
    train(config(tmp_path, models_dir, grader, max_steps=3, cfg={"extra": {"allow_python_grader": True}}), rec)
    assert len(rec.steps) == 3
    errors = [m["graders.py.errors"] for m in rec.steps]
    assert sum(errors) > 0 and all(m["nan_rewards"] == e for m, e in zip(rec.steps, errors, strict=True))
    said = [e for e in rec.events if "could not score" in e]
    assert len(said) == 1 and "ValueError: odd length" in said[0]  # once a run, not once a step


def test_what_a_grader_prints_cannot_confuse_or_crash_the_parent() -> None:
    """Results travel on a private descriptor: prints, half lines and invalid UTF-8 on stdout or
    stderr neither crash the parent nor move a score onto another sample."""
    source = (
        "import sys, os\n"
        "def grade(sample, item):\n"
        "    print(1)\n"
        "    sys.stdout.write('{\"i\": 1, \"score\": 99}')\n"
        "    os.write(2, b'\\xff\\xfe not utf-8')\n"
        "    return float(item['i'])\n"
    )
    assert [o.score for o in run(source, 3)] == [0.0, 1.0, 2.0]


def test_a_process_left_behind_does_not_hold_the_parent(tmp_path) -> None:
    """A time-out kills the grader's whole process group and never waits on its pipes."""
    source = "def grade(sample, item):\n    while True:\n        pass\n"
    t0 = time.monotonic()
    out = run(source, 2, per_sample_seconds=30, batch_seconds=1.0)
    assert time.monotonic() - t0 < 5 and all(math.isnan(o.score) for o in out)

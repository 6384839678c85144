"""Grader dry runs (POST /v1/fine_tuning/alpha/graders/run) on the session's real graders worker
(``rloo worker --queue <queue>-graders``): fair between projects, capped per project, and a dry run
or a message that kills or confuses the worker costs one answer, never the worker.

Also a python grader's sandbox escape through the API, as a tenant sends it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from service.jobs import dry_runs as dry_run_queue
from tests.helpers.api import assert_error
from tests.helpers.data import STRING_CHECK
from tests.helpers.scoring import Endpoint
from worker.jobs.message_guard import MAX_DELIVERIES

RUN = "/v1/fine_tuning/alpha/graders/run"

# Dry runs touch no database (but for the key's check): one backend is enough here.
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def python_grader(source: str) -> dict[str, Any]:
    return {"type": "python", "name": "py", "source": source}


def _redis(env: dict[str, str]) -> redis.Redis:
    from service.core.settings import Settings

    return redis.Redis.from_url(Settings(REDIS_URL=env["REDIS_URL"]).redis_client_url)


# Fairness and caps, on the real Redis, no worker: this test plays the worker ----------------------
def test_a_worker_takes_from_the_project_served_longest_ago(env, monkeypatch) -> None:
    queue = f"fair-{secrets.token_hex(4)}"
    conn = _redis(env)
    taken: list[str] = []

    async def submit() -> None:
        async def one(project: str, n: int) -> None:
            with contextlib.suppress(dry_run_queue.NoAnswer):  # (each is answered)
                await dry_run_queue.run(project=project, payload={"n": n}, queue=queue, timeout=20, cap=10)

        tasks = []
        for project, count in (("a", 5), ("b", 1), ("c", 1)):  # a's five are queued before b's one
            for n in range(count):
                tasks.append(asyncio.create_task(one(project, n)))
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(play_worker)
        await asyncio.gather(*tasks)

    def play_worker() -> None:
        while (envelope := dry_run_queue.take(conn, queue, "task")) is not None:
            taken.append(f"{envelope['project']}{envelope['payload']['n']}")
            dry_run_queue.answer(conn, queue, "task", envelope, {"reward": 1.0})

    monkeypatch.setattr("service.infra.task_queue.wake_grader", lambda *a: None)  # this test plays the worker
    asyncio.run(submit())
    assert taken == ["a0", "b0", "c0", "a1", "a2", "a3", "a4"]


def test_two_processes_taking_at_once_never_take_a_project_past_its_share(env, monkeypatch) -> None:
    """A project's place among the dry runs being graded is taken in the same script that takes its
    dry run: a second process taking right after the first one's script (before: the place was
    marked only afterwards, so both took one of the project's, and one project held both of the
    graders worker's processes) finds the project at its share (one of two) and takes nothing."""
    queue = f"race-{secrets.token_hex(4)}"
    conn = _redis(env)
    second: list[Any] = []

    class Interleaved:
        """The first process's connection: a second process takes right after each of its scripts."""

        def __init__(self, real: redis.Redis) -> None:
            self.real = real

        def eval(self, *args: Any) -> Any:
            out = self.real.eval(*args)
            if not second:
                second.append(dry_run_queue.take(conn, queue, "second-process"))
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    taken: list[Any] = []

    async def scenario() -> None:
        waiting = [
            asyncio.create_task(dry_run_queue.run(project="a", payload={"n": n}, queue=queue, timeout=5, cap=10))
            for n in range(2)
        ]
        await asyncio.sleep(0.3)
        first = await asyncio.to_thread(dry_run_queue.take, Interleaved(conn), queue, "first-process")
        taken.append(first)
        dry_run_queue.answer(conn, queue, "first-process", first, {"reward": 1.0})
        if second[0] is not None:  # (before: answered too, so that the scenario ends)
            dry_run_queue.answer(conn, queue, "second-process", second[0], {"reward": 1.0})
        nxt = await asyncio.to_thread(dry_run_queue.take, conn, queue, "third")  # a's next, its place free again
        taken.append(nxt)
        if nxt is not None:
            dry_run_queue.answer(conn, queue, "third", nxt, {"reward": 1.0})
        await asyncio.gather(*waiting)

    monkeypatch.setattr("service.infra.task_queue.wake_grader", lambda *a: None)  # this test plays the workers
    asyncio.run(scenario())
    assert second == [None]  # a was at its share: the second process took nothing
    assert sorted(t["payload"]["n"] for t in taken) == [0, 1]  # each of a's taken once, one at a time


def test_a_project_at_its_cap_is_refused_and_others_are_not(env, monkeypatch) -> None:
    """Admission alone (no worker; this test takes a dry run as one would): a project's place is
    free again once its dry run is answered or withdrawn, never while a worker still grades it."""
    queue = f"cap-{secrets.token_hex(4)}"
    conn = _redis(env)

    async def one(project: str) -> str:
        try:
            await dry_run_queue.run(project=project, payload={}, queue=queue, timeout=1, cap=1)
        except dry_run_queue.Busy:
            return f"{project}: busy"
        except dry_run_queue.NoAnswer:
            return f"{project}: no answer"  # admitted, and nobody answered in time
        return f"{project}: answered"

    async def scenario() -> list[str]:
        first = asyncio.create_task(one("a"))
        await asyncio.sleep(0.3)
        outcomes = [*await asyncio.gather(one("a"), one("b")), await first]
        # A worker takes a's next dry run and is slow: the API stops waiting; the place stays taken.
        held = asyncio.create_task(one("a"))
        await asyncio.sleep(0.3)
        envelope = await asyncio.to_thread(dry_run_queue.take, conn, queue, "slow-task")
        outcomes += [await held, await one("a")]
        dry_run_queue.answer(conn, queue, "slow-task", envelope, {"reward": 1.0})
        return [*outcomes, await one("a")]

    monkeypatch.setattr("service.infra.task_queue.wake_grader", lambda *a: None)  # no worker: admission only
    assert asyncio.run(scenario()) == [
        "a: busy",
        "b: no answer",
        "a: no answer",  # the first, withdrawn at its deadline
        "a: no answer",
        "a: busy",  # held by the slow worker
        "a: no answer",  # answered at last: a's place is free
    ]


# Through the API, on the session's graders worker ------------------------------------------------
def test_every_grader_is_graded_on_the_worker_never_in_the_api(client, auth, monkeypatch) -> None:
    """Without a graders worker (this test's queue has none) even a string_check waits and times out:
    the API grades nothing itself."""
    _setting(monkeypatch, RLOO_GRADER_RUN_SECONDS="1")
    resp = client.post(RUN, headers=auth, json={"grader": STRING_CHECK, "model_sample": "red", "item": {"answer": "r"}})
    assert_error(resp, 504, code="grader_timeout")


def _setting(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    from service.core.db import reset_caches

    for name, value in values.items():
        monkeypatch.setenv(name, value)
    reset_caches()


def _sleeping(seconds: float) -> dict[str, Any]:
    """A dry run of a python grader that takes ``seconds``."""
    source = f"import time\ndef grade(sample, item):\n    time.sleep({seconds})\n    return 1.0\n"
    return {"grader": python_grader(source), "model_sample": "a"}


def _in_background(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    """``fn(*args, **kwargs)`` in a thread; its result lands in the list."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    thread.start()
    return thread, out


def test_a_project_past_its_dry_run_cap_gets_a_429(client, auth, other_auth, dry_runs, monkeypatch) -> None:
    _setting(monkeypatch, RLOO_MAX_DRY_RUNS="1", RLOO_ALLOW_PYTHON_GRADER="1")
    slow = _sleeping(2)
    thread, first = _in_background(client.post, RUN, headers=auth, json=slow)
    time.sleep(0.5)
    err = assert_error(client.post(RUN, headers=auth, json=slow), 429, code="too_many_dry_runs")
    assert "RLOO_MAX_DRY_RUNS" in err["message"]
    quick = {"grader": STRING_CHECK, "model_sample": "red", "item": {"answer": "red"}}
    assert client.post(RUN, headers=other_auth, json=quick).json()["reward"] == 1.0  # another project
    thread.join()
    assert first[0].status_code == 200 and first[0].json()["reward"] == 1.0, first[0].text


def test_a_project_holds_half_the_graders_processes_and_another_finds_one_free(
    client, auth, other_auth, dry_runs, monkeypatch
) -> None:
    """A project's slow dry runs (an endpoint that trickles, a grader that sleeps) held both of the
    graders worker's processes: another project's string_check waited for one to end. A project now
    has at most half of them at once; its dry runs beyond wait their turn, and all are answered.

    No clock: the endpoint holds the first project's answers until the other project's dry run has
    been answered, so where that one waited behind them (before) it was never answered (504)."""
    release = threading.Event()

    def held(_: int, body: dict[str, Any]) -> tuple[int, Any]:
        release.wait(60)
        return 200, {"scores": [1.0] * len(body["samples"])}

    endpoint = Endpoint(held, int(dry_runs["http_port"]))  # the port the graders worker allows
    _setting(monkeypatch, RLOO_HTTP_GRADER_URLS=json.dumps([endpoint.url]), RLOO_GRADER_RUN_SECONDS="15")
    slow = {"grader": {"type": "http", "name": "held", "url": endpoint.url, "timeout_seconds": 60}, "model_sample": "a"}
    theirs = [_in_background(client.post, RUN, headers=auth, json=slow) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while not endpoint.calls and time.monotonic() < deadline:  # one of theirs holds a process
            time.sleep(0.05)
        quick = {"grader": STRING_CHECK, "model_sample": "red", "item": {"answer": "red"}}
        ours = client.post(RUN, headers=other_auth, json=quick)
        assert ours.status_code == 200 and ours.json()["reward"] == 1.0, ours.text
        # Answered while theirs were held, and the first project had one process of the two.
        assert len(endpoint.calls) == 1 and not any(answer for _, answer in theirs), endpoint.calls
    finally:
        release.set()
        for thread, _ in theirs:
            thread.join(60)
        endpoint.close()
    for _, answer in theirs:
        assert answer[0].status_code == 200 and answer[0].json()["reward"] == 1.0, answer[0].text
    assert len(endpoint.calls) == 2


def test_the_sandbox_escape_of_issue_12_scores_nan_and_reaches_nothing(client, auth, dry_runs, monkeypatch) -> None:
    from service.core.settings import get_settings

    _setting(monkeypatch, RLOO_ALLOW_PYTHON_GRADER="1")
    database = get_settings().database_url.split("///", 1)[-1]
    attempts = {
        # Switch the audit hook off through the runner's module globals, then run a program.
        "rebind": "import sys\nm = sys.modules['__main__']\nm.NO_EVENTS = ()\nm.NO_IMPORT = frozenset()\n"
        "def grade(sample, item):\n    import subprocess\n"
        "    return float(len(subprocess.run(['id'], capture_output=True).stdout))\n",
        # Fool the hook (it is no boundary) and read the service's database and the API's environment.
        "fooled": "import posixpath, sysconfig\nstd = sysconfig.get_paths()['stdlib']\n"
        "posixpath.abspath = lambda p: std + '/os.py'\n"
        f"def grade(sample, item):\n    open({database!r}, 'rb')\n"
        "    return float(len(open('/proc/1/environ').read()))\n",
    }
    for name, source in attempts.items():
        resp = client.post(RUN, headers=auth, json={"grader": python_grader(source), "model_sample": "a"})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["reward"] == 0 and body["metadata"]["error_counts"] == {"py": 1}, (name, body)
        assert body["metadata"]["errors"]["python_grader_runtime_error"], (name, body)
        said = body["metadata"]["error_messages"]["py"]
        assert ("may not import subprocess" if name == "rebind" else "No such file") in said, (name, said)
    assert client.get("/healthz").status_code == 200


def test_a_dry_run_that_kills_its_worker_process_is_answered_once_and_set_aside(
    client, auth, dry_runs, monkeypatch
) -> None:
    _setting(monkeypatch, RLOO_ALLOW_PYTHON_GRADER="1")
    thread, answer = _in_background(client.post, RUN, headers=auth, json=_sleeping(20))
    pool_process = _wait_for_the_pool_process_of_a_sandbox(int(dry_runs["pid"]))
    os.kill(pool_process, signal.SIGKILL)  # as the out-of-memory killer would
    thread.join(60)
    resp = answer[0]
    assert_error(resp, 502, code="grader_crashed", contains="will not be run again")
    dead = _redis(dry_runs).lrange(f"{dry_run_queue.namespace(dry_runs['RLOO_QUEUE'] + '-graders')}:dead", 0, -1)
    assert len(dead) >= 1 and b"time.sleep(20)" in dead[0]
    ok = client.post(RUN, headers=auth, json={"grader": STRING_CHECK, "model_sample": "red", "item": {"answer": "red"}})
    assert ok.status_code == 200 and ok.json()["reward"] == 1.0, ok.text
    assert Path(f"/proc/{dry_runs['pid']}").exists()  # the worker itself lives on


def _wait_for_the_pool_process_of_a_sandbox(worker: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if b"bwrap" in cmdline and b"/sandbox/runner.py" in cmdline and grandparent == worker:
                return parent
        time.sleep(0.1)
    raise AssertionError("no sandbox of the graders worker started")


def test_messages_that_cannot_be_run_never_stop_the_graders_worker(client, auth, dry_runs) -> None:
    """Garbage, a pickled message, a task with 500-deep arguments, an unknown task: each dropped by
    the worker, which then answers the next dry run."""
    from service.infra import task_queue

    graders_queue = dry_runs["RLOO_QUEUE"] + "-graders"
    _redis(dry_runs).lpush(graders_queue, b"this is no message", b'{"body": "e30=", "headers": null}')
    deep: Any = []
    for _ in range(500):
        deep = [deep]
    sender = task_queue.client()
    sender.send_task(task_queue.RUN_GRADER_TASK, args=[deep], queue=graders_queue)
    sender.send_task(task_queue.RUN_GRADER_TASK, args=[], queue=graders_queue, serializer="pickle")
    sender.send_task("os.system", args=["true"], queue=graders_queue)
    # A message that came back MAX_DELIVERIES times, never acknowledged (as one that ends every
    # process running it does): the next delivery sets it aside.
    _redis(dry_runs).set("rloo:deliveries:rloo-test-returning", MAX_DELIVERIES)
    sender.send_task(task_queue.RUN_GRADER_TASK, args=[], queue=graders_queue, task_id="rloo-test-returning")
    ok = client.post(RUN, headers=auth, json={"grader": STRING_CHECK, "model_sample": "red", "item": {"answer": "red"}})
    assert ok.status_code == 200 and ok.json()["reward"] == 1.0, ok.text
    assert Path(f"/proc/{dry_runs['pid']}").exists()
    dead = [json.loads(d) for d in _redis(dry_runs).lrange(f"rloo:dead-letters:{graders_queue}", 0, -1)]
    reasons = {d["id"]: d["reason"] for d in dead}
    assert reasons["rloo-test-returning"].startswith(f"delivered {MAX_DELIVERIES + 1} times"), dead
    assert "a wake-up carries no arguments" in reasons.values(), dead  # the one 500 levels deep


def test_a_huge_sample_is_graded_within_the_cap(client, auth, dry_runs) -> None:
    """200k characters against 400k (fuzzy_match read all of it: 10 s, and at 2M the API froze)."""
    grader = {
        "type": "text_similarity",
        "name": "sim",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.ref }}",
        "evaluation_metric": "fuzzy_match",
    }
    resp = client.post(
        RUN, headers=auth, json={"grader": grader, "model_sample": "word " * 40_000, "item": {"ref": "other " * 66_000}}
    )
    assert resp.status_code == 200, resp.text
    assert 0.0 <= resp.json()["reward"] < 1.0

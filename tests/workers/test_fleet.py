"""Jobs go to workers that can run them: the queue a job's devices name, the queues a worker's
devices let it consume (found on the host, or as ``--gpus``/``--accelerator`` say), workers that
register themselves and are listed to operator keys (``GET /v1/workers``), and a job that no live
worker can run left queued with one event that says what it waits for; end to end with a real
Celery worker on the embedded defaults and on PostgreSQL and Redis."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.infra import task_queue
from service.infra.task_queue import job_queue, training_queues
from tests.helpers.api import assert_error, create_job, make_key, upload_ok
from tests.helpers.data import EXAMPLES, ROOT, job_body
from tests.helpers.live import LiveStack, live_stack, run_cli, upload_path, wait_for
from worker.jobs import devices
from worker.jobs.devices import GIB, Devices, kind_of

WORKER_KEYS = {
    "id",
    "object",
    "host",
    "devices",
    "accelerator",
    "memory_per_device_gib",
    "queues",
    "version",
    "started_at",
    "heartbeat_at",
    "live",
}


@pytest.fixture
def base_queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_QUEUE", "rloo")
    reset_caches()
    yield "rloo"
    reset_caches()


# Queues ------------------------------------------------------------------------------------------
def test_a_job_goes_to_the_queue_its_devices_name(base_queue: str) -> None:
    cases: list[tuple[dict[str, Any] | None, str]] = [
        (None, "rloo"),  # no resources: the default queue, as before queues by device
        ({"gpus": 1, "accelerator": None}, "rloo"),
        ({"gpus": 1, "accelerator": "any"}, "rloo"),
        ({"gpus": 1, "accelerator": "h100"}, "rloo.train.h100.1"),
        ({"gpus": 4, "accelerator": "h100"}, "rloo.train.h100.4"),
        ({"gpus": 2, "accelerator": None}, "rloo.train.any.2"),
        ({"gpus": 2, "accelerator": "any"}, "rloo.train.any.2"),
    ]
    assert [job_queue(resources) for resources, _ in cases] == [name for _, name in cases]


def test_a_worker_consumes_the_queue_of_every_job_its_devices_can_run_and_no_other(base_queue: str) -> None:
    assert training_queues(2, "h100") == ["rloo", "rloo.train.h100.1", "rloo.train.h100.2", "rloo.train.any.2"]
    assert training_queues(1, "cpu") == ["rloo", "rloo.train.cpu.1"]
    wrong = []
    for have in range(1, 5):
        for kind in ("h100", "cpu"):
            queues = training_queues(have, kind)
            for want in range(1, 7):
                for asked in (None, "h100", "a100", "cpu"):
                    runs = job_queue({"gpus": want, "accelerator": asked}) in queues
                    if runs != (want <= have and asked in (None, kind)):
                        wrong.append((have, kind, want, asked, runs))
    assert wrong == []


# Devices -----------------------------------------------------------------------------------------
def test_device_names_become_kinds() -> None:
    names = {
        "NVIDIA H100 80GB HBM3": "h100",
        "NVIDIA H100 PCIe": "h100",
        "NVIDIA H200": "h200",
        "NVIDIA A100-SXM4-80GB": "a100",
        "Tesla V100-SXM2-16GB": "v100",
        "Tesla T4": "t4",
        "NVIDIA L4": "l4",
        "NVIDIA L40S": "l40s",
        "NVIDIA GeForce RTX 4090": "rtx4090",
        "NVIDIA RTX A6000": "rtxa6000",
        "AMD Instinct MI300X": "mi300x",
        "AMD Instinct MI250X/MI250": "mi250x",
        "NVIDIA": "gpu",
    }
    assert {name: kind_of(name) for name in names} == names


def test_a_worker_finds_its_devices_and_the_flags_override_them(monkeypatch: pytest.MonkeyPatch) -> None:
    h100s = [("NVIDIA H100 80GB HBM3", 80 * GIB)] * 3 + [("NVIDIA H100 80GB HBM3", 79 * GIB)]
    monkeypatch.setattr(devices, "probe", lambda: h100s)
    assert devices.detect() == Devices(4, "h100", 79.0)  # the smallest device's memory
    assert devices.detect(gpus=2) == Devices(2, "h100", 79.0)
    assert devices.detect(accelerator="h100-sxm", declared={"h100-sxm": 80}) == Devices(4, "h100-sxm", 80.0)
    assert devices.detect(accelerator="gh200") == Devices(4, "gh200", None)  # a kind not found here: unknown

    monkeypatch.setattr(devices, "probe", lambda: [])  # a CPU host
    host = devices._host_memory_gib()
    assert host and host > 0
    assert devices.detect() == Devices(1, "cpu", round(host, 1))
    assert devices.detect(gpus=2) == Devices(2, "cpu", round(host / 2, 1))
    assert devices.detect(gpus=2, accelerator="h100", declared={"h100": 80}) == Devices(2, "h100", 80.0)


def test_gpus_are_counted_in_a_child_process_and_a_failing_count_means_a_cpu_host(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The count runs in a child, so a GPU host's parent imports no torch (the child finds what torch
    finds here: none on a host without a GPU); a host without GPU device nodes starts no child at all."""
    import torch

    monkeypatch.setattr(devices, "has_gpu_nodes", lambda: True)
    assert len(devices.probe()) == torch.cuda.device_count()
    monkeypatch.setattr(devices, "_PROBE", "raise SystemExit('no driver here')")
    assert devices.probe() == []
    assert "could not count this host's GPUs" in caplog.text and "no driver here" in caplog.text

    monkeypatch.setattr(devices, "has_gpu_nodes", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child was started"))
    assert devices.probe() == []


def test_only_a_host_without_gpus_imports_torch_before_forking_its_pool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A CUDA context does not survive a fork: where a GPU or any graphics device node is, the Celery
    parent must never import torch; without one, it imports the training stack once for its pool."""
    from worker.jobs import preload

    nodes = {name: tmp_path / name for name in ("nvidia0", "kfd", "dxg", "dri")}
    monkeypatch.setattr(devices, "GPU_NODES", (str(tmp_path / "nvidia[0-9]*"), str(nodes["kfd"]), str(nodes["dxg"])))
    monkeypatch.setattr(devices, "OTHER_DEVICE_NODES", (str(nodes["dri"]),))
    assert not devices.has_device_nodes()
    assert preload.imports_before_forking() == sys.platform.startswith("linux")
    for name, node in nodes.items():
        node.touch()
        assert devices.has_gpu_nodes() == (name != "dri") and devices.has_device_nodes(), name
        assert not preload.imports_before_forking(), name
        node.unlink()


def test_each_pool_process_is_wired_to_preload_after_forgetting_the_parents_connections() -> None:
    """The Celery app connects ``preload.preload_training_stack`` to ``worker_process_init``, after
    the handler that drops the parent's pooled database connections."""
    from celery.signals import worker_process_init

    from worker import celery_app
    from worker.jobs import preload

    receivers = [ref() if isinstance(ref, weakref.ref) else ref for _, ref in worker_process_init.receivers]
    mine = [r for r in receivers if r in (celery_app._forget_the_parents_connections, preload.preload_training_stack)]
    assert mine == [celery_app._forget_the_parents_connections, preload.preload_training_stack]


def test_a_pool_process_imports_the_training_stack_in_a_thread_unless_forked_with_it() -> None:
    """Each in a fresh interpreter: a pool process of a GPU host (its parent holds no torch) imports
    the stack in a thread and a job waits for it; one forked from a parent that imported it starts
    no thread."""
    fresh = (
        "import sys; from worker.jobs import preload as c; "
        "assert 'torch' not in sys.modules; c.preload_training_stack(); "
        "assert c._PRELOAD is not None; c.wait_for_preload(); "
        "assert {'torch', 'worker.engine.methods.rloo', 'transformers.modeling_utils', 'transformers.modeling_layers'} "
        "<= set(sys.modules)"
    )
    forked = (
        "from worker.jobs import preload as c; "
        "c.import_training_stack(); c.preload_training_stack(); assert c._PRELOAD is None"
    )
    for code in (fresh, forked):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]


def test_the_worker_refuses_a_kind_jobs_could_not_name(tmp_path: Path) -> None:
    for kind in ("H100!", "any"):
        out = run_cli("worker", "--accelerator", kind, env={"RLOO_HOME": str(tmp_path)}, timeout=60)
        assert out.returncode == 2 and "--accelerator" in out.stderr, out.stderr


# Registration and GET /v1/workers ----------------------------------------------------------------
def _info(name: str, devices_: int, kind: str, **over: Any) -> Any:
    from service.jobs.fleet import WorkerInfo

    values: dict[str, Any] = {
        "id": f"rloo-worker-{name}@host-{name}",
        "host": f"host-{name}",
        "devices": devices_,
        "accelerator": kind,
        "memory_per_device_gib": 80.0,
        "queues": training_queues(devices_, kind),
        "version": "0.1.0",
        "started_at": int(time.time()),
    }
    return WorkerInfo(**{**values, **over})


def _register(*infos: Any, silent_for: float = 0.0) -> None:
    from service.core.db import session_scope
    from service.core.tables import Worker
    from service.jobs import fleet

    with session_scope() as session:
        for info in infos:
            fleet.register(session, info)
            if silent_for:
                session.query(Worker).filter(Worker.id == info.id).update({"heartbeat_at": time.time() - silent_for})
        session.commit()


def test_workers_are_listed_to_operator_keys_only(client, auth, env) -> None:
    from service.core.db import session_scope
    from service.jobs import fleet

    operator = {"Authorization": f"Bearer {make_key('ops', operator=True)}"}
    empty = client.get("/v1/workers", headers=operator)
    assert empty.status_code == 200 and empty.json()["data"] == []
    big, gone = _info("a", 4, "h100"), _info("b", 1, "cpu", memory_per_device_gib=None)
    _register(gone, silent_for=3600)  # its heartbeat stopped an hour ago: not live
    _register(big)
    _register(big)  # the next round's heartbeat: the same row

    body = client.get("/v1/workers", headers=operator).json()
    assert body["object"] == "list" and [w["id"] for w in body["data"]] == [big.id, gone.id]  # newest first
    first, second = body["data"]
    assert all(set(w) == WORKER_KEYS and w["object"] == "worker" for w in body["data"])
    assert first["live"] is True and second["live"] is False
    assert (first["host"], first["devices"], first["accelerator"], first["memory_per_device_gib"]) == (
        "host-a",
        4,
        "h100",
        80.0,
    )
    assert first["queues"] == training_queues(4, "h100") and first["version"] == "0.1.0"
    assert abs(first["heartbeat_at"] - time.time()) < 3600 and second["memory_per_device_gib"] is None

    # A project's key: the route is the operator's (403, saying how to get such a key); no key: 401.
    assert_error(client.get("/v1/workers", headers=auth), 403, code="insufficient_permissions", contains="--operator")
    assert_error(client.get("/v1/workers"), 401)
    # An operator's key is its own project's key too; the one `rloo up` makes is an operator's.
    assert client.get("/v1/files", headers=operator).status_code == 200
    from worker.cli.stack import ensure_local_key

    assert client.get("/v1/workers", headers={"Authorization": f"Bearer {ensure_local_key()}"}).status_code == 200
    document = client.get("/openapi.json").json()
    assert "403" in document["paths"]["/v1/workers"]["get"]["responses"]

    # A worker that stops leaves; one silent for a day is forgotten.
    with session_scope() as session:
        fleet.deregister(session, big.id)
        assert fleet.forget_gone(session) == 0
        assert fleet.forget_gone(session, now=time.time() + fleet.FORGET_AFTER_SECONDS) == 1
    assert client.get("/v1/workers", headers=operator).json()["data"] == []


def test_a_routed_job_task_lands_in_its_own_queue(client, auth, env) -> None:
    from redis import Redis

    from service.core.settings import Settings

    file_id = upload_ok(client, auth)["id"]
    create_job(client, auth, job_body(file_id, resources={"gpus": 2, "accelerator": "h100"}))
    create_job(client, auth, job_body(file_id))
    broker = Redis.from_url(Settings().redis_client_url)
    try:
        assert broker.llen(f"{env['RLOO_QUEUE']}.train.h100.2") == 1
        assert broker.llen(env["RLOO_QUEUE"]) == 1
    finally:
        broker.close()


def _events(client: Any, auth: dict[str, str], job_id: str) -> list[dict[str, Any]]:
    return client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=auth).json()["data"]


def test_a_job_no_live_worker_can_run_stays_queued_and_is_told_so_once(client, auth, monkeypatch) -> None:
    from service.core.db import session_scope
    from service.core.tables import Job
    from service.jobs import lifecycle
    from service.jobs.reconcile import reconcile

    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: True)
    file_id = upload_ok(client, auth)["id"]
    four = create_job(client, auth, job_body(file_id, resources={"gpus": 4, "accelerator": "h100"}))["id"]
    two = create_job(client, auth, job_body(file_id, resources={"gpus": 2, "accelerator": "h100"}))["id"]
    plain = create_job(client, auth, job_body(file_id))["id"]
    _register(_info("a", 2, "h100"), _info("b", 2, "h100"), _info("c", 1, "cpu"))
    _register(_info("d", 8, "h100"), silent_for=3600)  # a big worker, but not live

    def rounds(n: int) -> list[int]:
        with session_scope() as session:
            session.query(Job).update({"created_at": int(time.time()) - 3600})  # past the grace
            session.commit()
            return [
                reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 1, worker_stale_after=60)[
                    "waiting"
                ]
                for _ in range(n)
            ]

    assert rounds(3) == [1, 0, 0]
    waits = [e for e in _events(client, auth, four) if e["message"].startswith("Waiting for a worker")]
    assert [(e["level"], e["message"]) for e in waits] == [
        (
            "warn",
            "Waiting for a worker with 4 h100 devices; none of the live workers has that (they have 1 x cpu, "
            "2 x h100 (2 workers)). The job stays queued and starts when such a worker joins.",
        )
    ]
    assert "host-" not in waits[0]["message"]  # which hosts is the operator's business
    for runnable in (two, plain):
        assert not [e for e in _events(client, auth, runnable) if e["message"].startswith("Waiting")]
    assert {client.get(f"/v1/fine_tuning/jobs/{j}", headers=auth).json()["status"] for j in (four, two, plain)} == {
        "queued"
    }

    # Claimed, then queued again (its worker died) with still no worker for it: a new wait, said again.
    with session_scope() as session:
        assert lifecycle.claim(session=session, job_id=four, worker="host:1") is not None
        session.query(Job).filter(Job.id == four).update({"status": "queued", "worker": None})
        session.commit()
    assert rounds(2) == [1, 0]
    # No live worker registered at all: nothing to judge by, nothing said.
    _register(_info("a", 2, "h100"), _info("b", 2, "h100"), _info("c", 1, "cpu"), silent_for=3600)
    with session_scope() as session:
        session.query(Job).filter(Job.id == four).update({"waiting_at": None})
        session.commit()
    assert rounds(1) == [0]


def test_a_worker_takes_turns_between_projects_not_the_oldest_job(client, auth, other_auth, monkeypatch) -> None:
    """One FIFO queue let three 30-step jobs of one project hold another's 2-step job 196 s. A task
    is a turn in its job's lane: it runs the fairest queued job there, whichever task it came as."""
    from service.core.db import session_scope
    from service.core.tables import Job
    from service.jobs import lifecycle
    from worker.jobs.tasks import _claim_a_turn

    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: True)
    theirs, ours = upload_ok(client, auth)["id"], upload_ok(client, other_auth)["id"]
    a = [create_job(client, auth, job_body(theirs))["id"] for _ in range(3)]
    big = create_job(client, auth, job_body(theirs, resources={"gpus": 2}))["id"]  # another lane
    b = create_job(client, other_auth, job_body(ours))["id"]
    with session_scope() as session:
        for i, job_id in enumerate([*a, big, b]):  # created a second apart, the other project's last
            session.query(Job).filter(Job.id == job_id).update({"created_at": 1000 + i})
        session.commit()
        assert {j.id: j.lane for j in session.query(Job)} == {**dict.fromkeys([*a, b], "any.1"), big: "any.2"}

    def finish(job: Job) -> None:
        with session_scope() as session:
            session.query(Job).filter(Job.id == job.id).update({"status": "succeeded"})
            session.commit()

    order = []
    with session_scope() as session:
        for task in [a[0], a[1], a[2], b]:  # the tasks arrive in the order the jobs were created
            job = _claim_a_turn(session, task)
            assert job is not None
            order.append(job.id)
            if len(order) == 1:
                finish(job)  # the first ends before the next task; the rest keep running
        assert _claim_a_turn(session, b) is None  # every job of the lane is taken: a turn with nothing to run
        assert lifecycle.claim_fairest(session=session, lane="any.2", worker="w") is not None
    assert order == [a[0], b, a[1], a[2]], order  # before: a[0], a[1], a[2], b


# End to end --------------------------------------------------------------------------------------
@pytest.fixture(params=["embedded", "production"])
def stack(request: pytest.FixtureRequest, tmp_path: Path, models_dir: Path) -> Iterator[LiveStack]:
    # No GPU for the worker to find, even on a host with one: it offers what its flags say.
    env = {"RLOO_RECONCILE_SECONDS": "1", "RLOO_ACCELERATORS": '{"h100": 80}', "CUDA_VISIBLE_DEVICES": ""}
    with live_stack(request.param, tmp_path, models_dir, env=env, worker=False) as s:
        yield s


def _fleet(stack: LiveStack, operator: str) -> list[dict[str, Any]]:
    r = stack.http.get("/workers", headers={"Authorization": f"Bearer {operator}"})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _until(what: str, check: Any, stack: LiveStack, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = [name for name, proc in stack.procs.items() if proc.poll() is not None]
        assert not ended, f"{ended} exited while waiting for {what}\n{stack.log_tail()}"
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s\n{stack.log_tail()}")


def test_a_worker_registers_runs_the_jobs_its_devices_fit_and_leaves_the_rest_queued(stack: LiveStack) -> None:
    operator = stack.cli("keys", "create", "--project", "ops", "--operator").stdout.strip().splitlines()[-1]
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    too_big = http.post("/fine_tuning/jobs", json=job_body(file_id, resources={"gpus": 4, "accelerator": "h100"}))
    assert too_big.status_code == 200, too_big.text
    too_big_id = too_big.json()["id"]

    stack.start("worker", "worker", "--gpus", "2", "--accelerator", "h100")
    (me,) = _until("the worker's registration", lambda: _fleet(stack, operator), stack)
    queue = stack.env.get("RLOO_QUEUE", "rloo")
    assert me["live"] is True and me["id"] == f"rloo-worker-{stack.procs['worker'].pid}@{socket.gethostname()}"
    assert (me["host"], me["devices"], me["accelerator"]) == (socket.gethostname(), 2, "h100")
    assert me["memory_per_device_gib"] == 80.0  # not found on this host: the operator's RLOO_ACCELERATORS
    assert me["queues"] == [queue, f"{queue}.train.h100.1", f"{queue}.train.h100.2", f"{queue}.train.any.2"]
    first_beat = me["heartbeat_at"]
    _until("a heartbeat", lambda: _fleet(stack, operator)[0]["heartbeat_at"] > first_beat, stack)
    assert_error(http.get("/workers"), 403, code="insufficient_permissions")  # the project's key

    # A job its two h100s fit runs on it, through its own queue.
    fits = http.post(
        "/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2}, resources={"gpus": 2, "accelerator": "h100"})
    )
    job = wait_for(http, fits.json()["id"], {"succeeded", "failed", "cancelled"}, 240, stack)
    assert job["status"] == "succeeded", (job["error"], stack.log_tail())

    # The four-h100 job waits, queued, told once what for, however many rounds pass.
    def waits() -> list[str]:
        events = http.get(f"/fine_tuning/jobs/{too_big_id}/events", params={"limit": 100}).json()["data"]
        return [e["message"] for e in events if e["message"].startswith("Waiting for a worker")]

    said = _until("the waiting event", waits, stack)
    beat = _fleet(stack, operator)[0]["heartbeat_at"]
    _until("three more rounds", lambda: _fleet(stack, operator)[0]["heartbeat_at"] >= beat + 3, stack)
    assert waits() == said and len(said) == 1, said
    assert "4 h100 devices" in said[0] and "2 x h100" in said[0]
    assert http.get(f"/fine_tuning/jobs/{too_big_id}").json()["status"] == "queued"

    # A worker that stops leaves the fleet.
    stack.stop("worker", signal.SIGTERM)
    _until("the worker's row to go", lambda: _fleet(stack, operator) == [], stack)

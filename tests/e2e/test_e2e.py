"""End to end through real processes: HTTP -> API -> Redis -> a Celery worker process -> training ->
metrics and checkpoint rows -> succeeded, and a checkpoint that loads with from_pretrained.

Runs on the embedded defaults (SQLite + embedded Redis), and on PostgreSQL + Redis when
TEST_DATABASE_URL and TEST_REDIS_URL are set (the CI sets both).
"""

from __future__ import annotations

import io
import json
import signal
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import LiveStack, free_port, live_stack, upload_path, wait_for
from tests.helpers.scoring import Endpoint
from worker.jobs.preload import imports_before_forking

pytestmark = pytest.mark.e2e

RLOO_METRICS = [
    "step",
    "total_steps",
    "train_reward_mean",
    "train_reward_std",
    "frac_reward_zero_std",
    "advantage_std",
    "kl",
    "loss",
    "entropy",
    "grad_norm",
    "learning_rate",
    "completion_length_mean",
    "clipped_ratio",
    "nan_rewards",
    "time_generate",
    "time_score",
    "time_update",
    "time_step",
    "completions_per_s",
    "tokens_per_s",
]


@pytest.fixture(scope="module", params=["embedded", "production"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[LiveStack]:
    """One stack of each kind for the module's tests that need no settings of their own; each test
    leaves its worker idle (its jobs finished or stopped) and the stack with its one worker. Python
    graders are allowed, and http graders on one loopback port (``GRADER_PORT``) where a test
    starts its own scoring server."""
    where = tmp_path_factory.mktemp(f"e2e-{request.param}")
    port = free_port()
    env = {"RLOO_ALLOW_PYTHON_GRADER": "1", "RLOO_HTTP_GRADER_URLS": json.dumps([f"http://127.0.0.1:{port}/"])}
    with live_stack(request.param, where, models_dir, env=env) as s:
        s.env[GRADER_PORT] = str(port)
        yield s


GRADER_PORT = "TEST_GRADER_PORT"
"""The port of the module stack's allowed http grader, kept in its env (children ignore it)."""


def test_job_runs_end_to_end(stack: LiveStack) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    r = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 4, "checkpoint_interval": 2}))
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]

    job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 240, stack)
    assert job["status"] == "succeeded", (job["error"], stack.log_tail())
    assert job["progress"] == {"step": 4, "total_steps": 4}
    assert job["finished_at"] and job["trained_tokens"] > 0 and job["fine_tuned_model"]
    if imports_before_forking():  # the job's process was forked with torch loaded
        assert "forked with the training stack imported" in (stack.logs / "worker.log").read_text()

    metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        missing = [name for name in RLOO_METRICS if name not in m]
        assert not missing, missing
        assert 0.0 <= m["train_reward_mean"] <= 1.0

    events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    metric_events = [e for e in events if e["type"] == "metrics"]
    assert sorted(e["data"]["step"] for e in metric_events) == [1, 2, 3, 4]
    assert events[0]["message"].startswith("The job has successfully completed")  # newest first

    ckpts = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert [c["step_number"] for c in ckpts] == [4, 2]  # interval 2 and the final one, newest first
    assert ckpts[0]["fine_tuned_model_checkpoint"] == job["fine_tuned_model"] + ":ckpt-step-4"  # OpenAI's form
    assert "train_reward_mean" in ckpts[0]["metrics"]

    archive = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{ckpts[0]['id']}/content")
    assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        names = tar.getnames()
        assert any(n.endswith("config.json") for n in names) and any(n.endswith(".safetensors") for n in names)
        out = Path(stack.logs.parent / "download")
        tar.extractall(out, filter="data")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = out / ckpts[0]["id"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("What color is the sky?", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] > ids.shape[1]


def test_cancel_running_job_and_worker_takes_the_next(stack: LiveStack) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    long_job = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"n_epochs": 100})).json()
    wait_for(http, long_job["id"], {"running"}, 120, stack, min_step=1)
    # Create-and-cancel churn behind it: those tasks must cost the worker nothing (its main process
    # drops them; a pool process, once used, is replaced at the cost of torch's import).
    churn = [http.post("/fine_tuning/jobs", json=job_body(file_id)).json()["id"] for _ in range(3)]
    for job_id in churn:
        assert http.post(f"/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"

    r = http.post(f"/fine_tuning/jobs/{long_job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        events = http.get(f"/fine_tuning/jobs/{long_job['id']}/events", params={"limit": 100}).json()["data"]
        if any(e["message"].startswith("Training stopped") for e in events):
            break
        time.sleep(0.25)
    else:
        raise AssertionError("the worker did not stop the cancelled job\n" + stack.log_tail())
    job = http.get(f"/fine_tuning/jobs/{long_job['id']}").json()
    assert job["status"] == "cancelled" and job["progress"]["step"] < job["progress"]["total_steps"]
    # Checkpoints are kept on cancel: the model at the step where it stopped.
    assert http.get(f"/fine_tuning/jobs/{long_job['id']}/checkpoints").json()["data"]

    # Its pool process free, the worker drops the churn's tasks. (Waited for before the next job: while
    # a job waits in their lane, a task is a turn in it and would claim that job instead.)
    drops = [
        f"job {job_id} waits for no worker (cancelled, paused or finished); its task is dropped" for job_id in churn
    ]
    deadline = time.monotonic() + 60
    while not all(line in (stack.logs / "worker.log").read_text() for line in drops):
        assert time.monotonic() < deadline, "the churn's tasks were not dropped\n" + stack.log_tail()
        time.sleep(0.25)

    # The worker survives and takes the next job.
    short = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()
    assert wait_for(http, short["id"], {"succeeded", "failed"}, 180, stack)["status"] == "succeeded"
    log = (stack.logs / "worker.log").read_text()
    for job_id in churn:
        assert f"job {job_id} not claimed" not in log  # never reached a pool process


def test_pause_then_resume_continues_from_the_checkpoint(stack: LiveStack) -> None:
    """running -> paused (the worker saves a checkpoint after its step and lets go), a resume that
    comes too early is 409, then paused -> queued -> running -> succeeded: every step recorded once.

    Deterministic: the job's grader is an http grader whose server holds step 3's scoring until the
    test has paused the job and tried an early resume, so the worker is surely still in that step."""
    held, scoring = threading.Event(), threading.Event()

    def score(n: int, body: dict[str, Any]) -> tuple[int, Any]:
        if n == 3:  # step 3
            scoring.set()
            held.wait(60)
        return 200, {"scores": [len(s["sample"]["output_text"]) % 3 / 2 for s in body["samples"]]}

    server = Endpoint(score, port=int(stack.env[GRADER_PORT]))
    try:
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        grader = {"type": "http", "name": "held", "url": server.url}
        body = job_body(file_id, hp={"max_steps": 6})
        body["method"]["reinforcement"]["grader"] = grader
        job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]
        assert scoring.wait(120), "step 3 was never scored\n" + stack.log_tail()
        # The SDK in strict mode over pause, resume, checkpoints and events; its status enum
        # lacks OpenAI's own "paused", so only a lax SDK parses a paused job (the README says so).
        strict = openai.OpenAI(
            base_url=stack.url + "/v1", api_key=stack.key, max_retries=0, _strict_response_validation=True
        )
        lax = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0)
        with pytest.raises(openai.APIResponseValidationError):
            strict.fine_tuning.jobs.pause(job_id)
        assert lax.fine_tuning.jobs.retrieve(job_id).status == "paused"
        with pytest.raises(openai.ConflictError):
            lax.fine_tuning.jobs.pause(job_id)  # already paused
        with pytest.raises(openai.ConflictError) as early:  # the worker is still in step 3
            strict.fine_tuning.jobs.resume(job_id)
        assert "pausing" in early.value.message
        held.set()

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the worker finishes step 3, saves, lets go
            events = strict.fine_tuning.jobs.list_events(job_id, limit=100).data
            if any(e.message.startswith("Training stopped") for e in events):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the worker did not stop the paused job\n" + stack.log_tail())
        paused = http.get(f"/fine_tuning/jobs/{job_id}").json()
        assert paused["status"] == "paused" and paused["progress"]["step"] == 3
        ckpts = strict.fine_tuning.jobs.checkpoints.list(job_id).data
        assert [c.step_number for c in ckpts] == [3]  # the pause's checkpoint

        assert strict.fine_tuning.jobs.resume(job_id).status == "queued"
        job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 240, stack)
        assert job["status"] == "succeeded", (job["error"], stack.log_tail())
        assert strict.fine_tuning.jobs.retrieve(job_id).status == "succeeded"
        metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
        assert [m["step"] for m in metrics] == list(range(1, 7))
        # Events page through the SDK's cursor in the list's order, each once.
        paged = [e.id for e in strict.fine_tuning.jobs.list_events(job_id, limit=2)]
        assert paged == [e.id for e in strict.fine_tuning.jobs.list_events(job_id, limit=100).data]
        assert len(paged) > 4 and len(set(paged)) == len(paged)
        events = strict.fine_tuning.jobs.list_events(job_id, limit=100).data
        assert any("Resumed from the checkpoint at step 3" in e.message for e in events)
        with pytest.raises(openai.ConflictError):
            strict.fine_tuning.jobs.resume(job_id)  # succeeded
    finally:
        held.set()
        server.close()


@pytest.mark.parametrize("kind", ["embedded", "production"])
def test_a_worker_killed_mid_job_is_replaced_and_the_job_finishes_from_its_checkpoint(
    kind: str, tmp_path: Path, models_dir: Path
) -> None:
    """SIGKILL the worker mid-job (no goodbye, its task unacknowledged), start a new one: the new
    worker's reconciler sees the stale heartbeat, or its first task sees that the job's process on
    this host is gone (whichever comes first), queues the job again, and it continues from its last
    checkpoint to succeeded, with every step's metrics exactly once."""
    env = {"RLOO_RECONCILE_SECONDS": "1", "RLOO_STALE_SECONDS": "8"}
    with live_stack(kind, tmp_path, models_dir, env=env) as stack:
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        body = job_body(file_id, hp={"max_steps": 10, "checkpoint_interval": 2})
        job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]
        wait_for(http, job_id, {"running"}, 120, stack, min_step=5)
        stack.stop("worker", signal.SIGKILL)
        killed_at = http.get(f"/fine_tuning/jobs/{job_id}").json()["progress"]["step"]
        stack.start("worker2", "worker", "--loglevel", "INFO")
        job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 240, stack)
        assert job["status"] == "succeeded", (job["error"], stack.log_tail())
        metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
        assert [m["step"] for m in metrics] == list(range(1, 11))
        page = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
        events = [e["message"] for e in page]
        recovered = ("stopped sending heartbeats", "The worker process running the job was killed")
        assert any(why in e for e in events for why in recovered), events
        resumed = [e for e in events if e.startswith("Resumed from the checkpoint at step")]
        assert resumed and int(resumed[0].split("step ")[1].split(";")[0]) <= killed_at


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)  # the worker's rule, not the database's
def test_a_job_whose_rewards_are_all_nan_fails_clearly_and_the_worker_takes_the_next(stack: LiveStack) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    broken = job_body(file_id, hp={"max_steps": 3})
    broken["method"]["reinforcement"]["grader"] = {
        "type": "python",
        "name": "nan",
        "source": "def grade(sample, item):\n    return float('nan')\n",
    }
    bad = http.post("/fine_tuning/jobs", json=broken).json()["id"]
    good = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()["id"]
    failed = wait_for(http, bad, {"succeeded", "failed", "cancelled"}, 120, stack)
    assert failed["status"] == "failed" and failed["error"]["code"] == "reward_not_finite", failed
    assert "graders/run" in failed["error"]["message"]  # says where to try the grader
    done = wait_for(http, good, {"succeeded", "failed", "cancelled"}, 120, stack)
    assert done["status"] == "succeeded", (done["error"], stack.log_tail())


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_two_workers_several_jobs_each_runs_once(stack: LiveStack) -> None:
    """Two workers on one queue, four jobs: every job runs on exactly one worker, once. (The second
    worker is stopped after: the module's stack goes on with one.)"""
    stack.start("worker2", "worker", "--loglevel", "INFO")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both workers consuming before the jobs come
            logs = [(stack.logs / f"{name}.log").read_text() for name in ("worker", "worker2")]
            if all(" ready." in log for log in logs):
                break
            time.sleep(0.2)
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        ids = [
            http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 3})).json()["id"] for _ in range(4)
        ]
        workers = set()
        for job_id in ids:
            job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 240, stack)
            assert job["status"] == "succeeded", (job["error"], stack.log_tail())
            events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
            started = [e["message"] for e in events if e["message"].startswith("Job started")]
            assert started == ["Job started"], started  # once, and no host or process of ours in it
            # Which worker ran it: the operator's log says.
            ran_on = [
                name
                for name in ("worker", "worker2")
                if f"job {job_id} started on worker" in (stack.logs / f"{name}.log").read_text()
            ]
            assert len(ran_on) == 1, ran_on
            workers.add(ran_on[0])
            metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
            assert [m["step"] for m in metrics] == [1, 2, 3]
        assert len(workers) == 2  # both workers took jobs
    finally:
        stack.stop("worker2")

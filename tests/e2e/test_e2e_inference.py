"""Inference through real processes (the API under uvicorn, a training worker, an inference worker
with its supervisor), in this order: a job's latest checkpoint sampled while the job runs; an
inference worker killed mid-request (503, or an error event once the stream began) and a new one
serving the next request, while that training job goes on (then it is cancelled, freeing the
training worker); a key at its limit of requests in flight (429) whose client goes away mid-stream
and frees its place at once; an evaluation of a trained job's checkpoints; a job whose reward model
the inference worker scores (``"remote": true``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import LiveStack, free_port, live_stack, upload_path, wait_for

pytestmark = pytest.mark.e2e

PROMPT = "the cat sat on"
LONG = {"model": "tiny-policy", "prompt": [PROMPT] * 64, "n": 12, "max_tokens": 200}
"""A request that takes the tiny model some seconds: 768 completions of up to 200 tokens."""


GRADER_SECONDS = 6.0
"""What the slow http grader takes a chunk."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[LiveStack]:
    grader_port = free_port()
    env = {
        "RLOO_INFERENCE_MAX_CONCURRENT": "1",
        "RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT": str(10**6),
        "RLOO_INFERENCE_MAX_BATCH": "1024",  # LONG is one batch
        "RLOO_HTTP_GRADER_URLS": json.dumps([f"http://127.0.0.1:{grader_port}/"]),
    }
    with live_stack("embedded", tmp_path_factory.mktemp("inference"), models_dir, env=env) as s:
        s.http_grader_port = grader_port  # type: ignore[attr-defined]
        s.start("serve", "worker", "--serve")
        _served_again(s)
        yield s


def _served_again(stack: LiveStack, timeout: float = 90) -> None:
    """Wait until an inference worker answers (503 while none is up)."""
    deadline = time.monotonic() + timeout
    with stack.http as http:
        while True:
            r = http.post("/completions", json={"model": "tiny-policy", "prompt": "hi", "max_tokens": 2})
            if r.status_code == 200:
                return
            assert r.status_code == 503 and time.monotonic() < deadline, (r.text, stack.log_tail())
            time.sleep(0.3)


def _serving_process(stack: LiveStack, other_than: int | None = None) -> int:
    supervisor = stack.procs["serve"].pid
    deadline = time.monotonic() + 30
    while True:
        children = [int(c) for c in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()]
        if len(children) == 1 and children[0] != other_than:
            return children[0]
        assert time.monotonic() < deadline, children
        time.sleep(0.1)


def test_a_running_jobs_latest_checkpoint_is_sampled_while_it_trains(stack: LiveStack) -> None:
    sdk = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0, _strict_response_validation=True)
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    with stack.http as http:
        spec["training_file"] = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        # A checkpoint every 10 steps, the last 20 kept: the one sampled stays ~200 steps (the tiny
        # model runs ~15 a second here; with one every 2 steps, 10 kept, the step-6 checkpoint listed
        # was pruned before the chat asked for it on a loaded host).
        spec["method"]["reinforcement"]["hyperparameters"].update(
            {"n_epochs": 40, "checkpoint_interval": 10, "keep_checkpoints": 20, "batch_size": 4, "rloo_k": 2}
        )
        job = http.post("/fine_tuning/jobs", json=spec).json()
        wait_for(http, job["id"], {"running"}, 120, stack, min_step=10)
    deadline = time.monotonic() + 60
    while not (checkpoints := sdk.fine_tuning.jobs.checkpoints.list(job["id"]).data):
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    latest = checkpoints[0].fine_tuned_model_checkpoint  # newest first
    answer = sdk.chat.completions.create(model=latest, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.model == latest and answer.usage is not None and answer.usage.completion_tokens >= 1
    assert sdk.fine_tuning.jobs.retrieve(job["id"]).status == "running"
    stack.shared_job = job["id"]  # type: ignore[attr-defined]  # the kill test checks it goes on


def test_completions_are_metered(stack: LiveStack) -> None:
    """A new project's chats (whole and streamed) count their prompt and completion tokens as the
    answers report them (a job's steps are metered by its worker: the soak checks every job's)."""
    key = stack.cli("keys", "create", "--project", "metered").stdout.strip().splitlines()[-1]
    sdk = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
    ask = {"model": "tiny-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    whole = sdk.chat.completions.create(**ask)
    chunks = list(sdk.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert whole.usage is not None and chunks[-1].usage is not None
    served = whole.usage.total_tokens + chunks[-1].usage.total_tokens
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 10  # the stream's tokens are written as it closes
    while True:
        used = httpx.get(stack.url + "/v1/usage", headers=headers).json()["data"]
        if [u["amount"] for u in used if u["kind"] == "inference_tokens"] == [served]:
            break
        assert time.monotonic() < deadline, (used, served)
        time.sleep(0.2)


def test_an_inference_worker_killed_mid_request_fails_it_and_a_new_one_serves_the_next(stack: LiveStack) -> None:
    victim = _serving_process(stack)
    results: list[httpx.Response] = []

    def wait() -> None:
        with stack.http as http:
            http.timeout = httpx.Timeout(60)
            results.append(http.post("/completions", json=LONG))

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(1.5)
    os.kill(victim, signal.SIGKILL)
    waiting.join(timeout=60)
    assert results and results[0].status_code == 503, results[0].text if results else stack.log_tail()
    assert results[0].json()["error"]["code"] == "worker_lost"
    victim = _serving_process(stack, other_than=victim)
    _served_again(stack)
    # Streamed: the 200 was sent, so the failure comes as an error event, as OpenAI's streams carry one.
    with stack.http as http, http.stream("POST", "/completions", json={**LONG, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(victim, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert rest and json.loads(rest[-1].removeprefix("data: "))["error"]["code"] == "worker_lost", rest[-3:]
    _serving_process(stack, other_than=victim)
    _served_again(stack)
    job_id: Any = getattr(stack, "shared_job", None)
    if job_id is not None:  # the training job never noticed
        with stack.http as http:
            job = http.get(f"/fine_tuning/jobs/{job_id}").json()
            assert job["status"] in ("running", "succeeded"), job
            http.post(f"/fine_tuning/jobs/{job_id}/cancel")


def test_a_key_at_its_limit_is_429_and_a_client_that_leaves_frees_its_place_at_once(stack: LiveStack) -> None:
    with stack.http as http, http.stream("POST", "/completions", json={**LONG, "stream": True}) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes the response, as a client leaving
        assert next(lines).startswith("data: ")  # the stream is running
        r = http.post("/completions", json={"model": "tiny-policy", "prompt": "hi"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", stack.log_tail()
    # The client went away mid-stream: its place is free at once and the worker drops its rows at
    # the next token, so the next request is answered long before 200 tokens of 1,024 rows would end.
    started = time.monotonic()
    with stack.http as http:
        r = http.post("/completions", json={"model": "tiny-policy", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < 3.0


def test_an_evaluation_scores_the_starting_model_and_every_checkpoint_on_a_file(stack: LiveStack) -> None:
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    with stack.http as http:
        spec["training_file"] = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        valid = upload_path(http, EXAMPLES / "demo" / "valid.jsonl")
        spec["method"]["reinforcement"]["hyperparameters"].update(
            {"n_epochs": 1, "checkpoint_interval": 4, "batch_size": 4, "rloo_k": 2}
        )
        job = http.post("/fine_tuning/jobs", json=spec).json()
        job = wait_for(http, job["id"], {"succeeded", "failed"}, 180, stack)
        assert job["status"] == "succeeded", job
        steps = sorted(c["step_number"] for c in http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"])
        r = http.post(f"/fine_tuning/jobs/{job['id']}/evaluations", json={"file": valid, "samples": 6, "seed": 1})
        assert r.status_code == 200, r.text
        evaluation = r.json()
        assert evaluation["status"] == "queued" and evaluation["object"] == "fine_tuning.job.evaluation"
        deadline = time.monotonic() + 120
        while evaluation["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, stack.log_tail()
            time.sleep(0.5)
            evaluation = http.get(f"/fine_tuning/jobs/{job['id']}/evaluations/{evaluation['id']}").json()
        assert evaluation["status"] == "succeeded", (evaluation, stack.log_tail())
        listed = http.get(f"/fine_tuning/jobs/{job['id']}/evaluations").json()["data"]
        assert [e["id"] for e in listed] == [evaluation["id"]]
        bad = http.post(f"/fine_tuning/jobs/{job['id']}/evaluations", json={"file": valid, "checkpoints": ["nope"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "checkpoints.0"
    rows = evaluation["results"]
    # rloo jobs evaluations get prints the table: a model a row, each grader's mean a column.
    printed = stack.cli(
        "jobs",
        "evaluations",
        "get",
        job["id"],
        evaluation["id"],
        "--base-url",
        stack.url + "/v1",
        "--api-key",
        stack.key,
    )
    lines = [line.split("\t") for line in printed.stdout.splitlines()]
    assert lines[0][:3] == ["model", "step_number", "reward_mean"] and lines[0][-1] == "answer"
    assert [line[0] for line in lines[1:]] == [row["model"] for row in rows]
    print(printed.stdout)
    assert [row["step_number"] for row in rows] == [None, *steps]  # the starting model, then each checkpoint
    assert rows[0]["model"] == "tiny-policy" and evaluation["progress"] == {
        "done": 6 * len(rows),
        "total": 6 * len(rows),
    }
    for row in rows:
        assert row["samples"] == 6 and 0 <= row["reward_mean"] <= 1 and row["reward_std_error"] >= 0
        assert row["grader_means"]["answer"] == pytest.approx(row["reward_mean"])  # one grader: the reward
        assert row["completion_length_mean"] > 0


def test_a_job_whose_reward_model_is_remote_trains_as_one_that_scores_it_beside_the_policy(stack: LiveStack) -> None:
    """Two jobs of one seed, a reward model scored by the training worker and the same scored by the
    inference worker (``"remote": true``): the same rewards and updates, step for step."""
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    spec["method"]["reinforcement"]["hyperparameters"].update({"max_steps": 3, "batch_size": 4, "rloo_k": 2})
    rewards = {}
    with stack.http as http:
        spec["training_file"] = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        for remote in (False, True):
            grader = {"type": "reward_model", "name": "rm", "model": "tiny-reward", "remote": remote}
            spec["method"]["reinforcement"]["grader"] = grader
            job = http.post("/fine_tuning/jobs", json=spec).json()
            job = wait_for(http, job["id"], {"succeeded", "failed"}, 180, stack)
            assert job["status"] == "succeeded", (job, stack.log_tail())
            metrics = http.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
            assert [m["step"] for m in metrics] == [1, 2, 3]
            rewards[remote] = [m[name] for m in metrics for name in ("train_reward_mean", "kl", "loss")]
    assert rewards[True] == pytest.approx(rewards[False], abs=1e-5)
    assert len(set(rewards[False][::3])) > 1  # the steps' rewards really differ


def test_an_evaluations_slow_grader_holds_no_chat_and_a_cancel_stops_it(stack: LiveStack) -> None:
    """A grader that took 81 s a chunk ran inside the serving loop: another project's 4-token chat
    waited for it. Grading runs on the worker's grading thread now; the chat is answered meanwhile,
    and a cancelled evaluation ends at its worker's next heartbeat."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    graded = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"])
            graded.set()
            time.sleep(GRADER_SECONDS)
            body = json.dumps({"scores": [0.5] * n}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", stack.http_grader_port), Slow)  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other = stack.cli("keys", "create", "--project", "other").stdout.strip().splitlines()[-1]
    try:
        with stack.http as http:
            file_id = upload_path(http, EXAMPLES / "demo" / "valid.jsonl")
            job = http.post("/fine_tuning/jobs", json=job_body(upload_path(http, EXAMPLES / "demo" / "train.jsonl")))
            job_id = job.json()["id"]
            http.post(f"/fine_tuning/jobs/{job_id}/cancel")  # only its starting model is evaluated
            grader = {"type": "http", "name": "slow", "url": f"http://127.0.0.1:{stack.http_grader_port}/g"}  # type: ignore[attr-defined]
            r = http.post(
                f"/fine_tuning/jobs/{job_id}/evaluations",
                json={"file": file_id, "checkpoints": [], "samples": 40, "max_tokens": 4, "grader": grader},
            )
            assert r.status_code == 200, r.text
            evaluation = r.json()
            assert graded.wait(60), stack.log_tail()  # a chunk is being graded now
            with httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {other}"}) as theirs:
                t0 = time.monotonic()
                chat = theirs.post(
                    "/chat/completions",
                    json={"model": "tiny-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    timeout=60,
                )
                took = time.monotonic() - t0
            assert chat.status_code == 200, chat.text
            assert took < GRADER_SECONDS / 2, took  # before: behind the chunk's grading
            url = f"/fine_tuning/jobs/{job_id}/evaluations/{evaluation['id']}"
            assert http.post(url + "/cancel").json()["status"] == "cancelled"
            time.sleep(GRADER_SECONDS + 3)  # the grading in flight ends; its worker's heartbeat saw the cancel
            after = http.get(url).json()
            assert after["status"] == "cancelled" and after["progress"]["done"] < 40, after
    finally:
        server.shutdown()
        server.server_close()

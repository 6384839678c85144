"""The client commands (``rloo files|jobs|checkpoints|graders``) against a live stack over HTTP, as a
user's terminal runs them: a job created from the examples' spec and watched to its end, its
checkpoint downloaded and merged into a model ``from_pretrained`` loads, a watch that survives the
API restarting, and a watched job cancelled (its exit code says so)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.data import EXAMPLES, ROOT
from tests.helpers.live import LiveStack, live_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[LiveStack]:
    """One stack for the tests that need no settings of their own (each makes and asserts on its own job)."""
    with live_stack("embedded", tmp_path_factory.mktemp("cli-client"), models_dir) as s:
        s.env.update({"RLOO_BASE_URL": s.url + "/v1", "RLOO_API_KEY": s.key})
        yield s


def rloo(stack: LiveStack, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        capture_output=True,
        text=True,
        env=stack.env,
        cwd=ROOT,
        timeout=timeout,
    )


def watcher(stack: LiveStack, job_id: str, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "jobs", "watch", job_id],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        env=stack.env,
        cwd=ROOT,
    )


def wait_for_line(log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def step_lines(output: str) -> list[int]:
    return [int(line.split()[1].split("/")[0]) for line in output.splitlines() if line.startswith("step ")]


def test_create_watch_download_and_merge(stack: LiveStack, tmp_path: Path, models_dir: Path) -> None:
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    spec["method"]["reinforcement"]["hyperparameters"].update(
        max_steps=2, rloo_k=4, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    )
    (tmp_path / "job.json").write_text(json.dumps(spec))
    train = EXAMPLES / "demo" / "train.jsonl"
    made = rloo(stack, "jobs", "create", str(tmp_path / "job.json"), "--training-file", str(train), "--watch")
    assert made.returncode == 0, made.stdout + made.stderr
    assert step_lines(made.stdout) == [1, 2] and "reward" in made.stdout
    # The last step's samples:
    assert "best at step 2 (reward" in made.stdout and "worst at step 2 (reward" in made.stdout
    job_id = made.stderr.split("created ")[1].split()[0]
    assert made.stdout.strip().endswith(f"{job_id} succeeded")

    listed = rloo(stack, "jobs", "list")
    assert job_id in listed.stdout and "succeeded" in listed.stdout
    assert "train.jsonl" in rloo(stack, "files", "list").stdout  # uploaded by jobs create

    from transformers import AutoModelForCausalLM

    adapter = rloo(stack, "checkpoints", "download", job_id, str(tmp_path / "adapter"))
    assert adapter.returncode == 0, adapter.stderr
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = rloo(
        stack,
        "checkpoints",
        "download",
        job_id,
        str(tmp_path / "merged"),
        "--merge",
        "--base",
        str(models_dir / "tiny-policy"),
    )
    assert merged.returncode == 0, merged.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # a full model: no adapter left
    assert not (tmp_path / "merged" / "adapter_config.json").exists() and model.config.model_type == "llama"
    missing = rloo(stack, "checkpoints", "download", job_id, str(tmp_path / "x"), "--step", "99")
    assert missing.returncode == 1 and "no checkpoint at step 99" in missing.stderr


def test_a_watch_survives_the_api_restarting(tmp_path: Path, models_dir: Path) -> None:
    """The API goes away at step 2 of 8 and comes back: the watch reconnects after the last event
    it saw and shows every step once. (An http grader that takes 0.4 s a step keeps the job
    running meanwhile.)"""
    from tests.helpers.scoring import Endpoint

    def slow(n: int, body: dict) -> tuple[int, dict]:
        time.sleep(0.4)
        return 200, {"scores": [0.5] * len(body["samples"])}

    scorer = Endpoint(slow)
    env = {"RLOO_HTTP_GRADER_URLS": json.dumps([f"http://127.0.0.1:{scorer.server.server_port}/"])}
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    spec["method"]["reinforcement"]["grader"] = {"type": "http", "name": "slow", "url": scorer.url}
    spec["method"]["reinforcement"]["hyperparameters"].update(max_steps=8, rloo_k=4)
    spec["training_file"] = str(EXAMPLES / "demo" / "train.jsonl")
    (tmp_path / "job.json").write_text(json.dumps(spec))
    (tmp_path / "stack").mkdir()
    try:
        with live_stack("embedded", tmp_path / "stack", models_dir, env=env) as stack:
            stack.env.update({"RLOO_BASE_URL": stack.url + "/v1", "RLOO_API_KEY": stack.key})
            job_id = json.loads(rloo(stack, "jobs", "create", str(tmp_path / "job.json")).stdout)["id"]
            log = tmp_path / "watch.log"
            proc = watcher(stack, job_id, log)
            try:
                wait_for_line(log, "step 2/")
                stack.stop("api")
                time.sleep(1.5)  # the watch finds the API gone and keeps trying
                stack.start("api", "api", "--port", str(stack.port))
                assert proc.wait(timeout=300) == 0, log.read_text()
            finally:
                proc.kill()
    finally:
        scorer.close()
    assert step_lines(log.read_text()) == list(range(1, 9)), log.read_text()  # every step once, in order


def test_a_watched_job_cancelled_exits_2(stack: LiveStack, tmp_path: Path) -> None:
    made = rloo(
        stack,
        "jobs",
        "create",
        str(EXAMPLES / "demo" / "job.json"),
        "--training-file",
        str(EXAMPLES / "demo" / "train.jsonl"),
    )
    job_id = json.loads(made.stdout)["id"]
    log = tmp_path / "watch.log"
    proc = watcher(stack, job_id, log)
    try:
        wait_for_line(log, "step 1/")
        assert rloo(stack, "jobs", "cancel", job_id).stdout.strip() == f"{job_id} cancelled"
        assert proc.wait(timeout=120) == 2, log.read_text()
    finally:
        proc.kill()
    assert log.read_text().strip().endswith(f"{job_id} cancelled")
    bad = rloo(stack, "jobs", "get", "ftjob-nope")
    assert bad.returncode == 1 and "404" in bad.stderr

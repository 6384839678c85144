"""Operating it: Celery Flower against the tests' Redis behind its basic auth (compose's flower
service), a worker's own metrics on --metrics-port while it trains, and JSON log lines that name
their job (RLOO_LOG_FORMAT=json), from real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.data import EXAMPLES, ROOT, job_body
from tests.helpers.live import child_env, free_port, live_stack, upload_path, wait_for

pytestmark = pytest.mark.e2e


def _wait_http(url: str, timeout: float = 60, **kwargs: object) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=2, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError:
            assert time.monotonic() < deadline, url
            time.sleep(0.3)


def test_flower_answers_behind_its_basic_auth(tmp_path: Path, models_dir: Path, embedded_redis: str) -> None:
    port = free_port()
    env = {**child_env(tmp_path, models_dir), "REDIS_URL": embedded_redis, "FLOWER_PORT": str(port)}
    env["FLOWER_BASIC_AUTH"] = "admin:s3cret"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "--app", "worker.celery_app:app", "flower"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        assert _wait_http(url).status_code == 401  # no password, no Flower
        assert httpx.get(url, auth=("admin", "s3cret"), timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_worker_serves_its_metrics_and_logs_json_lines_that_name_the_job(tmp_path: Path, models_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    metrics_port = free_port()
    with live_stack("embedded", tmp_path, models_dir, env={"RLOO_LOG_FORMAT": "json"}, worker=False) as stack:
        stack.start("worker", "worker", "--metrics-port", str(metrics_port))
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        body = job_body(file_id, hp={"n_epochs": 1000, "max_steps": 5000})  # long enough to be scraped
        job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]
        wait_for(http, job_id, {"running"}, 120, stack, min_step=1)
        scrape = _wait_http(f"http://127.0.0.1:{metrics_port}/metrics").text
        samples = {
            (s.name, tuple(s.labels.items())): s.value
            for f in text_string_to_metric_families(scrape)
            for s in f.samples
        }
        assert samples[("rloo_worker_jobs_running", ())] == 1
        assert samples[("rloo_worker_job_step", (("job", job_id),))] >= 1
        http.post(f"/fine_tuning/jobs/{job_id}/cancel")
        wait_for(http, job_id, {"cancelled"}, 120, stack)
        time.sleep(1)
    for name in ("worker.log", "api.log"):
        lines = [json.loads(line) for line in (stack.logs / name).read_text().splitlines() if line.startswith("{")]
        assert lines, name
        assert all({"time", "level", "logger", "message", "job_id"} <= set(line) for line in lines), name
    worker_lines = [
        json.loads(line) for line in (stack.logs / "worker.log").read_text().splitlines() if line.startswith("{")
    ]
    about_job = [line for line in worker_lines if job_id in line["message"] or line["job_id"] == job_id]
    assert about_job and all(line["job_id"] == job_id for line in about_job), about_job[:5]

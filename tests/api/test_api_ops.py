"""Outside /v1: health, readiness, Prometheus metrics, unknown URLs and methods; and the names and
boundaries the architecture promises (the API imports no torch, the CLI's verbs, the settings).

Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set; every error is checked for its
exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers.api import (
    assert_error,
    create_job,
    each,
    fresh_client,
    upload_ok,
)
from tests.helpers.data import ROOT, job_body
from tests.helpers.live import run_cli


# Ops -----------------------------------------------------------------------------------------------
def test_healthz(client) -> None:
    resp = client.get("/healthz")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_readyz(client, monkeypatch) -> None:
    resp = client.get("/readyz")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "status": "ok",
        "checks": {"database": "ok", "broker": "ok"},
        "python_graders": "off",
        "limits": {"limits": "shared"},  # counted in Redis over every API process
    }
    # The sandbox python graders run in, once the operator turns them on.
    with fresh_client(monkeypatch, RLOO_ALLOW_PYTHON_GRADER="1") as on:
        assert on.get("/readyz").json()["python_graders"] == "bwrap"
    with fresh_client(monkeypatch, RLOO_PYTHON_GRADER_SANDBOX="process") as weaker:
        assert weaker.get("/readyz").json()["python_graders"] == "process"


def test_workers_say_which_sandbox_runs_on_their_host(monkeypatch) -> None:
    from service.core.settings import Settings
    from service.graders import sandbox

    assert sandbox.status(Settings()) == "off (RLOO_ALLOW_PYTHON_GRADER is false)"
    assert sandbox.status(Settings(allow_python_grader=True)).startswith("bwrap (namespaces: pid, net")
    monkeypatch.setenv("PATH", "/nonexistent")
    said = sandbox.status(Settings(allow_python_grader=True, python_grader_uid=65533))  # probed afresh
    assert said.startswith("unavailable: python graders run in bubblewrap's sandbox, and bwrap is not installed")


def test_broker_down_readyz_503_and_jobs_still_created(monkeypatch, env, auth, tmp_path) -> None:
    """The row is the truth: with the broker unreachable a job is still created (and queued later)."""
    from service.infra import task_queue

    dead = f"redis+socket://{tmp_path / 'no-redis.sock'}"
    task_queue.client.cache_clear()
    with fresh_client(monkeypatch, REDIS_URL=dead) as client:
        resp = client.get("/readyz")
        assert resp.status_code == 503, resp.text
        checks = resp.json()["checks"]
        assert checks["database"] == "ok" and checks["broker"] != "ok"
        f = upload_ok(client, auth)
        started = time.monotonic()
        job = create_job(client, auth, job_body(f["id"]))
        assert time.monotonic() - started < 15  # a dead broker must not hang the request
        assert job["status"] == "queued"
        events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
        assert events[0]["level"] == "warn", events
        assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()["status"] == "queued"
    task_queue.client.cache_clear()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, parsed back with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_metrics_count_jobs_steps_and_requests(client, auth) -> None:
    from service.core import crud
    from service.core.db import session_scope

    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    first = _samples(resp.text)
    assert first[("rloo_jobs", (("status", "queued"),))] == 0 and first[("rloo_queue_depth", ())] == 0
    assert first[("rloo_oldest_queued_job_age_seconds", ())] == 0
    f = upload_ok(client, auth)
    jobs = [create_job(client, auth, job_body(f["id"], seed=i)) for i in range(2)]
    client.post(f"/v1/fine_tuning/jobs/{jobs[0]['id']}/cancel", headers=auth)
    with session_scope() as session:  # three steps recorded as a worker records them
        job = crud.get_job_by_id(session=session, job_id=jobs[1]["id"])
        for step, seconds in ((1, 0.3), (2, 0.7), (3, 4.0)):
            data = {"time_step": seconds, "completions_per_s": 64 / seconds}
            crud.upsert_metrics(session=session, job=job, step=step, data=data)
        session.commit()
    got = _samples(client.get("/metrics").text)
    assert got[("rloo_jobs", (("status", "queued"),))] == 1 and got[("rloo_jobs", (("status", "cancelled"),))] == 1
    assert got[("rloo_queue_depth", ())] == 1 and got[("rloo_oldest_queued_job_age_seconds", ())] >= 0
    assert got[("rloo_steps_total", ())] == 3 and got[("rloo_completions_total", ())] == 3 * 64
    assert got[("rloo_step_seconds_count", ())] == 3 and got[("rloo_step_seconds_sum", ())] == pytest.approx(5.0)
    assert got[("rloo_step_seconds_bucket", (("le", "1.0"),))] == 2  # 0.3 and 0.7
    created = ("method", "POST"), ("route", "/v1/fine_tuning/jobs"), ("status", "200")
    assert got[("rloo_http_request_duration_seconds_count", created)] == 2
    cancel = ("method", "POST"), ("route", "/v1/fine_tuning/jobs/{job_id}/cancel"), ("status", "200")
    assert got[("rloo_http_request_duration_seconds_count", cancel)] == 1  # by template, not by id
    assert _samples(client.get("/metrics").text)[("rloo_steps_total", ())] == 3  # each row counted once


def test_unknown_url_is_404(client, auth) -> None:
    def check(url: str, headers: dict[str, str]) -> None:
        assert_error(client.get(url, headers=headers), 404, param=None)

    each([("/nope", {}), ("/nope", auth), ("/v1/nope", auth), ("/v1/fine_tuning/jobs/x/y/z", auth)], check)
    # Under /v1 the key comes first: no key, no information about which URLs exist.
    assert_error(client.get("/v1/nope"), 401, code="missing_api_key")


def test_wrong_method_is_405(client, auth) -> None:
    assert_error(client.put("/v1/files", headers=auth), 405)


# Boundaries and names ------------------------------------------------------------------------------
def test_api_process_imports_neither_torch_nor_worker(tmp_path) -> None:
    code = (
        "import service.main, sys; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch loaded'; "
        "assert not [m for m in sys.modules if m == 'worker' or m.startswith('worker.')], 'worker loaded'"
    )
    env = {**os.environ, "RLOO_HOME": str(tmp_path / "var")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr


def test_architecture_names_exist() -> None:
    import importlib

    import torch
    from celery import Celery
    from fastapi import FastAPI

    assert isinstance(importlib.import_module("service.main").app, FastAPI)
    assert isinstance(importlib.import_module("worker.celery_app").app, Celery)
    rloo_advantages = importlib.import_module("worker.rloo").rloo_advantages
    assert callable(rloo_advantages)
    # (1, 3): each reward minus the mean of the other two.
    out = rloo_advantages(torch.tensor([[1.0, 2.0, 3.0]]))
    assert out.shape == (1, 3)
    assert torch.allclose(out, torch.tensor([[-1.5, 0.0, 1.5]]))


def test_cli_lists_its_verbs() -> None:
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    for verb in ("up", "api", "worker", "db", "keys", "train", "demo"):
        assert re.search(rf"(^|\s){verb}\s", out.stdout, re.M), f"{verb} missing from:\n{out.stdout}"
    out = run_cli("keys", "create", "--help")
    assert out.returncode == 0, out.stderr
    assert "--project" in out.stdout


def test_settings_read_the_documented_environment(monkeypatch, tmp_path) -> None:
    from service.core.settings import Settings

    monkeypatch.setenv("DATABASE_URL", "postgres://u:p@db:5432/rloo")
    monkeypatch.setenv("REDIS_URL", "redis://cache:6379/3")
    monkeypatch.setenv("RLOO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLOO_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("RLOO_ARTIFACTS_DIR", str(tmp_path / "art"))
    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "true")
    s = Settings()
    assert s.database_url == "postgresql+psycopg://u:p@db:5432/rloo"
    assert s.redis_url == "redis://cache:6379/3"
    assert s.home_dir == (tmp_path / "home").resolve()
    assert s.models_dir == (tmp_path / "models").resolve()
    assert s.artifacts_dir == (tmp_path / "art").resolve()
    assert s.allow_python_grader is True
    for name in (
        "DATABASE_URL",
        "REDIS_URL",
        "RLOO_MODELS_DIR",
        "RLOO_ARTIFACTS_DIR",
        "RLOO_ALLOW_PYTHON_GRADER",
    ):
        monkeypatch.delenv(name)
    s = Settings()
    home = (tmp_path / "home").resolve()
    assert s.database_url == f"sqlite:///{home / 'rloo.db'}"
    assert s.artifacts_dir == home / "artifacts"
    assert s.allow_python_grader is False
    assert s.embedded_redis is True

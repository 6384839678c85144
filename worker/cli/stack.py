"""``rloo up``: the local stack as child processes (embedded Redis, the API, a training worker, a
graders worker, an inference worker), each started again should it die; and what it prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from service.core.settings import get_settings
from worker.cli.app import LOCAL_PROJECT, app, redact


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
    """The local project's key: created on first start, kept in $RLOO_HOME/api_key (mode 600). It
    is an operator's key (the fleet on the dashboard): whoever runs `rloo up` runs the machine."""
    from service.core.db import session_scope
    from service.tenancy import keys, projects

    settings = get_settings()
    key_file = settings.home_dir / "api_key"
    if key_file.is_file():
        secret = key_file.read_text().strip()
        with session_scope() as session:
            if keys.authenticate(session=session, secret=secret) is not None:
                return secret
    with session_scope() as session:
        proj = projects.get_or_create_project(session=session, name=LOCAL_PROJECT)
        _, secret = keys.create_api_key(session=session, project=proj, name="rloo up", operator=True)
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
    worker, a graders worker and an inference worker. A part that dies is started again (after 1 s, then up to 30 s
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
        from service.core.migrate import upgrade
        from service.infra.task_queue import grader_queue

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
            ("inference-worker", ["worker", "--serve"]),  # chat and text completions, evaluations
        ):
            self.parts[name] = _Part(args, self._spawn(name, args), time.monotonic())
        wait_until_ready(self.url, alive=self._check_parts)
        self._wait_for_inference()
        return key

    def _wait_for_inference(self, timeout: float = 300) -> None:
        """Until the inference worker has loaded the models it preloads (``RLOO_INFERENCE_PRELOAD``):
        the first chat request must not wait for a model to load. Past ``timeout`` (a model too big
        for this machine's patience) the stack is up all the same: requests wait for the worker."""
        import redis

        from service.infra import inference_bus

        conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=5, socket_connect_timeout=5)
        ns = inference_bus.namespace(inference_bus.serve_queue())
        deadline = time.monotonic() + timeout
        try:
            while not inference_bus.live_workers(conn, ns, warm=True):
                self._check_parts()
                if time.monotonic() > deadline:
                    typer.echo(
                        f"the inference worker is still loading its models after {timeout:.0f} s; chat requests "
                        "wait for it (its log: logs/inference-worker.log)",
                        err=True,
                    )
                    return
                time.sleep(0.2)
        finally:
            conn.close()

    def _keep_redis(self) -> None:
        """Start the embedded Redis unless one answers (a worker's reconciler may have started it)."""
        from service.infra import embedded_redis

        settings = get_settings()
        if settings.embedded_redis and (self.redis is None or self.redis.poll() is not None):
            self.redis = embedded_redis.start(settings, daemonize=False)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        settings = get_settings()
        env = {
            **os.environ,
            "RLOO_HOME": str(settings.home_dir),
            "PYTHONUNBUFFERED": "1",
            **torch_threads_of(name),
            **preload_of(name),
        }
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
            from service.infra import embedded_redis

            embedded_redis.stop_daemon(settings)


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


def torch_threads_of(part: str) -> dict[str, str]:
    """The torch threads of one of the stack's parts, where the user chose none (``RLOO_TORCH_THREADS``
    or ``OMP_NUM_THREADS``): the training and the inference worker share the usable cores less one
    (an evaluation runs on the one while a job trains on the other), a graders worker's dry runs take
    one each; the API imports no torch."""
    from worker.engine.cpu_threads import choose

    if get_settings().torch_threads != "auto" or "OMP_NUM_THREADS" in os.environ or part == "api":
        return {}
    threads = 1 if part == "grader-worker" else choose("auto", processes=2).threads
    return {"RLOO_TORCH_THREADS": str(threads)}


def preload_of(part: str) -> dict[str, str]:
    """The inference worker loads every model under the models root that writes text when it starts
    (``RLOO_INFERENCE_PRELOAD=all``), where the user chose nothing: a laptop's stack answers its first
    chat at once."""
    if part != "inference-worker" or "RLOO_INFERENCE_PRELOAD" in os.environ or get_settings().inference_preload:
        return {}
    return {"RLOO_INFERENCE_PRELOAD": "all"}


@app.command("up")
def up(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port the API listens on.")] = 8000,
) -> None:
    """Run the whole stack in the foreground until Ctrl-C: migrations, Redis, the API and the workers
    (each started again should it die). Prints the URL and the local project's API key.

    \b
    Example:
      rloo up --port 8000
    """
    port_free_or_exit(host, port, "rloo up --port {free}")
    stack = Stack(host, port)
    try:
        key = stack.start()
        typer.echo(up_banner(stack.url, key, get_settings()))
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the stack as Ctrl-C does
        # Ctrl-C too where the shell that started it ignores SIGINT (a `cmd &` of a script, `nohup`):
        # Python leaves an inherited SIG_IGN alone, and the stack would never stop on it.
        signal.signal(signal.SIGINT, _interrupt)
        while True:
            time.sleep(0.5)
            stack.supervise()
    except KeyboardInterrupt:
        typer.echo("\nstopping…")
    finally:
        stack.stop()


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` already (a bind with SO_REUSEADDR, as uvicorn's, fails)."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise  # a host this machine does not have, a port it may not bind: the caller says which
    return False


def port_free_or_exit(host: str, port: int, how: str) -> None:
    """Before anything starts: a port another program (or another stack) holds is one line saying
    so and a free one to take instead (``how`` with ``{free}`` in it), and exit 1."""
    try:
        if not port_in_use(host, port):
            return
    except OSError as exc:
        typer.echo(f"error: cannot listen on {host}:{port}: {exc.strerror}", err=True)
        raise typer.Exit(1) from None
    free = next((p for p in range(port + 1, min(port + 100, 65536)) if not port_in_use(host, p)), None)
    hint = f": {how.format(free=free)}" if free is not None else ""
    typer.echo(f"error: port {port} on {host} is in use (another rloo-service, or another program){hint}", err=True)
    raise typer.Exit(1)


def up_banner(url: str, key: str, settings: Any) -> str:
    """What `rloo up` prints once the stack answers: URLs with their passwords masked; the local
    project's key in full, on purpose (it is the user's own terminal; it is never logged)."""
    from service.graders.sandbox import status as sandbox_status

    return "\n".join(
        [
            f"\nrloo-service is up at {url}  (dashboard: {url}/, docs: {url}/docs)",
            f"  database:  {redact(settings.database_url)}",
            f"  broker:    {redact(settings.redis_url)}",
            f"  models:    {settings.models_dir}  (loaded for chat: "
            f"{preload_of('inference-worker').get('RLOO_INFERENCE_PRELOAD', settings.inference_preload) or 'none'}; "
            "RLOO_INFERENCE_PRELOAD)",
            f"  python graders: {sandbox_status(settings)}",
            f"  torch threads: {torch_threads_of('worker').get('RLOO_TORCH_THREADS', 'as set')} a worker "
            "(RLOO_TORCH_THREADS; README: on a busy machine)",
            f"  API key of project '{LOCAL_PROJECT}' (also in {settings.home_dir / 'api_key'}):",
            f"    export RLOO_BASE_URL={url}/v1 RLOO_API_KEY={key}",
            "Ctrl-C stops everything.",
        ]
    )

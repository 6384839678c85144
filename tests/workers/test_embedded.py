"""The embedded Redis: one server per RLOO_HOME, however many processes start it at once."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from service.core.settings import Settings
from service.infra import embedded_redis


def _servers(sock: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"unixsocket:{sock}"], capture_output=True, text=True).stdout
    return out.split()


def test_concurrent_starts_make_one_server(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "var")
    errors: list[BaseException] = []

    def start() -> None:
        try:
            embedded_redis.start(settings, daemonize=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert not errors, errors
        assert embedded_redis.ping(settings)
        assert len(_servers(settings.redis_socket)) == 1
    finally:
        embedded_redis.stop_daemon(settings)

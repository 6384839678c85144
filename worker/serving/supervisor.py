"""``rloo worker --serve``: a small parent process (no torch) that runs one inference worker process
(``python -m worker.serving``) and starts another should it die, as Celery's pool does for the
training workers. When one dies, the requests it held are answered 503 at once (the API would see
their leases expire within seconds anyway), and the next request is served by the new one."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from service.core.settings import get_settings
from service.infra import inference_bus

log = logging.getLogger("rloo.serve")

STABLE_SECONDS = 60.0  # a process that ran this long before it died is started again at once


def supervise() -> None:
    import redis

    settings = get_settings()
    logging.basicConfig(format="[%(asctime)s: %(levelname)s/serve] %(message)s", level=logging.INFO)
    conn = redis.Redis.from_url(settings.redis_client_url, socket_timeout=10, socket_connect_timeout=10)
    ns = inference_bus.namespace(inference_bus.serve_queue())
    stopping: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, _: Any) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    backoff, generation = 0.5, 0
    while not stopping:
        generation += 1
        worker = f"serve-{socket.gethostname()}-{os.getpid()}-{generation}"
        child = subprocess.Popen([sys.executable, "-m", "worker.serving", worker])
        started = time.monotonic()
        code = child.wait()
        if stopping:
            break
        try:
            lost = inference_bus.worker_gone(conn, ns, worker)
        except Exception as exc:  # Redis away: the API sees the leases expire instead
            log.warning("could not answer the dead worker's requests: %s", exc)
            lost = 0
        backoff = 0.5 if time.monotonic() - started >= STABLE_SECONDS else min(30.0, 2 * backoff)
        log.warning(
            "inference worker %s exited with %s (%d requests answered 503); starting another in %.1f s",
            worker,
            code,
            lost,
            backoff,
        )
        time.sleep(backoff)
    if child is not None:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()

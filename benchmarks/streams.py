"""What watching costs (``python -m benchmarks.streams``; ``make bench``'s ``streams``): ``watchers``
event streams of one job held open on one API process (uvicorn, in this process, on the embedded
defaults), then:

1. ``idle``: a minute and a bit with nothing written: database queries per watcher per minute (the
   streams' own resync), keep-alives only on the wire.
2. ``writes``: ``events`` events written one at a time (each commit publishes its wake-up): the time
   from commit to the event's arrival at every watcher (p50, p99, max), and queries per watcher
   per event.
3. the process's resident memory per open stream.

Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WATCHERS = int(os.environ.get("BENCH_WATCHERS", "500"))
EVENTS = 20
IDLE_SECONDS = 65.0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="rloo-bench-streams-"))
    os.environ.update({"RLOO_HOME": str(home), "RLOO_MAX_STREAMS_PER_KEY": str(WATCHERS + 10)})
    os.environ.setdefault("RLOO_MAX_CONNECTIONS", str(WATCHERS + 100))
    os.environ.setdefault("RLOO_RATE_LIMIT", "0")  # 500 streams opened at once: a burst no key is let
    from sqlalchemy import event

    from benchmarks.common import job_row
    from service.core.db import get_engine, session_scope
    from service.core.migrate import upgrade
    from service.core.settings import get_settings
    from service.infra import embedded_redis
    from service.tenancy import keys, projects

    redis_proc = embedded_redis.start(get_settings(), daemonize=False)
    upgrade()
    with session_scope() as session:
        project = projects.get_or_create_project(session=session, name="bench")
        _, key = keys.create_api_key(session=session, project=project)
        job = job_row(session, "bench", "m", base_model=None)
        session.commit()
        job_id = job.id
    queries = [0]
    event.listen(get_engine(), "before_cursor_execute", lambda *a: queries.__setitem__(0, queries[0] + 1))

    import uvicorn

    from service.main import create_app

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), port=port, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    rss_before = _rss_mb()
    try:
        return asyncio.run(_watch(port, key, job_id, queries, rss_before))
    finally:
        server.should_exit = True
        if redis_proc is not None:
            redis_proc.terminate()


def _write_event(job_id: str, i: int) -> tuple[str, float]:
    """One event of the job, committed (its wake-up published): its id and when."""
    from service.core import crud
    from service.core.db import session_scope
    from service.jobs import lifecycle

    with session_scope() as session:
        job = crud.get_job_by_id(session=session, job_id=job_id)
        assert job is not None
        e = lifecycle.add_event(session=session, job=job, message=f"bench event {i}")
        session.commit()
        return e.id, time.perf_counter()


async def _watch(port: int, key: str, job_id: str, queries: list[int], rss_before: float) -> dict[str, Any]:
    import httpx

    arrived: dict[str, list[float]] = {}
    opened = asyncio.Event()
    open_count = [0]

    async def watcher(client: httpx.AsyncClient) -> None:
        async with client.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events?stream=true") as r:
            assert r.status_code == 200, await r.aread()
            open_count[0] += 1
            if open_count[0] == WATCHERS:
                opened.set()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    arrived.setdefault(json.loads(line[6:])["id"], []).append(time.perf_counter())

    limits = httpx.Limits(max_connections=WATCHERS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=None
    ) as client:
        tasks = [asyncio.create_task(watcher(client)) for _ in range(WATCHERS)]
        await asyncio.wait_for(opened.wait(), timeout=120)
        await asyncio.sleep(1)
        rss_open = _rss_mb()
        q0 = queries[0]
        await asyncio.sleep(IDLE_SECONDS)
        idle_per_watcher_min = (queries[0] - q0) / WATCHERS / (IDLE_SECONDS / 60)

        latencies, q1 = [], queries[0]
        for i in range(EVENTS):
            event_id, committed = await asyncio.to_thread(_write_event, job_id, i)
            deadline = time.monotonic() + 30
            while len(arrived.get(event_id, [])) < WATCHERS and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            times = arrived.get(event_id, [])
            latencies += [t - committed for t in times]
            await asyncio.sleep(0.2)
        per_event = (queries[0] - q1) / WATCHERS / EVENTS
        for t in tasks:
            t.cancel()
    latencies.sort()
    return {
        "watchers": WATCHERS,
        "idle_queries_per_watcher_per_minute": round(idle_per_watcher_min, 2),
        "queries_per_watcher_per_event": round(per_event, 2),
        "delivered": f"{len(latencies)} of {WATCHERS * EVENTS}",
        "latency_ms": {
            "p50": round(statistics.median(latencies) * 1000, 1),
            "p99": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 1),
            "max": round(latencies[-1] * 1000, 1),
        },
        "rss_mb_per_stream": round((rss_open - rss_before) / WATCHERS, 3),
        "python": sys.version.split()[0],
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

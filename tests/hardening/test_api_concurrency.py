"""The API under many concurrent connections answers every request (a real `rloo api` process).

Regression: with a bounded SQLite pool, 128 concurrent job reads held every pooled connection
between their handler's thread hops while all the server's threads waited for one: the server
stalled until the pool timed out. Speed is `make bench`'s business; this checks only that every
request is answered. And connections that never finish their headers (slowloris) are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers.data import EXAMPLES, ROOT
from tests.helpers.live import child_env, free_port
from worker.cli.stack import wait_until_ready


def test_128_concurrent_reads_are_all_answered(tmp_path: Path, models_dir: Path) -> None:
    # (RLOO_HEADER_TIMEOUT_SECONDS: for the slowloris part, at the end)
    # 512 reads with one key in a second or two: far past the per-key rate limit, which is not what
    # this test is about (tests/hardening/test_rate_limit.py is).
    env = child_env(tmp_path, models_dir, RLOO_RATE_LIMIT="0", RLOO_HEADER_TIMEOUT_SECONDS="1")
    cli = [sys.executable, "-m", "worker.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)
    made = subprocess.run(
        [*cli, "keys", "create", "--project", "load"],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    headers = {"Authorization": f"Bearer {made.stdout.strip().splitlines()[-1]}"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "api.log", "wb") as log:
        server = subprocess.Popen(
            [*cli, "api", "--port", str(port)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_until_ready(base)
            with open(EXAMPLES / "demo" / "train.jsonl", "rb") as f:
                file_id = httpx.post(
                    f"{base}/v1/files", headers=headers, files={"file": f}, data={"purpose": "fine-tune"}, timeout=60
                ).json()["id"]
            body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
            body["training_file"] = file_id
            job_id = httpx.post(f"{base}/v1/fine_tuning/jobs", headers=headers, json=body, timeout=60).json()["id"]

            async def burst() -> list[int]:
                limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
                async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=20) as client:

                    async def read() -> int:
                        # A keep-alive connection the server closed just as it was reused is a client's
                        # retry (httpx does not retry reads); a stalled server times out instead.
                        for _ in range(3):
                            try:
                                return (await client.get(f"/v1/fine_tuning/jobs/{job_id}")).status_code
                            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                                await asyncio.sleep(0.1)
                        return -1

                    async def reads(n: int) -> list[int]:
                        return [await read() for _ in range(n)]

                    per_connection = await asyncio.gather(*(reads(4) for _ in range(128)))
                return [code for codes in per_connection for code in codes]

            codes = asyncio.run(burst())  # a stalled server raises ReadTimeout here
            assert codes == [200] * 512, (sorted(set(codes)), (tmp_path / "api.log").read_text()[-2000:])
            slowloris(port, base)
        finally:
            server.terminate()
            server.wait(timeout=30)
            from service.core.settings import Settings
            from service.infra import embedded_redis

            embedded_redis.stop_daemon(Settings(home=tmp_path / "var"))  # `rloo api` started it, daemonized


def slowloris(port: int, base: str) -> None:
    """200 connections that send half their headers and wait, and one that sends endless headers:
    each is answered (408, 431) and closed, and the API serves everyone else meanwhile."""
    stalled = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        stalled.append(sock)
    flood = socket.create_connection(("127.0.0.1", port))
    with contextlib.suppress(OSError):  # closed while we wrote: what we want
        flood.sendall(b"GET /healthz HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\n")
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
    answers = [_until_closed(sock) for sock in stalled]
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:20] for a in answers}
    assert _until_closed(flood).startswith(b"HTTP/1.1 431")
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
    # A body still coming after its answer (a 401 before a large upload is read) is no header, and
    # the connection serves the next request once it is in...
    post = b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n"
    early = socket.create_connection(("127.0.0.1", port))
    early.sendall(post)
    for _ in range(30):
        early.sendall(b"x" * 10_000)
    early.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answers = _until_closed(early)
    assert answers.startswith(b"HTTP/1.1 401") and b"HTTP/1.1 200" in answers and b"431" not in answers, answers
    # ...but a body that stops coming has the header's deadline, then the connection is closed.
    stuck = socket.create_connection(("127.0.0.1", port))
    stuck.sendall(post + b"x" * 10_000)
    assert _until_closed(stuck).startswith(b"HTTP/1.1 401")
    # A kept-alive connection fed blank lines (no request ever begins) is closed all the same.
    idle = socket.create_connection(("127.0.0.1", port))
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    idle.settimeout(0.5)
    closed_after = None
    for tick in range(16):  # 8 s; the deadline is 1 s
        try:
            if idle.recv(65536) == b"":
                closed_after = tick * 0.5
                break
        except TimeoutError:
            pass
        except ConnectionResetError:  # closed as a blank line arrived: the server's kernel answers RST
            closed_after = tick * 0.5
            break
        with contextlib.suppress(OSError):
            idle.sendall(b"\r\n")
    idle.close()
    assert closed_after is not None, "a blank-line drip kept the connection open"


def _until_closed(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (a timeout here: it never did)."""
    sock.settimeout(15)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return data

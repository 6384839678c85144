"""Streamed events and metrics (``?stream=true``, server-sent events) from a real API process while
a real worker trains: every row once, oldest first, live; ``[DONE]`` at the end; a dropped
connection resumed with ``Last-Event-ID`` loses and repeats nothing; the cap per key; another
project's job is 404.

Runs on the embedded defaults, and on PostgreSQL + Redis when TEST_DATABASE_URL and TEST_REDIS_URL
are set (the CI sets both).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.api import assert_error
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import LiveStack, live_stack, upload_path, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["embedded", "production"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[LiveStack]:
    """One stack of each kind for the module (each test makes and reads its own job)."""
    where = tmp_path_factory.mktemp(f"streams-{request.param}")
    with live_stack(request.param, where, models_dir, env={"RLOO_MAX_STREAMS_PER_KEY": "2"}) as s:
        yield s


def read_stream(
    http: httpx.Client, path: str, *, headers: dict[str, str] | None = None, stop_after: int | None = None
) -> tuple[list[tuple[str, Any]], bool]:
    """The ``(id, data)`` messages of a stream, and whether it ended with ``[DONE]``; with
    ``stop_after``, the connection is dropped after that many."""
    out: list[tuple[str, Any]] = []
    with http.stream("GET", path, headers=headers, timeout=httpx.Timeout(120, read=60)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        message: dict[str, str] = {}
        for line in r.iter_lines():
            if line.startswith("id: "):
                message["id"] = line[4:]
            elif line.startswith("data: "):
                message["data"] = line[6:]
            elif not line and "data" in message:
                if message["data"] == "[DONE]":
                    return out, True
                out.append((message["id"], json.loads(message["data"])))
                message = {}
                if stop_after is not None and len(out) == stop_after:
                    return out, False
    return out, False


def test_events_and_metrics_stream_live_resume_exactly_and_end_with_done(stack: LiveStack) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    job_id = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 4})).json()["id"]

    # Opened while the job is queued: the first few, then the connection drops.
    first, done = read_stream(http, f"/fine_tuning/jobs/{job_id}/events?stream=true", stop_after=2)
    assert not done and len(first) == 2
    # Resumed after the last one seen: the rest, live, until the job is final.
    rest, done = read_stream(
        http, f"/fine_tuning/jobs/{job_id}/events?stream=true", headers={"Last-Event-ID": first[-1][0]}
    )
    assert done
    job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 1, stack)
    assert job["status"] == "succeeded"
    listed = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"][::-1]
    streamed = first + rest
    assert [i for i, _ in streamed] == [e["id"] for e in listed]  # every event once, oldest first
    assert [d for _, d in streamed] == listed  # the very objects the list answers
    assert sum(d["type"] == "metrics" for _, d in streamed) == 4

    metrics, done = read_stream(http, f"/fine_tuning/jobs/{job_id}/metrics?stream=true")
    assert done and [i for i, _ in metrics] == ["1", "2", "3", "4"]
    assert [d for _, d in metrics] == http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    later, done = read_stream(http, f"/fine_tuning/jobs/{job_id}/metrics?stream=true", headers={"Last-Event-ID": "2"})
    assert done and [i for i, _ in later] == ["3", "4"]


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)  # the API process's own count: one backend
def test_streams_are_capped_per_key_and_scoped_to_the_project(stack: LiveStack) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    job_id = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 30})).json()["id"]
    path = f"/fine_tuning/jobs/{job_id}/events?stream=true"
    with http.stream("GET", path) as one, http.stream("GET", path) as two:
        assert one.status_code == two.status_code == 200
        assert_error(http.get(path), 429, code="too_many_streams")
    with http.stream("GET", path) as again:  # the two closed: room again
        assert again.status_code == 200
    other_key = stack.cli("keys", "create", "--project", "other").stdout.strip().splitlines()[-1]
    other = httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {other_key}"})
    assert_error(other.get(path), 404)
    assert_error(http.get(path, headers={"Last-Event-ID": "ftevent-nope"}), 400, param="Last-Event-ID")
    http.post(f"/fine_tuning/jobs/{job_id}/cancel")


def test_a_client_that_stops_reading_is_dropped_not_buffered() -> None:
    """A send that waits past send_timeout (uvicorn waits while a client reads nothing) ends the
    stream with an error, and the stream's place is given back."""
    import asyncio

    from service.api.streams import EventStreamResponse

    released: list[bool] = []
    sent: list[bytes] = []

    async def endless():  # type: ignore[no-untyped-def]
        while True:
            yield b"data: {}\n\n"

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and len(sent) >= 3:
            await asyncio.Event().wait()  # the client's buffers are full: this send never returns
        sent.append(message.get("body", b""))

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # no disconnect: the client is there, it just reads nothing
        return {}

    async def release() -> None:
        released.append(True)

    response = EventStreamResponse(endless(), send_timeout=0.2, on_close=release)
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}

    async def run() -> None:
        await asyncio.wait_for(response(scope, receive, send), timeout=10)

    from starlette.requests import ClientDisconnect

    with pytest.raises(ClientDisconnect):  # Starlette's name for a send that failed (TimeoutError is an OSError)
        asyncio.run(run())  # within send_timeout, not the test's 10 s
    assert len(sent) == 3 and released == [True]

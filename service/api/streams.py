"""Server-sent event streams of a job's rows: ``GET .../events?stream=true`` and ``.../metrics?stream=true``.

The database is the source: a stream reads the rows after its cursor (an event's ``seq``, a
metric's step), sends them, and waits. What wakes it is ``service.infra.wakeups``: one Redis pub/sub
subscription per API process (``Hub``) fans each "job X has new rows" out to that job's streams, so
a watcher costs a query when its job writes, not one a second. Besides, an idle stream sends a
keep-alive comment every ``keepalive`` seconds (proxies keep it open) and reads the database once a
minute whatever Redis says (a wake-up lost while Redis was down is a row sent a little later).

Each message is ``id: <cursor>`` and ``data: <the row's JSON, as the list answers it>``; a client
that reconnects with ``Last-Event-ID`` gets the rows after it, each once. When the job is final and
every row is sent, ``data: [DONE]`` ends the stream. A client that stops reading is dropped when a
send has waited ``send_timeout`` seconds (uvicorn buffers a few KiB, no more). A key may hold
``cap`` streams at once in a process (429 past it; ``Hub.take``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from service.api.errors import APIError
from service.core.tables import Job, JobEvent, JobMetric
from service.infra.limits import Lease, SharedLimits
from service.infra.wakeups import CHANNEL

log = logging.getLogger("rloo.streams")

RESYNC_SECONDS = 60.0
"""An idle stream reads the database at least this often, woken or not."""
BATCH = 500
"""Rows read at a time."""

Row = tuple[str, dict[str, Any]]
"""A message to send: its id (the cursor after it) and its data."""
Reader = Callable[[], Awaitable[tuple[bool, list[Row]]]]
"""Reads the rows after the stream's cursor (and moves it): whether the job was final before the
read, and the rows."""


class Hub:
    """This process's one subscription to the wake-up channel, fanned out to waiting streams.

    Connects on first use, on the event loop that serves the streams; reconnects with back-off
    when Redis goes away (streams carry on, reading once a ``RESYNC_SECONDS``). ``count`` says how
    many streams each key holds."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.waiting: dict[str, set[asyncio.Event]] = {}
        self.count: dict[str, int] = {}
        self.task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def watch(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever ``job_id`` has new rows, for the ``with`` block's lifetime."""
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._listen())
        woken = asyncio.Event()
        self.waiting.setdefault(job_id, set()).add(woken)
        try:
            yield woken
        finally:
            waiters = self.waiting.get(job_id, set())
            waiters.discard(woken)
            if not waiters:
                self.waiting.pop(job_id, None)

    async def take(self, key: str, cap: int, shared: SharedLimits | None = None) -> Lease:
        """One of ``key``'s at most ``cap`` streams (a 429 past them), counted in Redis over every API
        process (``shared``) where it answers, else in this one; returns its lease (renewed by the
        stream while it runs, released when it ends)."""
        if shared is not None:
            lease = await shared.lease("streams", key, cap=cap, ttl=STREAM_LEASE_SECONDS)
            if lease is False:
                raise _too_many_streams(cap)
            if isinstance(lease, Lease):
                return lease
        if self.count.get(key, 0) >= cap:
            raise _too_many_streams(cap)
        self.count[key] = self.count.get(key, 0) + 1

        async def release() -> None:
            self.count[key] -= 1
            if not self.count[key]:
                del self.count[key]

        return Lease(release=release)

    async def _listen(self) -> None:
        import redis.asyncio

        delay = 0.5
        while True:
            try:
                conn = redis.asyncio.Redis.from_url(self.redis_url, socket_connect_timeout=5)
                async with conn.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    delay = 0.5
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._wake(message["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: streams fall back to reading now and then
                log.warning("stream wake-ups lost (%s: %s); reconnecting in %.1f s", type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    def _wake(self, job_id: str) -> None:
        for woken in self.waiting.get(job_id, ()):
            woken.set()


STREAM_LEASE_SECONDS = 60.0
"""A stream's place among its key's (RLOO_MAX_STREAMS_PER_KEY) lapses this long after its last
renewal (an API process that died holding it frees it so); a stream renews it three times as often."""


@dataclass(frozen=True)
class Limits:
    keepalive: float
    send_timeout: float


async def messages(hub: Hub, job_id: str, read: Reader, limits: Limits, lease: Lease) -> AsyncIterator[bytes]:
    """The stream's bytes: every row ``read`` gives, as it comes, then ``[DONE]`` once the job is
    final and nothing is left to send. Renews the stream's ``lease`` as it goes."""
    yield b": stream open\n\n"
    renewed = time.monotonic()
    with hub.watch(job_id) as woken:
        while True:
            if time.monotonic() - renewed > STREAM_LEASE_SECONDS / 3:
                await lease.renew()
                renewed = time.monotonic()
            woken.clear()
            final, rows = await read()
            read_at = time.monotonic()
            for cursor, data in rows:
                yield f"id: {cursor}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
            if len(rows) == BATCH:
                continue
            if final and not rows:  # final before that read, which found nothing more
                yield b"data: [DONE]\n\n"
                return
            if final:
                continue
            while not woken.is_set() and time.monotonic() - read_at < min(RESYNC_SECONDS, STREAM_LEASE_SECONDS / 3):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=limits.keepalive)
                if not woken.is_set():
                    yield b": keep-alive\n\n"


class EventStreamResponse(StreamingResponse):
    """``text/event-stream``, never cached or buffered by a proxy; a send that waits past
    ``send_timeout`` (a client that stopped reading) ends the stream."""

    def __init__(
        self, content: AsyncIterator[bytes], *, send_timeout: float, on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.send_timeout, self.on_close = send_timeout, on_close

    async def __call__(self, scope: Any, receive: Any, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout=self.send_timeout)
            except TimeoutError:
                log.info("a stream's client stopped reading for %.0f s; dropped", self.send_timeout)
                raise

        await super().stream_response(timed)


# The rows of a job, after a cursor -----------------------------------------------------------------
def _too_many_streams(cap: int) -> APIError:
    return APIError(
        429,
        f"This API key already holds {cap} streams (RLOO_MAX_STREAMS_PER_KEY); close one first.",
        code="too_many_streams",
        headers={"Retry-After": "1"},
    )


def _final(session: Session, job_seq: int) -> bool:
    from service.jobs.lifecycle import FINAL

    return session.scalar(select(Job.status).where(Job.seq == job_seq)) in {s.value for s in FINAL}


def _reader(model: Any, job_seq: int, cursor_column: Any, after: int, message: Callable[[Any], Row]) -> Reader:
    """A job's rows of ``model`` after ``after`` in ``cursor_column``, oldest first, each as
    ``message`` makes it: whether the job was final before the read (read first, so rows written
    before a final status are read after it), and the rows."""
    cursor = after

    def work(session: Session) -> tuple[bool, list[Any]]:
        final = _final(session, job_seq)
        query = select(model).where(model.job_seq == job_seq, cursor_column > cursor)
        return final, list(session.scalars(query.order_by(cursor_column).limit(BATCH)))

    async def read() -> tuple[bool, list[Row]]:
        nonlocal cursor
        final, rows = await _in_session(work)
        cursor = getattr(rows[-1], cursor_column.key) if rows else cursor
        return final, [message(row) for row in rows]

    return read


def event_reader(job_seq: int, after_seq: int) -> Reader:
    """A job's events after ``after_seq``, as ``GET .../events`` answers each."""
    return _reader(JobEvent, job_seq, JobEvent.seq, after_seq, lambda e: (e.id, event_object(e)))


def metric_reader(job_seq: int, after_step: int) -> Reader:
    """A job's per-step metric rows after step ``after_step``, as ``GET .../metrics`` answers each."""
    return _reader(JobMetric, job_seq, JobMetric.step, after_step, lambda m: (str(m.step), {"step": m.step, **m.data}))


async def _in_session(work: Callable[[Session], Any]) -> Any:
    """``work(session)`` in a short session of its own (a stream outlives its request's)."""
    from service.core.db import new_session, run_db

    session = new_session()
    return await run_db(session, work, session)


def event_object(e: JobEvent) -> dict[str, Any]:
    return {
        "id": e.id,
        "object": "fine_tuning.job.event",
        "created_at": e.created_at,
        "level": e.level,
        "message": e.message,
        "type": e.type,
        "data": e.data or {},
    }

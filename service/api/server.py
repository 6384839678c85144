"""Serving the API (``rloo api``): uvicorn with the limits a public port needs.

uvicorn closes an idle keep-alive connection after a few seconds, but gives no deadline to a
request's headers: a client that opens a connection and sends its headers a byte at a time holds a
connection for ever, and a few hundred such clients hold them all (slowloris). Here each request's
headers must arrive whole within ``RLOO_HEADER_TIMEOUT_SECONDS`` and within 64 KiB; past either,
the connection is answered (408 or 431) and closed. A body still coming after its request was
answered (a 401 before an upload is read) has as long; uvicorn would keep that connection open.
``RLOO_MAX_CONNECTIONS`` caps the connections and requests in flight (503 past it). In production
put a proxy in front as well (docs/security.md): it buffers slow bodies and terminates TLS.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.core.settings import get_settings

MAX_HEADER_BYTES = 64 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on the connection whenever it waits on the
    client: for a request's headers (at most 64 KiB of them), between requests, and for a body still
    coming after its answer was sent (a 401 or 413 before an upload is read). Past it the connection
    is closed: with a 408 if a request had begun, quietly if not. uvicorn alone waits for ever once a
    client keeps sending something (a byte of headers, a blank line, a body nobody reads)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = get_settings().header_timeout_seconds
        self.guard: asyncio.TimerHandle | None = None
        # Bytes of the current request's headers, None once they are complete (the count of a request
        # that begins in the chunk that ended the one before starts with the next chunk).
        self.header_bytes: int | None = 0
        self.in_headers = False  # a request has begun, its headers are not complete
        self.body_coming = False  # the current request's headers are in, its body is not

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        while data and not self.transport.is_closing():
            if self.header_bytes is None:  # a body, or what comes before the next request begins
                super().data_received(data)
                return
            room = MAX_HEADER_BYTES - self.header_bytes
            if room <= 0:
                self._expire(b"431 Request Header Fields Too Large")
                return
            # The parser sees at most what the headers may still take; the rest after it finished them.
            head, data = data[:room], data[room:]
            self.header_bytes += len(head)
            super().data_received(head)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_headers = True
        if self.header_bytes is None:
            self.header_bytes = 0
        if self.guard is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self.in_headers, self.body_coming = False, True
        self.header_bytes = None  # the body is not counted (an answer may come before it is all sent)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.body_coming = False
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            self._arm()  # the body of an answered request is in: the next request has its deadline
            if self.timeout_keep_alive_task is None and not self.pipeline:  # (the body's bytes stopped it)
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self.pipeline or self.cycle is None or not self.cycle.response_complete:
            return  # (a pipelined request is being served: its headers are in)
        # Either the rest of this request's body, or the next request, has until the deadline.
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self.guard = self.loop.call_later(self.header_timeout, self._expire, None)

    def _disarm(self) -> None:
        if self.guard is not None:
            self.guard.cancel()
            self.guard = None

    def _expire(self, status: bytes | None) -> None:
        """Close the connection; with ``status``, or a 408 if a request's headers had begun."""
        self._disarm()
        if self.transport.is_closing():
            return
        if status is None and self.in_headers:
            status = b"408 Request Timeout"
        if status is not None:
            self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        self.transport.close()


def serve(*, host: str, port: int, workers: int) -> None:
    import uvicorn

    settings = get_settings()
    log_config = None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    uvicorn.run(
        "service.main:app",
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        log_config=log_config,
        proxy_headers=True,
        access_log=False,
        http="service.api.server:GuardedHttpToolsProtocol",
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=5,
        # Streams never end by themselves: on shutdown they get this long, then are closed (their
        # clients reconnect with Last-Event-ID to another process, or to this one restarted).
        timeout_graceful_shutdown=5,
    )

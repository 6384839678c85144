"""Serving the API (``rloo api``): uvicorn with the limits a public port needs.

uvicorn closes an idle keep-alive connection after a few seconds, but gives no deadline to a
request's headers: a client that opens a connection and sends its headers a byte at a time holds a
connection for ever, and a few hundred such clients hold them all (slowloris). Here each request's
headers must arrive whole within ``RLOO_HEADER_TIMEOUT_SECONDS`` and within 64 KiB; past either,
the connection is answered (408 or 431) and closed. ``RLOO_MAX_CONNECTIONS`` caps the connections
and requests in flight (503 past it). In production put a proxy in front as well (see the README):
it buffers slow bodies and terminates TLS.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.settings import get_settings

MAX_HEADER_BYTES = 64 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size limit on each request's headers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = get_settings().header_timeout_seconds
        self.header_timer: asyncio.TimerHandle | None = None
        self.header_bytes: int | None = 0  # None once the request's headers are complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_bytes is not None:
            self.header_bytes += len(data)
            if self.header_bytes > MAX_HEADER_BYTES:
                self._refuse(b"431 Request Header Fields Too Large")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.header_bytes = self.header_bytes or 0
        if self.header_timer is None:  # a new request on a kept-alive connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self.header_bytes = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self.header_bytes = 0  # the next request's headers are counted afresh
        super().on_response_complete()

    def _arm(self) -> None:
        self.header_timer = self.loop.call_later(self.header_timeout, self._refuse, b"408 Request Timeout")

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _refuse(self, status: bytes) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()


def serve(*, host: str, port: int, workers: int) -> None:
    import uvicorn

    settings = get_settings()
    uvicorn.run(
        "service.main:app",
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        proxy_headers=True,
        access_log=False,
        http="service.server:GuardedHttpToolsProtocol",
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=5,
    )

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

from service.settings import get_settings

MAX_HEADER_BYTES = 64 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size limit on each request's headers, and
    a deadline on a body that is still coming after its answer was sent (a 401 or 413 before an
    upload is read): past it the connection is closed (uvicorn would wait for that body for ever)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = get_settings().header_timeout_seconds
        self.guard: asyncio.TimerHandle | None = None
        self.header_bytes: int | None = 0  # None once the request's headers are complete
        self.body_coming = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(b"408 Request Timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_bytes is not None:
            self.header_bytes += len(data)
        super().data_received(data)
        # Still in the headers after this chunk (one that completes them may bring a body too).
        if self.header_bytes is not None and self.header_bytes > MAX_HEADER_BYTES:
            self._refuse(b"431 Request Header Fields Too Large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_bytes is None:  # the next request on a kept-alive connection: its headers count
            self.header_bytes = 0
        if self.guard is None:
            self._arm(b"408 Request Timeout")

    def on_headers_complete(self) -> None:
        self._disarm()
        self.header_bytes = None  # the body is not counted (an answer may come before it is all sent)
        self.body_coming = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.body_coming = False
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and self.guard is not None:
            # The body of an answered request is in: kept alive from now, as after any response.
            self._disarm()
            if self.timeout_keep_alive_task is None and not self.pipeline and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.body_coming and not self.transport.is_closing():
            self._arm(None)  # answered already: the rest of the body has until the deadline

    def _arm(self, status: bytes | None) -> None:
        self._disarm()
        self.guard = self.loop.call_later(self.header_timeout, self._refuse, status)

    def _disarm(self) -> None:
        if self.guard is not None:
            self.guard.cancel()
            self.guard = None

    def _refuse(self, status: bytes | None) -> None:
        """Answer ``status`` (None: nothing more to say) and close the connection."""
        self._disarm()
        if not self.transport.is_closing():
            if status is not None:
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

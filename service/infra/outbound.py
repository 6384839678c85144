"""The one client for every request the server sends to an address a user chose (webhooks, http
graders; tool calls when they come): a total wall-clock deadline per attempt, and the connection made
to the address that was checked.

**One deadline for the whole attempt.** httpx's time-outs bound each phase's silence, so a receiver
that sends its status line a byte every few seconds is never timed out: it held an API thread or a
sender for minutes. Here one deadline covers all of it: the name's lookup, the connection, TLS, the
request, the status line, the headers and whatever of the body is read. Sockets are non-blocking and
every wait is a ``select`` bounded by what is left, so no byte pattern of the receiver's stretches an
attempt past its deadline (tested against receivers that trickle each phase). ``within(seconds)``
sets a deadline for a whole piece of work (a dry run, an evaluation): no call inside it lasts past
it, whatever the call's own.

**The address checked is the address connected to.** The host is looked up once, each address is
judged by the caller's rule (``service.infra.egress.public_address`` for webhooks), and the socket connects
to an address so judged, while TLS checks the certificate against the host's name: a DNS answer that
changes between the check and the connection (rebinding) cannot reach a private address.

HTTP/1.1 is spoken by ``httpcore`` (httpx's own engine) over these sockets; no redirect is followed,
nothing is retried here (callers decide), no connection is kept for another call.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import ipaddress
import math
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpcore

AddressRule = Callable[[str], str | None]
"""Given an address a host resolved to, why it may not be reached (None: it may)."""

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("outbound_deadline", default=None)


class OutboundError(Exception):
    """No usable answer: ``reason`` says why, fit to show the user (no secret of the URL in it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Unreachable(OutboundError):
    """No answer in time, a connection refused or broken, or every address refused by the rule."""


class TooLarge(OutboundError):
    """The answer's body was longer than the caller reads."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes  # what was read of it (nothing when the caller reads no body)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """No outbound call in this context lasts past ``seconds`` from now (nor past an outer limit)."""
    end = time.monotonic() + seconds
    outer = _DEADLINE.get()
    token = _DEADLINE.set(end if outer is None else min(outer, end))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def seconds_left(default: float) -> float:
    """``default``, or less where an outer ``within`` ends sooner (0 when it has ended)."""
    outer = _DEADLINE.get()
    return default if outer is None else max(0.0, min(default, outer - time.monotonic()))


def post(
    url: str,
    content: bytes,
    *,
    headers: Mapping[str, str],
    seconds: float,
    max_body: int = 0,
    addresses: AddressRule | None = None,
) -> Reply:
    """POST ``content`` to ``url`` and read the answer's status (and up to ``max_body`` bytes of its
    body; 0 reads none), all within ``seconds`` (or less: ``within``). Raises ``Unreachable`` or
    ``TooLarge``; any status is a ``Reply``."""
    budget = seconds_left(seconds)
    if budget <= 0:
        raise Unreachable("the time this work was given has run out")
    end = time.monotonic() + budget
    backend = _DeadlineBackend(end, addresses)
    try:
        wire = _encoded(url)
        with (
            httpcore.ConnectionPool(network_backend=backend, ssl_context=_tls(), retries=0, max_connections=1) as pool,
            pool.stream("POST", wire, headers=list(headers.items()), content=content) as answer,
        ):
            body = _read_body(answer, max_body) if max_body else b""
            return Reply(answer.status, body)
    except OutboundError:
        raise
    except httpcore.TimeoutException:
        raise Unreachable(f"no answer within {budget:.3g} s") from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as exc:
        raise Unreachable(str(exc) or type(exc).__name__) from None
    except OSError as exc:
        raise Unreachable(_describe(exc)) from None
    except (ValueError, TypeError) as exc:  # a URL httpcore cannot take (a port out of range)
        raise Unreachable(f"the URL cannot be used ({exc})") from None


def _encoded(url: str) -> str:
    """``url`` as it goes on the wire: an international host in IDNA, the path and query
    percent-encoded (httpcore takes ASCII alone; httpx used to do this)."""
    import httpx

    try:
        return str(httpx.URL(url))
    except httpx.InvalidURL as exc:
        raise ValueError(str(exc)) from None


def _read_body(answer: Any, limit: int) -> bytes:
    data = bytearray()
    for chunk in answer.iter_stream():
        data += chunk
        if len(data) > limit:
            raise TooLarge(f"the answer is longer than {limit} bytes")
    return bytes(data)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_CONTEXT: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    """Certificates checked against certifi's roots (what httpx trusts), TLS 1.2 at least."""
    global _CONTEXT
    if _CONTEXT is None:
        try:
            import certifi

            context = ssl.create_default_context(cafile=certifi.where())
        except ImportError:  # pragma: no cover - certifi comes with httpx
            context = ssl.create_default_context()
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        _CONTEXT = context
    return _CONTEXT


# The sockets ----------------------------------------------------------------------------------------
def _left(end: float, what: type[Exception] = httpcore.ReadTimeout) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise what("the deadline passed")
    return left


def _ready(sock: socket.socket, *, write: bool, seconds: float) -> bool:
    """Whether ``sock`` can be read (or written) within ``seconds``: ``poll``, which takes any file
    descriptor (``select`` refuses those past 1023, which a busy API process reaches)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(math.ceil(seconds * 1000)))


def _wait(sock: socket.socket, end: float, *, write: bool, what: type[Exception]) -> None:
    if not _ready(sock, write=write, seconds=_left(end, what)):
        raise what("the deadline passed")


class _DeadlineStream(httpcore.NetworkStream):
    """A non-blocking socket (plain or TLS) whose every read and write ends by the deadline."""

    def __init__(self, sock: socket.socket, end: float) -> None:
        self.sock, self.end = sock, end

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        while True:
            try:
                return self.sock.recv(max_bytes)
            except (BlockingIOError, ssl.SSLWantReadError):
                _wait(self.sock, self.end, write=False, what=httpcore.ReadTimeout)
            except ssl.SSLWantWriteError:
                _wait(self.sock, self.end, write=True, what=httpcore.ReadTimeout)
            except OSError as exc:
                raise httpcore.ReadError(_describe(exc)) from None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        while view:
            try:
                sent = self.sock.send(view)
                view = view[sent:]
            except (BlockingIOError, ssl.SSLWantWriteError):
                _wait(self.sock, self.end, write=True, what=httpcore.WriteTimeout)
            except ssl.SSLWantReadError:
                _wait(self.sock, self.end, write=False, what=httpcore.WriteTimeout)
            except OSError as exc:
                raise httpcore.WriteError(_describe(exc)) from None

    def close(self) -> None:
        self.sock.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        try:
            tls = ssl_context.wrap_socket(self.sock, server_hostname=server_hostname, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            self.close()
            raise httpcore.ConnectError(_describe(exc)) from None
        while True:
            try:
                tls.do_handshake()
                return _DeadlineStream(tls, self.end)
            except ssl.SSLWantReadError:
                self._wait_or_close(tls, write=False)
            except ssl.SSLWantWriteError:
                self._wait_or_close(tls, write=True)
            except (OSError, ValueError) as exc:  # a bad certificate, a reset
                tls.close()
                raise httpcore.ConnectError(_describe(exc)) from None

    def _wait_or_close(self, tls: ssl.SSLSocket, *, write: bool) -> None:
        try:
            _wait(tls, self.end, write=write, what=httpcore.ConnectTimeout)
        except httpcore.ConnectTimeout:
            tls.close()
            raise

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object" and isinstance(self.sock, ssl.SSLSocket):
            return self.sock._sslobj  # type: ignore[attr-defined]
        if info == "server_addr":
            return self.sock.getpeername()
        if info == "socket":
            return self.sock
        if info == "is_readable":
            return _ready(self.sock, write=False, seconds=0)
        return None


class _DeadlineBackend(httpcore.NetworkBackend):
    """Connections for one attempt: the host looked up once, each address judged, a non-blocking
    connect to the first admitted one that answers, all by the attempt's deadline."""

    def __init__(self, end: float, rule: AddressRule | None) -> None:
        self.end, self.rule = end, rule

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        addresses = _lookup(host, port, self.end)
        judged = [(family, a, self.rule(a) if self.rule else None) for family, a in addresses]
        admitted = [(family, a) for family, a, why in judged if why is None]
        if not admitted:
            refusals = [why for _, _, why in judged if why]
            raise Unreachable(refusals[0] if refusals else f"the host {host!r} has no address")
        problem = ""
        for family, address in admitted:
            try:
                return _DeadlineStream(_connect(family, address, port, self.end), self.end)
            except httpcore.ConnectTimeout:
                raise
            except OSError as exc:
                problem = exc.strerror or str(exc)
        raise httpcore.ConnectError(f"could not connect ({problem})")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _connect(family: int, address: str, port: int, end: float) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex((address, port))
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            raise OSError(code, f"{address} port {port}: {os.strerror(code)}")
        if code:
            _wait(sock, end, write=True, what=httpcore.ConnectTimeout)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise OSError(error, f"{address} port {port}: {os.strerror(error)}")
        return sock
    except BaseException:
        sock.close()
        raise


def lookup(host: str, port: int, *, seconds: float) -> list[str]:
    """The addresses ``host`` resolves to, within ``seconds`` (``OSError`` past them, or when it does
    not resolve): a registration's check of a URL, bounded as a send is."""
    try:
        return [address for _, address in _lookup(host, port, time.monotonic() + seconds)]
    except httpcore.ConnectTimeout:
        raise OSError(f"no answer from the name servers within {seconds:g} s") from None
    except Unreachable as exc:
        raise OSError(exc.reason) from None


LOOKUPS = 32
"""Name lookups a process runs at once: each runs on a thread the resolver's own time-outs end (a
slow name server's thread outlives the caller's deadline), so their number is bounded."""
_LOOKUPS = threading.BoundedSemaphore(LOOKUPS)


def _lookup(host: str, port: int, end: float) -> list[tuple[int, str]]:
    """(family, address) of each address ``host`` resolves to, by the deadline. A literal address is
    itself; a name is looked up in a thread of its own (the resolver's own time-outs end it later),
    so a slow name server costs the caller no more than its deadline."""
    literal = host.strip("[]")
    try:
        ip = ipaddress.ip_address(literal)
        return [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, str(ip))]
    except ValueError:
        pass
    answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
    if not _LOOKUPS.acquire(blocking=False):
        raise Unreachable(f"too many name lookups in flight in this process ({LOOKUPS}); try again shortly")

    def resolve() -> None:
        try:
            answers.put(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP))
        except (OSError, UnicodeError) as exc:  # (a label IDNA refuses: "a..b")
            answers.put(exc)
        finally:
            _LOOKUPS.release()

    threading.Thread(target=resolve, name="outbound-lookup", daemon=True).start()
    try:
        got = answers.get(timeout=_left(end, httpcore.ConnectTimeout))
    except queue.Empty:
        raise httpcore.ConnectTimeout(f"looking up {host!r} took past the deadline") from None
    if isinstance(got, OSError):
        raise Unreachable(f"the host {host!r} does not resolve ({got.strerror or got})")
    if isinstance(got, UnicodeError):
        raise Unreachable(f"the host {host!r} is not a name that resolves ({got})")
    seen: dict[str, int] = {}
    for family, _, _, _, sockaddr in got:
        seen.setdefault(str(sockaddr[0]), family)
    return [(family, address) for address, family in seen.items()]


# Sends an API process makes for a request ---------------------------------------------------------
class Busy(Exception):
    """The key has its share of sends running already."""


class Lanes:
    """Blocking outbound work an API process does for requests (a webhook's test event, a URL's
    lookup), off the threads that run routes: at most ``per_key`` at once for one key (past that,
    ``Busy``: the caller answers 429), ``total`` at once in all (the rest wait their turn on the event
    loop, holding no thread). Each piece is bounded by its own deadline, so a turn comes soon."""

    def __init__(self, *, total: int, per_key: int) -> None:
        self.total, self.per_key = total, per_key
        self.running: dict[str, int] = {}
        self._limiter: Any = None

    async def run(self, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        import anyio

        if self.running.get(key, 0) >= self.per_key:
            raise Busy()
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.total)
        self.running[key] = self.running.get(key, 0) + 1
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            self.running[key] -= 1
            if not self.running[key]:
                del self.running[key]

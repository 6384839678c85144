"""The shared outbound client (``service.infra.outbound``): one deadline for the whole attempt, whatever the
receiver trickles (status line, headers, body, TLS handshake) or a name server withholds; the address
judged is the address connected to; TLS checked against the host's name; ``within`` bounds a whole
piece of work; ``Lanes`` keep a key to its share. Every server here listens on loopback."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from service.infra import egress, outbound

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n"


def read_request(conn: socket.socket) -> bytes:
    """The whole request (headers and the body they announce): a server that answers and closes with
    some of it unread resets the connection, and the client may lose the answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return data


class RawServer:
    """A TCP server on loopback that runs ``behave(conn)`` for each connection it accepts."""

    def __init__(self, behave: Callable[[socket.socket], None], *, tls: ssl.SSLContext | None = None) -> None:
        self.accepted = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.tls = tls

        def loop() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.accepted += 1
                threading.Thread(target=self._one, args=(behave, conn), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()

    def _one(self, behave: Callable[[socket.socket], None], conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            behave(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server() -> Iterator[Callable[..., RawServer]]:
    made: list[RawServer] = []

    def make(behave: Callable[[socket.socket], None], **kwargs: object) -> RawServer:
        made.append(RawServer(behave, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for s in made:
        s.close()


def trickle(data: bytes, every: float = 0.1, *, head: bytes = b"") -> Callable[[socket.socket], None]:
    def behave(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(head)
        for byte in data:
            conn.sendall(bytes([byte]))
            time.sleep(every)

    return behave


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.monotonic()
    try:
        result: object = fn()
    except outbound.OutboundError as exc:
        result = exc
    return result, time.monotonic() - t0


# The deadline ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "behave",
    [
        trickle(HEAD + b"ok"),  # the status line a byte at a time
        trickle(b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"),  # the headers
        lambda conn: time.sleep(5),  # silence after the connection
    ],
    ids=["status line", "headers", "silence"],
)
def test_an_attempt_ends_at_its_deadline_whatever_the_receiver_trickles(server, behave) -> None:
    s = server(behave)
    got, took = timed(lambda: outbound.post(f"http://127.0.0.1:{s.port}/x", b"{}", headers={}, seconds=0.5))
    assert isinstance(got, outbound.Unreachable) and "no answer within 0.5 s" in got.reason
    assert 0.45 < took < 2.0  # a trickle would take seconds more


def test_a_trickled_body_ends_at_the_deadline_when_it_is_read(server) -> None:
    s = server(trickle(b"x" * 100, every=0.02, head=b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"))
    url = f"http://127.0.0.1:{s.port}/x"
    got, took = timed(lambda: outbound.post(url, b"{}", headers={}, seconds=0.5, max_body=1000))
    assert isinstance(got, outbound.Unreachable) and 0.45 < took < 2.0
    got, took = timed(lambda: outbound.post(url, b"{}", headers={}, seconds=0.5))  # the body is not read
    assert isinstance(got, outbound.Reply) and got.status == 200 and took < 1.5


def test_a_trickled_tls_handshake_ends_at_the_deadline(server) -> None:
    def behave(conn: socket.socket) -> None:
        conn.recv(65536)  # the ClientHello
        for byte in b"\x16\x03\x03\x00\x40" + b"\x02" * 64:  # a ServerHello's record, a byte at a time
            conn.sendall(bytes([byte]))
            time.sleep(0.1)

    s = server(behave)
    got, took = timed(lambda: outbound.post(f"https://127.0.0.1:{s.port}/x", b"{}", headers={}, seconds=0.5))
    assert isinstance(got, outbound.Unreachable) and 0.45 < took < 2.0


def test_a_name_server_that_never_answers_costs_the_deadline(monkeypatch) -> None:
    def slow(*args: object, **kwargs: object) -> list[object]:
        time.sleep(10)
        return []

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    got, took = timed(lambda: outbound.post("http://hooks.invalid/x", b"{}", headers={}, seconds=0.3))
    assert isinstance(got, outbound.Unreachable) and took < 2.0
    t0 = time.monotonic()
    with pytest.raises(OSError, match="within 0.3 s"):
        outbound.lookup("hooks.invalid", 443, seconds=0.3)
    assert time.monotonic() - t0 < 2.0


def test_within_bounds_every_call_inside_it(server) -> None:
    s = server(lambda conn: time.sleep(5))
    url = f"http://127.0.0.1:{s.port}/x"
    with outbound.within(0.4):
        got, took = timed(lambda: outbound.post(url, b"{}", headers={}, seconds=30))
        assert isinstance(got, outbound.Unreachable) and took < 2.0
        got, took = timed(lambda: outbound.post(url, b"{}", headers={}, seconds=30))
        assert isinstance(got, outbound.Unreachable) and "run out" in got.reason and took < 0.5
    assert outbound.seconds_left(7.0) == 7.0


def test_an_answer_longer_than_the_caller_reads_is_too_large(server) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789"
    s = server(lambda conn: (read_request(conn), conn.sendall(answer)))
    with pytest.raises(outbound.TooLarge):
        outbound.post(f"http://127.0.0.1:{s.port}/x", b"{}", headers={}, seconds=2, max_body=4)


def test_an_international_url_is_sent_encoded(server) -> None:
    """httpcore takes ASCII alone: a path (or host) in another script was a TypeError, a 500."""
    seen: list[bytes] = []

    def behave(conn: socket.socket) -> None:
        seen.append(read_request(conn))
        conn.sendall(HEAD + b"ok")

    s = server(behave)
    reply = outbound.post(f"http://127.0.0.1:{s.port}/hööks?ü=1", b"{}", headers={}, seconds=2)
    assert reply.status == 200 and seen[0].startswith(b"POST /h%C3%B6%C3%B6ks?%C3%BC=1 HTTP/1.1")
    with pytest.raises(outbound.Unreachable, match="cannot be used"):
        outbound.post("http://[::1/x", b"{}", headers={}, seconds=2)


def test_a_socket_past_file_descriptor_1023_is_waited_on(server) -> None:
    """select() refuses descriptors past 1023, which a busy API process reaches: every send failed."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("the hard limit on open files is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        s = server(trickle(HEAD + b"ok", every=0.001))
        assert outbound.post(f"http://127.0.0.1:{s.port}/x", b"{}", headers={}, seconds=5).status == 200
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_name_lookups_in_flight_are_bounded(monkeypatch) -> None:
    """Each lookup runs on a thread its resolver ends (past the caller's deadline): a slow name
    server could pile them up without end."""
    release = threading.Event()

    def stuck(*args: object, **kwargs: object) -> list[object]:
        release.wait(10)
        return []

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    reasons = []
    try:
        for _ in range(outbound.LOOKUPS + 1):
            with pytest.raises(outbound.Unreachable) as caught:
                outbound.post("http://slow.invalid/x", b"{}", headers={}, seconds=0.01)
            reasons.append(caught.value.reason)
        lookups = [t for t in threading.enumerate() if t.name == "outbound-lookup"]
        assert len(lookups) <= outbound.LOOKUPS and "too many name lookups" in reasons[-1], reasons
    finally:
        release.set()


def test_a_closed_port_is_unreachable_at_once() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    got, took = timed(lambda: outbound.post(f"http://127.0.0.1:{port}/x", b"{}", headers={}, seconds=5))
    assert isinstance(got, outbound.Unreachable) and "could not connect" in got.reason and took < 1


# The address checked is the address connected to ------------------------------------------------------
def test_an_address_the_rule_refuses_is_never_connected_to(server) -> None:
    s = server(lambda conn: (read_request(conn), conn.sendall(HEAD + b"ok")))
    with pytest.raises(outbound.Unreachable, match="private, loopback or link-local"):
        outbound.post(f"http://127.0.0.1:{s.port}/x", b"{}", headers={}, seconds=2, addresses=egress.public_address)
    time.sleep(0.1)
    assert s.accepted == 0


def test_a_name_is_looked_up_once_and_its_checked_address_used(server, monkeypatch) -> None:
    """DNS rebinding: a name that answers a public address to the check and loopback to the connection
    reached loopback when the two looked it up apart. Here there is one lookup, and its answer is judged."""
    s = server(lambda conn: (read_request(conn), conn.sendall(HEAD + b"ok")))
    answers = iter(["127.0.0.1", "93.184.216.34"])  # the first lookup is loopback, any later one public
    calls: list[str] = []

    def rebinding(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with pytest.raises(outbound.Unreachable, match="127.0.0.1 is a private"):
        outbound.post(f"http://rebind.test:{s.port}/x", b"{}", headers={}, seconds=2, addresses=egress.public_address)
    assert calls == ["rebind.test"] and s.accepted == 0


def test_tls_is_checked_against_the_hosts_name(server, monkeypatch) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("hooks.test").configure_cert(served)
    s = server(lambda conn: (read_request(conn), conn.sendall(HEAD + b"ok")), tls=served)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    monkeypatch.setattr(outbound, "_CONTEXT", trusting)
    real = socket.getaddrinfo

    def to_loopback(host: str, port: int, *args: object, **kwargs: object) -> list[object]:
        return real("127.0.0.1", port, *args, **kwargs) if host.endswith(".test") else []  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", to_loopback)
    reply = outbound.post(f"https://hooks.test:{s.port}/x", b"{}", headers={}, seconds=3, max_body=10)
    assert reply.status == 200 and reply.body == b"ok"
    with pytest.raises(outbound.Unreachable, match="certificate|hostname"):  # the certificate names another host
        outbound.post(f"https://other.test:{s.port}/x", b"{}", headers={}, seconds=3)


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "64:ff9b:1::a00:1",  # local-use NAT64
        "2002:a00:1::",  # 6to4 of 10.0.0.1
        "::a00:1",  # IPv4-compatible 10.0.0.1
        "::127.0.0.1",
        "::ffff:0:7f00:1",  # IPv4-translated 127.0.0.1
        "::ffff:127.0.0.1",  # IPv4-mapped
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "10.1.2.3",
        "fe80::1%eth0",
    ],
)
def test_ipv6_forms_that_embed_a_private_ipv4_address_are_refused(address: str) -> None:
    assert egress.public_address(address) is not None


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700:4700::1111", "64:ff9b::5db8:d822"])
def test_public_addresses_are_admitted(address: str) -> None:
    assert egress.public_address(address) is None


# Lanes -----------------------------------------------------------------------------------------------
def test_lanes_keep_a_key_to_its_share_and_others_run_beside() -> None:
    lanes = outbound.Lanes(total=4, per_key=2)
    release = threading.Event()

    async def scenario() -> tuple[list[object], float]:
        held = [asyncio.ensure_future(lanes.run("a", release.wait, 5)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(outbound.Busy):
            await lanes.run("a", time.sleep, 0)
        t0 = time.monotonic()
        other = await lanes.run("b", lambda: "b ran")
        took = time.monotonic() - t0
        release.set()
        return [*(await asyncio.gather(*held)), other], took

    results, took = asyncio.run(scenario())
    assert results == [True, True, "b ran"] and took < 2.0  # not behind a's, which wait 5 s
    assert lanes.running == {}

"""A TCP proxy on loopback that can cut every connection through it and refuse new ones for a while
(the database host gone): the fault tests' and the soak's way to cut PostgreSQL off."""

from __future__ import annotations

import contextlib
import socket
import threading

from benchmarks.common import free_port


class TcpProxy:
    """127.0.0.1:port -> target, in a thread. ``cut()`` resets every connection and refuses new
    ones (the database host unreachable); ``restore()`` listens again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.conns: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.lock = threading.Lock()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self.lock:
            if self.listener is not None:  # shutdown wakes the accept blocked on it; close alone would not
                with contextlib.suppress(OSError):
                    self.listener.shutdown(socket.SHUT_RDWR)
                self.listener.close()
                self.listener = None
            for conn in self.conns:
                # shutdown, not just close: a close does not end a connection that a pipe thread is
                # blocked reading; linger 0 makes it a reset, as when a host goes away.
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    conn.shutdown(socket.SHUT_RDWR)
                    conn.close()
            self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self.lock:
                if self.listener is not listener:  # accepted while being cut: refuse it
                    client.close()
                    return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

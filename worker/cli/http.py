"""The client commands' side of HTTP: a server and key from the flags or the environment
(``RLOO_BASE_URL``, ``RLOO_API_KEY``), errors as one line that says what to change, and a job's
event stream followed across dropped connections (``Last-Event-ID``). Imports no torch."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import typer

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
RECONNECT_SECONDS = (0.5, 1.0, 2.0, 5.0)
"""Waits before reconnecting a dropped stream, the last repeated (for ``RECONNECT_FOR`` in all)."""
RECONNECT_FOR = 300.0


class Api:
    """The server, as the client commands talk to it."""

    def __init__(self, base_url: str | None, api_key: str | None) -> None:
        self.base_url = (base_url or os.environ.get("RLOO_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        key = api_key or os.environ.get("RLOO_API_KEY")
        if not key:
            raise typer.BadParameter("no API key: pass --api-key or set RLOO_API_KEY (rloo keys create makes one)")
        self.http = httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=httpx.Timeout(60, connect=10)
        )

    def call(self, method: str, path: str, *, patient: bool = False, **kwargs: Any) -> Any:
        """The answer's JSON; an error answer or no answer ends the command with its message.
        ``patient`` (a read while watching): no answer is tried again for ``RECONNECT_FOR``."""
        deadline = time.monotonic() + (RECONNECT_FOR if patient else 0)
        while True:
            try:
                r = self.http.request(method, path, **kwargs)
                break
            except httpx.HTTPError as exc:
                if time.monotonic() >= deadline:
                    fail(f"cannot reach {self.base_url}: {type(exc).__name__} (is `rloo up` running? --base-url?)")
                time.sleep(RECONNECT_SECONDS[-1])
        if r.is_error:
            fail(_error_line(r))
        return r.json()

    def stream(self, path: str, after: str | None = None) -> Iterator[tuple[str, Any]]:
        """The ``(id, data)`` messages of a server-sent event stream until ``[DONE]``: a dropped
        connection is opened again after the last id seen (nothing lost, nothing repeated), for up
        to ``RECONNECT_FOR`` seconds of failing to get one back."""
        last, failing_since, tries = after, None, 0
        while True:
            headers = {"Last-Event-ID": last} if last else {}
            try:
                with self.http.stream("GET", path, headers=headers, timeout=httpx.Timeout(60, read=90)) as r:
                    if r.is_error:
                        r.read()
                        fail(_error_line(r))
                    failing_since, tries = None, 0
                    for event_id, data in _messages(r.iter_lines()):
                        if data == "[DONE]":
                            return
                        last = event_id or last
                        yield event_id, json.loads(data)
            except httpx.HTTPError:
                pass  # dropped: open it again below
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > RECONNECT_FOR:
                fail(f"lost the stream from {self.base_url} for {RECONNECT_FOR:.0f} s; run the command again")
            time.sleep(RECONNECT_SECONDS[min(tries, len(RECONNECT_SECONDS) - 1)])
            tries += 1


def _messages(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    event_id, data = "", []
    for line in lines:
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield event_id, "\n".join(data)
            event_id, data = "", []


def _error_line(r: httpx.Response) -> str:
    try:
        err = r.json()["error"]
        where = f" ({err['param']})" if err.get("param") else ""
        return f"{r.status_code}: {err['message']}{where}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:300]}"


def fail(message: str, *, code: int = 1) -> Any:
    """One line on stderr, then exit ``code`` (2: the command's own input is wrong)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)

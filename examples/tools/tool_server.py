"""The calculator as a user's endpoint: what ``job_http.json``'s http tool calls.

    python examples/tools/tool_server.py --port 8765
    RLOO_TOOL_URLS='["http://127.0.0.1:8765/"]' rloo up      # the operator admits it

It answers each ``POST /calculator`` (``{"name", "arguments", "call_id", "job_id", "rollout_id",
"turn"}``, docs/tools.md) with ``{"content": result}``, or ``{"error": why}``, exactly as the
built-in calculator does, and checks the bearer secret ``job_http.json`` gives (``RLOO_EXAMPLE_TOOL_SECRET``,
``example-secret`` by default). Standard library only, on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for the built-in's code

from service.tools.builtins import calculator  # noqa: E402
from service.tools.errors import ToolFailed  # noqa: E402

SECRET = os.environ.get("RLOO_EXAMPLE_TOOL_SECRET", "example-secret")


class Calculator(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        if self.headers.get("Authorization") != f"Bearer {SECRET}":
            return self._send(401, {"error": "a bearer secret is required"})
        if self.path != "/calculator":
            return self._send(404, {"error": f"no tool at {self.path}"})
        try:
            body = json.loads(self.rfile.read(min(int(self.headers.get("Content-Length", 0)), 2**20)))
            self._send(200, {"content": calculator(body["arguments"])})
        except ToolFailed as exc:
            self._send(200, {"error": exc.message})
        except (ValueError, KeyError, TypeError):
            self._send(400, {"error": "the body must be JSON with the call's arguments"})

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def serve(port: int) -> ThreadingHTTPServer:
    """The server, bound to 127.0.0.1:``port`` (0: any free port); ``serve_forever`` it."""
    return ThreadingHTTPServer(("127.0.0.1", port), Calculator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=8765)
    server = serve(parser.parse_args().port)
    print(f"calculator at http://127.0.0.1:{server.server_port}/calculator", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

"""The route class of every /v1 router: a JSON body passes ``service.strictjson``'s door (no NaN or
infinity, no lone surrogate or NUL, no deeper than 128 levels) before FastAPI parses it, so a value
that cannot be stored or rendered is a 400 naming where it is, and never reaches the database."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from service import strictjson
from service.errors import bad_request


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            content_type = request.headers.get("content-type", "")
            if request.method in ("POST", "PUT", "PATCH") and not content_type.startswith(
                ("multipart/", "application/x-www-form-urlencoded")
            ):
                body = await request.body()
                if body:
                    try:
                        # Parsed once: Starlette's request.json() returns what it finds here.
                        request._json = strictjson.loads(body)
                    except strictjson.InvalidJSON as exc:
                        raise bad_request(f"The request body is not valid JSON: {exc.problem}.", exc.path) from None
                    except (ValueError, UnicodeDecodeError):
                        pass  # a syntax error: FastAPI's own parse reports it in the usual shape
            return await handler(request)

        return strict


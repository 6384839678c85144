"""The route class of every /v1 router: a JSON body passes ``service.core.strictjson``'s door (UTF-8, no
NaN or infinity, no lone surrogate or NUL, no deeper than 128 levels, at most 100,000 arrays and
objects and 1,000,000 values) before FastAPI parses it, so a value that cannot be stored or rendered
is a 400 naming where it is, and never reaches the database; a body past the counts is a 413 before
it is parsed. A body over ``OFF_LOOP_BYTES`` is parsed and checked on a thread (two at a time), so
no body's parsing holds the event loop."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response, params
from fastapi.routing import APIRoute

from service.api.errors import APIError
from service.core import strictjson
from service.core.errors import bad_request


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # Only routes that take a JSON body (an upload's multipart body is streamed, never read here).
        forms = any(isinstance(getattr(p, "field_info", None), params.Form) for p in self.dependant.body_params)
        if self.body_field is None or forms:
            return handler

        async def strict(request: Request) -> Response:
            content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if not content_type or content_type == "application/json" or content_type.endswith("+json"):
                body = await request.body()  # at most the JSON limit (service.api.middleware)
                if body:  # Starlette's request.json() returns it: parsed once
                    request._json = _parse(body) if len(body) <= OFF_LOOP_BYTES else await _parse_off_loop(body)
            return await handler(request)

        return strict


OFF_LOOP_BYTES = 64 * 1024
_PARSERS: Any = None


async def _parse_off_loop(body: bytes) -> Any:
    from anyio import CapacityLimiter, to_thread

    global _PARSERS
    if _PARSERS is None:
        _PARSERS = CapacityLimiter(2)
    return await to_thread.run_sync(_parse, body, limiter=_PARSERS)


def _parse(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")  # strictly: no surrogates smuggled as bytes, no UTF-16
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"The request body is not UTF-8 text (byte {exc.start + 1}); JSON is sent as UTF-8.", None
        ) from None
    try:
        return strictjson.loads(text.removeprefix("\ufeff"))  # a byte-order mark, as json.loads(bytes) skips it
    except strictjson.TooMany as exc:
        raise APIError(
            413,
            f"The request body is too large to read: {exc.problem}. Send less in one request (large data goes "
            "in an uploaded file).",
            code="request_too_large",
        ) from None
    except strictjson.InvalidJSON as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.problem}.", exc.path) from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON ({exc}).", None) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise bad_request(f"The request body has a value JSON readers refuse: {exc}.", None) from None

"""The JSON response of every handler that builds its body as plain data, and the OpenAPI answer of
the routes that stream on request."""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import Response

STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}
"""The OpenAPI answer of a route that streams on request: a JSON body, or ``text/event-stream``."""


class JSON(Response):
    """A body of plain JSON types (dicts, lists, str, numbers, None), serialized by ``json.dumps``.

    Returning a Response skips FastAPI's ``jsonable_encoder`` walk, which costs 125 µs for one job
    object and 2.5 ms for a page of 20 (the bulk of a list request). NaN is refused (it is not JSON):
    data that can hold it (metrics) is cleaned where it is written.
    """

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except (UnicodeEncodeError, ValueError):
            # A row stored before the door was shut (service.core.strictjson): a lone surrogate is
            # written as its escape, a non-finite number as null; one such object must never
            # break a page of others.
            return json.dumps(_finite(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def replayed(body: Any) -> JSON:
    """An answer stored under an Idempotency-Key (``service.jobs.idempotency``), sent again as it was."""
    return JSON(body, headers={"Idempotent-Replayed": "true"})


def page(data: list[dict[str, Any]], has_more: bool) -> JSON:
    """A list page as OpenAI answers one: ``{object, data, first_id, last_id, has_more}`` (the ids
    of the page's first and last items; null on an empty page)."""
    return JSON(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )

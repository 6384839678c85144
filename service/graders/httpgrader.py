"""The http grader's two sides: which URLs the operator admits, and the client that posts a batch.

The endpoint is the user's, so everything about the exchange is bounded: the URL must sit under one
of the operator's prefixes (``RLOO_HTTP_GRADER_URLS``), no redirect is followed, an answer is read
within ``timeout_seconds`` in all and up to 16 MiB, and a URL's credentials never reach a message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from service.egress import url_under
from service.graders.types import NAN, GraderUnavailable, HttpGrader, Sample, describe, finite_or_nan
from service.settings import redact_url

__all__ = ["HTTP_GRADER_ATTEMPTS", "HTTP_GRADER_BATCH", "HTTP_GRADER_MAX_BYTES", "grade_http", "url_under"]


HTTP_GRADER_ATTEMPTS = 3
HTTP_GRADER_BATCH = 256


def grade_http(grader: HttpGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]) -> list[float]:
    """POST the batch (in chunks of 256); a connection error, a time-out or a 5xx is retried twice
    (after 0.5 s, then 1 s); then, or on any answer that is not the scores, ``GraderUnavailable``."""
    import time

    import httpx

    scores: list[float] = []
    with httpx.Client(timeout=grader.timeout_seconds, follow_redirects=False) as client:
        for start in range(0, len(samples), HTTP_GRADER_BATCH):
            chunk = range(start, min(start + HTTP_GRADER_BATCH, len(samples)))
            body = {
                "samples": [
                    {
                        "sample": {"output_text": samples[i].output_text, "output_json": samples[i].output_json},
                        "item": dict(items[i]),
                    }
                    for i in chunk
                ]
            }
            problem = ""
            for attempt in range(HTTP_GRADER_ATTEMPTS):
                if attempt:
                    time.sleep(0.5 * attempt)
                try:
                    status, data = _post_capped(client, grader, body)
                except (httpx.HTTPError, TimeoutError) as exc:
                    problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    continue
                if status >= 500:
                    problem = f"HTTP {status}"
                    continue
                scores += _http_scores(grader, status, data, len(chunk))
                break
            else:
                raise GraderUnavailable(
                    f"http grader '{grader.name}': {redact_url(grader.url)} did not answer after "
                    f"{HTTP_GRADER_ATTEMPTS} attempts ({problem}); each waits {grader.timeout_seconds:g} s "
                    "(timeout_seconds)"
                )
    return scores


HTTP_GRADER_MAX_BYTES = 16 * 2**20


def _post_capped(client: Any, grader: HttpGrader, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST and read the answer within ``timeout_seconds`` in all (httpx's timeouts are per read, so
    a byte a second would never end) and at most 16 MiB."""
    import time

    deadline = time.monotonic() + grader.timeout_seconds
    with client.stream("POST", grader.url, json=body) as resp:
        data = bytearray()
        for chunk in resp.iter_bytes():
            data += chunk
            if len(data) > HTTP_GRADER_MAX_BYTES:
                raise GraderUnavailable(
                    f"http grader '{grader.name}': {redact_url(grader.url)} answered more than 16 MiB"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the answer took longer than {grader.timeout_seconds:g} s")
        return resp.status_code, bytes(data)


def _http_scores(grader: HttpGrader, status: int, data: bytes, n: int) -> list[float]:
    where = f"http grader '{grader.name}': {redact_url(grader.url)}"  # messages reach events and logs
    text = data[:200].decode("utf-8", errors="replace")
    if status != 200:
        raise GraderUnavailable(f"{where} answered HTTP {status}: {text}")
    try:
        scores = json.loads(data)["scores"]
    except (ValueError, KeyError, TypeError):
        raise GraderUnavailable(f'{where} must answer {{"scores": [...]}}; got {text!r}') from None
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else describe(scores)
        raise GraderUnavailable(f"{where} answered {got} for {n} samples")
    return [NAN if s is None or isinstance(s, bool) else finite_or_nan(s) for s in scores]

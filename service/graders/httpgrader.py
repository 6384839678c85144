"""The http grader's two sides: which URLs the operator admits, and the client that posts a batch.

The endpoint is the user's, so everything about the exchange is bounded: the URL must sit under one
of the operator's prefixes (``RLOO_HTTP_GRADER_URLS``), no redirect is followed, an attempt has
``timeout_seconds`` in all (lookup, connection, the status line, the answer: ``service.infra.outbound``)
and an answer is read up to 16 MiB, and a URL's credentials never reach a message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from service.core.settings import redact_url
from service.graders.types import NAN, GraderUnavailable, HttpGrader, Sample, describe, finite_or_nan
from service.infra import outbound
from service.infra.egress import url_under

__all__ = ["HTTP_GRADER_ATTEMPTS", "HTTP_GRADER_BATCH", "HTTP_GRADER_MAX_BYTES", "grade_http", "url_under"]


HTTP_GRADER_ATTEMPTS = 3
HTTP_GRADER_BATCH = 256


def grade_http(grader: HttpGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]) -> list[float]:
    """POST the batch (in chunks of 256), each attempt within ``timeout_seconds`` in all
    (``service.infra.outbound``); a connection error, a time-out or a 5xx is retried twice (after 0.5 s,
    then 1 s); then, or on any answer that is not the scores, ``GraderUnavailable``."""
    scores: list[float] = []
    for start in range(0, len(samples), HTTP_GRADER_BATCH):
        chunk = range(start, min(start + HTTP_GRADER_BATCH, len(samples)))
        body = {
            "samples": [
                {
                    "sample": samples[i].fields(),
                    "item": dict(items[i]),
                }
                for i in chunk
            ]
        }
        scores += _http_scores(grader, *_post_retried(grader, json.dumps(body).encode()), len(chunk))
    return scores


def _post_retried(grader: HttpGrader, content: bytes) -> tuple[int, bytes]:
    problem = ""
    for attempt in range(HTTP_GRADER_ATTEMPTS):
        if attempt:
            time.sleep(min(0.5 * attempt, outbound.seconds_left(0.5 * attempt)))
        try:
            reply = outbound.post(
                grader.url,
                content,
                headers={"content-type": "application/json"},
                seconds=grader.timeout_seconds,
                max_body=HTTP_GRADER_MAX_BYTES,
            )
        except outbound.TooLarge:
            raise GraderUnavailable(
                f"http grader '{grader.name}': {redact_url(grader.url)} answered more than 16 MiB"
            ) from None
        except outbound.Unreachable as exc:
            problem = redact_url(exc.reason)
            continue
        if reply.status >= 500:
            problem = f"HTTP {reply.status}"
            continue
        return reply.status, reply.body
    raise GraderUnavailable(
        f"http grader '{grader.name}': {redact_url(grader.url)} did not answer after {HTTP_GRADER_ATTEMPTS} "
        f"attempts ({problem}); each has {grader.timeout_seconds:g} s in all (timeout_seconds)"
    )


HTTP_GRADER_MAX_BYTES = 16 * 2**20


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

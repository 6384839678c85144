"""``POST /v1/chat/completions`` and ``POST /v1/completions`` in OpenAI's shapes, on base models and on
the project's fine-tuned models and checkpoints, answered by the inference workers
(``rloo worker --serve``; ``service.infra.inference_bus`` carries the request there and the tokens back).

With ``stream: true`` the answer is OpenAI's server-sent events (``chat.completion.chunk`` or
``text_completion`` objects, then ``data: [DONE]``); without, one object once the last choice ends.
Either way the HTTP status waits for the worker's first word, so a prompt past the model's context is
a 400, not an error inside a 200 stream. A client that goes away frees its place at once and the
worker drops its rows at the next token.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import redis
from fastapi import APIRouter, Request
from fastapi.responses import Response

from service import tools
from service.api.deps import ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError, error_body, status_of
from service.api.responses import JSON, STREAMED
from service.api.routing import StrictJSONRoute
from service.api.schemas.completions import ChatCompletionCreate, CompletionCreate, Sampling
from service.api.streams import EventStreamResponse
from service.core.crud import Caller
from service.core.db import run_db, session_scope
from service.core.errors import DomainError, LimitReached, bad_request, no_inference_worker
from service.core.settings import Settings
from service.infra import inference_bus, limits
from service.registry import weights
from service.tenancy import quotas, usage

router = APIRouter(prefix="/v1", route_class=StrictJSONRoute, tags=["inference"])
log = logging.getLogger("rloo.api")

FINGERPRINT = "rloo"


@router.post("/chat/completions", summary="Create a chat completion", responses=STREAMED)
async def chat_completions(
    request: Request, session: SessionDep, project: ProjectDep, settings: SettingsDep, body: ChatCompletionCreate
) -> Response:
    body.check_limits(settings)
    return await _complete(request, session, project, settings, body, ChatShape(body))


@router.post("/completions", summary="Create a text completion", responses=STREAMED)
async def completions(
    request: Request, session: SessionDep, project: ProjectDep, settings: SettingsDep, body: CompletionCreate
) -> Response:
    body.check_limits(settings)
    return await _complete(request, session, project, settings, body, TextShape(body))


# The answer's shapes ----------------------------------------------------------------------------------
class Shape:
    """How one kind of completion is written: the whole object, and a streamed chunk."""

    prefix = ""
    object = ""
    chunk_object = ""

    def __init__(self, body: Sampling) -> None:
        self.body = body
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.usage: dict[str, int] | None = None  # the worker's count, once it answered whole (metered)

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.body.model, "system_fingerprint": FINGERPRINT}

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str, first: bool, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, texts: dict[int, str], reasons: dict[int, str], usage: dict[str, int]) -> dict[str, Any]:
        choices = [self.choice(i, texts.get(i, ""), reasons.get(i)) for i in sorted(reasons)]
        return {**self.head(), "object": self.object, "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        chunk = {**self.head(), "object": self.chunk_object, "choices": choices}
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            chunk["usage"] = usage
        return chunk


class ChatShape(Shape):
    """A chat completion. When the request offered ``tools``, the worker says how the model writes a
    call (``tool_format``, from its chat template: ``service.tools.calls``) and an answer that calls
    tools is OpenAI's: ``tool_calls`` (arguments as a JSON string), ``content`` the text before them
    (null when none), ``finish_reason: tool_calls``. Streamed, text that may begin a call is held
    back until it is known, and the calls come in one chunk at the end. A call that cannot be read
    (bad JSON, no name) leaves the whole answer as text, as the model wrote it."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    tool_format: str | None = None

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": []}
        calls = self._calls(text)
        if calls is not None:
            message["content"], message["tool_calls"] = calls[0] or None, calls[1]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}

    def delta(self, index: int, text: str, first: bool, finish_reason: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def _calls(self, text: str) -> tuple[str, list[dict[str, Any]]] | None:
        if self.tool_format is None:
            return None
        turn = tools.parse(text, self.tool_format)
        if not turn.calls or any(c.error is not None for c in turn.calls):
            return None
        return turn.content, [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in turn.calls
        ]

    def held(self, text: str) -> int:
        """How much of ``text`` (a choice's answer so far) may be streamed now: all of it, unless the
        request offered tools and a call may be starting."""
        if self.tool_format is None:
            return len(text)
        if self.tool_format == "llama3":
            start = text.lstrip()
            if not start or start.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(start):
                return 0
            return len(text)
        at = text.find("<tool_call>")
        if at >= 0:
            return at
        for cut in range(min(len(text), len("<tool_call>") - 1), 0, -1):  # a tag cut between two deltas
            if "<tool_call>".startswith(text[-cut:]):
                return len(text) - cut
        return len(text)

    def ended(self, index: int, text: str, sent: int, first: bool, reason: str | None) -> list[dict[str, Any]]:
        """The last chunks of a streamed choice whose whole answer is ``text`` (``sent`` characters of
        it streamed): its calls, or the text held back."""
        calls = self._calls(text)
        if calls is None:
            return [self.delta(index, text[sent:], first, reason)]
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls[1])]
        reason = "tool_calls" if reason == "stop" else reason
        return [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}]


class TextShape(Shape):
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def delta(self, index: int, text: str, first: bool, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(index, text, finish_reason)


# Serving one request ----------------------------------------------------------------------------------
async def _complete(
    request: Request,
    session: SessionDep,
    project: Caller,
    settings: Settings,
    body: Sampling,
    shape: Shape,
) -> Response:
    served, cap = await run_db(
        session,
        lambda: (
            weights.resolve(session, settings, project_seq=project.seq, name=body.model),
            quotas.limit_of(session, project.seq, "inference_tokens_per_minute"),
        ),
    )
    body.check_context(await anyio.to_thread.run_sync(_servable_context, served, body.model))
    ns = inference_bus.namespace(inference_bus.serve_queue())
    rid, key, tokens = shape.id, project.key_id or project.id, body.budget(settings)
    deadline = time.time() + settings.inference_timeout_seconds
    await _within_token_quota(request, project, cap, tokens)
    conn = inference_bus.connect_async()
    admitted = answered = handed = False
    try:
        await _admit(conn, ns, settings, key=key, rid=rid, tokens=tokens, deadline=deadline)
        admitted = True
        envelope = {
            "id": rid,
            "project": project.id,
            "key": key,
            "deadline": deadline,
            "servable": served,
            **body.wire(),
        }
        await inference_bus.submit(conn, ns, envelope)

        async def wanted() -> bool:  # a client that left while its request waited frees its place
            return not await request.is_disconnected()

        messages = inference_bus.replies(conn, ns, rid, deadline, wanted=wanted).__aiter__()
        first = await _next(messages, settings)
        if first["t"] == "error":
            answered = True
            raise _error(first)
        if isinstance(shape, ChatShape):
            shape.tool_format = first.get("tool_format")  # set when the request offered tools
        if body.stream:
            handed = True  # the stream lets it go when it ends
            return EventStreamResponse(
                _closing(_stream(shape, messages, settings), conn, ns, key, rid, tokens, _meter(project, shape)),
                send_timeout=settings.stream_send_timeout_seconds,
                on_close=_nothing,
            )
        whole = await _collect(shape, messages, settings)
        answered = True
        await _meter(project, shape)()
        return JSON(whole)
    except inference_bus.ClientGone:
        return Response(status_code=499)  # nobody reads it; the finally lets the request go
    except redis.RedisError as exc:
        raise APIError(
            503,
            f"The queue (Redis) is unreachable ({type(exc).__name__}); retry in a few seconds.",
            code="queue_unavailable",
            headers={"Retry-After": "2"},
        ) from None
    finally:
        if not handed:
            await _let_go(conn, ns, key, rid, tokens, admitted=admitted, cancel=admitted and not answered)


def _servable_context(served: dict[str, Any], name: str) -> int | None:
    """What ``name`` serves checked fit to write text, and its context length (on a thread: it reads
    the model's files, on any database)."""
    weights.check_servable(served, name)
    return weights.context_of(served)


async def _admit(conn: Any, ns: str, settings: Settings, *, key: str, rid: str, tokens: int, deadline: float) -> None:
    try:
        await inference_bus.admit(
            conn,
            ns,
            key=key,
            rid=rid,
            tokens=tokens,
            deadline=deadline,
            cap=settings.inference_max_concurrent,
            token_cap=settings.inference_max_tokens_in_flight,
        )
    except inference_bus.NoWorker:
        raise no_inference_worker("No inference worker is running") from None
    except inference_bus.Refused as refused:
        limit = (
            f"{settings.inference_max_concurrent} requests in flight (RLOO_INFERENCE_MAX_CONCURRENT)"
            if refused.what == "requests"
            else f"{settings.inference_max_tokens_in_flight} tokens in flight, max_tokens times n "
            "(RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT)"
        )
        raise APIError(
            429,
            f"This key is at its limit of {limit}; wait for a request to end, or ask for fewer tokens.",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        ) from None


async def _next(messages: AsyncIterator[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    try:
        return await messages.__anext__()
    except inference_bus.WorkerLost:
        raise _error(inference_bus.lost_message()) from None
    except inference_bus.TimedOut:
        raise APIError(
            504,
            f"The request took longer than {settings.inference_timeout_seconds:g} s (RLOO_INFERENCE_TIMEOUT_SECONDS); "
            "ask for fewer tokens, or send it again when the workers are less busy.",
            code="timeout",
        ) from None


def _error(message: dict[str, Any]) -> APIError:
    status = int(message["status"])
    return APIError(
        status,
        message["message"],
        param=message.get("param"),
        code=message["code"],
        headers={"Retry-After": "1"} if status == 503 else None,
    )


async def _collect(shape: Shape, messages: AsyncIterator[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    while True:
        message = await _next(messages, settings)
        kind = message["t"]
        if kind == "delta":
            texts[message["i"]] = texts.get(message["i"], "") + message["text"]
        elif kind == "end":
            reasons[message["i"]] = message["finish_reason"]
        elif kind == "error":
            raise _error(message)
        elif kind == "done":
            shape.usage = message["usage"]
            return shape.whole(texts, reasons, message["usage"])


def _stream_choices(
    shape: Shape, message: dict[str, Any], texts: dict[int, str], sent: dict[int, int], started: set[int]
) -> list[dict[str, Any]]:
    """A worker's delta or end of one choice as the chunks' choices to send now: the text, or with
    tools offered what of it cannot be the start of a call (``ChatShape.held``), then the calls."""
    index, reason = message["i"], message.get("finish_reason")
    texts[index] = texts.get(index, "") + message.get("text", "")
    first = index not in started
    if isinstance(shape, ChatShape) and shape.tool_format is not None:
        if message["t"] == "end":
            out = shape.ended(index, texts[index], sent.get(index, 0), first, reason)
        else:
            done, upto = sent.get(index, 0), max(shape.held(texts[index]), sent.get(index, 0))
            out = [shape.delta(index, texts[index][done:upto], first, None)] if upto > done or first else []
            sent[index] = upto
    else:
        out = [shape.delta(index, message.get("text", ""), first, reason)]
    if out:
        started.add(index)
    return out


async def _stream(shape: Shape, messages: AsyncIterator[dict[str, Any]], settings: Settings) -> AsyncIterator[bytes]:
    started: set[int] = set()
    texts: dict[int, str] = {}
    sent: dict[int, int] = {}
    while True:
        try:
            message = await _next(messages, settings)
        except DomainError as exc:  # after the 200: OpenAI's way, an error object in the stream
            yield _event(error_body(status_of(exc), exc.message, exc.param, exc.code))
            return
        kind = message["t"]
        if kind in ("delta", "end"):
            for choice in _stream_choices(shape, message, texts, sent, started):
                yield _event(shape.chunk([choice]))
        elif kind == "error":
            yield _event(error_body(int(message["status"]), message["message"], message.get("param"), message["code"]))
            return
        elif kind == "done":
            shape.usage = message["usage"]
            if shape.body.stream_options is not None and shape.body.stream_options.include_usage:
                yield _event(shape.chunk([], message["usage"]))
            yield b"data: [DONE]\n\n"
            return


async def _closing(
    stream: AsyncIterator[bytes], conn: Any, ns: str, key: str, rid: str, tokens: int, meter: Callable[[], Any]
) -> AsyncIterator[bytes]:
    """``stream``, then the request let go: the worker told to drop it if it did not end (the client
    went away), the key's place given back, in every case; what it used metered."""
    ended = False
    try:
        async for item in stream:
            yield item
        ended = True
    finally:
        await _let_go(conn, ns, key, rid, tokens, admitted=True, cancel=not ended)
        with anyio.CancelScope(shield=True):
            await meter()


async def _within_token_quota(request: Request, project: Caller, cap: float | None, tokens: int) -> None:
    """The project's quota of inference tokens a minute (``inference_tokens_per_minute``: ``cap``, None
    for none), counted in Redis over every API process with what a request may use at most (its prompt
    and max_tokens times n): past it a 429 naming the quota and when it frees up."""
    if cap is None:
        return
    if tokens > cap:
        raise bad_request(
            f"This request may use up to {tokens} tokens (its prompt and max_tokens times n), more than the "
            f"project's quota of inference_tokens_per_minute ({int(cap)}); ask for fewer.",
            "max_tokens",
        )
    answer = await request.app.state.limits.rate(
        "inference_tokens", project.id, rate=cap / 60, burst=int(cap), cost=tokens, now=limits.clock()
    )
    if answer is not None and not answer[0]:
        raise LimitReached(
            f"This project is at its quota of inference_tokens_per_minute ({int(cap)}); this request may use "
            f"up to {tokens} tokens, which free up in {answer[2]:.1f} s.",
            code="quota_exceeded",
            retry_after=max(1.0, answer[2]),
        )


def _meter(project: Caller, shape: Shape) -> Callable[[], Any]:
    """What writes the completion's tokens (once the worker counted them) into the project's usage."""

    async def meter() -> None:
        used = shape.usage
        if not used:
            return
        total = int(used.get("prompt_tokens", 0)) + int(used.get("completion_tokens", 0))

        def write() -> None:
            with session_scope() as session:
                subject = f"inference:{project.key_id or project.id}"
                usage.add(session, project_seq=project.seq, subject=subject, kind="inference_tokens", amount=total)
                session.commit()

        try:
            await anyio.to_thread.run_sync(write)
        except Exception as exc:  # the answer stands; a lost meter reading is logged
            logging.getLogger("rloo.usage").warning("inference usage of %s not written: %s", project.id, exc)

    return meter


async def _let_go(conn: Any, ns: str, key: str, rid: str, tokens: int, *, admitted: bool, cancel: bool) -> None:
    """The key's place given back (when it was taken), the worker told to drop the request when it
    did not end (the client went away, the API gave up), the connection closed. Shielded: a client
    that went away cancels the request."""
    with anyio.CancelScope(shield=True):
        try:
            if cancel:
                await inference_bus.cancel(conn, ns, rid)
            if admitted:
                await inference_bus.release(conn, ns, key=key, rid=rid, tokens=tokens)
        except redis.RedisError as exc:  # the entry expires at its deadline anyway
            log.warning("could not let request %s go: %s", rid, exc)
        finally:
            await conn.aclose()


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _nothing() -> None:
    """A completion's stream holds no lease (its admission is the inference bus's)."""

"""Chat completions that call tools: an answer in the template's call format comes back as OpenAI's
``tool_calls`` (whole and streamed), read by the real ``openai`` SDK's types; text that is not a
call, or a call that cannot be read, stays text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from service.api.routes.completions import ChatShape, _stream_choices
from service.api.schemas.completions import ChatCompletionCreate
from service.tools.calls import written

CALL = written([("calculator", {"expression": "12*7"}), ("lookup", {"key": "a"})], "hermes")


def shape(tool_format: str | None = "hermes") -> ChatShape:
    body = ChatCompletionCreate.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    out = ChatShape(body)
    out.tool_format = tool_format
    return out


def whole(s: ChatShape, text: str) -> ChatCompletion:
    answer = s.whole({0: text}, {0: "stop"}, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    return ChatCompletion.model_validate(answer)


def test_an_answer_that_calls_tools_is_openais_tool_calls() -> None:
    answer = whole(shape(), "Let me compute." + CALL)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "12*7"}),
        ("lookup", {"key": "a"}),
    ]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    only = whole(shape(), CALL).choices[0].message
    assert only.content is None and only.tool_calls


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [
        (None, CALL),  # no tools offered: text
        ("hermes", "84"),
        ("hermes", '<tool_call>{"name": "calculator", "arguments": {bad}}</tool_call>'),  # unreadable: text
        ("llama3", "The answer is 84."),
    ],
)
def test_what_is_not_a_readable_call_stays_text(tool_format: str | None, text: str) -> None:
    choice = whole(shape(tool_format), text).choices[0]
    assert choice.message.content == text and choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_llama3_calls() -> None:
    text = written([("calculator", {"expression": "1+1"})], "llama3")
    calls = whole(shape("llama3"), text).choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "1+1"})
    ]


def stream(s: ChatShape, pieces: list[str]) -> list[ChatCompletionChunk]:
    texts: dict[int, str] = {}
    sent: dict[int, int] = {}
    started: set[int] = set()
    messages: list[dict[str, Any]] = [{"t": "delta", "i": 0, "text": p} for p in pieces]
    messages.append({"t": "end", "i": 0, "finish_reason": "stop"})
    chunks = []
    for message in messages:
        for choice in _stream_choices(s, message, texts, sent, started):
            chunks.append(ChatCompletionChunk.model_validate(s.chunk([choice])))
    return chunks


def test_a_streamed_call_is_held_back_then_sent_whole() -> None:
    text = "Let me compute." + CALL
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]  # the tag cut between deltas
    chunks = stream(shape(), pieces)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Let me compute."  # no piece of the call leaked as text
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls"
    calls = last.delta.tool_calls or []
    assert [(c.index, c.function.name if c.function else None) for c in calls] == [(0, "calculator"), (1, "lookup")]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_a_streamed_answer_without_a_call_is_all_its_text() -> None:
    text = "84 is 12 < 13 and <tool" + "x"
    chunks = stream(shape(), [text[:10], text[10:20], text[20:]])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = stream(shape(None), ["a", "b"])
    assert "".join(c.choices[0].delta.content or "" for c in plain) == "ab"


def test_tool_choice_none_offers_no_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert ChatCompletionCreate.model_validate(base).wire()["tools"] == tools
    assert ChatCompletionCreate.model_validate({**base, "tool_choice": "none"}).wire()["tools"] is None

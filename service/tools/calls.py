"""Tool calls as a model writes them, read back: the formats of the chat templates that have one,
and ours for those that have none.

* ``hermes`` (Hermes, Qwen 2.5/3, and the default: the tiny models' template writes it):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, after the text.
* ``llama3`` (Llama 3.1-3.3's JSON tool calling): the whole message is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` taken too), optionally after
  ``<|python_tag|>``, or several separated by ``;``.

``parse`` never raises: a call that cannot be read (bad JSON, no name, arguments not an object) is a
``Call`` with its ``error``, which the model is answered and the metrics count as malformed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    """One call: the tool's ``name`` and its ``arguments``, or why it could not be read (``error``)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


@dataclass(frozen=True)
class Turn:
    """An assistant turn read: its text without the calls (``content``) and the calls."""

    content: str
    calls: list[Call]


def template_format(chat_template: str | None) -> str:
    """The call format a chat template writes: ``llama3`` for Llama 3.x's, else ``hermes``."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def parse(text: str, call_format: str) -> Turn:
    """The calls of ``text`` in ``call_format`` (``hermes`` or ``llama3``)."""
    return _parse_llama3(text) if call_format == "llama3" else _parse_hermes(text)


def _parse_hermes(text: str) -> Turn:
    first = text.find("<tool_call>")
    if first < 0:
        return Turn(text, [])
    calls = []
    for match in _HERMES.finditer(text, first):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(Call("", error="the <tool_call> is not closed with </tool_call>", raw=body))
            continue
        calls.append(_from_json(body, arguments_key="arguments"))
    return Turn(text[:first].strip(), calls)


def _parse_llama3(text: str) -> Turn:
    tagged = text.strip().startswith("<|python_tag|>")
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{") or (not tagged and not _names_a_tool(body)):
        return Turn(text, [])  # a JSON answer that names no tool is an answer
    return Turn("", [_from_json(part, arguments_key="parameters") for part in _json_objects(body)])


def _names_a_tool(body: str) -> bool:
    """Whether ``body`` (JSON, or the start of some) reads as a call: a ``"name"`` key in its first
    object, or JSON that does not parse (a call gone wrong, answered as malformed)."""
    try:
        first, _ = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError):
        return True
    return isinstance(first, dict) and "name" in first


def _json_objects(body: str) -> list[str]:
    """``body`` split into its JSON objects (separated by ``;`` or white space); what cannot be read
    as one is the last part, whole, so that its call says why."""
    decoder, parts, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            parts.append(body[pos:])
            break
        parts.append(body[pos:end])
        pos = end
        while pos < len(body) and body[pos] in "; \t\r\n":
            pos += 1
    return parts


def _from_json(body: str, *, arguments_key: str) -> Call:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return Call("", error=f"the call is not JSON ({exc.msg} at character {exc.pos})", raw=body)
    except RecursionError:
        return Call("", error="the call's JSON nests too deep", raw=body[:200])
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return Call("", error='a call is a JSON object with a "name" and its "arguments"', raw=body)
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters", {})))
    if isinstance(arguments, str):  # OpenAI's form: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return Call(data["name"], error="the call's arguments are a string that is not JSON", raw=body)
    if not isinstance(arguments, dict):
        return Call(data["name"], error="the call's arguments must be a JSON object", raw=body)
    return Call(data["name"], arguments, raw=body)


def written(calls: list[tuple[str, dict[str, Any]]], call_format: str) -> str:
    """Calls written as a model of ``call_format`` writes them (for worked examples and tests)."""
    if call_format == "llama3":
        return ";".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)

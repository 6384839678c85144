"""A reinforcement job's tools and the limits of its multi-turn rollouts, parsed and checked: what
``POST /v1/fine_tuning/jobs`` refuses (a 400 naming the field) and what the worker reads again.

A tool is OpenAI's function tool (``type: "function"``, ``name``, ``description``, JSON-Schema
``parameters``; the Chat Completions form ``{type, function: {...}}`` is taken too) plus where it
runs, ``runtime``:

* ``{"type": "builtin"}``: one of ours, by name (``calculator``), deterministic and in-process;
* ``{"type": "http", "url": ..., "secret": ..., "timeout_seconds": ...}``: the user's endpoint, under
  one of the operator's ``RLOO_TOOL_URLS`` prefixes (``service.tools.runtime`` says what it is sent).

A dataset line may carry ``tools`` (OpenAI's supervised format): the tools that line offers, each
named as one of the job's (the job says where a tool runs; a line cannot).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field

from service.core import jsonschemas
from service.core.validation import Strict
from service.tools.builtins import BUILTINS
from service.tools.errors import ToolSpecError

MAX_TOOLS = 32
MAX_SCHEMA_BYTES = 16_384
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
CALL_FORMATS = ("auto", "hermes", "llama3")


class MultiTurn(Strict):
    """The limits of a rollout that calls tools (``method.reinforcement.multi_turn``)."""

    max_turns: int = Field(4, ge=1, le=64, description="Assistant turns a rollout takes at most.")
    max_tool_calls: int = Field(8, ge=0, le=256, description="Tool calls a rollout makes at most (all turns).")
    max_trajectory_tokens: int | None = Field(
        None,
        ge=2,
        le=1_048_576,
        description="Tokens of the whole trajectory (prompt, every turn, every tool result); none: the model's "
        "context.",
    )
    tool_timeout_seconds: float = Field(10.0, gt=0, le=300, description="A tool call's time in all.")
    max_tool_output_bytes: int = Field(
        16_384, ge=64, le=1_048_576, description="A tool result longer than this is cut (the model sees it cut)."
    )
    call_format: Literal["auto", "hermes", "llama3"] = Field(
        "auto",
        description="How tool calls are written: hermes (<tool_call>{json}</tool_call>), llama3 (a JSON object), "
        "auto (read from the chat template; hermes when it has none).",
    )


@dataclass(frozen=True)
class Runtime:
    type: str
    url: str | None = None
    secret: str | None = field(default=None, repr=False)
    timeout_seconds: float | None = None
    source: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    runtime: Runtime

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates and the Chat Completions API take it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class Toolset:
    """A job's tools by name and its limits."""

    tools: Mapping[str, Tool]
    limits: MultiTurn

    def offered(self, line_tools: Sequence[Any] | None) -> list[Tool]:
        """The tools a line offers: its own ``tools`` (each one of the job's, by name), or all."""
        if not line_tools:
            return list(self.tools.values())
        names = [_line_tool_name(t) for t in line_tools]
        return [self.tools[n] for n in names if n in self.tools]

    def unknown(self, line_tools: Sequence[Any] | None) -> list[str]:
        """Names a line offers that the job does not declare."""
        return [n for n in (_line_tool_name(t) for t in line_tools or ()) if n not in self.tools]


def _line_tool_name(tool: Any) -> str:
    if isinstance(tool, Mapping):
        function = tool.get("function")
        inner = function if isinstance(function, Mapping) else tool
        return str(inner.get("name", ""))
    return ""


def parse_tools(
    tools: Sequence[Any] | None,
    multi_turn: Mapping[str, Any] | MultiTurn | None,
    *,
    param: str,
    allowed_urls: Sequence[str],
    allow_python: bool = False,
) -> Toolset | None:
    """The job's tools and limits, or None for a job without tools. Raises ``ToolSpecError`` whose
    ``param`` is the field at fault (``{param}.tools.2.parameters``)."""
    if not tools:
        if multi_turn:
            raise ToolSpecError(
                "multi_turn limits a rollout that calls tools; give tools, or remove multi_turn.",
                param=f"{param}.multi_turn",
            )
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolSpecError(f"at most {MAX_TOOLS} tools a job", param=f"{param}.tools")
    parsed: dict[str, Tool] = {}
    for i, spec in enumerate(tools):
        tool = _tool(spec, param=f"{param}.tools.{i}", allowed_urls=allowed_urls, allow_python=allow_python)
        if tool.name in parsed:
            raise ToolSpecError(
                f"the tool name '{tool.name}' is given twice; each tool needs a name of its own.",
                param=f"{param}.tools.{i}.name",
            )
        parsed[tool.name] = tool
    limits = multi_turn if isinstance(multi_turn, MultiTurn) else MultiTurn.model_validate(multi_turn or {})
    return Toolset(parsed, limits)


def _tool(spec: Any, *, param: str, allowed_urls: Sequence[str], allow_python: bool) -> Tool:
    if not isinstance(spec, Mapping):
        raise ToolSpecError(
            "a tool is an object: {type: 'function', name, description, parameters, runtime}", param=param
        )
    body = dict(spec)
    if isinstance(body.get("function"), Mapping):  # the Chat Completions form
        body = {**{k: v for k, v in body.items() if k != "function"}, **body["function"]}
    unknown = set(body) - {"type", "name", "description", "parameters", "runtime", "strict"}
    if unknown:
        raise ToolSpecError(
            f"unknown key(s) {', '.join(sorted(unknown))}; a tool has type, name, description, parameters and runtime",
            param=f"{param}.{sorted(unknown)[0]}",
        )
    if body.get("type", "function") != "function":
        raise ToolSpecError("only function tools: type must be 'function'", param=f"{param}.type")
    name = body.get("name")
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        raise ToolSpecError("name must be 1 to 64 letters, digits, '_' or '-'", param=f"{param}.name")
    runtime = _runtime(
        body.get("runtime"), name, param=f"{param}.runtime", allowed_urls=allowed_urls, allow_python=allow_python
    )
    default_parameters: dict[str, Any] = {}
    default_description = ""
    if runtime.type == "builtin":
        _, default_parameters, default_description = BUILTINS[name]
    description = body.get("description", default_description)
    if not isinstance(description, str) or len(description) > 2048:
        raise ToolSpecError("description must be a string of at most 2048 characters", param=f"{param}.description")
    parameters = body.get("parameters", default_parameters or {"type": "object", "properties": {}})
    check_schema(parameters, param=f"{param}.parameters")
    return Tool(name, description, dict(parameters), runtime)


def check_schema(parameters: Any, *, param: str) -> None:
    """``parameters`` must be a JSON Schema (2020-12) of an object, at most 16 KiB."""
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ToolSpecError(
            "parameters must be a JSON Schema of an object: {type: 'object', properties: {...}}", param=param
        )
    if len(json.dumps(parameters)) > MAX_SCHEMA_BYTES:
        raise ToolSpecError(f"parameters must be at most {MAX_SCHEMA_BYTES} bytes of JSON", param=param)
    found = jsonschemas.problem(parameters, param, what="parameters")
    if found is not None:
        raise ToolSpecError(found[1], param=found[0])


RUNTIME_KEYS = {
    "builtin": {"type"},
    "http": {"type", "url", "secret", "timeout_seconds"},
    "python": {"type", "source", "timeout_seconds"},
}
MAX_SOURCE_BYTES = 65_536


def _runtime(spec: Any, name: str, *, param: str, allowed_urls: Sequence[str], allow_python: bool) -> Runtime:
    if spec is None and name in BUILTINS:
        return Runtime("builtin")
    if not isinstance(spec, Mapping) or spec.get("type") not in RUNTIME_KEYS:
        raise ToolSpecError(
            "runtime says where the tool runs: {type: 'builtin'} (one of ours: "
            f"{', '.join(BUILTINS)}), {{type: 'http', url, secret}} or {{type: 'python', source}}",
            param=param,
        )
    kind = spec["type"]
    allowed_keys = RUNTIME_KEYS[kind]
    extra = set(spec) - allowed_keys
    if extra:
        raise ToolSpecError(f"a {kind} runtime takes {', '.join(sorted(allowed_keys))}", param=f"{param}.{min(extra)}")
    if kind == "builtin":
        if name not in BUILTINS:
            raise ToolSpecError(f"no built-in tool '{name}'; the built-ins are {', '.join(BUILTINS)}", param=param)
        return Runtime("builtin")
    timeout = spec.get("timeout_seconds")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 300
    ):
        raise ToolSpecError("timeout_seconds is a number above 0 and at most 300", param=f"{param}.timeout_seconds")
    if kind == "python":
        return _python_runtime(spec, param=param, allow_python=allow_python)
    return _http_runtime(spec, param=param, allowed_urls=allowed_urls)


def _python_runtime(spec: Mapping[str, Any], *, param: str, allow_python: bool) -> Runtime:
    """A python tool: ``def call(arguments)`` returning the text the model reads (or JSON), run in
    the python graders' sandbox; off unless the operator sets ``RLOO_ALLOW_PYTHON_TOOLS``."""
    if not allow_python:
        raise ToolSpecError(
            "python tools are off on this server: the operator enables them with RLOO_ALLOW_PYTHON_TOOLS "
            "(they run in the python graders' sandbox)",
            param=param,
        )
    source = spec.get("source")
    if not isinstance(source, str) or not source.strip() or len(source.encode()) > MAX_SOURCE_BYTES:
        raise ToolSpecError(f"source is the tool's python, at most {MAX_SOURCE_BYTES} bytes", param=f"{param}.source")
    if "def call(" not in source:
        raise ToolSpecError(
            "source must define call(arguments), which returns the tool's result", param=f"{param}.source"
        )
    timeout = spec.get("timeout_seconds")
    return Runtime("python", source=source, timeout_seconds=None if timeout is None else float(timeout))


def _http_runtime(spec: Mapping[str, Any], *, param: str, allowed_urls: Sequence[str]) -> Runtime:
    from service.infra.egress import RefusedURL, check_url

    url, secret, timeout = spec.get("url"), spec.get("secret"), spec.get("timeout_seconds")
    if not isinstance(url, str):
        raise ToolSpecError("an http tool needs its url", param=f"{param}.url")
    if not allowed_urls:
        raise ToolSpecError(
            "http tools are off on this server: the operator admits their URLs with RLOO_TOOL_URLS",
            param=f"{param}.url",
        )
    try:
        if not any(_under(url, prefix) for prefix in allowed_urls):
            raise RefusedURL(
                f"the URL must sit under one of the operator's RLOO_TOOL_URLS prefixes ({', '.join(allowed_urls)})"
            )
        check_url(url, allowed_urls, resolve=None)
    except RefusedURL as exc:
        raise ToolSpecError(str(exc), param=f"{param}.url") from None
    if secret is not None and (not isinstance(secret, str) or not 1 <= len(secret) <= 4096 or not secret.isprintable()):
        raise ToolSpecError(
            "secret is a string of 1 to 4096 printable characters (sent as a bearer token)", param=f"{param}.secret"
        )
    return Runtime("http", url=url, secret=secret, timeout_seconds=None if timeout is None else float(timeout))


def _under(url: str, prefix: str) -> bool:
    from service.infra.egress import url_under

    return url_under(url, prefix)


def address_rule(url: str) -> Any:
    """How a tool's sends judge the addresses its host resolves to: a URL whose host is a literal
    address connects there alone (the operator named it); a host name may resolve only to public
    addresses, so a name under an admitted prefix cannot be pointed at the operator's network."""
    from service.infra.egress import public_address

    host = (urlsplit(url).hostname or "").strip("[]")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return lambda address: (
            None
            if ipaddress.ip_address(address.split("%", 1)[0]) == literal
            else (f"{address} is not the address the URL names")
        )

    def rule(address: str) -> str | None:
        why = public_address(address)
        return (
            None
            if why is None
            else (
                f"the tool's host {host!r} resolves to {address}, a private, loopback or link-local address; "
                "an operator admits one by its literal address in RLOO_TOOL_URLS"
            )
        )

    return rule


def redacted(tools: Sequence[Any] | None) -> list[Any] | None:
    """The job's tools as answered: each secret replaced by ``"***"``."""
    if tools is None:
        return None
    return [_redacted_tool(tool) for tool in tools]


def _redacted_tool(tool: Any) -> Any:
    """A tool with its runtime's secret hidden, where the runtime sits at the top or inside
    ``function`` (the Chat Completions form)."""
    if not isinstance(tool, Mapping):
        return tool
    out = dict(tool)
    runtime = out.get("runtime")
    if isinstance(runtime, Mapping) and "secret" in runtime:
        out["runtime"] = {**runtime, "secret": "***"}
    function = out.get("function")
    if isinstance(function, Mapping):
        out["function"] = _redacted_tool(function)
    return out

"""Running tool calls: each checked (a tool the rollout offers, arguments its schema admits), then
run where its runtime says, many at once, each bounded; whatever happens becomes text the model
reads, never an exception out of here.

An **http** tool is sent ``POST <url>`` with the JSON body ``{"name", "arguments", "call_id",
"job_id", "rollout_id", "turn"}`` and the headers ``Authorization: Bearer <secret>`` (when the tool
has one), ``X-Rloo-Job-Id`` and ``X-Rloo-Rollout-Id``, through ``service.infra.outbound``: one
deadline for the whole attempt (``timeout_seconds``), no redirect followed, an answer read up to 1 MiB,
a host name connected only at public addresses (``service.tools.spec.address_rule``). It answers 200
with JSON: ``{"content": "..."}`` is the text the model reads, ``{"error": "..."}`` an error the tool
reports (read by the model as ``{"error": "..."}`` and counted, as a built-in's), any other JSON is
read as it is.
Anything else (a status, a time-out, a body that is not JSON or too long) is an error the model
reads as ``{"error": "..."}``, and the metrics count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from service.core import jsonschemas
from service.tools.builtins import BUILTINS
from service.tools.calls import Call
from service.tools.errors import ToolFailed
from service.tools.spec import Tool, Toolset, address_rule

HTTP_TOOL_MAX_BYTES = 2**20
CONCURRENT_CALLS = 32
"""Calls a runner has in flight at once (a step's calls beyond it wait their turn)."""


@dataclass(frozen=True)
class Where:
    """Which rollout and turn a call belongs to, as an http tool is told."""

    job_id: str
    rollout_id: str
    turn: int
    call_id: str


@dataclass(frozen=True)
class Outcome:
    """What the model reads (``content``), and how the call ended: ``kind`` None when it gave a
    result, else ``error``, ``timeout`` or ``malformed``."""

    content: str
    kind: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.kind is None


class ToolRunner:
    """Runs a job's calls on a pool of threads (an http call waits on its endpoint, a built-in is
    instant). ``allowed_urls`` are the operator's ``RLOO_TOOL_URLS`` as they are now: a prefix
    removed since the job was created stops its calls."""

    def __init__(self, toolset: Toolset, *, allowed_urls: Sequence[str]) -> None:
        self.toolset, self.allowed_urls = toolset, list(allowed_urls)
        self.pool = ThreadPoolExecutor(CONCURRENT_CALLS, thread_name_prefix="tool-call")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def run(self, calls: Sequence[tuple[Sequence[Tool], Call, Where]]) -> list[Outcome]:
        """Each ``(offered tools, call, where)``'s outcome, in order, run concurrently: a python
        tool's calls together in one sandbox (``_python``), every other call on its own."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        batches: dict[str, tuple[Tool, list[int]]] = {}
        singles: list[int] = []
        for i, (offered, call, _) in enumerate(calls):
            tool = next((t for t in offered if t.name == call.name), None)
            if tool is None or tool.runtime.type != "python" or call.error is not None:
                singles.append(i)
                continue
            try:
                _checked(offered, call)
            except ToolFailed as exc:
                outcomes[i] = self._failed(exc, 0.0)
                continue
            batches.setdefault(tool.name, (tool, []))[1].append(i)
        futures = [
            (indices, self.pool.submit(self._python, tool, [calls[i][1].arguments for i in indices]))
            for tool, indices in batches.values()
        ]
        for i, out in zip(singles, self.pool.map(lambda i: self.run_one(*calls[i]), singles), strict=True):
            outcomes[i] = out
        for indices, future in futures:
            for i, out in zip(indices, future.result(), strict=True):
                outcomes[i] = out
        return [o for o in outcomes if o is not None]

    def _failed(self, exc: ToolFailed, seconds: float) -> Outcome:
        limit = self.toolset.limits.max_tool_output_bytes
        return Outcome(json.dumps({"error": _cut(exc.message, limit)}), exc.kind, seconds)

    def _python(self, tool: Tool, arguments: list[dict[str, Any]]) -> list[Outcome]:
        """A python tool's calls of a turn, one after another in one sandbox (the python graders'),
        each within the tool's time-out."""
        from service.core.settings import get_settings
        from service.graders.sandbox import Limits, SandboxUnavailable, run_python_tool

        seconds = tool.runtime.timeout_seconds or self.toolset.limits.tool_timeout_seconds
        limits = Limits(
            per_sample_seconds=seconds,
            batch_seconds=seconds * len(arguments) + 10,
            memory_mb=get_settings().python_grader_memory_mb,
        )
        start = time.monotonic()
        try:
            results = run_python_tool(tool.runtime.source or "", arguments, limits)
        except SandboxUnavailable as exc:
            return [self._failed(ToolFailed(f"the python tool cannot run here: {exc}"), 0.0)] * len(arguments)
        seconds_each = (time.monotonic() - start) / max(len(arguments), 1)
        limit = self.toolset.limits.max_tool_output_bytes
        return [
            Outcome(_cut(r.text, limit), None, seconds_each)
            if r.text is not None
            else self._failed(ToolFailed(r.error or "no result", kind=_python_kind(r.error)), seconds_each)
            for r in results
        ]

    def run_one(self, offered: Sequence[Tool], call: Call, where: Where) -> Outcome:
        start = time.monotonic()
        try:
            tool = _checked(offered, call)
            content = self._call(tool, call.arguments, where)
            return Outcome(_cut(content, self.toolset.limits.max_tool_output_bytes), None, time.monotonic() - start)
        except ToolFailed as exc:
            return self._failed(exc, time.monotonic() - start)
        except Exception as exc:  # a tool must never end a rollout: the model reads what broke
            return Outcome(
                json.dumps({"error": f"the tool failed ({type(exc).__name__})"}), "error", time.monotonic() - start
            )

    def _call(self, tool: Tool, arguments: dict[str, Any], where: Where) -> str:
        if tool.runtime.type == "python":
            outcome = self._python(tool, [arguments])[0]
            if outcome.kind is not None:
                raise ToolFailed(json.loads(outcome.content)["error"], kind=outcome.kind)
            return outcome.content
        if tool.runtime.type == "builtin":
            return BUILTINS[tool.name][0](arguments)
        return self._http(tool, arguments, where)

    def _http(self, tool: Tool, arguments: dict[str, Any], where: Where) -> str:
        from service.infra import outbound
        from service.infra.egress import url_under

        url = tool.runtime.url or ""
        if not any(url_under(url, prefix) for prefix in self.allowed_urls):
            raise ToolFailed(f"the tool '{tool.name}' is no longer admitted by the operator (RLOO_TOOL_URLS)")
        body = {
            "name": tool.name,
            "arguments": arguments,
            "call_id": where.call_id,
            "job_id": where.job_id,
            "rollout_id": where.rollout_id,
            "turn": where.turn,
        }
        headers = {
            "content-type": "application/json",
            "x-rloo-job-id": where.job_id,
            "x-rloo-rollout-id": where.rollout_id,
        }
        if tool.runtime.secret:
            headers["authorization"] = f"Bearer {tool.runtime.secret}"
        seconds = tool.runtime.timeout_seconds or self.toolset.limits.tool_timeout_seconds
        try:
            reply = outbound.post(
                url,
                json.dumps(body).encode(),
                headers=headers,
                seconds=seconds,
                max_body=HTTP_TOOL_MAX_BYTES,
                addresses=address_rule(url),
            )
        except outbound.TooLarge:
            raise ToolFailed(f"the tool answered more than {HTTP_TOOL_MAX_BYTES} bytes") from None
        except outbound.Unreachable as exc:
            timed_out = "within" in exc.reason or "deadline" in exc.reason or "run out" in exc.reason
            raise ToolFailed(
                f"the tool did not answer: {exc.reason}", kind="timeout" if timed_out else "error"
            ) from None
        return _answer(reply.status, reply.body)


def _python_kind(error: str | None) -> str:
    """A python tool's failure as the metrics count it: past its time, or any other error."""
    return "timeout" if error and ("ran past" in error or "past its limit" in error) else "error"


def _checked(offered: Sequence[Tool], call: Call) -> Tool:
    """The tool ``call`` names, its arguments checked against the tool's schema."""
    import jsonschema

    if call.error is not None:
        raise ToolFailed(call.error, kind="malformed")
    tool = next((t for t in offered if t.name == call.name), None)
    if tool is None:
        names = ", ".join(t.name for t in offered) or "none"
        raise ToolFailed(f"no tool named '{call.name}'; the tools are: {names}", kind="malformed")
    validator = jsonschemas.validator(tool.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(call.arguments))
    if error is not None:
        where = "/".join(str(p) for p in error.path) or "the arguments"
        raise ToolFailed(f"{where}: {error.message}", kind="malformed")
    return tool


def _answer(status: int, data: bytes) -> str:
    text = data[:200].decode("utf-8", errors="replace")
    if 300 <= status < 400:
        raise ToolFailed(f"the tool answered HTTP {status} (a redirect, which is not followed)")
    if status != 200:
        raise ToolFailed(f"the tool answered HTTP {status}: {text}")
    try:
        answer = json.loads(data)
    except ValueError:
        raise ToolFailed(f"the tool's answer is not JSON: {text!r}") from None
    if isinstance(answer, dict) and isinstance(answer.get("content"), str):
        return str(answer["content"])
    if isinstance(answer, dict) and set(answer) == {"error"} and isinstance(answer["error"], str):
        raise ToolFailed(answer["error"])  # the tool's own error: read and counted as a built-in's is
    return json.dumps(answer, ensure_ascii=False)


def _cut(content: str, limit: int) -> str:
    data = content.encode()
    if len(data) <= limit:
        return content
    return data[:limit].decode("utf-8", errors="ignore") + " [cut]"

"""The bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's parameters, checked
here so that a request the inference workers cannot honour is a 400 naming the field, never a
silently different answer. What an inference worker needs of a request is ``Sampling.wire``.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from service.api.errors import APIError
from service.core.errors import bad_request
from service.core.settings import Settings
from service.core.validation import Strict
from service.infra.inference_bus import BYTES_PER_TOKEN, estimated_tokens, past_any_context, rows_a_project
from service.jobs.hyperparameters import check_stop

MAX_PROMPTS = 64


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's; accepted, nothing to hide here


class Sampling(Strict):
    """What chat and text completions share."""

    model: str = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stop: str | Annotated[list[str], Field(max_length=64)] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=512)
    presence_penalty: float = Field(default=0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        return check_stop([value] if isinstance(value, str) else value)

    @model_validator(mode="after")
    def _unsupported(self) -> Sampling:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server; leave it at 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server; leave it out")
        return self

    prompt_param: ClassVar[str] = "prompt"

    @property
    def budget_param(self) -> str:
        """The field that holds the tokens each completion may write, as the request spelt it."""
        return "max_tokens"

    def prompt_texts(self) -> list[str]:
        """The text of each prompt (a chat's: its messages' and tools' text), for the byte counts."""
        raise NotImplementedError

    @functools.cached_property
    def prompt_bytes(self) -> list[int]:
        """Each prompt's UTF-8 bytes, counted once (a body may hold 8 MiB of them, on the event loop)."""
        return [len(text.encode()) for text in self.prompt_texts()]

    @property
    def rows(self) -> int:
        """Completions it asks for: ``n`` for each prompt."""
        return self.n * len(self.prompt_bytes)

    def check_limits(self, settings: Settings) -> None:
        """What no model or load could make acceptable: a 400 naming the field."""
        param = self.budget_param
        if self.n > settings.inference_max_n:
            raise bad_request(f"n is at most {settings.inference_max_n} on this server; got {self.n}.", "n")
        if self.max_tokens is not None and self.max_tokens > settings.inference_max_tokens:
            raise bad_request(
                f"{param} is at most {settings.inference_max_tokens} on this server "
                f"(RLOO_INFERENCE_MAX_TOKENS); got {self.max_tokens}.",
                param,
            )
        most = rows_a_project(settings.inference_max_batch)
        if self.rows > most:
            raise bad_request(
                f"This request asks for {self.rows} completions (n times the prompts); a request may ask for at "
                f"most {most}, three quarters of what an inference worker decodes at once (RLOO_INFERENCE_MAX_BATCH, "
                f"{settings.inference_max_batch}): send fewer prompts or a smaller n, in several requests.",
                "n" if len(self.prompt_bytes) == 1 else "prompt",
            )
        self.check_budget(settings)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")

    def check_context(self, context: int | None) -> None:
        """A prompt longer than any ``context`` tokens of text could be is a 400 before a worker
        tokenizes it (tokenizing 8 MB took a worker 45 s)."""
        why = past_any_context(context, max(self.prompt_bytes), self.prompt_param)
        if why is not None:
            raise APIError(400, why, param=self.prompt_param, code="context_length_exceeded")

    def check_budget(self, settings: Settings) -> None:
        budget = self.budget(settings)
        if budget > settings.inference_max_tokens_in_flight:
            raise bad_request(
                f"This request asks for {budget} tokens (its prompts' tokens, estimated at {BYTES_PER_TOKEN} bytes "
                f"a token, and {self.budget_param}, times n), more than a key may have in flight "
                f"({settings.inference_max_tokens_in_flight}, RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT); ask for fewer.",
                self.budget_param,
            )

    def budget(self, settings: Settings) -> int:
        """Tokens this request may hold in all, what the key's tokens in flight count: for each
        completion, its prompt's tokens (estimated from its bytes; the API tokenizes nothing) and
        what it may write."""
        writes = self.max_tokens or settings.inference_max_tokens
        return self.n * sum(estimated_tokens(size) + writes for size in self.prompt_bytes)

    def wire(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "n": self.n,
            "stop": self.stop,
            "seed": self.seed,
        }


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=4096)] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        content = self.content
        text = "".join(part.text for part in content) if isinstance(content, list) else (content or "")
        return text + (json.dumps(self.tool_calls, ensure_ascii=False) if self.tool_calls else "")

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionCreate(Sampling):
    prompt_param: ClassVar[str] = "messages"
    messages: list[Message] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: Literal[False] | None = Field(default=None, description="Log-probs are not returned by this server.")
    response_format: dict[Literal["type"], Literal["text"]] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=64)
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _one_budget(self) -> ChatCompletionCreate:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("give max_completion_tokens or max_tokens, not both")
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def budget_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def prompt_texts(self) -> list[str]:
        parts = [m.text() for m in self.messages]
        if self.tools:
            parts.append(json.dumps(self.tools, ensure_ascii=False))
        return ["\n".join(parts)]

    def wire(self) -> dict[str, Any]:
        return {
            **super().wire(),
            "kind": "chat",
            "messages": [m.for_template() for m in self.messages],
            "tools": self.tools if self.tool_choice != "none" else None,  # none: the model is not offered them
        }


class CompletionCreate(Sampling):
    prompt: str | Annotated[list[str], Field(max_length=1024)] = Field(
        description="A prompt, or a list of prompts (each answered n times)."
    )
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for text completions
    echo: Literal[False] = False
    suffix: None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: None = Field(default=None, description="Log-probs are not returned by this server.")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not 1 <= len(value) <= MAX_PROMPTS:
            raise ValueError(f"prompt is a string or a list of 1 to {MAX_PROMPTS} strings")
        return value

    @model_validator(mode="after")
    def _best_of(self) -> CompletionCreate:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server unless it equals n")
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def prompt_texts(self) -> list[str]:
        return self.prompts

    def wire(self) -> dict[str, Any]:
        return {**super().wire(), "kind": "completion", "prompts": self.prompts}

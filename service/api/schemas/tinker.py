"""The JSON bodies of the Tinker protocol's requests, as the ``tinker`` SDK sends them
(``tinker/types/*_request.py``): the fields the server reads, checked; the ones it does not (the
SDK's ``type`` tags, telemetry's details) ignored."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(_Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = Field(default="", max_length=64)
    project_id: str | None = None
    display_name: str | None = Field(default=None, max_length=200)


class SessionRef(_Body):
    session_id: str = Field(max_length=128)


class Lora(_Body):
    rank: int = Field(ge=0, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(_Body):
    session_id: str = Field(max_length=128)
    model_seq_id: int = Field(ge=0, le=1_000_000)
    base_model: str = Field(max_length=1024)
    user_metadata: dict[str, Any] | None = None
    lora_config: Lora | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelRef(_Body):
    model_id: str = Field(max_length=160)


class AdamParams(_Body):
    """Tinker's ``AdamParams``, its defaults."""

    learning_rate: float = Field(default=1e-4, ge=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    grad_clip_norm: float = Field(default=0.0, ge=0)


class OptimStep(_Body):
    model_id: str = Field(max_length=160)
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(_Body):
    model_id: str = Field(max_length=160)
    path: str | None = Field(default=None, max_length=200)
    seq_id: int | None = None
    ttl_seconds: int | None = Field(default=None, ge=3600, le=10 * 365 * 86400)
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


class LoadWeights(_Body):
    model_id: str | None = Field(default=None, max_length=160)
    seq_id: int | None = None
    session_id: str | None = Field(default=None, max_length=128)
    model_seq_id: int | None = Field(default=None, ge=0, le=1_000_000)
    base_model: str | None = Field(default=None, max_length=1024)
    user_metadata: dict[str, Any] | None = None
    path: str = Field(max_length=600)
    optimizer: bool = False
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None


class RetrieveFuture(_Body):
    request_id: str = Field(max_length=64)
    allow_metadata_only: bool = False


class CancelFuture(_Body):
    request_id: str = Field(max_length=64)


class CreateSamplingSession(_Body):
    session_id: str = Field(max_length=128)
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = Field(default=None, max_length=1024)
    model_path: str | None = Field(default=None, max_length=600)


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list, max_length=1_048_576)


class Prompt(_Body):
    chunks: list[Chunk] = Field(max_length=4096)


class SamplingParams(_Body):
    """Tinker's ``SamplingParams``; ``max_tokens`` unset: ``DEFAULT_MAX_TOKENS``."""

    max_tokens: int | None = Field(default=None, ge=1, le=1_048_576)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str | int] | None = Field(default=None, max_length=64)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_k: int = Field(default=-1, ge=-1, le=100_000)
    top_p: float = Field(default=1.0, gt=0, le=1)


DEFAULT_MAX_TOKENS = 256
MAX_TOPK = 20
"""The most top-k log-probs a position may ask for (vLLM's default cap)."""


class Sample(_Body):
    num_samples: int = Field(default=1, ge=1, le=64)
    prompt: Prompt
    sampling_params: SamplingParams
    base_model: str | None = Field(default=None, max_length=1024)
    model_path: str | None = Field(default=None, max_length=600)
    sampling_session_id: str | None = Field(default=None, max_length=2048)
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK)
    prompt_logprobs_last_n: int | None = None
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None

    def prompt_tokens(self) -> list[int]:
        return [t for chunk in self.prompt.chunks for t in chunk.tokens]


class SaveWeightsExternal(_Body):
    model_id: str = Field(max_length=160)
    path: str = Field(max_length=200)
    seq_id: int | None = None
    ttl_seconds: int | None = Field(default=None, ge=3600, le=10 * 365 * 86400)
    age_encryption_recipients: list[str] | None = None


class TinkerPathRef(_Body):
    tinker_path: str = Field(max_length=600)


class CheckpointTtl(_Body):
    ttl_seconds: int | None = None

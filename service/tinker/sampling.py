"""Tinker's sampling on the inference workers: a sampling session names what it samples (a base
model, or a training model's sampler weights), a sample request becomes an inference request of
kind ``tokens`` (its prompt's token ids, ``n`` samples, each token's log-probability kept), and the
worker's last message becomes the SDK's ``SampleResponse``.

A sampling session's id carries what it names (base64 of ``{"base": ...}`` or ``{"path": ...}``),
so that nothing is stored for it and any API process answers it; what it names is resolved, within
the caller's project, at every request.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from typing import Any

from sqlalchemy.orm import Session

from service.core.errors import Invalid, NotFound
from service.core.settings import Settings
from service.registry.inspection import check_policy
from service.registry.model_root import resolve_model
from service.tinker import sessions, wire

SESSION_PREFIX = "sms-"
MAX_SAMPLES = 64


def session_id_of(*, base_model: str | None = None, path: str | None = None) -> str:
    named = {"path": path} if path else {"base": base_model}
    return SESSION_PREFIX + base64.urlsafe_b64encode(json.dumps(named).encode()).decode().rstrip("=")


def named_by(sampling_session_id: str) -> dict[str, str]:
    """What a sampling session's id names: ``{"base": name}`` or ``{"path": tinker path}``."""
    raw = sampling_session_id.removeprefix(SESSION_PREFIX)
    try:
        named = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (binascii.Error, ValueError):
        named = None
    if (
        not sampling_session_id.startswith(SESSION_PREFIX)
        or not isinstance(named, dict)
        or len(named) != 1
        or not all(k in ("base", "path") and isinstance(v, str) for k, v in named.items())
    ):
        raise NotFound(
            f"No sampling session '{sampling_session_id[:120]}'.", param="sampling_session_id", code="session_not_found"
        )
    return named


def servable(
    session: Session, settings: Settings, *, project: int, named: dict[str, str]
) -> tuple[dict[str, Any], str]:
    """What the inference worker loads for ``named`` (``{"base", "chain"}``, as
    ``service.registry.weights.resolve`` answers for a job's model) and the base model's name."""
    if "base" in named:
        name = named["base"]
        path = resolve_model(settings.models_dir, name, hub_offline=True, param="base_model")
        check_policy(path, name, "base_model")
        return {"base": str(path), "chain": []}, name
    parsed = sessions.parse_path(named["path"], "model_path")
    if parsed.kind != "sampler_weights":
        raise Invalid(
            "A saved state is for training: sample from sampler weights (tinker://<model>/sampler_weights/<name>, "
            "as save_weights_for_sampler answers)",
            param="model_path",
            code="invalid_path",
        )
    checkpoint = sessions.find_checkpoint(session, project=project, path=parsed, param="model_path")
    model = sessions.get_model(session, project=project, model_id=parsed.model_id, param="model_path")
    chain = [str(settings.artifacts_dir / checkpoint.path)]
    return {"base": str(settings.models_dir / model.base_model), "chain": chain}, model.base_model


def envelope(body: Any, *, rid: str, project: str, key: str, served: dict[str, Any], deadline: float) -> dict[str, Any]:
    """The inference request of a ``SampleRequest`` (``service.api.schemas.tinker.Sample``)."""
    params = body.sampling_params
    stop = params.stop
    stop_ids = [int(t) for t in stop] if isinstance(stop, list) and all(isinstance(t, int) for t in stop) else None
    strings = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    return {
        "id": rid,
        "project": project,
        "key": key,
        "deadline": deadline,
        "servable": served,
        "kind": "tokens",
        "prompt_ids": body.prompt_tokens(),
        "n": body.num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": strings,
        "stop_ids": stop_ids if stop_ids is not None or stop is None or strings else [],
        "top_k": params.top_k if params.top_k > 0 else 0,
        "scoring": {
            "prompt": bool(body.prompt_logprobs),
            "prompt_topk": body.topk_prompt_logprobs,
            "last_n": body.prompt_logprobs_last_n,
            "sample_topk": body.topk_sample_logprobs,
        },
    }


def sequence_ids(count: int) -> list[str]:
    return [f"seq-{secrets.token_hex(8)}" for _ in range(count)]


def response_of(done: dict[str, Any]) -> bytes:
    """The worker's last message of a ``tokens`` request as the SDK's protobuf ``SampleResponse``."""
    return wire.encode_sample_response(
        [
            wire.SampledSequence(
                tokens=list(s["tokens"]),
                logprobs=list(s["logprobs"]) if s.get("logprobs") is not None else None,
                stop_reason="length" if s.get("stop_reason") == "length" else "stop",
                topk_logprobs=_pairs(s.get("topk_logprobs")),
            )
            for s in done["sequences"]
        ],
        prompt_logprobs=done.get("prompt_logprobs"),
        topk_prompt_logprobs=_pairs(done.get("topk_prompt_logprobs")),
    )


def _pairs(rows: list[Any] | None) -> list[list[tuple[int, float]] | None] | None:
    """Top-k lists as JSON carried them ([[id, logprob], ...] a position) back to pairs."""
    if rows is None:
        return None
    return [None if row is None else [(int(t), float(v)) for t, v in row] for row in rows]

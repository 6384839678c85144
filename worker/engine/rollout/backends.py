"""Choosing the rollout backend of a run (the operator's ``RLOO_ROLLOUT_BACKEND``).

Apart from both backends, so that neither imports the other: ``worker.engine.rollout.base`` holds the
transformers backend and what both share, ``worker.engine.rollout.vllm_backend`` the vLLM one.
"""

from __future__ import annotations

from typing import Any

from worker.engine.rollout.base import RolloutBackend, Sampling
from worker.engine.rollout.transformers_backend import TransformersBackend

BACKENDS = ("auto", "transformers", "vllm")


def make_backend(
    choice: str,
    model: Any,
    tokenizer: Any,
    sampling: Sampling,
    *,
    device: Any,
    vllm_options: dict[str, Any] | None = None,
) -> RolloutBackend:
    """``auto``: vLLM when it is installed and the policy is on a CUDA device, else transformers."""
    if choice not in BACKENDS:
        raise ValueError(f"unknown rollout backend '{choice}'; choose one of {', '.join(BACKENDS)}")
    if choice == "vllm" or (choice == "auto" and getattr(device, "type", "") == "cuda" and vllm_installed()):
        from worker.engine.rollout.vllm_backend import VLLMBackend  # imports vLLM: only where it is chosen

        return VLLMBackend(model, tokenizer, sampling, options=vllm_options or {})
    return TransformersBackend(model, tokenizer, sampling)


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None

"""The stand-in's engine arguments: only the fields ``worker.engine.rollout.vllm_backend`` asks about."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    model: str = ""
    logprobs_mode: str = "raw_logprobs"

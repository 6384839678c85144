"""A grader's dry run on a worker of the graders queue: one sample scored as a job would score it.

Rule graders never touch torch; model graders (reward models, judges, ``cosine``) keep their models
loaded in this process between dry runs (the graders worker's processes are long-lived).
"""

from __future__ import annotations

import math
from typing import Any

from service import graders
from service.core.settings import get_settings, tenant_safe

MODELS_KEPT = 4  # distinct models a process keeps loaded for dry runs; past that it starts afresh

_reward_models: Any = None


def grade(payload: dict[str, Any]) -> dict[str, Any]:
    """``{"reward", "sub_rewards", "errors", "messages"}``, or ``{"error", "code", "status"}`` when the
    grader cannot run (a bad spec, a model that will not load, an endpoint or sandbox that is down)."""
    settings = get_settings()
    try:
        grader = graders.parse_grader(payload["grader"], allow_python=settings.allow_python_grader)
    except graders.GraderError as exc:
        return {"error": exc.message, "code": "invalid_grader", "status": 400}
    sample, item = str(payload["model_sample"]), dict(payload["item"])
    try:
        if graders.is_model_grader(grader):
            result = _with_models(grader, sample, item)
        else:
            result = graders.grade_batch(grader, [graders.Sample(output_text=sample)], [item])
    except OSError as exc:  # a model that will not load (transformers says which and why)
        return {"error": tenant_safe(f"{type(exc).__name__}: {exc}"), "code": "model_load_failed", "status": 400}
    except graders.GraderUnavailable as exc:
        return {"error": tenant_safe(str(exc)), "code": "grader_unavailable", "status": 502}

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    return {
        "reward": finite(result.rewards[0]),
        "sub_rewards": {name: finite(column[0]) for name, column in result.sub_rewards.items()},
        "errors": result.errors,
        "messages": {name: tenant_safe(m) for name, m in result.messages.items()},
    }


def _with_models(grader: Any, sample: str, item: dict[str, Any]) -> graders.GradeResult:
    from worker.jobs.preload import wait_for_preload

    wait_for_preload()
    from worker.engine.rewards.scoring import score_batch

    return score_batch(grader, prompts=[""], texts=[sample], items=[item], reward_models=_models())


def _models() -> Any:
    """This process's reward models, kept between dry runs (a fresh set once it holds too many)."""
    global _reward_models
    from worker.engine.modeling import pick_device
    from worker.engine.rewards.scoring import RewardModels

    if _reward_models is None or len(_reward_models._loaded) >= MODELS_KEPT:
        settings = get_settings()
        _reward_models = RewardModels(
            models_dir=settings.models_dir, device=pick_device(None), embedding_model=settings.embedding_model
        )
    return _reward_models

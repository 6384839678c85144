"""The request bodies of ``/v1/fine_tuning/alpha/graders``: validate a grader, run one on a sample."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from service.core.validation import Strict


class GraderValidate(Strict):
    grader: dict[str, Any]


class GraderRun(Strict):
    grader: dict[str, Any]
    model_sample: str = Field(max_length=1_000_000)
    item: dict[str, Any] = Field(default_factory=dict)
    reference_answer: Any | None = None  # OpenAI's older spelling; available as item.reference_answer

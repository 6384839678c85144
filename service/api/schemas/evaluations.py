"""The request body of ``POST /v1/fine_tuning/jobs/{id}/evaluations``: a file, the checkpoints, a
grader, and the sampling settings (the job's by default)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from service.core.validation import Strict

MAX_SAMPLES = 2000
DEFAULT_SAMPLES = 200


class EvaluationCreate(Strict):
    file: str = Field(max_length=64, description="A file of the project (prompt lines, as a training file).")
    checkpoints: Annotated[list[str], Field(max_length=1024)] | Literal["all"] = Field(
        default="all",
        description="Checkpoint ids (ftckpt-… or ft:…:ckpt-step-N) of the job, or all it has so far (none: the "
        "starting model alone).",
    )
    grader: dict[str, Any] | None = Field(default=None, description="Default: the grader the job trained with.")
    samples: int = Field(default=DEFAULT_SAMPLES, ge=1, le=MAX_SAMPLES, description="Lines of the file scored.")
    temperature: float | None = Field(default=None, ge=0, le=2, description="Default: the job's (1 if it has none).")
    max_tokens: int | None = Field(default=None, ge=1, le=4096, description="Default: the job's max_new_tokens (64).")
    seed: int | None = Field(default=None, ge=0, lt=2**62)

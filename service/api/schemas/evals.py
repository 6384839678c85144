"""The request bodies of OpenAI's Evals API (``/v1/evals``): their shape here, their meaning checked by
``service.evals`` (a 400 naming the field)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from service.core.validation import Strict, check_metadata


class EvalCreate(Strict):
    name: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    data_source_config: dict[str, Any] = Field(description="{'type': 'custom', 'item_schema': {...}}")
    testing_criteria: list[Any] = Field(
        max_length=16, description="Graders (at most 16), each with its pass_threshold where it takes one."
    )

    _check_metadata = field_validator("metadata")(check_metadata)


class EvalUpdate(Strict):
    name: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)

    _check_metadata = field_validator("metadata")(check_metadata)


class EvalRunCreate(Strict):
    name: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    data_source: dict[str, Any] = Field(description="jsonl (items with their samples) or completions (a model).")

    _check_metadata = field_validator("metadata")(check_metadata)

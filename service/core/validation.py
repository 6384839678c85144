"""One wording for a request that fails validation, wherever it was sent (the API, ``rloo train``):
the field at fault as a dotted ``param``, and for a misspelt name the closest name that exists."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

_NOT_FIELDS = ("body", "query", "path", "header", "form")


class Strict(BaseModel):
    """The base of every request body: an unknown key is an error (a misspelt name silently ignored
    would cost a user a run), and NaN or an infinity is never a value."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @classmethod
    def unknown_field_hint(cls, fields: list[str]) -> str | None:
        """What to say of an unknown field at ``fields`` (its dotted path) beyond "did you mean",
        where the body knows better (a job's field that belongs to another method); None if nothing."""
        return None


def param_of(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error's location as the dotted name a user wrote (``method.reinforcement.grader``)."""
    parts = [str(p) for p in loc if p not in _NOT_FIELDS]
    # Pydantic adds the tag or the model name for unions; they mean nothing to a user.
    parts = [p for p in parts if not p.startswith(("function-", "tagged-union", "lax-or-strict"))]
    return ".".join(parts) or None


def message(err: Mapping[str, Any], model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """``(message, param)`` for the first error of a failed validation of ``model``."""
    kind = err.get("type", "")
    if kind == "json_invalid":  # its loc is a character offset, not a field
        ctx = err.get("ctx") or {}
        where = f" ({ctx['error']})" if ctx.get("error") else ""
        return f"The request body is not valid JSON{where}.", None
    loc = tuple(err.get("loc", ()))
    param = param_of(loc)
    if kind == "extra_forbidden":
        fields = [str(p) for p in loc if p not in _NOT_FIELDS]
        other = model.unknown_field_hint(fields) if model is not None and issubclass(model, Strict) else None
        if other:
            return other, param
        hint = ""
        if model is not None and fields:
            close = difflib.get_close_matches(str(fields[-1]), known_names(model, fields[:-1]), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"Unknown parameter '{param}'.{hint} Remove it, or check its spelling against the API reference.", param
    if kind == "missing" and param is None and model is not None:  # no body at all
        required = [name for name, field in model.model_fields.items() if field.is_required()]
        if required:
            listed = ", ".join(f"'{name}'" for name in required)
            return (
                f"Missing required parameter '{required[0]}': the request has no JSON body; send {listed}.",
                required[0],
            )
    if kind == "missing":
        return f"Missing required parameter '{param}'.", param
    msg = err.get("msg", "invalid value")
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."), param


def known_names(model: type[BaseModel], path: list[Any]) -> list[str]:
    """The field names of the model found at ``path`` inside ``model`` (none if the path leaves it)."""
    current: type[BaseModel] | None = model
    for part in path:
        field = current.model_fields.get(str(part)) if current is not None else None
        current = _model_in(field.annotation) if field is not None else None
    return list(current.model_fields) if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``, ``Optional[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's ``metadata`` limits (a pydantic field validator's body): at most 16 keys, keys of at
    most 64 characters, values of at most 512."""
    if v is not None:
        if len(v) > 16:
            raise ValueError("at most 16 keys")
        for key, value in v.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys are at most 64 characters and values at most 512")
    return v

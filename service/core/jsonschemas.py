"""JSON Schemas that users give (a tool's ``parameters``, an eval's ``item_schema``), checked before
anything runs them: a schema of JSON Schema 2020-12, with no keyword our validators will not run (a
user's regular expression, a ``$ref`` that would be fetched, nesting deeper than a validator's
recursion), and a validator that never fetches anything (``validator``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)


_REGEX = (
    "pattern and patternProperties are not supported: their regular expressions would run on a model's text in "
    "the worker with nothing to stop them. Say the format in the description instead."
)
_REMOTE = "a $ref may only point within the schema ('#/$defs/...'): nothing is fetched from elsewhere."


MAX_SCHEMA_DEPTH = 32


def unsafe_keyword(schema: Any, where: str, depth: int = 0) -> tuple[str, str] | None:
    """Where (a dotted path) and why a schema, or any schema within it, uses a keyword the worker
    will not run: ``pattern``, ``patternProperties``, a ``$ref`` (or ``$dynamicRef``) outside it;
    or nests schemas deeper than 32 (a validator walks them by recursion)."""
    if not isinstance(schema, Mapping):
        return None
    if depth > MAX_SCHEMA_DEPTH:
        return where, f"schemas nest at most {MAX_SCHEMA_DEPTH} deep"
    for keyword in ("pattern", "patternProperties"):
        if keyword in schema:
            return f"{where}.{keyword}", _REGEX
    for keyword in ("$ref", "$dynamicRef"):
        if keyword in schema and not (isinstance(schema[keyword], str) and schema[keyword].startswith("#")):
            return f"{where}.{keyword}", _REMOTE
    inner: list[tuple[Any, str]] = []
    for keyword in _SCHEMA_MAPS:
        if isinstance(schema.get(keyword), Mapping):
            inner += [(s, f"{where}.{keyword}.{name}") for name, s in schema[keyword].items()]
    for keyword in _SCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            inner += [(s, f"{where}.{keyword}.{i}") for i, s in enumerate(schema[keyword])]
    inner += [(schema[k], f"{where}.{k}") for k in _SCHEMAS if k in schema]
    return next((found for s, path in inner if (found := unsafe_keyword(s, path, depth + 1)) is not None), None)


def problem(schema: Any, param: str, *, what: str) -> tuple[str, str] | None:
    """Where (a dotted path under ``param``) and why ``schema`` cannot be taken; None when it can.
    ``what`` names it in the message (``parameters``, ``item_schema``)."""
    import jsonschema

    found = unsafe_keyword(schema, param)
    if found is not None:
        return found
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        return f"{param}.{where}".rstrip("."), f"{what} is not a JSON Schema: {exc.message}"
    except RecursionError:
        return param, f"{what} nests too deep to check"
    return None


def _refuse(uri: str) -> Any:
    from referencing.exceptions import NoSuchResource

    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


def _registry() -> Any:
    from referencing import Registry

    return Registry(retrieve=_refuse)  # type: ignore[call-arg]


NOTHING_FETCHED = _registry()
"""Where a schema's ``$ref`` is looked up: within the schema alone (jsonschema's default would fetch
a URL; ``problem`` refuses such refs, and this keeps any that slipped through from reaching out)."""


def validator(schema: Mapping[str, Any]) -> Any:
    """A 2020-12 validator of ``schema`` that never fetches."""
    import jsonschema

    return jsonschema.Draft202012Validator(schema, registry=NOTHING_FETCHED)

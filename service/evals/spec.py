"""What ``POST /v1/evals`` and ``POST /v1/evals/{id}/runs`` take, checked before anything is stored:
an eval's ``data_source_config`` (``custom``: an ``item_schema``), and a run's ``data_source``
(``jsonl`` items with their answers, or ``completions``: items answered by one of the project's
models from ``input_messages``). A mistake is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.core import jsonschemas
from service.core.errors import bad_request
from service.evals.criteria import Criterion, item_keys
from service.graders import templates

MAX_SCHEMA_BYTES = 65_536
MAX_INLINE_BYTES = 262_144
"""A run's ``file_content`` at most: the run object answers it back, in every list too."""
SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "output_text": {"type": "string"},
        "output_json": {"type": "object"},
    },
    "required": ["output_text"],
}
"""The ``sample`` namespace's schema (``include_sample_schema``): what graders read as
``{{ sample.output_text }}``, as OpenAI's has it."""

UNSUPPORTED_CONFIGS = {
    "stored_completions": "this server stores no chat completions to evaluate",
    "logs": "this server keeps no logs of completions to evaluate",
}


def data_source_config(raw: object, param: str = "data_source_config") -> dict[str, Any]:
    """The config as answered, ``{"type": "custom", "schema": {...}}`` (the item's schema and, with
    ``include_sample_schema``, the sample's), or a 400 naming the field."""
    if not isinstance(raw, Mapping) or "type" not in raw:
        raise bad_request("data_source_config must be an object with a type: 'custom'.", param)
    kind = raw["type"]
    if not isinstance(kind, str):
        raise bad_request("data_source_config type must be the string 'custom'.", f"{param}.type")
    if kind in UNSUPPORTED_CONFIGS:
        raise bad_request(
            f"data_source_config type '{kind}' is not available: {UNSUPPORTED_CONFIGS[kind]}. Use "
            "{'type': 'custom', 'item_schema': {...}} and give the items in each run's data_source (a jsonl file "
            "or inline content).",
            f"{param}.type",
            "unsupported_data_source",
        )
    if kind != "custom":
        raise bad_request(f"data_source_config type must be 'custom'; got {kind!r}.", f"{param}.type")
    unknown = sorted(set(raw) - {"type", "item_schema", "include_sample_schema"})
    if unknown:
        raise bad_request(f"Unknown key {unknown[0]!r} in a custom data_source_config.", f"{param}.{unknown[0]}")
    schema = raw.get("item_schema")
    _check_item_schema(schema, f"{param}.item_schema")
    include_sample = raw.get("include_sample_schema", False)
    if not isinstance(include_sample, bool):
        raise bad_request("include_sample_schema must be true or false.", f"{param}.include_sample_schema")
    properties: dict[str, Any] = {"item": schema}
    if include_sample:
        properties["sample"] = SAMPLE_SCHEMA
    return {"type": "custom", "schema": {"type": "object", "properties": properties, "required": list(properties)}}


def _check_item_schema(schema: object, param: str) -> None:
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise bad_request(
            "item_schema must be a JSON Schema of an object: {'type': 'object', 'properties': {...}}.", param
        )
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise bad_request(f"item_schema must be at most {MAX_SCHEMA_BYTES} bytes of JSON.", param)
    found = jsonschemas.problem(schema, param, what="item_schema") or _reference(schema, param)
    if found is not None:
        raise bad_request(found[1], found[0])


REFERENCES = ("$ref", "$dynamicRef", "$id", "$anchor", "$dynamicAnchor", "$recursiveRef")


def _reference(node: Any, where: str) -> tuple[str, str] | None:
    """An item schema refers to nothing, within it or without: each item is checked by the API and
    the worker, and references can make a small schema cost exponential time an item."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key in REFERENCES:
                return f"{where}.{key}", f"item_schema may not use {key}: write the schema out in full."
            found = _reference(value, f"{where}.{key}")
            if found is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _reference(value, f"{where}.{i}")
            if found is not None:
                return found
    return None


def item_schema(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(config["schema"]["properties"]["item"])


def check_criteria_fit(criteria: list[Criterion], config: Mapping[str, Any], param: str = "testing_criteria") -> None:
    """Every ``item.<key>`` a criterion reads is a property of the item schema (where it lists any):
    a 400 naming the criterion otherwise."""
    schema = item_schema(config)
    known = schema.get("properties")
    if not isinstance(known, Mapping) or schema.get("additionalProperties") not in (None, False):
        return  # a schema open to any key: nothing to hold the references to
    for i, key in item_keys(criteria):
        if key not in known:
            listed = ", ".join(sorted(known)) or "none"
            raise bad_request(
                f"Testing criterion '{criteria[i].name}' reads item.{key}, which the item_schema does not have "
                f"(its properties: {listed}). Add it to the item_schema or change the template.",
                f"{param}.{i}",
            )


@dataclass
class RunSource:
    """A run's ``data_source``, checked. ``answered``: as the run answers it (inline content apart)."""

    kind: str  # jsonl | completions
    answered: dict[str, Any]
    file_id: str | None = None
    content: list[dict[str, Any]] | None = None
    model: str | None = None
    input_messages: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


SAMPLING_KEYS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "max_completion_tokens": (1, 4096), "seed": (0, 2**62)}


def run_source(raw: object, param: str = "data_source") -> RunSource:
    """The run's data source, or a 400 naming the field."""
    if not isinstance(raw, Mapping) or "type" not in raw:
        raise bad_request("data_source must be an object with a type: 'jsonl' or 'completions'.", param)
    kind = raw["type"]
    if not isinstance(kind, str):
        raise bad_request("data_source type must be the string 'jsonl' or 'completions'.", f"{param}.type")
    if kind == "responses":
        raise bad_request(
            "data_source type 'responses' is not available: this server has no Responses API. Use 'completions' "
            "with a model of this project.",
            f"{param}.type",
            "unsupported_data_source",
        )
    if kind not in ("jsonl", "completions"):
        raise bad_request(f"data_source type must be 'jsonl' or 'completions'; got {kind!r}.", f"{param}.type")
    allowed = {"type", "source"} | ({"model", "input_messages", "sampling_params"} if kind == "completions" else set())
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise bad_request(f"Unknown key {unknown[0]!r} in a {kind} data_source.", f"{param}.{unknown[0]}")
    source = _source(raw.get("source"), f"{param}.source")
    answered: dict[str, Any] = {"type": kind, "source": source.answered}
    if kind == "jsonl":
        return RunSource("jsonl", answered, source.file_id, source.content)
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "A completions data_source needs the model that answers: one of GET /v1/models.", f"{param}.model"
        )
    messages = _input_messages(raw.get("input_messages"), f"{param}.input_messages")
    sampling = _sampling(raw.get("sampling_params"), f"{param}.sampling_params")
    answered |= {"model": model, "input_messages": messages, "sampling_params": sampling}
    return RunSource("completions", answered, source.file_id, source.content, model, messages, sampling)


def _source(raw: object, param: str) -> RunSource:
    if not isinstance(raw, Mapping) or raw.get("type") not in ("file_id", "file_content"):
        kind = raw.get("type") if isinstance(raw, Mapping) else None
        if kind == "stored_completions":
            raise bad_request(
                "source type 'stored_completions' is not available: this server stores no completions. Give the "
                "items as a file ('file_id') or inline ('file_content').",
                f"{param}.type",
                "unsupported_data_source",
            )
        raise bad_request(
            "source must be {'type': 'file_id', 'id': ...} or {'type': 'file_content', 'content': [...]}.", param
        )
    if raw["type"] == "file_id":
        file_id = raw.get("id")
        if not isinstance(file_id, str) or not file_id or len(file_id) > 64:
            raise bad_request("A file_id source needs the id of a file uploaded with purpose 'evals'.", f"{param}.id")
        return RunSource("", {"type": "file_id", "id": file_id}, file_id=file_id)
    content = raw.get("content")
    if not isinstance(content, list) or not content:
        raise bad_request(
            "A file_content source needs 'content': a non-empty list of {'item': {...}}.", f"{param}.content"
        )
    if len(json.dumps(content)) > MAX_INLINE_BYTES:
        raise bad_request(
            f"Inline content is at most {MAX_INLINE_BYTES // 1024} KiB of JSON (every answer of the run repeats it); "
            "upload the items as a file (purpose 'evals') and give {'type': 'file_id', 'id': ...}.",
            f"{param}.content",
        )
    return RunSource("", {"type": "file_content"}, content=content)


def _input_messages(raw: object, param: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping) or raw.get("type") not in ("template", "item_reference"):
        raise bad_request(
            "input_messages must be {'type': 'template', 'template': [{'role': 'user', 'content': "
            "'{{item.question}}'}]} or {'type': 'item_reference', 'item_reference': 'item.messages'}.",
            param,
        )
    if raw["type"] == "item_reference":
        ref = raw.get("item_reference")
        if not isinstance(ref, str) or not ref.startswith("item.") or len(ref) < 6:
            raise bad_request(
                "item_reference names a key of the item holding its messages: 'item.<key>'.", f"{param}.item_reference"
            )
        return {"type": "item_reference", "item_reference": ref}
    template = raw.get("template")
    if not isinstance(template, list) or not template:
        raise bad_request("template must be a non-empty list of messages.", f"{param}.template")
    return {
        "type": "template",
        "template": [_template_message(m, f"{param}.template.{i}") for i, m in enumerate(template)],
    }


ROLES = ("system", "developer", "user", "assistant")


def _template_message(raw: object, param: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping) or raw.get("role") not in ROLES:
        raise bad_request(f"Each template message needs a role ({', '.join(ROLES)}) and a content.", param)
    content = raw.get("content")
    if isinstance(content, Mapping) and content.get("type") in ("input_text", "output_text"):
        content = content.get("text")
    if not isinstance(content, str):
        raise bad_request(
            "A template message's content must be text (a string, or an input_text part).", f"{param}.content"
        )
    try:
        templates.validate(content, param=f"{param}.content")
    except Exception as exc:
        raise bad_request(getattr(exc, "message", str(exc)), f"{param}.content") from None
    if "sample" in templates.template_namespaces(content):
        raise bad_request(
            "An input message is written before the answer: it may read item.<key>, not sample.", f"{param}.content"
        )
    out = {"role": raw["role"], "content": content}
    if raw.get("type") == "message":
        out["type"] = "message"
    return out


def _sampling(raw: object, param: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise bad_request("sampling_params must be an object.", param)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in SAMPLING_KEYS:
            raise bad_request(
                f"sampling_params.{key} is not available here; the ones taken are {', '.join(SAMPLING_KEYS)}.",
                f"{param}.{key}",
            )
        low, high = SAMPLING_KEYS[key]
        integral = key in ("max_completion_tokens", "seed")
        if (
            isinstance(value, bool)
            or not isinstance(value, int if integral else (int, float))
            or not low <= value <= high
        ):
            kind = "an integer" if integral else "a number"
            raise bad_request(f"sampling_params.{key} must be {kind} from {low} to {high}.", f"{param}.{key}")
        out[key] = value
    return out


def message_keys(messages: Mapping[str, Any]) -> set[str]:
    """The item keys a run's ``input_messages`` read."""
    if messages["type"] == "item_reference":
        return {messages["item_reference"].split(".")[1]}
    return {key for m in messages["template"] for key in templates.template_item_keys(m["content"])}

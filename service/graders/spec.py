"""Grader specs: JSON in, a parsed ``Grader`` out, or a ``GraderError`` naming the field to fix.

One parser per grader type, in ``PARSERS``; the keys a spec may hold come from its class
(``required``, ``optional``). A spec is parsed once in each process that uses it: at the API when a
job is created (or a grader validated), and again in the worker, from the grader's ``to_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from service.core.settings import redact_url
from service.graders import formula
from service.graders.similarity import EVALUATION_METRICS, MODEL_METRICS
from service.graders.templates import template_item_keys, validate
from service.graders.types import (
    STRING_CHECK_OPERATIONS,
    ChatJudgeGrader,
    CosineGrader,
    Grader,
    GraderError,
    HttpGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    RewardModelGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    describe,
    leaves,
)
from service.infra.egress import url_under

__all__ = [
    "MAX_GRADER_DEPTH",
    "PARSERS",
    "PYTHON_GRADER_DISABLED",
    "first_missing_item_key",
    "grader_to_dict",
    "is_model_grader",
    "model_leaves",
    "openai_typed",
    "parse_grader",
    "referenced_item_keys",
]

MAX_GRADER_DEPTH = 8
"""Deepest nesting of ``multi`` graders; bounds recursion on a hostile JSON spec."""

PYTHON_GRADER_DISABLED = (
    "the python grader is disabled on this server; the operator enables it with RLOO_ALLOW_PYTHON_GRADER=1"
)


def parse_grader(spec: object, *, param: str = "grader", allow_python: bool = False) -> Grader:
    """Validate a JSON-like grader spec and return its immutable parsed form.

    ``param`` is the dotted path of ``spec`` in the request body; errors extend it to the exact
    field. ``allow_python`` is the operator's ``RLOO_ALLOW_PYTHON_GRADER`` setting.
    """
    return _parse(spec, param=param, allow_python=allow_python, depth=0)


@dataclass(frozen=True)
class Spec:
    """One grader's spec as its parser reads it: typed look-ups whose errors name the field."""

    raw: Mapping[str, object]
    param: str
    kind: str
    allow_python: bool
    depth: int

    def at(self, key: str) -> str:
        return f"{self.param}.{key}"

    def string(self, key: str) -> str:
        value = self.raw[key]
        if not isinstance(value, str):
            raise GraderError(
                f"{key} of a {self.kind} grader must be a string; got {describe(value)}", param=self.at(key)
            )
        return value

    def nonempty(self, key: str) -> str:
        value = self.string(key)
        if not value.strip():
            raise GraderError(f"{key} of a {self.kind} grader must not be empty", param=self.at(key))
        return value

    def flag(self, key: str) -> bool:
        """An optional boolean: False when absent."""
        value = self.raw.get(key, False)
        if not isinstance(value, bool):
            raise GraderError(
                f"{key} of a {self.kind} grader must be true or false; got {describe(value)}", param=self.at(key)
            )
        return value

    def template(self, key: str) -> str:
        value = self.string(key)
        validate(value, param=self.at(key))
        return value

    def sub(self, spec: object, param: str) -> Grader:
        """A sub-grader of a ``multi``, one level deeper."""
        return _parse(spec, param=param, allow_python=self.allow_python, depth=self.depth + 1)


Parser = Callable[[Spec, str], Grader]
"""``(spec, name) -> grader``: the keys are known to be allowed and the required ones present."""


def _parse(spec: object, *, param: str, allow_python: bool, depth: int) -> Grader:
    if not isinstance(spec, Mapping):
        raise GraderError(f"a grader must be a JSON object with a 'type'; got {describe(spec)}", param=param)
    types = ", ".join(sorted(PARSERS))
    if "type" not in spec:
        raise GraderError(f"type is required; use one of {types}", param=f"{param}.type")
    kind = spec["type"]
    if not isinstance(kind, str) or kind not in PARSERS:
        got = repr(kind) if isinstance(kind, str) else describe(kind)
        raise GraderError(f"unknown grader type {got}; use one of {types}", param=f"{param}.type")
    if kind == PythonGrader.type and not allow_python:
        raise GraderError(PYTHON_GRADER_DISABLED, param=f"{param}.type")

    cls, parser = PARSERS[kind]
    allowed = ("type", "name", *cls.required, *cls.optional)
    unknown = [str(k) for k in spec if k not in allowed]
    if unknown:
        listed = ", ".join(repr(k) for k in unknown)
        raise GraderError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {listed} in a {kind} grader; "
            f"allowed keys: {', '.join(allowed)}",
            param=f"{param}.{unknown[0]}",
        )
    for key in ("name", *cls.required):
        if key not in spec:
            raise GraderError(f"{key} is required in a {kind} grader", param=f"{param}.{key}")
    fields = Spec(spec, param, kind, allow_python, depth)
    return parser(fields, fields.nonempty("name"))


def _string_check(spec: Spec, name: str) -> StringCheckGrader:
    operation = spec.string("operation")
    if operation not in STRING_CHECK_OPERATIONS:
        raise GraderError(
            f"operation must be one of {', '.join(STRING_CHECK_OPERATIONS)}; got {operation!r}",
            param=spec.at("operation"),
        )
    return StringCheckGrader(
        name=name, input=spec.template("input"), reference=spec.template("reference"), operation=operation
    )


def _text_similarity(spec: Spec, name: str) -> TextSimilarityGrader:
    metric = spec.string("evaluation_metric")
    if metric not in EVALUATION_METRICS:
        raise GraderError(
            f"evaluation_metric must be one of {', '.join(EVALUATION_METRICS)} on this server; got {metric!r}",
            param=spec.at("evaluation_metric"),
        )
    cls = CosineGrader if metric in MODEL_METRICS else TextSimilarityGrader
    return cls(name=name, input=spec.template("input"), reference=spec.template("reference"), evaluation_metric=metric)


def _reward_model(spec: Spec, name: str) -> RewardModelGrader:
    model = spec.nonempty("model")
    template = spec.template("input") if spec.raw.get("input") is not None else None
    return RewardModelGrader(name=name, model=model, input=template, remote=spec.flag("remote"))


JUDGE_SAMPLING = frozenset({"max_tokens", "max_completions_tokens", "temperature", "top_p", "seed", "reasoning_effort"})
"""OpenAI's ``sampling_params`` of a judge. Ours answers greedily, so only the length matters."""


def _judge_messages(spec: Spec) -> tuple[tuple[str, str], ...]:
    """A judge's ``input``: (role, content template) per message; a developer message is a system one."""
    messages = spec.raw["input"]
    if not isinstance(messages, list) or not messages:
        raise GraderError(
            f'input of a {spec.kind} grader must be a non-empty list of {{"role", "content"}} messages',
            param=spec.at("input"),
        )
    parsed: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = spec.at(f"input.{i}")
        if not isinstance(message, Mapping) or set(message) - {"role", "content", "type"} or "content" not in message:
            raise GraderError('each input message is {"role": ..., "content": "..."}', param=where)
        role, content = message.get("role", "user"), _text_content(message["content"], f"{where}.content")
        if role not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
            raise GraderError("role must be system, developer, user or assistant, and content a string", param=where)
        validate(content, param=f"{where}.content")
        parsed.append(("system" if role == "developer" else role, content))
    return tuple(parsed)


def _score_model(spec: Spec, name: str) -> ScoreModelGrader:
    model = spec.nonempty("model")
    messages = _judge_messages(spec)
    low_high = spec.raw.get("range", [0, 1])
    if (
        not isinstance(low_high, list)
        or len(low_high) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in low_high)
        or not low_high[0] < low_high[1]
    ):
        raise GraderError(
            f"range must be [low, high] with low < high; got {describe(low_high)}", param=spec.at("range")
        )
    sampling = spec.raw.get("sampling_params")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, Mapping) or set(sampling) - JUDGE_SAMPLING:
        raise GraderError(
            f"sampling_params may set {', '.join(sorted(JUDGE_SAMPLING))} (the judge answers greedily: temperature, "
            "top_p, seed and reasoning_effort are accepted and change nothing)",
            param=spec.at("sampling_params"),
        )
    max_tokens = sampling.get("max_tokens", sampling.get("max_completions_tokens", 16))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
        raise GraderError(
            "sampling_params.max_tokens must be an integer in 1..256", param=spec.at("sampling_params.max_tokens")
        )
    return ScoreModelGrader(
        name=name,
        model=model,
        input=messages,
        range=(float(low_high[0]), float(low_high[1])),
        max_tokens=max_tokens,
    )


MAX_LABELS = 64
"""Most labels a label_model grader may offer (each is scored on every sample)."""


def _label_model(spec: Spec, name: str) -> LabelModelGrader:
    model = spec.nonempty("model")
    messages = _judge_messages(spec)
    labels = _labels(spec, "labels")
    if len(labels) > MAX_LABELS:
        raise GraderError(f"labels may list at most {MAX_LABELS} labels; got {len(labels)}", param=spec.at("labels"))
    passing = _labels(spec, "passing_labels")
    strays = [label for label in passing if label not in labels]
    if strays:
        raise GraderError(
            f"passing_labels must be a subset of labels; {strays[0]!r} is not one of them",
            param=spec.at("passing_labels"),
        )
    return LabelModelGrader(name=name, model=model, input=messages, labels=labels, passing_labels=passing)


def _labels(spec: Spec, key: str) -> tuple[str, ...]:
    value = spec.raw[key]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(label, str) and label.strip() for label in value)
        or len(set(value)) != len(value)
    ):
        raise GraderError(
            f"{key} of a label_model grader must be a non-empty list of distinct, non-empty strings; "
            f"got {describe(value)}",
            param=spec.at(key),
        )
    return tuple(value)


def _text_content(content: object, param: str) -> object:
    """A judge message's content as text: a string, or OpenAI's structured content (an
    ``input_text``/``output_text`` part, or a list of them, joined by new lines)."""
    parts = content if isinstance(content, list) else [content] if isinstance(content, Mapping) else None
    if parts is None:
        return content
    texts = []
    for i, part in enumerate(parts):
        is_text = isinstance(part, Mapping) and part.get("type") in ("input_text", "output_text")
        if isinstance(part, str):
            texts.append(part)
        elif is_text and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else describe(part)
            raise GraderError(
                f"content part {kind!r} is not text; the judges here read input_text and output_text parts only",
                param=f"{param}.{i}" if isinstance(content, list) else param,
            )
    return "\n".join(texts)


def _python(spec: Spec, name: str) -> PythonGrader:
    image_tag = spec.raw.get("image_tag")
    if image_tag is not None and not isinstance(image_tag, str):
        raise GraderError("image_tag must be a string (it is kept and ignored here)", param=spec.at("image_tag"))
    return PythonGrader(name=name, source=spec.nonempty("source"), image_tag=image_tag)


def _http(spec: Spec, name: str) -> HttpGrader:
    from service.core.settings import get_settings

    url = spec.nonempty("url")
    allowed = get_settings().http_grader_urls
    if not any(url_under(url, prefix) for prefix in allowed):
        # The operator's prefixes may hold credentials (user:password@): never shown to a caller.
        shown = ", ".join(map(redact_url, allowed))
        where = f"one of: {shown}" if allowed else "none: http graders are off on this server"
        raise GraderError(
            f"url {redact_url(url)!r} is not on the operator's allowlist "
            f"(RLOO_HTTP_GRADER_URLS, URL prefixes; {where})",
            param=spec.at("url"),
        )
    timeout = spec.raw.get("timeout_seconds", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 120:
        raise GraderError(
            f"timeout_seconds must be a number in (0, 120]; got {describe(timeout)}", param=spec.at("timeout_seconds")
        )
    return HttpGrader(name=name, url=url, timeout_seconds=float(timeout))


def _multi(spec: Spec, name: str) -> MultiGrader:
    if spec.depth >= MAX_GRADER_DEPTH:
        raise GraderError(f"multi graders nest at most {MAX_GRADER_DEPTH} deep; flatten this one", param=spec.param)
    form, entries = _sub_specs(spec)
    graders: list[tuple[str, Grader]] = []
    seen: set[str] = set()
    for sub_name, sub_param, where, sub in entries:
        _check_sub_name(sub_name, name, seen, where)
        seen.add(sub_name)
        graders.append((sub_name, spec.sub(sub, sub_param)))
    text = spec.string("calculate_output")
    try:
        parsed = formula.parse(text, [n for n, _ in graders])
    except formula.FormulaError as exc:
        raise GraderError(str(exc), param=spec.at("calculate_output")) from None
    return MultiGrader(name=name, graders=tuple(graders), calculate_output=text, formula=parsed, form=form)


def _sub_specs(spec: Spec) -> tuple[str, list[tuple[str, str, str, object]]]:
    """The form of ``graders`` (``MultiGrader.form``) and ``(formula name, param of its spec, param
    to blame for its name, spec)`` per sub-grader: ``graders`` is one grader (OpenAI's schema), an
    array of named graders (OpenAI's documentation) or an object of name -> grader."""
    raw, param = spec.raw["graders"], spec.at("graders")
    entries: list[tuple[str, str, str, object]] = []
    form = "list"
    if isinstance(raw, Mapping) and isinstance(raw.get("type"), str):  # one grader, named by its name
        sub_name = raw.get("name")
        if not isinstance(sub_name, str) or not sub_name.strip():
            spec.sub(raw, param)
            raise GraderError("name is required", param=f"{param}.name")
        form, entries = "one", [(sub_name, param, f"{param}.name", raw)]
    elif isinstance(raw, Mapping):
        form = "map"
        entries = [(str(key), f"{param}.{key}", f"{param}.{key}", sub) for key, sub in raw.items()]
    elif isinstance(raw, (list, tuple)):
        for i, sub in enumerate(raw):
            sub_param = f"{param}.{i}"
            sub_name = sub.get("name") if isinstance(sub, Mapping) else None
            if not isinstance(sub_name, str) or not sub_name.strip():
                spec.sub(sub, sub_param)  # the sub-grader's own validation gives the precise message
                raise GraderError("name is required", param=f"{sub_param}.name")
            entries.append((sub_name, sub_param, f"{sub_param}.name", sub))
    else:
        raise GraderError(
            f"graders must be a grader, an array of graders or an object of name -> grader; got {describe(raw)}",
            param=param,
        )
    if not entries:
        raise GraderError("graders must contain at least one grader", param=param)
    return form, entries


def _check_sub_name(sub_name: str, multi_name: str, seen: set[str], where: str) -> None:
    """A sub-grader's name is a name in ``calculate_output`` and a label in the job's metrics."""
    if sub_name in seen:
        raise GraderError(f"two sub-graders are named '{sub_name}'; names must be unique", param=where)
    if not formula.IDENTIFIER.fullmatch(sub_name):
        raise GraderError(
            f"sub-grader name '{sub_name}' cannot be used in calculate_output; use letters, "
            "digits and '_', not starting with a digit",
            param=where,
        )
    if sub_name in formula.FUNCTIONS:
        raise GraderError(f"sub-grader name '{sub_name}' is a function of calculate_output; rename it", param=where)
    if sub_name == multi_name:
        raise GraderError(
            f"sub-grader name '{sub_name}' is also the multi grader's own name; rename one "
            "(both label scores in the job's metrics)",
            param=where,
        )


PARSERS: dict[str, tuple[type[Grader], Parser]] = {
    cls.type: (cls, parser)
    for cls, parser in (
        (StringCheckGrader, _string_check),
        (TextSimilarityGrader, _text_similarity),
        (RewardModelGrader, _reward_model),
        (ScoreModelGrader, _score_model),
        (LabelModelGrader, _label_model),
        (MultiGrader, _multi),
        (PythonGrader, _python),
        (HttpGrader, _http),
    )
}
"""Grader type -> (its class, its parser). Adding a type: a class in ``types``, a parser here, a
scorer in ``scoring.SCORERS``."""


# --------------------------------------------------------------------------------------------------
# Questions about a parsed grader
# --------------------------------------------------------------------------------------------------


def grader_to_dict(grader: Grader) -> dict[str, object]:
    """The JSON form of a parsed grader; ``parse_grader(grader_to_dict(g)) == g``."""
    return grader.to_dict()


def model_leaves(grader: Grader, param: str = "grader") -> list[tuple[RewardModelGrader | ChatJudgeGrader, str]]:
    """Leaves naming a model (reward and judge models) with the dotted ``param`` path of each (job
    creation checks their models)."""
    if isinstance(grader, MultiGrader):
        return [pair for name, sub in grader.graders for pair in model_leaves(sub, f"{param}.graders.{name}")]
    return [(grader, param)] if isinstance(grader, (RewardModelGrader, ChatJudgeGrader)) else []


def referenced_item_keys(grader: Grader) -> set[str]:
    """Top-level ``item`` keys that any template in the grader tree references.

    Job creation checks each training-file line has them ("the grader references item.answer, which
    line 3 lacks"). A python grader's references cannot be known statically and add nothing.
    """
    return {key for leaf in leaves(grader) for template in leaf.templates() for key in template_item_keys(template)}


def first_missing_item_key(
    grader: Grader, keys_summary: Mapping[str, Any], *, within: int | None = None
) -> tuple[str, int] | None:
    """The first ``item.`` key the grader uses that some dataset line lacks, with that line's number
    (only lines up to ``within``, where only those are read).

    ``keys_summary`` is an upload's summary: ``{"keys": {key: count}, "first_missing": {key: line}}``.
    """
    keys, first_missing = keys_summary.get("keys", {}), keys_summary.get("first_missing", {})
    for key in sorted(referenced_item_keys(grader)):
        line = 1 if key not in keys else first_missing.get(key)
        if line is not None and (within is None or int(line) <= within):
            return key, int(line)
    return None


def is_model_grader(grader: Grader) -> bool:
    """True if any leaf needs a model (a reward model, a judge, a ``cosine`` similarity): the worker
    scores it."""
    return any(leaf.needs_model for leaf in leaves(grader))


OPENAI_TYPES = frozenset({"string_check", "text_similarity", "python", "score_model", "multi"})
"""The grader types a job's ``method.reinforcement.grader`` may be in OpenAI's schema."""
OPENAI_SUB_TYPES = frozenset({"string_check", "text_similarity", "python", "score_model", "label_model"})
"""The types a ``multi``'s ``graders`` may be there (``label_model`` only inside a ``multi``)."""


def openai_typed(spec: object) -> bool:
    """Whether a stored grader fits OpenAI's grader types as its SDK parses them: its own types, a
    ``multi`` holding one grader object (the schema's form)."""
    if not isinstance(spec, Mapping) or spec.get("type") not in OPENAI_TYPES:
        return False
    if spec["type"] == "multi":
        sub = spec.get("graders")
        return isinstance(sub, Mapping) and sub.get("type") in OPENAI_SUB_TYPES
    return True

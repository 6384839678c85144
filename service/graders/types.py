"""The parsed graders: one immutable dataclass per grader type, and the errors grading raises.

Each class says which JSON keys its spec takes (``required``, ``optional``), which templates it
renders (``templates``: job creation checks every training line has the ``item`` keys they read),
and its JSON form (``fields``; ``to_dict`` adds ``type`` and ``name``). ``spec`` parses a spec into
one of these, ``scoring`` runs it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from service.core.errors import Invalid
from service.graders.formula import Expr
from service.graders.similarity import MODEL_METRICS

NAN = float("nan")


class GraderError(Invalid, ValueError):
    """A grader spec the user must fix (or a grader that cannot run here).

    ``param`` is the dotted path of the offending field, as the API reports it in its error body
    (``method.reinforcement.grader.graders.correct.operation``), so a user can find the field.
    """

    default_code = None  # the caller names it: a job's invalid_grader, an evaluation's evaluation_failed

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message, param=param)
        self.param: str = param


class GraderUnavailable(RuntimeError):
    """A grader that could not score at all (an http grader's endpoint down or broken): the job
    fails with ``grader_unavailable`` rather than training on nothing."""


def describe(value: object) -> str:
    """A short, JSON-flavoured name of a value's type for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


@dataclass
class Sample:
    """One completion to grade, as templates see it (``{{ sample.output_text }}``). A rollout that
    called tools also has ``output_tools`` (each call: ``name``, ``arguments``, ``output``, ``error``),
    ``messages`` (the whole conversation) and ``rollout_id`` (what its http tools were told)."""

    output_text: str
    output_tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] | None = None
    rollout_id: str | None = None

    def fields(self) -> dict[str, Any]:
        """The sample as a python grader and an http grader receive it."""
        out: dict[str, Any] = {"output_text": self.output_text, "output_json": self.output_json}
        extra = {"output_tools": self.output_tools, "messages": self.messages, "rollout_id": self.rollout_id}
        out.update({key: value for key, value in extra.items() if value is not None})
        return out

    @cached_property
    def output_json(self) -> object | None:
        """The completion parsed as JSON, or None when it is not JSON.

        Cached because every template of every grader in a ``multi`` tree may ask for it.
        """
        try:
            parsed: object = json.loads(self.output_text)
            return parsed
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class Grader:
    """Base of the parsed, immutable graders. ``name`` labels its scores in metrics and errors."""

    type: ClassVar[str] = ""
    required: ClassVar[tuple[str, ...]] = ()
    """Keys its spec must have besides ``type`` and ``name``."""
    optional: ClassVar[tuple[str, ...]] = ()
    needs_model: ClassVar[bool] = False
    """Scored with a model the worker loads (rule graders score anywhere)."""
    name: str

    def templates(self) -> tuple[str, ...]:
        """The templates this grader renders (its own, not its sub-graders')."""
        return ()

    def children(self) -> tuple[tuple[str, Grader], ...]:
        """``(name, grader)`` of its sub-graders; only ``multi`` has any."""
        return ()

    def fields(self) -> dict[str, object]:
        """Its spec's keys besides ``type`` and ``name``, as JSON."""
        return {}

    def to_dict(self) -> dict[str, object]:
        """The JSON form; ``parse_grader(g.to_dict()) == g``."""
        return {"type": self.type, "name": self.name, **self.fields()}


STRING_CHECK_OPERATIONS = ("eq", "ne", "like", "ilike")


@dataclass(frozen=True)
class StringCheckGrader(Grader):
    """1.0 if ``input`` compares true to ``reference`` under ``operation``, else 0.0.

    ``eq``/``ne``: exact equality / inequality. ``like``: reference is a substring of input;
    ``ilike``: the same, case-insensitive (OpenAI's semantics).
    """

    type: ClassVar[str] = "string_check"
    required: ClassVar[tuple[str, ...]] = ("input", "reference", "operation")
    input: str
    reference: str
    operation: str

    def templates(self) -> tuple[str, ...]:
        return (self.input, self.reference)

    def fields(self) -> dict[str, object]:
        return {"input": self.input, "reference": self.reference, "operation": self.operation}


@dataclass(frozen=True)
class TextSimilarityGrader(Grader):
    """``metrics.TEXT_SIMILARITY_METRICS[evaluation_metric](input, reference)``, a score in 0..1."""

    type: ClassVar[str] = "text_similarity"
    required: ClassVar[tuple[str, ...]] = ("input", "reference", "evaluation_metric")
    input: str
    reference: str
    evaluation_metric: str

    def __post_init__(self) -> None:
        if (self.evaluation_metric in MODEL_METRICS) != self.needs_model:
            raise TypeError(f"a {self.evaluation_metric} similarity is a CosineGrader (parse_grader picks the class)")

    def templates(self) -> tuple[str, ...]:
        return (self.input, self.reference)

    def fields(self) -> dict[str, object]:
        return {"input": self.input, "reference": self.reference, "evaluation_metric": self.evaluation_metric}


@dataclass(frozen=True)
class CosineGrader(TextSimilarityGrader):
    """``text_similarity`` with ``evaluation_metric: cosine``: the cosine similarity of the sentence
    embeddings of input and reference, from an embedding model the worker loads."""

    needs_model: ClassVar[bool] = True


@dataclass(frozen=True)
class RewardModelGrader(Grader):
    """A Hugging Face sequence classifier (one label) scored on the worker.

    ``input`` is an optional template for the text the model scores; None means the completion
    text. The worker renders it with ``render_reward_model_inputs``. ``remote``: scored by the
    inference workers (``worker.engine.rewards.remote``), not beside the policy.
    """

    type: ClassVar[str] = "reward_model"
    required: ClassVar[tuple[str, ...]] = ("model",)
    optional: ClassVar[tuple[str, ...]] = ("input", "remote")
    needs_model: ClassVar[bool] = True
    model: str
    input: str | None = None
    remote: bool = False

    def templates(self) -> tuple[str, ...]:
        return () if self.input is None else (self.input,)

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"model": self.model}
        if self.input is not None:
            out["input"] = self.input
        if self.remote:
            out["remote"] = True
        return out


@dataclass(frozen=True)
class ChatJudgeGrader(Grader):
    """Base of the graders where a local causal LM (``model``, under the models root) reads ``input``,
    chat messages whose contents are templates. Scored on the worker."""

    needs_model: ClassVar[bool] = True
    model: str
    input: tuple[tuple[str, str], ...]
    """(role, content template) per message."""

    def templates(self) -> tuple[str, ...]:
        return tuple(content for _, content in self.input)

    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.input]


@dataclass(frozen=True)
class ScoreModelGrader(ChatJudgeGrader):
    """An LLM judge: the model answers ``input`` greedily, and the first number of its answer,
    clamped into ``range``, is the score (``parse_judge_score`` reads the answer)."""

    type: ClassVar[str] = "score_model"
    required: ClassVar[tuple[str, ...]] = ("model", "input")
    optional: ClassVar[tuple[str, ...]] = ("range", "sampling_params")
    range: tuple[float, float] = (0.0, 1.0)
    max_tokens: int = 16

    def fields(self) -> dict[str, object]:
        return {
            "model": self.model,
            "input": self.messages(),
            "range": list(self.range),
            "sampling_params": {"max_tokens": self.max_tokens},
        }


@dataclass(frozen=True)
class LabelModelGrader(ChatJudgeGrader):
    """A classifier judge: the model's answer to ``input`` is the one of ``labels`` it gives the
    highest probability (the sum of the label's token log-probs after the rendered messages: a
    choice constrained to the labels, as OpenAI's structured output is). 1.0 when that label is one
    of ``passing_labels``, else 0.0."""

    type: ClassVar[str] = "label_model"
    required: ClassVar[tuple[str, ...]] = ("model", "input", "labels", "passing_labels")
    labels: tuple[str, ...] = ()
    passing_labels: tuple[str, ...] = ()

    def fields(self) -> dict[str, object]:
        return {
            "model": self.model,
            "input": self.messages(),
            "labels": list(self.labels),
            "passing_labels": list(self.passing_labels),
        }


@dataclass(frozen=True)
class PythonGrader(Grader):
    """User Python code, ``def grade(sample, item) -> float``; parsed only when the operator allows
    it, run in a sandboxed process (``service.graders.sandbox``)."""

    type: ClassVar[str] = "python"
    required: ClassVar[tuple[str, ...]] = ("source",)
    optional: ClassVar[tuple[str, ...]] = ("image_tag",)
    source: str
    image_tag: str | None = None
    """OpenAI's image to run in: kept and ignored (graders run in this server's sandbox)."""

    def fields(self) -> dict[str, object]:
        return (
            {"source": self.source} if self.image_tag is None else {"source": self.source, "image_tag": self.image_tag}
        )


@dataclass(frozen=True)
class HttpGrader(Grader):
    """Scores by an HTTP endpoint of the user's (an operator-allowlisted URL): a POST of the batch,
    ``{"samples": [{"sample": {...}, "item": {...}}, ...]}``, answered ``{"scores": [number|null]}``."""

    type: ClassVar[str] = "http"
    required: ClassVar[tuple[str, ...]] = ("url",)
    optional: ClassVar[tuple[str, ...]] = ("timeout_seconds",)
    url: str
    timeout_seconds: float = 10.0

    def fields(self) -> dict[str, object]:
        return {"url": self.url, "timeout_seconds": self.timeout_seconds}


@dataclass(frozen=True)
class MultiGrader(Grader):
    """Sub-graders combined by ``calculate_output``, a formula over their names.

    ``graders`` is a tuple of ``(name, grader)`` pairs rather than a dict so the dataclass stays
    immutable and hashable; ``graders_by_name`` gives the mapping. ``formula`` is the parsed form of
    ``calculate_output`` and is not part of equality (it is derived from it). ``form`` is how the
    sub-graders came in and go out of ``to_dict``: ``one`` grader object (OpenAI's schema), a
    ``list`` of named graders (OpenAI's documentation) or a ``map`` of name -> grader.
    """

    type: ClassVar[str] = "multi"
    required: ClassVar[tuple[str, ...]] = ("graders", "calculate_output")
    graders: tuple[tuple[str, Grader], ...]
    calculate_output: str
    formula: Expr = field(compare=False, repr=False)
    form: str = field(default="map", compare=False)

    @property
    def graders_by_name(self) -> dict[str, Grader]:
        return dict(self.graders)

    def children(self) -> tuple[tuple[str, Grader], ...]:
        return self.graders

    def fields(self) -> dict[str, object]:
        graders: object = {name: sub.to_dict() for name, sub in self.graders}
        if self.form == "list":
            graders = [sub.to_dict() for _, sub in self.graders]
        elif self.form == "one":
            graders = self.graders[0][1].to_dict()
        return {"graders": graders, "calculate_output": self.calculate_output}


def leaves(grader: Grader) -> list[Grader]:
    """The graders of a tree that score by themselves (every grader but a ``multi``)."""
    if not grader.children():
        return [grader]
    return [leaf for _, sub in grader.children() for leaf in leaves(sub)]


def finite_or_nan(value: object) -> float:
    """``value`` as a float, or NaN when it is none or not finite: a score grading can average."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return NAN
    return number if math.isfinite(number) else NAN

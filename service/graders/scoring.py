"""Running graders on a batch: one scorer per grader class, in one table.

``SCORERS`` maps each grader class to the function that scores a batch with it. Rule graders score
anywhere; a grader that needs a model (``needs_model``) scores only where the worker has put its own
scorer in the table (``worker.engine.rewards.scoring.model_scorers``): here it raises a ``GraderError`` saying so.

A completion that cannot be scored (a missing template key, a non-finite value, a division by zero)
gets a NaN reward, never an exception: RLOO leaves NaN out of its group's baseline (see
docs/algorithm.md), and one bad sample must not kill a training step. Scoring is batched so that a
model leaf costs one forward pass per batch, not per sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from service.graders import formula
from service.graders.httpgrader import grade_http
from service.graders.similarity import TEXT_SIMILARITY_METRICS
from service.graders.templates import TemplateKeyError, render, render_batch
from service.graders.types import (
    NAN,
    ChatJudgeGrader,
    CosineGrader,
    Grader,
    GraderError,
    GraderUnavailable,
    HttpGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    RewardModelGrader,
    Sample,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    finite_or_nan,
)

__all__ = [
    "SCORERS",
    "Batch",
    "GradeResult",
    "Scorer",
    "grade_batch",
    "grade_one",
    "parse_judge_score",
    "render_judge_messages",
    "render_pairs",
    "render_reward_model_inputs",
]


@dataclass
class GradeResult:
    """Scores of one batch, index-aligned with its samples.

    ``rewards``: the reward per sample, NaN where it could not be scored.
    ``sub_rewards``: scores per grader: for a ``multi``, each sub-grader by name (nested ones as
    ``outer.inner``); for a single grader, ``{its name: rewards}``.
    ``errors``: how many NaN each grader produced (root by its name, sub-graders as in
    ``sub_rewards``); graders without NaN are left out, so a clean batch gives ``{}``.
    """

    rewards: list[float]
    sub_rewards: dict[str, list[float]]
    errors: dict[str, int]
    messages: dict[str, str] = field(default_factory=dict)
    """The first error message of each grader that gave one (python graders: why a sample failed)."""

    @classmethod
    def joined(cls, parts: list[GradeResult]) -> GradeResult:
        """The results of consecutive parts of a batch (a job's ranks' shares) as the batch's."""
        if len(parts) == 1:
            return parts[0]
        errors: dict[str, int] = {}
        messages: dict[str, str] = {}
        for part in parts:
            for name, count in part.errors.items():
                errors[name] = errors.get(name, 0) + count
            for name, message in part.messages.items():
                messages.setdefault(name, message)
        return cls(
            rewards=[r for part in parts for r in part.rewards],
            sub_rewards={name: [v for part in parts for v in part.sub_rewards[name]] for name in parts[0].sub_rewards},
            errors=errors,
            messages=messages,
        )


@dataclass(frozen=True)
class Batch:
    """The batch being graded, as each scorer sees it: ``samples[i]`` completes the line ``items[i]``.

    ``path`` is the dotted name of the grader being scored inside a ``multi`` ("" for the root);
    ``sub_rewards`` and ``messages`` are shared by the whole tree and filled as it is scored.
    """

    samples: Sequence[Sample]
    items: Sequence[Mapping[str, object]]
    scorers: Mapping[type[Grader], Scorer]
    path: str = ""
    sub_rewards: dict[str, list[float]] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)

    def score(self, grader: Grader) -> list[float]:
        """One finite score or NaN per sample, by the table's scorer for ``grader``'s class."""
        scorer = self.scorers.get(type(grader))
        if scorer is None:
            raise TypeError(f"no scorer for {type(grader).__name__}: {grader!r}")
        if not self.samples and not grader.children():  # a multi still reports each sub-grader
            return []
        scores = list(scorer(grader, self))
        if len(scores) != len(self.samples):
            raise ValueError(f"the {grader.type} scorer returned {len(scores)} scores for {len(self.samples)} samples")
        return [finite_or_nan(s) for s in scores]

    def at(self, name: str) -> Batch:
        """The same batch, for the sub-grader ``name`` of the grader at ``path``."""
        return replace(self, path=f"{self.path}.{name}" if self.path else name)

    def note(self, grader: Grader, message: str) -> None:
        """Keep the first message that explains a grader's NaN scores."""
        self.messages.setdefault(self.path or grader.name, message)


Scorer = Callable[[Any, Batch], Sequence[float]]
"""``(grader, batch) -> one score per sample``; NaN (or any non-finite value) where unscored."""


def grade_batch(
    grader: Grader,
    samples: Sequence[Sample],
    items: Sequence[Mapping[str, object]],
    *,
    scorers: Mapping[type[Grader], Scorer] | None = None,
) -> GradeResult:
    """Score a batch: ``samples[i]`` is a completion of the training line ``items[i]``.

    ``scorers`` add to (or replace entries of) ``SCORERS``: the worker passes its model scorers.
    Never raises for one bad sample (it gets NaN); raises ``GraderError`` when the grader cannot run
    here at all (a reward model without a scorer for it).
    """
    if len(samples) != len(items):
        raise ValueError(f"got {len(samples)} samples but {len(items)} items; pass one item each")
    batch = Batch(samples, items, {**SCORERS, **(scorers or {})})
    rewards = batch.score(grader)
    sub_rewards = batch.sub_rewards if isinstance(grader, MultiGrader) else {grader.name: rewards}
    errors: dict[str, int] = {}
    for name, column in ((grader.name, rewards), *sub_rewards.items()):
        count = sum(1 for r in column if math.isnan(r))
        if count:
            errors[name] = count
    return GradeResult(rewards=rewards, sub_rewards=sub_rewards, errors=errors, messages=batch.messages)


def grade_one(
    grader: Grader,
    sample: Sample,
    item: Mapping[str, object],
    *,
    scorers: Mapping[type[Grader], Scorer] | None = None,
) -> tuple[float, dict[str, float]]:
    """Score one completion, as ``POST /graders/run`` does: ``(reward, {grader name: score})``."""
    result = grade_batch(grader, [sample], [item], scorers=scorers)
    return result.rewards[0], {name: column[0] for name, column in result.sub_rewards.items()}


# --------------------------------------------------------------------------------------------------
# What model scorers render (the worker's, in worker.engine.rewards.scoring)
# --------------------------------------------------------------------------------------------------


def render_pairs(
    grader: StringCheckGrader | TextSimilarityGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]
) -> list[tuple[str, str] | None]:
    """(input, reference) per sample; None where a template misses a key."""
    inputs = render_batch(grader.input, samples, items)
    references = render_batch(grader.reference, samples, items)
    return [None if a is None or b is None else (a, b) for a, b in zip(inputs, references, strict=True)]


def render_reward_model_inputs(
    grader: RewardModelGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]
) -> list[str | None]:
    """The text a reward model scores per sample (its ``input``, or the completion); None where the
    template misses a key: the scorer gives those NaN."""
    if grader.input is None:
        return [s.output_text for s in samples]
    return render_batch(grader.input, samples, items)


def render_judge_messages(
    grader: ChatJudgeGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]
) -> list[list[dict[str, str]] | None]:
    """The judge's chat messages per sample; None where a template misses a key."""
    out: list[list[dict[str, str]] | None] = []
    for sample, item in zip(samples, items, strict=True):
        try:
            out.append(
                [{"role": role, "content": render(content, sample=sample, item=item)} for role, content in grader.input]
            )
        except TemplateKeyError:
            out.append(None)
    return out


_JUDGE_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_judge_score(answer: str, low: float, high: float) -> float:
    """The first number in a judge's answer, clamped into [low, high]; NaN when there is none."""
    match = _JUDGE_NUMBER.search(answer)
    if match is None:
        return NAN
    value = float(match.group())
    return float(min(high, max(low, value))) if math.isfinite(value) else NAN


# --------------------------------------------------------------------------------------------------
# The scorers
# --------------------------------------------------------------------------------------------------


def _string_check(grader: StringCheckGrader, batch: Batch) -> list[float]:
    compare = _OPERATIONS[grader.operation]
    pairs = render_pairs(grader, batch.samples, batch.items)
    return [NAN if pair is None else float(compare(*pair)) for pair in pairs]


_OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": lambda text, reference: text == reference,
    "ne": lambda text, reference: text != reference,
    "like": lambda text, reference: reference in text,
    "ilike": lambda text, reference: reference.casefold() in text.casefold(),
}


def _text_similarity(grader: TextSimilarityGrader, batch: Batch) -> list[float]:
    metric = TEXT_SIMILARITY_METRICS[grader.evaluation_metric]
    pairs = render_pairs(grader, batch.samples, batch.items)
    return [NAN if pair is None else finite_or_nan(metric(*pair)) for pair in pairs]


def _python(grader: PythonGrader, batch: Batch) -> list[float]:
    from service.core.settings import get_settings
    from service.graders.sandbox import Limits, SandboxUnavailable, run_python_grader

    settings = get_settings()
    limits = Limits(
        per_sample_seconds=settings.python_grader_seconds,
        batch_seconds=settings.python_grader_seconds * len(batch.samples) + 10,
        memory_mb=settings.python_grader_memory_mb,
    )
    try:
        outcomes = run_python_grader(
            grader.source,
            [s.fields() for s in batch.samples],
            [dict(item) for item in batch.items],
            limits,
        )
    except SandboxUnavailable as exc:
        raise GraderUnavailable(f"python grader '{grader.name}': {exc}") from None
    first_error = next((o.error for o in outcomes if o.error), None)
    if first_error is not None:
        batch.note(grader, first_error)
    return [o.score for o in outcomes]


def _http(grader: HttpGrader, batch: Batch) -> list[float]:
    return grade_http(grader, batch.samples, batch.items)


def _multi(grader: MultiGrader, batch: Batch) -> list[float]:
    columns: dict[str, list[float]] = {}
    for name, sub in grader.graders:
        sub_batch = batch.at(name)
        columns[name] = sub_batch.score(sub)
        batch.sub_rewards[sub_batch.path] = columns[name]
    rewards = []
    for i in range(len(batch.samples)):
        value = formula.evaluate(grader.formula, {name: column[i] for name, column in columns.items()})
        rewards.append(value if math.isfinite(value) else NAN)
    return rewards


def _needs_a_model(grader: Grader, batch: Batch) -> list[float]:
    """Where no model scorer was given (the API, a rule-only process): say where such graders run."""
    what, key = (
        ("the embedding model", "evaluation_metric")
        if isinstance(grader, CosineGrader)
        else ("its model loaded", "model")
    )
    raise GraderError(
        f"{grader.type} grader '{grader.name}' needs {what}; model graders run on the worker",
        param=f"{batch.path or grader.name}.{key}",
    )


SCORERS: dict[type[Grader], Scorer] = {
    StringCheckGrader: _string_check,
    TextSimilarityGrader: _text_similarity,
    CosineGrader: _needs_a_model,
    RewardModelGrader: _needs_a_model,
    ScoreModelGrader: _needs_a_model,
    LabelModelGrader: _needs_a_model,
    PythonGrader: _python,
    HttpGrader: _http,
    MultiGrader: _multi,
}
"""Grader class -> its scorer. Model graders' entries only refuse: the worker replaces them."""

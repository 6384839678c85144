"""An eval's ``testing_criteria``: each one of OpenAI's eval graders (``string_check``,
``text_similarity``, ``label_model``, ``score_model``, ``python``) or ours (``reward_model``, ``http``,
``multi``), parsed by the graders' own parser (``service.graders``: the same rules and messages as a
job's grader), with the score at which an item passes it.

``string_check`` and ``label_model`` score 0 or 1 and pass at 1 (they take no ``pass_threshold``, as
OpenAI's); ``text_similarity`` needs a ``pass_threshold``; the others take one and pass without it at
the middle of their scores (0.5; a ``score_model``'s ``range`` says its own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service import graders
from service.core.errors import bad_request
from service.graders.templates import template_namespaces

MAX_CRITERIA = 16
BINARY = frozenset({"string_check", "label_model"})
"""Criteria that score 0 or 1 and pass at 1; a ``pass_threshold`` on them is refused."""
THRESHOLD_REQUIRED = frozenset({"text_similarity"})


@dataclass(frozen=True)
class Criterion:
    name: str
    grader: graders.Grader
    pass_threshold: float

    def passed(self, score: float) -> bool:
        return math.isfinite(score) and score >= self.pass_threshold

    def result(self, score: float) -> dict[str, Any]:
        """One item's result of this criterion, as an output item lists it (a score that could not
        be had is 0, not passed, and counted as an error by the run)."""
        finite = math.isfinite(score)
        return {
            "name": self.name,
            "type": self.grader.type,
            "score": score if finite else 0.0,
            "passed": self.passed(score),
            "sample": None if finite else {"error": "the grader could not score this item"},
        }


def parse(raw: object, *, allow_python: bool, param: str = "testing_criteria") -> list[Criterion]:
    """The criteria, or a 400 naming the field (``testing_criteria.1.pass_threshold``)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("testing_criteria must be a non-empty list of graders.", param)
    if len(raw) > MAX_CRITERIA:
        raise bad_request(f"An eval has at most {MAX_CRITERIA} testing criteria; got {len(raw)}.", param)
    out: list[Criterion] = []
    for i, spec in enumerate(raw):
        criterion = _criterion(spec, allow_python=allow_python, param=f"{param}.{i}")
        if any(c.name == criterion.name for c in out):
            raise bad_request(
                f"Two testing criteria are named '{criterion.name}'; give each its own name.", f"{param}.{i}.name"
            )
        out.append(criterion)
    return out


def _criterion(spec: object, *, allow_python: bool, param: str) -> Criterion:
    if not isinstance(spec, Mapping):
        raise bad_request("A testing criterion is a grader: a JSON object with a 'type'.", param)
    kind = spec.get("type")
    rest = {k: v for k, v in spec.items() if k != "pass_threshold"}
    try:
        grader = graders.parse_grader(rest, param=param, allow_python=allow_python)
    except graders.GraderError as exc:
        raise bad_request(exc.message, exc.param) from None
    return Criterion(grader.name, grader, _threshold(spec, str(kind), param, getattr(grader, "range", (0.0, 1.0))))


def _threshold(spec: Mapping[str, Any], kind: str, param: str, scores: tuple[float, float]) -> float:
    value = spec.get("pass_threshold")
    where = f"{param}.pass_threshold"
    if kind in BINARY:
        if value is not None:
            raise bad_request(f"A {kind} criterion scores 0 or 1 and passes at 1; it takes no pass_threshold.", where)
        return 1.0
    if value is None:
        if kind in THRESHOLD_REQUIRED:
            raise bad_request(f"A {kind} criterion needs a pass_threshold (the score at which it passes).", where)
        return (scores[0] + scores[1]) / 2  # a score_model's range; 0.5 for the rest
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"pass_threshold must be a number; got {value!r}.", where)
    return float(value)


def item_keys(criteria: list[Criterion]) -> list[tuple[int, str]]:
    """``(criterion index, item key)`` for each ``item.<key>`` a criterion's templates read."""
    return [(i, key) for i, c in enumerate(criteria) for key in sorted(graders.referenced_item_keys(c.grader))]


def reads_sample(criteria: list[Criterion]) -> bool:
    """Whether any criterion reads an answer (``sample.…``, or a grader that always does)."""
    for c in criteria:
        for leaf in graders.leaves(c.grader):
            templates = list(leaf.templates())
            if not templates or any("sample" in template_namespaces(t) for t in templates):
                return True
    return False

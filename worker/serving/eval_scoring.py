"""What the evaluation engine (``worker.serving.evaluate``) does with a chunk's answers, by the kind
of its run:

* ``CheckpointScoring``: a job's checkpoints evaluated with one grader: a row of means a model
  (``results``), its prompts the lines' ``prompt`` or ``messages``;
* ``RunScoring``: an eval's run: every testing criterion scores each item, each item becomes an
  output item (``pass``, ``fail`` or ``error``), and the run's counts (``summary``) add up: OpenAI's
  ``result_counts``, ``per_testing_criteria_results`` and ``per_model_usage``. Its prompts are the
  eval's ``input_messages`` rendered over each item; a run without a model grades the samples its
  lines hold.

Grading (``grade``) runs on the worker's background thread; the rest on the serving loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from service import graders
from service.evals import criteria as criteria_
from service.evals import items as items_
from service.evals.runs import NO_ERROR
from service.graders import GradeResult
from worker.engine.errors import JobError
from worker.serving.decode import Row


@dataclass
class Tally:
    """One model's sums so far (a checkpoint evaluation's row)."""

    model: str
    step_number: int | None
    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    tokens: int = 0
    unscored: int = 0
    graders: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    def row(self) -> dict[str, Any]:
        mean = self.total / self.n if self.n else None
        error = None
        if self.n > 1 and mean is not None:
            variance = max(0.0, (self.squares - self.n * mean * mean) / (self.n - 1))
            error = math.sqrt(variance / self.n)
        return {
            "model": self.model,
            "step_number": self.step_number,
            "reward_mean": mean,
            "reward_std_error": error,
            "grader_means": {k: s / c if c else None for k, (s, c) in self.graders.items()},
            "completion_length_mean": self.tokens / (self.n + self.unscored) if self.n + self.unscored else None,
            "samples": self.n,
            "unscored": self.unscored,
        }

    def add(self, result: GradeResult, rows: list[Row]) -> None:
        for i, reward in enumerate(result.rewards):
            self.tokens += rows[i].sampled
            if not math.isfinite(reward):
                self.unscored += 1
                continue
            self.n += 1
            self.total += reward
            self.squares += reward * reward
        for name, column in result.sub_rewards.items():
            sums = self.graders.setdefault(name, [0.0, 0.0])
            for value in column:
                if math.isfinite(value):
                    sums[0] += value
                    sums[1] += 1


@dataclass
class Answers:
    """A chunk's answers as graded: the texts, and the rows that made them (none when the lines
    brought their answers)."""

    index: int  # which model
    items: list[Any]
    prompts: list[str]
    texts: list[str]
    rows: list[Row]


class CheckpointScoring:
    """A job's checkpoints, one grader."""

    def __init__(self, grader: graders.Grader, models: list[dict[str, Any]]) -> None:
        self.grader = grader
        self.tallies = [Tally(entry["model"], entry["step_number"]) for entry in models]

    @property
    def needs_models(self) -> bool:
        return graders.is_model_grader(self.grader)

    def prompt(self, item: dict[str, Any], tokenizer: Any, number: int) -> str:
        from worker.engine.data import prompt_text

        return prompt_text(item, tokenizer)

    def given_text(self, item: Any) -> str:
        raise AssertionError("a checkpoint evaluation always has models")

    def grade(self, answers: Answers, reward_models: Any) -> Any:
        from worker.engine.rewards.scoring import score_batch

        return score_batch(
            self.grader, prompts=answers.prompts, texts=answers.texts, items=answers.items, reward_models=reward_models
        )

    def count(self, answers: Answers, result: GradeResult) -> list[dict[str, Any]]:
        """The graded chunk added to its model's row; no output items."""
        self.tallies[answers.index].add(result, answers.rows)
        return []

    def values(self) -> dict[str, Any]:
        return {"results": [t.row() for t in self.tallies]}


class RunScoring:
    """An eval's run: its criteria, its items' answers (by ``model``, or the lines' own samples)."""

    def __init__(
        self,
        criteria: list[criteria_.Criterion],
        model: str | None,
        input_messages: dict[str, Any] | None,
        settings: dict[str, Any],
    ) -> None:
        self.criteria, self.model, self.input_messages, self.settings = criteria, model, input_messages, settings
        self.counts = {"total": 0, "errored": 0, "failed": 0, "passed": 0}
        self.per_criterion = [[0, 0] for _ in criteria]  # passed, failed
        self.usage = {"invocation_count": 0, "prompt_tokens": 0, "completion_tokens": 0}

    @property
    def needs_models(self) -> bool:
        return any(graders.is_model_grader(c.grader) for c in self.criteria)

    def prompt(self, item: items_.Item, tokenizer: Any, number: int) -> str:
        from worker.engine.data import prompt_text

        assert self.input_messages is not None
        try:
            return prompt_text({"messages": items_.messages(self.input_messages, item.item)}, tokenizer)
        except ValueError as exc:
            raise JobError("invalid_item", f"item {number} of the run: {exc}") from None

    def given_text(self, item: items_.Item) -> str:
        return str((item.sample or {}).get("output_text", ""))

    def grade(self, answers: Answers, reward_models: Any) -> list[GradeResult]:
        """Every criterion's scores of the chunk."""
        from worker.engine.rewards.scoring import score_batch

        items = [i.item for i in answers.items]
        return [
            score_batch(
                c.grader, prompts=answers.prompts, texts=answers.texts, items=items, reward_models=reward_models
            )
            for c in self.criteria
        ]

    def count(self, answers: Answers, results: list[GradeResult]) -> list[dict[str, Any]]:
        """The chunk counted; its output items' rows."""
        out = []
        for i, item in enumerate(answers.items):
            scores = [result.rewards[i] for result in results]
            graded = [c.result(s) for c, s in zip(self.criteria, scores, strict=True)]
            for k, c in enumerate(self.criteria):
                self.per_criterion[k][0 if c.passed(scores[k]) else 1] += 1
            status = "error" if any(not math.isfinite(s) for s in scores) else None
            status = status or ("pass" if all(g["passed"] for g in graded) else "fail")
            self.counts["total"] += 1
            self.counts[{"error": "errored", "pass": "passed", "fail": "failed"}[status]] += 1
            row = answers.rows[i] if answers.rows else None
            out.append(
                {
                    "datasource_item_id": item.index,
                    "datasource_item": item.item,
                    "sample": self._sample(answers, i, row),
                    "results": graded,
                    "status": status,
                }
            )
        return out

    def _sample(self, answers: Answers, i: int, row: Row | None) -> dict[str, Any]:
        item = answers.items[i]
        prompt_tokens = len(row.prompt_ids) if row is not None else 0
        completion_tokens = row.sampled if row is not None else 0
        if row is not None:
            self.usage["invocation_count"] += 1
            self.usage["prompt_tokens"] += prompt_tokens
            self.usage["completion_tokens"] += completion_tokens
        given = item.sample or {}
        return {
            "input": items_.messages(self.input_messages, item.item) if self.input_messages else [],
            "output": [{"role": "assistant", "content": answers.texts[i]}],
            "finish_reason": (row.finish_reason or "stop")
            if row is not None
            else str(given.get("finish_reason", "stop")),
            "model": self.model or str(given.get("model", "")),
            "usage": {
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens": prompt_tokens,
                "cached_tokens": 0,
            },
            "error": NO_ERROR,
            "temperature": float(self.settings["temperature"]),
            "max_completion_tokens": int(self.settings["max_tokens"]),
            "top_p": float(self.settings.get("top_p", 1.0)),
            "seed": int(self.settings.get("seed") or 0),
        }

    def values(self) -> dict[str, Any]:
        usage = []
        if self.model is not None:
            u = self.usage
            usage = [
                {
                    "model_name": self.model,
                    **u,
                    "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                    "cached_tokens": 0,
                }
            ]
        return {
            "summary": {
                "result_counts": dict(self.counts),
                "per_testing_criteria_results": [
                    {"testing_criteria": c.name, "passed": p, "failed": f}
                    for c, (p, f) in zip(self.criteria, self.per_criterion, strict=True)
                ],
                "per_model_usage": usage,
            }
        }

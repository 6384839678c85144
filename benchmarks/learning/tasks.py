"""The two tasks of the learning benchmark, both on ``examples/addition``'s model and problems.

* ``exact``: ``examples/addition/job.json`` as it is: reward 1 for the exact sum, 0 otherwise (a
  ``string_check``). One right answer a prompt; a wrong one scores what every other wrong one does.
* ``graded``: the same job with a graded reward in [0, 1], ``text_similarity`` ``fuzzy_match``
  against the sum: "57" for 58 scores 0.5, "85" 0.5, "5" 0.67 (rapidfuzz's WRatio). Wrong answers
  differ in what they score, and a failure's zero is not where most completions sit: the regime
  where a baseline is said to earn its keep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

EXAMPLE = ROOT / "examples" / "addition"
JOB = EXAMPLE / "job.json"

FUZZY = {
    "type": "text_similarity",
    "name": "similarity",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
}


@dataclass(frozen=True)
class Task:
    name: str
    grader: dict[str, Any] | None
    """None: job.json's own (exact match)."""

    def spec(self, where: Path) -> Path:
        """The job file of this task: job.json, or a copy of it with this task's grader (written
        under ``where``, its data files named by absolute path)."""
        if self.grader is None:
            return JOB
        body = json.loads(JOB.read_text())
        body["method"]["reinforcement"]["grader"] = self.grader
        for key in ("training_file", "validation_file"):
            body[key] = str(EXAMPLE / body[key])
        path = where / f"job-{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=2))
        return path

    def reward(self, text: str, answer: str) -> float:
        """The task's reward of one completion's text (what its grader gives)."""
        if self.grader is None:
            return float(text == answer)
        from service.graders.similarity import TEXT_SIMILARITY_METRICS

        return float(TEXT_SIMILARITY_METRICS[self.grader["evaluation_metric"]](text, answer))


TASKS = {"exact": Task("exact", None), "graded": Task("graded", FUZZY)}


def job_settings() -> dict[str, Any]:
    return dict(json.loads(JOB.read_text())["method"]["reinforcement"]["hyperparameters"])

"""What ``POST /graders/run`` answers: OpenAI's ``RunGraderResponse``, from a dry run's scores.

OpenAI reports an unscored sample as ``reward: 0`` with flags in ``metadata.errors`` saying why;
ours is NaN inside a job (left out of its group's baseline) and the same 0-and-flags here. The flags
come from the type of each grader that could not score: a python grader's error is a runtime error
(with its message), a judge without a number in its answer a parse error, a template that misses a
key an invalid variable (a sample parse error when the key was in a completion that is not JSON).
Our own detail rides along as extension keys: ``error_counts`` and ``error_messages`` per grader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.graders.templates import TemplateKeyError, render
from service.graders.types import ChatJudgeGrader, Grader, PythonGrader, Sample, ScoreModelGrader

FLAGS = (
    "formula_parse_error",
    "sample_parse_error",
    "truncated_observation_error",
    "unresponsive_reward_error",
    "invalid_variable_error",
    "other_error",
    "python_grader_server_error",
    "python_grader_runtime_error",
    "model_grader_server_error",
    "model_grader_refusal_error",
    "model_grader_parse_error",
)
DETAILS = (
    "python_grader_server_error_type",
    "python_grader_runtime_error_details",
    "model_grader_server_error_details",
)


def run_answer(
    grader: Grader, sample: Sample, item: Mapping[str, Any], scores: Mapping[str, Any], *, execution_time: float
) -> dict[str, Any]:
    """The answer for ``sample`` of ``item``. ``scores`` is the dry run's: ``reward`` and
    ``sub_rewards`` (None where unscored), ``errors`` (NaN counts by grader path) and ``messages``
    (first error by path)."""
    errors: dict[str, Any] = {**dict.fromkeys(FLAGS, False), **dict.fromkeys(DETAILS)}
    by_path = dict(_paths(grader))
    messages: dict[str, str] = dict(scores["messages"])
    for path in scores["errors"]:
        leaf = by_path.get(path)
        if leaf is None or leaf.children():
            errors["other_error"] = True  # a formula that gave no number from numbers (x / 0)
        elif isinstance(leaf, PythonGrader):
            errors["python_grader_runtime_error"] = True
            errors["python_grader_runtime_error_details"] = messages.get(path)
        elif (unrendered := _render_error(leaf, sample, item)) is not None:
            reads_json = any("sample.output_json" in t for t in leaf.templates())
            errors["sample_parse_error" if reads_json and sample.output_json is None else "invalid_variable_error"] = (
                True
            )
            messages.setdefault(path, unrendered)  # which variable, so the flag says what to change
        elif isinstance(leaf, ScoreModelGrader):  # its messages rendered: its answer held no number
            errors["model_grader_parse_error"] = True
        else:
            errors["other_error"] = True
    reward = scores["reward"]
    judges = [leaf.model for _, leaf in by_path.items() if isinstance(leaf, ChatJudgeGrader)]
    return {
        "reward": 0.0 if reward is None else reward,
        "sub_rewards": scores["sub_rewards"],
        "metadata": {
            "name": grader.name,
            "type": grader.type,
            "errors": errors,
            "execution_time": round(execution_time, 6),
            "scores": scores["sub_rewards"],
            "token_usage": None,
            "sampled_model_name": judges[0] if judges else None,
            "error_counts": scores["errors"],
            "error_messages": messages,
        },
        "model_grader_token_usage_per_model": {},
    }


def _render_error(leaf: Grader, sample: Sample, item: Mapping[str, Any]) -> str | None:
    """Why the leaf's templates do not render for this sample (the variable missing), or None."""
    try:
        for template in leaf.templates():
            render(template, sample=sample, item=item)
    except TemplateKeyError as exc:
        return exc.message
    return None


def _paths(grader: Grader, prefix: str = "") -> list[tuple[str, Grader]]:
    """Each grader of the tree by the path ``sub_rewards`` and ``errors`` name it with (the root by
    its name, sub-graders as ``outer.inner``)."""
    out = [(prefix or grader.name, grader)]
    for name, sub in grader.children():
        out += _paths(sub, f"{prefix}.{name}" if prefix else name)
    return out

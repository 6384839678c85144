"""Try a reward spec before paying for a job: validate it, or run it on one sample."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service import graders
from service.deps import ProjectDep, SettingsDep
from service.errors import APIError, bad_request
from service.responses import JSON
from service.schemas import GraderRun, GraderValidate

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"])


def _parse(spec: dict[str, Any], settings: SettingsDep) -> Any:
    try:
        return graders.parse_grader(spec, param="grader", allow_python=settings.allow_python_grader)
    except graders.GraderError as exc:
        raise bad_request(exc.message, exc.param) from None


@router.post("/validate", summary="Validate a grader")
def validate_grader(_: ProjectDep, settings: SettingsDep, body: GraderValidate) -> JSON:
    return JSON({"grader": graders.grader_to_dict(_parse(body.grader, settings))})


@router.post("/run", summary="Run a grader on one sample")
def run_grader(_: ProjectDep, settings: SettingsDep, body: GraderRun) -> JSON:
    grader = _parse(body.grader, settings)
    if graders.is_model_grader(grader):
        raise bad_request(
            "This grader uses a model, which runs on a worker; dry runs of model graders are not "
            "available yet. Try the rule graders here.",
            "grader",
            "model_grader_unsupported",
        )
    item = dict(body.item)
    if body.reference_answer is not None:
        item.setdefault("reference_answer", body.reference_answer)
    try:
        result = graders.grade_batch(grader, [graders.Sample(output_text=body.model_sample)], [item])
    except graders.GraderUnavailable as exc:
        raise APIError(502, str(exc), param="grader", code="grader_unavailable") from None
    reward = result.rewards[0]
    sub = {name: values[0] for name, values in result.sub_rewards.items()}
    finite = reward == reward
    return JSON({
        "reward": reward if finite else None,
        "sub_rewards": {k: (v if v == v else None) for k, v in sub.items()},
        "metadata": {
            "errors": result.errors,
            "error_messages": result.messages,
            "name": grader.name,
            "type": grader.type,
        },
    })

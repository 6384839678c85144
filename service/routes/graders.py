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
async def run_grader(_: ProjectDep, settings: SettingsDep, body: GraderRun) -> JSON:
    """Rule graders answer here; model graders (reward and judge models, cosine) run on a worker
    of the graders queue, within RLOO_GRADER_RUN_SECONDS."""
    grader = _parse(body.grader, settings)
    item = dict(body.item)
    if body.reference_answer is not None:
        item.setdefault("reference_answer", body.reference_answer)
    if graders.is_model_grader(grader):
        return JSON(await _run_on_worker(grader, body.model_sample, item, settings.grader_run_seconds))
    from anyio import to_thread

    try:  # rule graders here, in a worker thread (python and http graders wait on other processes)
        result = await to_thread.run_sync(
            graders.grade_batch, grader, [graders.Sample(output_text=body.model_sample)], [item]
        )
    except graders.GraderUnavailable as exc:
        raise APIError(502, str(exc), param="grader", code="grader_unavailable") from None
    return JSON(_answer(grader, result.rewards[0], {k: v[0] for k, v in result.sub_rewards.items()},
                        result.errors, result.messages))


def _answer(grader: Any, reward: float, sub: dict[str, float], errors: Any, messages: Any) -> dict[str, Any]:
    return {
        "reward": reward if reward == reward else None,
        "sub_rewards": {k: (v if v == v else None) for k, v in sub.items()},
        "metadata": {"errors": errors, "error_messages": messages, "name": grader.name, "type": grader.type},
    }


async def _run_on_worker(grader: Any, sample: str, item: dict[str, Any], timeout: float) -> dict[str, Any]:
    from service import queue

    payload: dict[str, object] = {"grader": graders.grader_to_dict(grader), "model_sample": sample, "item": item}
    try:
        answer = await queue.run_model_grader(payload, timeout=timeout)
    except queue.GraderRunTimeout as exc:
        raise APIError(504, str(exc), param="grader", code="grader_timeout") from None
    except Exception as exc:  # the broker is down
        raise APIError(503, f"the queue is unreachable ({type(exc).__name__}); try again shortly",
                       param=None, code="queue_unavailable") from None
    if "error" in answer:
        raise APIError(int(answer.get("status", 502)), str(answer["error"]), param="grader",  # type: ignore[call-overload]
                       code=str(answer.get("code", "grader_failed")))
    reward = answer["reward"]
    return _answer(grader, float("nan") if reward is None else reward, answer["sub_rewards"],  # type: ignore[arg-type]
                   answer["errors"], answer["messages"])

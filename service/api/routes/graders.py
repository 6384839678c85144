"""Try a reward spec before paying for a job: validate it, or run it on one sample."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter

from service import graders
from service.api.deps import ProjectDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON
from service.api.routing import StrictJSONRoute
from service.api.schemas.graders import GraderRun, GraderValidate
from service.core.errors import bad_request
from service.core.settings import Settings
from service.core.strictjson import depth
from service.files.datasets import MAX_DEPTH
from service.graders.report import run_answer

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", route_class=StrictJSONRoute, tags=["graders"])


def _parse(spec: dict[str, Any], settings: SettingsDep) -> Any:
    try:
        return graders.parse_grader(spec, param="grader", allow_python=settings.allow_python_grader)
    except graders.GraderError as exc:
        raise bad_request(exc.message, exc.param) from None


@router.post("/validate", summary="Validate a grader")
def validate_grader(_: ProjectDep, settings: SettingsDep, body: GraderValidate) -> JSON:
    """The grader as parsed, under ``grader``; one OpenAI's types cannot hold (``reward_model``,
    ``http``, ``label_model`` outside a ``multi``, a ``multi`` of several graders) under our
    ``rloo.grader`` instead, as a job's method answers it, so the SDK's strict parsing holds."""
    parsed = graders.grader_to_dict(_parse(body.grader, settings))
    return JSON({"grader": parsed} if graders.openai_typed(parsed) else {"rloo": {"grader": parsed}})


@router.post("/run", summary="Run a grader on one sample")
async def run_grader(project: ProjectDep, settings: SettingsDep, body: GraderRun) -> JSON:
    """Every grader runs on a worker of the graders queue (service.jobs.dry_runs), within
    RLOO_GRADER_RUN_SECONDS, at most RLOO_MAX_DRY_RUNS at once per project: the API grades nothing."""
    grader = _parse(body.grader, settings)
    item = dict(body.item)
    if body.reference_answer is not None:
        item.setdefault("reference_answer", body.reference_answer)
    _check_item(item, settings.max_line_bytes)
    payload = {"grader": graders.grader_to_dict(grader), "model_sample": body.model_sample, "item": item}
    started = time.perf_counter()
    answer = await _run_on_worker(project.id, payload, settings)
    execution_time = time.perf_counter() - started
    if "error" in answer:
        raise APIError(
            int(answer.get("status", 502)),
            str(answer["error"]),
            param="grader",
            code=str(answer.get("code", "grader_failed")),
        )
    sample = graders.Sample(output_text=body.model_sample)
    return JSON(run_answer(grader, sample, item, answer, execution_time=execution_time))


def _check_item(item: dict[str, Any], max_bytes: int) -> None:
    """An item is a line of a training file: the same limits as an upload's line."""
    if depth(item, MAX_DEPTH) > MAX_DEPTH:
        raise bad_request(
            f"item nests arrays or objects more than {MAX_DEPTH} levels deep, as no line of a "
            "training file may; flatten it.",
            "item",
        )
    if len(json.dumps(item, ensure_ascii=False).encode()) > max_bytes:
        raise bad_request(
            f"item is larger than a training file's line may be ({max_bytes} bytes, RLOO_MAX_LINE_BYTES).", "item"
        )


async def _run_on_worker(project: str, payload: dict[str, Any], settings: Settings) -> dict[str, Any]:
    from service.infra import task_queue
    from service.jobs import dry_runs

    try:
        return await dry_runs.run(
            project=project,
            payload=payload,
            queue=task_queue.grader_queue(),
            timeout=settings.grader_run_seconds,
            cap=settings.max_dry_runs,
        )
    except dry_runs.Busy:
        raise APIError(
            429,
            f"This project already has {settings.max_dry_runs} grader runs in progress (RLOO_MAX_DRY_RUNS); "
            "wait for one to finish.",
            code="too_many_dry_runs",
            headers={"Retry-After": "1"},
        ) from None
    except dry_runs.NoAnswer as exc:
        raise APIError(504, str(exc), param="grader", code="grader_timeout") from None
    except Exception as exc:  # the broker is down
        raise APIError(
            503,
            f"the queue is unreachable ({type(exc).__name__}); try again shortly",
            param=None,
            code="queue_unavailable",
        ) from None

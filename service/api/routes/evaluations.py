"""Evaluations of a job's checkpoints (an extension): ``POST /v1/fine_tuning/jobs/{id}/evaluations``
``{checkpoints: [...] | "all", file, grader?, samples?, temperature?, max_tokens?, seed?}`` scores the
job's starting model and each checkpoint named on the file's first ``samples`` lines, with the job's
grader unless another is given, on the inference workers (``worker.serving.evaluate``). Listed and
retrieved like jobs; the answer's ``results`` fills in, a row a model, as the work goes. ``POST
…/evaluations/{id}/cancel`` stops one; deleting its file or the job's model cancels it too."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from service import graders
from service.api.deps import PagingDep, ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON, page
from service.api.routes.jobs import _job
from service.api.routing import StrictJSONRoute
from service.api.schemas.evaluations import EvaluationCreate
from service.core.db import ends_session
from service.core.errors import DomainError, bad_request, not_found
from service.core.tables import Checkpoint, Evaluation, Job
from service.evals import creation
from service.evals import runs as evaluations
from service.files.datasets import first_line_not
from service.jobs.creation import fine_tune_file
from service.jobs.spec import check_grader_models, check_item_keys
from service.registry import weights

router = APIRouter(prefix="/v1/fine_tuning/jobs", route_class=StrictJSONRoute, tags=["evaluations"])


def evaluation_object(e: Evaluation, job: Job) -> dict[str, Any]:
    return {
        "id": e.id,
        "object": "fine_tuning.job.evaluation",
        "created_at": e.created_at,
        "fine_tuning_job_id": job.id,
        "status": e.status,
        "file": e.file_id,
        "grader": e.grader,
        **e.settings,
        "models": e.models,
        "results": e.results,
        "progress": {"done": e.done, "total": e.total},
        "error": e.error,
        "finished_at": e.finished_at,
    }


@router.post("/{job_id}/evaluations", summary="Evaluate a job's checkpoints (and its starting model) on a file")
@ends_session
def create_evaluation(
    session: SessionDep, project: ProjectDep, settings: SettingsDep, job_id: str, body: EvaluationCreate | None = None
) -> JSON:
    job = _job(session, project, job_id)  # another project's job is a 404 before its body is read
    if body is None:
        raise bad_request('Give the evaluation as a JSON body: {"file": "file-…", "checkpoints": "all"}.', "file")
    creation.check_room(session, settings, project.seq)
    file = fine_tune_file(session, project, body.file, "file")
    found = first_line_not(dict(file.keys_summary or {}), "reinforcement")
    if found is not None and found[0] <= body.samples:  # it samples the file's first lines only
        raise bad_request(
            f"Line {found[0]} of file {file.id} is not a prompt: an evaluation samples a completion for each "
            "line's 'prompt' (or 'messages' ending in a user turn), as a reinforcement job's training file "
            "holds. Upload such a file for it.",
            "file",
            "invalid_file_format",
        )
    kind = job.method.get("type", "supervised")
    if (job.method.get(kind) or {}).get("tools"):
        raise bad_request(
            f"Job {job.id} trained with tools, and evaluations on the inference workers sample one turn without "
            "them. Its validation passes are multi-turn with its tools (valid_reward_mean, every eval_interval "
            "steps), and so is `rloo score SPEC --checkpoint DIR` (docs/tools.md).",
            "job_id",
            "unsupported_for_tools",
        )
    spec = body.grader if body.grader is not None else (job.method.get(kind) or {}).get("grader")
    if spec is None:
        raise bad_request(f"Job {job.id} trained with no grader ({kind}); give one as 'grader'.", "grader")
    try:
        grader = graders.parse_grader(spec, allow_python=settings.allow_python_grader)
    except graders.GraderError as exc:
        raise bad_request(exc.message, exc.param) from None
    check_grader_models(grader, "grader", settings)
    check_item_keys(grader, file.keys_summary or {}, source=f"file {file.id}", param="grader", within=body.samples)
    models = [{"model": job.model, "step_number": None}] + _checkpoints(session, job, body.checkpoints)
    for entry in models:  # each one servable now, or a 400 that says which
        try:
            weights.resolve(session, settings, project_seq=project.seq, name=entry["model"], include_deleted=True)
        except DomainError as exc:
            raise bad_request(f"{entry['model']} cannot be evaluated: {exc.message}", "checkpoints") from None
    hp = job.hyperparameters
    evaluation = Evaluation(
        project_seq=project.seq,
        job_seq=job.seq,
        file_id=body.file,
        grader=spec,
        settings={
            "samples": body.samples,
            "temperature": body.temperature if body.temperature is not None else float(hp.get("temperature", 1.0)),
            "top_p": float(hp.get("top_p", 1.0)),
            "max_tokens": body.max_tokens or min(int(hp.get("max_new_tokens") or 64), settings.inference_max_tokens),
            "stop": hp.get("stop") or [],
            "seed": body.seed,
        },
        models=models,
    )
    session.add(evaluation)
    session.commit()
    return JSON(evaluation_object(evaluation, job))


def _checkpoints(session: SessionDep, job: Job, asked: list[str] | str) -> list[dict[str, Any]]:
    rows = list(
        session.scalars(select(Checkpoint).where(Checkpoint.job_seq == job.seq).order_by(Checkpoint.step_number))
    )
    if asked == "all":
        chosen = rows
    else:
        by_name = {c.id: c for c in rows} | {c.fine_tuned_model_checkpoint: c for c in rows}
        chosen = []
        for i, name in enumerate(asked):
            if name not in by_name:
                raise bad_request(
                    f"Job {job.id} has no checkpoint '{name}'.", f"checkpoints.{i}", "checkpoint_not_found"
                )
            chosen.append(by_name[name])
    return [{"model": c.fine_tuned_model_checkpoint, "step_number": c.step_number} for c in chosen]


@router.get("/{job_id}/evaluations", summary="List a job's evaluations, newest first")
@ends_session
def list_evaluations(session: SessionDep, project: ProjectDep, paging: PagingDep, job_id: str) -> JSON:
    job = _job(session, project, job_id)
    rows, has_more = paging.apply(session, Evaluation, [Evaluation.job_seq == job.seq])
    return page([evaluation_object(e, job) for e in rows], has_more)


def _evaluation(session: SessionDep, job: Job, evaluation_id: str) -> Evaluation:
    e = session.scalar(select(Evaluation).where(Evaluation.job_seq == job.seq, Evaluation.id == evaluation_id))
    if e is None:
        raise not_found("evaluation", evaluation_id)
    return e


@router.get("/{job_id}/evaluations/{evaluation_id}", summary="Retrieve an evaluation")
@ends_session
def read_evaluation(session: SessionDep, project: ProjectDep, job_id: str, evaluation_id: str) -> JSON:
    job = _job(session, project, job_id)
    return JSON(evaluation_object(_evaluation(session, job, evaluation_id), job))


@router.post("/{job_id}/evaluations/{evaluation_id}/cancel", summary="Cancel an evaluation")
@ends_session
def cancel_evaluation(session: SessionDep, project: ProjectDep, job_id: str, evaluation_id: str) -> JSON:
    """queued or running -> cancelled (its worker stops within a heartbeat, results so far kept); an
    evaluation that has ended is a 409."""
    job = _job(session, project, job_id)
    e = _evaluation(session, job, evaluation_id)
    if not evaluations.cancel(session, Evaluation.seq == e.seq, code="cancelled", message="Cancelled by request."):
        session.rollback()
        raise APIError(
            409,
            f"Evaluation {evaluation_id} is {e.status}; only one that has not ended can be cancelled.",
            code="invalid_state",
        )
    session.commit()
    session.refresh(e)
    return JSON(evaluation_object(e, job))

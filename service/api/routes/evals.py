"""OpenAI's Evals API (the ``openai`` SDK's ``client.evals``, ``client.evals.runs``,
``client.evals.runs.output_items``): evals, their runs and each run's output items, on this server's
graders and models. A run is answered by an inference worker (``worker.serving.evaluate``, the engine
that also evaluates a job's checkpoints) and announced by the ``eval.run.*`` webhooks when it ends.

Where we differ from OpenAI on purpose (docs/api.md): a run without a model (a ``jsonl`` source whose
lines hold their answers) answers ``model: ""``; a run or a sample without an error answers
``error: {"code": "", "message": ""}`` (OpenAI's schema has no null there)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import delete, select

from service.api.deps import Paging, ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON, page
from service.api.routing import StrictJSONRoute
from service.api.schemas.evals import EvalCreate, EvalRunCreate, EvalUpdate
from service.core.crud import Caller
from service.core.db import ends_session
from service.core.errors import bad_request, not_found
from service.core.tables import Eval, EvalOutputItem, Evaluation
from service.evals import creation, runs

router = APIRouter(prefix="/v1/evals", route_class=StrictJSONRoute, tags=["evals"])


class ListPaging(Paging):
    """The Evals API's lists: ``order`` ``asc`` (oldest first, OpenAI's default) or ``desc``."""

    def __init__(
        self,
        after: Annotated[str | None, Query(max_length=64, description="Id of the last item seen.")] = None,
        limit: Annotated[int | None, Query(description="Items a page (default 20, at most 100).")] = None,
        order: Annotated[str, Query(description="asc (oldest first) or desc.")] = "asc",
    ) -> None:
        super().__init__(after, limit)
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc'; got '{order}'.", "order")
        self.ascending = order == "asc"


ListPagingDep = Annotated[ListPaging, Depends()]


# Objects ------------------------------------------------------------------------------------------
def eval_object(e: Eval) -> dict[str, Any]:
    return {
        "object": "eval",
        "id": e.id,
        "name": e.name,
        "data_source_config": e.data_source_config,
        "testing_criteria": e.testing_criteria,
        "created_at": e.created_at,
        "metadata": e.metadata_ or {},
    }


def run_object(run: Evaluation, e: Eval, base_url: str) -> dict[str, Any]:
    summary = run.summary or {}
    data_source = dict(run.data_source or {})
    if run.items_inline is not None:
        data_source["source"] = {"type": "file_content", "content": run.items_inline}
    return {
        "object": "eval.run",
        "id": run.id,
        "eval_id": e.id,
        "status": runs.OPENAI_STATUS.get(run.status, run.status),
        "model": run.models[0]["model"] if run.models else "",
        "name": run.name or "",
        "created_at": run.created_at,
        "report_url": f"{base_url.rstrip('/')}/dashboard/#/evals/{e.id}",
        "result_counts": summary.get("result_counts", {"total": 0, "errored": 0, "failed": 0, "passed": 0}),
        "per_model_usage": summary.get("per_model_usage", []),
        "per_testing_criteria_results": summary.get("per_testing_criteria_results", []),
        "data_source": data_source,
        "metadata": run.metadata_ or {},
        "error": run.error or runs.NO_ERROR,
        # ours, beside OpenAI's: how far it is
        "progress": {"done": run.done, "total": run.total},
        "finished_at": run.finished_at,
    }


def item_object(item: EvalOutputItem, run: Evaluation, e: Eval) -> dict[str, Any]:
    return {
        "object": "eval.run.output_item",
        "id": item.id,
        "run_id": run.id,
        "eval_id": e.id,
        "created_at": item.created_at,
        "status": item.status,
        "datasource_item_id": item.datasource_item_id,
        "datasource_item": item.datasource_item,
        "results": item.results,
        "sample": item.sample,
    }


# Look-ups: another project's object is as unknown as one that never was ---------------------------
def _eval(session: SessionDep, project: Caller, eval_id: str) -> Eval:
    e = session.scalar(select(Eval).where(Eval.id == eval_id, Eval.project_seq == project.seq))
    if e is None:
        raise not_found("eval", eval_id, "eval_id")
    return e


def _run(session: SessionDep, e: Eval, run_id: str) -> Evaluation:
    run = session.scalar(select(Evaluation).where(Evaluation.id == run_id, Evaluation.eval_seq == e.seq))
    if run is None:
        raise not_found("eval run", run_id, "run_id")
    return run


# Evals --------------------------------------------------------------------------------------------
@router.post("", summary="Create an eval")
@ends_session
def create_eval(session: SessionDep, project: ProjectDep, settings: SettingsDep, body: EvalCreate) -> JSON:
    request = creation.EvalRequest(body.name, body.metadata, body.data_source_config, body.testing_criteria)
    e = creation.create_eval(session, project.seq, settings, request)
    session.commit()
    return JSON(eval_object(e))


@router.get("", summary="List evals")
@ends_session
def list_evals(session: SessionDep, project: ProjectDep, paging: ListPagingDep, order_by: str = "created_at") -> JSON:
    if order_by not in ("created_at", "updated_at"):
        raise bad_request("order_by must be 'created_at' or 'updated_at'.", "order_by")
    rows, has_more = paging.apply(session, Eval, [Eval.project_seq == project.seq])
    return page([eval_object(e) for e in rows], has_more)


@router.get("/{eval_id}", summary="Retrieve an eval")
@ends_session
def read_eval(session: SessionDep, project: ProjectDep, eval_id: str) -> JSON:
    return JSON(eval_object(_eval(session, project, eval_id)))


@router.post("/{eval_id}", summary="Update an eval's name or metadata")
@ends_session
def update_eval(session: SessionDep, project: ProjectDep, eval_id: str, body: EvalUpdate | None = None) -> JSON:
    e = _eval(session, project, eval_id)  # another project's eval is a 404 before its body is read
    if body is None:
        raise bad_request('Give the change as a JSON body: {"name": "...", "metadata": {...}}.', "name")
    if body.name is not None:
        e.name = body.name
    if body.metadata is not None:
        e.metadata_ = body.metadata
    session.commit()
    return JSON(eval_object(e))


@router.delete("/{eval_id}", summary="Delete an eval, its runs and their output items")
@ends_session
def delete_eval(session: SessionDep, project: ProjectDep, eval_id: str) -> JSON:
    e = _eval(session, project, eval_id)
    runs.cancel(session, Evaluation.eval_seq == e.seq, code="eval_deleted", message=f"The eval {e.id} was deleted.")
    _delete_runs(session, Evaluation.eval_seq == e.seq)
    session.delete(e)
    session.commit()
    return JSON({"object": "eval.deleted", "deleted": True, "eval_id": eval_id})


def _delete_runs(session: SessionDep, *where: Any) -> None:
    """Runs and their output items (explicitly: a database without cascading deletes keeps none)."""
    seqs = select(Evaluation.seq).where(*where).scalar_subquery()
    session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_seq.in_(seqs)))
    session.execute(delete(Evaluation).where(*where))


# Runs ---------------------------------------------------------------------------------------------
@router.post("/{eval_id}/runs", summary="Start a run of an eval")
@ends_session
def create_run(
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    request: Request,
    eval_id: str,
    body: EvalRunCreate | None = None,
) -> JSON:
    e = _eval(session, project, eval_id)  # another project's eval is a 404 before its body is read
    if body is None:
        raise bad_request('Give the run as a JSON body: {"data_source": {"type": "jsonl", ...}}.', "data_source")
    run = creation.create_run(
        session, project.seq, settings, e, data_source=body.data_source, name=body.name, metadata=body.metadata
    )
    session.commit()
    return JSON(run_object(run, e, str(request.base_url)))


@router.get("/{eval_id}/runs", summary="List an eval's runs")
@ends_session
def list_runs(
    session: SessionDep,
    project: ProjectDep,
    paging: ListPagingDep,
    request: Request,
    eval_id: str,
    status: str | None = None,
) -> JSON:
    e = _eval(session, project, eval_id)
    scope = [Evaluation.eval_seq == e.seq]
    if status is not None:
        stored = {v: k for k, v in runs.OPENAI_STATUS.items()}
        if status not in stored:
            raise bad_request(f"status must be one of {', '.join(stored)}.", "status")
        scope.append(Evaluation.status == stored[status])
    rows, has_more = paging.apply(session, Evaluation, scope)
    return page([run_object(r, e, str(request.base_url)) for r in rows], has_more)


@router.get("/{eval_id}/runs/{run_id}", summary="Retrieve a run")
@ends_session
def read_run(session: SessionDep, project: ProjectDep, request: Request, eval_id: str, run_id: str) -> JSON:
    e = _eval(session, project, eval_id)
    return JSON(run_object(_run(session, e, run_id), e, str(request.base_url)))


@router.post("/{eval_id}/runs/{run_id}/cancel", summary="Cancel a run")
@router.post(
    "/{eval_id}/runs/{run_id}", summary="Cancel a run (OpenAI's reference names this path; its SDK adds /cancel)"
)
@ends_session
def cancel_run(session: SessionDep, project: ProjectDep, request: Request, eval_id: str, run_id: str) -> JSON:
    """queued or in progress -> canceled (its worker stops within a heartbeat, its output items so
    far kept); a run that has ended is a 409."""
    e = _eval(session, project, eval_id)
    run = _run(session, e, run_id)
    if not runs.cancel(session, Evaluation.seq == run.seq, code="canceled", message="Canceled by request."):
        session.rollback()
        raise APIError(
            409,
            f"Run {run_id} is {runs.OPENAI_STATUS.get(run.status, run.status)}; only a run that has not ended can "
            "be canceled.",
            code="invalid_state",
        )
    session.commit()
    session.refresh(run)
    return JSON(run_object(run, e, str(request.base_url)))


@router.delete("/{eval_id}/runs/{run_id}", summary="Delete a run and its output items")
@ends_session
def delete_run(session: SessionDep, project: ProjectDep, eval_id: str, run_id: str) -> JSON:
    e = _eval(session, project, eval_id)
    run = _run(session, e, run_id)
    runs.cancel(session, Evaluation.seq == run.seq, code="deleted", message="The run was deleted.")
    _delete_runs(session, Evaluation.seq == run.seq)
    session.commit()
    return JSON({"object": "eval.run.deleted", "deleted": True, "run_id": run_id})


# Output items -------------------------------------------------------------------------------------
@router.get("/{eval_id}/runs/{run_id}/output_items", summary="List a run's output items")
@ends_session
def list_output_items(
    session: SessionDep,
    project: ProjectDep,
    paging: ListPagingDep,
    eval_id: str,
    run_id: str,
    status: str | None = None,
) -> JSON:
    e = _eval(session, project, eval_id)
    run = _run(session, e, run_id)
    scope = [EvalOutputItem.run_seq == run.seq]
    if status is not None:
        if status not in ("pass", "fail", "error"):
            raise bad_request("status must be 'pass', 'fail' or 'error'.", "status")
        scope.append(EvalOutputItem.status == status)
    rows, has_more = paging.apply(session, EvalOutputItem, scope)
    return page([item_object(i, run, e) for i in rows], has_more)


@router.get("/{eval_id}/runs/{run_id}/output_items/{output_item_id}", summary="Retrieve an output item")
@ends_session
def read_output_item(session: SessionDep, project: ProjectDep, eval_id: str, run_id: str, output_item_id: str) -> JSON:
    e = _eval(session, project, eval_id)
    run = _run(session, e, run_id)
    item = session.scalar(
        select(EvalOutputItem).where(EvalOutputItem.id == output_item_id, EvalOutputItem.run_seq == run.seq)
    )
    if item is None:
        raise not_found("output item", output_item_id, "output_item_id")
    return JSON(item_object(item, run, e))

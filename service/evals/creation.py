"""An eval and its runs made from checked requests: ``create_eval`` and ``create_run`` validate all of
it (a 400 or 404 naming the field or the line) before a row is added; the caller commits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.core import crud
from service.core.errors import DomainError, LimitReached, bad_request
from service.core.settings import Settings
from service.core.tables import Eval, Evaluation, File, new_token_id
from service.evals import criteria as criteria_
from service.evals import items as items_
from service.evals import spec
from service.evals.runs import UNFINISHED
from service.files.datasets import EVAL_PURPOSES
from service.infra.artifacts import open_store
from service.jobs.spec import check_grader_models
from service.registry import weights

DEFAULT_MAX_TOKENS = 256
DEFAULT_SEED = 42  # OpenAI's default sampling seed: the same run twice answers the same


@dataclass
class EvalRequest:
    name: str | None
    metadata: dict[str, str] | None
    data_source_config: dict[str, Any]
    testing_criteria: list[Any]


def create_eval(session: Session, project_seq: int, settings: Settings, body: EvalRequest) -> Eval:
    config = spec.data_source_config(body.data_source_config)
    criteria = criteria_.parse(body.testing_criteria, allow_python=settings.allow_python_grader)
    for i, c in enumerate(criteria):
        check_grader_models(c.grader, f"testing_criteria.{i}", settings)
    spec.check_criteria_fit(criteria, config)
    row = Eval(
        project_seq=project_seq,
        name=body.name or "eval",
        metadata_=body.metadata or {},
        data_source_config=config,
        testing_criteria=body.testing_criteria,
    )
    session.add(row)
    return row


def parsed_criteria(evaluation: Eval, settings: Settings) -> list[criteria_.Criterion]:
    """The eval's criteria as its runs grade with them (the operator's settings of today)."""
    return criteria_.parse(evaluation.testing_criteria, allow_python=settings.allow_python_grader)


def create_run(
    session: Session,
    project_seq: int,
    settings: Settings,
    evaluation: Eval,
    *,
    data_source: dict[str, Any],
    name: str | None,
    metadata: dict[str, str] | None,
) -> Evaluation:
    check_room(session, settings, project_seq)  # before any file is read
    source = spec.run_source(data_source)
    criteria = parsed_criteria(evaluation, settings)
    schema = spec.item_schema(evaluation.data_source_config)
    if source.kind == "completions":
        _check_model(session, settings, project_seq, source)
        _check_message_keys(source, schema)
        _check_max_tokens(source, settings)
    needs_sample = source.kind == "jsonl" and criteria_.reads_sample(criteria)
    count = _checked_items(session, settings, project_seq, source, schema, needs_sample)
    models = [{"model": source.model, "step_number": None}] if source.model else []
    sampling = source.sampling
    run = Evaluation(
        id=new_token_id("evalrun"),
        project_seq=project_seq,
        eval_seq=evaluation.seq,
        name=name or f"{source.model or 'jsonl'} run",
        metadata_=metadata or {},
        data_source=source.answered,
        items_inline=source.content,
        file_id=source.file_id,
        settings={
            "samples": count,
            "temperature": float(sampling.get("temperature", 1.0)),
            "top_p": float(sampling.get("top_p", 1.0)),
            "max_tokens": int(
                sampling.get("max_completion_tokens", min(DEFAULT_MAX_TOKENS, settings.inference_max_tokens))
            ),
            "seed": int(sampling.get("seed", DEFAULT_SEED)),
            "stop": [],
        },
        models=models,
        total=count,
        summary=empty_summary(criteria),
    )
    session.add(run)
    return run


def empty_summary(criteria: list[criteria_.Criterion]) -> dict[str, Any]:
    return {
        "result_counts": {"total": 0, "errored": 0, "failed": 0, "passed": 0},
        "per_testing_criteria_results": [{"testing_criteria": c.name, "passed": 0, "failed": 0} for c in criteria],
        "per_model_usage": [],
    }


def _check_model(session: Session, settings: Settings, project_seq: int, source: spec.RunSource) -> None:
    assert source.model is not None
    try:
        weights.resolve(session, settings, project_seq=project_seq, name=source.model)
    except DomainError as exc:
        exc.param = "data_source.model"
        raise


def _check_max_tokens(source: spec.RunSource, settings: Settings) -> None:
    asked = source.sampling.get("max_completion_tokens")
    if asked is not None and asked > settings.inference_max_tokens:
        raise bad_request(
            f"max_completion_tokens is at most {settings.inference_max_tokens} on this server "
            "(RLOO_INFERENCE_MAX_TOKENS).",
            "data_source.sampling_params.max_completion_tokens",
        )


def _check_message_keys(source: spec.RunSource, schema: dict[str, Any]) -> None:
    assert source.input_messages is not None
    known = schema.get("properties")
    if not isinstance(known, dict) or schema.get("additionalProperties") not in (None, False):
        return
    for key in sorted(spec.message_keys(source.input_messages)):
        if key not in known:
            raise bad_request(
                f"input_messages read item.{key}, which the eval's item_schema does not have (its properties: "
                f"{', '.join(sorted(known)) or 'none'}).",
                "data_source.input_messages",
            )


def _checked_items(
    session: Session,
    settings: Settings,
    project_seq: int,
    source: spec.RunSource,
    schema: dict[str, Any],
    needs_sample: bool,
) -> int:
    """How many items the run has, the ones the API can check now checked (``items.check``)."""
    limit = settings.eval_run_max_items
    if source.content is not None:
        if len(source.content) > limit:
            raise bad_request(
                f"A run holds at most {limit} items (RLOO_EVAL_RUN_MAX_ITEMS).", "data_source.source.content"
            )
        lines = ((i, line) for i, line in enumerate(source.content))
        items_.check(
            lines,
            schema,
            where="item {n} of the content",
            param="data_source.source.content.{n}",
            needs_sample=needs_sample,
        )
        return len(source.content)
    file = _evals_file(session, project_seq, source.file_id or "")
    if file.line_count > limit:
        raise bad_request(
            f"File {file.id} has {file.line_count} lines; a run holds at most {limit} items (RLOO_EVAL_RUN_MAX_ITEMS).",
            "data_source.source.id",
        )
    path = open_store(settings).fetch_file(file.path)
    items_.check(
        items_.file_lines(path, items_.CHECK_AT_CREATION),
        schema,
        where=f"line {{n}} of file {file.id}",
        param="data_source.source.id",
        needs_sample=needs_sample,
    )
    return file.line_count


def _evals_file(session: Session, project_seq: int, file_id: str) -> File:
    f = crud.get_file_by_id(session=session, project_seq=project_seq, file_id=file_id)
    if f is None:
        raise bad_request(
            f"No file with id '{file_id}' in this project; upload the items with POST /v1/files (purpose 'evals').",
            "data_source.source.id",
            "file_not_found",
        )
    if f.purpose not in EVAL_PURPOSES:
        raise bad_request(
            f"File '{file_id}' has purpose '{f.purpose}'; an eval run reads a file uploaded with purpose 'evals' "
            "(or 'user_data'), each line {'item': {...}}.",
            "data_source.source.id",
            "invalid_file_purpose",
        )
    return f


def check_room(session: Session, settings: Settings, project_seq: int) -> None:
    """A 429 when the project has its eval runs and checkpoint evaluations queued or running."""
    unfinished = session.scalar(
        select(func.count()).where(Evaluation.project_seq == project_seq, Evaluation.status.in_(UNFINISHED))
    )
    limit = settings.eval_runs_unfinished_per_project
    if (unfinished or 0) >= limit:
        raise LimitReached(
            f"The project has {unfinished} eval runs and evaluations queued or running, its limit "
            f"(RLOO_EVAL_RUNS_UNFINISHED_PER_PROJECT = {limit}); one frees a place when it ends. Wait, or cancel one.",
            param="data_source",
            retry_after=30,
        )

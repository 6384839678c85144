"""``rloo jobs evaluations create|list|get|cancel``: a job's checkpoints evaluated on a file by the
server's inference workers (``POST /v1/fine_tuning/jobs/{id}/evaluations``, the path it mirrors),
printed as a table a model a row. (``rloo evals`` is OpenAI's Evals API: ``worker.cli.evals``.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from worker.cli.client import ApiKey, BaseUrl, JobId, _show, _table, jobs_app, upload
from worker.cli.http import Api

evals_app = typer.Typer(help="Evaluate a job's checkpoints (over HTTP).", no_args_is_help=True, rich_markup_mode=None)
jobs_app.add_typer(evals_app, name="evaluations")

COLUMNS = ["model", "step_number", "reward_mean", "reward_std_error", "completion_length_mean", "samples"]


def rows(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    """The evaluation's results as table rows: numbers to 4 places, each grader's mean a column."""
    out = []
    for row in evaluation.get("results") or []:
        line = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "grader_means"}
        for name, mean in (row.get("grader_means") or {}).items():
            line[name] = None if mean is None else round(mean, 4)
        out.append(line)
    return out


def print_table(evaluation: dict[str, Any]) -> None:
    table = rows(evaluation)
    graders = [k for k in (table[0] if table else {}) if k not in COLUMNS and k != "unscored"]
    _table(table, COLUMNS + graders)


@evals_app.command("create")
def evals_create(
    job_id: JobId,
    file: Annotated[str, typer.Option(metavar="FILE", help="A file id, or a local JSONL file to upload.")],
    checkpoints: Annotated[str, typer.Option(metavar="IDS", help="'all', or checkpoint ids, comma-separated.")] = "all",
    samples: Annotated[int, typer.Option(metavar="N", help="Lines of the file scored.")] = 200,
    seed: Annotated[int | None, typer.Option(metavar="SEED")] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait for the table.")] = True,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Score the job's starting model and its checkpoints on FILE with the job's grader.

    \b
    Example:
      rloo jobs evaluations create ftjob-abc123 --file examples/demo/valid.jsonl --samples 50
    """
    api = Api(base_url, api_key)
    file_id = upload(api, Path(file))["id"] if Path(file).is_file() else file
    body: dict[str, Any] = {"file": file_id, "samples": samples, "seed": seed}
    body["checkpoints"] = "all" if checkpoints == "all" else [c.strip() for c in checkpoints.split(",") if c.strip()]
    evaluation = api.call("POST", f"/fine_tuning/jobs/{job_id}/evaluations", json=body)
    if not wait:
        typer.echo(f"{evaluation['id']} {evaluation['status']}")
        return
    raise typer.Exit(follow(api, job_id, evaluation))


def follow(api: Api, job_id: str, evaluation: dict[str, Any], *, poll: float = 1.0) -> int:
    """Wait for ``evaluation`` to end, showing its progress; print its table. 0 if it succeeded."""
    last = -1
    while evaluation["status"] in ("queued", "running"):
        done = evaluation["progress"]["done"]
        if done != last:
            typer.echo(
                f"{evaluation['id']}: {evaluation['status']}, {done}/{evaluation['progress']['total']}", err=True
            )
            last = done
        time.sleep(poll)
        evaluation = api.call("GET", f"/fine_tuning/jobs/{job_id}/evaluations/{evaluation['id']}")
    if evaluation["status"] != "succeeded":
        typer.echo(f"{evaluation['id']} {evaluation['status']}: {evaluation.get('error')}", err=True)
        return 1
    print_table(evaluation)
    return 0


@evals_app.command("list")
def evals_list(job_id: JobId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """A job's evaluations, newest first."""
    data = Api(base_url, api_key).call("GET", f"/fine_tuning/jobs/{job_id}/evaluations")["data"]
    for row in data:
        row["progress"] = f"{row['progress']['done']}/{row['progress']['total']}"
    _table(data, ["id", "status", "file", "samples", "progress", "created_at"])


@evals_app.command("get")
def evals_get(
    job_id: JobId,
    evaluation_id: Annotated[str, typer.Argument(metavar="EVAL_ID")],
    json_out: Annotated[bool, typer.Option("--json", help="The whole object as JSON.")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """One evaluation: its table (or, with --json, the object)."""
    evaluation = Api(base_url, api_key).call("GET", f"/fine_tuning/jobs/{job_id}/evaluations/{evaluation_id}")
    if json_out:
        _show(evaluation)
    else:
        print_table(evaluation)


@evals_app.command("cancel")
def evals_cancel(
    job_id: JobId,
    evaluation_id: Annotated[str, typer.Argument(metavar="EVAL_ID")],
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Stop an evaluation that has not ended (its results so far are kept)."""
    evaluation = Api(base_url, api_key).call("POST", f"/fine_tuning/jobs/{job_id}/evaluations/{evaluation_id}/cancel")
    typer.echo(f"{evaluation['id']} {evaluation['status']}")

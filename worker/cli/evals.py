"""``rloo evals``: OpenAI's Evals API from the command line, in its nouns (``client.evals``,
``client.evals.runs``, ``client.evals.runs.output_items``): an eval made from a JSON spec, runs of it
on a file of items (answered by a model, or graded as the lines' own samples), their output items,
and an eval's runs side by side (pass rate per criterion, per model)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from worker.cli.app import app
from worker.cli.client import ApiKey, BaseUrl, _show, _table, upload
from worker.cli.http import Api, fail

evals_app = typer.Typer(
    help="OpenAI's Evals API: evals and their runs (over HTTP).", no_args_is_help=True, rich_markup_mode=None
)
runs_app = typer.Typer(help="An eval's runs and their output items.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(evals_app, name="evals")
evals_app.add_typer(runs_app, name="runs")

EvalId = Annotated[str, typer.Argument(metavar="EVAL_ID")]
RunId = Annotated[str, typer.Argument(metavar="RUN_ID")]
ENDED = ("completed", "failed", "canceled")


def _json(text: str, what: str) -> Any:
    """``text`` as JSON, or the JSON of the file it names."""
    path = Path(text)
    try:
        return json.loads(path.read_text() if path.is_file() else text)
    except (OSError, ValueError) as exc:
        fail(f"{what} is neither a JSON file nor JSON: {exc}", code=2)


# Evals ---------------------------------------------------------------------------------------------
@evals_app.command("create")
def create(
    spec: Annotated[
        str,
        typer.Argument(metavar="SPEC", help="A JSON file (or JSON) of the eval: data_source_config, testing_criteria."),
    ],
    name: Annotated[str | None, typer.Option(metavar="NAME")] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Create an eval; print its id.

    \b
    Example:
      rloo evals create examples/migrating/eval.json --name arithmetic
    """
    body = _json(spec, "SPEC")
    if not isinstance(body, dict):
        fail("SPEC is an object: {'data_source_config': {...}, 'testing_criteria': [...]}", code=2)
    if name is not None:
        body["name"] = name
    typer.echo(Api(base_url, api_key).call("POST", "/evals", json=body)["id"])


@evals_app.command("list")
def list_(base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """The project's evals, oldest first."""
    data = Api(base_url, api_key).call("GET", "/evals", params={"limit": 100})["data"]
    rows = [{**e, "criteria": ", ".join(c["name"] for c in e["testing_criteria"])} for e in data]
    _table(rows, ["id", "name", "criteria", "created_at"])


@evals_app.command("get")
def get(
    eval_id: EvalId,
    json_out: Annotated[bool, typer.Option("--json", help="The eval object as JSON.")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """An eval's runs side by side: a run a row, its pass rate on each criterion."""
    api = Api(base_url, api_key)
    e = api.call("GET", f"/evals/{eval_id}")
    if json_out:
        _show(e)
        return
    runs = api.call("GET", f"/evals/{eval_id}/runs", params={"limit": 100})["data"]
    names = [c["name"] for c in e["testing_criteria"]]
    _table([side_by_side(r) for r in runs], ["id", "model", "status", "items", "passed", *names])


def side_by_side(run: dict[str, Any]) -> dict[str, Any]:
    """One run as a row: its pass rate overall and on each criterion (percent, one decimal)."""
    counts = run["result_counts"]
    row = {"id": run["id"], "model": run["model"] or "(the lines' samples)", "status": run["status"]}
    row["items"] = counts["total"]
    row["passed"] = _rate(counts["passed"], counts["total"])
    for r in run["per_testing_criteria_results"]:
        row[r["testing_criteria"]] = _rate(r["passed"], r["passed"] + r["failed"])
    return row


def _rate(passed: int, total: int) -> str:
    return f"{100 * passed / total:.1f}%" if total else "-"


@evals_app.command("delete")
def delete(eval_id: EvalId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Delete an eval, its runs and their output items."""
    Api(base_url, api_key).call("DELETE", f"/evals/{eval_id}")
    typer.echo(f"{eval_id} deleted")


# Runs ----------------------------------------------------------------------------------------------
@runs_app.command("create")
def runs_create(
    eval_id: EvalId,
    file: Annotated[
        str, typer.Option(metavar="FILE", help="A file id, or a local JSONL of {'item': ...} lines to upload.")
    ],
    model: Annotated[
        str | None, typer.Option(metavar="MODEL", help="The model that answers (else: the lines' samples are graded).")
    ] = None,
    template: Annotated[
        str | None, typer.Option(metavar="TEXT", help="The user message, over {{ item.<key> }}.")
    ] = None,
    system: Annotated[str | None, typer.Option(metavar="TEXT", help="A system message before it.")] = None,
    item_reference: Annotated[str | None, typer.Option(metavar="item.KEY", help="The item's own messages.")] = None,
    temperature: Annotated[float | None, typer.Option(metavar="T")] = None,
    max_tokens: Annotated[int | None, typer.Option(metavar="N")] = None,
    seed: Annotated[int | None, typer.Option(metavar="SEED")] = None,
    name: Annotated[str | None, typer.Option(metavar="NAME")] = None,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait, showing progress, and print its counts.")
    ] = True,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Start a run of an eval on FILE.

    \b
    Example:
      rloo evals runs create eval_abc --file items.jsonl --model ft:tiny-policy:... \\
          --template "What is {{ item.question }}?" --temperature 0
    """
    api = Api(base_url, api_key)
    file_id = upload(api, Path(file), purpose="evals")["id"] if Path(file).is_file() else file
    source = {"type": "file_id", "id": file_id}
    data_source: dict[str, Any] = {"type": "jsonl", "source": source}
    if model is not None:
        data_source = {"type": "completions", "model": model, "source": source}
        data_source["input_messages"] = _input_messages(template, system, item_reference)
        sampling = {"temperature": temperature, "max_completion_tokens": max_tokens, "seed": seed}
        data_source["sampling_params"] = {k: v for k, v in sampling.items() if v is not None}
    elif template or item_reference:
        fail("--template and --item-reference say what a --model answers; give one", code=2)
    run = api.call("POST", f"/evals/{eval_id}/runs", json={"name": name, "data_source": data_source})
    if not wait:
        typer.echo(f"{run['id']} {run['status']}")
        return
    raise typer.Exit(follow(api, eval_id, run))


def _input_messages(template: str | None, system: str | None, item_reference: str | None) -> dict[str, Any]:
    if item_reference is not None:
        return {"type": "item_reference", "item_reference": item_reference}
    if template is None:
        fail("a run with --model needs --template (the user message) or --item-reference", code=2)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": template}]
    return {"type": "template", "template": messages}


def follow(api: Api, eval_id: str, run: dict[str, Any], *, poll: float = 1.0) -> int:
    """Wait for ``run`` to end, showing its progress; print its row. 0 if it completed."""
    last = -1
    while run["status"] not in ENDED:
        done = run["progress"]["done"]
        if done != last:
            typer.echo(f"{run['id']}: {run['status']}, {done}/{run['progress']['total']}", err=True)
            last = done
        time.sleep(poll)
        run = api.call("GET", f"/evals/{eval_id}/runs/{run['id']}", patient=True)
    row = side_by_side(run)
    _table([row], list(row))
    if run["status"] != "completed":
        typer.echo(f"{run['id']} {run['status']}: {run['error']['message']}", err=True)
        return 1
    return 0


@runs_app.command("list")
def runs_list(eval_id: EvalId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """An eval's runs, oldest first (``rloo evals get`` shows their pass rates side by side)."""
    data = Api(base_url, api_key).call("GET", f"/evals/{eval_id}/runs", params={"limit": 100})["data"]
    rows = [{**r, "progress": f"{r['progress']['done']}/{r['progress']['total']}"} for r in data]
    _table(rows, ["id", "name", "model", "status", "progress", "created_at"])


@runs_app.command("get")
def runs_get(
    eval_id: EvalId,
    run_id: RunId,
    json_out: Annotated[bool, typer.Option("--json", help="The run object as JSON.")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """One run: its pass rates (or, with --json, the object)."""
    run = Api(base_url, api_key).call("GET", f"/evals/{eval_id}/runs/{run_id}")
    if json_out:
        _show(run)
        return
    row = side_by_side(run)
    _table([row], list(row))


@runs_app.command("cancel")
def runs_cancel(eval_id: EvalId, run_id: RunId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Stop a run that has not ended (its output items so far are kept)."""
    run = Api(base_url, api_key).call("POST", f"/evals/{eval_id}/runs/{run_id}/cancel")
    typer.echo(f"{run['id']} {run['status']}")


@runs_app.command("delete")
def runs_delete(eval_id: EvalId, run_id: RunId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Delete a run and its output items."""
    Api(base_url, api_key).call("DELETE", f"/evals/{eval_id}/runs/{run_id}")
    typer.echo(f"{run_id} deleted")


@runs_app.command("output-items")
def output_items(
    eval_id: EvalId,
    run_id: RunId,
    status: Annotated[str | None, typer.Option(metavar="STATUS", help="pass, fail or error.")] = None,
    limit: Annotated[int, typer.Option(metavar="N")] = 20,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """A run's output items: each item's answer and its score on each criterion."""
    params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {})}
    data = Api(base_url, api_key).call("GET", f"/evals/{eval_id}/runs/{run_id}/output_items", params=params)["data"]
    rows = []
    for item in data:
        row = {"item": item["datasource_item_id"], "status": item["status"]}
        row["output"] = " ".join(m.get("content") or "" for m in item["sample"]["output"])[:60]
        row |= {r["name"]: round(r["score"], 4) for r in item["results"]}
        rows.append(row)
    _table(rows, list(rows[0]) if rows else ["item", "status", "output"])

"""``rloo tinker runs|checkpoints``: a project's Tinker training runs and their checkpoints, over
HTTP (the server's ``/api/v1``, as the SDK's RestClient reads them), with any key of the project."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from worker.cli.app import app
from worker.cli.client import ApiKey, BaseUrl, _table
from worker.cli.http import Api

tinker_app = typer.Typer(
    help="Tinker training runs and checkpoints on a server (over HTTP).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(tinker_app, name="tinker")


def _get(api: Api, path: str, **params: Any) -> Any:
    """``path`` under the server's /api/v1 (the client's base URL is its /v1)."""
    return api.call("GET", f"{api.base_url.removesuffix('/v1')}/api/v1{path}", params=params)


@tinker_app.command("runs")
def runs(
    limit: Annotated[int, typer.Option(metavar="N")] = 20, base_url: BaseUrl = None, api_key: ApiKey = None
) -> None:
    """The project's Tinker training runs, newest first, with their newest saved state."""
    rows = _get(Api(base_url, api_key), "/training_runs", limit=limit)["training_runs"]
    for row in rows:
        row["last_state"] = (row.get("last_checkpoint") or {}).get("tinker_path")
        row["last_sampler"] = (row.get("last_sampler_checkpoint") or {}).get("tinker_path")
    _table(rows, ["training_run_id", "base_model", "lora_rank", "last_request_time", "last_state", "last_sampler"])


@tinker_app.command("checkpoints")
def checkpoints(
    run_id: Annotated[str, typer.Argument(metavar="RUN_ID")], base_url: BaseUrl = None, api_key: ApiKey = None
) -> None:
    """A training run's checkpoints, oldest first: each ``tinker://`` path is a model of the project."""
    rows = _get(Api(base_url, api_key), f"/training_runs/{run_id}/checkpoints")["checkpoints"]
    _table(rows, ["tinker_path", "checkpoint_type", "time", "size_bytes", "expires_at"])

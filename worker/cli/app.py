"""The typer application the command modules register on. Plain help (click's): each option shows
its metavar (``HOST``, ``KEY=VALUE``), and each command an example."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="rloo-service: RLOO fine-tuning as a service. `rloo up` runs it all on this machine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True, rich_markup_mode=None)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
projects_app = typer.Typer(help="Projects (the operator's).", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(projects_app, name="projects")

LOCAL_PROJECT = "local"
"""The project of the key `rloo up` makes for its user."""


def redact(url: str) -> str:
    from service.core.settings import redact_url

    return redact_url(url)


def torch_threads(*, say: bool = True) -> None:
    """Choose this process's torch threads (``RLOO_TORCH_THREADS``) before torch is imported, and,
    unless told not to, say on stderr what was chosen and why."""
    from service.core.settings import get_settings
    from worker.engine.cpu_threads import configure

    choice = configure(get_settings().torch_threads)
    if say:
        typer.echo(choice.describe(), err=True)

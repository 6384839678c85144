"""``rloo db upgrade`` and ``rloo keys create|revoke|list``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from service.core.settings import get_settings
from worker.cli.app import db_app, keys_app, redact


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Option(metavar="REVISION", help="Alembic revision.")] = "head",
) -> None:
    """Create or migrate the schema of DATABASE_URL (default: the SQLite file under RLOO_HOME).

    \b
    Example:
      DATABASE_URL=postgresql://rloo@db/rloo rloo db upgrade
    """
    from service.core.migrate import upgrade

    upgrade(revision=revision)
    typer.echo(f"database at revision {revision}: {redact(get_settings().database_url)}")


@contextmanager
def _keys_session() -> Iterator[Any]:
    """A session for the key commands; a database with no schema yet (before the first `rloo up` or
    `rloo db upgrade`) is one line saying what to run, exit 1, not the driver's traceback."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from service.core.db import session_scope

    try:
        with session_scope() as session:
            yield session
    except (OperationalError, ProgrammingError) as exc:
        if not _missing_table(exc.orig):
            raise
        where = redact(get_settings().database_url)
        typer.echo(
            f"error: the database at {where} has no schema yet: run `rloo db upgrade` (rloo up does it)", err=True
        )
        raise typer.Exit(1) from None


def _missing_table(error: BaseException | None) -> bool:
    """The driver's "no such table": SQLite's message, PostgreSQL's undefined_table (42P01); not a
    missing database or role, which say "does not exist" too."""
    return (
        "no such table" in str(error)
        or getattr(error, "sqlstate", None) == "42P01"
        or getattr(error, "pgcode", None) == "42P01"
    )


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(metavar="NAME", help="Project name; created if new.")],
    name: Annotated[str, typer.Option(metavar="LABEL", help="A label for the key.")] = "",
    operator: Annotated[
        bool,
        typer.Option("--operator", help="The operator's key: also the routes over every project (GET /v1/workers)."),
    ] = False,
    tinker: Annotated[
        bool,
        typer.Option(
            "--tinker", help="A key the tinker SDK accepts (it starts with tml-); it serves the rest of the API too."
        ),
    ] = False,
) -> None:
    """Create an API key. It is shown once, on the last line; only its hash is stored. An operator's
    key (--operator) is its project's key too, and also lists the fleet of workers. The tinker SDK
    takes only keys that start with tml- (--tinker).

    \b
    Example:
      export RLOO_API_KEY=$(rloo keys create --project research | tail -1)
      export TINKER_API_KEY=$(rloo keys create --project research --tinker | tail -1)
      rloo keys create --project ops --operator
    """
    from service.core import crud

    with _keys_session() as session:
        proj = crud.get_or_create_project(session=session, name=project)
        row, secret = crud.create_api_key(
            session=session,
            project=proj,
            name=name,
            operator=operator,
            prefix=crud.TINKER_KEY_PREFIX if tinker else None,
        )
        session.commit()
        kind = "operator key" if operator else "key"
        typer.echo(f"project {proj.name} ({proj.id}), {kind} {row.id} (prefix {row.prefix}); store it now:", err=True)
    typer.echo(secret)


@keys_app.command("revoke")
def keys_revoke(key: Annotated[str, typer.Argument(metavar="KEY_ID", help="Key id (key-…) or its prefix.")]) -> None:
    """Revoke a key: requests with it get 401 within RLOO_AUTH_CACHE_SECONDS (5 s by default).

    \b
    Example:
      rloo keys revoke key-3f9a…
    """
    from service.core import crud

    with _keys_session() as session:
        n = crud.revoke_api_key(session=session, key_id_or_prefix=key)
        session.commit()
    if not n:
        typer.echo(f"no key matches '{key}'", err=True)
        raise typer.Exit(1)
    wait = get_settings().auth_cache_seconds
    typer.echo(f"revoked {n} key(s); running API processes refuse them within {wait:g} s (RLOO_AUTH_CACHE_SECONDS)")


@keys_app.command("list")
def keys_list() -> None:
    """List keys (ids and prefixes; secrets are never stored)."""
    from service.core import crud

    with _keys_session() as session:
        for row in crud.list_api_keys(session=session):
            state = "revoked" if row.revoked_at else "active"
            typer.echo(f"{row.id}\t{row.prefix}…\t{row.project.name}\t{state}" + ("\toperator" if row.operator else ""))

"""``rloo db upgrade``, ``rloo keys create|revoke|list`` and ``rloo projects create|list|archive|restore``:
the operator's, on the database directly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from service.core.settings import get_settings
from worker.cli.app import db_app, keys_app, projects_app, redact


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
def _admin_session() -> Iterator[Any]:
    """A session for the key and project commands; a database with no schema yet (before the first
    `rloo up` or `rloo db upgrade`) is one line saying what to run, exit 1, not the driver's traceback;
    so is a value the domain refuses (an unknown scope), in its own words."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from service.core.db import session_scope
    from service.core.errors import DomainError

    try:
        with session_scope() as session:
            yield session
    except DomainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    except (OperationalError, ProgrammingError) as exc:
        if not _missing_table(exc.orig):
            raise
        where = redact(get_settings().database_url)
        typer.echo(
            f"error: the database at {where} has no schema yet: run `rloo db upgrade` (rloo up does it)", err=True
        )
        raise typer.Exit(1) from None


def _audit(session: Any, project: Any, action: str, object_id: str) -> None:
    """The audit row of an operator's action on the database directly (client ``cli``, key ``cli``)."""
    from service.core.crud import Caller
    from service.tenancy import audit

    caller = Caller(seq=project.seq, id=project.id, key_id="cli", operator=True)
    audit.record(session, caller=caller, action=action, object_id=object_id)


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
    scope: Annotated[
        list[str] | None,
        typer.Option(
            metavar="SCOPE",
            help="What the key may do (again for more): files:read|write, jobs:read|write, models:read|write, "
            "inference, webhooks, keys (the project's admin), or all (the default).",
        ),
    ] = None,
    expires_in: Annotated[
        str | None, typer.Option(metavar="DURATION", help="Expire after 30d, 12h, 90m, 2w… (default: never).")
    ] = None,
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
    """Create an API key. It is shown once, on the last line; only its hash is stored. Without
    --scope it may do everything in its project; an operator's key (--operator) is its project's key
    too, and also manages projects and lists the fleet of workers. The tinker SDK takes only keys that
    start with tml- (--tinker).

    \b
    Example:
      export RLOO_API_KEY=$(rloo keys create --project research | tail -1)
      rloo keys create --project research --scope jobs:read --scope models:read --expires-in 30d --name dashboard
      export TINKER_API_KEY=$(rloo keys create --project research --tinker | tail -1)
      rloo keys create --project ops --operator
    """
    from service.tenancy import keys, projects, scopes

    with _admin_session() as session:
        held = scopes.parse(scope, param="--scope") if scope else None
        seconds = keys.parse_duration(expires_in, param="--expires-in") if expires_in is not None else None
        proj = projects.get_or_create_project(session=session, name=projects.check_name(project))
        row, secret = keys.create_api_key(
            session=session,
            project=proj,
            name=name,
            operator=operator,
            prefix=keys.TINKER_KEY_PREFIX if tinker else None,
            scopes=held,
            expires_in=seconds,
        )
        _audit(session, proj, "rloo keys create", row.id)
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
    from service.tenancy import keys

    with _admin_session() as session:
        n = keys.revoke_api_key(session=session, key_id_or_prefix=key)
        for row in keys.find_by_id_or_prefix(session=session, key_id_or_prefix=key):
            _audit(session, row.project, "rloo keys revoke", row.id)
        session.commit()
    if not n:
        typer.echo(f"no key matches '{key}'", err=True)
        raise typer.Exit(1)
    wait = get_settings().auth_cache_seconds
    typer.echo(f"revoked {n} key(s); running API processes refuse them within {wait:g} s (RLOO_AUTH_CACHE_SECONDS)")


@keys_app.command("list")
def keys_list(
    project: Annotated[str | None, typer.Option(metavar="NAME", help="Only this project's keys.")] = None,
) -> None:
    """List keys: id, prefix, project, state (active, expired, revoked), scopes, expiry (secrets
    are never stored)."""
    from service.tenancy import keys, projects, scopes

    with _admin_session() as session:
        only = projects.find_project(session=session, id_or_name=project, param="--project") if project else None
        for row in keys.list_api_keys(session=session, project=only):
            held = ",".join(scopes.ordered(keys.held_scopes(row)))
            expiry = f"expires {_when(row.expires_at)}" if row.expires_at else "no expiry"
            typer.echo(f"{row.id}\t{row.prefix}…\t{row.project.name}\t{keys.key_state(row)}\t{held}\t{expiry}")


def _when(t: int) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


@projects_app.command("create")
def projects_create(name: Annotated[str, typer.Argument(metavar="NAME", help="The project's name.")]) -> None:
    """Create a project (its first key: rloo keys create --project NAME --scope all).

    \b
    Example:
      rloo projects create tenant-a && rloo keys create --project tenant-a --name admin
    """
    from service.tenancy import projects

    with _admin_session() as session:
        project = projects.create_project(session=session, name=name)
        _audit(session, project, "rloo projects create", project.id)
        session.commit()
        typer.echo(f"project {project.name} ({project.id})")


@projects_app.command("list")
def projects_list() -> None:
    """List projects: id, name, state (active or archived), active keys."""
    from service.tenancy import projects

    with _admin_session() as session:
        counts = projects.key_counts(session=session)
        for p in projects.list_projects(session=session):
            state = "archived" if p.archived_at else "active"
            typer.echo(f"{p.id}\t{p.name}\t{state}\t{counts.get(p.seq, 0)} key(s)")


@projects_app.command("archive")
def projects_archive(project: Annotated[str, typer.Argument(metavar="PROJECT", help="Its name or id.")]) -> None:
    """Archive a project: its jobs, files and models are kept; its keys are refused (403
    project_archived) within RLOO_AUTH_CACHE_SECONDS. Undo with rloo projects restore."""
    from service.tenancy import projects

    _change_project(project, "archive", lambda row: projects.archive(project=row))


@projects_app.command("restore")
def projects_restore(project: Annotated[str, typer.Argument(metavar="PROJECT", help="Its name or id.")]) -> None:
    """Restore an archived project: its keys work again."""
    from service.tenancy import projects

    _change_project(project, "restore", lambda row: projects.restore(project=row))


def _change_project(project: str, verb: str, change: Any) -> None:
    """``change`` a project (by name or id), audited, committed, said."""
    from service.tenancy import projects

    with _admin_session() as session:
        row = projects.find_project(session=session, id_or_name=project, param="PROJECT")
        change(row)
        _audit(session, row, f"rloo projects {verb}", row.id)
        session.commit()
        typer.echo(f"project {row.name} ({row.id}) {verb}d")


@projects_app.command("quota")
def projects_quota(
    project: Annotated[str, typer.Argument(metavar="PROJECT", help="Its name or id.")],
    settings: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[NAME=VALUE]...",
            help="running_jobs, gpus, queued_jobs, stored_bytes, inference_tokens_per_minute, "
            "device_hours_per_day, cost_per_day; NAME= unsets one.",
        ),
    ] = None,
) -> None:
    """Show a project's quotas, or set them (a number each; NAME= unsets one and the default holds).

    \b
    Example:
      rloo projects quota tenant-a running_jobs=2 gpus=4 device_hours_per_day=24 stored_bytes=50000000000
      rloo projects quota tenant-a gpus=
    """
    from service.core.errors import bad_request
    from service.tenancy import projects, quotas

    with _admin_session() as session:
        row = projects.find_project(session=session, id_or_name=project, param="PROJECT")
        if settings:
            asked: dict[str, Any] = {}
            for item in settings:
                name, sep, value = item.partition("=")
                if not sep:
                    raise bad_request(f"Write NAME=VALUE (or NAME= to unset); got {item!r}.", "NAME=VALUE")
                asked[name.strip()] = _number(value.strip()) if value.strip() else None
            quotas.apply(row, quotas.parse(asked, param="quota"))
            _audit(session, row, "rloo projects quota", row.id)
            session.commit()
        for name, value in quotas.project_quotas(row).items():
            typer.echo(f"{name}\t{'(default)' if value is None else f'{value:g}'}")


def _number(text: str) -> Any:
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return text  # quotas.parse names it

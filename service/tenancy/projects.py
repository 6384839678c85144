"""Projects: made by the operator (``rloo projects create``, ``POST /v1/projects``) or by
``rloo keys create --project NAME`` on first use, listed, archived (its objects kept, its keys
refused) and restored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.core.errors import Conflict, bad_request, not_found
from service.core.tables import ApiKey, Project, now

NAME_LIMIT = 200


def get_or_create_project(*, session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        project = Project(name=name)
        session.add(project)
        session.flush()
    return project


def check_name(name: str) -> str:
    name = name.strip()
    if not name or len(name) > NAME_LIMIT or any(ord(c) < 32 for c in name):
        raise bad_request(f"A project's name is 1 to {NAME_LIMIT} printable characters; got {name!r}.", "name")
    if name.startswith("proj-"):  # ids are proj-…: a name may never be read as another project's id
        raise bad_request(f"A project's name may not start with 'proj-' (project ids do); got {name!r}.", "name")
    return name


def create_project(*, session: Session, name: str) -> Project:
    """A new project; a name in use is a 409 (names are how the CLI finds a project)."""
    name = check_name(name)
    if session.scalar(select(Project.seq).where(Project.name == name)) is not None:
        raise name_taken(name)
    project = Project(name=name)
    session.add(project)
    session.flush()
    return project


def name_taken(name: str) -> Conflict:
    return Conflict(f"A project named {name!r} exists already; choose another name.", param="name", code="name_taken")


def find_project(*, session: Session, id_or_name: str, param: str = "project_id") -> Project:
    project = session.scalar(select(Project).where((Project.id == id_or_name) | (Project.name == id_or_name)))
    if project is None:
        raise not_found("project", id_or_name, param)
    return project


def find_by_seq(*, session: Session, seq: int) -> Project:
    return session.get_one(Project, seq)


def list_projects(*, session: Session) -> Sequence[Project]:
    return session.scalars(select(Project).order_by(Project.seq)).all()


def archive(*, project: Project, by_project_seq: int | None = None) -> None:
    """Archive ``project``: its keys are refused from the next auth check on (RLOO_AUTH_CACHE_SECONDS),
    its jobs, files and models are kept. Over HTTP (``by_project_seq``: the operator key's project),
    the operator's own project may not be archived: its key would lock itself out."""
    if project.seq == by_project_seq:
        raise Conflict(
            "This is the project of the operator's key making the request; archiving it would lock that key out.",
            param="project_id",
            code="invalid_state",
        )
    project.archived_at = project.archived_at or now()


def restore(*, project: Project) -> None:
    project.archived_at = None


def key_counts(*, session: Session) -> dict[int, int]:
    """Active (unrevoked) keys by project seq."""
    rows = session.execute(
        select(ApiKey.project_seq, func.count()).where(ApiKey.revoked_at.is_(None)).group_by(ApiKey.project_seq)
    )
    return {seq: n for seq, n in rows}


def project_object(project: Project, *, keys: int | None = None) -> dict[str, Any]:
    from service.tenancy.quotas import project_quotas

    out: dict[str, Any] = {
        "object": "project",
        "id": project.id,
        "name": project.name,
        "status": "archived" if project.archived_at is not None else "active",
        "created_at": project.created_at,
        "archived_at": project.archived_at,
        "quotas": project_quotas(project),
    }
    if keys is not None:
        out["active_keys"] = keys
    return out

"""API keys: made (the secret shown once, its SHA-256 digest stored), checked on each request (with
its scopes, expiry and project), listed without a secret, revoked. Shared by the API's ``/v1/keys``
and ``/v1/projects/{id}/keys``, the CLI's ``rloo keys`` and the tests."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.core.crud import Caller
from service.core.errors import Forbidden, Unauthenticated, bad_request, not_found
from service.core.tables import ApiKey, Project, now
from service.tenancy import scopes as scope_names

KEY_PREFIX = "rloo-"
TINKER_KEY_PREFIX = "tml-rloo-"
"""A key the tinker SDK accepts (it refuses one that does not start with ``tml-``)."""
LAST_USED_EVERY = 60
"""Seconds between writes of a key's ``last_used_at`` (a key used all day writes once a minute)."""
MAX_EXPIRES_IN = 10 * 365 * 86400


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(
    *,
    session: Session,
    project: Project,
    name: str = "",
    operator: bool = False,
    prefix: str | None = None,
    scopes: frozenset[str] | None = None,
    expires_in: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key (``operator``: one that may also call the operator's routes; ``prefix``: its
    secret's start, ``KEY_PREFIX`` by default; ``scopes``: what it may do, all of a project's by
    default; ``expires_in``: seconds it lives, for ever by default); returns the row and the secret,
    which is never stored and shown only now."""
    if expires_in is not None and not 1 <= expires_in <= MAX_EXPIRES_IN:
        raise bad_request(f"expires_in must be between 1 second and 10 years; got {expires_in}.", "expires_in")
    start = prefix or KEY_PREFIX
    secret = start + secrets.token_urlsafe(32)
    row = ApiKey(
        project_seq=project.seq,
        name=name,
        prefix=secret[: len(start) + 7],
        key_hash=hash_key(secret),
        operator=operator,
        scopes=None if scopes is None or scopes >= scope_names.ALL else scope_names.ordered(scopes),
        expires_at=None if expires_in is None else now() + expires_in,
    )
    session.add(row)
    session.flush()
    return row, secret


def held_scopes(row: Any) -> frozenset[str]:
    """What a key row (or a row of its columns) may do: its scopes (all of a project's where none are
    stored, as for a key made before scopes), and ``operator`` for an operator's key."""
    held = scope_names.ALL if row.scopes is None else frozenset(row.scopes) & scope_names.ALL
    return held | {scope_names.OPERATOR} if row.operator else held


def authenticate(*, session: Session, secret: str) -> Caller | None:
    """The caller of a secret, or None for one no key has or that is revoked; an expired key is a 401
    ``key_expired`` that says so. Writes the key's last use at most once a minute."""
    digest = hash_key(secret)
    row = session.execute(
        select(
            ApiKey.key_hash,
            ApiKey.revoked_at,
            ApiKey.id.label("key_id"),
            ApiKey.operator,
            ApiKey.scopes,
            ApiKey.expires_at,
            ApiKey.last_used_at,
            Project.seq,
            Project.id,
            Project.archived_at,
        )
        .join(Project, Project.seq == ApiKey.project_seq)
        .where(ApiKey.key_hash == digest)
    ).first()
    # The lookup is by digest (an index probe); compare again in constant time so that no timing
    # difference tells an attacker how much of a digest matched.
    if row is None or row.revoked_at is not None or not hmac.compare_digest(row.key_hash, digest):
        return None
    caller = Caller(
        seq=row.seq,
        id=row.id,
        key_id=row.key_id,
        operator=bool(row.operator),
        scopes=held_scopes(row),
        expires_at=row.expires_at,
        archived=row.archived_at is not None,
    )
    check_usable(caller)
    t = now()
    if row.last_used_at is None or row.last_used_at <= t - LAST_USED_EVERY:
        from service.core.db import write_lock

        with write_lock(session):  # SQLite's one writer at a time, as every write of the API takes it
            session.execute(update(ApiKey).where(ApiKey.id == row.key_id).values(last_used_at=t))
            session.commit()
    return caller


def check_usable(caller: Caller) -> None:
    """A 401 for an expired key, a 403 for an archived project's key (each checked again on a key
    the API remembers, so that it ends on time)."""
    if caller.expires_at is not None and caller.expires_at <= now():
        raise Unauthenticated(
            "This API key has expired: ask your project's admin for a new one (`rloo keys create`, POST /v1/keys).",
            code="key_expired",
        )
    if caller.archived:
        raise Forbidden(
            "This key's project is archived: its objects are kept, and no key of it may be used. "
            "Ask the operator to restore it (`rloo projects restore`).",
            code="project_archived",
        )


def grant(*, caller: Caller, asked: frozenset[str]) -> frozenset[str]:
    """The scopes ``caller`` may give a new key: only ones it holds (an admin without ``files:write``
    makes no key with it), so no key can make a stronger one."""
    missing = scope_names.ordered(asked - caller.scopes)
    if missing:
        raise Forbidden(
            f"A key may give a new key only scopes it holds; this one lacks {', '.join(missing)}.",
            code="insufficient_scope",
        )
    return asked


def lifetime(*, caller: Caller, asked: int | None) -> int | None:
    """The seconds a new key may live: no longer than the key that makes it (its remaining time by
    default), so an expiring key cannot make one that outlives it."""
    if caller.expires_at is None:
        return asked
    left = max(1, caller.expires_at - now())
    if asked is None:
        return left
    if asked > left:
        raise Forbidden(
            f"A key may not outlive the key that makes it: this one expires in {left} s; ask for expires_in <= {left}.",
            code="insufficient_scope",
        )
    return asked


def find_key(*, session: Session, project_seq: int, key_id: str) -> ApiKey:
    row = session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.project_seq == project_seq))
    if row is None:
        raise not_found("API key", key_id, "key_id")
    return row


def revoke_key(*, row: ApiKey, caller: Caller) -> None:
    """Revoke ``row`` (a key of ``caller``'s project, or any key for an operator): an operator's key
    only by an operator."""
    if row.operator and not caller.operator:
        raise Forbidden("Only an operator's key may revoke an operator's key.", code="insufficient_scope")
    stronger = scope_names.ordered(held_scopes(row) - caller.scopes)
    if stronger:
        raise Forbidden(
            f"A key may revoke only keys holding no scope it lacks; that key holds {', '.join(stronger)}.",
            code="insufficient_scope",
        )
    row.revoked_at = row.revoked_at or now()


def find_by_id_or_prefix(*, session: Session, key_id_or_prefix: str) -> Sequence[ApiKey]:
    return session.scalars(
        select(ApiKey).where((ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix))
    ).all()


def revoke_api_key(*, session: Session, key_id_or_prefix: str) -> int:
    """``rloo keys revoke``: every key with that id or prefix, of any project."""
    rows = find_by_id_or_prefix(session=session, key_id_or_prefix=key_id_or_prefix)
    for row in rows:
        row.revoked_at = row.revoked_at or now()
    return len(rows)


def list_api_keys(*, session: Session, project: Project | None = None) -> Sequence[ApiKey]:
    stmt = select(ApiKey).order_by(ApiKey.seq)
    if project is not None:
        stmt = stmt.where(ApiKey.project_seq == project.seq)
    return session.scalars(stmt).all()


def key_state(row: ApiKey) -> str:
    if row.revoked_at is not None:
        return "revoked"
    return "expired" if row.expires_at is not None and row.expires_at <= now() else "active"


def key_object(row: ApiKey, secret: str | None = None) -> dict[str, Any]:
    """A key as the API shows it: never its digest; its secret (``value``) only when just made."""
    out: dict[str, Any] = {
        "object": "api_key",
        "id": row.id,
        "name": row.name,
        "prefix": row.prefix,
        "scopes": scope_names.ordered(held_scopes(row)),
        "operator": bool(row.operator),
        "status": key_state(row),
        "created_at": row.created_at,
        "expires_at": row.expires_at,
        "last_used_at": row.last_used_at,
        "revoked_at": row.revoked_at,
        "project_id": row.project.id,
    }
    if secret is not None:
        out["value"] = secret
    return out


_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, *, param: str = "expires_in") -> int:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a number of seconds, as seconds."""
    match = _DURATION.match(text)
    if not match or int(match.group(1)) == 0:
        raise bad_request(
            f"{param} must be a positive number with a unit s, m, h, d or w (e.g. 30d); got {text!r}.", param
        )
    return int(match.group(1)) * _UNIT[match.group(2)]

"""The audit log: every mutating request (and the operator's CLI actions) leaves one row naming the
key, project, action, object, outcome, client and time, written with the change it records; a
project's admin reads its own project's, an operator every project's; no secret is ever in it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.api import assert_error, make_key, upload_ok
from tests.helpers.live import run_cli


@pytest.fixture
def app(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from service.core.settings import get_settings
    from service.main import create_app

    monkeypatch.setenv("RLOO_AUTH_CACHE_SECONDS", "0")
    get_settings.cache_clear()
    return create_app()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def events(client: Any, headers: dict[str, str], query: str = "") -> list[dict[str, Any]]:
    resp = client.get(f"/v1/audit?limit=100{query}", headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


def test_each_mutation_leaves_one_row_with_its_outcome(client, auth) -> None:
    me = client.get("/v1/me", headers=auth).json()
    uploaded = upload_ok(client, auth)
    made = client.post("/v1/keys", headers=auth, json={"name": "reader", "scopes": ["files:read"]}).json()
    reader = bearer(made["value"])
    assert_error(client.delete(f"/v1/files/{uploaded['id']}", headers=reader), 403, code="insufficient_scope")
    assert_error(client.delete("/v1/files/file-nope", headers=auth), 404)
    client.get("/v1/files", headers=auth)  # a read: not audited
    deleted = client.delete(f"/v1/files/{uploaded['id']}", headers=auth)
    assert deleted.status_code == 200, deleted.text

    rows = events(client, auth)
    assert [(r["action"], r["outcome"], r["status"]) for r in rows] == [
        ("DELETE /v1/files/{file_id}", "succeeded", 200),
        ("DELETE /v1/files/{file_id}", "refused", 404),
        ("DELETE /v1/files/{file_id}", "refused", 403),
        ("POST /v1/keys", "succeeded", 201),
        ("POST /v1/files", "succeeded", 200),
    ]
    newest, missing, forbidden, key_row, upload_row = rows
    assert newest["object_id"] == uploaded["id"] and newest["key_id"] == me["key"]["id"]
    assert missing["object_id"] == "file-nope" and missing["error_code"] == "not_found"
    assert forbidden["key_id"] == made["id"] and forbidden["error_code"] == "insufficient_scope"
    assert key_row["object_id"] == made["id"]  # the created object, found in the transaction
    assert upload_row["object_id"] == uploaded["id"]
    assert {r["project_id"] for r in rows} == {me["project"]["id"]}
    assert {r["client"] for r in rows} == {"127.0.0.1"}
    assert made["value"] not in client.get("/v1/audit?limit=100", headers=auth).text  # never a secret


def test_the_row_lands_with_the_change_or_not_at_all(client, auth, monkeypatch) -> None:
    """A commit that fails (here: a second key with the first's digest breaks the unique index at the
    flush) keeps neither the change nor its success row; the failure is recorded after the answer."""
    from fastapi.testclient import TestClient

    from service.tenancy import keys as tenancy_keys

    monkeypatch.setattr(tenancy_keys.secrets, "token_urlsafe", lambda n: "same-secret-twice")
    assert client.post("/v1/keys", headers=auth, json={"name": "first"}).status_code == 201
    before = client.get("/v1/keys", headers=auth).json()["data"]
    with TestClient(client.app, raise_server_exceptions=False) as raw:
        assert raw.post("/v1/keys", headers=auth, json={"name": "second"}).status_code == 500
    assert client.get("/v1/keys", headers=auth).json()["data"] == before
    failed, first = events(client, auth)
    assert (failed["action"], failed["outcome"], failed["status"]) == ("POST /v1/keys", "failed", 500)
    assert failed["object_id"] is None and first["outcome"] == "succeeded"


def test_admins_read_their_project_and_operators_every_one(client, auth, other_auth) -> None:
    operator = bearer(make_key("ops", operator=True))
    upload_ok(client, auth)
    upload_ok(client, other_auth)
    alpha = client.get("/v1/me", headers=auth).json()["project"]["id"]
    beta = client.get("/v1/me", headers=other_auth).json()["project"]["id"]
    assert {r["project_id"] for r in events(client, auth)} == {alpha}
    assert {r["project_id"] for r in events(client, other_auth)} == {beta}
    assert {r["project_id"] for r in events(client, operator)} >= {alpha, beta}
    assert {r["project_id"] for r in events(client, operator, f"&project_id={beta}")} == {beta}
    assert_error(client.get(f"/v1/audit?project_id={beta}", headers=auth), 403, code="insufficient_permissions")
    reader = bearer(make_key("alpha", scopes=["files:read", "jobs:read"]))
    assert_error(client.get("/v1/audit", headers=reader), 403, code="insufficient_scope")
    refused = events(client, auth, "&outcome=refused")
    assert refused == [] and events(client, auth, "&outcome=succeeded")
    assert_error(client.get("/v1/audit?outcome=maybe", headers=auth), 400, param="outcome")


def test_cli_admin_actions_are_audited(client, env) -> None:
    operator = bearer(make_key("ops", operator=True))
    assert run_cli("projects", "create", "audited", env=env).returncode == 0
    made = run_cli("keys", "create", "--project", "audited", "--scope", "jobs:read", env=env)
    assert made.returncode == 0, made.stderr
    assert run_cli("projects", "archive", "audited", env=env).returncode == 0
    rows = [r for r in events(client, operator) if r["client"] == "cli"]
    assert [r["action"] for r in rows][:3] == ["rloo projects archive", "rloo keys create", "rloo projects create"]
    assert made.stdout.strip().splitlines()[-1] not in str(rows)


def test_old_rows_are_swept_after_the_retention(client, auth) -> None:
    from sqlalchemy import update

    from service.core.db import session_scope
    from service.core.tables import AuditEvent, now
    from service.tenancy import audit

    upload_ok(client, auth)
    upload_ok(client, auth)
    with session_scope() as session:
        oldest = session.query(AuditEvent).order_by(AuditEvent.seq).first()
        assert oldest is not None
        session.execute(update(AuditEvent).where(AuditEvent.seq == oldest.seq).values(created_at=now() - 91 * 86400))
        session.commit()
        assert audit.sweep(session, retention_days=0) == 0  # 0 keeps every row
        assert audit.sweep(session, retention_days=90) == 1
    assert len(events(client, auth)) == 1

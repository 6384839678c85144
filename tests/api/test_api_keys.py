"""Scoped keys, project admins and the operator's projects.

Every route needs a scope (``service.api.route_scopes``): a key holding only one scope is refused every
route that needs another, with 403 ``insufficient_scope`` naming it, before its body is read, and
let through every route its scope opens. A project's admin (``keys``) makes, lists and revokes its
project's keys over HTTP, never a stronger key than its own; an expired key is a 401 ``key_expired``;
an operator makes projects, their first keys, and archives them.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from service.api import route_scopes
from service.tenancy import scopes as scope_names
from tests.helpers.api import assert_error, each, make_key
from tests.helpers.live import run_cli

GARBAGE = b"\xff{not json"


@pytest.fixture
def app(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """conftest's app with the per-key rate limit off (the matrix sends a request a route a scope)
    and no auth cache (a revoked or expired key is refused at once)."""
    from service.core.settings import get_settings
    from service.main import create_app

    monkeypatch.setenv("RLOO_RATE_LIMIT", "0")
    monkeypatch.setenv("RLOO_AUTH_CACHE_SECONDS", "0")
    get_settings.cache_clear()
    return create_app()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every route behind a key: /v1 and the Tinker protocol's."""
    from fastapi import routing

    from service.api.middleware import OPEN_TINKER_PATHS, OPEN_TINKER_PREFIXES

    flatten = getattr(routing, "iter_route_contexts", lambda routes: routes)
    found = set()
    for route in flatten(app.routes):
        path = getattr(route, "path", "") or ""
        keyed = path.startswith("/v1/") or path.startswith("/api/v1/")
        if not keyed or path in OPEN_TINKER_PATHS or path.startswith(OPEN_TINKER_PREFIXES):
            continue
        found |= {(m, path) for m in getattr(route, "methods", ()) if m != "HEAD"}
    return found


def concrete(path: str) -> str:
    """A template with made-up ids (a model id with a slash in it, as a base model's may have)."""
    return re.sub(r"\{[^}]+\}", lambda m: "org/some-model" if m.group().endswith(":path}") else "x-0", path)


def test_every_route_needs_a_named_scope(app) -> None:
    """The table and the app hold the same routes; each template's own paths find it (a fixed path
    is not read as an id of its templated neighbour); each scope is a known one."""
    assert app_routes(app) == set(route_scopes.ROUTE_SCOPES), "add the route to service.api.route_scopes.ROUTE_SCOPES"
    known = set(scope_names.PROJECT_SCOPES) | {scope_names.OPERATOR}
    for (method, template), needed in route_scopes.ROUTE_SCOPES.items():
        assert set(needed) <= known, (method, template, needed)
        assert route_scopes.needed(method, concrete(template)) == (template, needed), (method, template)
    assert route_scopes.needed("GET", "/v1/nothing-here") is None
    assert route_scopes.needed("HEAD", "/v1/files") == ("/v1/files", ("files:read",))


def test_each_scope_opens_its_routes_and_no_other(client, env) -> None:
    """A key holding one scope, on every route: 403 insufficient_scope naming what it lacks, before
    the (unreadable) body is read, wherever the route needs another; anything else where it may."""
    keys = {scope: bearer(make_key("alpha", scopes=[scope])) for scope in scope_names.PROJECT_SCOPES}

    def check(scope: str, method: str, template: str, needed: tuple[str, ...]) -> None:
        held = scope_names.parse([scope])
        body = GARBAGE if method in ("POST", "PUT", "PATCH") else None
        resp = client.request(method, concrete(template), headers=keys[scope], content=body)
        if not needed or held & set(needed):
            assert resp.status_code != 403 or resp.json()["error"]["code"] != "insufficient_scope", resp.text
        elif needed == route_scopes.OPERATOR:
            assert_error(resp, 403, code="insufficient_permissions", contains="operator")
        else:
            err = assert_error(resp, 403, code="insufficient_scope")
            assert f"'{needed[0]}'" in err["message"] and template in err["message"], err

    cases = [
        (scope, method, template, needed)
        for scope in scope_names.PROJECT_SCOPES
        for (method, template), needed in route_scopes.ROUTE_SCOPES.items()
        if not template.startswith("/api/v1/") or needed  # the Tinker SDK's beats: no body check here
    ]
    each(cases, check)


def test_a_project_admin_manages_its_keys(client, auth) -> None:
    made = client.post("/v1/keys", headers=auth, json={"name": "dash", "scopes": ["jobs:write", "models:read"]})
    assert made.status_code == 201, made.text
    key = made.json()
    secret = key.pop("value")
    assert key["scopes"] == ["jobs:read", "jobs:write", "models:read"]  # write brings its read
    assert key["status"] == "active" and key["expires_at"] is None and key["name"] == "dash"
    assert secret.startswith(key["prefix"])

    listed = client.get("/v1/keys", headers=auth).json()["data"]
    assert key["id"] in {k["id"] for k in listed}
    text = client.get("/v1/keys", headers=auth).text
    assert secret not in text and "value" not in text and "hash" not in text  # never a secret or digest
    assert client.get(f"/v1/keys/{key['id']}", headers=auth).json()["scopes"] == key["scopes"]

    me = client.get("/v1/me", headers=bearer(secret)).json()
    assert me["scopes"] == key["scopes"] and me["project"]["name"] == "alpha" and not me["operator"]
    assert me["key"]["last_used_at"] is not None  # written by this very request's check
    assert client.get("/v1/fine_tuning/jobs", headers=bearer(secret)).status_code == 200
    assert_error(client.get("/v1/files", headers=bearer(secret)), 403, code="insufficient_scope")
    # The new key is no admin: it may not make keys, let alone a stronger one.
    assert_error(client.post("/v1/keys", headers=bearer(secret), json={}), 403, code="insufficient_scope")

    gone = client.delete(f"/v1/keys/{key['id']}", headers=auth)
    assert gone.json() == {"object": "api_key.deleted", "id": key["id"], "deleted": True}
    assert_error(client.get("/v1/me", headers=bearer(secret)), 401, code="invalid_api_key")
    assert client.get(f"/v1/keys/{key['id']}", headers=auth).json()["status"] == "revoked"


def test_an_admin_gives_only_scopes_it_holds(client) -> None:
    admin = bearer(make_key("alpha", scopes=["keys", "files:read"]))
    ok = client.post("/v1/keys", headers=admin, json={"scopes": ["files:read"]})
    assert ok.status_code == 201, ok.text
    asked_all = client.post("/v1/keys", headers=admin, json={"scopes": ["all"]})
    err = assert_error(asked_all, 403, code="insufficient_scope")
    assert "files:write" in err["message"]  # names what it lacks
    assert client.post("/v1/keys", headers=admin, json={}).json()["scopes"] == ["files:read", "keys"]  # its own
    operator_key = make_key("alpha", operator=True)
    op_id = client.get("/v1/me", headers=bearer(operator_key)).json()["key"]["id"]
    assert_error(client.delete(f"/v1/keys/{op_id}", headers=admin), 403, code="insufficient_scope")


BAD_KEYS = {
    "unknown scope": ({"scopes": ["files:read", "jobs:delete"]}, "scopes[1]", "jobs:delete"),
    "no scope": ({"scopes": []}, "scopes", "at least one"),
    "operator": ({"scopes": ["operator"]}, "scopes[0]", "operator"),
    "expiry 0": ({"expires_in": 0}, "expires_in", "between"),
    "expiry negative": ({"expires_in": -5}, "expires_in", "between"),
    "expiry past ten years": ({"expires_in": 10**10}, "expires_in", "between"),
    "a misspelt field": ({"scope": ["files:read"]}, "scope", "scopes"),
}


def test_bad_key_requests_are_400s_and_make_nothing(client, auth) -> None:
    before = len(client.get("/v1/keys", headers=auth).json()["data"])

    def check(body: dict[str, Any], param: str, says: str) -> None:
        assert_error(client.post("/v1/keys", headers=auth, json=body), 400, param=param, contains=says)

    each(BAD_KEYS, check)
    assert len(client.get("/v1/keys", headers=auth).json()["data"]) == before


def test_an_expired_key_is_a_401_saying_so(client, auth, monkeypatch) -> None:
    from service.core.settings import get_settings
    from service.main import create_app
    from service.tenancy import keys as tenancy_keys

    made = client.post("/v1/keys", headers=auth, json={"expires_in": 3600, "scopes": ["files:read"]}).json()
    assert made["expires_at"] - made["created_at"] == 3600
    assert client.get("/v1/files", headers=bearer(made["value"])).status_code == 200
    # An hour later: refused with a code of its own, though it is neither revoked nor unknown.
    monkeypatch.setattr(tenancy_keys, "now", lambda: made["expires_at"])
    err = assert_error(client.get("/v1/files", headers=bearer(made["value"])), 401, code="key_expired")
    assert "expired" in err["message"]
    assert client.get(f"/v1/keys/{made['id']}", headers=auth).json()["status"] == "expired"
    # An API process that remembers the key (RLOO_AUTH_CACHE_SECONDS) refuses it on time too.
    monkeypatch.setenv("RLOO_AUTH_CACHE_SECONDS", "300")
    get_settings.cache_clear()
    from fastapi.testclient import TestClient

    from tests.helpers.api import LOCAL

    monkeypatch.setattr(tenancy_keys, "now", lambda: made["expires_at"] - 10)
    with TestClient(create_app(), client=LOCAL) as cached:
        assert cached.get("/v1/files", headers=bearer(made["value"])).status_code == 200
        monkeypatch.setattr(tenancy_keys, "now", lambda: made["expires_at"] + 1)
        assert_error(cached.get("/v1/files", headers=bearer(made["value"])), 401, code="key_expired")


def test_the_operator_manages_projects(client, auth) -> None:
    operator = bearer(make_key("ops", operator=True))
    assert_error(client.get("/v1/projects", headers=auth), 403, code="insufficient_permissions")

    made = client.post("/v1/projects", headers=operator, json={"name": "tenant-a"})
    assert made.status_code == 201, made.text
    project = made.json()
    assert project["status"] == "active" and project["active_keys"] == 0
    assert_error(
        client.post("/v1/projects", headers=operator, json={"name": "tenant-a"}), 409, param="name", code="name_taken"
    )
    first = client.post(f"/v1/projects/{project['id']}/keys", headers=operator, json={"name": "first admin"})
    assert first.status_code == 201, first.text
    tenant = bearer(first.json()["value"])
    me = client.get("/v1/me", headers=tenant).json()
    assert me["project"]["id"] == project["id"] and "keys" in me["scopes"] and not me["operator"]
    assert client.get(f"/v1/projects/{project['id']}", headers=operator).json()["active_keys"] == 1
    assert project["id"] in {p["id"] for p in client.get("/v1/projects", headers=operator).json()["data"]}

    archived = client.post(f"/v1/projects/{project['id']}/archive", headers=operator).json()
    assert archived["status"] == "archived" and archived["archived_at"]
    assert_error(client.get("/v1/files", headers=tenant), 403, code="project_archived")
    assert client.get("/v1/files", headers=auth).status_code == 200  # another project: untouched
    restored = client.post(f"/v1/projects/{project['id']}/restore", headers=operator).json()
    assert restored["status"] == "active"
    assert client.get("/v1/files", headers=tenant).status_code == 200

    own = client.get("/v1/me", headers=operator).json()["project"]["id"]
    assert_error(client.post(f"/v1/projects/{own}/archive", headers=operator), 409, code="invalid_state")
    assert_error(client.post("/v1/projects/proj-nope/archive", headers=operator), 404)


def test_the_cli_makes_scoped_expiring_keys_and_projects(client, env) -> None:
    created = run_cli("projects", "create", "tenant-cli", env=env)
    assert created.returncode == 0, created.stderr
    made = run_cli(
        "keys", "create", "--project", "tenant-cli", "--scope", "files:read", "--scope", "inference",
        "--expires-in", "30d", "--name", "reader", env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip().splitlines()[-1]
    me = client.get("/v1/me", headers=bearer(secret)).json()
    assert me["scopes"] == ["files:read", "inference"]
    assert me["key"]["expires_at"] - me["key"]["created_at"] == 30 * 86400
    listed = run_cli("keys", "list", env=env)
    line = next(x for x in listed.stdout.splitlines() if me["key"]["id"] in x)
    assert "files:read,inference" in line and "expires" in line
    bad = run_cli("keys", "create", "--project", "tenant-cli", "--scope", "files:admin", env=env)
    assert bad.returncode != 0 and "Unknown scope 'files:admin'" in bad.stderr
    bad = run_cli("keys", "create", "--project", "tenant-cli", "--expires-in", "soon", env=env)
    assert bad.returncode != 0 and "expires" in bad.stderr

    archived = run_cli("projects", "archive", "tenant-cli", env=env)
    assert archived.returncode == 0, archived.stderr
    assert_error(client.get("/v1/files", headers=bearer(secret)), 403, code="project_archived")
    listed = run_cli("projects", "list", env=env).stdout
    assert re.search(r"tenant-cli\s+archived", listed), listed
    assert run_cli("projects", "restore", "tenant-cli", env=env).returncode == 0
    assert client.get("/v1/files", headers=bearer(secret)).status_code == 200


def test_the_docs_table_is_the_code_table() -> None:
    """docs/api.md lists each route with the scopes it takes, exactly as service.api.route_scopes has them."""
    from tests.helpers.data import ROOT

    text = (ROOT / "docs" / "api.md").read_text()
    table = text.split("Which scope each route needs", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for method, path, scopes in re.findall(r"^\| `(GET|POST|PUT|DELETE) (/[^`]+)` \| ([^|]+) \|$", table, re.M):
        documented[(method, path)] = tuple(re.findall(r"`([^`]+)`", scopes))
    assert documented == route_scopes.ROUTE_SCOPES
    for scope in scope_names.PROJECT_SCOPES:
        assert f"| `{scope}` | {scope_names.PROJECT_SCOPES[scope]} |" in text


def test_a_key_makes_no_key_that_outlives_it_or_revokes_a_stronger_one(client, auth) -> None:
    made = client.post("/v1/keys", headers=auth, json={"scopes": ["keys", "files:read"], "expires_in": 600}).json()
    admin = bearer(made["value"])
    child = client.post("/v1/keys", headers=admin, json={}).json()  # its own scopes and time by default
    assert child["scopes"] == ["files:read", "keys"] and child["expires_at"] <= made["expires_at"]
    err = assert_error(client.post("/v1/keys", headers=admin, json={"expires_in": 3600}), 403)
    assert "outlive" in err["message"]
    full = client.get("/v1/me", headers=auth).json()["key"]["id"]
    assert_error(client.delete(f"/v1/keys/{full}", headers=admin), 403, code="insufficient_scope")
    assert client.delete(f"/v1/keys/{child['id']}", headers=admin).status_code == 200  # no stronger than it


def test_an_empty_path_rest_is_still_checked(client) -> None:
    """``{model_id:path}`` may match an empty rest, as Starlette's router lets it: the scope is checked there too."""
    reader = bearer(make_key("alpha", scopes=["files:read"]))
    assert_error(client.delete("/v1/models/", headers=reader), 403, code="insufficient_scope")


def test_project_names_are_never_ids_and_operator_actions_reach_the_tenants_log(client, auth) -> None:
    operator = bearer(make_key("ops", operator=True))
    assert_error(client.post("/v1/projects", headers=operator, json={"name": "proj-abc"}), 400, param="name")
    alpha = client.get("/v1/me", headers=auth).json()["project"]["id"]
    changed = client.post(f"/v1/projects/{alpha}", headers=operator, json={"quotas": {"gpus": 2}})
    assert changed.status_code == 200, changed.text
    rows = client.get("/v1/audit", headers=auth).json()["data"]
    assert rows[0]["action"] == "POST /v1/projects/{project_id}" and rows[0]["operator"], rows[0]
    assert rows[0]["project_id"] == alpha

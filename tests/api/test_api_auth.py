"""Keys: every /v1 request needs one, in `Authorization: Bearer`, checked before the body is read;
a revoked key is refused within the auth cache's time; `rloo keys create` makes a working one.

Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set; every error is checked for its
exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.helpers.api import (
    LOCAL,
    assert_error,
    each,
    list_ids,
    make_key,
    upload_ok,
)
from tests.helpers.data import STRING_CHECK
from tests.helpers.live import run_cli

# Auth ----------------------------------------------------------------------------------------------
AUTHED_REQUESTS = [
    ("GET", "/v1/files", None),
    ("POST", "/v1/files", None),
    ("GET", "/v1/files/file-abc", None),
    ("GET", "/v1/fine_tuning/jobs", None),
    ("POST", "/v1/fine_tuning/jobs", {"model": "tiny-policy"}),
    ("GET", "/v1/fine_tuning/jobs/ftjob-abc/events", None),
    ("POST", "/v1/fine_tuning/alpha/graders/validate", {"grader": STRING_CHECK}),
]


def test_requests_without_key_are_401(client) -> None:
    def check(method: str, url: str, body: Any) -> None:
        resp = client.request(method, url, json=body)
        assert_error(resp, 401, param=None, code="missing_api_key")
        assert resp.headers.get("www-authenticate") == "Bearer"

    each(AUTHED_REQUESTS, check)


BAD_HEADERS = [
    "Basic {key}",  # a valid key under the wrong scheme
    "Token {key}",
    "{key}",  # no scheme at all
    "Bearer",
    "Bearer ",
    "Bearer rloo-not-a-real-key",
    "Bearer {key}x",
]


def test_bad_authorization_headers_are_401(client, auth) -> None:
    key = auth["Authorization"].removeprefix("Bearer ")

    def check(header: str) -> None:
        for method, url in (("GET", "/v1/files"), ("GET", "/v1/fine_tuning/jobs")):
            resp = client.request(method, url, headers={"Authorization": header.format(key=key)})
            err = assert_error(resp, 401, param=None)
            assert err["code"] in ("invalid_api_key", "missing_api_key"), err

    each(BAD_HEADERS, check)
    assert client.get("/v1/files", headers=auth).status_code == 200  # the key itself is fine


@pytest.mark.parametrize("cache_seconds", [0.0, 1.0])
def test_revoked_key_is_401_within_the_auth_cache_time(env, monkeypatch, cache_seconds) -> None:
    """A key checked lately is trusted for RLOO_AUTH_CACHE_SECONDS; a revocation takes effect on
    the next request without the cache, and once that time has passed with it."""

    from fastapi.testclient import TestClient

    from service.core.db import reset_caches, session_scope
    from service.main import create_app
    from service.tenancy import keys

    monkeypatch.setenv("RLOO_AUTH_CACHE_SECONDS", str(cache_seconds))
    reset_caches()
    secret = make_key("alpha")
    headers = {"Authorization": f"Bearer {secret}"}
    with TestClient(create_app(), client=LOCAL) as client:
        checked_at = time.monotonic()
        assert client.get("/v1/files", headers=headers).status_code == 200
        cached_until = time.monotonic() + cache_seconds  # the cache's entry was written before this answer
        with session_scope() as session:
            assert keys.revoke_api_key(session=session, key_id_or_prefix=secret[:12]) == 1
            session.commit()
        if cache_seconds:
            status = client.get("/v1/files", headers=headers).status_code
            if time.monotonic() < checked_at + cache_seconds:  # (a slow machine may be past it already)
                assert status == 200  # still trusted, for now: the cache is live
            time.sleep(max(0.0, cached_until + 0.05 - time.monotonic()))
        assert_error(client.get("/v1/files", headers=headers), 401, param=None, code="invalid_api_key")
        assert_error(client.get("/v1/fine_tuning/jobs", headers=headers), 401, param=None, code="invalid_api_key")


def test_behind_a_path_prefix_the_key_is_still_checked(app, auth) -> None:
    """Behind a proxy that mounts the API under a prefix (uvicorn --root-path), /v1 routes keep
    their key check: without a key 401, with one 200 (never a 500, never let through)."""
    from fastapi.testclient import TestClient

    with TestClient(app, root_path="/api", client=LOCAL) as prefixed:
        assert_error(prefixed.get("/v1/files"), 401, param=None, code="missing_api_key")
        assert prefixed.get("/v1/files", headers=auth).status_code == 200


def test_bearer_scheme_is_case_insensitive(client, auth) -> None:
    key = auth["Authorization"].removeprefix("Bearer ")
    assert client.get("/v1/files", headers={"Authorization": f"bearer {key}"}).status_code == 200


def test_key_is_checked_before_the_body(client) -> None:
    """A caller without a valid key learns only that: never how its body would have been parsed."""
    resp = client.post("/v1/fine_tuning/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(resp, 401, param=None, code="missing_api_key")
    resp = client.post("/v1/fine_tuning/jobs", json={"model": 1}, headers={"Authorization": "Bearer nope"})
    assert_error(resp, 401, param=None, code="invalid_api_key")
    resp = client.post("/v1/files", files={"file": ("a.jsonl", b"[1]\n")}, data={"purpose": "bogus"})
    assert_error(resp, 401, param=None, code="missing_api_key")


def test_ops_endpoints_need_no_key(client) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 200, path


def test_cli_keys_create_prints_a_working_key(client, env, auth) -> None:
    upload_ok(client, auth)  # alpha's file, which the new project must not see
    out = run_cli(
        "keys",
        "create",
        "--project",
        "gamma",
        env={"DATABASE_URL": env["DATABASE_URL"], "RLOO_HOME": env["RLOO_HOME"]},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    key = lines[-1]
    assert re.fullmatch(r"\S+", key) and len(key) >= 32, out.stdout
    headers = {"Authorization": f"Bearer {key}"}
    resp = client.get("/v1/files", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["data"] == []
    f = upload_ok(client, headers)
    assert list_ids(client, headers, "/v1/files") == [f["id"]]

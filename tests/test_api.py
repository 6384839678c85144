"""The HTTP API against API.md: auth, files, jobs, pagination, graders, ops, and the names that
ARCHITECTURE.md promises. Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set.

Every error is checked for its exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
Jobs are queued to a queue that no worker consumes, so they stay ``queued``.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import EXAMPLES, LOCAL, ROOT, make_key, run_cli

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    403: "permission_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    504: "api_error",
}
ANY = object()

JOB_FIELDS = {
    "id",
    "object",
    "created_at",
    "status",
    "model",
    "training_file",
    "validation_file",
    "hyperparameters",
    "method",
    "seed",
    "metadata",
    "organization_id",
    "result_files",
    "trained_tokens",
    "fine_tuned_model",
    "finished_at",
    "estimated_finish",
    "error",
    "progress",
}
FILE_FIELDS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status"}

# RLOO.md's defaults table, spelled out here (not read from the schema) so a drifting default fails.
RLOO_DEFAULTS = {
    "rloo_k": 4,
    "batch_size": 8,
    "learning_rate": 1e-5,
    "learning_rate_multiplier": 1.0,
    "n_epochs": 1,
    "max_steps": None,
    "max_new_tokens": 64,
    "temperature": 1.0,
    "top_p": 1.0,
    "kl_coef": 0.05,
    "kl_estimator": "k1",
    "kl_in_reward": True,
    "ppo_epochs": 1,
    "clip_epsilon": 0.2,
    "loss_aggregation": "sequence_sum",
    "normalize_advantages": False,
    "max_grad_norm": 1.0,
    "checkpoint_interval": 0,
    "eval_interval": 0,
    "eval_samples": 32,
    # Beyond RLOO.md's table: the schema's own extensions.
    "max_prompt_length": 512,
    "clip_epsilon_high": None,
    "weight_decay": 0.0,
    "lora": None,  # in RLOO.md's table
    "reward_clip": None,
    "mask_truncated_completions": False,
    "stop": None,
    "gradient_accumulation_steps": 1,
    "lr_scheduler": "constant",
    "warmup_ratio": 0.0,
    "precision": "auto",
    "gradient_checkpointing": False,
    "keep_checkpoints": None,
}

TRAIN_JSONL = (EXAMPLES / "demo" / "train.jsonl").read_bytes()
TRAIN_LINES = len(TRAIN_JSONL.strip().splitlines())
JOB_JSON = json.loads((EXAMPLES / "demo" / "job.json").read_text())

STRING_CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}


# Helpers -------------------------------------------------------------------------------------------
def assert_error(
    resp: httpx.Response,
    status: int,
    *,
    param: Any = ANY,
    code: Any = ANY,
    contains: str | list[str] | None = None,
) -> dict[str, Any]:
    """Exact status and OpenAI's error body; returns the inner error object."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text}"
    assert resp.headers["content-type"].startswith("application/json"), resp.headers["content-type"]
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert err["type"] == ERROR_TYPES[status], err
    if param is not ANY:
        assert err["param"] == param, err
    if code is not ANY:
        assert err["code"] == code, err
    for needle in [contains] if isinstance(contains, str) else contains or []:
        assert needle in err["message"], err
    return err


def each(cases: Any, check: Callable[..., None]) -> None:
    """Run ``check`` on every case (a dict name -> args, or a list of args) and report every failure
    at once: one test, one database, many cases."""
    items = cases.items() if isinstance(cases, dict) else ((repr(c)[:80], c) for c in cases)
    failures = []
    for name, case in items:
        try:
            check(*case) if isinstance(case, tuple) else check(case)
        except AssertionError as exc:
            failures.append(f"[{name}] {str(exc)[:600]}")
    assert not failures, f"{len(failures)} case(s) failed:\n" + "\n".join(failures)


def upload(
    client: Any,
    auth: dict[str, str],
    content: bytes = TRAIN_JSONL,
    *,
    filename: str = "train.jsonl",
    purpose: str = "fine-tune",
) -> httpx.Response:
    return client.post(
        "/v1/files",
        headers=auth,
        files={"file": (filename, content, "application/jsonl")},
        data={"purpose": purpose},
    )


def upload_ok(client: Any, auth: dict[str, str], content: bytes = TRAIN_JSONL, **kw: Any) -> dict[str, Any]:
    resp = upload(client, auth, content, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


def job_body(training_file: str, **overrides: Any) -> dict[str, Any]:
    body = copy.deepcopy(JOB_JSON)
    body["training_file"] = training_file
    body.update(overrides)
    return body


def create_job(client: Any, auth: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stored_files(env: dict[str, str]) -> list[Path]:
    """Every regular file under the artifacts' files/ folder (temporary uploads included)."""
    root = Path(env["RLOO_HOME"]) / "artifacts" / "files"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def list_ids(client: Any, auth: dict[str, str], url: str) -> list[str]:
    resp = client.get(url, headers=auth)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and isinstance(body["has_more"], bool)
    return [item["id"] for item in body["data"]]


@pytest.fixture
def unique_model_path(models_dir: Path) -> Iterator[Callable[[str], Path]]:
    """Unique names under the session-shared models root, removed afterwards."""
    made: list[Path] = []

    def make(stem: str) -> Path:
        path = models_dir / f"{stem}-{secrets.token_hex(4)}"
        made.append(path)
        return path

    yield make
    for path in made:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def _fresh_client(monkeypatch: pytest.MonkeyPatch, **env_values: str) -> Any:
    """A TestClient on a new app built after setting ``env_values`` (settings are read at build time)."""
    from fastapi.testclient import TestClient

    from service.db import reset_caches
    from service.main import create_app

    for key, value in env_values.items():
        monkeypatch.setenv(key, value)
    reset_caches()
    return TestClient(create_app(), client=LOCAL)


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
    import time

    from fastapi.testclient import TestClient

    from service import crud
    from service.db import reset_caches, session_scope
    from service.main import create_app

    monkeypatch.setenv("RLOO_AUTH_CACHE_SECONDS", str(cache_seconds))
    reset_caches()
    secret = make_key("alpha")
    headers = {"Authorization": f"Bearer {secret}"}
    with TestClient(create_app(), client=LOCAL) as client:
        checked_at = time.monotonic()
        assert client.get("/v1/files", headers=headers).status_code == 200
        with session_scope() as session:
            assert crud.revoke_api_key(session=session, key_id_or_prefix=secret[:12]) == 1
            session.commit()
        if cache_seconds:
            status = client.get("/v1/files", headers=headers).status_code
            if time.monotonic() < checked_at + cache_seconds:  # (a slow machine may be past it already)
                assert status == 200  # still trusted, for now: the cache is live
            time.sleep(max(0.0, checked_at + cache_seconds + 0.05 - time.monotonic()))
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


# Files ---------------------------------------------------------------------------------------------
def test_upload_returns_the_file_object(client, auth, env) -> None:
    before = int(time.time())
    f = upload_ok(client, auth, filename="my data.jsonl")
    assert set(f) >= FILE_FIELDS, f
    assert re.fullmatch(r"file-[0-9A-Za-z]+", f["id"]), f["id"]
    assert f["object"] == "file"
    assert f["bytes"] == len(TRAIN_JSONL)
    assert before <= f["created_at"] <= int(time.time()) + 1
    assert f["filename"] == "my data.jsonl"
    assert f["purpose"] == "fine-tune"
    assert f["status"] == "processed"
    assert [p.name for p in stored_files(env)] == [f"{f['id']}.jsonl"]
    assert client.get(f"/v1/files/{f['id']}", headers=auth).json() == f


def test_upload_filename_cannot_carry_a_path(client, auth, env) -> None:
    f = upload_ok(client, auth, filename="../../evil.jsonl")
    assert "/" not in f["filename"]
    assert [p.name for p in stored_files(env)] == [f"{f['id']}.jsonl"]


def test_list_get_and_content(client, auth) -> None:
    content = '{"prompt": "café ☕", "answer": "x"}\r\n{"prompt": "b", "answer": "y"}'.encode()
    first = upload_ok(client, auth, filename="a.jsonl")
    second = upload_ok(client, auth, content, filename="b.jsonl")
    listing = client.get("/v1/files", headers=auth).json()
    assert listing["object"] == "list" and listing["has_more"] is False
    assert [f["id"] for f in listing["data"]] == [second["id"], first["id"]]  # newest first
    assert listing["data"][0] == second
    assert client.get(f"/v1/files/{first['id']}", headers=auth).json() == first
    for f, expected in ((first, TRAIN_JSONL), (second, content)):
        resp = client.get(f"/v1/files/{f['id']}/content", headers=auth)
        assert resp.status_code == 200
        assert resp.content == expected


def test_list_filters_by_purpose(client, auth) -> None:
    f = upload_ok(client, auth)
    assert list_ids(client, auth, "/v1/files?purpose=fine-tune") == [f["id"]]
    assert list_ids(client, auth, "/v1/files?purpose=assistants") == []


def test_delete_file(client, auth, env) -> None:
    keep = upload_ok(client, auth)
    f = upload_ok(client, auth)
    assert len(stored_files(env)) == 2
    resp = client.delete(f"/v1/files/{f['id']}", headers=auth)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"id": f["id"], "object": "file", "deleted": True}
    assert_error(client.get(f"/v1/files/{f['id']}", headers=auth), 404, code="not_found", contains=f["id"])
    assert_error(client.get(f"/v1/files/{f['id']}/content", headers=auth), 404, code="not_found")
    assert_error(client.delete(f"/v1/files/{f['id']}", headers=auth), 404, code="not_found")
    assert [p.name for p in stored_files(env)] == [f"{keep['id']}.jsonl"]
    assert list_ids(client, auth, "/v1/files") == [keep["id"]]


def test_unknown_file_is_404(client, auth) -> None:
    for method, url in (
        ("GET", "/v1/files/file-nope"),
        ("GET", "/v1/files/file-nope/content"),
        ("DELETE", "/v1/files/file-nope"),
    ):
        assert_error(client.request(method, url, headers=auth), 404, code="not_found", contains="file-nope")


BAD_UPLOADS = {
    "not_json": (b'{"prompt": "a"}\n{not json}\n', "Line 2"),
    "line_is_a_list": (b'{"prompt": "a"}\n["prompt", "b"]\n', "Line 2"),
    "line_is_a_string": (b'"just a string"\n', "Line 1"),
    "no_messages_or_prompt": (b'{"prompt": "a"}\n{"prompt": "b"}\n{"question": "c"}\n', "Line 3"),
    "last_turn_not_user": (
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n',
        "Line 1",
    ),
    "empty_messages": (b'{"messages": []}\n', "Line 1"),
    "message_without_content": (b'{"messages": [{"role": "user"}]}\n', "Line 1"),
    "prompt_not_a_string": (b'{"prompt": "ok"}\n{"prompt": 5}\n', "Line 2"),
    "invalid_utf8": (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "Line 2"),
    "blank_line_in_middle": (b'{"prompt": "a"}\n\n{"prompt": "b"}\n', "Line 2"),
    "integer_of_5000_digits": (b'{"prompt": "a"}\n{"prompt": "b", "n": ' + b"7" * 5000 + b"}\n", "Line 2"),
    "empty_file": (b"", "empty"),
    "only_blank_lines": (b"\n\n  \n", "empty"),
    # Not UTF-8: the whole file is at fault, and the message says which encoding it is.
    "utf16_with_bom": ('{"prompt": "a"}\n{"prompt": "b"}\n'.encode("utf-16"), ["UTF-16", "save it as UTF-8"]),
    "utf16le_without_bom": ('{"prompt": "a"}\n'.encode("utf-16-le"), ["UTF-16", "save it as UTF-8"]),
    "utf16be_without_bom": ('{"prompt": "a"}\n'.encode("utf-16-be"), ["UTF-16", "save it as UTF-8"]),
    "utf32_with_bom": ('{"prompt": "a"}\n'.encode("utf-32"), ["UTF-32", "save it as UTF-8"]),
    "latin1_says_where": (b'{"prompt": "caf\xe9"}\n', ["Line 1", "UTF-8", "0xe9"]),
    "bom_in_the_middle": (b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n', ["Line 2", "byte-order mark", "remove"]),
    # Not JSONL.
    "pretty_printed_json_array": (
        b'[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n',
        ["Line 1", "JSON array", "one object a line"],
    ),
    "json_array_on_one_line": (b'[{"prompt": "a"}, {"prompt": "b"}]\n', ["Line 1", "one object a line"]),
    "pretty_printed_object": (b'{\n  "prompt": "a"\n}\n', ["Line 1", "whole on one line"]),
    "gzip_compressed": (gzip.compress(b'{"prompt": "a"}\n' * 50), ["gzip-compressed", "uncompressed .jsonl"]),
    "csv": (b"prompt,answer\nwhat is 2+2?,4\n", ["Line 1", "not valid JSON", "CSV", "JSON object"]),
    "raw_tab_in_a_string": (b'{"prompt": "a\tb"}\n', ["Line 1", "must be escaped"]),
    # Too deep for a parser (Python's json raises RecursionError), or deeper than a dataset needs.
    "nested_arrays_100k_deep": (b'{"prompt": "a"}\n' + b"[" * 100_000 + b"\n", ["Line 2", "levels deep", "flatten"]),
    "nested_objects_100k_deep": (b'{"prompt": "a"}\n' + b'{"a":' * 100_000 + b"\n", ["Line 2", "flatten"]),
    "nested_101_levels": (b'{"prompt": "a", "x": ' + b"[" * 100 + b"]" * 100 + b"}\n", ["Line 1", "flatten"]),
    # NUL: PostgreSQL text cannot hold it, whether escaped in a string or a key, or raw.
    "nul_escaped_in_prompt": (b'{"prompt": "a\\u0000b"}\n', ["Line 1", "NUL", "remove it"]),
    "nul_escaped_in_a_key": (b'{"prompt": "a"}\n{"prompt": "b", "k\\u0000": 1}\n', ["Line 2", "NUL", "remove it"]),
    "nul_escaped_in_messages": (
        b'{"messages": [{"role": "user", "content": "x\\u0000"}]}\n',
        ["Line 1", "NUL", "remove it"],
    ),
    "nul_byte_raw": (b'{"prompt": "a"}\n{"prompt": "a\x00b"}\n', ["Line 2", "NUL", "UTF-8"]),
    # OpenAI's multimodal content parts: refused here rather than accepted and misread by the worker.
    "content_as_text_parts": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}\n',
        ["Line 1", "messages[0].content", "list of content parts", "one string"],
    ),
    "content_with_an_image_part": (
        b'{"prompt": "x"}\n{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": '
        b'[{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}\n',
        ["Line 2", "messages[1].content", "one string"],
    ),
}


def test_bad_upload_is_400_and_leaves_nothing(client, auth, env) -> None:
    def check(content: bytes, needle: str) -> None:
        assert_error(upload(client, auth, content), 400, param="file", code="invalid_file", contains=needle)
        assert stored_files(env) == []
        assert list_ids(client, auth, "/v1/files") == []

    each(BAD_UPLOADS, check)


def test_bad_purpose_is_400(client, auth, env) -> None:
    def check(purpose: str) -> None:
        assert_error(upload(client, auth, purpose=purpose), 400, param="purpose", contains=repr(purpose)[1:-1])
        assert stored_files(env) == []
        assert list_ids(client, auth, "/v1/files") == []

    each(["assistants", "fine_tune", "FINE-TUNE"], check)


def test_upload_without_file_field_is_400(client, auth) -> None:
    resp = client.post("/v1/files", headers=auth, data={"purpose": "fine-tune"})
    assert_error(resp, 400, param="file")


def test_trailing_blank_lines_are_fine(client, auth) -> None:
    f = upload_ok(client, auth, b'{"prompt": "a"}\n{"prompt": "b"}\n\n\n')
    job = create_job(
        client,
        auth,
        job_body(
            f["id"],
            method={
                "type": "rloo",
                "rloo": {"grader": {**STRING_CHECK, "reference": "x"}, "hyperparameters": {"batch_size": 1}},
            },
        ),
    )
    assert job["progress"]["total_steps"] == 2  # two prompts, the blank lines are not prompts


def test_upload_size_limit_is_413(monkeypatch, env, auth) -> None:
    line = b'{"prompt": "0123456789012345678901234567890123456789"}\n'  # 55 bytes
    limit = 20 * len(line)
    with _fresh_client(monkeypatch, RLOO_MAX_UPLOAD_BYTES=str(limit)) as client:
        ok = upload(client, auth, line * 20)  # exactly at the limit
        assert ok.status_code == 200, ok.text
        assert client.delete(f"/v1/files/{ok.json()['id']}", headers=auth).status_code == 200
        # Just over the limit (checked while the upload streams to storage) ...
        assert_error(upload(client, auth, line * 21), 413, param="file", code="file_too_large")
        # ... and far over it (refused from the declared length, before the body is read).
        assert_error(upload(client, auth, line * 5000), 413, code="request_too_large")
        assert stored_files(env) == []
        assert list_ids(client, auth, "/v1/files") == []


def test_upload_size_limit_without_content_length_is_413(monkeypatch, env, auth) -> None:
    """A chunked body declares no length: the limit must hold while it streams in."""
    with _fresh_client(monkeypatch, RLOO_MAX_UPLOAD_BYTES="1000") as client:
        req = httpx.Request(
            "POST",
            "http://testserver/v1/files",
            data={"purpose": "fine-tune"},
            files={"file": ("big.jsonl", b'{"prompt": "a"}\n' * 20_000)},
        )
        body = req.read()

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(body), 8192):
                yield body[i : i + 8192]

        resp = client.post("/v1/files", content=chunks(), headers={**auth, "content-type": req.headers["content-type"]})
        assert_error(resp, 413)
        assert stored_files(env) == []
        assert list_ids(client, auth, "/v1/files") == []


LONG_LINES = {
    "middle": (b'{"prompt": "a"}\n{"prompt": "' + b"x" * 200 + b'"}\n{"prompt": "c"}\n', "Line 2"),
    "last_unterminated": (b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "' + b"x" * 200 + b'"}', "Line 3"),
}


def test_line_over_line_limit_is_400(monkeypatch, env, auth) -> None:
    with _fresh_client(monkeypatch, RLOO_MAX_LINE_BYTES="100") as client:

        def check(content: bytes, needle: str) -> None:
            assert_error(upload(client, auth, content), 400, param="file", code="invalid_file", contains=needle)
            assert stored_files(env) == []
            assert list_ids(client, auth, "/v1/files") == []

        each(LONG_LINES, check)
        assert upload(client, auth, b'{"prompt": "' + b"x" * 80 + b'"}\n').status_code == 200  # 94 bytes: fine


def test_json_body_over_limit_is_413(client, auth) -> None:
    body = {"model": "tiny-policy", "training_file": "file-x", "metadata": {"pad": "x" * (9 * 1024 * 1024)}}
    assert_error(client.post("/v1/fine_tuning/jobs", headers=auth, json=body), 413, code="request_too_large")


def test_content_gone_from_storage_is_an_error_not_a_crash(client, auth, env) -> None:
    f = upload_ok(client, auth)
    (path,) = stored_files(env)
    path.unlink()
    resp = client.get(f"/v1/files/{f['id']}/content", headers=auth)
    assert resp.status_code == 410, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert client.delete(f"/v1/files/{f['id']}", headers=auth).status_code == 200


def test_delete_file_used_by_a_job_is_409_until_cancelled(client, auth, env) -> None:
    train = upload_ok(client, auth)
    valid = upload_ok(client, auth)
    job = create_job(client, auth, job_body(train["id"], validation_file=valid["id"]))
    for f in (train, valid):
        assert_error(client.delete(f"/v1/files/{f['id']}", headers=auth), 409, code="file_in_use")
        assert client.get(f"/v1/files/{f['id']}/content", headers=auth).status_code == 200
    assert len(stored_files(env)) == 2
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=auth).status_code == 200
    for f in (train, valid):
        assert client.delete(f"/v1/files/{f['id']}", headers=auth).status_code == 200
    assert stored_files(env) == []


# Jobs ----------------------------------------------------------------------------------------------
def test_create_job_returns_every_field(client, auth, env) -> None:
    from redis import Redis

    from service.settings import Settings

    f = upload_ok(client, auth)
    before = int(time.time())
    body = job_body(f["id"], metadata={"team": "red"}, suffix="demo")
    job = create_job(client, auth, body)
    assert set(job) >= JOB_FIELDS, JOB_FIELDS - set(job)
    assert re.fullmatch(r"ftjob-[0-9A-Za-z]+", job["id"]), job["id"]
    assert job["object"] == "fine_tuning.job"
    assert before <= job["created_at"] <= int(time.time()) + 1
    assert job["status"] == "queued"
    assert job["model"] == "tiny-policy"
    assert job["training_file"] == f["id"]
    assert job["validation_file"] is None
    assert job["seed"] == 0
    assert job["metadata"] == {"team": "red"}
    assert isinstance(job["organization_id"], str) and job["organization_id"]
    assert job["result_files"] == []
    assert job["trained_tokens"] is None
    assert job["fine_tuned_model"] is None
    assert job["finished_at"] is None
    assert job["estimated_finish"] is None
    assert job["error"] is None
    given = JOB_JSON["method"]["reinforcement"]["hyperparameters"]
    assert job["hyperparameters"] == {**RLOO_DEFAULTS, **given}
    assert job["method"]["type"] == "reinforcement"
    assert job["method"]["reinforcement"]["hyperparameters"] == job["hyperparameters"]
    assert job["method"]["reinforcement"]["grader"] == JOB_JSON["method"]["reinforcement"]["grader"]
    steps = math.ceil(TRAIN_LINES * given["n_epochs"] / given["batch_size"])
    assert job["progress"] == {"step": 0, "total_steps": steps}
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json() == job
    # The task went to the broker (a queue no worker consumes).
    broker = Redis.from_url(Settings().redis_client_url)
    try:
        assert broker.llen(env["RLOO_QUEUE"]) == 1
    finally:
        broker.close()


def test_job_defaults_and_random_seed(client, auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(
        client,
        auth,
        {
            "model": "tiny-policy",
            "training_file": f["id"],
            "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}},
        },
    )
    assert job["hyperparameters"] == RLOO_DEFAULTS
    assert job["progress"] == {"step": 0, "total_steps": math.ceil(TRAIN_LINES / 8)}
    assert isinstance(job["seed"], int) and 0 <= job["seed"] < 2**31
    assert job["metadata"] is None


def test_lora_hyperparameter_of_rloo_md(client, auth) -> None:
    """RLOO.md's `lora`: null is full fine-tuning; an adapter spec is stored with its defaults filled in."""
    f = upload_ok(client, auth)
    body = job_body(f["id"])
    body["method"]["reinforcement"]["hyperparameters"]["lora"] = None
    job = create_job(client, auth, body)
    assert job["hyperparameters"]["lora"] is None
    body["method"]["reinforcement"]["hyperparameters"]["lora"] = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    job = create_job(client, auth, body)
    assert job["hyperparameters"]["lora"] == {
        "r": 8,
        "alpha": 32.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
    }
    body["method"]["reinforcement"]["hyperparameters"]["lora"] = {}
    assert create_job(client, auth, body)["hyperparameters"]["lora"]["target_modules"] == "all-linear"


TOTAL_STEPS = [
    (5, {"batch_size": 2, "n_epochs": 3}, 8),  # ceil(15 / 2)
    (5, {"batch_size": 5, "n_epochs": 1}, 1),
    (5, {"batch_size": 8, "n_epochs": 1}, 1),  # fewer prompts than a batch
    (7, {"batch_size": 2, "n_epochs": 10, "max_steps": 4}, 4),  # capped
    (7, {"batch_size": 2, "n_epochs": 1, "max_steps": 100}, 4),  # cap above ceil(7 / 2)
    (7, {"batch_size": "auto", "n_epochs": "auto"}, 1),  # auto = 8 and 1
    (7, {"batch_size": 3, "n_epochs": 2}, 5),  # ceil(14 / 3)
]


def test_total_steps(client, auth) -> None:
    files: dict[int, str] = {}

    def check(lines: int, hp: dict[str, Any], expected: int) -> None:
        if lines not in files:
            content = b"".join(b'{"prompt": "p%d", "answer": "a"}\n' % i for i in range(lines))
            files[lines] = upload_ok(client, auth, content)["id"]
        body = job_body(files[lines])
        body["method"]["reinforcement"]["hyperparameters"] = hp
        job = create_job(client, auth, body)
        assert job["progress"] == {"step": 0, "total_steps": expected}, (hp, job["progress"])

    each(TOTAL_STEPS, check)


def test_learning_rate_multiplier_auto_is_accepted(client, auth) -> None:
    f = upload_ok(client, auth)
    body = job_body(f["id"])
    body["method"]["reinforcement"]["hyperparameters"]["learning_rate_multiplier"] = "auto"
    job = create_job(client, auth, body)
    assert job["hyperparameters"]["learning_rate_multiplier"] == 1.0


def test_method_type_rloo_takes_its_config_under_rloo(client, auth) -> None:
    f = upload_ok(client, auth)
    body = job_body(f["id"])
    body["method"] = {"type": "rloo", "rloo": body["method"]["reinforcement"]}
    job = create_job(client, auth, body)
    assert job["method"]["type"] == "rloo"
    assert job["method"]["rloo"]["grader"]["name"] == "answer"
    assert "reinforcement" not in job["method"] or job["method"]["reinforcement"] is None


def test_validation_file_and_eval_interval(client, auth) -> None:
    train = upload_ok(client, auth)
    valid = upload_ok(client, auth)
    body = job_body(train["id"], validation_file=valid["id"])
    body["method"]["reinforcement"]["hyperparameters"]["eval_interval"] = 5
    job = create_job(client, auth, body)
    assert job["validation_file"] == valid["id"]
    assert job["hyperparameters"]["eval_interval"] == 5


def test_reward_model_grader_inside_the_root_is_accepted(client, auth) -> None:
    f = upload_ok(client, auth)
    body = job_body(f["id"])
    body["method"]["reinforcement"]["grader"] = {"type": "reward_model", "name": "rm", "model": "tiny-reward"}
    assert create_job(client, auth, body)["method"]["reinforcement"]["grader"]["model"] == "tiny-reward"


def test_list_and_get_jobs(client, auth) -> None:
    f = upload_ok(client, auth)
    first = create_job(client, auth, job_body(f["id"]))
    second = create_job(client, auth, job_body(f["id"], seed=7))
    listing = client.get("/v1/fine_tuning/jobs", headers=auth).json()
    assert listing["object"] == "list" and listing["has_more"] is False
    assert [j["id"] for j in listing["data"]] == [second["id"], first["id"]]
    assert listing["data"][0] == second
    assert client.get(f"/v1/fine_tuning/jobs/{first['id']}", headers=auth).json() == first
    assert first["organization_id"] == second["organization_id"]


def test_job_events_metrics_checkpoints_of_a_queued_job(client, auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"]))
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()
    assert events["object"] == "list" and events["has_more"] is False
    assert len(events["data"]) == 2
    for e in events["data"]:
        assert {"id", "object", "created_at", "level", "message", "type", "data"} <= set(e), e
        assert e["object"] == "fine_tuning.job.event"
        assert e["level"] == "info" and e["type"] == "message"
        assert e["created_at"] >= job["created_at"]
    newest, oldest = events["data"]
    assert "Created" in oldest["message"] and job["id"] in oldest["message"]  # newest first
    assert f["id"] in newest["message"]
    page = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events?limit=1", headers=auth).json()
    assert [e["id"] for e in page["data"]] == [newest["id"]] and page["has_more"] is True
    page = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events?limit=1&after={newest['id']}", headers=auth).json()
    assert [e["id"] for e in page["data"]] == [oldest["id"]] and page["has_more"] is False
    for what in ("metrics", "checkpoints"):
        resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}/{what}", headers=auth)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"object": "list", "data": [], "has_more": False}
    assert_error(
        client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/ftckpt-nope/content", headers=auth),
        404,
        code="not_found",
    )


def test_cancel_queued_job(client, auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"]))
    resp = client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=auth)
    assert resp.status_code == 200, resp.text
    cancelled = resp.json()
    assert set(cancelled) >= JOB_FIELDS
    assert cancelled["id"] == job["id"] and cancelled["status"] == "cancelled"
    assert isinstance(cancelled["finished_at"], int) and cancelled["finished_at"] >= job["created_at"]
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()["status"] == "cancelled"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
    assert len(events) == 3 and "cancelled" in events[0]["message"].lower()
    err = assert_error(client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=auth), 409, code="invalid_state")
    assert "cancelled" in err["message"]
    assert len(client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]) == 3


def test_unknown_job_is_404(client, auth) -> None:
    for method, suffix in (
        ("GET", ""),
        ("POST", "/cancel"),
        ("GET", "/events"),
        ("GET", "/metrics"),
        ("GET", "/checkpoints"),
    ):
        resp = client.request(method, f"/v1/fine_tuning/jobs/ftjob-nope{suffix}", headers=auth)
        assert_error(resp, 404, code="not_found", contains="ftjob-nope")


# Bad job bodies ------------------------------------------------------------------------------------
HP = "method.reinforcement.hyperparameters"
GR = "method.reinforcement.grader"


def _hp(**values: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        body["method"]["reinforcement"]["hyperparameters"].update(values)

    return mutate


def _grader(grader: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        body["method"]["reinforcement"]["grader"] = grader

    return mutate


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        body.update(values)

    return mutate


def _method(method: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        body["method"] = method

    return mutate


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        del body[key]

    return mutate


BAD_JOBS: dict[str, tuple[Callable[[dict[str, Any]], None], str, str | None]] = {
    # name: (mutation, param, a word the message must contain)
    "rloo_k_1": (_hp(rloo_k=1), f"{HP}.rloo_k", None),
    "rloo_k_string": (_hp(rloo_k="four"), f"{HP}.rloo_k", None),
    "misspelt_hyperparameter": (_hp(rloo_K=4), f"{HP}.rloo_K", "Did you mean 'rloo_k'?"),
    "misspelt_top_level_key": (_set(modle="tiny-policy"), "modle", "Did you mean 'model'?"),
    "batch_size_0": (_hp(batch_size=0), f"{HP}.batch_size", None),
    "n_epochs_0": (_hp(n_epochs=0), f"{HP}.n_epochs", None),
    "learning_rate_negative": (_hp(learning_rate=-1.0), f"{HP}.learning_rate", None),
    "learning_rate_multiplier_0": (_hp(learning_rate_multiplier=0), f"{HP}.learning_rate_multiplier", None),
    "kl_estimator_unknown": (_hp(kl_estimator="k2"), f"{HP}.kl_estimator", None),
    "eval_interval_without_validation": (_hp(eval_interval=5), f"{HP}.eval_interval", "validation_file"),
    "accumulation_not_dividing_batch": (
        _hp(batch_size=8, gradient_accumulation_steps=3),
        f"{HP}.gradient_accumulation_steps",
        "divide",
    ),
    "k1_as_a_loss_term": (_hp(kl_in_reward=False, kl_estimator="k1"), f"{HP}.kl_estimator", "k3"),
    "lora_rank_0": (_hp(lora={"r": 0}), f"{HP}.lora.r", None),
    "lora_unknown_key": (_hp(lora={"rank": 8}), f"{HP}.lora.rank", None),
    "lora_bad_module_name": (_hp(lora={"target_modules": ["q_proj; rm -rf"]}), f"{HP}.lora.target_modules", None),
    "lora_not_an_object": (_hp(lora=8), f"{HP}.lora", None),
    "lr_scheduler_unknown": (_hp(lr_scheduler="step"), f"{HP}.lr_scheduler", None),
    "warmup_ratio_1": (_hp(warmup_ratio=1.0), f"{HP}.warmup_ratio", None),
    "precision_fp16": (_hp(precision="fp16"), f"{HP}.precision", None),
    "stop_too_many": (_hp(stop=["a", "b", "c", "d", "e"]), f"{HP}.stop", None),
    "stop_empty_string": (_hp(stop=[""]), f"{HP}.stop", None),
    "reward_clip_0": (_hp(reward_clip=0), f"{HP}.reward_clip", None),
    "keep_checkpoints_0": (_hp(keep_checkpoints=0), f"{HP}.keep_checkpoints", None),
    "unknown_top_level_key": (_set(frobnicate=True), "frobnicate", "frobnicate"),
    "top_level_hyperparameters": (_set(hyperparameters={"n_epochs": 2}), "hyperparameters", "method"),
    "integrations": (_set(integrations=[{"type": "wandb"}]), "integrations", None),
    "missing_model": (_drop("model"), "model", None),
    "missing_training_file": (_drop("training_file"), "training_file", None),
    "seed_negative": (_set(seed=-1), "seed", None),
    "metadata_not_strings": (_set(metadata={"a": 1}), "metadata.a", None),
    "unknown_training_file": (_set(training_file="file-doesnotexist"), "training_file", "file-doesnotexist"),
    "unknown_validation_file": (_set(validation_file="file-doesnotexist"), "validation_file", None),
    "reinforcement_without_config": (_method({"type": "reinforcement"}), "method", "method.reinforcement"),
    "rloo_with_config_under_reinforcement": (
        _method({"type": "rloo", "reinforcement": {"grader": STRING_CHECK}}),
        "method",
        None,
    ),
    "both_configs": (
        _method({"type": "rloo", "rloo": {"grader": STRING_CHECK}, "reinforcement": {"grader": STRING_CHECK}}),
        "method",
        None,
    ),
    "unknown_method_type": (_method({"type": "ppo", "ppo": {"grader": STRING_CHECK}}), "method.type", None),
    "model_dotdot": (_set(model="../x"), "model", None),
    "model_dotdot_inside": (_set(model="tiny-policy/../../x"), "model", None),
    "model_absolute": (_set(model="/etc"), "model", None),
    "model_home": (_set(model="~/models/x"), "model", None),
    "model_missing": (_set(model="no-such-model"), "model", "no-such-model"),
    "model_hub_id_offline": (_set(model="org/some-model"), "model", None),
    "grader_unknown_type": (_grader({"type": "regex", "name": "r"}), f"{GR}.type", "regex"),
    "grader_not_an_object": (_grader("exact"), GR, None),  # type: ignore[arg-type]
    "grader_bad_operation": (_grader({**STRING_CHECK, "operation": "contains"}), f"{GR}.operation", None),
    "grader_unknown_key": (_grader({**STRING_CHECK, "extra": 1}), f"{GR}.extra", None),
    "grader_bad_template": (_grader({**STRING_CHECK, "input": "{{ output_text }}"}), f"{GR}.input", None),
    "grader_python_disabled": (
        _grader({"type": "python", "name": "p", "source": "def grade(s, i): return 1"}),
        f"{GR}.type",
        "RLOO_ALLOW_PYTHON_GRADER",
    ),
    "grader_missing_item_key": (
        _grader({**STRING_CHECK, "reference": "{{ item.missing_key }}"}),
        GR,
        "missing_key",
    ),
    "reward_model_outside_root": (
        _grader({"type": "reward_model", "name": "rm", "model": "../../etc"}),
        f"{GR}.model",
        None,
    ),
    "reward_model_absolute": (
        _grader({"type": "reward_model", "name": "rm", "model": "/etc"}),
        f"{GR}.model",
        None,
    ),
    "reward_model_in_multi_outside_root": (
        _grader(
            {
                "type": "multi",
                "name": "m",
                "calculate_output": "exact + rm",
                "graders": {
                    "exact": STRING_CHECK,
                    "rm": {"type": "reward_model", "name": "rm", "model": "/etc"},
                },
            }
        ),
        f"{GR}.graders.rm.model",
        None,
    ),
    "multi_sub_grader_missing_item_key": (
        _grader(
            {
                "type": "multi",
                "name": "m",
                "calculate_output": "exact",
                "graders": {"exact": {**STRING_CHECK, "reference": "{{ item.missing_key }}"}},
            }
        ),
        GR,
        "missing_key",
    ),
    "multi_bad_formula": (
        _grader(
            {
                "type": "multi",
                "name": "m",
                "calculate_output": "exact + nope",
                "graders": {"exact": STRING_CHECK},
            }
        ),
        f"{GR}.calculate_output",
        "nope",
    ),
}


@pytest.fixture
def unlimited_client(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Iterator[Any]:
    """A client of an app without the per-key rate limit, for a table of cases sent with one key at
    in-process speed (tests/test_rate_limit.py checks the limit)."""
    with _fresh_client(monkeypatch, RLOO_RATE_LIMIT="0") as c:
        yield c


def test_bad_job_body_is_400_with_param(unlimited_client, auth) -> None:
    client = unlimited_client  # ~120 requests in a few seconds: past the default burst of 100
    f = upload_ok(client, auth)
    assert create_job(client, auth, job_body(f["id"]))["status"] == "queued"  # the unmutated body is fine
    client.post(f"/v1/fine_tuning/jobs/{list_ids(client, auth, '/v1/fine_tuning/jobs')[0]}/cancel", headers=auth)
    jobs_before = list_ids(client, auth, "/v1/fine_tuning/jobs")

    def check(mutate: Callable[[dict[str, Any]], None], param: str, needle: str | None) -> None:
        body = job_body(f["id"])
        mutate(body)
        resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
        assert_error(resp, 400, param=param, contains=needle)
        assert list_ids(client, auth, "/v1/fine_tuning/jobs") == jobs_before  # validated before a row exists

    each(BAD_JOBS, check)


MISSING_KEY_FILES = {
    "no_line_has_it": (b'{"prompt": "a"}\n', 1),
    "third_line_lacks_it": (
        b'{"prompt": "a", "answer": "x"}\n{"prompt": "b", "answer": "y"}\n{"prompt": "c"}\n',
        3,
    ),
    "only_from_line_2": (b'{"prompt": "a"}\n{"prompt": "b", "answer": "y"}\n', 1),
    "messages_lines": (
        b'{"messages": [{"role": "user", "content": "q"}], "answer": "x"}\n'
        b'{"messages": [{"role": "user", "content": "q"}], "answr": "x"}\n',
        2,
    ),
}


def test_grader_key_missing_from_a_line_names_key_and_line(client, auth) -> None:
    def check(content: bytes, line: int) -> None:
        f = upload_ok(client, auth, content)
        resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(f["id"]))
        assert_error(resp, 400, param=GR, code="missing_item_key", contains=["item.answer", f"line {line} ", f["id"]])
        assert list_ids(client, auth, "/v1/fine_tuning/jobs") == []

    each(MISSING_KEY_FILES, check)


def test_grader_key_missing_from_validation_file(client, auth) -> None:
    train = upload_ok(client, auth)
    valid = upload_ok(client, auth, b'{"prompt": "a", "answer": "x"}\n{"prompt": "b"}\n')
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(train["id"], validation_file=valid["id"]))
    assert_error(resp, 400, param=GR, contains=["answer", "line 2", valid["id"]])


def test_invalid_json_body_is_400(client, auth) -> None:
    resp = client.post(
        "/v1/fine_tuning/jobs",
        headers={**auth, "content-type": "application/json"},
        content=b'{"model": tiny-policy}',
    )
    assert_error(resp, 400, contains="JSON")
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=[1, 2])
    assert_error(resp, 400)


def test_invalid_json_body_has_null_param(client, auth) -> None:
    resp = client.post(
        "/v1/fine_tuning/jobs",
        headers={**auth, "content-type": "application/json"},
        content=b'{"model": tiny-policy}',
    )
    assert_error(resp, 400, param=None)


def test_model_symlink_pointing_outside_the_root_is_400(client, auth, tmp_path, models_dir, unique_model_path) -> None:
    outside = tmp_path / "outside-model"
    shutil.copytree(models_dir / "tiny-policy", outside)  # a valid model, elsewhere
    link = unique_model_path("escape")
    link.symlink_to(outside, target_is_directory=True)
    f = upload_ok(client, auth)
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(f["id"], model=link.name)),
        400,
        param="model",
    )
    body = job_body(f["id"])
    body["method"]["reinforcement"]["grader"] = {"type": "reward_model", "name": "rm", "model": link.name}
    assert_error(client.post("/v1/fine_tuning/jobs", headers=auth, json=body), 400, param=f"{GR}.model")
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == []


def test_model_symlink_inside_the_root_is_accepted(client, auth, models_dir, unique_model_path) -> None:
    link = unique_model_path("alias")
    link.symlink_to(models_dir / "tiny-policy", target_is_directory=True)
    f = upload_ok(client, auth)
    assert create_job(client, auth, job_body(f["id"], model=link.name))["model"] == link.name


def test_model_directory_without_config_is_400(client, auth, unique_model_path) -> None:
    bare = unique_model_path("bare")
    bare.mkdir()
    (bare / "README.md").write_text("not a model")
    f = upload_ok(client, auth)
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(f["id"], model=bare.name)),
        400,
        param="model",
        contains="config.json",
    )


# Pagination ----------------------------------------------------------------------------------------
def test_files_paginate_newest_first(client, auth) -> None:
    created = [upload_ok(client, auth, filename=f"f{i}.jsonl")["id"] for i in range(5)]
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        url = "/v1/files?limit=2" + (f"&after={after}" if after else "")
        body = client.get(url, headers=auth).json()
        pages += 1
        assert 1 <= len(body["data"]) <= 2
        seen += [f["id"] for f in body["data"]]
        if not body["has_more"]:
            break
        assert len(body["data"]) == 2
        after = body["data"][-1]["id"]
        assert pages < 10
    assert pages == 3
    assert seen == created[::-1]
    assert list_ids(client, auth, "/v1/files?limit=100") == created[::-1]
    assert list_ids(client, auth, f"/v1/files?after={created[0]}") == []


def test_jobs_paginate_newest_first(client, auth) -> None:
    f = upload_ok(client, auth)
    created = [create_job(client, auth, job_body(f["id"], seed=i))["id"] for i in range(3)]
    first = client.get("/v1/fine_tuning/jobs?limit=2", headers=auth).json()
    assert [j["id"] for j in first["data"]] == created[:0:-1] and first["has_more"] is True
    rest = client.get(f"/v1/fine_tuning/jobs?limit=2&after={created[1]}", headers=auth).json()
    assert [j["id"] for j in rest["data"]] == [created[0]] and rest["has_more"] is False


LISTS = ["/v1/files", "/v1/fine_tuning/jobs"]


def test_bad_limit_is_400(client, auth) -> None:
    def check(url: str, limit: str) -> None:
        assert_error(client.get(f"{url}?limit={limit}", headers=auth), 400, param="limit")

    each([(url, limit) for url in LISTS for limit in ("0", "101", "-1", "abc", "1.5")], check)


def test_limit_bounds_are_accepted(client, auth) -> None:
    for url in LISTS:
        for limit in (1, 100):
            assert client.get(f"{url}?limit={limit}", headers=auth).status_code == 200, (url, limit)


def test_unknown_after_is_404(client, auth) -> None:
    def check(url: str, after: str) -> None:
        assert_error(client.get(f"{url}?after={after}", headers=auth), 404, param="after", contains=after)

    each([("/v1/files", "file-nope"), ("/v1/fine_tuning/jobs", "ftjob-nope")], check)


def test_unknown_event_after_is_404(client, auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"]))
    resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events?after=ftevent-nope", headers=auth)
    assert_error(resp, 404, param="after")


# Graders -------------------------------------------------------------------------------------------
MULTI = {
    "type": "multi",
    "name": "combo",
    "calculate_output": "0.7 * exact + 0.3 * not_blue",
    "graders": {
        "exact": STRING_CHECK,
        "not_blue": {
            "type": "string_check",
            "name": "not_blue",
            "input": "{{ sample.output_text }}",
            "reference": "blue",
            "operation": "ne",
        },
    },
}


def test_validate_grader(client, auth) -> None:
    def check(grader: dict[str, Any]) -> None:
        resp = client.post("/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": grader})
        assert resp.status_code == 200, resp.text
        assert resp.json()["grader"]["type"] == grader["type"]
        assert resp.json()["grader"]["name"] == grader["name"]

    each({"string_check": STRING_CHECK, "multi": MULTI}, check)


GRADER_RUNS = [
    (STRING_CHECK, "red", {"answer": "red"}, 1.0, {"exact": 1.0}),
    (STRING_CHECK, "Red", {"answer": "red"}, 0.0, {"exact": 0.0}),
    (STRING_CHECK, "red ", {"answer": "red"}, 0.0, {"exact": 0.0}),
    ({**STRING_CHECK, "operation": "ilike"}, "It is RED.", {"answer": "red"}, 1.0, None),
    ({**STRING_CHECK, "operation": "like"}, "It is RED.", {"answer": "red"}, 0.0, None),
    (MULTI, "red", {"answer": "red"}, 1.0, {"exact": 1.0, "not_blue": 1.0}),  # 0.7 * 1 + 0.3 * 1
    (MULTI, "green", {"answer": "red"}, 0.3, {"exact": 0.0, "not_blue": 1.0}),  # 0.7 * 0 + 0.3 * 1
    (MULTI, "blue", {"answer": "red"}, 0.0, {"exact": 0.0, "not_blue": 0.0}),
    (MULTI, "blue", {"answer": "blue"}, 0.7, {"exact": 1.0, "not_blue": 0.0}),
]


def test_run_grader(client, auth, dry_runs) -> None:
    def check(
        grader: dict[str, Any], sample: str, item: dict[str, Any], reward: float, sub: dict[str, float] | None
    ) -> None:
        resp = client.post(
            "/v1/fine_tuning/alpha/graders/run",
            headers=auth,
            json={"grader": grader, "model_sample": sample, "item": item},
        )
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert {"reward", "sub_rewards", "metadata"} <= set(out)
        assert out["reward"] == pytest.approx(reward), out
        if sub is not None:
            assert out["sub_rewards"] == pytest.approx(sub), out

    each(GRADER_RUNS, check)


def test_run_grader_reference_answer_spelling(client, auth, dry_runs) -> None:
    grader = {**STRING_CHECK, "reference": "{{ item.reference_answer }}"}
    resp = client.post(
        "/v1/fine_tuning/alpha/graders/run",
        headers=auth,
        json={"grader": grader, "model_sample": "42", "reference_answer": "42"},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 1.0


INVALID_GRADERS = [
    ({**STRING_CHECK, "operation": "contains"}, "grader.operation"),
    ({k: v for k, v in STRING_CHECK.items() if k != "input"}, "grader.input"),
    ({"type": "regex", "name": "r"}, "grader.type"),
    ({"name": "no type"}, "grader.type"),
    ({**MULTI, "calculate_output": "__import__('os')"}, "grader.calculate_output"),
    (
        {
            **MULTI,
            "graders": {
                "exact": {**STRING_CHECK, "operation": "bogus"},
                "not_blue": MULTI["graders"]["not_blue"],
            },
        },
        "grader.graders.exact.operation",
    ),
    ({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}, "grader.type"),
]


def test_invalid_grader_is_400(client, auth) -> None:
    def check(grader: dict[str, Any], param: str, endpoint: str) -> None:
        body: dict[str, Any] = {"grader": grader}
        if endpoint == "run":
            body.update(model_sample="red", item={"answer": "red"})
        resp = client.post(f"/v1/fine_tuning/alpha/graders/{endpoint}", headers=auth, json=body)
        err = assert_error(resp, 400, param=param)
        if grader.get("type") == "python":
            assert "RLOO_ALLOW_PYTHON_GRADER" in err["message"]

    each([(g, p, e) for g, p in INVALID_GRADERS for e in ("validate", "run")], check)


def test_python_grader_validates_when_the_operator_enables_it(monkeypatch, client, auth) -> None:
    from service.db import reset_caches

    grader = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "1")
    reset_caches()
    resp = client.post("/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": grader})
    assert resp.status_code == 200, resp.text


def test_python_grader_dry_run_over_http(monkeypatch, client, auth, dry_runs) -> None:
    """The operator enables python graders; /graders/run runs one in the sandbox of a graders
    worker: a score, or the sample's error in metadata.error_messages (never a 500)."""
    from service.db import reset_caches

    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "1")
    reset_caches()
    source = "def grade(sample, item):\n    return len(sample['output_text']) / item['n']\n"
    grader = {"type": "python", "name": "p", "source": source}
    url = "/v1/fine_tuning/alpha/graders/run"
    resp = client.post(url, headers=auth, json={"grader": grader, "model_sample": "abcd", "item": {"n": 8}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 0.5 and resp.json()["sub_rewards"] == {"p": 0.5}
    resp = client.post(url, headers=auth, json={"grader": grader, "model_sample": "abcd", "item": {"n": 0}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["reward"] is None and body["metadata"]["errors"] == {"p": 1}
    assert body["metadata"]["error_messages"] == {"p": "ZeroDivisionError: division by zero"}


def test_grader_body_unknown_key_is_400(client, auth) -> None:
    resp = client.post(
        "/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": STRING_CHECK, "extra": 1}
    )
    assert_error(resp, 400, param="extra")


# Ops -----------------------------------------------------------------------------------------------
def test_healthz(client) -> None:
    resp = client.get("/healthz")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_readyz(client, monkeypatch) -> None:
    resp = client.get("/readyz")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"status": "ok", "checks": {"database": "ok", "broker": "ok"}, "python_graders": "off"}
    # The sandbox python graders run in, once the operator turns them on.
    with _fresh_client(monkeypatch, RLOO_ALLOW_PYTHON_GRADER="1") as on:
        assert on.get("/readyz").json()["python_graders"] == "bwrap"
    with _fresh_client(monkeypatch, RLOO_PYTHON_GRADER_SANDBOX="process") as weaker:
        assert weaker.get("/readyz").json()["python_graders"] == "process"


def test_workers_say_which_sandbox_runs_on_their_host(monkeypatch) -> None:
    from service import sandbox
    from service.settings import Settings

    assert sandbox.status(Settings()) == "off (RLOO_ALLOW_PYTHON_GRADER is false)"
    assert sandbox.status(Settings(allow_python_grader=True)).startswith("bwrap (namespaces: pid, net")
    monkeypatch.setenv("PATH", "/nonexistent")
    said = sandbox.status(Settings(allow_python_grader=True, python_grader_uid=65533))  # probed afresh
    assert said.startswith("unavailable: python graders run in bubblewrap's sandbox, and bwrap is not installed")


def test_broker_down_readyz_503_and_jobs_still_created(monkeypatch, env, auth, tmp_path) -> None:
    """The row is the truth: with the broker unreachable a job is still created (and queued later)."""
    from service import queue

    dead = f"redis+socket://{tmp_path / 'no-redis.sock'}"
    queue.client.cache_clear()
    with _fresh_client(monkeypatch, REDIS_URL=dead) as client:
        resp = client.get("/readyz")
        assert resp.status_code == 503, resp.text
        checks = resp.json()["checks"]
        assert checks["database"] == "ok" and checks["broker"] != "ok"
        f = upload_ok(client, auth)
        started = time.monotonic()
        job = create_job(client, auth, job_body(f["id"]))
        assert time.monotonic() - started < 15  # a dead broker must not hang the request
        assert job["status"] == "queued"
        events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
        assert events[0]["level"] == "warn", events
        assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()["status"] == "queued"
    queue.client.cache_clear()


def _job_gauge(text: str, status: str) -> int:
    match = re.search(rf'^rloo_jobs\{{status="{status}"\}} (\d+)$', text, re.M)
    assert match, text
    return int(match.group(1))


def test_prometheus_metrics_count_jobs(client, auth) -> None:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    assert "# TYPE rloo_jobs gauge" in resp.text
    assert _job_gauge(resp.text, "queued") == 0
    f = upload_ok(client, auth)
    jobs = [create_job(client, auth, job_body(f["id"], seed=i)) for i in range(2)]
    text = client.get("/metrics").text
    assert _job_gauge(text, "queued") == 2 and _job_gauge(text, "cancelled") == 0
    client.post(f"/v1/fine_tuning/jobs/{jobs[0]['id']}/cancel", headers=auth)
    text = client.get("/metrics").text
    assert _job_gauge(text, "queued") == 1 and _job_gauge(text, "cancelled") == 1


def test_unknown_url_is_404(client, auth) -> None:
    def check(url: str, headers: dict[str, str]) -> None:
        assert_error(client.get(url, headers=headers), 404, param=None)

    each([("/nope", {}), ("/nope", auth), ("/v1/nope", auth), ("/v1/fine_tuning/jobs/x/y/z", auth)], check)
    # Under /v1 the key comes first: no key, no information about which URLs exist.
    assert_error(client.get("/v1/nope"), 401, code="missing_api_key")


def test_wrong_method_is_405(client, auth) -> None:
    assert_error(client.put("/v1/files", headers=auth), 405)


# Boundaries and names ------------------------------------------------------------------------------
def test_api_process_imports_neither_torch_nor_worker(tmp_path) -> None:
    code = (
        "import service.main, sys; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch loaded'; "
        "assert not [m for m in sys.modules if m == 'worker' or m.startswith('worker.')], 'worker loaded'"
    )
    env = {**os.environ, "RLOO_HOME": str(tmp_path / "var")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr


def test_architecture_names_exist() -> None:
    import importlib

    import torch
    from celery import Celery
    from fastapi import FastAPI

    assert isinstance(importlib.import_module("service.main").app, FastAPI)
    assert isinstance(importlib.import_module("worker.celery_app").app, Celery)
    rloo_advantages = importlib.import_module("worker.rloo").rloo_advantages
    assert callable(rloo_advantages)
    # (1, 3): each reward minus the mean of the other two.
    out = rloo_advantages(torch.tensor([[1.0, 2.0, 3.0]]))
    assert out.shape == (1, 3)
    assert torch.allclose(out, torch.tensor([[-1.5, 0.0, 1.5]]))


def test_cli_lists_its_verbs() -> None:
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    for verb in ("up", "api", "worker", "db", "keys", "train", "demo"):
        assert re.search(rf"(^|\s){verb}\s", out.stdout, re.M), f"{verb} missing from:\n{out.stdout}"
    out = run_cli("keys", "create", "--help")
    assert out.returncode == 0, out.stderr
    assert "--project" in out.stdout


def test_settings_read_the_documented_environment(monkeypatch, tmp_path) -> None:
    from service.settings import Settings

    monkeypatch.setenv("DATABASE_URL", "postgres://u:p@db:5432/rloo")
    monkeypatch.setenv("REDIS_URL", "redis://cache:6379/3")
    monkeypatch.setenv("RLOO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLOO_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("RLOO_ARTIFACTS_DIR", str(tmp_path / "art"))
    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "true")
    s = Settings()
    assert s.database_url == "postgresql+psycopg://u:p@db:5432/rloo"
    assert s.redis_url == "redis://cache:6379/3"
    assert s.home_dir == (tmp_path / "home").resolve()
    assert s.models_dir == (tmp_path / "models").resolve()
    assert s.artifacts_dir == (tmp_path / "art").resolve()
    assert s.allow_python_grader is True
    for name in (
        "DATABASE_URL",
        "REDIS_URL",
        "RLOO_MODELS_DIR",
        "RLOO_ARTIFACTS_DIR",
        "RLOO_ALLOW_PYTHON_GRADER",
    ):
        monkeypatch.delenv(name)
    s = Settings()
    home = (tmp_path / "home").resolve()
    assert s.database_url == f"sqlite:///{home / 'rloo.db'}"
    assert s.artifacts_dir == home / "artifacts"
    assert s.allow_python_grader is False
    assert s.embedded_redis is True


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


def test_pause_and_resume_state_machine(client, auth) -> None:
    """Only a running job pauses; only a paused job whose worker has let go (or gone silent: no
    heartbeat for 3 periods) resumes; each change is an event; illegal changes are 409."""
    import time

    from service.db import session_scope
    from service.models import Job

    file_id = upload_ok(client, auth)["id"]
    job = create_job(client, auth, job_body(file_id))
    jid = job["id"]
    url = f"/v1/fine_tuning/jobs/{jid}"
    assert_error(client.post(url + "/pause", headers=auth), 409, param=None, code="invalid_state")  # queued
    assert_error(client.post(url + "/resume", headers=auth), 409, param=None, code="invalid_state")

    def set_row(**values: object) -> None:
        with session_scope() as session:
            session.query(Job).filter(Job.id == jid).update(values)
            session.commit()

    set_row(status="running", worker="host:1", heartbeat_at=time.time())
    resp = client.post(url + "/pause", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "paused", resp.text
    err = assert_error(client.post(url + "/resume", headers=auth), 409, param=None, code="invalid_state")
    assert "pausing" in err["message"]  # its worker holds it and beats
    set_row(heartbeat_at=time.time() - 3600)  # the worker died while pausing
    resp = client.post(url + "/resume", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text
    events = client.get(url + "/events", headers=auth, params={"limit": 50}).json()["data"]
    assert any(e["message"].startswith("Job paused") for e in events)
    assert any(e["message"].startswith("Job resumed") for e in events)
    set_row(status="succeeded")
    for action in ("pause", "resume"):
        assert_error(client.post(url + f"/{action}", headers=auth), 409, param=None, code="invalid_state")
    assert client.post("/v1/fine_tuning/jobs/ftjob-nope/pause", headers=auth).status_code == 404


def test_idempotency_key_returns_the_first_answer(client, auth, other_auth, env) -> None:
    """A retried creation with the same Idempotency-Key gets the first answer: one file, one job;
    the same key with another request is a 409; keys are per project; a bad key is a 400."""
    from concurrent.futures import ThreadPoolExecutor

    def upload_with(key: str, content: bytes = TRAIN_JSONL, headers: dict | None = None) -> Any:
        return client.post(
            "/v1/files",
            headers={**(headers or auth), "Idempotency-Key": key},
            files={"file": ("train.jsonl", content)},
            data={"purpose": "fine-tune"},
        )

    first, again = upload_with("up-1"), upload_with("up-1")
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert again.headers.get("idempotent-replayed") == "true"
    files = client.get("/v1/files", headers=auth).json()["data"]
    assert [f["id"] for f in files] == [first.json()["id"]]
    assert len(stored_files(env)) == 1  # the retry's bytes were not kept
    other = upload_with("up-1", TRAIN_JSONL + b'{"prompt": "one more"}\n')
    assert_error(other, 409, param="Idempotency-Key", code="idempotency_key_reused")
    assert upload_with("up-1", headers=other_auth).json()["id"] != first.json()["id"]  # another project's key
    assert_error(upload_with(""), 400, param="Idempotency-Key")

    body = job_body(first.json()["id"])
    headers = {**auth, "Idempotency-Key": "job-1"}
    with ThreadPoolExecutor(4) as pool:  # retries racing each other
        answers = list(pool.map(lambda _: client.post("/v1/fine_tuning/jobs", headers=headers, json=body), range(4)))
    assert {r.status_code for r in answers} == {200}
    assert len({r.json()["id"] for r in answers}) == 1
    jobs = client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"]
    assert [j["id"] for j in jobs] == [answers[0].json()["id"]]
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=headers, json={**body, "seed": 7}),
        409,
        param="Idempotency-Key",
        code="idempotency_key_reused",
    )


# Uploads: the edges that are accepted, and read by the worker exactly as they were validated -------
ACCEPTED_UPLOADS = {
    # Windows tools write a UTF-8 byte-order mark: accepted, and never part of the first line.
    "utf8_bom_and_crlf": (
        b'\xef\xbb\xbf{"prompt": "first", "answer": "1"}\r\n{"prompt": "second", "answer": "2"}\r\n',
        [{"prompt": "first", "answer": "1"}, {"prompt": "second", "answer": "2"}],
    ),
    # A lone CR between tokens is JSON whitespace inside the line, not a line end.
    "lone_cr_inside_a_line": (
        b'{"prompt": "a",\r"answer": "b"}\n{"prompt": "c", "answer": "d"}',
        [{"prompt": "a", "answer": "b"}, {"prompt": "c", "answer": "d"}],
    ),
    # Control characters other than NUL, escaped, in values and keys: text PostgreSQL holds.
    "escaped_control_characters": (
        b'{"prompt": "tab\\there\\u0001\\u001f\x7f", "answer": "x\\ny", "k\\t": 1}\n',
        [{"prompt": "tab\there\x01\x1f\x7f", "answer": "x\ny", "k\t": 1}],
    ),
    # Unicode line separators are characters of the line, not line ends.
    "unicode_line_separators": (
        '{"prompt": "a\u2028b\u0085c\u2029", "answer": "1"}\n'.encode(),
        [{"prompt": "a\u2028b\u0085c\u2029", "answer": "1"}],
    ),
    "nested_100_levels": (
        b'{"prompt": "a", "answer": "1", "x": ' + b"[" * 99 + b"]" * 99 + b"}\n",
        [{"prompt": "a", "answer": "1", "x": json.loads("[" * 99 + "]" * 99)}],
    ),
}


def test_accepted_upload_edges_read_by_the_worker_as_validated(client, auth, env) -> None:
    """What the API accepts, the worker's reader (worker.data.load_items) reads line for line the same:
    the UTF-8 BOM is not part of the first prompt, a lone CR does not split a line."""
    from worker.data import load_items

    def check(content: bytes, expected: list[dict[str, Any]]) -> None:
        f = upload_ok(client, auth, content)
        assert f["line_count"] == len(expected) and f["bytes"] == len(content)
        assert client.get(f"/v1/files/{f['id']}/content", headers=auth).content == content  # kept as sent
        (path,) = [p for p in stored_files(env) if p.name == f"{f['id']}.jsonl"]
        items = load_items(path)
        assert items == expected
        assert not items[0]["prompt"].startswith("\ufeff")
        create_job(client, auth, job_body(f["id"]))  # its grader reads item.answer: every line has it

    each(ACCEPTED_UPLOADS, check)


def test_default_line_limit_is_1_mib(client, auth, env) -> None:
    """RLOO_MAX_LINE_BYTES is 1 MiB unless set: a longer line is a 400 naming it (with its newline, or as
    the last line without one); a line at the limit is accepted."""
    from service.settings import Settings, get_settings

    limit = 1 << 20
    assert Settings.model_fields["max_line_bytes"].default == limit
    assert get_settings().max_line_bytes == limit  # this client runs with the default

    def line(n: int) -> bytes:
        return b'{"prompt": "' + b"x" * (n - 14) + b'"}'

    small = b'{"prompt": "a"}'
    assert len(line(limit)) == limit

    def check(content: bytes, needle: list[str]) -> None:
        assert_error(upload(client, auth, content), 400, param="file", code="invalid_file", contains=needle)
        assert stored_files(env) == []
        assert list_ids(client, auth, "/v1/files") == []

    each(
        {
            "one_byte_over_with_newline": (
                small + b"\n" + line(limit + 1) + b"\n" + small + b"\n",
                ["Line 2", "1 MiB", "shorten it"],
            ),
            "one_byte_over_as_last_line": (small + b"\n" + small + b"\n" + line(limit + 1), ["Line 3", "1 MiB"]),
            "far_over": (small + b"\n" + line(3 * limit) + b"\n", ["Line 2", "shorten it"]),
        },
        check,
    )
    for content in (line(limit) + b"\n" + small + b"\n", small + b"\n" + line(limit - 1)):
        f = upload_ok(client, auth, content)
        assert f["line_count"] == 2 and f["bytes"] == len(content)


def test_upload_request_that_is_not_a_file_upload_is_400(client, auth, env) -> None:
    """A missing purpose, a body that is not multipart, a file sent as a plain form string: 400 in the
    error shape (never FastAPI's 422, never a 500), and nothing stored."""
    jsonl = b'{"prompt": "a"}\n'
    cases: dict[str, tuple[dict[str, Any], str | None]] = {
        "missing_purpose": ({"files": {"file": ("a.jsonl", jsonl)}}, "purpose"),
        "json_body": ({"json": {"file": jsonl.decode(), "purpose": "fine-tune"}}, "file"),
        "urlencoded_form": ({"data": {"file": jsonl.decode(), "purpose": "fine-tune"}}, "file"),
        "file_as_plain_multipart_field": ({"files": {"file": (None, jsonl), "purpose": (None, "fine-tune")}}, "file"),
        "raw_jsonl_body": ({"content": jsonl, "headers": {"content-type": "application/jsonl"}}, "file"),
        "multipart_without_boundary": ({"content": jsonl, "headers": {"content-type": "multipart/form-data"}}, None),
        "empty_body": ({}, "file"),
    }

    def check(kwargs: dict[str, Any], param: str | None) -> None:
        kwargs = {**kwargs, "headers": {**auth, **kwargs.get("headers", {})}}
        assert_error(client.post("/v1/files", **kwargs), 400, param=param)
        assert stored_files(env) == []
        assert list_ids(client, auth, "/v1/files") == []

    each(cases, check)


def test_an_unknown_model_says_what_there_is_or_how_to_build_the_examples(client, auth, monkeypatch, tmp_path) -> None:
    from service.db import reset_caches

    file_id = upload_ok(client, auth)["id"]
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(file_id, model="tiny-polcy"))
    assert_error(
        resp, 400, param="model", code="model_not_found", contains="Models available: tiny-policy, tiny-reward"
    )
    monkeypatch.setenv("RLOO_MODELS_DIR", str(tmp_path / "empty"))
    reset_caches()
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(file_id))
    err = assert_error(resp, 400, param="model", code="model_not_found", contains="python -m worker.tinymodels")
    assert str(tmp_path) not in err["message"]  # no path of the host

"""Files (`/v1/files`): upload, list, read, delete; every bad upload a 400 that says what to change
and leaves nothing behind; the edges that are accepted are read by the worker as they were
validated.

Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set; every error is checked for its
exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tests.helpers.api import (
    assert_error,
    create_job,
    each,
    fresh_client,
    list_ids,
    stored_files,
    upload,
    upload_ok,
)
from tests.helpers.data import STRING_CHECK, TRAIN_JSONL, job_body

FILE_FIELDS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status"}

# docs/algorithm.md's defaults table, spelled out here (not read from the schema) so a drifting default fails.


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
    "last_turn_neither_user_nor_assistant": (
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]}\n',
        "Line 1",
    ),
    "unknown_role": (b'{"messages": [{"role": "robot", "content": "hi"}]}\n', "role"),
    "weight_not_0_or_1": (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 2}]}\n',
        "weight",
    ),
    "only_weight_0": (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}\n',
        "nothing is left to learn",
    ),
    "preference_without_rejected": (
        b'{"input": {"messages": [{"role": "user", "content": "q"}]}, '
        b'"preferred_output": [{"role": "assistant", "content": "a"}]}\n',
        "non_preferred_output",
    ),
    "preference_output_not_assistant": (
        b'{"input": {"messages": [{"role": "user", "content": "q"}]}, '
        b'"preferred_output": [{"role": "user", "content": "a"}], '
        b'"non_preferred_output": [{"role": "assistant", "content": "b"}]}\n',
        "assistant messages only",
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
    with fresh_client(monkeypatch, RLOO_MAX_UPLOAD_BYTES=str(limit)) as client:
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
    with fresh_client(monkeypatch, RLOO_MAX_UPLOAD_BYTES="1000") as client:
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
    with fresh_client(monkeypatch, RLOO_MAX_LINE_BYTES="100") as client:

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
    """What the API accepts, the worker's reader (worker.engine.data.load_items) reads line for line the same:
    the UTF-8 BOM is not part of the first prompt, a lone CR does not split a line."""
    from worker.engine.data import load_items

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
    from service.core.settings import Settings, get_settings

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

"""Lists: newest first, `after` and `limit`, the same on every list.

Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set; every error is checked for its
exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

from tests.helpers.api import (
    assert_error,
    create_job,
    each,
    list_ids,
    upload_ok,
)
from tests.helpers.data import job_body


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

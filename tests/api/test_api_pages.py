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

    bad = ("0", "-1", "abc", "1.5")
    each([(url, limit) for url in LISTS for limit in bad] + [("/v1/fine_tuning/jobs", "101")], check)


def test_limit_bounds_are_accepted(client, auth) -> None:
    for url in LISTS:
        for limit in (1, 100):
            assert client.get(f"{url}?limit={limit}", headers=auth).status_code == 200, (url, limit)


def test_an_unknown_after_is_an_empty_page_as_at_openai(client, auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"]))

    def check(url: str, after: str) -> None:
        resp = client.get(f"{url}?after={after}", headers=auth)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}

    events = f"/v1/fine_tuning/jobs/{job['id']}/events"
    each([("/v1/files", "file-nope"), ("/v1/fine_tuning/jobs", "ftjob-nope"), (events, "ftevent-nope")], check)


def test_files_list_takes_openais_limit_and_order(client, auth) -> None:
    created = [upload_ok(client, auth)["id"] for _ in range(3)]
    assert list_ids(client, auth, "/v1/files?limit=10000") == created[::-1]
    assert list_ids(client, auth, "/v1/files?order=asc") == created
    assert list_ids(client, auth, f"/v1/files?order=asc&after={created[0]}&limit=1") == created[1:2]
    assert_error(client.get("/v1/files?limit=10001", headers=auth), 400, param="limit", contains="10000")
    assert_error(client.get("/v1/files?order=up", headers=auth), 400, param="order")
    assert_error(client.get("/v1/fine_tuning/jobs?limit=101", headers=auth), 400, param="limit", contains="100")


def test_jobs_list_filters_on_metadata(client, auth) -> None:
    f = upload_ok(client, auth)
    red = create_job(client, auth, job_body(f["id"], metadata={"team": "red", "run": "1"}))
    blue = create_job(client, auth, job_body(f["id"], metadata={"team": "blue"}))
    bare = create_job(client, auth, job_body(f["id"]))
    url = "/v1/fine_tuning/jobs"
    assert list_ids(client, auth, f"{url}?metadata[team]=red") == [red["id"]]
    assert list_ids(client, auth, f"{url}?metadata[team]=red&metadata[run]=2") == []
    assert list_ids(client, auth, f"{url}?metadata[team]=blue") == [blue["id"]]
    assert list_ids(client, auth, f"{url}?metadata=null") == [bare["id"]]
    assert_error(client.get(f"{url}?metadata=team", headers=auth), 400, param="metadata")

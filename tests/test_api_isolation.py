"""Projects are isolated: another project's files, jobs and checkpoints do not exist for a key (404, never
403), its lists are empty, and nothing it does changes them."""

from __future__ import annotations

from typing import Any

from tests.test_api import assert_error, create_job, job_body, list_ids, stored_files, upload_ok

FOREIGN_FILE_REQUESTS = [("GET", ""), ("GET", "/content"), ("DELETE", "")]
FOREIGN_JOB_REQUESTS = [
    ("GET", ""),
    ("POST", "/cancel"),
    ("GET", "/events"),
    ("GET", "/metrics"),
    ("GET", "/checkpoints"),
    ("GET", "/checkpoints/ftckpt-000000000000000000000000/content"),
]


def _same_error_as_for_a_missing_id(
    client: Any, headers: dict[str, str], method: str, url: str, real_id: str, fake_id: str
) -> None:
    """404 in the error shape, and the very body a never-existing id gets: no existence oracle."""
    resp = client.request(method, url, headers=headers)
    err = assert_error(resp, 404, code="not_found")
    fake = client.request(method, url.replace(real_id, fake_id), headers=headers)
    assert fake.status_code == 404
    assert fake.json()["error"] == {**err, "message": err["message"].replace(real_id, fake_id)}


def test_other_project_cannot_see_or_touch_files(client, auth, other_auth, env) -> None:
    f = upload_ok(client, auth)
    fake = "file-" + "0" * 24
    for method, suffix in FOREIGN_FILE_REQUESTS:
        _same_error_as_for_a_missing_id(client, other_auth, method, f"/v1/files/{f['id']}{suffix}", f["id"], fake)
    assert list_ids(client, other_auth, "/v1/files") == []
    assert_error(client.get(f"/v1/files?after={f['id']}", headers=other_auth), 404, param="after")
    # Nothing beta did changed alpha's file.
    assert client.get(f"/v1/files/{f['id']}", headers=auth).json() == f
    assert len(stored_files(env)) == 1
    assert list_ids(client, auth, "/v1/files") == [f["id"]]


def test_other_project_cannot_see_or_touch_jobs(client, auth, other_auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"]))
    events = list_ids(client, auth, f"/v1/fine_tuning/jobs/{job['id']}/events")
    fake = "ftjob-" + "0" * 24
    for method, suffix in FOREIGN_JOB_REQUESTS:
        url = f"/v1/fine_tuning/jobs/{job['id']}{suffix}"
        _same_error_as_for_a_missing_id(client, other_auth, method, url, job["id"], fake)
    assert list_ids(client, other_auth, "/v1/fine_tuning/jobs") == []
    assert_error(client.get(f"/v1/fine_tuning/jobs?after={job['id']}", headers=other_auth), 404, param="after")
    # beta's cancel did nothing: alpha's job is still queued, with the same events.
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json() == job
    assert list_ids(client, auth, f"/v1/fine_tuning/jobs/{job['id']}/events") == events


def test_projects_see_only_their_own_lists(client, auth, other_auth) -> None:
    mine = upload_ok(client, auth)
    theirs = upload_ok(client, other_auth)
    my_job = create_job(client, auth, job_body(mine["id"]))
    their_job = create_job(client, other_auth, job_body(theirs["id"]))
    assert list_ids(client, auth, "/v1/files") == [mine["id"]]
    assert list_ids(client, other_auth, "/v1/files") == [theirs["id"]]
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == [my_job["id"]]
    assert list_ids(client, other_auth, "/v1/fine_tuning/jobs") == [their_job["id"]]
    assert my_job["organization_id"] != their_job["organization_id"]
    # Each cancels only its own.
    assert_error(client.post(f"/v1/fine_tuning/jobs/{their_job['id']}/cancel", headers=auth), 404)
    assert client.post(f"/v1/fine_tuning/jobs/{their_job['id']}/cancel", headers=other_auth).status_code == 200
    assert client.get(f"/v1/fine_tuning/jobs/{my_job['id']}", headers=auth).json()["status"] == "queued"


def test_other_projects_file_cannot_train_a_job(client, auth, other_auth) -> None:
    theirs = upload_ok(client, other_auth)
    mine = upload_ok(client, auth)
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(theirs["id"])),
        400,
        param="training_file",
    )
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(mine["id"], validation_file=theirs["id"])),
        400,
        param="validation_file",
    )
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == []

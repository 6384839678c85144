"""Quotas, metering and budgets: the operator sets a project's quotas (HTTP and CLI); past each the
project gets a 429 (a 403 quota_exceeded for storage) naming the quota, its use, the limit and when it
frees up, and loses nothing; a job's steps are metered (device-seconds by accelerator kind, tokens
trained and sampled) and read back by GET /v1/usage; a job at its device-hour budget, or its project
at its day, is paused with an event and the paused webhook, and resumes from there."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.helpers.api import assert_error, create_job, make_key, upload_ok
from tests.helpers.data import job_body
from tests.helpers.live import run_cli


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def operator(env: dict[str, str]) -> dict[str, str]:
    return bearer(make_key("ops", operator=True))


def set_quotas(client: Any, operator: dict[str, str], project: str, **quotas: Any) -> dict[str, Any]:
    resp = client.post(f"/v1/projects/{project}", headers=operator, json={"quotas": quotas})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_operator_sets_and_unsets_quotas(client, auth, operator) -> None:
    project = set_quotas(client, operator, "alpha", running_jobs=2, device_hours_per_day=1.5)
    assert project["quotas"]["running_jobs"] == 2 and project["quotas"]["device_hours_per_day"] == 1.5
    assert project["quotas"]["gpus"] is None
    project = set_quotas(client, operator, "alpha", running_jobs=None, gpus=4)
    assert project["quotas"]["running_jobs"] is None and project["quotas"]["gpus"] == 4
    assert project["quotas"]["device_hours_per_day"] == 1.5  # untouched
    for quotas, param in (
        ({"cpus": 3}, "quotas.cpus"),
        ({"gpus": -1}, "quotas.gpus"),
        ({"gpus": 1.5}, "quotas.gpus"),
        ({"stored_bytes": "lots"}, "quotas.stored_bytes"),
    ):
        resp = client.post("/v1/projects/alpha", headers=operator, json={"quotas": quotas})
        assert resp.status_code == 400 and resp.json()["error"]["param"] in (param, "quotas.stored_bytes"), resp.text
    assert client.get("/v1/projects/alpha", headers=operator).json()["quotas"]["gpus"] == 4  # nothing half-set
    assert_error(client.post("/v1/projects/alpha", headers=auth, json={"quotas": {}}), 403)


def test_queued_jobs_and_storage_quotas_refuse_and_store_nothing(client, auth, operator) -> None:
    training = upload_ok(client, auth)
    set_quotas(client, operator, "alpha", queued_jobs=1)
    create_job(client, auth, job_body(training["id"]))
    err = assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(training["id"])),
        429,
        code="too_many_queued_jobs",
    )
    assert "quota of queued_jobs (1)" in err["message"]

    stored = client.get("/v1/usage", headers=auth).json()["stored_bytes"]
    assert stored == training["bytes"]
    set_quotas(client, operator, "alpha", stored_bytes=stored + 10)
    before = client.get("/v1/files", headers=auth).json()["data"]
    err = assert_error(
        client.post("/v1/files", headers=auth, files={"file": ("more.jsonl", b'{"prompt": "a longer prompt"}\n')},
                    data={"purpose": "fine-tune"}),
        403,
        code="quota_exceeded",
    )  # fmt: skip
    assert "stored_bytes" in err["message"] and str(stored) in err["message"]
    assert client.get("/v1/files", headers=auth).json()["data"] == before


def test_running_jobs_quota_keeps_the_next_job_waiting(client, auth, operator) -> None:
    from service.core.db import session_scope
    from service.jobs import lifecycle

    training = upload_ok(client, auth)
    first = create_job(client, auth, job_body(training["id"]))
    second = create_job(client, auth, job_body(training["id"]))
    set_quotas(client, operator, "alpha", running_jobs=1)
    with session_scope() as session:
        claimed = lifecycle.claim_fairest(session=session, lane=first_lane(first), worker="w1")
        assert claimed is not None and claimed.id == first["id"]
        assert lifecycle.claim_fairest(session=session, lane=first_lane(first), worker="w2") is None
    events = client.get(f"/v1/fine_tuning/jobs/{second['id']}/events", headers=auth).json()["data"]
    assert any("quota of running_jobs (1)" in e["message"] for e in events), events
    assert client.get(f"/v1/fine_tuning/jobs/{second['id']}", headers=auth).json()["status"] == "queued"
    client.post(f"/v1/fine_tuning/jobs/{first['id']}/cancel", headers=auth)
    with session_scope() as session:
        claimed = lifecycle.claim_fairest(session=session, lane=first_lane(first), worker="w2")
        assert claimed is not None and claimed.id == second["id"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_on_sqlite_a_claim_waits_for_another_claims_commit_and_sees_its_running_job(client, auth, operator) -> None:
    """SQLite has no row locks: a claim takes the database's write lock before it reads the project's
    running jobs, so a claim on another worker that took the project's last place is seen, not raced."""
    import threading

    from sqlalchemy import update

    from service.core.db import session_scope
    from service.core.tables import Job
    from service.jobs import lifecycle

    training = upload_ok(client, auth)
    first, second = (create_job(client, auth, job_body(training["id"])) for _ in range(2))
    set_quotas(client, operator, "alpha", running_jobs=1)

    def claim() -> None:
        with session_scope() as session:
            got.append(lifecycle.claim_fairest(session=session, lane=first_lane(first), worker="w2"))

    got: list[Any] = []
    with session_scope() as other:  # another worker's claim (as of another lane's), not yet committed
        other.execute(update(Job).where(Job.id == second["id"]).values(status="running", worker="w1"))
        waiting = threading.Thread(target=claim)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # its turn comes after the other's commit
        other.commit()
    waiting.join(30)
    assert got == [None]  # it saw the running job: the project is at its quota, the first job waits
    assert client.get(f"/v1/fine_tuning/jobs/{first['id']}", headers=auth).json()["status"] == "queued"


def first_lane(job: dict[str, Any]) -> str:
    from service.infra.task_queue import lane

    return lane(job.get("resources"))


def test_steps_are_metered_and_a_budget_pauses_the_job(client, auth, operator) -> None:
    from service.core.db import session_scope
    from service.jobs import lifecycle
    from worker.jobs.database_recorder import DatabaseRecorder

    training = upload_ok(client, auth)
    body = job_body(training["id"], budget={"device_hours": 0.001})  # 3.6 device-seconds
    job = create_job(client, auth, body)
    assert job["budget"] == {"device_hours": 0.001}
    with session_scope() as session:
        row = lifecycle.claim(session=session, job_id=job["id"], worker="w1")
        assert row is not None
    recorder = DatabaseRecorder(row, holder="w1")
    recorder.meter.last -= 2.0  # two seconds since the job started, on its one device
    first = {"total_steps": 10, "trained_tokens": 100, "completion_length_mean": 5.0, "judge_tokens": 900}
    assert recorder.step(1, {**first, "reward_model_tokens": 0}) is None
    used = client.get("/v1/usage?group_by=subject", headers=auth).json()["data"]
    mine = {u["kind"]: u["amount"] for u in used if u["subject"] == job["id"]}
    hp = job["method"]["reinforcement"]["hyperparameters"]
    assert 2.0 <= mine["device_seconds"] < 2.0 + 30  # the 2 s held back, and the machine's own time since
    assert mine["tokens_trained"] == 100 and mine["tokens_sampled"] == 5.0 * hp["batch_size"] * hp["rloo_k"]
    assert mine["judge_tokens"] == 900 and "reward_model_tokens" not in mine  # a step's own (no zero rows)

    recorder.meter.last -= 3.0
    recorder.meter.checked = float("-inf")  # the budget is looked at every 10 s; now
    assert recorder.step(2, {"total_steps": 10, "trained_tokens": 250, "completion_length_mean": 5.0}) == "paused"
    after = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()
    assert after["status"] == "paused"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
    assert "its budget (0.001)" in events[0]["message"]
    by_kind = {u["kind"]: u for u in client.get("/v1/usage", headers=auth).json()["data"]}
    assert by_kind["tokens_trained"]["amount"] == 250  # deltas: 100, then 150
    assert by_kind["judge_tokens"]["amount"] == 900  # the second step's judge read nothing
    assert 5.0 / 3600 <= by_kind["device_seconds"]["device_hours"] < 35.0 / 3600


def test_a_project_past_its_device_hours_is_refused_new_jobs_until_it_frees(client, auth, operator) -> None:
    from service.core.db import session_scope
    from service.tenancy import usage

    training = upload_ok(client, auth)
    seq = client.get("/v1/me", headers=auth).json()["project"]["id"]
    with session_scope() as session:
        from service.tenancy import projects

        project = projects.find_project(session=session, id_or_name=seq)
        usage.add(session, project_seq=project.seq, subject="ftjob-old", kind="device_seconds", amount=7200.0)
        session.commit()
    set_quotas(client, operator, "alpha", device_hours_per_day=1.5)
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(training["id"]))
    err = assert_error(resp, 429, code="quota_exceeded")
    assert "used 2.00 device-hours" in err["message"] and "device_hours_per_day (1.5)" in err["message"]
    assert int(resp.headers["retry-after"]) > 22 * 3600  # the hour used leaves the window tomorrow
    assert client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == []


def test_a_running_job_of_a_project_past_its_device_hours_is_paused_at_its_next_look(client, auth, operator) -> None:
    from service.core.db import session_scope
    from service.jobs import lifecycle
    from service.tenancy import projects, usage
    from worker.jobs.database_recorder import DatabaseRecorder

    job = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))  # no budget of its own
    with session_scope() as session:
        row = lifecycle.claim(session=session, job_id=job["id"], worker="w1")
        assert row is not None
        project = projects.find_project(session=session, id_or_name="alpha")
        usage.add(session, project_seq=project.seq, subject="ftjob-old", kind="device_seconds", amount=7200.0)
        session.commit()
    recorder = DatabaseRecorder(row, holder="w1")
    assert recorder.step(1, {"total_steps": 10, "trained_tokens": 10}) is None  # no quota yet
    set_quotas(client, operator, "alpha", device_hours_per_day=1.5)
    recorder.meter.checked = float("-inf")  # the budget is looked at every 10 s; now
    assert recorder.step(2, {"total_steps": 10, "trained_tokens": 20}) == "paused"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
    assert events[0]["message"].startswith("Paused: the project used 2.0"), events[0]
    assert "its quota of device_hours_per_day (1.5)" in events[0]["message"]


def test_inference_tokens_a_minute_are_a_quota_across_processes(client, auth, operator, monkeypatch) -> None:
    """Counted with the request's most (its prompt and max_tokens): no worker runs here, so each
    request that passes the quota gets the 503 after it, and still spent its tokens."""
    set_quotas(client, operator, "alpha", inference_tokens_per_minute=200)
    ask = {"model": "tiny-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 80}
    first = client.post("/v1/chat/completions", headers=auth, json=ask)
    assert first.status_code == 503, first.text  # past the quota: no inference worker here
    second = client.post("/v1/chat/completions", headers=auth, json=ask)
    assert second.status_code == 503, second.text
    err = assert_error(client.post("/v1/chat/completions", headers=auth, json=ask), 429, code="quota_exceeded")
    assert "inference_tokens_per_minute (200)" in err["message"]
    too_big = {**ask, "max_tokens": 500}
    assert_error(client.post("/v1/chat/completions", headers=auth, json=too_big), 400, param="max_tokens")


def test_usage_reads_as_asked(client, auth, operator, other_auth) -> None:
    from service.core.db import session_scope
    from service.tenancy import projects, usage

    with session_scope() as session:
        for name, amount in (("alpha", 3600.0), ("beta", 1800.0)):
            project = projects.get_or_create_project(session=session, name=name)
            usage.add(session, project_seq=project.seq, subject=f"ftjob-{name}", kind="device_seconds", amount=amount,
                      accelerator="h100")  # fmt: skip
        session.commit()
    mine = client.get("/v1/usage?group_by=accelerator", headers=auth).json()
    assert mine["data"] == [{"accelerator": "h100", "kind": "device_seconds", "amount": 3600.0, "device_hours": 1.0}]
    every = client.get("/v1/usage?group_by=project", headers=operator).json()["data"]
    assert {(u["project"], u["amount"]) for u in every} >= {
        (client.get("/v1/me", headers=auth).json()["project"]["id"], 3600.0),
        (client.get("/v1/me", headers=other_auth).json()["project"]["id"], 1800.0),
    }
    assert_error(client.get("/v1/usage?group_by=colour", headers=auth), 400, param="group_by")
    assert_error(client.get("/v1/usage?project_id=beta", headers=auth), 403)
    later = int(time.time()) + 7200
    assert client.get(f"/v1/usage?start_time={later}&end_time={later + 60}", headers=auth).json()["data"] == []


def test_the_cli_sets_quotas(client, env, operator) -> None:
    assert run_cli("projects", "create", "quota-cli", env=env).returncode == 0
    done = run_cli("projects", "quota", "quota-cli", "running_jobs=3", "device_hours_per_day=12.5", env=env)
    assert done.returncode == 0, done.stderr
    assert "running_jobs\t3" in done.stdout and "device_hours_per_day\t12.5" in done.stdout
    assert client.get("/v1/projects/quota-cli", headers=operator).json()["quotas"]["running_jobs"] == 3
    bad = run_cli("projects", "quota", "quota-cli", "gpus=lots", env=env)
    assert bad.returncode == 1 and "'gpus' must be a number" in bad.stderr
    assert run_cli("projects", "quota", "quota-cli", "running_jobs=", env=env).returncode == 0
    assert client.get("/v1/projects/quota-cli", headers=operator).json()["quotas"]["running_jobs"] is None


def test_tinker_training_models_count_as_running(client, auth, operator) -> None:
    """A project at its running_jobs quota gets a 429 for one more Tinker training model; a running
    job counts, and so does an active training model against the next job."""
    headers = {"X-API-Key": make_key("alpha")}
    set_quotas(client, operator, "alpha", running_jobs=1)

    def new_model(seq: int) -> Any:
        made = client.post(
            "/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}, headers=headers
        )
        body = {"session_id": made.json()["session_id"], "model_seq_id": seq, "base_model": "tiny-policy"}
        return client.post("/api/v1/create_model", json=body, headers=headers)

    assert new_model(0).status_code == 200
    refused = new_model(0)
    assert refused.status_code == 429 and "quota of running_jobs (1)" in refused.json()["error"]["message"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_on_sqlite_a_training_model_waits_for_a_claims_commit_and_sees_its_job(client, auth, operator) -> None:
    """A Tinker training model takes the project's lock before it counts the running jobs, as a claim
    does: a job claimed meanwhile on a worker is seen, and the model refused, not both let run."""
    import threading

    from sqlalchemy import update

    from service.core.db import session_scope
    from service.core.tables import Job

    headers = {"X-API-Key": make_key("alpha")}
    job = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))
    set_quotas(client, operator, "alpha", running_jobs=1)
    made = client.post(
        "/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}, headers=headers
    )
    body = {"session_id": made.json()["session_id"], "model_seq_id": 0, "base_model": "tiny-policy"}
    answers: list[Any] = []
    with session_scope() as worker:  # a worker's claim of the job, not yet committed
        worker.execute(update(Job).where(Job.id == job["id"]).values(status="running", worker="w1"))
        asking = threading.Thread(
            target=lambda: answers.append(client.post("/api/v1/create_model", json=body, headers=headers))
        )
        asking.start()
        asking.join(0.5)
        assert asking.is_alive()
        worker.commit()
    asking.join(30)
    assert answers[0].status_code == 429, answers[0].text


def test_times_past_any_clock_are_400s(client, auth) -> None:
    assert_error(client.get("/v1/usage?end_time=100000000000000000000", headers=auth), 400, param="end_time")
    assert_error(client.get("/v1/audit?since=100000000000000000000", headers=auth), 400, param="since")


def test_prices_give_costs_and_budgets_in_money(client, auth, operator, monkeypatch) -> None:
    """With the operator's prices, usage answers what device time cost; a job's budget and the
    project's day may be set in money; without prices either is a 400 that says why."""
    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.jobs import lifecycle
    from service.tenancy import projects, usage
    from worker.jobs.database_recorder import DatabaseRecorder

    training = upload_ok(client, auth)
    no_prices = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(training["id"], budget={"cost": 1}))
    assert_error(no_prices, 400, param="budget.cost", contains="RLOO_ACCELERATOR_PRICES")
    resp = client.post("/v1/projects/alpha", headers=operator, json={"quotas": {"cost_per_day": 5}})
    assert_error(resp, 400, param="quotas.cost_per_day")

    monkeypatch.setenv("RLOO_ACCELERATOR_PRICES", '{"h100": 3.0, "cpu": 0.5}')
    get_settings.cache_clear()
    with session_scope() as session:
        project = projects.get_or_create_project(session=session, name="alpha")
        usage.add(session, project_seq=project.seq, subject="ftjob-a", kind="device_seconds", amount=7200.0,
                  accelerator="h100")  # fmt: skip
        usage.add(session, project_seq=project.seq, subject="ftjob-b", kind="device_seconds", amount=3600.0,
                  accelerator="cpu")  # fmt: skip
        session.commit()
    (row,) = client.get("/v1/usage", headers=auth).json()["data"]
    assert row["device_hours"] == 3.0 and row["cost"] == pytest.approx(2 * 3.0 + 1 * 0.5)
    by_kind = {
        r["accelerator"]: r["cost"] for r in client.get("/v1/usage?group_by=accelerator", headers=auth).json()["data"]
    }
    assert by_kind == {"h100": 6.0, "cpu": 0.5}

    set_quotas(client, operator, "alpha", cost_per_day=6)  # 6.5 spent: new work waits
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(training["id"])), 429)
    assert "quota of cost_per_day (6)" in err["message"]
    set_quotas(client, operator, "alpha", cost_per_day=None)

    job = create_job(client, auth, job_body(training["id"], budget={"cost": 0.0001}))  # 0.72 cpu-seconds at 0.5
    with session_scope() as session:
        claimed = lifecycle.claim(session=session, job_id=job["id"], worker="w1")
    monkeypatch.setenv("RLOO_WORKER_ACCELERATOR", "cpu")
    recorder = DatabaseRecorder(claimed, holder="w1")
    recorder.meter.last -= 2.0
    assert recorder.step(1, {"total_steps": 10, "trained_tokens": 10}) == "paused"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
    assert "cost" in events[0]["message"] and "its budget (0.0001)" in events[0]["message"]

"""Supervised and DPO jobs over HTTP (OpenAI's three methods): created as OpenAI's clients create
them, refused with a 400 naming the line or field when the file or an option does not fit the
method, nothing stored then. Jobs go to a queue no worker consumes, so they stay ``queued``."""

from __future__ import annotations

import json
from typing import Any

from tests.helpers.api import assert_error, create_job, each, upload_ok
from tests.helpers.data import EXAMPLES, STRING_CHECK, TRAIN_JSONL, job_body

SFT_JSONL = (EXAMPLES / "supervised" / "train.jsonl").read_bytes()
DPO_JSONL = (EXAMPLES / "dpo" / "train.jsonl").read_bytes()


def body_of(method: str, training_file: str) -> dict[str, Any]:
    body = json.loads((EXAMPLES / method / "job.json").read_text())
    body.pop("validation_file")
    body["training_file"] = training_file
    return body


def test_no_method_is_a_supervised_job_with_openais_defaults(client, auth) -> None:
    f = upload_ok(client, auth, SFT_JSONL)
    job = create_job(client, auth, {"model": "tiny-policy", "training_file": f["id"]})
    assert job["method"]["type"] == "supervised"
    hp = job["method"]["supervised"]["hyperparameters"]
    assert hp == job["hyperparameters"]
    assert (hp["n_epochs"], hp["batch_size"], hp["learning_rate_multiplier"]) == (3, 8, 1.0)  # "auto", resolved
    assert "rloo_k" not in hp and "grader" not in job["method"]["supervised"]
    assert job["progress"]["total_steps"] == 18  # ceil(48 * 3 / 8)
    # The deprecated top-level hyperparameters of OpenAI's older examples mean the same.
    old = create_job(
        client, auth, {"model": "tiny-policy", "training_file": f["id"], "hyperparameters": {"n_epochs": 1}}
    )
    assert old["hyperparameters"]["n_epochs"] == 1 and old["method"]["type"] == "supervised"
    # Their errors name the field the user sent, and say that it is a supervised job's.
    body = {"model": "tiny-policy", "training_file": f["id"], "hyperparameters": {"rloo_k": 4}}
    err = assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=body), 400, param="hyperparameters.rloo_k"
    )
    assert "reinforcement jobs" in err["message"] and "supervised" in err["message"], err
    body["hyperparameters"] = [1]
    assert_error(client.post("/v1/fine_tuning/jobs", headers=auth, json=body), 400, param="hyperparameters")


def test_supervised_and_dpo_jobs_as_the_examples_make_them(client, auth) -> None:
    sft = create_job(client, auth, body_of("supervised", upload_ok(client, auth, SFT_JSONL)["id"]))
    assert sft["hyperparameters"]["learning_rate"] == 0.003 and sft["hyperparameters"]["packing"] is False
    dpo = create_job(client, auth, body_of("dpo", upload_ok(client, auth, DPO_JSONL)["id"]))
    assert dpo["method"]["type"] == "dpo" and dpo["hyperparameters"]["beta"] == 0.1
    bare = create_job(
        client, auth, {"model": "tiny-policy", "training_file": dpo["training_file"], "method": {"type": "dpo"}}
    )
    assert bare["hyperparameters"]["beta"] == 0.1 and bare["hyperparameters"]["n_epochs"] == 3


def test_what_does_not_fit_the_method_is_a_400_naming_it(client, auth) -> None:
    prompts = upload_ok(client, auth, TRAIN_JSONL)["id"]
    chats = upload_ok(client, auth, SFT_JSONL)["id"]
    pairs = upload_ok(client, auth, DPO_JSONL)["id"]
    mixed = upload_ok(client, auth, SFT_JSONL.splitlines(keepends=True)[0] + TRAIN_JSONL)["id"]

    def sft(training_file: str, **hp: Any) -> dict[str, Any]:
        body = body_of("supervised", training_file)
        body["method"]["supervised"]["hyperparameters"].update(hp)
        return body

    dpo_with_grader = body_of("dpo", pairs)
    dpo_with_grader["method"]["dpo"]["grader"] = STRING_CHECK
    cases = {
        "supervised_on_prompts": (sft(prompts), "training_file", ["Line 1", "assistant turns"]),
        "supervised_on_a_mixed_file": (sft(mixed), "training_file", "Line 2"),
        "dpo_on_chats": (body_of("dpo", chats), "training_file", ["Line 1", "preference pairs"]),
        "reinforcement_on_chats": (job_body(chats), "training_file", ["Line 1", "prompts"]),
        "rloo_k_on_supervised": (
            sft(chats, rloo_k=4),
            "method.supervised.hyperparameters.rloo_k",
            ["'rloo_k' is a hyperparameter of reinforcement", "supervised job does not take it"],
        ),
        "beta_on_supervised": (sft(chats, beta=0.2), "method.supervised.hyperparameters.beta", "dpo jobs"),
        "grader_on_dpo": (dpo_with_grader, "method.dpo.grader", "has no grader"),
        "max_length_past_the_context": (
            sft(chats, max_length=4096),
            "method.supervised.hyperparameters.max_length",
            ["4096", "256"],
        ),
        "max_new_tokens_past_the_context": (
            job_body(prompts, hp={"max_new_tokens": 20000}),
            "method.reinforcement.hyperparameters.max_new_tokens",
            ["20000", "256"],
        ),
        "eval_interval_0": (
            job_body(prompts, hp={"eval_interval": 0}),
            "method.reinforcement.hyperparameters.eval_interval",
            "at least 1",
        ),
    }
    before = client.get("/v1/fine_tuning/jobs?limit=100", headers=auth).json()["data"]

    def check(body: dict[str, Any], param: str, contains: Any) -> None:
        resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
        assert_error(resp, 400, param=param, contains=contains)

    each(cases, check)
    assert client.get("/v1/fine_tuning/jobs?limit=100", headers=auth).json()["data"] == before  # nothing stored


def test_openais_reinforcement_hyperparameters_are_accepted(client, auth) -> None:
    f = upload_ok(client, auth)
    body = job_body(f["id"], hp={"compute_multiplier": 2, "reasoning_effort": "high", "eval_samples": "auto"})
    job = create_job(client, auth, body)
    assert job["hyperparameters"]["rloo_k"] == 16 and job["hyperparameters"]["compute_multiplier"] == 2
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
    messages = " ".join(e["message"] for e in events)
    assert "reasoning_effort 'high'" in messages and "no effect" in messages and "rloo_k is 16" in messages
    plain = create_job(client, auth, job_body(f["id"], hp={"compute_multiplier": "auto"}))
    assert plain["hyperparameters"]["rloo_k"] == 8 and plain["hyperparameters"]["compute_multiplier"] == 1.0


def test_advantage_estimators_are_accepted_and_reinforce_alone_takes_one_completion(client, auth) -> None:
    f = upload_ok(client, auth)
    for name in ("rloo", "grpo", "reinforce", "reinforce_mean"):
        job = create_job(client, auth, job_body(f["id"], hp={"advantage_estimator": name}))
        assert job["hyperparameters"]["advantage_estimator"] == name
    one = create_job(client, auth, job_body(f["id"], hp={"advantage_estimator": "reinforce", "rloo_k": 1}))
    assert one["hyperparameters"]["rloo_k"] == 1
    # compute_multiplier keeps a group where the estimator needs one, and one completion for reinforce
    hp = {"rloo_k": 2, "compute_multiplier": 0.2}
    assert create_job(client, auth, job_body(f["id"], hp=hp))["hyperparameters"]["rloo_k"] == 2
    hp = {**hp, "advantage_estimator": "reinforce"}
    assert create_job(client, auth, job_body(f["id"], hp=hp))["hyperparameters"]["rloo_k"] == 1


def test_models_answers_for_names_that_are_no_fine_tuned_model(client, auth) -> None:
    """A base model cannot be deleted (403); a name that is neither is 404, on every verb; a model
    whose job did not succeed is none, and an id in an earlier release's form is not listed."""
    from service.core.db import session_scope
    from service.core.tables import Job
    from service.tenancy import projects

    assert_error(client.delete("/v1/models/tiny-policy", headers=auth), 403, code="model_not_deletable")
    for name in ("no-such-model", "ft:tiny-policy:p::ftjob-none"):
        assert_error(client.delete(f"/v1/models/{name}", headers=auth), 404, code="model_not_found")
        assert_error(client.get(f"/v1/models/{name}", headers=auth), 404, code="model_not_found")
    before = client.get("/v1/models", headers=auth).json()
    with session_scope() as session:
        seq = projects.get_or_create_project(session=session, name="alpha").seq  # the auth fixture's project
        for model, status in (
            ("ft:tiny-policy:alpha::ftjob-failed", "failed"),
            ("tiny-policy:old:ftjob-x", "succeeded"),
        ):
            session.add(
                Job(
                    project_seq=seq,
                    model="tiny-policy",
                    training_file="file-x",
                    seed=0,
                    method={"type": "supervised"},
                    hyperparameters={},
                    status=status,
                    total_steps=1,
                    fine_tuned_model=model,
                )
            )
        session.commit()
    listed = {m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]}
    assert listed == {m["id"] for m in before["data"]}  # neither the failed job's nor the old form
    assert_error(client.get("/v1/models/ft:tiny-policy:alpha::ftjob-failed", headers=auth), 404)

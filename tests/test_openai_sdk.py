"""The unmodified openai SDK drives the API: its calls succeed and its models parse our objects."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.data import EXAMPLES


@pytest.fixture
def sdk(client, auth) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    key = auth["Authorization"].removeprefix("Bearer ")
    # TestClient is an httpx.Client: the SDK's own request building and parsing, the app in-process.
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key=key,
        http_client=client,
        max_retries=0,
        _strict_response_validation=True,
    )


def test_sdk_files_and_jobs_round_trip(sdk: openai.OpenAI) -> None:
    data = (EXAMPLES / "demo" / "train.jsonl").read_bytes()
    f = sdk.files.create(file=("train.jsonl", data), purpose="fine-tune")
    assert f.id.startswith("file-") and f.bytes == len(data) and f.purpose == "fine-tune"
    assert [x.id for x in sdk.files.list()] == [f.id]
    assert sdk.files.retrieve(f.id).filename == "train.jsonl"
    assert sdk.files.content(f.id).read() == data

    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    job = sdk.fine_tuning.jobs.create(
        model=spec["model"], training_file=f.id, method=spec["method"], seed=3, suffix="demo", metadata={"team": "rl"}
    )
    assert job.id.startswith("ftjob-") and job.status == "queued" and job.seed == 3
    assert job.method.type == "reinforcement"
    assert job.method.reinforcement.grader.type == "text_similarity"
    assert job.metadata == {"team": "rl"}

    assert sdk.fine_tuning.jobs.retrieve(job.id).id == job.id
    assert [j.id for j in sdk.fine_tuning.jobs.list()] == [job.id]
    events = list(sdk.fine_tuning.jobs.list_events(job.id))
    assert events and all(e.object == "fine_tuning.job.event" for e in events)
    assert list(sdk.fine_tuning.jobs.checkpoints.list(job.id)) == []

    assert sdk.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    with pytest.raises(openai.ConflictError):
        sdk.fine_tuning.jobs.cancel(job.id)
    assert sdk.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(f.id)


def test_sdk_sees_openai_shaped_errors(sdk: openai.OpenAI) -> None:
    f = sdk.files.create(file=("train.jsonl", (EXAMPLES / "demo" / "train.jsonl").read_bytes()), purpose="fine-tune")
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    spec["method"]["reinforcement"]["hyperparameters"]["rloo_k"] = 1
    with pytest.raises(openai.BadRequestError) as err:
        sdk.fine_tuning.jobs.create(model=spec["model"], training_file=f.id, method=spec["method"])
    assert err.value.param == "method.reinforcement.hyperparameters.rloo_k"
    assert err.value.code == "invalid_value"
    # RLOO-only keys pass through the SDK's extra_body.
    spec["method"]["reinforcement"]["hyperparameters"]["rloo_k"] = 4
    job = sdk.fine_tuning.jobs.create(
        model=spec["model"], training_file=f.id, method=spec["method"], extra_body={"validation_file": f.id}
    )
    assert job.validation_file == f.id


def test_sdk_with_a_bad_key_gets_authentication_error(client) -> None:  # type: ignore[no-untyped-def]
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="rloo-nope", http_client=client, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.files.list()


def test_sdk_validates_and_runs_graders_in_strict_mode(sdk: openai.OpenAI, dry_runs) -> None:  # type: ignore[no-untyped-def]
    """graders.validate and graders.run parse in the SDK's strict mode, a score and an unscored
    sample alike (OpenAI's 0 with the flag saying why)."""
    grader = {
        "type": "string_check",
        "name": "exact",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
        "operation": "eq",
    }
    assert sdk.fine_tuning.alpha.graders.validate(grader=grader).grader.type == "string_check"  # type: ignore[arg-type]
    scored = sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="Paris", item={"answer": "Paris"})  # type: ignore[arg-type]
    assert scored.reward == 1.0 and scored.metadata.errors.invalid_variable_error is False
    assert scored.metadata.name == "exact" and scored.metadata.execution_time > 0
    unscored = sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="Paris", item={})  # type: ignore[arg-type]
    assert unscored.reward == 0.0 and unscored.metadata.errors.invalid_variable_error is True


def test_jobs_with_graders_openais_types_lack_parse_strictly(sdk: openai.OpenAI) -> None:
    """A reward_model grader, or a multi of several graders, in a job: the job and a page holding it
    parse in strict mode (the config under method.rloo); a multi of one grader stays OpenAI's."""
    data = (EXAMPLES / "demo" / "train.jsonl").read_bytes()
    f = sdk.files.create(file=("train.jsonl", data), purpose="fine-tune")
    check = {
        "type": "string_check",
        "name": "exact",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
        "operation": "eq",
    }
    rm = {"type": "reward_model", "name": "rm", "model": "tiny-reward"}
    ids = {}
    for label, grader in {
        "reward_model": rm,
        "multi_list": {"type": "multi", "name": "total", "graders": [check, rm], "calculate_output": "exact + rm"},
        "multi_one": {"type": "multi", "name": "total", "graders": check, "calculate_output": "exact"},
    }.items():
        job = sdk.fine_tuning.jobs.create(
            model="tiny-policy",
            training_file=f.id,
            method={"type": "reinforcement", "reinforcement": {"grader": grader}},
        )
        ids[label] = job.id
        retrieved = sdk.fine_tuning.jobs.retrieve(job.id)
        if label == "multi_one":
            assert retrieved.method.reinforcement.grader.graders.name == "exact"
        else:
            assert retrieved.method.reinforcement is None
            assert retrieved.method.model_extra["rloo"]["grader"] == grader
    assert {j.id for j in sdk.fine_tuning.jobs.list(limit=10)} == set(ids.values())

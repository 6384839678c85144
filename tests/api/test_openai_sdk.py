"""The unmodified openai SDK drives the API: its calls succeed and its models parse our objects."""

from __future__ import annotations

import json
import math

import openai
import pytest

from tests.helpers.data import EXAMPLES


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


def test_sdk_pages_every_list_in_strict_mode(sdk: openai.OpenAI) -> None:
    """The SDK's auto-paging (its ``after`` cursor) over files, jobs, events and models, one item a
    page: every item once, in the order one big page has."""
    data = (EXAMPLES / "demo" / "train.jsonl").read_bytes()
    files = [sdk.files.create(file=(f"t{i}.jsonl", data), purpose="fine-tune").id for i in range(3)]
    assert [f.id for f in sdk.files.list(limit=1)] == [f.id for f in sdk.files.list(limit=100).data]
    assert [f.id for f in sdk.files.list(limit=1, order="asc")] == files
    spec = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    jobs = [sdk.fine_tuning.jobs.create(model="tiny-policy", training_file=f, method=spec["method"]).id for f in files]
    assert [j.id for j in sdk.fine_tuning.jobs.list(limit=1)] == jobs[::-1]
    events = [e.id for e in sdk.fine_tuning.jobs.list_events(jobs[0], limit=1)]
    assert events and events == [e.id for e in sdk.fine_tuning.jobs.list_events(jobs[0], limit=100).data]
    assert "tiny-policy" in {m.id for m in sdk.models.list()}


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


CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}
SIMILAR = {k: v for k, v in CHECK.items() if k != "operation"}
HALF = {"type": "python", "name": "half", "source": "def grade(sample, item):\n    return 0.5\n"}
EVERY_GRADER = {
    # type: (grader, the reward of "Paris" for the item {"answer": "Paris"}, or None where the
    # model decides it)
    "string_check": (CHECK, 1.0),
    "text_similarity": ({**SIMILAR, "type": "text_similarity", "evaluation_metric": "fuzzy_match"}, 1.0),
    "cosine": ({**SIMILAR, "type": "text_similarity", "name": "cos", "evaluation_metric": "cosine"}, 1.0),
    "python": (HALF, 0.5),
    "score_model": (
        {
            "type": "score_model",
            "name": "judge",
            "model": "tiny-policy",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Rate {{ sample.output_text }}"}]}],
            "sampling_params": {"temperature": 1, "seed": 42, "max_completions_tokens": 4},
        },
        None,
    ),
    "label_model": (
        {
            "type": "label_model",
            "name": "verdict",
            "model": "tiny-policy",
            "input": [{"role": "user", "content": "Is {{ sample.output_text }} {{ item.answer }}?"}],
            "labels": ["yes", "no"],
            "passing_labels": ["yes", "no"],  # whichever it picks passes
        },
        1.0,
    ),
    "multi": ({"type": "multi", "name": "total", "graders": [CHECK, HALF], "calculate_output": "exact + half"}, 1.5),
    "multi_one": ({"type": "multi", "name": "total", "graders": CHECK, "calculate_output": "2 * exact"}, 2.0),
    "multi_label": (
        {
            "type": "multi",
            "name": "total",
            "graders": {
                "type": "label_model",
                "name": "verdict",
                "model": "tiny-policy",
                "input": [{"role": "user", "content": "Is {{ sample.output_text }} right?"}],
                "labels": ["yes", "no"],
                "passing_labels": ["yes", "no"],
            },
            "calculate_output": "verdict",
        },
        1.0,
    ),
    "reward_model": ({"type": "reward_model", "name": "rm", "model": "tiny-reward"}, None),
    "http": ({"type": "http", "name": "remote", "url": "(set below)"}, 0.25),
}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # dry runs touch no database: one is enough
@pytest.mark.parametrize("kind", list(EVERY_GRADER))
def test_sdk_validates_and_runs_every_grader_type_in_strict_mode(
    sdk: openai.OpenAI, dry_runs, monkeypatch, kind: str
) -> None:  # type: ignore[no-untyped-def]
    """Each grader type through graders.validate and graders.run on the real graders worker, parsed
    by the SDK in strict mode: OpenAI's types answer under ``grader``, ours under ``rloo.grader``."""
    from service.core.db import reset_caches
    from tests.helpers.scoring import Endpoint

    grader, reward = EVERY_GRADER[kind]
    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "1")
    endpoint = None
    if kind == "http":
        endpoint = Endpoint(
            lambda n, body: (200, {"scores": [0.25] * len(body["samples"])}), int(dry_runs["http_port"])
        )
        grader = {**grader, "url": endpoint.url}
        monkeypatch.setenv("RLOO_HTTP_GRADER_URLS", json.dumps([endpoint.url.removesuffix("score")]))
    reset_caches()
    try:
        validated = sdk.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
        ours = kind in ("reward_model", "http", "multi", "label_model")  # label_model: only inside a multi
        if ours:
            assert validated.grader is None and validated.model_extra["rloo"]["grader"]["type"] == grader["type"]
        else:
            assert validated.grader is not None and validated.grader.type == grader["type"]
        run = sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="Paris", item={"answer": "Paris"})  # type: ignore[arg-type]
    finally:
        if endpoint is not None:
            endpoint.close()
    assert run.metadata.name == grader["name"] and run.metadata.type == grader["type"]
    assert run.metadata.execution_time > 0
    errors = run.metadata.errors
    if reward is not None:
        assert run.reward == pytest.approx(reward, abs=1e-5), run
        assert not any(v for k, v in errors.model_dump().items() if isinstance(v, bool)), errors
    elif kind == "score_model":  # the untaught judge's answer is a number in range, or none (0, flagged)
        flagged = errors.api_model_grader_parse_error
        assert (run.reward == 0.0 and flagged) or (not flagged and 0.0 <= run.reward <= 1.0), run
        assert run.metadata.sampled_model_name == "tiny-policy"
    else:
        assert math.isfinite(run.reward) and run.sub_rewards == {"rm": run.reward}

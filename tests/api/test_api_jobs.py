"""Fine-tuning jobs (`/v1/fine_tuning/jobs`): every field of the job object, the hyperparameters'
defaults and ranges, every bad body a 400 naming its field, the state machine of pause and resume,
Idempotency-Key. Jobs go to a queue no worker consumes, so they stay `queued`.

Runs on SQLite, and on PostgreSQL when TEST_DATABASE_URL is set; every error is checked for its
exact status and OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.api import (
    assert_error,
    create_job,
    each,
    fresh_client,
    list_ids,
    stored_files,
    upload_ok,
)
from tests.helpers.data import JOB_JSON, STRING_CHECK, TRAIN_JSONL, TRAIN_LINES, job_body

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


RLOO_DEFAULTS = {
    "rloo_k": 4,
    "compute_multiplier": 1.0,
    "reasoning_effort": "default",
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
    "advantage_estimator": "rloo",
    "max_grad_norm": 1.0,
    "checkpoint_interval": 0,
    "eval_interval": "auto",
    "eval_samples": 32,
    # Beyond docs/algorithm.md's table: the schema's own extensions.
    "max_prompt_length": 512,
    "clip_epsilon_high": None,
    "weight_decay": 0.0,
    "lora": None,  # in docs/algorithm.md's table
    "reward_clip": None,
    "mask_truncated_completions": False,
    "drop_constant_groups": False,
    "sampler_correction": "auto",
    "sampler_correction_cap": 2.0,
    "stop": None,
    "gradient_accumulation_steps": 1,
    "lr_scheduler": "constant",
    "warmup_ratio": 0.0,
    "precision": "auto",
    "gradient_checkpointing": False,
    "keep_checkpoints": None,
    "sample_interval": 10,
    "sample_groups": 2,
}


# Jobs ----------------------------------------------------------------------------------------------
def test_create_job_returns_every_field(client, auth, env) -> None:
    from redis import Redis

    from service.core.settings import Settings

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
    """docs/algorithm.md's `lora`: null is full fine-tuning; an adapter spec is stored with its defaults filled in."""
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
        # A batch over the file's lines is accepted (as at OpenAI) and said: its steps repeat lines.
        events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
        said = [e["message"] for e in events if "more than the" in e["message"]]
        over = (
            isinstance(hp["batch_size"], int) and hp["batch_size"] > lines or hp["batch_size"] == "auto" and lines < 8
        )
        assert len(said) == int(over) and (not said or f"{lines} line(s)" in said[0]), (hp, said)

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
    job = create_job(client, auth, body)
    # OpenAI's types have no reward model: the config sits under method.rloo, type still reinforcement.
    assert job["method"]["type"] == "reinforcement" and "reinforcement" not in job["method"]
    assert job["method"]["rloo"]["grader"]["model"] == "tiny-reward"


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
    empty = {"object": "list", "data": [], "has_more": False}
    ids = {"first_id": None, "last_id": None}  # OpenAI's lists have them; the metrics series is ours
    for what, want in (("metrics", empty), ("checkpoints", {**empty, **ids})):
        resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}/{what}", headers=auth)
        assert resp.status_code == 200, resp.text
        assert resp.json() == want
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
    "rloo_k_0": (_hp(rloo_k=0), f"{HP}.rloo_k", None),
    "rloo_k_1": (_hp(rloo_k=1), f"{HP}.rloo_k", "'reinforce'"),
    "grpo_with_rloo_k_1": (_hp(advantage_estimator="grpo", rloo_k=1), f"{HP}.rloo_k", "no group"),
    "rloo_k_1_scaled_up": (_hp(rloo_k=1, compute_multiplier=1.5), f"{HP}.rloo_k", "no group"),
    "advantage_estimator_unknown": (
        _hp(advantage_estimator="ppo"),
        f"{HP}.advantage_estimator",
        "'rloo', 'grpo', 'reinforce' or 'reinforce_mean'",
    ),
    "rloo_k_string": (_hp(rloo_k="four"), f"{HP}.rloo_k", None),
    "misspelt_hyperparameter": (_hp(rloo_K=4), f"{HP}.rloo_K", "Did you mean 'rloo_k'?"),
    "misspelt_top_level_key": (_set(modle="tiny-policy"), "modle", "Did you mean 'model'?"),
    "batch_size_0": (_hp(batch_size=0), f"{HP}.batch_size", None),
    "n_epochs_0": (_hp(n_epochs=0), f"{HP}.n_epochs", None),
    "learning_rate_negative": (_hp(learning_rate=-1.0), f"{HP}.learning_rate", None),
    "learning_rate_multiplier_0": (_hp(learning_rate_multiplier=0), f"{HP}.learning_rate_multiplier", None),
    "kl_estimator_unknown": (_hp(kl_estimator="k2"), f"{HP}.kl_estimator", None),
    "loss_aggregation_unknown": (_hp(loss_aggregation="sum"), f"{HP}.loss_aggregation", "'constant'"),
    "sampler_correction_unknown": (_hp(sampler_correction="is"), f"{HP}.sampler_correction", "'tis'"),
    "sampler_correction_cap_0": (_hp(sampler_correction_cap=0), f"{HP}.sampler_correction_cap", "greater than 1"),
    "sampler_correction_cap_negative": (_hp(sampler_correction_cap=-2), f"{HP}.sampler_correction_cap", None),
    "drop_constant_groups_not_a_bool": (_hp(drop_constant_groups="sometimes"), f"{HP}.drop_constant_groups", None),
    "drop_constant_groups_of_one": (
        _hp(advantage_estimator="reinforce", rloo_k=1, drop_constant_groups=True),
        f"{HP}.drop_constant_groups",
        "nothing would train",
    ),
    "tis_under_a_nucleus": (_hp(sampler_correction="tis", top_p=0.9), f"{HP}.sampler_correction", "top_p"),
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
    "integrations": (_set(integrations=[{"type": "wandb"}]), "integrations.0.wandb", None),
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
    in-process speed (tests/hardening/test_rate_limit.py checks the limit)."""
    with fresh_client(monkeypatch, RLOO_RATE_LIMIT="0") as c:
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


def test_pause_and_resume_state_machine(client, auth) -> None:
    """Only a running job pauses; only a paused job whose worker has let go (or gone silent: no
    heartbeat for 3 periods) resumes; each change is an event; illegal changes are 409."""
    import time

    from service.core.db import session_scope
    from service.core.tables import Job

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


def test_an_unknown_model_says_what_there_is_or_how_to_build_the_examples(client, auth, monkeypatch, tmp_path) -> None:
    from service.core.db import reset_caches

    file_id = upload_ok(client, auth)["id"]
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(file_id, model="tiny-polcy"))
    assert_error(
        resp, 400, param="model", code="model_not_found", contains="Models available: tiny-policy, tiny-reward"
    )
    monkeypatch.setenv("RLOO_MODELS_DIR", str(tmp_path / "empty"))
    reset_caches()
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(file_id))
    err = assert_error(resp, 400, param="model", code="model_not_found", contains="python -m worker.tiny.models")
    assert str(tmp_path) not in err["message"]  # no path of the host


def test_checkpoint_metrics_leave_out_what_is_not_a_number() -> None:
    """OpenAI's schema types each checkpoint metric as a number: a key the method has no value for
    (null, as an earlier release stored) or a diverged loss's NaN is left out, not answered null."""
    import math

    from service.api.routes.jobs import checkpoint_object
    from service.core.tables import Checkpoint, Job

    job = Job(id="ftjob-x")
    metrics = {"train_loss": 0.5, "valid_loss": None, "full_valid_loss": math.nan, "train_mean_token_accuracy": 1}
    c = Checkpoint(id="ftckpt-x", step_number=3, fine_tuned_model_checkpoint="m", created_at=0, metrics=metrics)
    assert checkpoint_object(c, job)["metrics"] == {"step": 3, "train_loss": 0.5, "train_mean_token_accuracy": 1}

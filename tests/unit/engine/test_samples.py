"""What the reward looks like: every sample_interval steps (and the last) a few prompts with their k
completions, rewards and advantages are recorded, bounded in size, and served by
``GET /v1/fine_tuning/jobs/{id}/samples``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.api import assert_error, create_job, upload_ok
from tests.helpers.data import job_body
from tests.helpers.training import ListRecorder, config
from worker import rloo
from worker.engine.methods.rloo import train
from worker.engine.samples import MAX_CHARS, best_and_worst, is_sample_step, sample_groups


def test_sample_steps_are_every_interval_and_the_last() -> None:
    assert [s for s in range(1, 8) if is_sample_step(s, 7, 3)] == [3, 6, 7]
    assert not any(is_sample_step(s, 7, 0) for s in range(1, 8))


def test_groups_are_bounded_and_an_unscored_reward_is_null() -> None:
    rewards = torch.tensor([[1.0, float("nan")], [0.5, 0.25]])
    groups = sample_groups(["p" * 5000, "q"], ["a", "b", "c", "d"], rewards, torch.zeros(2, 2), groups=1)
    assert len(groups) == 1 and len(groups[0]["prompt"]) == MAX_CHARS and groups[0]["prompt"].endswith("…")
    assert [c["reward"] for c in groups[0]["completions"]] == [1.0, None]
    assert best_and_worst(groups) == [("best", groups[0]["completions"][0]), ("worst", groups[0]["completions"][0])]


@pytest.mark.parametrize(("estimator", "k"), [("rloo", 4), ("grpo", 4), ("reinforce_mean", 3), ("reinforce", 1)])
def test_a_run_records_its_completions_with_their_estimators_advantages(
    tmp_path: Path, models_dir: Path, estimator: str, k: int
) -> None:
    """Steps 2 and 3 of 3 (interval 2), every prompt of the batch: the recorded rewards average to
    the step's train_reward_mean, and each advantage is the job's estimator's (kl_coef 0): for RLOO,
    by hand, its reward minus the mean of the others'; plain REINFORCE trains on one completion a
    prompt."""
    rec = ListRecorder()
    cfg = config(
        tmp_path,
        models_dir,
        max_steps=3,
        rloo_k=k,
        batch_size=4,
        kl_coef=0.0,
        sample_interval=2,
        sample_groups=4,
        advantage_estimator=estimator,
    )
    train(cfg, rec)
    assert sorted(rec.samples_by_step) == [2, 3]
    for step, groups in rec.samples_by_step.items():
        assert len(groups) == 4 and all(len(g["completions"]) == k for g in groups)
        rewards = [c["reward"] for g in groups for c in g["completions"]]
        assert sum(rewards) / len(rewards) == pytest.approx(rec.steps[step - 1]["train_reward_mean"], abs=1e-5)
        table = torch.tensor([[c["reward"] for c in g["completions"]] for g in groups])
        expected = rloo.advantages(table, estimator)
        for b, g in enumerate(groups):
            r = [c["reward"] for c in g["completions"]]
            for i, c in enumerate(g["completions"]):
                assert c["advantage"] == pytest.approx(float(expected[b, i]), abs=1e-5)
                if estimator == "rloo":
                    others = [x for j, x in enumerate(r) if j != i]
                    assert c["advantage"] == pytest.approx(r[i] - sum(others) / len(others), abs=1e-5)
                if estimator == "reinforce":
                    assert c["advantage"] == pytest.approx(r[i], abs=1e-5)
            assert g["prompt"] and all(isinstance(c["text"], str) for c in g["completions"])


def test_the_api_serves_a_jobs_samples_page_by_page(client, auth, other_auth) -> None:  # type: ignore[no-untyped-def]
    from worker.jobs.tasks import run_job

    body = job_body(upload_ok(client, auth)["id"], hp={"max_steps": 3, "rloo_k": 2, "sample_interval": 1})
    job_id = create_job(client, auth, body)["id"]
    assert run_job(job_id) == "succeeded"
    url = f"/v1/fine_tuning/jobs/{job_id}/samples"
    page = client.get(url, headers=auth, params={"limit": 2}).json()
    assert [r["step"] for r in page["data"]] == [1, 2] and page["has_more"] is True
    rest = client.get(url, headers=auth, params={"after_step": 2}).json()
    assert [r["step"] for r in rest["data"]] == [3] and rest["has_more"] is False
    group = rest["data"][0]["groups"][0]
    assert len(group["completions"]) == 2 and {"text", "reward", "advantage"} <= set(group["completions"][0])
    assert json.dumps(rest)  # plain JSON, no NaN
    assert_error(client.get(url, headers=other_auth), 404)

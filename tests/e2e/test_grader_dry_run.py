"""Dry runs of model graders (POST /v1/fine_tuning/alpha/graders/run) go to a worker of the graders
queue, with real processes: the API, embedded Redis and a Celery worker started with
``rloo worker --queue <queue>-graders``; without that worker the API answers 504 in time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.live import LiveStack, live_stack

pytestmark = pytest.mark.e2e

REWARD_MODEL = {"type": "reward_model", "name": "rm", "model": "tiny-reward"}


@pytest.fixture
def live(tmp_path: Path, models_dir: Path) -> Iterator[LiveStack]:
    with live_stack("embedded", tmp_path, models_dir, env={"RLOO_GRADER_RUN_SECONDS": "60"}, worker=False) as s:
        yield s


def test_a_reward_model_dry_run_is_scored_by_a_graders_worker(live: LiveStack, models_dir: Path) -> None:
    from service import graders
    from worker.engine.rewards.scoring import RewardModels

    live.start("grader-worker", "worker", "--queue", "rloo-graders")
    body = {"grader": REWARD_MODEL, "model_sample": "The sky is blue.", "item": {}}
    t0 = time.monotonic()
    resp = live.http.post("/fine_tuning/alpha/graders/run", json=body, timeout=90)
    assert resp.status_code == 200, (resp.text, live.log_tail())
    got = resp.json()
    # The same model, here, on the same text (no prompt in a dry run: the completion alone).
    want = RewardModels(models_dir=models_dir, device=torch.device("cpu")).score(
        graders.parse_grader(REWARD_MODEL), [graders.Sample("The sky is blue.")], [{}], [""]
    )[0]
    assert got["reward"] == pytest.approx(want, abs=1e-5) and got["sub_rewards"] == {"rm": got["reward"]}
    assert got["metadata"]["type"] == "reward_model" and time.monotonic() - t0 < 90
    # A model that is not there: a clear 400 from the worker, not a 500 or a hang.
    bad = {**body, "grader": {**REWARD_MODEL, "model": "missing-model"}}
    resp = live.http.post("/fine_tuning/alpha/graders/run", json=bad, timeout=90)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_load_failed", resp.text
    assert "missing-model" in resp.text and str(models_dir) not in resp.text  # no path of the host


def test_without_a_graders_worker_the_dry_run_times_out_clearly(live: LiveStack) -> None:
    live.stop("api")
    live.env["RLOO_GRADER_RUN_SECONDS"] = "2"
    live.start("api", "api", "--port", str(live.port))
    live.wait_ready()
    t0 = time.monotonic()
    resp = live.http.post("/fine_tuning/alpha/graders/run", json={"grader": REWARD_MODEL, "model_sample": "x"})
    assert time.monotonic() - t0 < 10
    assert resp.status_code == 504, resp.text
    err = resp.json()["error"]
    assert err["code"] == "grader_timeout" and "rloo worker --queue rloo-graders" in err["message"]

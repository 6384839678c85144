"""The training loop in-process on tiny models: learning, reward models, KL, determinism, failures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.training import ANSWER, ListRecorder, config
from worker.engine.methods.rloo import JobError, train


def test_reward_rises_on_the_demo_task(tmp_path: Path, models_dir: Path) -> None:
    rec = ListRecorder()
    result = train(config(tmp_path, models_dir, max_steps=40), rec)
    rewards = [m["train_reward_mean"] for m in rec.steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert result.steps == 40 and len(rewards) == 40
    assert last > first + 0.08, (first, last)
    assert rec.checkpoints == [(40, tmp_path / "out" / "step-40", True)]


def test_same_seed_same_metrics(tmp_path: Path, models_dir: Path) -> None:
    keys = ("train_reward_mean", "kl", "loss", "grad_norm", "entropy")
    runs = []
    for i in range(2):
        rec = ListRecorder()
        train(config(tmp_path / str(i), models_dir, max_steps=3), rec)
        runs.append([[m[k] for k in keys] for m in rec.steps])
    assert runs[0] == runs[1]


def test_reward_model_grader_scores_in_batches(tmp_path: Path, models_dir: Path) -> None:
    grader = {
        "type": "multi",
        "name": "reward",
        "calculate_output": "answer + 0.1 * clip(rm, -1, 1)",
        "graders": {"answer": ANSWER, "rm": {"type": "reward_model", "name": "rm", "model": "tiny-reward"}},
    }
    rec = ListRecorder()
    train(config(tmp_path, models_dir, grader=grader, max_steps=2), rec)
    for m in rec.steps:
        assert math.isfinite(m["graders.rm.mean"]) and m["graders.rm.errors"] == 0
        assert math.isfinite(m["graders.answer.mean"])
        # The formula combines them: reward = answer + 0.1 * clip(rm) (means are linear).
        assert m["train_reward_mean"] == pytest.approx(
            m["graders.answer.mean"] + 0.1 * max(-1, min(1, m["graders.rm.mean"])), abs=1e-4
        )


def test_no_reference_model_without_kl(tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    copies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda obj, *a: copies.append(type(obj).__name__) or real_deepcopy(obj, *a))
    rec = ListRecorder()
    train(config(tmp_path, models_dir, kl_coef=0.0, max_steps=1), rec)
    assert not any("ForCausalLM" in name for name in copies)
    assert rec.steps[0]["kl"] == 0.0


def test_cancel_stops_between_steps_and_keeps_a_checkpoint(tmp_path: Path, models_dir: Path) -> None:
    rec = ListRecorder(stop_at=2)
    result = train(config(tmp_path, models_dir, max_steps=10), rec)
    assert result.stopped == "cancelled" and result.steps == 2 and len(rec.steps) == 2
    assert [(s, final) for s, _, final in rec.checkpoints] == [(2, False)]


def test_a_grader_that_never_scores_fails_with_a_clear_code(tmp_path: Path, models_dir: Path) -> None:
    grader = {"type": "multi", "name": "broken", "calculate_output": "answer / 0", "graders": {"answer": ANSWER}}
    with pytest.raises(JobError) as err:
        train(config(tmp_path, models_dir, grader=grader, max_steps=3), ListRecorder())
    assert err.value.code == "reward_not_finite"

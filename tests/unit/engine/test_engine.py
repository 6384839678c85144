"""Each engine option changes what it should and nothing else; checkpoints, resume and LoRA.

Runs the real training loop in-process on the tiny policy (CPU, fp32, seeded), a few steps each.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.data import EXAMPLES
from tests.helpers.training import ANSWER, LORA, TIMING, ListRecorder, config
from worker.engine import modeling
from worker.engine.checkpoints import TRAINING_INFO, TRAINING_STATE, latest_resumable
from worker.engine.errors import JobError
from worker.engine.methods import rloo_update
from worker.engine.methods.rloo import train


def run(
    tmp_path: Path,
    models_dir: Path,
    rec: ListRecorder | None = None,
    *,
    cfg: dict[str, Any] | None = None,
    grader: dict[str, Any] = ANSWER,
    **hp: Any,
) -> tuple[Any, ListRecorder]:
    rec = rec or ListRecorder()
    result = train(config(tmp_path, models_dir, grader, cfg=cfg, **hp), rec)
    return result, rec


def comparable(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in steps]


def series(rec: ListRecorder, key: str) -> list[Any]:
    return [m[key] for m in rec.steps]


def weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------- resume and determinism
RESUME_CASES = {
    "full": {
        "ppo_epochs": 2,
        "gradient_accumulation_steps": 2,
        "lr_scheduler": "cosine",
        "warmup_ratio": 0.2,
        "kl_estimator": "k3",
        "normalize_advantages": True,
    },
    "lora": {
        "lora": {**LORA, "dropout": 0.1},
        "learning_rate": 0.02,
        "lr_scheduler": "linear",
        "warmup_ratio": 0.2,
        "kl_in_reward": False,
        "kl_estimator": "k3",
    },
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_a_paused_and_resumed_run_equals_an_uninterrupted_one_step_for_step(tmp_path, models_dir, case):
    hp = {**RESUME_CASES[case], "max_steps": 6, "checkpoint_interval": 2}
    _, whole = run(tmp_path / "whole", models_dir, **hp)

    paused_result, first = run(tmp_path / "split", models_dir, ListRecorder(stop_at=3, stop_as="paused"), **hp)
    assert paused_result.stopped == "paused" and paused_result.steps == 3
    assert [(s, final) for s, _, final in first.checkpoints] == [(2, False), (3, False)]
    out = tmp_path / "split" / "out"
    assert latest_resumable(out) == out / "step-3"
    result, second = run(tmp_path / "split", models_dir, cfg={"resume_from": out / "step-3"}, **hp)

    assert result.resumed_from == 3 and [m["step"] for m in second.steps] == [4, 5, 6]
    assert comparable(first.steps + second.steps) == comparable(whole.steps)
    assert any("Resumed from the checkpoint at step 3" in e for e in second.events)
    final_a, final_b = weights(tmp_path / "whole" / "out" / "step-6"), weights(out / "step-6")
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_a_crashed_run_continues_from_an_interval_checkpoint(tmp_path, models_dir):
    """A worker that dies after step 3 leaves the step-2 checkpoint; steps 3.. replay exactly."""
    hp = {"max_steps": 5, "checkpoint_interval": 2, "lr_scheduler": "linear"}
    _, whole = run(tmp_path / "whole", models_dir, **hp)
    run(tmp_path / "crash", models_dir, ListRecorder(stop_at=3, stop_as="paused"), **hp)
    out = tmp_path / "crash" / "out"
    shutil.rmtree(out / "step-3")  # a crash after step 3 leaves no checkpoint of it
    _, replay = run(tmp_path / "crash", models_dir, cfg={"resume_from": out / "step-2"}, **hp)
    assert comparable(replay.steps) == comparable(whole.steps[2:])


def test_resume_refuses_a_changed_algorithm_but_allows_more_steps(tmp_path, models_dir):
    run(tmp_path, models_dir, ListRecorder(stop_at=2, stop_as="paused"), max_steps=4)
    ckpt = tmp_path / "out" / "step-2"

    def refused(*, cfg: dict[str, Any] | None = None, **hp: Any) -> str:
        with pytest.raises(JobError) as err:
            run(tmp_path, models_dir, cfg={"resume_from": ckpt, **(cfg or {})}, **hp)
        assert err.value.code == "resume_failed"
        return err.value.message

    assert "rloo_k" in refused(max_steps=4, rloo_k=4)
    assert "past this run's last step" in refused(max_steps=1)
    # A schedule that moves would bend mid-run if the run got longer; a constant one may grow.
    (tmp_path / "lin").mkdir()
    run(tmp_path / "lin", models_dir, ListRecorder(stop_at=2, stop_as="paused"), max_steps=4, lr_scheduler="linear")
    with pytest.raises(JobError, match="schedule"):
        run(
            tmp_path / "lin",
            models_dir,
            cfg={"resume_from": tmp_path / "lin" / "out" / "step-2"},
            max_steps=5,
            lr_scheduler="linear",
        )
    result, rec = run(tmp_path, models_dir, cfg={"resume_from": ckpt}, max_steps=5)
    assert [m["step"] for m in rec.steps] == [3, 4, 5] and result.stopped is None
    # The run's directory now holds steps past 2: resuming from step 2 again would mix two futures.
    assert "past step 2" in refused(max_steps=5)


def test_the_base_models_dropout_is_off_so_the_update_sees_the_sampling_policy(tmp_path, models_dir):
    noisy = tmp_path / "models" / "tiny-policy"
    shutil.copytree(models_dir / "tiny-policy", noisy)
    config_json = json.loads((noisy / "config.json").read_text())
    (noisy / "config.json").write_text(json.dumps({**config_json, "attention_dropout": 0.5}))
    _, rec = run(tmp_path, tmp_path / "models", max_steps=1, kl_estimator="k1")
    # Policy and reference are the same weights at step 1: dropout would make the KL ~0.1 here. Not
    # bit-equal: the frozen copy and the trainable policy may take different CPU matmul kernels.
    assert abs(rec.steps[0]["kl"]) < 1e-6


def test_same_seed_same_metrics_with_lora_dropout_and_accumulation(tmp_path, models_dir):
    hp = {"max_steps": 3, "lora": {**LORA, "dropout": 0.2}, "learning_rate": 0.02, "gradient_accumulation_steps": 4}
    a, b = run(tmp_path / "a", models_dir, **hp)[1], run(tmp_path / "b", models_dir, **hp)[1]
    assert comparable(a.steps) == comparable(b.steps)
    c = run(tmp_path / "c", models_dir, **{**hp, "lora": {**LORA, "dropout": 0.3}})[1]
    assert comparable(c.steps) != comparable(a.steps)  # dropout is live: the comparison can fail


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_holds_the_model_and_the_training_state(tmp_path, models_dir):
    from transformers import AutoModelForCausalLM

    _, rec = run(tmp_path, models_dir, max_steps=3, checkpoint_interval=2)
    assert [(s, final) for s, _, final in rec.checkpoints] == [(2, False), (3, True)]
    ckpt = tmp_path / "out" / "step-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", TRAINING_STATE, TRAINING_INFO} <= names
    info = json.loads((ckpt / TRAINING_INFO).read_text())
    # 48 training lines, 8 a step: after 2 steps the next prompt is the 16th of epoch 0.
    assert info["step"] == 2 and info["data_position"] == {"epoch": 0, "offset": 16, "n_items": 48}
    state = torch.load(ckpt / TRAINING_STATE, weights_only=True)
    assert set(state) == {"optimizer", "scheduler", "rng"} and state["optimizer"]["state"]
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert next(model.parameters()).dtype == torch.float32
    assert not any(name.startswith(".tmp") for name in (p.name for p in (tmp_path / "out").iterdir()))


def test_keep_checkpoints_keeps_the_newest_and_always_the_final(tmp_path, models_dir):
    _, rec = run(tmp_path, models_dir, max_steps=5, checkpoint_interval=1, keep_checkpoints=2)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-4", "step-5"]
    assert rec.removed == [1, 2, 3]
    _, rec = run(tmp_path / "one", models_dir, max_steps=3, checkpoint_interval=1, keep_checkpoints=1)
    assert sorted(p.name for p in (tmp_path / "one" / "out").iterdir()) == ["step-3"]
    assert rec.checkpoints[-1][0] == 3 and rec.checkpoints[-1][2] is True


# ---------------------------------------------------------------- LoRA
def test_lora_checkpoint_is_an_adapter_that_peft_loads(tmp_path, models_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run(tmp_path, models_dir, max_steps=2, lora=LORA, learning_rate=0.02)
    ckpt = tmp_path / "out" / "step-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    base = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy")
    tuned = PeftModel.from_pretrained(base, ckpt)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        moved = tuned(ids).logits
        with tuned.disable_adapter():
            plain = tuned(ids).logits
    assert not torch.allclose(moved, plain)  # the adapter was trained


def test_lora_reference_is_the_base_with_the_adapter_disabled(tmp_path, models_dir, monkeypatch):
    import copy

    copies: list[str] = []
    real = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda obj, *a: copies.append(type(obj).__name__) or real(obj, *a))
    _, rec = run(tmp_path, models_dir, max_steps=4, lora=LORA, learning_rate=0.02, kl_coef=0.1)
    assert not any("ForCausalLM" in name for name in copies), copies  # never a second model
    assert rec.steps[0]["kl"] == 0.0 and rec.steps[-1]["kl"] != 0.0  # the policy moved away from its base


def test_lora_on_modules_the_model_lacks_fails_clearly(tmp_path, models_dir):
    with pytest.raises(JobError) as err:
        run(tmp_path, models_dir, max_steps=1, lora={**LORA, "target_modules": ["no_such_proj"]})
    assert err.value.code == "invalid_lora" and "target_modules" in err.value.message


# ---------------------------------------------------------------- update options
def test_one_pass_spends_no_forward_on_old_logprobs_and_its_ratio_is_exactly_one(tmp_path, models_dir, monkeypatch):
    calls: list[bool] = []
    real = rloo_update.completion_logprobs

    def spy(model: Any, *a: Any, **kw: Any) -> Any:
        calls.append(model.training)  # the policy runs in train mode, the frozen reference in eval mode
        return real(model, *a, **kw)

    monkeypatch.setattr(rloo_update, "completion_logprobs", spy)  # the policy's passes
    monkeypatch.setattr(modeling, "completion_logprobs", spy)  # the reference's
    _, one = run(tmp_path / "one", models_dir, max_steps=2, clip_epsilon=1e-6)
    assert calls.count(True) == 2 and calls.count(False) == 2  # one policy and one reference forward a step
    assert series(one, "ratio_clip_frac") == [0.0, 0.0]  # even a 1e-6 clip never bites: the ratio is exactly 1
    assert series(one, "clip_frac") == series(one, "ratio_clip_frac")  # the old name, kept for one release
    calls.clear()
    _, three = run(
        tmp_path / "three", models_dir, max_steps=2, clip_epsilon=1e-6, ppo_epochs=3, gradient_accumulation_steps=2
    )
    assert calls.count(True) == 2 * 3 * 2  # steps x passes x micro-batches
    assert all(c > 0 for c in series(three, "ratio_clip_frac"))  # later passes move the ratio off 1
    calls.clear()
    run(tmp_path / "pre", models_dir, max_steps=1, gradient_accumulation_steps=2, normalize_advantages=True)
    assert calls.count(True) == 2 + 2  # whitening a KL-shaped reward over micro-batches needs one no-grad pass


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"normalize_advantages": True},
        {"kl_in_reward": False, "kl_estimator": "k3"},
        {"loss_aggregation": "token_mean", "mask_truncated_completions": True},
        {"loss_aggregation": "constant", "drop_constant_groups": True},
    ],
)
def test_gradient_accumulation_gives_the_same_update(tmp_path, models_dir, extra):
    keys = ("train_reward_mean", "loss", "grad_norm", "kl", "advantage_std", "entropy")
    _, whole = run(tmp_path / "a", models_dir, max_steps=3, **extra)
    _, split = run(tmp_path / "b", models_dir, max_steps=3, gradient_accumulation_steps=4, **extra)
    for key in keys:
        assert series(split, key) == pytest.approx(series(whole, key), rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("aggregation", ["sequence_sum", "constant"])
def test_drop_constant_groups_leaves_them_out_of_the_normaliser(tmp_path, models_dir, aggregation):
    """Constant groups' RLOO advantages are 0 already: dropping them only divides the loss by the
    informative completions, so the first step's gradient grows by 1 / (1 - constant_groups_frac)."""
    # One new token: a similarity of few values, so that some pairs score alike and some not.
    kw = {"max_steps": 1, "kl_coef": 0.0, "rloo_k": 2, "max_new_tokens": 1, "loss_aggregation": aggregation}
    _, kept = run(tmp_path / "kept", models_dir, **kw)
    _, dropped = run(tmp_path / "dropped", models_dir, drop_constant_groups=True, **kw)
    frac = kept.steps[0]["constant_groups_frac"]
    assert frac == dropped.steps[0]["constant_groups_frac"] == kept.steps[0]["frac_reward_zero_std"]
    assert 0 < frac < 1, frac  # (this seed's rewards: some groups constant, some not)
    assert dropped.steps[0]["grad_norm"] == pytest.approx(kept.steps[0]["grad_norm"] / (1 - frac), rel=1e-5)


def test_kl_as_a_loss_term_leaves_the_advantages_alone(tmp_path, models_dir):
    """k3's gradient is 0 where policy == reference, so step 1 updates alike and step 2 samples alike."""
    _, plain = run(tmp_path / "plain", models_dir, max_steps=2, kl_coef=0.0)
    _, term = run(tmp_path / "term", models_dir, max_steps=2, kl_coef=0.5, kl_in_reward=False, kl_estimator="k3")
    _, folded = run(tmp_path / "fold", models_dir, max_steps=2, kl_coef=0.5, kl_in_reward=True, kl_estimator="k3")
    assert term.steps[1]["train_reward_mean"] == pytest.approx(plain.steps[1]["train_reward_mean"])
    assert term.steps[1]["advantage_std"] == pytest.approx(plain.steps[1]["advantage_std"], rel=1e-5)
    assert term.steps[1]["kl"] > 0 and term.steps[1]["loss"] > plain.steps[1]["loss"]  # k3 >= 0 adds to the loss
    assert folded.steps[1]["advantage_std"] != pytest.approx(plain.steps[1]["advantage_std"], rel=1e-5)


def test_k3_is_never_negative_and_differs_from_k1(tmp_path, models_dir):
    _, k1 = run(tmp_path / "k1", models_dir, max_steps=4, kl_coef=0.1, kl_estimator="k1")
    _, k3 = run(tmp_path / "k3", models_dir, max_steps=4, kl_coef=0.1, kl_estimator="k3")
    assert all(v >= 0 for v in series(k3, "kl")) and series(k3, "kl")[1:] != series(k1, "kl")[1:]


def test_normalize_advantages_whitens_and_reward_clip_bounds_them(tmp_path, models_dir):
    _, raw = run(tmp_path / "raw", models_dir, max_steps=2, kl_coef=0.0)
    _, white = run(tmp_path / "white", models_dir, max_steps=2, kl_coef=0.0, normalize_advantages=True)
    assert white.steps[0]["advantage_std"] == pytest.approx(1.0, abs=0.02)
    assert raw.steps[0]["advantage_std"] < 0.5
    _, clipped = run(tmp_path / "clip", models_dir, max_steps=2, kl_coef=0.0, reward_clip=0.01)
    # |A| <= 2 * clip when every reward is in [-clip, clip]; the reported reward stays the grader's.
    assert all(0 < v <= 0.02 for v in series(clipped, "advantage_std"))
    assert clipped.steps[0]["train_reward_mean"] == raw.steps[0]["train_reward_mean"]


def test_mask_truncated_completions_takes_their_gradient_away(tmp_path, models_dir):
    # One new token: nearly every completion is cut at max_new_tokens.
    _, kept = run(tmp_path / "kept", models_dir, max_steps=1, max_new_tokens=1, kl_coef=0.0)
    _, masked = run(
        tmp_path / "masked",
        models_dir,
        max_steps=1,
        max_new_tokens=1,
        kl_coef=0.0,
        mask_truncated_completions=True,
        weight_decay=0.1,
    )
    assert masked.steps[0]["clipped_ratio"] == 1.0 == kept.steps[0]["clipped_ratio"]
    assert kept.steps[0]["grad_norm"] > 0 and masked.steps[0]["grad_norm"] == 0.0 and masked.steps[0]["loss"] == 0.0
    # No token carried loss, so the optimizer did not step: not even weight decay moved the weights.
    start = weights(models_dir / "tiny-policy")
    after = weights(tmp_path / "masked" / "out" / "step-1")
    assert all(torch.equal(start[k], after[k]) for k in start)


def test_max_grad_norm_bounds_the_applied_gradient(tmp_path, models_dir, monkeypatch):
    seen: list[float] = []

    class Spy(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Spy)
    _, rec = run(tmp_path, models_dir, max_steps=2, max_grad_norm=0.01)
    assert all(g > 0.01 for g in series(rec, "grad_norm"))  # the metric is the norm before clipping
    assert all(s == pytest.approx(0.01, rel=1e-3) for s in seen)


def test_weight_decay_reaches_the_weights(tmp_path, models_dir):
    run(tmp_path / "a", models_dir, max_steps=1, kl_coef=0.0)
    run(tmp_path / "b", models_dir, max_steps=1, kl_coef=0.0, weight_decay=0.5)
    a, b = weights(tmp_path / "a" / "out" / "step-1"), weights(tmp_path / "b" / "out" / "step-1")
    # AdamW's decoupled decay: w <- w - lr * wd * w, on top of the same Adam step.
    norm_a = sum(float(t.norm()) for t in a.values())
    norm_b = sum(float(t.norm()) for t in b.values())
    assert norm_b < norm_a


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # 8 steps, warmup_ratio 0.25 -> 2 warmup steps (HF schedules: step s uses lr * f(s), s from 0).
        ("constant", [0.0, 0.5, 1, 1, 1, 1, 1, 1]),
        ("linear", [0.0, 0.5, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
        ("cosine", [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * (s - 2) / 6)) for s in range(2, 8)]),
    ],
)
def test_lr_scheduler_with_warmup(tmp_path, models_dir, name, expected):
    _, rec = run(
        tmp_path, models_dir, max_steps=8, learning_rate=0.01, lr_scheduler=name, warmup_ratio=0.25, max_new_tokens=2
    )
    assert series(rec, "learning_rate") == pytest.approx([0.01 * e for e in expected])


def test_precision(tmp_path, models_dir):
    _, fp32 = run(tmp_path / "fp32", models_dir, max_steps=2, precision="fp32")
    _, auto = run(tmp_path / "auto", models_dir, max_steps=2, precision="auto")
    _, bf16 = run(tmp_path / "bf16", models_dir, max_steps=2, precision="bf16")
    assert comparable(auto.steps) == comparable(fp32.steps)  # auto is fp32 on the CPU
    assert all(math.isfinite(v) for v in series(bf16, "loss") + series(bf16, "grad_norm"))
    assert series(bf16, "loss") != series(fp32, "loss")  # autocast really ran in bf16
    assert all(t.dtype == torch.float32 for t in weights(tmp_path / "bf16" / "out" / "step-2").values())


def test_gradient_checkpointing_recomputes_and_changes_no_number(tmp_path, models_dir, monkeypatch):
    from transformers.models.llama import modeling_llama

    recomputed = []
    # Counted inside the layer (the layer's own forward is what transformers wraps for checkpointing),
    # when it runs during a backward pass: that is a recomputation.
    real = modeling_llama.LlamaMLP.forward

    def counting(self, *a, **kw):
        if torch._C._current_graph_task_id() != -1:
            recomputed.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", counting)
    _, plain = run(tmp_path / "plain", models_dir, max_steps=2)
    assert recomputed == []
    _, gc = run(tmp_path / "gc", models_dir, max_steps=2, gradient_checkpointing=True)
    # The backward recomputes each of the 2 layers once for the 1 update forward of each of 2 steps.
    assert len(recomputed) == 2 * 2
    # Equal to rounding: the recomputed forward may reduce in another order (transformers 5.24 on the
    # CPU: 2e-5 relative on step 2's grad norm); a wrong recomputation is off by orders more.
    for key in ("loss", "grad_norm", "kl", "train_reward_mean"):
        assert series(gc, key) == pytest.approx(series(plain, key), rel=1e-4, abs=1e-7)


# ---------------------------------------------------------------- rollouts and validation
def test_stop_strings_end_completions(tmp_path, models_dir):
    from transformers import AutoTokenizer

    from worker.engine.rollout.base import cut_at_stop

    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    ids = torch.tensor([tok.encode("blue sky. red", add_special_tokens=False)])
    mask = torch.ones_like(ids)
    truncated = torch.tensor([True])
    texts = cut_at_stop(ids, mask, truncated, ["blue sky. red"], tok, [". ", "zzz"])
    assert texts == ["blue sky"] and not truncated[0]
    kept = int(mask.sum())
    # The kept tokens are the fewest whose text holds the stop string.
    assert ". " in tok.decode(ids[0, :kept]) and ". " not in tok.decode(ids[0, : kept - 1])
    assert mask[0, kept:].sum() == 0

    _, free = run(tmp_path / "free", models_dir, max_steps=2, max_new_tokens=8, kl_coef=0.0)
    _, stopped = run(tmp_path / "stop", models_dir, max_steps=2, max_new_tokens=8, kl_coef=0.0, stop=[" "])
    assert stopped.steps[0]["completion_length_mean"] < free.steps[0]["completion_length_mean"]
    assert stopped.steps[0]["clipped_ratio"] < free.steps[0]["clipped_ratio"]


def test_validation_scores_on_its_steps_and_leaves_training_unchanged(tmp_path, models_dir):
    valid = {"validation_file": EXAMPLES / "demo" / "valid.jsonl"}
    _, plain = run(tmp_path / "plain", models_dir, max_steps=5)
    _, rec = run(
        tmp_path / "eval", models_dir, cfg=valid, max_steps=5, eval_interval=2, eval_samples=8, checkpoint_interval=2
    )
    assert [m["step"] for m in rec.steps if "valid_reward_mean" in m] == [2, 4, 5]  # and the last step
    assert all(0 <= m["valid_reward_mean"] <= 1 for m in rec.steps if "valid_reward_mean" in m)
    assert comparable([{k: v for k, v in m.items() if k != "valid_reward_mean"} for m in rec.steps]) == comparable(
        plain.steps
    )  # the eval passes draw no random numbers from the run
    assert rec.checkpoint_metrics[2]["valid_reward_mean"] == rec.steps[1]["valid_reward_mean"]
    assert rec.checkpoint_metrics[5]["valid_reward_mean"] == rec.steps[4]["valid_reward_mean"]


# ---------------------------------------------------------------- learning
def test_lora_learns_the_demo_task(tmp_path, models_dir):
    _, rec = run(tmp_path, models_dir, max_steps=40, lora=LORA, learning_rate=0.02)
    rewards = series(rec, "train_reward_mean")
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.08, (first, last)


def test_a_runs_counters_read_alike_from_checkpoints_of_before_and_after_they_were_typed() -> None:
    """``RunCounters`` saves the keys the string-keyed dict had; a checkpoint written before (with
    only the keys set, and ``first_reward`` before every method had a headline) restores the same."""
    from worker.engine.state import RunCounters

    old = {"trained_tokens": 120, "first_reward": 0.25, "valid_reward_mean": 0.5, "reported_grader_errors": ["g"]}
    counters = RunCounters.restored(old)
    assert (counters.trained_tokens, counters.first, counters.valid_reward_mean) == (120, 0.25, 0.5)
    assert counters.reported_grader_errors == ["g"] and counters.valid_loss is None
    saved = counters.saved()
    assert {"trained_tokens", "first", "valid_reward_mean", "reported_grader_errors"} <= set(saved)
    assert RunCounters.restored(saved) == counters  # a round trip through a checkpoint
    counters.record_valid({"valid_loss": 1.5, "full_valid_loss": 1.25})
    assert (counters.valid_loss, counters.full_valid_loss) == (1.5, 1.25)
    with pytest.raises(KeyError, match="train_loss"):
        counters.record_valid({"train_loss": 2.0})

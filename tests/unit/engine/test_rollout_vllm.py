"""The rollout backend choice and the vLLM backend's wiring, driven by a stand-in ``vllm`` module
(tests/fakes/vllm: vLLM needs a GPU). What vLLM itself samples is vLLM's business; what is tested
here is ours: the rollout layout, EOS and stop handling, the truncation flags, and that the engine
gets the policy's weights after every update (LoRA merged)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.data import FAKES
from tests.helpers.training import load_policy
from worker.engine.config import OperatorOptions
from worker.engine.methods.rloo import train
from worker.engine.rollout.backends import make_backend
from worker.engine.rollout.base import Sampling
from worker.engine.rollout.transformers_backend import TransformersBackend

PROMPTS = ["What color is the sky?", "Grass?", "What color is a ripe banana, usually, at noon?"]
SAMPLING = Sampling(max_new_tokens=24, temperature=1.0, top_p=1.0, max_prompt_length=64)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    import vllm

    vllm.LLM.instances.clear()
    yield vllm
    sys.modules.pop("vllm", None)


@pytest.fixture(scope="module")
def policy(models_dir: Path) -> tuple[Any, Any]:
    return load_policy(models_dir)


def test_auto_samples_with_transformers_without_a_gpu_even_where_vllm_is_installed(fake_vllm, policy) -> None:
    model, tok = policy
    backend = make_backend("auto", model, tok, SAMPLING, device=torch.device("cpu"))
    assert isinstance(backend, TransformersBackend) and backend.name == "transformers"
    assert fake_vllm.LLM.instances == []
    with pytest.raises(ValueError, match="unknown rollout backend 'sglang'"):
        make_backend("sglang", model, tok, SAMPLING, device=torch.device("cpu"))


def test_vllm_rollout_layout_eos_and_truncation(fake_vllm, policy) -> None:
    model, tok = policy
    backend = make_backend("vllm", model, tok, SAMPLING, device=torch.device("cpu"))
    assert backend.name == "vllm"
    # Chat-rendered, as jobs send them: the tiny policy answers, then ends with its EOS.
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in PROMPTS
    ]
    ro = backend.generate(prompts, k=8, generator_seed=2)  # a seed where some rows end
    llm = fake_vllm.LLM.instances[-1]
    assert len(llm.runner.pushes) == 1  # the policy's weights went in before the first sample
    n = len(PROMPTS) * 8
    assert ro.group == 8 and ro.completion_ids.shape[0] == n == len(ro.texts) == ro.prompt_ids.shape[0]
    eos = set(backend.eos_ids)
    for b, prompt in enumerate(prompts):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for row in range(b * 8, b * 8 + 8):
            real = ro.prompt_mask[row].bool()
            assert ro.prompt_ids[row][real].tolist() == ids and not real[: -len(ids)].any()  # left-padded
    lengths = ro.completion_mask.sum(dim=1).tolist()
    ended = 0
    for row, length in enumerate(lengths):
        tokens = ro.completion_ids[row, :length].tolist()
        assert (ro.completion_ids[row, length:] == tok.pad_token_id).all()
        if ro.truncated[row]:
            assert length == SAMPLING.max_new_tokens and not eos & set(tokens)
        else:
            ended += 1
            assert tokens[-1] in eos  # the engine left the EOS out; the backend put it back: it carries loss
            assert ro.texts[row] == tok.decode(tokens[:-1], skip_special_tokens=True)
    assert 0 < ended < n  # some rows end, some run out (the checks above can fail)


def test_a_job_on_vllm_pushes_the_updated_policy_every_step(fake_vllm, tmp_path, models_dir) -> None:
    from tests.helpers.training import ListRecorder, config

    rec = ListRecorder()
    operator = OperatorOptions(rollout_backend="vllm", vllm_options={"sleep_mode": True})
    train(config(tmp_path, models_dir, max_steps=3, cfg={"operator": operator}), rec)
    assert len(rec.steps) == 3
    pushes = fake_vllm.LLM.instances[-1].runner.pushes
    assert len(pushes) == 3  # before each step's rollouts, none after the last update
    checksums = [p["checksum"] for p in pushes]
    assert len(set(checksums)) == 3  # each push carried weights the update had changed
    assert all(p["unexpected"] == [] for p in pushes)
    # Asleep through every update: woken (weights, then the KV cache) for each step's rollouts only.
    assert fake_vllm.LLM.instances[-1].sleeps == 3 and fake_vllm.LLM.instances[-1].options["enable_sleep_mode"]


def test_a_lora_job_on_vllm_pushes_merged_weights_under_the_base_names(fake_vllm, tmp_path, models_dir) -> None:
    from tests.helpers.training import LORA, ListRecorder, config

    train(
        config(
            tmp_path,
            models_dir,
            max_steps=2,
            learning_rate=0.05,
            lora=LORA,
            cfg={"operator": OperatorOptions(rollout_backend="vllm")},
        ),
        ListRecorder(),
    )
    pushes = fake_vllm.LLM.instances[-1].runner.pushes
    assert len(pushes) == 2
    base_names = set(fake_vllm.LLM.instances[-1].hf.state_dict())
    for p in pushes:
        assert p["unexpected"] == [] and set(p["names"]) <= base_names
        assert not any("lora_" in name for name in p["names"])
    assert pushes[0]["checksum"] != pushes[1]["checksum"]  # the merged adapter moved the weights


def test_a_job_with_tools_on_vllm_gives_it_the_trajectory_budget_and_token_contexts(
    fake_vllm, tmp_path, models_dir
) -> None:
    """Multi-turn rollouts on vLLM: the engine is built for a trajectory's budget (not one turn's),
    and the steps run with the tool metrics."""
    from service.tools import parse_tools
    from tests.helpers.training import ListRecorder, config

    toolset = parse_tools(
        [{"type": "function", "name": "calculator", "runtime": {"type": "builtin"}}],
        {"max_turns": 2, "max_trajectory_tokens": 200},
        param="method.reinforcement",
        allowed_urls=[],
    )
    rec = ListRecorder()
    operator = OperatorOptions(rollout_backend="vllm")
    train(config(tmp_path, models_dir, max_steps=2, cfg={"operator": operator, "tools": toolset}), rec)
    assert len(rec.steps) == 2 and "tool_turns_mean" in rec.steps[-1]
    assert fake_vllm.LLM.instances[-1].options["max_model_len"] == 200


def test_vllm_continues_token_contexts_within_the_room_given(fake_vllm, policy) -> None:
    model, tok = policy
    backend = make_backend("vllm", model, tok, SAMPLING, device=torch.device("cpu"))
    contexts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ro = backend.generate_ids(contexts, generator_seed=5, rows=[7, 3, 9], max_new_tokens=5)
    assert ro.completion_ids.shape[0] == 3 and ro.completion_ids.shape[1] <= 5 + 1  # (an EOS may be added)
    assert int(ro.completion_mask.sum(dim=1).max()) <= 6
    for i, context in enumerate(contexts):  # each prompt as given, left-padded
        assert ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist() == context
    again = backend.generate_ids(contexts, generator_seed=5, rows=[7, 3, 9], max_new_tokens=5)
    assert torch.equal(ro.completion_ids, again.completion_ids)  # each row seeded by its own place


def test_a_job_on_vllm_measures_the_mismatch_and_names_a_sampler_left_behind(
    fake_vllm, monkeypatch, tmp_path, models_dir
) -> None:
    """vLLM's log-probs of what it sampled come back; with its weights synced, trainer and sampler
    differ by rounding only. A sync that never reaches it leaves it sampling from the first
    weights: the mismatch grows, TIS truncates tokens, and an event says what is wrong."""
    from tests.helpers.training import ListRecorder, config

    operator = OperatorOptions(rollout_backend="vllm")
    synced = ListRecorder()
    train(config(tmp_path / "synced", models_dir, max_steps=2, cfg={"operator": operator}), synced)
    assert all(m["sampler_logratio_mean"] < 1e-4 and m["sampler_correction_frac"] == 0 for m in synced.steps)

    real = fake_vllm.LLM.instances[-1].runner.load_weights.__func__

    def first_only(self: Any, weights: Any) -> None:
        if not self.pushes:
            real(self, weights)

    monkeypatch.setattr(type(fake_vllm.LLM.instances[-1].runner), "load_weights", first_only)
    stale = ListRecorder()
    hp = {"max_steps": 24, "learning_rate": 0.002, "rloo_k": 2, "batch_size": 4, "max_new_tokens": 8}
    train(config(tmp_path / "stale", models_dir, **hp, cfg={"operator": operator}), stale)
    mismatch = [m["sampler_logratio_mean"] for m in stale.steps]
    assert mismatch[0] < 1e-4 and min(mismatch[1:]) > 0.05, mismatch  # synced once, then left behind
    assert stale.steps[-1]["sampler_correction_frac"] > 0  # tokens the stale sampler over-weighted: truncated
    assert any("not being updated" in e for e in stale.events), stale.events

    # The same stale run uncorrected: the same first step, then other updates.
    plain = ListRecorder()
    hp = {**hp, "max_steps": 3, "sampler_correction": "none"}
    train(config(tmp_path / "plain", models_dir, **hp, cfg={"operator": operator}), plain)
    assert plain.steps[0]["grad_norm"] == pytest.approx(stale.steps[0]["grad_norm"], rel=1e-5)
    assert plain.steps[2]["grad_norm"] != pytest.approx(stale.steps[2]["grad_norm"], rel=1e-3)
    assert plain.steps[2]["sampler_correction_frac"] == 0 < plain.steps[2]["sampler_logratio_mean"]


def test_vllm_reports_the_log_probs_it_samples_from_at_any_temperature(fake_vllm, tmp_path, models_dir) -> None:
    """At temperature 0.7 vLLM's raw log-probs are not those of the distribution it samples from:
    the backend asks for the processed ones, and trainer and sampler agree to rounding."""
    from tests.helpers.training import ListRecorder, config

    rec = ListRecorder()
    operator = OperatorOptions(rollout_backend="vllm")
    train(config(tmp_path, models_dir, max_steps=1, temperature=0.7, cfg={"operator": operator}), rec)
    assert fake_vllm.LLM.instances[-1].options["logprobs_mode"] == "processed_logprobs"
    assert rec.steps[0]["sampler_logratio_mean"] < 1e-4, rec.steps[0]


def test_mask_leaves_out_the_completions_a_stale_sampler_drew(fake_vllm, monkeypatch, tmp_path, models_dir) -> None:
    from tests.helpers.training import ListRecorder, config

    runner = fake_vllm._Runner
    real = runner.load_weights

    def first_only(self: Any, weights: Any) -> None:
        if not self.pushes:
            real(self, weights)

    monkeypatch.setattr(runner, "load_weights", first_only)
    rec = ListRecorder()
    hp = {"max_steps": 4, "learning_rate": 0.01, "rloo_k": 2, "batch_size": 4, "max_new_tokens": 8}
    operator = OperatorOptions(rollout_backend="vllm")
    train(config(tmp_path, models_dir, **hp, sampler_correction="mask", cfg={"operator": operator}), rec)
    assert rec.steps[0]["sampler_correction_frac"] == 0  # synced: nothing past the bound
    assert rec.steps[-1]["sampler_correction_frac"] > 0  # completions with a token past 2x either way: out


def test_auto_correction_is_tis_only_where_the_sampler_is_not_the_policy_and_there_is_no_nucleus() -> None:
    from types import SimpleNamespace

    from worker.engine.methods.rloo_update import correction_mode

    def mode(correction: str, top_p: float, logprobs: bool) -> str:
        hp = SimpleNamespace(sampler_correction=correction, top_p=top_p)
        return correction_mode(hp, has_sampler_logprobs=logprobs)  # type: ignore[arg-type]

    assert mode("auto", 1.0, True) == "tis"
    assert mode("auto", 0.9, True) == "none"
    assert mode("auto", 1.0, False) == mode("mask", 1.0, False) == "none"  # the policy sampled: ratio 1
    assert mode("mask", 1.0, True) == "mask"

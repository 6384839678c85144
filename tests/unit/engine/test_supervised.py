"""The supervised and DPO loops on the tiny policy: what the loss reads, the loss against a hand
computation, a run whose loss falls, and a paused run that resumes bit-equal, as for RLOO."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.data import EXAMPLES
from tests.helpers.training import LORA, TIMING, ListRecorder, load_policy, method_config
from worker.engine import sequences
from worker.engine.methods import dpo
from worker.engine.methods.rloo import train
from worker.engine.sequences import Example, batch_rows, chat_example, token_logprobs

CHAT = {
    "messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "blue", "weight": 0},
        {"role": "user", "content": "Grass?"},
        {"role": "assistant", "content": "green"},
    ]
}


def comparable(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in steps]


# ---------------------------------------------------------------- what the loss reads
def test_only_assistant_tokens_of_weight_1_are_learned(models_dir: Path) -> None:
    _, tok = load_policy(models_dir)
    ex = chat_example(tok, CHAT, max_length=256)
    assert len(ex.ids) == len(ex.learn)
    learned = tok.decode([i for i, m in zip(ex.ids, ex.learn, strict=True) if m])
    context = tok.decode([i for i, m in zip(ex.ids, ex.learn, strict=True) if not m])
    assert learned == "green" + tok.eos_token  # the turn and its end; not its header, not the weight-0 turn
    assert "blue" in context and "Grass?" in context and "<|assistant|>" in context
    # The tokens are the conversation as the template writes it.
    assert tok.decode(ex.ids) == tok.apply_chat_template(
        [{k: v for k, v in m.items() if k != "weight"} for m in CHAT["messages"]], tokenize=False
    )


def test_a_tool_call_dialogue_learns_the_calls_and_the_answer_not_the_results(models_dir: Path) -> None:
    """OpenAI's tool-call format: the assistant's ``tool_calls`` (as the template writes them) and
    its answer are learned; the ``tool`` result and the tools' header are context."""
    _, tok = load_policy(models_dir)
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}
    line = {
        "messages": [
            {"role": "user", "content": "6*7="},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "42"},
            {"role": "assistant", "content": "42"},
        ],
        "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}],
    }
    ex = chat_example(tok, line, max_length=512)
    learned = tok.decode([i for i, m in zip(ex.ids, ex.learn, strict=True) if m])
    context = tok.decode([i for i, m in zip(ex.ids, ex.learn, strict=True) if not m])
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    assert learned == call_text + tok.eos_token + "42" + tok.eos_token
    assert "<tool_response>42</tool_response>" in context and "tools: calculator" in context


def test_an_example_keeps_its_first_tokens() -> None:
    class Tok:
        chat_template = None
        eos_token = "</s>"

        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

    ex = chat_example(
        Tok(), {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, max_length=5
    )
    assert ex.ids == [ord(c) for c in "user:"] and ex.learn == [0] * 5


def test_a_template_that_rewrites_earlier_turns_fails_clearly(models_dir: Path) -> None:
    """A template that moves the system prompt to the last user turn writes a conversation's start
    differently as more turns follow: which tokens are whose cannot be told, and the job says so."""
    from worker.engine.errors import JobError

    _, tok = load_policy(models_dir)

    class SystemLast:
        chat_template = "(moves the system prompt)"
        eos_token = tok.eos_token

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, **_):  # type: ignore[no-untyped-def]
            system = [m["content"] for m in messages if m["role"] == "system"]
            turns = [f"{m['role']}: {m['content']}" for m in messages if m["role"] != "system"]
            return "\n".join(turns + system) + ("\nassistant:" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens):  # type: ignore[no-untyped-def]
            return tok(text, add_special_tokens=add_special_tokens)

    with pytest.raises(JobError) as info:
        chat_example(SystemLast(), CHAT, max_length=256)
    assert info.value.code == "unsupported_chat_template"


def test_token_logprobs_against_a_hand_computation(models_dir: Path) -> None:
    model, tok = load_policy(models_dir)
    model.eval()
    examples = [chat_example(tok, CHAT, max_length=256), Example([5, 6, 7], [0, 1, 1])]
    rows = batch_rows(examples, pad_id=tok.pad_token_id, pack_to=None, device=torch.device("cpu"))
    with torch.no_grad():
        logp, _ = token_logprobs(model, rows)
        for r, ex in enumerate(examples):
            ids = torch.tensor([ex.ids])
            by_hand = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            assert torch.allclose(logp[r, : len(ex.ids) - 1], by_hand, atol=1e-5)
            assert rows.learn[r, : len(ex.ids) - 1].tolist() == [float(x) for x in ex.learn[1:]]
            assert rows.learn[r, len(ex.ids) - 1 :].sum() == 0  # padding teaches nothing


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_each_example_its_own_logprobs(models_dir: Path, attention: str) -> None:
    model, tok = load_policy(models_dir)
    model.eval()
    model.config._attn_implementation = attention  # eager adds a 4D mask to the scores
    examples = [Example([5, 6, 7, 8], [0, 1, 1, 1]), Example([9, 10, 11], [0, 0, 1]), Example([12, 13], [0, 1])]
    cpu = torch.device("cpu")
    padded = batch_rows(examples, pad_id=0, pack_to=None, device=cpu)
    packed = batch_rows(examples, pad_id=0, pack_to=8, device=cpu)
    assert packed.ids.shape[0] == 2  # 4 + 3 in the first row, 2 in the second
    with torch.no_grad():
        lp_padded, _ = token_logprobs(model, padded)
        lp_packed, _ = token_logprobs(model, packed)
    learned = lambda lp, rows: sorted((lp * rows.learn)[rows.learn.bool()].tolist())  # noqa: E731
    assert packed.learn.sum() == padded.learn.sum() == 5  # each but its first token; none across a border
    assert learned(lp_packed, packed) == pytest.approx(learned(lp_padded, padded), abs=1e-5)


def test_the_dpo_loss_against_a_hand_computation() -> None:
    policy = torch.tensor([[-1.0, -3.0], [-2.0, -1.0]])
    reference = torch.tensor([[-2.0, -2.0], [-2.0, -2.0]])
    loss, margin, accuracy = dpo.dpo_loss(policy, reference, beta=0.5)
    z = [0.5 * ((-1 + 2) - (-3 + 2)), 0.5 * ((-2 + 2) - (-1 + 2))]  # 1.0 and -0.5
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-v)) for v in z) / 2)
    assert margin.item() == pytest.approx(0.25) and accuracy.item() == 0.5


def test_a_pair_shares_its_prompt_and_keeps_each_output(models_dir: Path) -> None:
    _, tok = load_policy(models_dir)
    line = {
        "input": {"messages": [{"role": "user", "content": "Sky?"}]},
        "preferred_output": [{"role": "assistant", "content": "blue"}],
        "non_preferred_output": [{"role": "assistant", "content": "green"}],
    }
    prompt, good, bad = sequences.preference_texts(tok, line)
    assert prompt.endswith("<|assistant|>") and good == "blue" + tok.eos_token and bad == "green" + tok.eos_token
    ro = dpo.pair_rollout(tok, [(prompt, good, bad)], max_length=256, device=torch.device("cpu"))
    assert ro.group == 2 and torch.equal(ro.prompt_ids[0], ro.prompt_ids[1])
    assert tok.decode(ro.completion_ids[0][ro.completion_mask[0].bool()]) == good


# ---------------------------------------------------------------- the loops
@pytest.mark.parametrize("method", ["supervised", "dpo"])
def test_the_loss_falls_on_the_example_task(tmp_path: Path, models_dir: Path, method: str) -> None:
    cfg = method_config(tmp_path, models_dir, method, cfg={"validation_file": EXAMPLES / method / "valid.jsonl"})
    rec = ListRecorder()
    result = train(cfg, rec)
    assert result.stopped is None and result.headline == "train_loss"
    losses = [m["train_loss"] for m in rec.steps]
    assert len(losses) == cfg.hyperparameters.total_steps(48)
    assert result.first == losses[0] and result.last == losses[-1]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3
    valid = [m["valid_loss"] for m in rec.steps if "valid_loss" in m]
    assert len(valid) >= 5 and valid[-1] < valid[0]
    final = rec.checkpoint_metrics[result.steps]
    assert final["train_loss"] == losses[-1] and final["valid_loss"] == valid[-1]
    if method == "supervised":
        assert 0 <= final["train_mean_token_accuracy"] <= 1 and final["full_valid_loss"] is not None
    else:
        assert "train_mean_token_accuracy" not in final and final["reward_accuracy"] is not None
        assert final["valid_reward_margin"] is not None and None not in final.values()


@pytest.mark.parametrize(
    "method,extra",
    [("supervised", {}), ("supervised", {"packing": True, "lora": LORA}), ("dpo", {}), ("dpo", {"lora": LORA})],
)
def test_a_paused_run_resumes_bit_equal(tmp_path: Path, models_dir: Path, method: str, extra: dict[str, Any]) -> None:
    hp = {"max_steps": 4, "gradient_accumulation_steps": 2, **extra}
    whole = ListRecorder()
    train(method_config(tmp_path / "whole", models_dir, method, **hp), whole)
    first = ListRecorder(stop_at=2, stop_as="paused")
    paused = train(method_config(tmp_path / "split", models_dir, method, **hp), first)
    assert paused.stopped == "paused" and paused.steps == 2
    second = ListRecorder()
    resumed = train(
        method_config(tmp_path / "split", models_dir, method, cfg={"resume_from": paused.final_checkpoint}, **hp),
        second,
    )
    assert resumed.resumed_from == 2
    assert comparable(first.steps + second.steps) == comparable(whole.steps)


def test_dpo_under_lora_compares_with_the_base(tmp_path: Path, models_dir: Path, monkeypatch) -> None:
    from worker.engine import modeling

    seen: list[bool] = []
    real = modeling.Reference.logprobs

    def spy(self: Any, rollout: Any, *, temperature: float) -> Any:
        seen.append(self.lora and self.model is None)
        return real(self, rollout, temperature=temperature)

    monkeypatch.setattr(modeling.Reference, "logprobs", spy)
    train(method_config(tmp_path, models_dir, "dpo", max_steps=1, lora=LORA), ListRecorder())
    assert seen == [True]  # no second copy: the policy with its adapter off

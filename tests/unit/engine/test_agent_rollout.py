"""Multi-turn rollouts (``worker.engine.rollout.agent``) on the tiny policy's real tokenizer and chat
template: what each token is (sampled, or a tool's result), what graders see, where limits cut.

The turns come from a scripted sampler (a test's stand-in for the policy's sampling: it answers
each context with a given text), so each assertion knows what was written; the tokens, the
template, the tools and the assembly are the real ones. ``test_train_with_tools`` runs the real
policy through a whole RLOO step with tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from service.tools import MultiTurn, ToolRunner, parse_tools
from worker.engine.rollout.agent import Agent, run_agent, trajectory_budget, transcript
from worker.engine.rollout.base import Rollout, completion_logprobs

CALC = {"type": "function", "name": "calculator", "runtime": {"type": "builtin"}}
Script = Callable[[str], str]


class ScriptedSampler:
    """Answers each context (decoded) with ``script(context)`` and the end-of-turn token, as the
    policy's backend would (same layout, padding and masks)."""

    def __init__(self, tokenizer: Any, script: Script) -> None:
        self.tok, self.script = tokenizer, script
        self.contexts: list[str] = []
        self.limits: list[int | None] = []

    def generate(self, prompts: list[str], *, k: int, generator_seed: int, first: int = 0) -> Rollout:
        ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(k)]
        return self._answer(ids, k)

    def generate_ids(
        self, prompt_ids: list[list[int]], *, generator_seed: int, rows: list[int], max_new_tokens: int | None = None
    ) -> Rollout:
        self.limits.append(max_new_tokens)
        return self._answer(prompt_ids, 1)

    def _answer(self, contexts: list[list[int]], k: int) -> Rollout:
        tok = self.tok
        texts = [tok.decode(c) for c in contexts]
        self.contexts += texts
        turns = [tok(self.script(t), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        width = max(len(t) for t in turns)
        completion = torch.tensor([t + [tok.pad_token_id] * (width - len(t)) for t in turns])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in turns])
        padded = tok.pad({"input_ids": contexts[::k]}, padding=True, return_tensors="pt")
        return Rollout(
            padded["input_ids"].repeat_interleave(k, dim=0),
            padded["attention_mask"].repeat_interleave(k, dim=0),
            completion,
            mask,
            torch.zeros(len(turns), dtype=torch.bool),
            [tok.decode(t, skip_special_tokens=True) for t in turns],
            k,
        )


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> Any:
    from worker.engine.modeling import load_tokenizer

    return load_tokenizer(models_dir / "tiny-policy", name="tiny-policy")


def agent_of(tokenizer: Any, tools: list[Any] | None = None, context: int = 4096, **limits: Any) -> Agent:
    toolset = parse_tools(tools or [CALC], MultiTurn(**limits), param="method.reinforcement", allowed_urls=[])
    assert toolset is not None
    return Agent.of(
        toolset,
        ToolRunner(toolset, allowed_urls=[]),
        tokenizer,
        budget=trajectory_budget(toolset, context),
        job_id="ftjob-t",
    )


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def calculator_script(context: str) -> str:
    """Call the calculator on the question, then answer with what it said."""
    if "<tool_response>" in context:
        return context.rsplit("<tool_response>", 1)[1].split("</tool_response>", 1)[0]
    return call(context.split("<|user|>", 1)[1].split("?", 1)[0])


ITEMS = [{"messages": [{"role": "user", "content": "12345+678?"}]}, {"messages": [{"role": "user", "content": "7*6?"}]}]


def prompts_of(tokenizer: Any, items: list[dict[str, Any]], tools: Any = None) -> list[str]:
    from worker.engine.data import prompt_text

    return [prompt_text(item, tokenizer) for item in items]


def one_prompt(tokenizer: Any, agent: Agent, sampler: Any, k: int = 1) -> Any:
    """``run_agent`` on the first item alone, ``k`` rollouts."""
    return run_agent(agent, sampler, tokenizer, ITEMS[:1], prompts_of(tokenizer, ITEMS[:1]), k=k, generator_seed=0)


def test_a_tool_call_then_the_answer(tokenizer: Any) -> None:
    agent = agent_of(tokenizer)
    sampler = ScriptedSampler(tokenizer, calculator_script)
    out = run_agent(
        agent, sampler, tokenizer, ITEMS, prompts_of(tokenizer, ITEMS), k=2, generator_seed=1, label="step-3"
    )
    ro, rows = out.rollout, out.trajectories
    assert ro.texts == ["13023", "13023", "42", "42"]  # the graded text is the last turn's
    first = rows[0]
    assert (first.turns, first.calls, first.errors, first.malformed, first.truncated) == (2, 1, 0, 0, False)
    assert first.output_tools == [
        {"name": "calculator", "arguments": {"expression": "12345+678"}, "output": "13023", "error": None}
    ]
    assert first.rollout_id == "ftjob-t:step-3:rollout-0" and rows[3].rollout_id.endswith("rollout-3")
    # The second turn may not take a context past the budget (4096 here): its longest context's room.
    second = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in sampler.contexts[4:]]
    assert sampler.limits == [4096 - max(second)]
    # The sampled tokens are the two turns (their end-of-turn tokens included); everything between
    # them is the tool's result as the template writes it, context only.
    ids, gen = ro.completion_ids[0], ro.generated[0].bool()
    n = int(ro.completion_mask[0].sum())
    assert tokenizer.decode(ids[:n][gen[:n]]) == call("12345+678") + "<|eos|>13023<|eos|>"
    assert tokenizer.decode(ids[:n][~gen[:n]]) == "<|user|><tool_response>13023</tool_response><|eos|><|assistant|>"
    # The whole trajectory is what the template writes for the conversation in OpenAI's tool-call
    # format: what a supervised job on such lines teaches is exactly what these rollouts sample.
    openai_format = [
        ITEMS[0]["messages"][0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "12345+678"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "13023"},
        {"role": "assistant", "content": "13023"},
    ]
    whole = torch.cat([ro.prompt_ids[0][ro.prompt_mask[0].bool()], ids[:n]])
    assert tokenizer.decode(whole) == tokenizer.apply_chat_template(openai_format, tokenize=False)
    assert transcript(first).startswith("[assistant] <tool_call>") and "[tool] 13023" in transcript(first)
    sample = first.sample()
    assert sample.output_text == "13023" and sample.output_tools == first.output_tools
    assert sample.messages is not None and sample.messages[-1] == {"role": "assistant", "content": "13023"}


def test_log_probs_of_a_trajectory_are_those_of_its_sampled_tokens(tokenizer: Any, models_dir: Path) -> None:
    """The assembled rollout goes through the update's forward: a log-prob at every completion
    position, read where ``generated`` says."""
    from tests.helpers.training import load_policy

    model, _ = load_policy(models_dir)
    out = run_agent(
        agent_of(tokenizer),
        ScriptedSampler(tokenizer, calculator_script),
        tokenizer,
        ITEMS,
        prompts_of(tokenizer, ITEMS),
        k=2,
        generator_seed=1,
    )
    ro = out.rollout
    logp, _ = completion_logprobs(model, ro, temperature=1.0)
    single = completion_logprobs(model, ro.rows(slice(0, 1)), temperature=1.0)[0]  # no shared prompt
    mask = ro.sampled_mask.bool()
    assert logp.shape == ro.completion_ids.shape
    torch.testing.assert_close(logp[0][mask[0]], single[0][mask[0]], atol=1e-4, rtol=1e-4)
    assert int(ro.sampled_mask.sum()) < int(ro.completion_mask.sum())


def test_malformed_calls_are_answered_and_counted(tokenizer: Any) -> None:
    turns = iter(
        [
            "<tool_call>{not json}</tool_call>"
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
            "done",
        ]
    )
    sampler = ScriptedSampler(tokenizer, lambda _: next(turns))
    out = run_agent(
        agent_of(tokenizer), sampler, tokenizer, ITEMS[:1], prompts_of(tokenizer, ITEMS[:1]), k=1, generator_seed=0
    )
    row = out.trajectories[0]
    assert (row.calls, row.malformed, row.errors, row.turns, row.answer) == (4, 3, 1, 2, "done")
    outputs = [json.loads(t["output"])["error"] for t in row.output_tools]
    assert "not JSON" in outputs[0]
    assert "no tool named 'search'" in outputs[1] and "calculator" in outputs[1]
    assert "expression" in outputs[2] and "string" in outputs[2]
    assert "division by zero" in outputs[3]
    # The model read every answer, in order, in the next turn's context.
    assert sampler.contexts[-1].count("<tool_response>") == 4


def test_limits_end_a_trajectory_as_truncated(tokenizer: Any) -> None:
    always = ScriptedSampler(tokenizer, lambda _: call("1+1"))
    out = one_prompt(tokenizer, agent_of(tokenizer, max_turns=3), always, k=1)
    row = out.trajectories[0]
    assert (row.turns, row.calls, row.truncated, bool(out.rollout.truncated[0])) == (3, 2, True, True)

    out = one_prompt(tokenizer, agent_of(tokenizer, max_tool_calls=1), always, k=1)
    assert (out.trajectories[0].calls, out.trajectories[0].turns, out.trajectories[0].truncated) == (1, 2, True)

    # A budget that holds the prompt and one turn but not the tool's result.
    prompt = len(tokenizer(prompts_of(tokenizer, ITEMS[:1])[0], add_special_tokens=False)["input_ids"])
    turn = len(tokenizer(call("1+1"), add_special_tokens=False)["input_ids"]) + 1
    out = one_prompt(tokenizer, agent_of(tokenizer, max_trajectory_tokens=prompt + turn + 3), always, k=1)
    row = out.trajectories[0]
    assert row.truncated and row.turns == 1 and row.length() <= prompt + turn + 3
    assert int(out.rollout.completion_mask.sum()) == turn  # nothing past the budget


def test_a_turn_without_a_call_is_the_answer(tokenizer: Any) -> None:
    out = one_prompt(tokenizer, agent_of(tokenizer), ScriptedSampler(tokenizer, lambda _: "42"), k=3)
    assert [t.turns for t in out.trajectories] == [1, 1, 1] and out.rollout.texts == ["42"] * 3
    assert torch.equal(out.rollout.generated, out.rollout.completion_mask)


def test_train_with_tools(tmp_path: Path, models_dir: Path) -> None:
    """A whole RLOO run whose rollouts may call tools, on the real policy: its steps report the tool
    metrics and the time tools took, its samples show each turn, and the same seed gives the same
    run."""
    from tests.helpers.training import ListRecorder, config
    from worker.engine.methods.rloo import train

    toolset = parse_tools([CALC], {"max_turns": 2}, param="method.reinforcement", allowed_urls=[])
    runs = []
    for i in range(2):
        rec = ListRecorder()
        cfg = config(tmp_path / str(i), models_dir, cfg={"tools": toolset}, max_steps=2, sample_interval=1)
        assert train(cfg, rec).steps == 2
        runs.append(rec)
    steps = runs[0].steps
    for key in ("tool_turns_mean", "tool_calls_mean", "tool_errors", "tool_malformed", "trajectory_length_mean"):
        assert key in steps[-1], key
    assert 1 <= steps[-1]["tool_turns_mean"] <= 2 and steps[-1]["time_tools"] >= 0
    assert [m["train_reward_mean"] for m in steps] == [m["train_reward_mean"] for m in runs[1].steps]
    assert [m["trajectory_length_mean"] for m in steps] == [m["trajectory_length_mean"] for m in runs[1].steps]
    assert runs[0].samples_by_step[1][0]["completions"][0]["text"].startswith("[assistant] ")

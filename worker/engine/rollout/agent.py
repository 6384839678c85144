"""Multi-turn rollouts: the policy calls tools, reads their results, calls again, then answers.

A step's rollouts advance together, a turn at a time: every unfinished trajectory generates one
assistant turn (the first turn of a prompt's k trajectories from one prompt encoding, as single-turn
rollouts are; later turns from each trajectory's own context), the turn's tool calls are parsed in
the chat template's format (``service.tools.calls``), every call of every trajectory runs at once
(``service.tools.runtime``), and their results enter as ``tool`` messages rendered by the template.
A trajectory ends when a turn calls no tool (its answer), when a turn is cut at ``max_new_tokens``,
or at a limit: ``max_turns``, ``max_tool_calls``, or ``max_trajectory_tokens``; one ended by a
limit while it still wanted to go on is marked truncated, so ``mask_truncated_completions`` means
what it says.

The context is kept as token ids and never re-tokenized: a turn's sampled tokens (its end-of-turn
token included) are the tokens the update scores, and a tool result is appended as the tokens of
what the template writes between the turn's end and the next assistant header. The ``Rollout``'s
completion is the whole trajectory after the prompt; its ``generated`` mask is 1 on the sampled
tokens alone, so the loss, the KL and the log-probs count only what the policy wrote, and the
advantage is the trajectory's (one reward each).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from service import graders
from service import tools as tooling
from worker.engine.rollout.base import Rollout, RolloutBackend, group_seed, right_padded
from worker.engine.sequences import render, template_delta


@dataclass
class Trajectory:
    """One rollout's conversation as it grows, and what it did."""

    messages: list[dict[str, Any]]
    offered: list[tooling.Tool]
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    output_tools: list[dict[str, Any]] = field(default_factory=list)
    answer: str = ""
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    malformed: int = 0
    truncated: bool = False
    done: bool = False

    rollout_id: str = ""
    prompt_messages: int = 0

    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def counts(self) -> tuple[int, int, int, int, int, int]:
        """What the metrics add up: turns, calls, errors, time-outs, malformed calls, tokens after
        the prompt."""
        return (self.turns, self.calls, self.errors, self.timeouts, self.malformed, len(self.ids))

    def sample(self) -> graders.Sample:
        """The trajectory as graders see it: the answer, the calls made, the conversation."""
        return graders.Sample(
            output_text=self.answer,
            output_tools=self.output_tools,
            messages=self.messages,
            rollout_id=self.rollout_id,
        )


def transcript(trajectory: Trajectory) -> str:
    """The turns after the prompt, one block each (``assistant:``/``tool:``), as the samples view
    shows a rollout that called tools."""
    turns = trajectory.messages[trajectory.prompt_messages :]
    return "\n".join(f"[{m['role']}] {m['content']}" for m in turns)


@dataclass
class AgentRollout:
    """A step's multi-turn rollouts: the ``Rollout`` the update reads, each trajectory, and the
    seconds spent waiting on tools."""

    rollout: Rollout
    trajectories: list[Trajectory]
    tool_seconds: float


@dataclass(frozen=True)
class Agent:
    """What multi-turn rollouts of a run share: the tools and limits, the runner, how calls are
    written and what the template writes after a turn's end-of-turn token."""

    toolset: tooling.Toolset
    runner: tooling.ToolRunner
    call_format: str
    after_turn: str
    max_tokens: int
    job_id: str

    @classmethod
    def of(
        cls, toolset: tooling.Toolset, runner: tooling.ToolRunner, tokenizer: Any, *, budget: int, job_id: str
    ) -> Agent:
        call_format: str = toolset.limits.call_format
        if call_format == "auto":
            call_format = tooling.template_format(getattr(tokenizer, "chat_template", None))
        return cls(toolset, runner, call_format, _after_turn(tokenizer), budget, job_id)

    def prompt(self, item: dict[str, Any], tokenizer: Any) -> str:
        """The text a trajectory starts from: the line's messages with the tools it offers, rendered
        by the template, the assistant's header at the end."""
        tools = [t.openai() for t in self.toolset.offered(item.get("tools"))] or None
        return render(tokenizer, _messages(item), tools=tools, generation=True)


def trajectory_budget(toolset: tooling.Toolset, context: int | None) -> int:
    """Tokens a trajectory may hold: ``max_trajectory_tokens``, within the model's context."""
    limit = toolset.limits.max_trajectory_tokens
    candidates = [n for n in (limit, context) if n]
    return min(candidates) if candidates else 1_048_576


def run_agent(
    agent: Agent,
    backend: RolloutBackend,
    tokenizer: Any,
    items: Sequence[dict[str, Any]],
    prompts: list[str],
    *,
    k: int,
    generator_seed: int,
    first: int = 0,
    label: str = "step-0",
) -> AgentRollout:
    """``k`` trajectories of each prompt (prompt-major, as ``generate``'s rows), turn by turn."""
    first_turn = backend.generate(prompts, k=k, generator_seed=generator_seed, first=first)
    rows = []
    for i, item in enumerate(item for item in items for _ in range(k)):
        messages = [dict(m) for m in _messages(item)]
        rows.append(
            Trajectory(
                messages=messages,
                offered=agent.toolset.offered(item.get("tools")),
                prompt_ids=first_turn.prompt_ids[i][first_turn.prompt_mask[i].bool()].tolist(),
                rollout_id=f"{agent.job_id}:{label}:rollout-{first * k + i}",
                prompt_messages=len(messages),
            )
        )
    turn_ro, active = first_turn, list(range(len(rows)))
    tool_seconds = 0.0
    for turn in range(1, agent.toolset.limits.max_turns + 1):
        pending = [_take_turn(agent, rows[i], turn_ro, j, tokenizer) for j, i in enumerate(active)]
        calls = [
            (rows[i].offered, call, _where(agent, rows[i], turn, n))
            for i, turn_calls in zip(active, pending, strict=True)
            for n, call in enumerate(turn_calls)
        ]
        t0 = time.perf_counter()
        outcomes = iter(agent.runner.run(calls))
        tool_seconds += time.perf_counter() - t0
        for i, turn_calls in zip(active, pending, strict=True):
            if turn_calls:
                _answer_calls(agent, rows[i], turn_calls, [next(outcomes) for _ in turn_calls], tokenizer)
        active = [i for i in active if not rows[i].done]
        if not active:
            break
        # Each trajectory's turn drawn from its own seed (its place in the step, the turn): it does
        # not depend on which others are still going.
        contexts = [rows[i].prompt_ids + rows[i].ids for i in active]
        turn_ro = backend.generate_ids(
            contexts,
            generator_seed=group_seed(generator_seed, turn),
            rows=[first * k + i for i in active],
            max_new_tokens=agent.max_tokens - max(len(c) for c in contexts),  # no context past the budget
        )
    for i in active:  # still wanting to go on after the last turn
        rows[i].done, rows[i].truncated = True, True
    return AgentRollout(_assembled(rows, first_turn, tokenizer, k), rows, tool_seconds)


def _messages(item: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in item:
        return list(item["messages"])
    return [{"role": "user", "content": str(item.get("prompt", ""))}]


def _where(agent: Agent, row: Trajectory, turn: int, n: int) -> tooling.Where:
    return tooling.Where(agent.job_id, row.rollout_id, turn, f"{row.rollout_id}:turn-{turn}:call-{n}")


def _take_turn(agent: Agent, row: Trajectory, ro: Rollout, j: int, tokenizer: Any) -> list[tooling.Call]:
    """Append row ``j`` of ``ro`` (the trajectory's new turn) and say which calls to run: none when
    the trajectory ends here."""
    n = int(ro.completion_mask[j].sum())
    new = ro.completion_ids[j, :n].tolist()
    room = agent.max_tokens - row.length()
    cut = len(new) > room
    new = new[: max(room, 0)]
    row.ids += new
    row.generated += [1] * len(new)
    row.turns += 1
    text = ro.texts[j] if not cut else tokenizer.decode(new, skip_special_tokens=True)
    parsed = tooling.parse(text, agent.call_format)
    row.messages.append({"role": "assistant", "content": text})
    row.answer = parsed.content
    if cut or bool(ro.truncated[j]):
        row.done, row.truncated = True, True
        return []
    if not parsed.calls:
        row.done = True
        return []
    left = agent.toolset.limits.max_tool_calls - row.calls
    if left <= 0 or row.turns >= agent.toolset.limits.max_turns:
        row.done, row.truncated = True, True  # it wanted to go on; a limit ended it
        return []
    return parsed.calls[:left]


def _answer_calls(
    agent: Agent, row: Trajectory, calls: list[tooling.Call], outcomes: list[tooling.Outcome], tokenizer: Any
) -> None:
    """The calls' results as ``tool`` messages, their tokens appended as context; the trajectory
    ends, truncated, when they do not fit its budget."""
    before = row.messages
    for call, outcome in zip(calls, outcomes, strict=True):
        row.calls += 1
        row.errors += outcome.kind == "error"
        row.timeouts += outcome.kind == "timeout"
        row.malformed += outcome.kind == "malformed"
        row.output_tools.append(
            {"name": call.name, "arguments": call.arguments, "output": outcome.content, "error": outcome.kind}
        )
    results = [{"role": "tool", "content": o.content, "name": c.name} for c, o in zip(calls, outcomes, strict=True)]
    tools = [t.openai() for t in row.offered] or None
    done = render(tokenizer, before, tools=tools, generation=False)
    full = render(tokenizer, before + results, tools=tools, generation=True)
    scaffold = tokenizer(agent.after_turn + template_delta(full, done), add_special_tokens=False)["input_ids"]
    row.messages = before + results
    if row.length() + len(scaffold) + 1 > agent.max_tokens:
        row.done, row.truncated = True, True
        return
    row.ids += scaffold
    row.generated += [0] * len(scaffold)


def _after_turn(tokenizer: Any) -> str:
    """What the template writes after an assistant turn's end-of-turn token (Qwen's newline after
    ``<|im_end|>``; nothing for the tiny models'): a turn sampled to its end-of-turn token is then
    followed by exactly what the template would have written."""
    marker = "\u2063rloo-turn\u2063"
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    text = render(tokenizer, probe, generation=False)
    after = text[text.rfind(marker) + len(marker) :]
    for end in _end_of_turn_texts(tokenizer):
        if after.startswith(end):
            return after[len(end) :]
    return after


def _end_of_turn_texts(tokenizer: Any) -> list[str]:
    eos = tokenizer.eos_token
    return [t for t in (eos, "<|im_end|>", "<|eot_id|>", "<|end|>") if t]


def _assembled(rows: list[Trajectory], first_turn: Rollout, tokenizer: Any, k: int) -> Rollout:
    """The trajectories as one ``Rollout``: the prompt as the first turn had it, the rest of each
    trajectory as its completion, right-padded, sampled tokens marked in ``generated``."""
    device = first_turn.completion_ids.device
    ids, mask = right_padded([r.ids for r in rows], tokenizer.pad_token_id)
    generated, _ = right_padded([r.generated for r in rows], 0)
    truncated = torch.tensor([r.truncated for r in rows], device=device)
    return Rollout(
        first_turn.prompt_ids,
        first_turn.prompt_mask,
        ids.to(device),
        mask.to(device),
        truncated,
        [r.answer for r in rows],
        k,
        generated.to(device),
    )

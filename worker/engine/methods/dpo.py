"""The DPO loop, top to bottom: a batch of preference pairs, the policy's and the reference's
log-probs of both outputs, the sigmoid loss, the update, record, evaluate, checkpoint.

Direct preference optimisation (Rafailov et al., 2023) with the sigmoid loss::

    z = beta * ((log pi(y+|x) - log ref(y+|x)) - (log pi(y-|x) - log ref(y-|x)))
    loss = -log sigmoid(z), averaged over the batch's pairs

The reference is the starting model: a frozen copy for full fine-tuning, the policy with its
adapter disabled under LoRA (``worker.engine.modeling.Reference``, as for RLOO's KL). A pair is a group of
two completions sharing one prompt (``worker.engine.rollout.base.Rollout`` with ``group = 2``), so the prompt
goes through the model once for both outputs, as RLOO's k completions share theirs.

Metrics: ``train_loss`` (OpenAI's name), ``reward_margin`` (the mean of ``z``: how far the implicit
reward ``beta * (log pi - log ref)`` of the preferred output is above the other's),
``reward_accuracy`` (the share of pairs where it is above), and the same on the validation file
(``valid_loss``, ``valid_reward_margin``, ``valid_reward_accuracy``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from service.jobs.hyperparameters import ResolvedDpoHyperparameters
from worker.engine.config import TrainConfig
from worker.engine.data import batch_indices
from worker.engine.loop import Stop, TrainResult, base_metrics, end_of_step, finish, is_eval_step
from worker.engine.prepare import max_length, prepare
from worker.engine.recorders import Recorder
from worker.engine.rollout.base import Rollout, completion_logprobs
from worker.engine.sequences import preference_texts
from worker.engine.state import Run

HEADLINE = "train_loss"
Triple = tuple[str, str, str]


def train_dpo(cfg: TrainConfig, recorder: Recorder) -> TrainResult:
    run = prepare(cfg, recorder)
    hp = _hp(run)
    pairs = [preference_texts(run.tokenizer, line) for line in run.items]
    valid = [preference_texts(run.tokenizer, line) for line in run.valid_items][: hp.eval_samples]
    stop = Stop(run.start, {})
    for step in range(run.start + 1, run.total_steps + 1):
        t_step = time.perf_counter()
        indices = batch_indices(n_items=len(pairs), batch_size=hp.batch_size, step=step - 1, seed=cfg.seed)
        update = dpo_update(run, [pairs[i] for i in indices])
        metrics = base_metrics(
            run,
            step,
            started=t_step,
            tokens=update.tokens,
            train_loss=update.loss,
            reward_margin=update.margin,
            reward_accuracy=update.accuracy,
            grad_norm=update.grad_norm,
            learning_rate=update.learning_rate,
        )
        if is_eval_step(run, step):
            valid_stats = evaluate(run, valid)
            metrics.update(valid_stats)
            run.counters.record_valid(valid_stats)
        if (stop := end_of_step(run, step, metrics, recorder, headline=HEADLINE)).done:
            break
    return finish(run, stop, recorder, headline=HEADLINE)


def _hp(run: Run) -> ResolvedDpoHyperparameters:
    assert isinstance(run.hp, ResolvedDpoHyperparameters)
    return run.hp


def dpo_loss(policy_logp: Tensor, reference_logp: Tensor, *, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """The sigmoid DPO loss of ``(B, 2)`` sequence log-probs (column 0 the preferred output, 1 the
    other), its mean implicit-reward margin and the share of pairs ordered right (both detached)."""
    rewards = beta * (policy_logp - reference_logp)
    z = rewards[:, 0] - rewards[:, 1]
    loss = -torch.nn.functional.logsigmoid(z).mean()
    return loss, z.detach().mean(), (z.detach() > 0).float().mean()


def pair_rollout(tokenizer: Any, pairs: list[Triple], *, max_length: int, device: torch.device) -> Rollout:
    """Pairs as a rollout of groups of two: each prompt left-padded and repeated, its preferred then
    its non-preferred output right-padded after it. A prompt keeps its last tokens when prompt and
    output would pass ``max_length`` (it keeps at least half), an output its first."""
    prompts, outputs = [], []
    for prompt, preferred, other in pairs:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        o_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (preferred, other)]
        longest = max(len(o) for o in o_ids)
        keep_prompt = max(max_length // 2, max_length - longest)
        p_ids = p_ids[-keep_prompt:]
        room = max(max_length - len(p_ids), 1)
        prompts += [p_ids, p_ids]
        outputs += [o[:room] for o in o_ids]
    pad = tokenizer.pad_token_id
    p_width, o_width = max(len(p) for p in prompts), max(len(o) for o in outputs)
    n = len(prompts)
    prompt_ids = torch.full((n, p_width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_width), dtype=torch.long)
    completion_ids = torch.full((n, o_width), pad, dtype=torch.long)
    completion_mask = torch.zeros((n, o_width), dtype=torch.long)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        if p:
            prompt_ids[i, p_width - len(p) :] = torch.tensor(p)
            prompt_mask[i, p_width - len(p) :] = 1
        completion_ids[i, : len(o)] = torch.tensor(o)
        completion_mask[i, : len(o)] = 1
    return Rollout(
        prompt_ids.to(device),
        prompt_mask.to(device),
        completion_ids.to(device),
        completion_mask.to(device),
        torch.zeros(n, dtype=torch.bool, device=device),
        [text for _, preferred, other in pairs for text in (preferred, other)],
        group=2,
    )


@dataclass(frozen=True)
class DpoStats:
    loss: float
    margin: float
    accuracy: float
    grad_norm: float
    learning_rate: float
    tokens: int


def _sequence_logprobs(run: Run, ro: Rollout) -> tuple[Tensor, Tensor]:
    """``(B, 2)`` log-probs of each output under the policy (with grad) and the reference."""
    assert run.reference is not None  # DPO always loads one (worker.engine.prepare.needs_reference)
    mask = ro.completion_mask.float()
    with run.autocast:
        logp, _ = completion_logprobs(run.model, ro, temperature=1.0)
        ref = run.reference.logprobs(ro, temperature=1.0)
    return (logp.float() * mask).sum(-1).view(-1, 2), (ref.float() * mask).sum(-1).view(-1, 2)


def dpo_update(run: Run, batch: list[Triple]) -> DpoStats:
    """Micro-batched loss and backward over ``batch``, one optimizer and scheduler step."""
    hp = _hp(run)
    run.model.train()
    n_micro = hp.gradient_accumulation_steps
    per_micro = len(batch) // n_micro
    run.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(3, device=run.device)
    tokens = 0
    for m in range(n_micro):
        ro = pair_rollout(
            run.tokenizer, batch[m * per_micro : (m + 1) * per_micro], max_length=max_length(run), device=run.device
        )
        policy, reference = _sequence_logprobs(run, ro)
        loss, margin, accuracy = dpo_loss(policy, reference, beta=hp.beta)
        (loss / n_micro).backward()
        sums += torch.stack([loss.detach(), margin, accuracy]) / n_micro
        tokens += int(ro.prompt_mask.sum()) // 2 + int(ro.completion_mask.sum())  # each prompt once
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, hp.max_grad_norm)
    run.optimizer.step()
    learning_rate = float(run.scheduler.get_last_lr()[0])
    run.scheduler.step()
    loss_v, margin_v, accuracy_v = sums.tolist()
    return DpoStats(loss_v, margin_v, accuracy_v, float(grad_norm), learning_rate, tokens)


@torch.no_grad()
def evaluate(run: Run, pairs: list[Triple]) -> dict[str, float]:
    """``valid_loss``, ``valid_reward_margin`` and ``valid_reward_accuracy`` over ``pairs``."""
    hp = _hp(run)
    was_training = run.model.training
    run.model.eval()
    totals = torch.zeros(3)
    try:
        for i in range(0, len(pairs), hp.batch_size):
            chunk = pairs[i : i + hp.batch_size]
            ro = pair_rollout(run.tokenizer, chunk, max_length=max_length(run), device=run.device)
            policy, reference = _sequence_logprobs(run, ro)
            totals += torch.stack(dpo_loss(policy, reference, beta=hp.beta)).cpu() * len(chunk)
    finally:
        run.model.train(was_training)
    loss, margin, accuracy = (totals / max(len(pairs), 1)).tolist()
    return {"valid_loss": loss, "valid_reward_margin": margin, "valid_reward_accuracy": accuracy}

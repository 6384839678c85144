"""The supervised loop, top to bottom: a batch of conversations, the loss on their assistant tokens,
the update, record, evaluate, checkpoint.

It runs on the engine's shared parts: ``worker.engine.prepare`` (models, LoRA, precision, optimizer,
schedule, resuming), the seeded batch order of ``worker.engine.data``, and ``worker.engine.loop`` (recording,
pause and cancel, checkpoints). A step, for ``B`` examples:

1. the step's examples (a function of the seed and the step, so a resumed run reads the same);
2. for each of ``gradient_accumulation_steps`` micro-batches: token log-probs with grad, the loss
   ``-sum(log p(assistant token)) / (assistant tokens of the whole batch)`` (OpenAI's ``train_loss``:
   the mean over the batch's learned tokens), backward;
3. clip the gradient norm, optimizer step, scheduler step;
4. record ``train_loss`` and ``train_mean_token_accuracy``; ``valid_loss`` and
   ``valid_mean_token_accuracy`` on the validation file's first ``eval_samples`` examples at each
   validation pass, ``full_valid_*`` on all of it at the last step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from service.jobs.hyperparameters import ResolvedSupervisedHyperparameters
from worker.engine.config import TrainConfig
from worker.engine.data import batch_indices
from worker.engine.loop import Stop, TrainResult, base_metrics, end_of_step, finish, is_eval_step
from worker.engine.prepare import max_length, prepare
from worker.engine.recorders import Recorder
from worker.engine.sequences import Example, batch_rows, chat_example, token_logprobs
from worker.engine.state import Run

HEADLINE = "train_loss"


def train_supervised(cfg: TrainConfig, recorder: Recorder) -> TrainResult:
    run = prepare(cfg, recorder)
    hp = _hp(run)
    examples = [chat_example(run.tokenizer, line, max_length=max_length(run)) for line in run.items]
    valid = [chat_example(run.tokenizer, line, max_length=max_length(run)) for line in run.valid_items]
    stop = Stop(run.start, {})
    for step in range(run.start + 1, run.total_steps + 1):
        t_step = time.perf_counter()
        indices = batch_indices(n_items=len(examples), batch_size=hp.batch_size, step=step - 1, seed=cfg.seed)
        update = supervised_update(run, [examples[i] for i in indices])
        metrics = base_metrics(
            run,
            step,
            started=t_step,
            tokens=update.tokens,
            train_loss=update.loss,
            train_mean_token_accuracy=update.accuracy,
            grad_norm=update.grad_norm,
            learning_rate=update.learning_rate,
            learned_tokens=update.learned,
        )
        if is_eval_step(run, step):
            metrics["valid_loss"], metrics["valid_mean_token_accuracy"] = evaluate(run, valid[: hp.eval_samples])
            if step == run.total_steps:
                metrics["full_valid_loss"], metrics["full_valid_mean_token_accuracy"] = evaluate(run, valid)
            run.counters.record_valid({k: v for k, v in metrics.items() if k.startswith(("valid_", "full_valid_"))})
        if (stop := end_of_step(run, step, metrics, recorder, headline=HEADLINE)).done:
            break
    return finish(run, stop, recorder, headline=HEADLINE)


def _hp(run: Run) -> ResolvedSupervisedHyperparameters:
    assert isinstance(run.hp, ResolvedSupervisedHyperparameters)
    return run.hp


@dataclass(frozen=True)
class SupervisedStats:
    loss: float
    accuracy: float
    grad_norm: float
    learning_rate: float
    learned: int
    """Tokens the loss learned from (assistant tokens of weight 1)."""
    tokens: int
    """Every token of the batch (context included)."""


def supervised_update(run: Run, batch: list[Example]) -> SupervisedStats:
    """Micro-batched loss and backward over ``batch``, one optimizer and scheduler step."""
    hp = _hp(run)
    run.model.train()
    n_micro = hp.gradient_accumulation_steps
    per_micro = len(batch) // n_micro
    learned = sum(sum(ex.learn[1:]) for ex in batch)  # the first token is never predicted
    norm = max(learned, 1)
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=run.device)
    correct_sum = torch.zeros((), device=run.device)
    for m in range(n_micro):
        rows = _rows(run, batch[m * per_micro : (m + 1) * per_micro])
        with run.autocast:
            logp, correct = token_logprobs(run.model, rows)
        loss = -(logp * rows.learn).sum() / norm
        loss.backward()
        loss_sum += loss.detach()
        correct_sum += (correct * rows.learn).sum()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, hp.max_grad_norm)
    if learned:  # else the gradient is all zero: AdamW's momentum and decay must not move the weights
        run.optimizer.step()
    learning_rate = float(run.scheduler.get_last_lr()[0])
    run.scheduler.step()
    return SupervisedStats(
        loss=float(loss_sum) if learned else float("nan"),
        accuracy=float(correct_sum) / learned if learned else float("nan"),
        grad_norm=float(grad_norm),
        learning_rate=learning_rate,
        learned=learned,
        tokens=sum(len(ex.ids) for ex in batch),
    )


def _rows(run: Run, examples: list[Example]) -> Any:
    hp = _hp(run)
    return batch_rows(
        examples,
        pad_id=run.tokenizer.pad_token_id,
        pack_to=max_length(run) if hp.packing else None,
        device=run.device,
    )


@torch.no_grad()
def evaluate(run: Run, examples: list[Example]) -> tuple[float, float]:
    """Token-mean loss and accuracy over ``examples`` (no grad; the model's mode kept)."""
    was_training = run.model.training
    run.model.eval()
    loss_sum, correct_sum, learned = 0.0, 0.0, 0.0
    try:
        for i in range(0, len(examples), _hp(run).batch_size):
            rows = _rows(run, examples[i : i + _hp(run).batch_size])
            with run.autocast:
                logp, correct = token_logprobs(run.model, rows)
            loss_sum -= float((logp * rows.learn).sum())
            correct_sum += float((correct * rows.learn).sum())
            learned += float(rows.learn.sum())
    finally:
        run.model.train(was_training)
    if not learned:
        return float("nan"), float("nan")
    return loss_sum / learned, correct_sum / learned

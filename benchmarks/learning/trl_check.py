"""This engine against TRL's ``RLOOTrainer``, deterministically: the same weights and the same
rollouts through both, number by number, instead of two sets of learning curves.

At the supervised start and at a trained checkpoint, ``BATCHES`` batches of the exact task (16
prompts x 8 samples, drawn by this engine's sampler) go through:

* ours: the rewards of the job's grader, ``rloo_advantages``, the engine's log-probs and
  ``policy_loss`` (sequence_sum, at ratio 1, as every first pass is) and its gradient;
* TRL's: the same completions handed to ``_generate_and_score_completions`` (its ``_generate``
  replaced by one that returns them), so that TRL scores them with its reward function, computes
  its advantages and old log-probs; then its ``_compute_loss`` and its gradient, on a copy of the
  same weights.

Compared: the advantages (largest difference), the losses, and the gradients (largest difference
against the largest entry, and their cosine). Then once more with the old log-probs moved off the
policy's (a ratio away from 1 on every completion, some past the clip range), the same offsets given
to both: the clipped objective, compared the same way.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.learning.tasks import EXAMPLE, TASKS, job_settings

BATCHES = 4


def gradients_against_trl(home: Path) -> dict[str, Any]:
    """Per point (``start`` and, when the benchmark's RLOO reference run is there, its last
    checkpoint): the comparisons at ratio 1 and off it, the worst over ``BATCHES`` batches."""
    from benchmarks.learning.variance import _prepared

    points: dict[str, Path | None] = {"start": None}
    trained = sorted((home / "reference").glob("exact-every-*/step-*"), key=lambda p: int(p.name[5:]))
    if trained:
        points[f"step {trained[-1].name[5:]}"] = trained[-1]
    out: dict[str, Any] = {}
    for name, checkpoint in points.items():
        run = _prepared(TASKS["exact"], checkpoint, home / "specs")
        trainer = _trainer(run, Path(tempfile.mkdtemp(dir=home)))
        rows = [_compare(run, trainer, b) for b in range(BATCHES)]
        out[name] = {key: max(row[key] for row in rows) for key in rows[0] if key != "cosine"}
        out[name]["cosine_min"] = min(row["cosine"] for row in rows)
    return out


def _trainer(run: Any, where: Path) -> Any:
    """TRL's RLOOTrainer over a copy of the run's model, set as the benchmark's TRL runs are."""
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import RLOOTrainer

    from benchmarks.common import trl_config
    from worker.engine.data import load_items

    hf_logging.set_verbosity_error()
    hp = job_settings()

    def exact_match(completions: list[list[dict[str, str]]], answer: list[str], **_: Any) -> list[float]:
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]

    rows = [{"prompt": item["messages"], "answer": item["answer"]} for item in load_items(EXAMPLE / "train.jsonl")]
    args = trl_config(
        where,
        seed=0,
        steps=1,
        learning_rate=hp["learning_rate"],
        k=hp["rloo_k"],
        prompts=hp["batch_size"],
        new_tokens=hp["max_new_tokens"],
        beta=0.0,
    )
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        trainer = RLOOTrainer(
            model=copy.deepcopy(run.model),
            reward_funcs=exact_match,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=run.tokenizer,
        )
    trainer.model.train()
    return trainer


def _compare(run: Any, trainer: Any, b: int) -> dict[str, float]:
    """One batch through both; the differences at ratio 1 and with the old log-probs moved."""
    import torch

    from worker.engine.data import batch_indices, prompt_text
    from worker.engine.methods import policy_gradient
    from worker.engine.rewards.scoring import score_batch
    from worker.engine.rollout.base import completion_logprobs

    hp = run.rl
    k = hp.rloo_k
    items = [run.items[i] for i in batch_indices(n_items=len(run.items), batch_size=hp.batch_size, step=b, seed=77)]
    ro = run.sampler.generate([prompt_text(item, run.tokenizer) for item in items], k=k, generator_seed=31_337 + b)
    graded = score_batch(
        run.scorer,
        prompts=[""] * len(ro.texts),
        texts=ro.texts,
        items=[item for item in items for _ in range(k)],
        reward_models=None,
    )
    ours_adv = policy_gradient.rloo_advantages(torch.tensor(graded.rewards).view(-1, k)).view(-1)
    theirs = _trl_inputs(trainer, ro, items, k)
    mask = ro.completion_mask.float()
    # Moved: each completion's old log-prob shifted by a fixed offset in [-0.3, 0.3] (some ratios clip).
    offsets = torch.linspace(-0.3, 0.3, len(ro.texts))
    out: dict[str, float] = {"advantage_max_abs_diff": float((theirs["advantages"] - ours_adv).abs().max())}
    grads = {}
    for moved in (False, True):
        run.model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(run.model, ro, temperature=hp.temperature)
        old = logp.detach().clone()
        if moved:  # the offset on each completion's first token: its summed log-prob moves by it
            old[:, 0] += offsets
        loss, _ = policy_gradient.policy_loss(logp, old, ours_adv, mask, aggregation="sequence_sum")
        loss.backward()
        ours = _flat(run.params)
        trl_in = dict(theirs)
        if moved:
            trl_in["old_logps"] = theirs["old_logps"] + offsets
        trainer.model.zero_grad(set_to_none=True)
        trl_loss = trainer._compute_loss(trainer.model, trl_in)
        trl_loss.backward()
        trl_grad = _flat([p for p in trainer.model.parameters() if p.requires_grad])
        tag = "moved" if moved else "ratio_1"
        grads[tag] = (ours, trl_grad)
        out[f"loss_abs_diff_{tag}"] = float((loss - trl_loss).abs())
        out[f"grad_max_abs_diff_over_max_{tag}"] = float((ours - trl_grad).abs().max() / ours.abs().max())
    out["cosine"] = min(float(torch.nn.functional.cosine_similarity(a, c, dim=0)) for a, c in grads.values())
    return out


def _trl_inputs(trainer: Any, ro: Any, items: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """TRL's own ``_generate_and_score_completions`` on ``ro``'s completions (its reward function,
    its advantages, its old log-probs)."""
    prompt_ids = [row[m.bool()].tolist() for row, m in zip(ro.prompt_ids, ro.prompt_mask, strict=True)]
    completion_ids = [row[m.bool()].tolist() for row, m in zip(ro.completion_ids, ro.completion_mask, strict=True)]
    completions = [[{"role": "assistant", "content": text}] for text in ro.texts]
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, completions)
    inputs = [{"prompt": item["messages"], "answer": item["answer"]} for item in items for _ in range(k)]
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        return dict(trainer._generate_and_score_completions(inputs))


def _flat(params: list[Any]) -> Any:
    """The parameters' gradients as one vector (a parameter without one: zeros)."""
    import torch

    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]).double()

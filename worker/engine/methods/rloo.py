"""The RLOO training loop, top to bottom: rollout, score, reference, update, record, checkpoint.

One function, ``train``, runs a job for the Celery task and for ``rloo train`` alike; where the
numbers go (database or stdout) is the ``Recorder``'s business. Setting up is ``worker.engine.prepare``'s,
checkpoints and resuming ``worker.engine.resume``'s, steps 4-5 (the update) ``worker.engine.methods.rloo_update``'s,
the math ``worker.engine.methods.policy_gradient``'s, the metrics ``worker.engine.metrics``'s.

A step, for ``B`` prompts and ``k`` completions each (``N = B * k``, prompt-major):

1. generate the N completions (one prompt encoding shared by its k samples);
2. score them (NaN where a completion cannot be scored);
3. reference log-probs (no grad), when ``kl_coef > 0``: a frozen copy for full fine-tuning, the
   same model with its adapter disabled for LoRA. A grader that waits on other processes (a
   sandbox, an endpoint, a remote reward model) scores on a thread meanwhile (``worker.engine.overlap``);
4. for each of ``gradient_accumulation_steps`` micro-batches (whole groups, so leave-one-out
   baselines never cross a micro-batch): policy log-probs with grad; on the first pass their
   detached values are the sampling policy's (no extra forward), which gives the KL and the
   advantages; loss, backward;
5. clip the gradient norm, optimizer step; repeat 4-5 ``ppo_epochs`` times; scheduler step;
6. record metrics, evaluate, checkpoint (with the training state, so a restart resumes exactly).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
from torch import Tensor

from service import graders
from worker.engine.config import TrainConfig
from worker.engine.data import batch_indices, prompt_text
from worker.engine.diagnostics import Diagnostics
from worker.engine.errors import JobError
from worker.engine.loop import Stop, TrainResult, end_of_step, finish, is_eval_step
from worker.engine.methods.rloo_update import rloo_update
from worker.engine.metrics import Timings, UpdateStats, grader_metrics, step_metrics, tool_metrics
from worker.engine.overlap import Started
from worker.engine.prepare import prepare
from worker.engine.recorders import Recorder
from worker.engine.resume import preserved_rng
from worker.engine.rewards.scoring import SampledTokens, score_batch, scored_elsewhere
from worker.engine.rollout.agent import Trajectory, run_agent, transcript
from worker.engine.rollout.base import Rollout
from worker.engine.samples import is_sample_step, sample_groups
from worker.engine.state import Run, RunCounters


def train(cfg: TrainConfig, recorder: Recorder) -> TrainResult:
    """Run ``cfg`` to its end (or a pause, a cancel): the loop of its method, its integrations
    (W&B) recording beside ``recorder``."""
    from worker.engine.integrations.wandb_recorder import recording

    with recording(cfg, recorder) as recorder:
        if cfg.method == "supervised":
            from worker.engine.methods.supervised import train_supervised

            return train_supervised(cfg, recorder)
        if cfg.method == "dpo":
            from worker.engine.methods.dpo import train_dpo

            return train_dpo(cfg, recorder)
        return train_rloo(cfg, recorder)


def train_rloo(cfg: TrainConfig, recorder: Recorder) -> TrainResult:
    run = prepare(cfg, recorder)
    hp, counters, ranks = run.rl, run.counters, run.ranks
    k, batch_size = hp.rloo_k, hp.batch_size
    # This rank's prompts of every step (all of them for one process): whole prompts, so a prompt's
    # k completions stay together and leave-one-out needs no communication.
    mine = ranks.share(batch_size)
    micro = micro_batches(mine.stop - mine.start, k, hp.gradient_accumulation_steps)
    overlap = run.reference is not None and scored_elsewhere(run.scorer)
    stop, watch = Stop(run.start, {}), Diagnostics(counters.reported_diagnostics, group=k)
    for step in range(run.start + 1, run.total_steps + 1):
        t_step = time.perf_counter()

        # 1. Rollout: k completions for each of this rank's prompts, prompt-major ------------------
        indices = batch_indices(n_items=len(run.items), batch_size=batch_size, step=step - 1, seed=cfg.seed)
        batch = [run.items[i] for i in indices]
        prompts = [_prompt(run, item) for item in batch]
        with run.autocast, run.sampler.sampling():
            seed, label = cfg.seed * 1_000_003 + step, f"step-{step}"
            ro, trajectories, t_tools = _rollouts(
                run, batch[mine], prompts[mine], seed=seed, first=mine.start, label=label
            )
        # Every rank's completions as wide as the widest, so all ranks run the same forwards.
        ro = ro.widened(int(ranks.max(torch.tensor(ro.completion_ids.shape[1]))), run.tokenizer.pad_token_id)
        mask = ro.sampled_mask.to(torch.float32)  # what the policy wrote: not a tool's result
        t_generate = time.perf_counter() - t_step - t_tools

        # 2. Score: the grader gives r[b, i]; NaN where a completion could not be scored -----------
        # Each rank scores its own completions. A grader that waits on other processes scores on a
        # thread while the reference forward runs (worker.engine.overlap); the others score here and now.
        # The sampled tokens are read here, before the reference forward is queued on the device: read
        # on the thread, they would wait for it.
        sampled = sampled_tokens(run, ro, trajectories)
        scoring = Started(
            functools.partial(_score, run, step, prompts[mine], batch[mine], ro, sampled, trajectories), beside=overlap
        )

        # 3. Reference log-probs, in micro-batches of whole groups ------------------------------------
        t0 = time.perf_counter()
        ref_logp = None
        if run.reference is not None:
            with run.autocast:
                ref_logp = torch.cat([run.reference.logprobs(ro.rows(sl), temperature=hp.temperature) for sl in micro])
        t_ref = time.perf_counter() - t0

        # Every rank holds the whole batch's rewards from here.
        mine_graded, t_score = scoring.result()
        graded = graders.GradeResult.joined(ranks.whole_objects(mine_graded))
        rewards, finite = _reward_matrix(run, step, graded, batch_size, k)

        # 4-5. Advantages and the update ------------------------------------------------------------
        t0 = time.perf_counter()
        update = rloo_update(run, ro, mask, rewards, finite, ref_logp, micro)
        t_update = time.perf_counter() - t0

        # 6. Record, evaluate, checkpoint (the whole batch's figures, on every rank) ------------------
        mask_all, truncated_all = ranks.whole(mask), ranks.whole(ro.truncated)
        counters.trained_tokens += int(mask_all.sum().item()) + int(ranks.sum(ro.prompt_mask.sum()).item())
        # A step takes as long as its slowest rank.
        seconds = [t_generate, t_score, t_ref, t_update, time.perf_counter() - t_step, t_tools]
        timings = Timings(*ranks.max(torch.tensor(seconds, dtype=torch.float64)).tolist())
        metrics = step_metrics(
            step=step,
            total_steps=run.total_steps,
            rewards=rewards,
            finite=finite,
            mask=mask_all,
            truncated=truncated_all,
            update=update,
            timings=timings,
            trained_tokens=counters.trained_tokens,
        )
        _complete_metrics(run, step, metrics, graded, trajectories, timings, watch, recorder)
        _record_samples(run, step, prompts, ro, trajectories, rewards, update, recorder)
        if is_eval_step(run, step):
            with run.autocast:
                score, tool_figures = validation_pass(run, label=f"valid-{step}")
                metrics["valid_reward_mean"] = counters.valid_reward_mean = score
                metrics.update(tool_figures)
        if (stop := end_of_step(run, step, metrics, recorder, headline=HEADLINE)).done:
            break
    return finish(run, stop, recorder, headline=HEADLINE)


def _reward_matrix(run: Run, step: int, graded: graders.GradeResult, batch_size: int, k: int) -> tuple[Tensor, Tensor]:
    """The whole batch's rewards ``(batch_size, k)`` and where they are finite, on the device (advantages
    and KL never travel back to the host within the step); a step with no finite reward fails the job."""
    rewards = torch.tensor(graded.rewards, dtype=torch.float32).view(batch_size, k)
    finite = torch.isfinite(rewards)
    if not finite.any():
        raise JobError(
            "reward_not_finite",
            f"step {step}: no completion could be scored (all rewards NaN); "
            "check the grader with POST /v1/fine_tuning/alpha/graders/run",
        )
    return rewards.to(run.device), finite.to(run.device)


def _complete_metrics(
    run: Run,
    step: int,
    metrics: dict[str, Any],
    graded: graders.GradeResult,
    trajectories: list[Trajectory] | None,
    timings: Timings,
    watch: Diagnostics,
    recorder: Recorder,
) -> None:
    """Each grader's figures (its first error reported once a run), and a run with tools' figures,
    added to ``metrics``; then the signs of a run not learning as it should (once each, as events)."""
    _report_grader_errors(graded, step, run.counters, recorder)
    metrics.update(grader_metrics(graded))
    if trajectories is not None:
        metrics.update(tool_metrics([t.counts() for t in trajectories], run.ranks, timings))
    for message in watch.observe(metrics):
        recorder.event(message, level="warn")


def _record_samples(
    run: Run,
    step: int,
    prompts: list[str],
    ro: Rollout,
    trajectories: list[Trajectory] | None,
    rewards: Tensor,
    update: UpdateStats,
    recorder: Recorder,
) -> None:
    """On a sample step, a few prompts with their completions (each turn of a trajectory)."""
    ranks, hp = run.ranks, run.rl
    if is_sample_step(step, run.total_steps, hp.sample_interval):
        shown = ro.texts if trajectories is None else [transcript(t) for t in trajectories]
        texts = [text for share in ranks.whole_objects(shown) for text in share]
        recorder.samples(step, sample_groups(prompts, texts, rewards, update.advantages, groups=hp.sample_groups))


def micro_batches(prompts: int, k: int, accumulation: int) -> list[slice]:
    """The rows of each of ``accumulation`` micro-batches of ``prompts`` prompts' ``k`` completions:
    whole groups, so leave-one-out baselines never cross a micro-batch."""
    per = prompts // accumulation
    return [slice(m * per * k, (m + 1) * per * k) for m in range(accumulation)]


HEADLINE = "train_reward_mean"


def _prompt(run: Run, item: dict[str, Any]) -> str:
    """The text the policy continues: the line's prompt, with the tools it offers in a run with tools."""
    return prompt_text(item, run.tokenizer) if run.agent is None else run.agent.prompt(item, run.tokenizer)


def _rollouts(
    run: Run,
    batch: list[dict[str, Any]],
    prompts: list[str],
    *,
    seed: int,
    first: int,
    label: str,
    k: int | None = None,
) -> tuple[Rollout, list[Trajectory] | None, float]:
    """``k`` (``rloo_k``) rollouts of each prompt drawn from ``seed`` (``generate``'s): single
    completions, or for a run with tools its trajectories (``worker.engine.rollout.agent``); and the
    seconds spent waiting on tools."""
    k = run.rl.rloo_k if k is None else k
    if run.agent is None:
        return run.sampler.generate(prompts, k=k, generator_seed=seed, first=first), None, 0.0
    out = run_agent(
        run.agent, run.sampler, run.tokenizer, batch, prompts, k=k, generator_seed=seed, first=first, label=label
    )
    return out.rollout, out.trajectories, out.tool_seconds


def _score(
    run: Run,
    step: int,
    prompts: list[str],
    batch: list[dict[str, Any]],
    ro: Rollout,
    sampled: SampledTokens | None,
    trajectories: list[Trajectory] | None = None,
) -> graders.GradeResult:
    """The grader's scores of the step's completions (each prompt and item repeated k times)."""
    k = ro.group
    try:
        return score_batch(
            run.scorer,
            prompts=[p for p in prompts for _ in range(k)],
            texts=ro.texts,
            items=[item for item in batch for _ in range(k)],
            reward_models=run.reward_models,
            sampled=sampled,
            samples=None if trajectories is None else [t.sample() for t in trajectories],
        )
    except graders.GraderUnavailable as exc:
        raise JobError("grader_unavailable", f"step {step}: {exc}") from None


def sampled_tokens(run: Run, ro: Rollout, trajectories: list[Trajectory] | None = None) -> SampledTokens | None:
    """``ro``'s completions as sampled, for a grader with a reward model (which reads them where it
    has the policy's tokenizer); None for the others, and for trajectories (a reward model reads
    their answer's text, as any grader does)."""
    if trajectories is not None or not any(
        isinstance(leaf, graders.RewardModelGrader) for leaf in graders.leaves(run.scorer)
    ):
        return None
    return SampledTokens(run.tokenizer_digest, ro.sampled(run.special_token_ids))


def _report_grader_errors(graded: graders.GradeResult, step: int, counters: RunCounters, recorder: Recorder) -> None:
    """The first error of each grader, once a run, as a warning event."""
    for name, message in graded.messages.items():
        if name not in counters.reported_grader_errors:
            counters.reported_grader_errors.append(name)
            recorder.event(
                f"Grader '{name}' could not score a sample at step {step}: {message} (such samples "
                f"score NaN; graders.{name}.errors counts them)",
                level="warn",
            )


@torch.no_grad()
def validation_pass(run: Run, *, label: str = "valid") -> tuple[float, dict[str, float]]:
    """Mean reward of one sample on each of the first ``eval_samples`` validation prompts, and for a
    run with tools, the pass's tool calls per rollout (``valid_tool_calls_mean``) and share of
    well-formed calls (``valid_tool_well_formed_frac``); ``label`` names the pass in its rollouts' ids.

    Each prompt is sampled from its own seed, the same at every pass, so passes differ only by the
    model, and the training run's random state is left as it was. Ranks each take a share of the
    prompts.
    """
    valid = run.valid_items[: run.hp.eval_samples]
    mine = run.ranks.share(len(valid))
    batch = valid[mine]
    prompts = [_prompt(run, item) for item in batch]
    rewards: list[float] = []
    calls = [0, 0]  # calls, malformed ones
    with preserved_rng(run.device), run.sampler.sampling():
        for i in range(0, len(batch), 64):
            chunk, texts = batch[i : i + 64], prompts[i : i + 64]
            seed = run.cfg.seed + 7919  # the same at every pass
            ro, trajectories, _ = _rollouts(run, chunk, texts, seed=seed, first=mine.start + i, label=label, k=1)
            graded = _score(run, 0, texts, chunk, ro, sampled_tokens(run, ro, trajectories), trajectories)
            rewards.extend(r for r in graded.rewards if math.isfinite(r))
            for t in trajectories or ():
                calls[0] += t.calls
                calls[1] += t.malformed
    scored = [r for share in run.ranks.whole_objects(rewards) for r in share]
    mean = sum(scored) / len(scored) if scored else float("nan")
    if run.agent is None:
        return mean, {}
    made, malformed = (sum(c) for c in zip(*run.ranks.whole_objects(calls), strict=True))
    prompts_seen = len(valid)
    return mean, {
        "valid_tool_calls_mean": made / max(prompts_seen, 1),
        "valid_tool_well_formed_frac": (made - malformed) / made if made else float("nan"),
    }

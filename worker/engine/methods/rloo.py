"""The RLOO training loop, top to bottom: rollout, score, reference, update, record, checkpoint.

One function, ``train``, runs a job for the Celery task and for ``rloo train`` alike; where the
numbers go (database or stdout) is the ``Recorder``'s business. Setting up is ``worker.engine.prepare``'s,
checkpoints and resuming ``worker.engine.resume``'s, the math ``worker.engine.methods.policy_gradient``'s, the metrics
``worker.engine.metrics``'s.

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

import dataclasses
import enum
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from service import graders
from service.jobs.hyperparameters import ResolvedReinforcementHyperparameters
from worker.engine.config import TrainConfig
from worker.engine.data import batch_indices, prompt_text
from worker.engine.diagnostics import Diagnostics
from worker.engine.distributed.ranks import whole_tensor
from worker.engine.errors import JobError
from worker.engine.loop import Stop, TrainResult, end_of_step, finish, is_eval_step
from worker.engine.methods import policy_gradient
from worker.engine.metrics import Timings, UpdateStats, grader_metrics, step_metrics, tool_metrics
from worker.engine.overlap import Started
from worker.engine.prepare import prepare
from worker.engine.recorders import Recorder
from worker.engine.resume import preserved_rng
from worker.engine.rewards.scoring import SampledTokens, score_batch, scored_elsewhere
from worker.engine.rollout.agent import Trajectory, run_agent, transcript
from worker.engine.rollout.base import Rollout, completion_logprobs
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


class AdvantageTiming(enum.Enum):
    """When a step's advantages can be computed, which decides where the sampling policy's
    log-probs (the PPO ratio's denominator) come from."""

    FROM_REWARDS = "from_rewards"
    """No KL in the reward: every advantage from the rewards alone, before any forward; the sampling
    policy's log-probs are the first epoch's own forward, detached."""
    AFTER_PREPASS = "after_prepass"
    """KL in the reward, whitened across micro-batches or ranks: every group's KL is needed before
    the first loss, so one forward without grad gives the sampling policy's log-probs first (the one
    case that costs a forward)."""
    PER_MICRO_BATCH = "per_micro_batch"
    """KL in the reward, whitened (if at all) within one micro-batch of whole groups: each
    micro-batch's advantages from the first epoch's own forward, detached (no extra forward)."""


def advantage_timing(
    hp: ResolvedReinforcementHyperparameters, *, has_reference: bool, micro_batches: int, distributed: bool
) -> AdvantageTiming:
    if not (has_reference and hp.kl_in_reward):
        return AdvantageTiming.FROM_REWARDS
    if hp.normalize_advantages and (micro_batches > 1 or distributed):
        return AdvantageTiming.AFTER_PREPASS
    return AdvantageTiming.PER_MICRO_BATCH


@dataclass
class UpdateBatch:
    """What an update reads, in its three index spaces, named. ``ro``, ``mask``, ``loss_mask`` and
    ``ref_logp`` are this rank's completion rows; ``rewards`` and ``finite`` the whole batch's
    ``(B, k)``; micro-batch ``m`` is ``local[m]`` of this rank's rows and ``groups[m]`` of the whole
    batch's prompts; ``mine`` is this rank's prompts."""

    ro: Rollout
    mask: Tensor
    loss_mask: Tensor
    rewards: Tensor
    finite: Tensor
    ref_logp: Tensor | None
    mine: slice
    local: list[slice]
    groups: list[slice]
    dropped: Tensor | None
    """``(B,)``: the whole batch's groups out of the loss (``drop_constant_groups``), else None."""

    @classmethod
    def of(
        cls,
        run: Run,
        ro: Rollout,
        mask: Tensor,
        rewards: Tensor,
        finite: Tensor,
        ref_logp: Tensor | None,
        micro: list[slice],
    ) -> UpdateBatch:
        hp = run.rl
        mine = run.ranks.share(hp.batch_size)
        per = (mine.stop - mine.start) // len(micro)
        groups = [slice(mine.start + m * per, mine.start + (m + 1) * per) for m in range(len(micro))]
        loss_mask = mask * (~ro.truncated).unsqueeze(-1) if hp.mask_truncated_completions else mask
        dropped = policy_gradient.constant_groups(rewards, finite) if hp.drop_constant_groups else None
        if dropped is not None:  # out of the loss and its normaliser: they carry no signal
            kept = ~dropped[mine]
            loss_mask = loss_mask * kept.repeat_interleave(hp.rloo_k).unsqueeze(-1).to(loss_mask.dtype)
        return cls(ro, mask, loss_mask, rewards, finite, ref_logp, mine, micro, groups, dropped)


@dataclass
class SamplingSide:
    """The sampling policy's side of an update, complete after the first epoch: its log-probs a
    micro-batch, each completion's KL to the reference, the advantages, the entropy's sum."""

    old_logp: list[Tensor]
    kl_seq: Tensor
    advantages: Tensor
    entropy_sum: Tensor
    token_weights: list[Tensor | None] = dataclasses.field(default_factory=list)
    """A micro-batch's ``sampler_correction`` weights (None: uncorrected)."""
    sampler: Tensor | None = None
    """The trainer-sampler mismatch's statistics over this rank's micro-batches (a sampler that is
    not the policy), else None."""


def rloo_update(
    run: Run,
    ro: Rollout,
    mask: Tensor,
    rewards: Tensor,
    finite: Tensor,
    ref_logp: Tensor | None,
    micro: list[slice],
) -> UpdateStats:
    """Old log-probs and KL, the advantages, then ``ppo_epochs`` passes of micro-batched loss,
    backward and optimizer step.

    ``rewards`` and ``finite`` are the whole batch's ``(B, k)``; ``ro``, ``mask``, ``ref_logp`` and
    ``micro`` this rank's rows (all of them for one process). The loss of each rank's rows is divided
    by the whole batch's normaliser and the ranks' gradients are summed, so the update is the one a
    single process makes on the whole batch. The stats are the whole batch's."""
    b = UpdateBatch.of(run, ro, mask, rewards, finite, ref_logp, micro)
    timing = advantage_timing(
        run.rl, has_reference=ref_logp is not None, micro_batches=len(micro), distributed=run.ranks.distributed
    )
    run.model.train()
    side = _sampling_side_before_the_update(run, b, timing)
    loss_sum, clip_sum, grad_norm = _policy_epochs(run, b, side, timing)
    run.sampler.sync()  # the next rollouts come from the updated weights
    learning_rate = float(run.scheduler.get_last_lr()[0])
    run.scheduler.step()
    ranks = run.ranks
    # Each rank's loss and clip fraction are its rows' share of the whole batch's: they add up.
    return UpdateStats(
        ranks.whole(side.advantages[b.mine]),  # each rank computed its own rows for certain
        ranks.whole(side.kl_seq),
        ranks.sum(loss_sum),
        ranks.sum(clip_sum),
        ranks.sum(side.entropy_sum),
        whole_tensor(grad_norm),  # a DTensor when sharded
        learning_rate,
        None if side.sampler is None else _whole_sampler_stats(ranks, side.sampler),
    )


def _whole_sampler_stats(ranks: Any, stats: Tensor) -> Tensor:
    """The ranks' mismatch statistics added up (the largest: the largest)."""
    return torch.cat([ranks.sum(stats[:2]), ranks.max(stats[2:3]), ranks.sum(stats[3:])])


def _advantages(run: Run, b: UpdateBatch, kl: Tensor | None, rows: slice = slice(None)) -> Tensor:
    """The advantages of the whole batch's groups ``rows``."""
    hp = run.rl
    return policy_gradient.batch_advantages(
        b.rewards[rows],
        kl,
        b.finite[rows],
        estimator=hp.advantage_estimator,
        kl_coef=hp.kl_coef,
        reward_clip=hp.reward_clip,
        normalize=hp.normalize_advantages,
        dropped=None if b.dropped is None else b.dropped[rows],
    )


def _sampling_side_before_the_update(run: Run, b: UpdateBatch, timing: AdvantageTiming) -> SamplingSide:
    """What is known of the sampling policy before the first loss: every advantage when they need no
    KL; after a prepass, its log-probs, every KL and every advantage; else nothing yet."""
    device = run.device
    side = SamplingSide(
        old_logp=[],
        kl_seq=torch.zeros(b.ro.completion_ids.shape[0], device=device),
        advantages=torch.zeros_like(b.rewards),  # the whole batch's (B, k)
        entropy_sum=torch.zeros((), device=device),
    )
    if timing is AdvantageTiming.FROM_REWARDS:
        side.advantages = _advantages(run, b, None)
    elif timing is AdvantageTiming.AFTER_PREPASS:
        assert b.ref_logp is not None
        with torch.no_grad(), run.autocast:
            for sl in b.local:
                side.old_logp.append(completion_logprobs(run.model, b.ro.rows(sl), temperature=run.rl.temperature)[0])
        side.kl_seq = policy_gradient.sequence_kl(
            torch.cat(side.old_logp), b.ref_logp, b.mask, run.rl.kl_estimator
        ).float()
        side.advantages = _advantages(run, b, run.ranks.whole(side.kl_seq).view_as(b.rewards))
    return side


def _first_epoch(
    run: Run, b: UpdateBatch, side: SamplingSide, timing: AdvantageTiming, m: int, logp: Tensor, entropy: Tensor | None
) -> None:
    """Micro-batch ``m``'s share of the sampling side, from the first epoch's forward: its old
    log-probs (unless a prepass gave them), entropy, KL and, per micro-batch, its advantages."""
    sl, rows, hp = b.local[m], b.groups[m], run.rl
    if timing is not AdvantageTiming.AFTER_PREPASS:
        side.old_logp.append(logp.detach())  # the sampling policy: no extra forward for it
    if entropy is not None:
        side.entropy_sum += (entropy.float() * b.mask[sl]).sum()
    if b.ref_logp is not None:
        side.kl_seq[sl] = policy_gradient.sequence_kl(side.old_logp[m], b.ref_logp[sl], b.mask[sl], hp.kl_estimator)
    side.token_weights.append(_sampler_correction(run, b, side, m))
    if timing is AdvantageTiming.PER_MICRO_BATCH:
        # Whole groups: this micro-batch's leave-one-out advantages are the batch's.
        kl = side.kl_seq[sl].view(rows.stop - rows.start, hp.rloo_k)
        side.advantages[rows] = _advantages(run, b, kl, rows)


def _sampler_correction(run: Run, b: UpdateBatch, side: SamplingSide, m: int) -> Tensor | None:
    """Micro-batch ``m``'s token weights for a sampler that is not the policy (None: the policy
    sampled, or ``sampler_correction`` is none), its mismatch added to ``side.sampler``."""
    sampled = b.ro.sampler_logprobs
    if sampled is None:
        return None
    sl, hp = b.local[m], run.rl
    mode = correction_mode(hp, has_sampler_logprobs=True)
    # Over every sampled token (a truncated or dropped completion's too); the weights act on loss tokens only.
    weights, stats = policy_gradient.sampler_correction(
        side.old_logp[m], sampled[sl].to(run.device), b.mask[sl], mode=mode, cap=hp.sampler_correction_cap
    )
    side.sampler = stats if side.sampler is None else policy_gradient.merged_sampler_stats(side.sampler, stats)
    return None if mode == "none" else weights


def correction_mode(hp: ResolvedReinforcementHyperparameters, *, has_sampler_logprobs: bool) -> str:
    """``sampler_correction`` resolved: none where the policy sampled (the ratio is exactly 1);
    auto is tis where the sampler reports its log-probs of the distribution the trainer scores
    (top_p 1: a nucleus renormalises the sampler's), none otherwise."""
    if not has_sampler_logprobs:
        return "none"
    if hp.sampler_correction == "auto":
        return "tis" if hp.top_p == 1.0 else "none"
    return hp.sampler_correction


def _policy_epochs(
    run: Run, b: UpdateBatch, side: SamplingSide, timing: AdvantageTiming
) -> tuple[Tensor, Tensor, Tensor]:
    """``ppo_epochs`` passes over the micro-batches: loss, backward, then a clipped optimizer step.
    The last pass's loss and clip fraction sums, and its gradient norm."""
    hp, device = run.rl, run.device
    whole_loss_mask = run.ranks.whole(b.loss_mask)
    norm = policy_gradient.loss_normalizer(whole_loss_mask, hp.loss_aggregation, hp.max_new_tokens)
    stats_norm = policy_gradient.stats_normalizer_of(whole_loss_mask, hp.loss_aggregation, hp.max_new_tokens)
    has_loss = bool(whole_loss_mask.any())
    for epoch in range(hp.ppo_epochs):
        run.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        clip_sum = torch.zeros((), device=device)
        for m, sl in enumerate(b.local):
            with run.autocast:
                logp, entropy = completion_logprobs(
                    run.model, b.ro.rows(sl), temperature=hp.temperature, with_entropy=epoch == 0
                )
            if epoch == 0:
                _first_epoch(run, b, side, timing, m, logp, entropy)
            loss, stats = _micro_batch_loss(run, b, side, m, logp, norm, stats_norm)
            loss.backward()
            loss_sum += loss.detach()
            clip_sum += stats["ratio_clip_frac"]
        grad_norm = torch.nn.utils.clip_grad_norm_(run.params, hp.max_grad_norm)
        if has_loss:  # else the gradient is all zero: AdamW's momentum and decay must not move the weights
            run.optimizer.step()
    return loss_sum, clip_sum, grad_norm


def _micro_batch_loss(
    run: Run, b: UpdateBatch, side: SamplingSide, m: int, logp: Tensor, norm: Tensor, stats_norm: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped policy loss of micro-batch ``m`` (plus the KL term when it is not in the reward),
    divided by the whole batch's normaliser."""
    sl, hp = b.local[m], run.rl
    loss, stats = policy_gradient.policy_loss(
        logp.float(),
        side.old_logp[m].float(),
        side.advantages[b.groups[m]].reshape(-1).to(run.device),
        b.loss_mask[sl],
        clip_epsilon=hp.clip_epsilon,
        clip_epsilon_high=hp.clip_epsilon_high,
        aggregation=hp.loss_aggregation,
        normalizer=norm,
        budget=hp.max_new_tokens,
        stats_normalizer=stats_norm,
        token_weights=side.token_weights[m],
    )
    if b.ref_logp is not None and not hp.kl_in_reward:
        loss = loss + hp.kl_coef * policy_gradient.kl_loss(
            logp.float(),
            b.ref_logp[sl].float(),
            b.loss_mask[sl],
            estimator=hp.kl_estimator,
            aggregation=hp.loss_aggregation,
            normalizer=norm,
            budget=hp.max_new_tokens,
        )
    return loss, stats


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

"""The RLOO update of one step, after its rollouts are scored: the sampling policy's side (its
log-probs, each completion's KL to the reference, the advantages, the sampler's mismatch), then
``ppo_epochs`` passes of micro-batched clipped loss, backward and optimizer step. The step's loop is
``worker.engine.methods.rloo``'s; the pure math ``worker.engine.methods.policy_gradient``'s."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from service.jobs.hyperparameters import ResolvedReinforcementHyperparameters
from worker.engine.distributed.ranks import whole_tensor
from worker.engine.methods import policy_gradient
from worker.engine.metrics import UpdateStats
from worker.engine.rollout.base import Rollout, completion_logprobs
from worker.engine.state import Run


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

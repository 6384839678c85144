"""The RLOO math: pure tensor functions, no I/O, no models.

RLOO (Ahmadian et al. 2024) is REINFORCE with a leave-one-out baseline: each of the k completions
of a prompt is compared with the mean reward of the *other* k-1. How this module differs from
its cousins:

* GRPO subtracts the mean of *all* k rewards (the completion leaks into its own baseline) and
  divides by their std; RLOO's baseline excludes the completion and is unbiased.
* PPO learns a critic; RLOO has none: the group is the critic.
* ``advantages(rewards, estimator)`` also gives GRPO's, plain REINFORCE's and REINFORCE with the
  group mean as its baseline, for comparison (``advantage_estimator``; ``benchmarks/learning/``).
* KL to the reference is folded into the reward before the baseline, as in the paper and TRL
  (``kl_in_reward``), or added to the loss as a separate term.

Layout: rewards are ``(B, k)``: row ``b`` is a prompt, column ``i`` one of its k completions.
Completions are flattened prompt-major, so completion ``b * k + i`` is row ``b``, column ``i``.
(TRL's first RLOO trainer used ``(k, B)``; the layouts disagree, so the tests pin this one.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def rloo_advantages(rewards: Tensor) -> Tensor:
    """Leave-one-out advantages. ``(B, k)`` float in, ``(B, k)`` out.

    ``A[b, i] = r[b, i] - (sum_j r[b, j] - r[b, i]) / (n_b - 1)`` with ``n_b`` the finite rewards of
    row ``b``. NaN rewards (a completion that could not be scored) take no part in any baseline and
    get advantage 0; a row with fewer than two finite rewards gives 0 to all its members.
    """
    r, finite, n = _finite_rows(rewards)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (n - 1).clamp(min=1)
    return torch.where(finite & (n >= 2), r - baseline, torch.zeros_like(r))


def grpo_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """GRPO's (DeepSeekMath): the group's mean subtracted, divided by the group's std.
    ``(B, k)`` in and out.

    ``A[b, i] = (r[b, i] - mean_b) / (std_b + eps)`` over the finite rewards of row ``b`` (the
    sample std, as TRL's GRPO; ``eps`` as TRL's). The completion is in its own baseline, and the
    division weighs each group by how little its rewards differ: a biased estimate of the policy
    gradient. NaN and rows with fewer than two finite rewards as ``rloo_advantages``.
    """
    r, finite, n = _finite_rows(rewards)
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(finite, r - mean, torch.zeros_like(r))
    std = (centred.pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    return torch.where(finite & (n >= 2), centred / (std + eps), torch.zeros_like(r))


def reinforce_advantages(rewards: Tensor) -> Tensor:
    """Plain REINFORCE: the reward itself, no baseline. ``(B, k)`` in and out; NaN gives 0.

    Unbiased, and not shift-invariant: every completion's log-probability is pushed by its whole
    reward, whatever its siblings scored, so a reward whose zero is not where failures sit adds
    variance that a baseline removes (``benchmarks/learning/`` measures it). Needs no group
    (``k`` may be 1).
    """
    r, finite, _ = _finite_rows(rewards)
    return torch.where(finite, r, torch.zeros_like(r))


def reinforce_mean_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE with the group's mean *including* the completion as its baseline.
    ``(B, k)`` in and out; NaN and short rows as ``rloo_advantages``.

    ``r - mean(all n) = (n - 1) / n * (r - mean(the others))``: RLOO's advantage shrunk by
    ``(n - 1) / n``, so its expected gradient is RLOO's (the true one) times ``(k - 1) / k``.
    """
    r, finite, n = _finite_rows(rewards)
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    return torch.where(finite & (n >= 2), r - mean, torch.zeros_like(r))


ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "rloo": rloo_advantages,
    "grpo": grpo_advantages,
    "reinforce": reinforce_advantages,
    "reinforce_mean": reinforce_mean_advantages,
}
"""``advantage_estimator`` -> its function: ``(B, k)`` rewards in, ``(B, k)`` advantages out."""

GROUP_ESTIMATORS = ("rloo", "grpo", "reinforce_mean")
"""The estimators whose baseline is the rest of the group: they need ``k >= 2`` (REINFORCE does not)."""


def advantages(rewards: Tensor, estimator: str = "rloo") -> Tensor:
    """Advantages of ``rewards`` by the named estimator (``ESTIMATORS``). ``(B, k)`` in and out,
    NaN-aware: an unscored completion gets 0 and is no one's baseline."""
    try:
        fn = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown advantage estimator '{estimator}'; use one of {', '.join(ESTIMATORS)}") from None
    return fn(rewards)


def _finite_rows(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rewards with NaN as 0, which are finite, finite count per row (B, 1))`` of a ``(B, k)``."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, k); got shape {tuple(rewards.shape)}")
    finite = torch.isfinite(rewards)
    r = torch.where(finite, rewards, torch.zeros_like(rewards))
    return r, finite, finite.sum(dim=1, keepdim=True)


def constant_groups(rewards: Tensor, finite: Tensor) -> Tensor:
    """``(B,)`` bool: the groups whose finite rewards are all equal, or fewer than two. Under a group
    baseline (RLOO, GRPO, the group mean) their advantages are all 0: they carry no signal, and
    ``drop_constant_groups`` leaves them out of the loss's normaliser too."""
    group_max = torch.where(finite, rewards, -math.inf).amax(dim=1)
    group_min = torch.where(finite, rewards, math.inf).amin(dim=1)
    return (finite.sum(dim=1) < 2) | (group_max == group_min)


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Zero mean, unit std over the entries where ``mask`` is true; others stay 0."""
    mask = mask.bool()
    if mask.sum() < 2:
        return torch.zeros_like(values)
    selected = values[mask]
    out = (values - selected.mean()) / (selected.std() + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def kl_per_token(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate of the policy to the reference, from log-probs of the sampled tokens.

    ``d = logp - ref_logp``; ``k1 = d`` (unbiased, can be negative); ``k3 = exp(-d) - 1 + d``
    (Schulman's estimator: unbiased, always >= 0, lower variance). Shapes: any, equal.
    """
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator '{estimator}'; use 'k1' or 'k3'")


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """KL of each completion: per-token KL summed over its completion tokens. ``(N, T) -> (N,)``."""
    return (kl_per_token(logp, ref_logp, estimator) * mask).sum(dim=-1)


def shape_rewards(
    rewards: Tensor,
    kl: Tensor | None = None,
    *,
    kl_coef: float = 0.0,
    reward_clip: float | None = None,
) -> Tensor:
    """The reward the baseline sees: ``clip(r, -c, c) - kl_coef * kl``. ``(B, k)`` in and out.

    Clipping comes first, so the KL penalty is never clipped away; NaN (unscorable) stays NaN.
    ``kl`` is the per-completion KL ``(B, k)``, or None when it is not folded into the reward.
    """
    out = rewards.clamp(-reward_clip, reward_clip) if reward_clip is not None else rewards
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.to(out.dtype)
    return out


def batch_advantages(
    rewards: Tensor,
    kl: Tensor | None,
    finite: Tensor,
    *,
    estimator: str = "rloo",
    kl_coef: float = 0.0,
    reward_clip: float | None = None,
    normalize: bool = False,
    dropped: Tensor | None = None,
) -> Tensor:
    """The advantage recipe: shape the rewards (clip, KL penalty), take the estimator's advantages
    (leave-one-out by default), whiten them if asked. ``(B, k)`` in and out; ``finite`` marks the
    rewards that were scored; ``dropped`` ``(B,)`` the groups out of the loss (``drop_constant_groups``).

    Whitening covers only advantages that carry signal: in a group estimator's groups with fewer
    than two finite rewards they stay at 0, and dropped groups take no part. Rows are independent
    unless ``normalize``: any set of whole groups gives the same values as the whole batch.
    """
    shaped = shape_rewards(rewards, kl, kl_coef=kl_coef, reward_clip=reward_clip)
    out = advantages(shaped, estimator)
    if normalize:
        signal = finite if estimator not in GROUP_ESTIMATORS else finite & (finite.sum(dim=1, keepdim=True) >= 2)
        if dropped is not None:
            signal = signal & ~dropped.unsqueeze(1)
        out = whiten(out, signal)
    return out


SAMPLER_CORRECTIONS = ("tis", "mask", "none")


def sampler_correction(
    trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, *, mode: str, cap: float
) -> tuple[Tensor, Tensor]:
    """Token weights that correct for a sampler that is not the policy (vLLM), and the mismatch's
    statistics. ``(N, T)`` each in; ``sampler_logp`` NaN where the sampler gave no log-prob (such a
    token is not corrected and not counted).

    With ``rho = pi_trainer / pi_sampler`` per token (the first pass's, detached):

    * ``tis`` (truncated importance sampling): weight ``min(rho, cap)``: the gradient of a token
      sampled where the sampler put more mass than the trainer shrinks, and no token weighs more
      than ``cap``;
    * ``mask``: weight 0 on every token of a completion with a token past the bound either way
      (``rho > cap`` or ``rho < 1 / cap``), 1 elsewhere;
    * ``none``: weight 1.

    Returns the weights ``(N, T)`` and ``[sum |log rho|, tokens counted, max |log rho|, corrected,
    out of]`` (corrected: tokens truncated out of the tokens counted, or completions masked out of
    the completions), to add up over micro-batches and ranks (the max: its largest).
    """
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"unknown sampler_correction '{mode}'; use {', '.join(SAMPLER_CORRECTIONS)}")
    known = mask.bool() & torch.isfinite(sampler_logp)
    log_rho = torch.where(known, trainer_logp.detach().float() - sampler_logp.float(), torch.zeros_like(trainer_logp))
    ones = torch.ones_like(log_rho)
    out_of = known.sum()
    if mode == "tis":
        weights = torch.where(known, log_rho.exp().clamp(max=cap), ones)
        corrected = (known & (log_rho > math.log(cap))).sum()
    elif mode == "mask":
        past = (known & (log_rho.abs() > math.log(cap))).any(dim=1)
        weights = torch.where(past.unsqueeze(1), torch.zeros_like(ones), ones)
        corrected, out_of = past.sum(), (mask.sum(dim=1) > 0).sum()
    else:
        weights, corrected = ones, torch.zeros((), dtype=torch.long, device=ones.device)
    largest = log_rho.abs().max() if known.any() else torch.zeros((), device=log_rho.device)
    parts = [log_rho.abs().sum(), known.sum().float(), largest, corrected.float(), out_of.float()]
    stats = torch.stack(parts)
    return weights, stats


def merged_sampler_stats(a: Tensor, b: Tensor) -> Tensor:
    """Two parts' ``sampler_correction`` statistics as one: sums added, the largest kept."""
    return torch.cat([a[:2] + b[:2], a[2:3].maximum(b[2:3]), a[3:] + b[3:]])


# exp(20) ~ 5e8: far past any clip range, and never inf (inf * an advantage of 0 would be NaN).
MAX_LOG_RATIO = 20.0


AGGREGATIONS = ("sequence_sum", "token_mean", "sequence_mean", "constant")
"""``loss_aggregation``'s values: how a batch's per-token terms become one loss (``policy_loss``)."""

TOKEN_LEVEL = ("token_mean", "constant")
"""The aggregations with a ratio, and a clip, per token (the others: one per completion)."""


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss_aggregation '{aggregation}'; use {', '.join(AGGREGATIONS)}")


def loss_normalizer(mask: Tensor, aggregation: str, budget: int | None = None) -> Tensor:
    """What a batch's summed loss is divided by: its loss tokens (``token_mean``); its completions
    with at least one loss token (``sequence_sum``, ``sequence_mean``); those completions times
    ``budget`` tokens each (``constant``: Dr. GRPO's fixed length, ``max_new_tokens``), so that a
    completion's tokens weigh the same however long it and its batch are. Micro-batches are divided
    by the whole batch's normalizer, so their losses and gradients add up to the full batch's exactly."""
    _check_aggregation(aggregation)
    if aggregation == "token_mean":
        return mask.sum().clamp(min=1.0)
    completions = (mask.sum(dim=-1) > 0).sum().to(mask.dtype).clamp(min=1.0)
    if aggregation == "constant":
        if budget is None or budget < 1:
            raise ValueError("loss_aggregation 'constant' needs the token budget (max_new_tokens)")
        return completions * budget
    return completions


def _stats_normalizer(
    mask: Tensor,
    aggregation: str,
    budget: int | None,
    normalizer: Tensor | float | None,
    stats_normalizer: Tensor | float | None,
) -> Tensor | float:
    if stats_normalizer is not None:
        return stats_normalizer
    if normalizer is None:
        return stats_normalizer_of(mask, aggregation, budget)
    if aggregation == "constant":  # a micro-batch's own tokens would not add up to the batch's share
        raise ValueError("loss_aggregation 'constant' with a normalizer needs the whole batch's stats_normalizer too")
    return normalizer


def stats_normalizer_of(mask: Tensor, aggregation: str, budget: int | None = None) -> Tensor:
    """What ``policy_loss``'s statistics are divided by: the loss's normaliser, but a token-level
    aggregation's tokens (``constant``'s budget counts tokens never written)."""
    return loss_normalizer(mask, "token_mean" if aggregation in TOKEN_LEVEL else aggregation, budget)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_epsilon: float = 0.2,
    clip_epsilon_high: float | None = None,
    aggregation: str = "sequence_sum",
    normalizer: Tensor | float | None = None,
    budget: int | None = None,
    stats_normalizer: Tensor | float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss over completion tokens.

    Shapes: ``logp``, ``old_logp``, ``mask`` are ``(N, T)`` (token log-probs of the sampled
    completion; ``mask`` is 1 on loss tokens: completion tokens up to and including EOS, never
    padding); ``advantages`` is ``(N,)``, held constant. A completion whose mask is all 0 (e.g. a
    truncated one under ``mask_truncated_completions``) carries no loss and is not counted.

    The importance ratio matches the aggregation, so that each gives its own token weighting and
    the plain REINFORCE gradient when the ratio is 1 (the first, or only, pass):

    * ``sequence_sum`` (TRL): one ratio per completion, ``exp(sum_t (logp - old_logp))``;
      loss = mean over completions of ``-min(ratio * A, clip(ratio) * A)``; gradient
      ``A * sum_t grad logp_t``.
    * ``sequence_mean`` (length-normalised, as GSPO): ratio ``exp(mean_t (logp - old_logp))``;
      gradient ``A * mean_t grad logp_t``.
    * ``token_mean`` (DAPO, verl, OpenRLHF): a ratio per token, clipped per token, averaged over all
      completion tokens of the batch: gradient ``sum_i A_i sum_t grad logp_it / sum_i |y_i|``, every
      token of the batch weighing the same (a long completion more than a short one).
    * ``constant`` (Dr. GRPO): per token as ``token_mean``, summed and divided by a constant budget,
      ``completions * budget`` (``budget``: ``max_new_tokens``): gradient ``sequence_sum``'s over
      ``budget``, with no length bias and no dependence on the batch's lengths.

    ``normalizer`` (default ``loss_normalizer(mask, aggregation, budget)``) divides the summed loss;
    pass the whole batch's to a micro-batch. Returns the scalar loss and detached statistics
    (``ratio_clip_frac``: the share of the loss whose ratio was clipped, and ``ratio_mean``),
    divided by ``stats_normalizer`` (default: the loss's normaliser, but the tokens for ``constant``,
    whose budget would understate them: ``stats_normalizer_of``), so micro-batches' statistics add
    up too: a micro-batch of ``constant`` passes the whole batch's.

    ``token_weights`` ``(N, T)`` (``sampler_correction``'s, detached) weigh each token's part: a
    token-level aggregation's terms are multiplied by them; a sequence-level one's log-ratio is the
    weighted sum of its tokens', so that its first-pass gradient is ``A * sum_t w_t grad logp_t``.
    """
    low = clip_epsilon
    high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
    mask = mask.to(logp.dtype)
    norm = loss_normalizer(mask, aggregation, budget) if normalizer is None else normalizer
    stats_norm = _stats_normalizer(mask, aggregation, budget, normalizer, stats_normalizer)
    # where, not multiply: a -inf log-prob on a padding position must not turn into NaN.
    delta = torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp))
    lengths = mask.sum(dim=-1)
    if aggregation in TOKEN_LEVEL:
        ratio = torch.exp(delta.clamp(max=MAX_LOG_RATIO))
        adv = advantages.unsqueeze(-1)
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
        counted = mask  # the statistics count tokens, not their weights
        weight = mask if token_weights is None else mask * token_weights.to(mask.dtype)
    elif aggregation in ("sequence_sum", "sequence_mean"):
        log_ratio = (delta if token_weights is None else delta * token_weights.to(delta.dtype)).sum(dim=-1)
        if aggregation == "sequence_mean":
            log_ratio = log_ratio / lengths.clamp(min=1.0)
        ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
        weight = counted = (lengths > 0).to(logp.dtype)
    else:
        _check_aggregation(aggregation)
        raise AssertionError(aggregation)
    loss = (-torch.minimum(unclipped, clipped) * weight).sum() / norm
    clip_frac = ((clipped < unclipped).to(logp.dtype) * counted).sum() / stats_norm
    ratio_mean = (ratio * counted).sum() / stats_norm
    return loss, {"ratio_clip_frac": clip_frac.detach(), "ratio_mean": ratio_mean.detach()}


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    aggregation: str = "sequence_sum",
    normalizer: Tensor | float | None = None,
    budget: int | None = None,
) -> Tensor:
    """KL as a loss term (``kl_in_reward`` false), aggregated and normalised like the policy loss.
    ``(N, T) -> ()``."""
    _check_aggregation(aggregation)
    mask = mask.to(logp.dtype)
    norm = loss_normalizer(mask, aggregation, budget) if normalizer is None else normalizer
    kl = torch.where(mask.bool(), kl_per_token(logp, ref_logp, estimator), torch.zeros_like(logp))
    if aggregation in TOKEN_LEVEL:
        return kl.sum() / norm
    per_seq = kl.sum(dim=-1)
    if aggregation == "sequence_mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / norm

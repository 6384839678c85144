"""Hand-worked checks of the RLOO math in worker/engine/methods/policy_gradient.py, through its documented name
``worker.rloo`` (spec: docs/algorithm.md). Arithmetic in comments."""

import math

import pytest
import torch

from worker import rloo

NAN, INF = float("nan"), float("inf")


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def close(got, want, atol=1e-6):
    torch.testing.assert_close(got, t(want) if not isinstance(want, torch.Tensor) else want, atol=atol, rtol=0.0)


# ---------------------------------------------------------------- rloo_advantages
def test_worked_example_of_the_spec():
    # sum = 0.8 + 0.5 + 0.6 + 0.7 = 2.6; A_i = r_i - (2.6 - r_i) / 3
    # A0 = 0.8 - 1.8/3 = 0.8 - 0.6    =  0.2
    # A1 = 0.5 - 2.1/3 = 0.5 - 0.7    = -0.2
    # A2 = 0.6 - 2.0/3 = 0.6 - 0.6667 = -1/15
    # A3 = 0.7 - 1.9/3 = 0.7 - 0.6333 = +1/15
    adv = rloo.rloo_advantages(t([[0.8, 0.5, 0.6, 0.7]]))
    close(adv, [[0.2, -0.2, -1 / 15, 1 / 15]])
    close(adv.sum(), 0.0)


def test_group_sums_to_zero_and_equals_scaled_centering():
    # sum_i A_i = S - (k*S - S)/(k-1) = 0, and A_i = k/(k-1) * (r_i - mean)
    r = torch.rand(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = rloo.rloo_advantages(r)
    close(adv.sum(dim=1), torch.zeros(5, dtype=torch.float64))
    close(adv, 4 / 3 * (r - r.mean(dim=1, keepdim=True)))


def test_layout_is_rows_prompts_columns_rollouts():
    # B=2 prompts, k=3 rollouts. Row 0: S=6,  A = r - (6 - r)/2  -> 1-2.5, 2-2, 3-1.5 = -1.5, 0, 1.5
    #                            Row 1: S=70, A = r - (70 - r)/2 -> 10-30, 20-25, 40-15 = -20, -5, 25
    # Read as (k, B) the groups would be the columns {1,10}, {2,20}, {3,40}: A = -9, 9, ... instead.
    r = t([[1.0, 2.0, 3.0], [10.0, 20.0, 40.0]])
    adv = rloo.rloo_advantages(r)
    close(adv, [[-1.5, 0.0, 1.5], [-20.0, -5.0, 25.0]])
    # prompt-major flattening: completion b*k + i is row b, column i
    close(adv.view(-1)[1 * 3 + 2], 25.0)


def test_two_rollouts():
    # k=2: A0 = 1 - 3 = -2, A1 = 3 - 1 = 2
    close(rloo.rloo_advantages(t([[1.0, 3.0]])), [[-2.0, 2.0]])


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_reward_left_out_of_baseline(bad):
    # finite {1, 3, 5}: n=3, S=9. A = r - (9 - r)/2 -> 1-4 = -3, 3-3 = 0, 5-2 = 3; the bad one gets 0.
    adv = rloo.rloo_advantages(t([[1.0, bad, 3.0, 5.0]]))
    close(adv, [[-3.0, 0.0, 0.0, 3.0]])
    close(rloo.rloo_advantages(t([[1.0, 3.0, 5.0]])), [[-3.0, 0.0, 3.0]])  # same as without it


def test_groups_with_fewer_than_two_finite_rewards_get_zero():
    r = t(
        [
            [NAN, 2.0, NAN, NAN],  # one finite -> all 0
            [NAN, NAN, NAN, NAN],  # none finite -> all 0
            [INF, 7.0, -INF, NAN],  # one finite (infs count as NaN) -> all 0
            [4.0, NAN, 2.0, INF],
        ]
    )  # finite {4, 2}: A = 4-2 = 2, 2-4 = -2
    adv = rloo.rloo_advantages(r)
    close(adv, [[0.0] * 4, [0.0] * 4, [0.0] * 4, [2.0, 0.0, -2.0, 0.0]])
    assert torch.isfinite(adv).all()
    close(adv.sum(dim=1), torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), ()])
def test_rejects_non_2d(shape):
    with pytest.raises(ValueError):
        rloo.rloo_advantages(torch.zeros(shape))


# ---------------------------------------------------------------- the other estimators
SEED_EXAMPLE = [[0.8, 0.5, 0.6, 0.7]]  # the seed's: 0.8 against 0.5, 0.6 and 0.7


def test_advantages_defaults_to_rloo_on_the_seeds_example():
    # 0.8's baseline is (0.5 + 0.6 + 0.7) / 3 = 0.6: advantage 0.2 (the rest as in the worked example above)
    close(rloo.advantages(t(SEED_EXAMPLE)), [[0.2, -0.2, -1 / 15, 1 / 15]])
    close(rloo.advantages(t(SEED_EXAMPLE), "rloo"), [[0.2, -0.2, -1 / 15, 1 / 15]])


def test_reinforce_is_the_reward_itself():
    close(rloo.advantages(t(SEED_EXAMPLE), "reinforce"), SEED_EXAMPLE)


def test_reinforce_mean_includes_the_completion_and_shrinks_rloo_by_k_minus_1_over_k():
    # mean of all four = 2.6 / 4 = 0.65: 0.8 - 0.65 = 0.15, -0.15, -0.05, 0.05 = 3/4 of RLOO's
    adv = rloo.advantages(t(SEED_EXAMPLE), "reinforce_mean")
    close(adv, [[0.15, -0.15, -0.05, 0.05]])
    close(adv, 3 / 4 * rloo.rloo_advantages(t(SEED_EXAMPLE)))


def test_grpo_divides_the_centred_rewards_by_the_groups_sample_std():
    # centred as reinforce_mean: 0.15, -0.15, -0.05, 0.05; sample std = sqrt((2*0.0225 + 2*0.0025) / 3)
    # = sqrt(0.05 / 3) = 0.1290994; 0.15 / (0.1290994 + 1e-4) = 1.1610, 0.05 / 0.1291994 = 0.38700
    std = math.sqrt(0.05 / 3) + 1e-4
    close(rloo.advantages(t(SEED_EXAMPLE), "grpo"), [[0.15 / std, -0.15 / std, -0.05 / std, 0.05 / std]])
    close(rloo.advantages(t(SEED_EXAMPLE), "grpo")[0, 0], 1.1610, atol=1e-4)


def test_grpo_gives_zero_to_a_group_whose_rewards_are_all_equal():
    close(rloo.advantages(t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), "grpo"), [[0.0] * 3, [0.0] * 3])


@pytest.mark.parametrize("bad", [NAN, INF])
def test_every_estimator_leaves_an_unscored_completion_out(bad):
    # finite {1, 3, 5}: each estimator gives the unscored one 0 and the others what {1, 3, 5} alone gives
    r = t([[1.0, bad, 3.0, 5.0]])
    for name in rloo.ESTIMATORS:
        adv = rloo.advantages(r, name)
        alone = rloo.advantages(t([[1.0, 3.0, 5.0]]), name)
        close(adv, [[alone[0, 0].item(), 0.0, alone[0, 1].item(), alone[0, 2].item()]])
    close(rloo.advantages(r, "reinforce_mean"), [[-2.0, 0.0, 0.0, 2.0]])  # mean 3
    close(rloo.advantages(r, "reinforce"), [[1.0, 0.0, 3.0, 5.0]])


def test_group_estimators_need_two_finite_rewards_reinforce_needs_none():
    r = t([[NAN, 2.0, NAN], [4.0, NAN, 2.0]])
    for name in rloo.GROUP_ESTIMATORS:
        assert rloo.advantages(r, name)[0].abs().sum().item() == 0.0, name
    close(rloo.advantages(r, "reinforce"), [[0.0, 2.0, 0.0], [4.0, 0.0, 2.0]])
    close(rloo.advantages(t([[0.3], [0.9]]), "reinforce"), [[0.3], [0.9]])  # k = 1: one sample a prompt


def test_unknown_advantage_estimator_names_the_known_ones():
    with pytest.raises(ValueError, match="rloo, grpo, reinforce, reinforce_mean"):
        rloo.advantages(t(SEED_EXAMPLE), "ppo")
    with pytest.raises(ValueError):
        rloo.advantages(t([0.1, 0.2]), "grpo")  # (B, k) only


def test_whitening_a_reinforce_batch_keeps_groups_of_one():
    # reinforce, k = 1: every finite reward is signal; whitened over all four finite rewards 1, 2, 3, 4
    r = t([[1.0], [2.0], [3.0], [4.0]])
    adv = rloo.batch_advantages(r, None, torch.isfinite(r), estimator="reinforce", normalize=True)
    close(adv, (r - 2.5) / (r.std() + 1e-8))


def test_every_estimator_the_api_takes_has_a_function_and_a_least_k():
    from typing import get_args

    from service.jobs.hyperparameters import AdvantageEstimator, least_rloo_k

    assert get_args(AdvantageEstimator) == tuple(rloo.ESTIMATORS)
    assert {name for name in rloo.ESTIMATORS if least_rloo_k(name) == 2} == set(rloo.GROUP_ESTIMATORS)


def _bandit_gradients(estimator: str, *, batches: int = 20_000, k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy gradients of a 3-armed softmax bandit with Bernoulli rewards, one per batch of k pulls:
    ``sum_i A_i * grad log pi(a_i) / k``. Returns (their mean, its standard error), each (3,)."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(t([0.5, 0.0, -0.5]), dim=0)
    pay = t([0.8, 0.5, 0.2])
    arms = torch.multinomial(probs, batches * k, replacement=True, generator=g).view(batches, k)
    rewards = torch.bernoulli(pay[arms], generator=g)
    adv = rloo.advantages(rewards, estimator)
    score = torch.nn.functional.one_hot(arms, 3).to(torch.float64) - probs  # grad of log softmax
    grads = (adv.unsqueeze(-1) * score).sum(dim=1) / k
    return grads.mean(dim=0), grads.std(dim=0) / math.sqrt(batches)


def test_leave_one_out_is_unbiased_and_the_mean_baseline_shrinks_the_gradient_by_k_minus_1_over_k():
    # The true gradient of J = sum_a pi(a) pay(a) is pi * (pay - pi . pay) (softmax). REINFORCE and RLOO
    # estimate it without bias; the mean baseline estimates 3/4 of it (k = 4); RLOO's noise is the least.
    probs = torch.softmax(t([0.5, 0.0, -0.5]), dim=0)
    pay = t([0.8, 0.5, 0.2])
    true = probs * (pay - (probs * pay).sum())
    means, errors = {}, {}
    for name in rloo.ESTIMATORS:
        means[name], errors[name] = _bandit_gradients(name)
    for name, target in (("rloo", true), ("reinforce", true), ("reinforce_mean", 0.75 * true)):
        assert ((means[name] - target).abs() < 4 * errors[name]).all(), (name, means[name], target, errors[name])
    assert ((means["reinforce_mean"] - true).abs() > 4 * errors["reinforce_mean"]).any()  # biased: seen
    # The baseline lowers the total variance (its trace; not every coordinate's: here the rare, poor arm's
    # rises a little), here by about a third.
    assert (errors["rloo"] ** 2).sum() < 0.8 * (errors["reinforce"] ** 2).sum()
    # GRPO divides by the group's std (about 0.4 here): its expectation is about 1.4 times the gradient
    assert ((means["grpo"] / true - 1).abs() > 0.25).all()


# ---------------------------------------------------------------- KL
def test_kl_estimators_by_hand():
    # d = logp - ref = [-1 - -1.5, -2 - -2, -0.5 - -0.2] = [0.5, 0, -0.3]
    logp, ref = t([-1.0, -2.0, -0.5]), t([-1.5, -2.0, -0.2])
    close(rloo.kl_per_token(logp, ref, "k1"), [0.5, 0.0, -0.3])
    # k3 = exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.60653066 - 0.5 = 0.10653066; 0; exp(0.3) - 1.3 = 0.04985881
    close(rloo.kl_per_token(logp, ref, "k3"), [0.10653066, 0.0, 0.04985881])
    close(rloo.kl_per_token(logp, ref), [0.5, 0.0, -0.3])


def test_k3_nonnegative_and_zero_at_zero():
    d = torch.arange(-50, 51, dtype=torch.float64) / 10  # -5.0 .. 5.0, d[50] is exactly 0
    k3 = rloo.kl_per_token(d, torch.zeros_like(d), "k3")
    assert (k3 >= 0).all()
    assert d[50].item() == 0.0 and k3[50].item() == 0.0
    assert rloo.kl_per_token(t([-1.3]), t([-1.3]), "k3").item() == 0.0
    close(k3, torch.exp(-d) - 1 + d)


def test_sequence_kl_sums_only_masked_tokens():
    # masked-out tokens carry huge d (100, -7) that must not show up
    logp = t([[0.5, 0.0, 100.0], [-7.0, 0.2, -0.3]])
    ref = torch.zeros_like(logp)
    mask = t([[1, 1, 0], [0, 1, 1]])
    close(rloo.sequence_kl(logp, ref, mask, "k1"), [0.5, -0.1])  # 0.5+0 ; 0.2-0.3
    # k3: row0 0.10653066 + 0; row1 (exp(-0.2)-0.8) + (exp(0.3)-1.3) = 0.01873075 + 0.04985881
    close(rloo.sequence_kl(logp, ref, mask, "k3"), [0.10653066, 0.06858956])


def test_unknown_estimator_raises():
    x = t([0.1])
    with pytest.raises(ValueError):
        rloo.kl_per_token(x, x, "k2")
    with pytest.raises(ValueError):
        rloo.sequence_kl(x[None], x[None], x[None], "kl")


def test_kl_loss_aggregations_by_hand():
    # k1 d = [[0.5, -0.1, (9)], [0.3, (9), (9)]], parentheses = masked out
    logp = t([[0.5, -0.1, 9.0], [0.3, 9.0, 9.0]])
    ref, mask = torch.zeros_like(logp), t([[1, 1, 0], [1, 0, 0]])
    kl = lambda agg, est="k1": rloo.kl_loss(logp, ref, mask, estimator=est, aggregation=agg)  # noqa: E731
    close(kl("token_mean"), 0.7 / 3)  # (0.5 - 0.1 + 0.3) / 3 tokens
    close(kl("sequence_sum"), 0.35)  # mean(0.4, 0.3)
    close(kl("sequence_mean"), 0.25)  # mean(0.4/2, 0.3/1)
    close(rloo.kl_loss(logp, ref, mask, estimator="k1", aggregation="constant", budget=3), 0.7 / 6)  # 2 * 3
    # k3 (the default): 0.10653066 + (exp(0.1) - 1.1 = 0.00517092) ; exp(-0.3) - 0.7 = 0.04081822
    close(rloo.kl_loss(logp, ref, mask), (0.11170158 + 0.04081822) / 2)


# ---------------------------------------------------------------- policy_loss
# N=3 completions, T=4: row 0 has a prompt token then 3 completion tokens; row 1 one completion token
# between prompt and padding; row 2 two completion tokens then padding. lengths 3, 1, 2; total 6.
MASK = [[0, 1, 1, 1], [0, 0, 1, 0], [1, 1, 0, 0]]
ADV = [0.5, -1.0, 2.0]
AGGS = ["sequence_sum", "token_mean", "sequence_mean", "constant"]
BUDGET = 4  # constant's max_new_tokens: T


def logps():
    g = torch.Generator().manual_seed(1)
    return (-3 * torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()


@pytest.mark.parametrize("agg", AGGS)
def test_first_pass_ratio_is_one(agg):
    logp = logps()
    loss, stats = rloo.policy_loss(logp, logp.detach(), t(ADV), t(MASK), aggregation=agg, budget=BUDGET)
    assert stats["ratio_mean"].item() == 1.0
    assert stats["ratio_clip_frac"].item() == 0.0
    # sequence_*: -mean(A) = -(0.5 - 1 + 2)/3 = -0.5; token_mean: -(0.5*3 - 1*1 + 2*2)/6 = -0.75;
    # constant: -(0.5*3 - 1*1 + 2*2) / (3 completions * 4 tokens) = -0.375
    close(loss.detach(), {"token_mean": -0.75, "constant": -0.375}.get(agg, -0.5))


@pytest.mark.parametrize(
    "agg,denom",
    [
        ("sequence_sum", [[3.0], [3.0], [3.0]]),  # N
        ("token_mean", [[6.0], [6.0], [6.0]]),  # total mask
        ("sequence_mean", [[9.0], [3.0], [6.0]]),  # N * len_n = 3*3, 3*1, 3*2
        ("constant", [[12.0], [12.0], [12.0]]),  # N * budget, whatever the lengths
    ],
)
def test_first_pass_gradient_is_reinforce(agg, denom):
    # d loss / d logp[n, t] = -A[n] * mask[n, t] / denom[n]
    logp = logps()
    loss, _ = rloo.policy_loss(logp, logp.detach(), t(ADV), t(MASK), aggregation=agg, budget=BUDGET)
    loss.backward()
    want = -t(ADV)[:, None] * t(MASK) / t(denom)
    close(logp.grad, want)
    # e.g. sequence_mean row 0: -0.5/9 = -0.0556; row 1: +1/3; row 2: -2/6
    assert logp.grad[t(MASK) == 0].abs().max().item() == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_prompt_and_padding_positions_carry_no_loss(agg):
    mask = t(MASK)
    logp = logps()
    # ratio != 1 on purpose, but inside [0.8, 1.2] so nothing is clipped (row 0: exp(.01+.02+.03))
    old = (logp - 0.01 * torch.arange(4, dtype=torch.float64)).detach()
    loss1, _ = rloo.policy_loss(logp, old, t(ADV), mask, aggregation=agg, budget=BUDGET)
    loss1.backward()
    assert logp.grad[mask == 0].abs().max().item() == 0.0
    assert logp.grad[mask == 1].abs().min().item() > 0.0
    moved = torch.where(mask.bool(), logp.detach(), t(5.0))  # garbage on prompt/padding positions
    loss2, _ = rloo.policy_loss(moved, old, t(ADV), mask, aggregation=agg, budget=BUDGET)
    close(loss2, loss1.detach(), atol=1e-12)


def one_seq(ratio, adv, agg="sequence_sum", **kw):
    # one completion of 2 tokens; all the log-ratio on token 0
    logp = t([[math.log(ratio), 0.0]], requires_grad=True)
    loss, stats = rloo.policy_loss(logp, torch.zeros_like(logp), t([adv]), t([[1, 1]]), aggregation=agg, **kw)
    loss.backward()
    return loss.detach(), logp.grad[0], stats


def test_clip_high_side_kills_gradient():
    # ratio 1.5, A=1, eps=0.2: -min(1.5*1, 1.2*1) = -1.2, clamp is flat there -> no gradient
    loss, grad, stats = one_seq(1.5, 1.0)
    close(loss, -1.2)
    close(grad, [0.0, 0.0], atol=0.0)
    assert stats["ratio_clip_frac"].item() == 1.0
    close(stats["ratio_mean"], 1.5)


def test_low_ratio_positive_advantage_is_unclipped():
    # ratio 0.5, A=1: -min(0.5, 0.8) = -0.5 (min picks the unclipped); d/dlogp_t = -A * ratio = -0.5
    loss, grad, stats = one_seq(0.5, 1.0)
    close(loss, -0.5)
    close(grad, [-0.5, -0.5])
    assert stats["ratio_clip_frac"].item() == 0.0


def test_low_ratio_negative_advantage_is_clipped():
    # ratio 0.5, A=-1: -min(-0.5, -0.8) = 0.8, no gradient
    loss, grad, stats = one_seq(0.5, -1.0)
    close(loss, 0.8)
    close(grad, [0.0, 0.0], atol=0.0)
    assert stats["ratio_clip_frac"].item() == 1.0


def test_asymmetric_clip_epsilon_high():
    # ratio 1.25, A=1: eps=0.2 clips to 1.2; with clip_epsilon_high=0.28 the bound is 1.28 -> unclipped
    close(one_seq(1.25, 1.0)[0], -1.2)
    loss, grad, stats = one_seq(1.25, 1.0, clip_epsilon_high=0.28)
    close(loss, -1.25)
    close(grad, [-1.25, -1.25])  # d(-A * exp(sum_t delta_t))/d logp_t = -A * ratio = -1.25, each token
    # the low side still uses clip_epsilon: ratio 0.75, A=-1 -> -min(-0.75, -0.8) = 0.8 (not 1-0.28=0.72)
    close(one_seq(0.75, -1.0, clip_epsilon_high=0.28)[0], 0.8)


def test_ratio_follows_the_aggregation():
    # token log-ratios [0.1, 0.2], A=1, eps=0.2
    logp = t([[0.1, 0.2]])
    args = (torch.zeros_like(logp), t([1.0]), t([[1, 1]]))
    # sequence_sum: exp(0.3) = 1.34986 > 1.2 -> clipped, loss -1.2
    close(rloo.policy_loss(logp, *args, aggregation="sequence_sum")[0], -1.2)
    # sequence_mean: exp(0.15) = 1.16183 -> unclipped, loss -1.16183
    close(rloo.policy_loss(logp, *args, aggregation="sequence_mean")[0], -math.exp(0.15))
    # token_mean: per-token ratios exp(0.1)=1.10517, exp(0.2)=1.22140 -> 1.2; loss -(1.10517+1.2)/2
    loss, stats = rloo.policy_loss(logp, *args, aggregation="token_mean")
    close(loss, -(math.exp(0.1) + 1.2) / 2)
    close(stats["ratio_clip_frac"], 0.5)
    close(stats["ratio_mean"], (math.exp(0.1) + math.exp(0.2)) / 2)
    # constant: token_mean's per-token ratios and clip, over 1 completion * a budget of 4 tokens
    loss, stats = rloo.policy_loss(logp, *args, aggregation="constant", budget=4)
    close(loss, -(math.exp(0.1) + 1.2) / 4)
    close(stats["ratio_clip_frac"], 0.5)  # of the tokens written, not of the budget


def test_unknown_aggregation_raises():
    x = t([[0.0]])
    with pytest.raises(ValueError, match="sequence_sum, token_mean, sequence_mean, constant"):
        rloo.policy_loss(x, x, t([1.0]), x, aggregation="sum")
    with pytest.raises(ValueError, match="sequence_sum, token_mean, sequence_mean, constant"):
        rloo.loss_normalizer(x, "sum")
    with pytest.raises(ValueError, match="budget"):  # constant without its budget
        rloo.policy_loss(x, x, t([1.0]), x, aggregation="constant")


def test_constant_groups():
    # rows: mixed; all equal; one finite (NaN elsewhere); equal finite ones around a NaN; all NaN
    nan = math.nan
    rewards = t([[0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [1.0, nan, nan], [1.0, nan, 1.0], [nan, nan, nan]])
    got = rloo.constant_groups(rewards, torch.isfinite(rewards))
    assert got.tolist() == [False, True, True, True, True]
    # exactly the groups whose leave-one-out advantages are all 0
    zero = (rloo.rloo_advantages(rewards) == 0).all(dim=1)
    assert got.tolist() == zero.tolist()


# ---------------------------------------------------------------- whiten
def test_whiten_masked():
    # masked {1, 2, 3}: mean 2, unbiased std sqrt((1+0+1)/2) = 1 -> [-1, 0, 1]; unmasked 100 -> 0
    mask = torch.tensor([True, True, True, False])
    close(rloo.whiten(t([1.0, 2.0, 3.0, 100.0]), mask), [-1.0, 0.0, 1.0, 0.0])
    # masked {0, 4}: mean 2, std sqrt((4+4)/1) = 2*sqrt(2) -> -+1/sqrt(2); unmasked 7 -> 0
    out = rloo.whiten(t([0.0, 7.0, 4.0]), torch.tensor([True, False, True]))
    close(out, [-(2**-0.5), 0.0, 2**-0.5])
    v = torch.rand(10, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 5 + 3
    m = torch.arange(10) % 3 != 0
    w = rloo.whiten(v, m)
    close(w[m].mean(), 0.0)
    close(w[m].std(), 1.0)
    assert (w[~m] == 0).all()


def test_whiten_with_one_masked_entry_gives_zero() -> None:
    # One value has no spread to whiten against: (5 - mean 5) / ... = 0, and masked-out stay 0.
    out = rloo.whiten(torch.tensor([5.0, 2.0, 3.0]), torch.tensor([True, False, False]))
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_kl_loss_rejects_unknown_aggregation() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_aggregation"):
        rloo.kl_loss(lp, lp, torch.ones(1, 2), aggregation="bogus")


# ---------------------------------------------------------------- reward shaping, normalisers, micro-batches
def test_shape_rewards_clips_then_subtracts_kl_by_hand():
    r = t([[3.0, -0.5], [NAN, -4.0]])
    kl = t([[2.0, 1.0], [0.0, 10.0]])
    # clip to [-1, 1]: [[1, -0.5], [nan, -1]]; minus 0.1 * kl: [[0.8, -0.6], [nan, -2.0]]
    got = rloo.shape_rewards(r, kl, kl_coef=0.1, reward_clip=1.0)
    close(got[0], [0.8, -0.6])
    assert math.isnan(got[1, 0]) and got[1, 1].item() == pytest.approx(-2.0)
    # Without a clip or a KL the rewards pass through untouched.
    torch.testing.assert_close(rloo.shape_rewards(r), r, equal_nan=True)
    close(rloo.shape_rewards(t([[3.0, 1.0]]), None, kl_coef=0.5)[0], [3.0, 1.0])


def test_loss_normalizer_counts_tokens_or_completions_with_a_loss_token():
    mask = t([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert rloo.loss_normalizer(mask, "token_mean").item() == 3.0
    assert rloo.loss_normalizer(mask, "sequence_sum").item() == 2.0  # the all-zero row does not count
    assert rloo.loss_normalizer(mask, "sequence_mean").item() == 2.0
    assert rloo.loss_normalizer(torch.zeros(2, 2), "token_mean").item() == 1.0  # never a division by 0


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_add_up_to_the_full_batch(agg):
    """Gradient accumulation: micro-batch losses divided by the whole batch's normaliser sum to the
    full-batch loss, and so do their gradients and statistics, whatever the lengths in each."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = t([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    full, full_stats = rloo.policy_loss(logp, old, adv, mask, aggregation=agg, budget=5)
    (full_grad,) = torch.autograd.grad(full, logp)
    norm = rloo.loss_normalizer(mask, agg, 5)
    whole = {"normalizer": norm, "budget": 5}
    if agg == "constant":  # its statistics count tokens: the whole batch's
        whole["stats_normalizer"] = rloo.loss_normalizer(mask, "token_mean")
    parts = [
        rloo.policy_loss(logp[s], old[s], adv[s], mask[s], aggregation=agg, **whole)
        for s in (slice(0, 2), slice(2, 4), slice(4, 6))
    ]
    (acc_grad,) = torch.autograd.grad(sum(loss for loss, _ in parts), logp)
    torch.testing.assert_close(sum(loss for loss, _ in parts), full)
    torch.testing.assert_close(acc_grad, full_grad)
    for stat in ("ratio_clip_frac", "ratio_mean"):
        torch.testing.assert_close(sum(st[stat] for _, st in parts), full_stats[stat])
    # The KL term too.
    ref = old - 0.2
    full_kl = rloo.kl_loss(logp, ref, mask, estimator="k3", aggregation=agg, budget=5)
    acc_kl = sum(
        rloo.kl_loss(logp[s], ref[s], mask[s], estimator="k3", aggregation=agg, normalizer=norm)
        for s in (slice(0, 3), slice(3, 6))
    )
    torch.testing.assert_close(acc_kl, full_kl)
    if agg == "constant":
        with pytest.raises(ValueError, match="stats_normalizer"):
            rloo.policy_loss(logp, old, adv, mask, aggregation=agg, normalizer=norm)
    with pytest.raises(ValueError, match="unknown loss_aggregation"):
        rloo.kl_loss(logp, ref, mask, aggregation="sum", normalizer=norm)


@pytest.mark.parametrize("agg", ["sequence_sum", "sequence_mean", "token_mean"])
def test_a_fully_masked_completion_gives_no_gradient_and_is_not_counted(agg):
    """mask_truncated_completions zeroes a truncated completion's mask: it must drop out entirely."""
    logp = t([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    mask = t([[1, 1], [0, 0]])
    loss, _ = rloo.policy_loss(logp, logp.detach(), t([2.0, 5.0]), mask, aggregation=agg)
    loss.backward()
    close(logp.grad[1], [0.0, 0.0])
    # Only the first completion counts: sequence_sum loss = -2 * 1 / 1; token_mean = -(2 + 2) / 2.
    assert loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize("agg", ["sequence_sum", "sequence_mean", "token_mean"])
def test_a_huge_ratio_never_turns_a_zero_advantage_into_nan(agg):
    logp = t([[0.0, 0.0]], requires_grad=True)
    old = t([[-400.0, -400.0]])  # exp(800) overflows float64
    loss, _ = rloo.policy_loss(logp, old, t([0.0]), t([[1, 1]]), aggregation=agg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------- sampler_correction
def test_sampler_correction_tis_truncates_the_trainer_over_sampler_ratio():
    # log rho per token: row 0 [0.1, 1.0, (pad)], row 1 [-0.5, (NaN: the sampler gave none)]
    trainer = t([[0.1, 1.0, 0.0], [-0.5, -1.0, 0.0]])
    sampler = t([[0.0, 0.0, 0.0], [0.0, math.nan, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    weights, stats = rloo.sampler_correction(trainer, sampler, mask, mode="tis", cap=2.0)
    close(weights, [[math.exp(0.1), 2.0, 1.0], [math.exp(-0.5), 1.0, 1.0]])  # exp(1) = 2.72 -> 2
    total, counted, largest, corrected, out_of = stats.tolist()
    assert total == pytest.approx(0.1 + 1.0 + 0.5)
    assert (counted, corrected, out_of) == (3, 1, 3) and largest == pytest.approx(1.0)


def test_sampler_correction_mask_drops_a_completion_past_the_bound_either_way():
    # bound log 2 = 0.693: row 0 has +1.0 (past), row 1 -0.9 (past, below 1/2), row 2 within
    trainer = t([[0.1, 1.0], [-0.9, 0.0], [0.5, -0.5]])
    mask = t([[1, 1], [1, 1], [1, 1]])
    weights, stats = rloo.sampler_correction(trainer, torch.zeros_like(trainer), mask, mode="mask", cap=2.0)
    close(weights, [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    assert stats[3].item() == 2 and stats[4].item() == 3  # 2 of 3 completions masked
    none, _ = rloo.sampler_correction(trainer, torch.zeros_like(trainer), mask, mode="none", cap=2.0)
    assert (none == 1).all()
    with pytest.raises(ValueError, match="tis, mask, none"):
        rloo.sampler_correction(trainer, trainer, mask, mode="is", cap=2.0)


@pytest.mark.parametrize("agg", AGGS)
def test_token_weights_weigh_each_tokens_gradient(agg):
    # d loss / d logp[n, t] = -A[n] * w[n, t] * mask[n, t] / denom[n] at ratio 1, every aggregation
    w = t([[0.5, 2.0, 1.0, 0.0], [1.0, 1.0, 0.25, 1.0], [3.0, 0.0, 1.0, 1.0]])
    plain, weighted = logps(), logps()
    rloo.policy_loss(plain, plain.detach(), t(ADV), t(MASK), aggregation=agg, budget=BUDGET)[0].backward()
    loss, stats = rloo.policy_loss(
        weighted, weighted.detach(), t(ADV), t(MASK), aggregation=agg, budget=BUDGET, token_weights=w
    )
    loss.backward()
    close(weighted.grad, plain.grad * w)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)  # statistics count tokens, not weights


def test_sampler_statistics_merge_sums_and_the_largest():
    merged = rloo.merged_sampler_stats(t([1.0, 2.0, 0.5, 1.0, 4.0]), t([3.0, 1.0, 0.9, 0.0, 2.0]))
    close(merged, [4.0, 3.0, 0.9, 1.0, 6.0])

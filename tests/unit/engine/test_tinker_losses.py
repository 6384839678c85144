"""Tinker's built-in losses (worker/engine/tinker/losses.py) against the formulas Tinker documents,
written out again here token by token in plain Python floats: the loss, its gradient with respect to
the model's log-probabilities, the config defaults and overrides, what comes back, and the inputs
refused. Notation: ``lp`` the model's log-probability, ``q`` the sampler's, ``a`` the advantage,
``w`` the weight, ``r = exp(lp - q)``."""

import math

import pytest
import torch

from worker.engine.tinker.losses import LOSSES, LossInputError, LossResult, check_inputs, compute

LENGTHS = (5, 9, 1, 12, 30)
RL = ("importance_sampling", "ppo", "cispo", "dro")
DEFAULTS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}
OVERRIDES = {
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.5},
}


def batch(seed=0):
    """Random datums of LENGTHS: the model's log-probabilities (leaves with grad) and every input."""
    g = torch.Generator().manual_seed(seed)
    logprobs, inputs = [], []
    for n in LENGTHS:
        lp = -3 * torch.rand(n, generator=g)
        sampler = (lp + torch.randn(n, generator=g)).clamp(max=0.0)
        inputs.append(
            {
                "target_tokens": torch.randint(0, 1000, (n,), generator=g),
                "weights": torch.rand(n, generator=g),
                "logprobs": sampler,
                "advantages": torch.randn(n, generator=g),
            }
        )
        logprobs.append(lp.requires_grad_())
    return logprobs, inputs


def taking(loss_fn, inputs):
    """Only the inputs ``loss_fn`` documents."""
    keys = ("target_tokens", "weights") if loss_fn == "cross_entropy" else ("target_tokens", "logprobs", "advantages")
    return [{k: x[k] for k in keys} for x in inputs]


def token(loss_fn, cfg, lp, w, q, a):
    """(loss, d loss / d lp) of one token, from Tinker's documented formula for ``loss_fn``."""
    r = math.exp(lp - q)
    if loss_fn == "cross_entropy":
        return -w * lp, -w
    if loss_fn == "importance_sampling":
        return -r * a, -r * a
    if loss_fn == "ppo":
        clipped = min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])
        if r * a <= clipped * a:  # the unclipped term is the smaller: it carries the gradient
            return -r * a, -r * a
        return -clipped * a, 0.0  # the clipped term is a constant
    if loss_fn == "cispo":
        coefficient = min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])  # stop-gradient
        return -coefficient * lp * a, -coefficient * a
    assert loss_fn == "dro"
    beta = cfg["beta"]
    return -(lp * a - 0.5 * beta * (lp - q) ** 2), -(a - beta * (lp - q))


def by_hand(loss_fn, cfg, logprobs, inputs):
    """The summed loss and each datum's gradient, token by token."""
    total, grads = 0.0, []
    for lp, x in zip(logprobs, inputs, strict=True):
        grad = []
        for i in range(len(lp)):
            w = float(x["weights"][i]) if "weights" in x else 0.0
            q = float(x["logprobs"][i]) if "logprobs" in x else 0.0
            a = float(x["advantages"][i]) if "advantages" in x else 0.0
            value, slope = token(loss_fn, cfg, float(lp[i]), w, q, a)
            total += value
            grad.append(slope)
        grads.append(torch.tensor(grad, dtype=torch.float32))
    return total, grads


def run(loss_fn, config, logprobs, inputs) -> LossResult:
    """``compute`` with fresh gradients, after ``check_inputs`` passes the batch."""
    for lp in logprobs:
        lp.grad = None
    check_inputs(loss_fn, inputs, [len(lp) for lp in logprobs], config)
    result = compute(loss_fn, logprobs, inputs, config)
    result.loss.backward()
    return result


def assert_matches(loss_fn, config, cfg, logprobs, inputs):
    result = run(loss_fn, config, logprobs, inputs)
    want, grads = by_hand(loss_fn, cfg, [lp.detach() for lp in logprobs], inputs)
    assert result.loss.dim() == 0
    assert result.loss.item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    for lp, grad in zip(logprobs, grads, strict=True):
        torch.testing.assert_close(lp.grad, grad, rtol=1e-5, atol=1e-5)
    return result


def ratios(logprobs, inputs):
    return torch.cat([(lp.detach() - x["logprobs"]).exp() for lp, x in zip(logprobs, inputs, strict=True)])


# ---------------------------------------------------------------- the formulas
def test_the_losses_are_tinkers_five():
    assert sorted(LOSSES) == ["cispo", "cross_entropy", "dro", "importance_sampling", "ppo"]


def test_the_random_batch_reaches_every_branch():
    # Below, inside and above PPO's band, and above CISPO's cap: otherwise the formula checks would
    # pass with the clipping left out.
    r = ratios(*batch())
    assert (r < 0.8).any() and ((r > 0.8) & (r < 1.2)).any() and (r > 1.2).any() and (r > 4.0).any()


@pytest.mark.parametrize("loss_fn", sorted(DEFAULTS))
def test_loss_and_gradient_are_the_documented_formula_with_its_defaults(loss_fn):
    logprobs, inputs = batch()
    assert_matches(loss_fn, {}, DEFAULTS[loss_fn], logprobs, taking(loss_fn, inputs))


@pytest.mark.parametrize("loss_fn", sorted(OVERRIDES))
def test_an_override_is_the_formula_with_its_value_and_changes_the_result(loss_fn):
    logprobs, inputs = batch(seed=1)
    inputs = taking(loss_fn, inputs)
    default = run(loss_fn, {}, logprobs, inputs)
    default_grads = [lp.grad.clone() for lp in logprobs]
    overridden = assert_matches(loss_fn, OVERRIDES[loss_fn], OVERRIDES[loss_fn], logprobs, inputs)
    assert overridden.loss.item() != pytest.approx(default.loss.item(), abs=1e-4)
    assert any(not torch.allclose(lp.grad, g) for lp, g in zip(logprobs, default_grads, strict=True))


def test_the_loss_is_a_sum_over_datums_and_tokens_not_a_mean():
    logprobs, inputs = batch()
    inputs = taking("importance_sampling", inputs)
    once = compute("importance_sampling", logprobs, inputs, {}).loss.item()
    twice = compute("importance_sampling", logprobs * 2, inputs * 2, {}).loss.item()
    assert twice == pytest.approx(2 * once, rel=1e-6)
    parts = [compute("importance_sampling", [lp], [x], {}).loss.item() for lp, x in zip(logprobs, inputs, strict=True)]
    assert once == pytest.approx(sum(parts), rel=1e-6)


def test_an_rl_loss_ignores_weights_it_is_sent():
    # The docs' overview sends weights with an importance_sampling datum; no RL formula reads them.
    logprobs, inputs = batch()
    with_weights = {loss_fn: run(loss_fn, {}, logprobs, inputs).loss.item() for loss_fn in RL}
    for loss_fn in RL:
        assert with_weights[loss_fn] == pytest.approx(run(loss_fn, {}, logprobs, taking(loss_fn, inputs)).loss.item())


# ---------------------------------------------------------------- defaults, worked by hand
def at_ratios(rs, advantages):
    """One datum whose sampler log-probabilities are 0, so that r = exp(lp) is ``rs``."""
    lp = torch.tensor([math.log(r) for r in rs]).requires_grad_()
    n = len(rs)
    x = {
        "target_tokens": torch.zeros(n, dtype=torch.long),
        "logprobs": torch.zeros(n),
        "advantages": torch.tensor(advantages),
    }
    return [lp], [x]


def test_ppo_clips_at_0_8_and_1_2_by_default_and_a_clipped_token_has_no_gradient():
    # r=1.3, a=+1: min(1.3, 1.2) = 1.2, the clipped constant: loss -1.2, gradient 0
    # r=1.1, a=+1: inside the band:                         loss -1.1, gradient -r*a = -1.1
    # r=0.7, a=-1: min(-0.7, -0.8) = -0.8, clipped:         loss +0.8, gradient 0
    # r=0.7, a=+1: min(0.7, 0.8) = 0.7, unclipped:          loss -0.7, gradient -0.7
    # r=1.3, a=-1: min(-1.3, -1.2) = -1.3, unclipped:       loss +1.3, gradient +1.3
    logprobs, inputs = at_ratios([1.3, 1.1, 0.7, 0.7, 1.3], [1.0, 1.0, -1.0, 1.0, -1.0])
    result = run("ppo", {}, logprobs, inputs)
    assert result.loss.item() == pytest.approx(-1.2 - 1.1 + 0.8 - 0.7 + 1.3, abs=1e-5)
    torch.testing.assert_close(logprobs[0].grad, torch.tensor([0.0, -1.1, 0.0, -0.7, 1.3]))
    # A band of [0.8, 1.5] lets the first token through: loss -1.3, gradient -1.3.
    result = run("ppo", {"clip_high_threshold": 1.5}, logprobs, inputs)
    assert result.loss.item() == pytest.approx(-1.3 - 1.1 + 0.8 - 0.7 + 1.3, abs=1e-5)
    torch.testing.assert_close(logprobs[0].grad, torch.tensor([-1.3, -1.1, 0.0, -0.7, 1.3]))


def test_cispo_clips_only_above_4_by_default_and_never_zeroes_a_gradient():
    # Coefficients clip(r, 0, 4): 0.1, 3, 4; loss -sum(c * lp * a), gradient -c * a (a = 1).
    logprobs, inputs = at_ratios([0.1, 3.0, 6.0], [1.0, 1.0, 1.0])
    result = run("cispo", {}, logprobs, inputs)
    want = -(0.1 * math.log(0.1) + 3.0 * math.log(3.0) + 4.0 * math.log(6.0))
    assert result.loss.item() == pytest.approx(want, abs=1e-5)
    torch.testing.assert_close(logprobs[0].grad, torch.tensor([-0.1, -3.0, -4.0]))
    # PPO's band instead: 0.8, 1.2, 1.2.
    run("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, logprobs, inputs)
    torch.testing.assert_close(logprobs[0].grad, torch.tensor([-0.8, -1.2, -1.2]))


def test_dro_beta_defaults_to_0_05_and_0_drops_the_penalty():
    # lp - q = log 2 on each token, a = 1, 0: penalty 0.5 * beta * (log 2)^2 per token.
    logprobs, inputs = at_ratios([2.0, 2.0], [1.0, 0.0])
    l2 = math.log(2.0)
    assert run("dro", {}, logprobs, inputs).loss.item() == pytest.approx(-l2 + 2 * 0.5 * 0.05 * l2**2, abs=1e-6)
    torch.testing.assert_close(logprobs[0].grad, torch.tensor([-(1 - 0.05 * l2), 0.05 * l2]))
    assert run("dro", {"beta": 0}, logprobs, inputs).loss.item() == pytest.approx(-l2, abs=1e-6)
    torch.testing.assert_close(logprobs[0].grad, torch.tensor([-1.0, 0.0]))


def test_cross_entropy_is_the_weighted_negative_log_likelihood():
    lp = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.1)]).requires_grad_()
    x = {"target_tokens": torch.tensor([3, 4, 5]), "weights": torch.tensor([0.0, 1.0, 2.0])}
    result = run("cross_entropy", {}, [lp], [x])
    assert result.loss.item() == pytest.approx(math.log(4) + 2 * math.log(10), abs=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -1.0, -2.0]))


# ---------------------------------------------------------------- what comes back
@pytest.mark.parametrize("loss_fn", sorted(DEFAULTS))
def test_outputs_are_each_datums_logprobs_detached_and_the_metric_is_loss_sum(loss_fn):
    logprobs, inputs = batch()
    result = compute(loss_fn, logprobs, taking(loss_fn, inputs), {})
    assert isinstance(result, LossResult) and result.loss.requires_grad
    assert len(result.outputs) == len(LENGTHS)
    for output, lp in zip(result.outputs, logprobs, strict=True):
        assert set(output) == {"logprobs"}
        assert output["logprobs"].dtype == torch.float32 and not output["logprobs"].requires_grad
        torch.testing.assert_close(output["logprobs"], lp.detach(), rtol=0, atol=0)
    assert result.metrics == {"loss:sum": pytest.approx(result.loss.item(), rel=1e-7)}


def test_half_precision_logprobs_are_answered_and_summed_in_float32():
    logprobs, inputs = batch()
    half = [lp.detach().to(torch.bfloat16).requires_grad_() for lp in logprobs]
    result = compute("cross_entropy", half, taking("cross_entropy", inputs), {})
    assert result.loss.dtype == torch.float32
    assert all(o["logprobs"].dtype == torch.float32 for o in result.outputs)
    result.loss.backward()
    assert all(lp.grad is not None and lp.grad.dtype == torch.bfloat16 for lp in half)


# ---------------------------------------------------------------- refusals
def good(loss_fn="ppo"):
    """A batch ``check_inputs`` passes for ``loss_fn``, and its lengths."""
    _, inputs = batch()
    return taking(loss_fn, inputs), list(LENGTHS)


def test_a_good_batch_passes_weights_included_on_an_rl_loss():
    _, inputs = batch()
    for loss_fn in RL:
        check_inputs(loss_fn, inputs, list(LENGTHS), {})
        check_inputs(loss_fn, taking(loss_fn, inputs), list(LENGTHS), DEFAULTS[loss_fn])
    check_inputs("cross_entropy", taking("cross_entropy", inputs), list(LENGTHS), {})


def test_an_unknown_loss_is_refused_naming_the_known_ones():
    inputs, lengths = good()
    with pytest.raises(LossInputError, match="'gspo'") as raised:
        check_inputs("gspo", inputs, lengths, {})
    assert all(name in str(raised.value) for name in LOSSES)
    with pytest.raises(LossInputError, match="'grpo'"):
        compute("grpo", [torch.zeros(1)], [{"target_tokens": torch.zeros(1, dtype=torch.long)}], {})


def test_a_missing_input_is_refused_naming_the_datum_and_the_input():
    inputs, lengths = good("ppo")
    del inputs[2]["advantages"]
    with pytest.raises(LossInputError, match=r"^datum 2: .*'advantages'.*add it"):
        check_inputs("ppo", inputs, lengths, {})
    inputs, lengths = good("cross_entropy")
    del inputs[3]["weights"]
    with pytest.raises(LossInputError, match=r"^datum 3: .*'weights'"):
        check_inputs("cross_entropy", inputs, lengths, {})


def test_an_input_the_loss_does_not_take_is_refused():
    inputs, lengths = good("importance_sampling")
    inputs[0]["mask"] = torch.ones(LENGTHS[0])
    with pytest.raises(LossInputError, match=r"^datum 0: .*'mask'.*remove it"):
        check_inputs("importance_sampling", inputs, lengths, {})
    inputs, lengths = good("cross_entropy")
    inputs[4]["advantages"] = torch.ones(LENGTHS[4])
    with pytest.raises(LossInputError, match=r"^datum 4: .*'advantages'"):
        check_inputs("cross_entropy", inputs, lengths, {})


def test_an_input_of_the_wrong_length_is_refused_naming_both_lengths():
    inputs, lengths = good("cross_entropy")
    inputs[1]["weights"] = inputs[1]["weights"][:-1]
    with pytest.raises(LossInputError, match=r"^datum 1: loss_fn_inputs\['weights'\] has shape \[8\].* 9 tokens"):
        check_inputs("cross_entropy", inputs, lengths, {})
    inputs, lengths = good("dro")
    with pytest.raises(LossInputError, match=r"^datum 3: loss_fn_inputs\['target_tokens'\].* 13 tokens"):
        check_inputs("dro", inputs, [5, 9, 1, 13, 30], {})


def test_bad_values_are_refused():
    inputs, lengths = good("ppo")
    inputs[4]["advantages"][7] = float("nan")
    with pytest.raises(LossInputError, match=r"^datum 4: loss_fn_inputs\['advantages'\].*finite"):
        check_inputs("ppo", inputs, lengths, {})
    inputs, lengths = good("ppo")
    inputs[0]["target_tokens"] = inputs[0]["target_tokens"].float()
    with pytest.raises(LossInputError, match=r"^datum 0: loss_fn_inputs\['target_tokens'\].*int64"):
        check_inputs("ppo", inputs, lengths, {})
    inputs, lengths = good("cross_entropy")
    inputs[2] = {"target_tokens": torch.zeros(1, 4, dtype=torch.long), "weights": torch.ones(1, 4)}
    with pytest.raises(LossInputError, match=r"^datum 2: .*top-K"):
        check_inputs("cross_entropy", inputs, lengths, {})
    with pytest.raises(LossInputError, match="no data"):
        check_inputs("ppo", [], [], {})


def test_an_unknown_config_key_is_refused_naming_the_keys_the_loss_takes():
    inputs, lengths = good("ppo")
    with pytest.raises(LossInputError, match=r"'clip_low'.*clip_high_threshold, clip_low_threshold"):
        check_inputs("ppo", inputs, lengths, {"clip_low": 0.8})
    inputs, lengths = good("importance_sampling")
    with pytest.raises(LossInputError, match=r"'beta'.*no keys"):
        check_inputs("importance_sampling", inputs, lengths, {"beta": 0.1})
    logprobs, inputs = batch()
    with pytest.raises(LossInputError, match="'beta'"):
        compute("cross_entropy", logprobs, taking("cross_entropy", inputs), {"beta": 0.1})


@pytest.mark.parametrize(
    ("loss_fn", "config", "message"),
    [
        ("ppo", {"clip_low_threshold": 1.3}, r"clip_low_threshold=1.3, clip_high_threshold=1.2"),
        ("ppo", {"clip_low_threshold": -0.1}, r"0 <= clip_low_threshold <= clip_high_threshold"),
        ("cispo", {"clip_low_threshold": 5.0}, r"defaults 0.0, 4.0"),
        ("dro", {"beta": -0.5}, r"'beta'.*>= 0"),
        ("dro", {"beta": float("nan")}, r"'beta'.*finite number"),
        ("ppo", {"clip_high_threshold": "1.2"}, r"'clip_high_threshold'.*finite number"),
    ],
)
def test_an_out_of_range_config_value_is_refused(loss_fn, config, message):
    inputs, lengths = good(loss_fn)
    with pytest.raises(LossInputError, match=message):
        check_inputs(loss_fn, inputs, lengths, config)

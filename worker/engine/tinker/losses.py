"""Tinker's built-in losses (``forward_backward(data, loss_fn, loss_fn_config)``), as Tinker defines
them: each one summed over every token of every datum (Tinker sums; it never averages, so any
normalisation belongs in the weights or the advantages the user sends).

Notation, per datum of ``T`` positions: ``lp`` the model's log-probability of ``target_tokens`` (the
graph runs through it), ``q`` the sampler's log-probabilities (the ``logprobs`` input), ``A`` the
``advantages`` input, ``r = exp(lp - q)`` the importance ratio, ``sg`` stop-gradient.

* ``cross_entropy``: ``-sum(weights * lp)``. Inputs ``target_tokens``, ``weights``. No config.
* ``importance_sampling``: ``-sum(r * A)``. Inputs ``target_tokens``, ``logprobs``, ``advantages``.
  No config.
* ``ppo``: ``-sum(min(r * A, clip(r, low, high) * A))``, ``low``/``high`` the config's
  ``clip_low_threshold`` (default 0.8) and ``clip_high_threshold`` (default 1.2). Same inputs.
* ``cispo``: ``-sum(sg(clip(r, low, high)) * lp * A)``, same config keys, defaults 0.0 and 4.0
  (one-sided: no lower bound). Same inputs.
* ``dro``: ``-sum(lp * A - 0.5 * beta * (lp - q) ** 2)``, config ``beta`` (default 0.05). Same inputs.

Every loss answers, per datum, ``{"logprobs": lp}`` (float32, detached), and one metric,
``loss:sum`` (the loss itself).

Where each choice comes from:

* The names: the SDK's ``LossFnType`` (tinker 0.38, ``tinker/types/loss_fn_type.py``), which also
  lists ``gspo``, ``stable_reinforce`` and ``custom``: not built in here. ``loss_fn_config`` is a
  ``Dict[str, float | str]`` (``ForwardBackwardInput``).
* The formulas, inputs, output tensors and the ``loss:sum`` diagnostic: Tinker's docs, one page per
  loss (tinker-docs.thinkingmachines.ai, "Loss Functions": cross-entropy, importance sampling, PPO,
  CISPO, DRO), each giving the torch code reproduced above. The thresholds are bounds on the ratio
  itself (``torch.clamp(prob_ratio, clip_low_threshold, clip_high_threshold)``), not epsilons.
* ``ppo``'s defaults: the PPO page fixes epsilon low and high to 0.2; the cookbook's tutorial 202
  (``tutorials/202_loss_functions.py``) says "PPO defaults to 0.8 and 1.2".
* ``cispo``'s defaults: the CISPO page ("Choosing clipping thresholds": "CISPO defaults to
  disabling the lower bound ... clip_low_threshold=0.0, clip_high_threshold=4.0") and tutorial 202
  since June 2026 (earlier the cookbook gave CISPO PPO's 0.8 and 1.2).
* ``dro``'s ``beta``: the name is the DRO page's; its default is not documented (the page shows only
  ``{"beta": 0.05}`` as an example, and the cookbook's loss-comparison recipe calls the default
  undocumented). 0.05, the one value Tinker's docs name, is taken.
* What is read back: the cookbook reads ``loss_fn_outputs[i]["logprobs"]`` (``rl/train.py``,
  ``supervised/train.py``) and ``metrics["loss:sum"]`` (tutorial 202); the SDK's
  ``forward_backward_custom`` pops ``metrics["loss:sum"]`` from a ``cross_entropy`` answer.
  ``elementwise_loss`` is only a variable of the cross-entropy page's code, listed as no output:
  not returned.
* ``weights`` on an RL loss: the docs' overview sends ``weights`` with an ``importance_sampling``
  datum, but no RL formula reads them; they are accepted and ignored. Any other extra input is
  refused (the cookbook strips its own ``mask`` before sending, ``rl/train.py``), as are the
  ``clip_low_threshold``/``clip_high_threshold``/``sequence_ratio_mask`` inputs whose dtypes the
  SDK's ``Datum`` knows but that none of these five losses documents.
* Top-K ``cross_entropy`` (``target_tokens`` and ``weights`` of shape ``(T, K)``, on the
  cross-entropy page) is refused: the model here scores one target per position.
* Ranges (the docs give none): thresholds finite with ``0 <= low <= high``; ``beta`` finite and
  ``>= 0``; no text values (none of these losses takes one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from service.tinker import loss_specs

LOSSES = loss_specs.LOSSES
LossInputError = loss_specs.LossInputError
_CLIP_LOW, _CLIP_HIGH = "clip_low_threshold", "clip_high_threshold"


@dataclass
class LossResult:
    """What a ``forward_backward`` answers.

    ``loss``: the scalar loss, summed over every datum's tokens, differentiable through the model's
    log-probabilities. ``outputs``: per datum, Tinker's ``loss_fn_outputs`` entry (``{"logprobs":
    [T] float32}``, detached). ``metrics``: Tinker's metrics (``{"loss:sum": float}``).
    """

    loss: torch.Tensor
    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


def check_inputs(
    loss_fn: str, inputs: list[dict[str, torch.Tensor]], lengths: list[int], config: dict[str, float | str]
) -> None:
    """``service.tinker.loss_specs.check_inputs`` on tensors: a ``LossInputError`` for an unknown loss,
    a missing or extra input, a shape that is not the datum's length, a config key unknown or out of
    range."""
    arrays = [{k: v.detach().cpu().numpy() for k, v in datum.items()} for datum in inputs]
    loss_specs.check_inputs(loss_fn, arrays, lengths, config)


Elementwise = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]
"""A loss per position: ``(lp, float inputs, config) -> [T]``; its sum is the datum's loss."""


def _cross_entropy(lp: Tensor, x: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """``-weights * lp``."""
    return -(x["weights"] * lp)


def _importance_sampling(lp: Tensor, x: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """``-r * A``."""
    return -(torch.exp(lp - x["logprobs"]) * x["advantages"])


def _ppo(lp: Tensor, x: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """``-min(r * A, clip(r, low, high) * A)``: the pessimistic of the two, per token."""
    ratio = torch.exp(lp - x["logprobs"])
    clipped = torch.clamp(ratio, cfg[_CLIP_LOW], cfg[_CLIP_HIGH])
    return -torch.minimum(ratio * x["advantages"], clipped * x["advantages"])


def _cispo(lp: Tensor, x: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """``-sg(clip(r, low, high)) * lp * A``: the clipped ratio a constant weight on ``lp``."""
    coefficient = torch.clamp(torch.exp(lp - x["logprobs"]), cfg[_CLIP_LOW], cfg[_CLIP_HIGH]).detach()
    return -(coefficient * lp * x["advantages"])


def _dro(lp: Tensor, x: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """``-(lp * A - 0.5 * beta * (lp - q) ** 2)``."""
    return -(lp * x["advantages"] - 0.5 * cfg["beta"] * (lp - x["logprobs"]) ** 2)


_ELEMENTWISE: dict[str, Elementwise] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
}


def compute(
    loss_fn: str, logprobs: list[torch.Tensor], inputs: list[dict[str, torch.Tensor]], config: dict[str, float | str]
) -> LossResult:
    """logprobs[i]: the model's log-probability of datum i's target_tokens at each position, shape [T_i], with
    grad. inputs[i]: the datum's loss_fn_inputs as tensors (target_tokens int64 [T_i], weights float32 [T_i],
    logprobs (the sampler's) float32 [T_i], advantages float32 [T_i], ...).

    The inputs are those ``check_inputs`` passed; the loss is computed in float32 on the log-probabilities'
    device, whatever dtype they come in.
    """
    cfg = loss_specs.resolved_config(loss_fn, config)  # an unknown loss is refused here
    elementwise = _ELEMENTWISE[loss_fn]
    if len(logprobs) != len(inputs) or not logprobs:
        raise ValueError(f"{len(logprobs)} datums' log-probabilities for {len(inputs)} datums' inputs")
    terms: list[Tensor] = []
    outputs: list[dict[str, Tensor]] = []
    for i, (lp, x) in enumerate(zip(logprobs, inputs, strict=True)):
        if lp.shape != x["target_tokens"].shape:
            raise ValueError(f"datum {i}: log-probabilities of shape {list(lp.shape)} for its target_tokens' shape")
        lp32 = lp.float()
        floats = {k: v.to(device=lp32.device, dtype=torch.float32) for k, v in x.items() if k != "target_tokens"}
        terms.append(elementwise(lp32, floats, cfg).sum())
        outputs.append({"logprobs": lp32.detach()})
    loss = torch.stack(terms).sum()
    return LossResult(loss=loss, outputs=outputs, metrics={"loss:sum": float(loss.detach())})

"""Tinker's built-in losses as a request names them: which exist, the inputs each takes, its config
keys with their defaults and ranges, and the checks of a ``forward_backward`` batch against them
(torch-free: the API checks a request before it is queued, the worker's engine computes it,
``worker.engine.tinker.losses``, whose docstring gives each formula and where it comes from).

* ``cross_entropy``: inputs ``target_tokens``, ``weights``; no config.
* ``importance_sampling``: ``target_tokens``, ``logprobs`` (the sampler's), ``advantages``
  (``weights`` accepted and ignored); no config.
* ``ppo``: as importance_sampling; ``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2 (bounds
  on the ratio itself).
* ``cispo``: as ppo; thresholds 0.0 and 4.0.
* ``dro``: as importance_sampling; ``beta`` 0.05 (Tinker documents no default: the one value its
  docs show).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from service.core.errors import Invalid

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP_LOW = "clip_low_threshold"
_CLIP_HIGH = "clip_high_threshold"


@dataclass(frozen=True)
class _Spec:
    """What a loss takes: the inputs it needs, those it tolerates, its config keys with defaults."""

    required: tuple[str, ...]
    optional: tuple[str, ...]
    defaults: Mapping[str, float]


_SPECS: dict[str, _Spec] = {
    "cross_entropy": _Spec(("target_tokens", "weights"), (), {}),
    "importance_sampling": _Spec(_RL_INPUTS, ("weights",), {}),
    "ppo": _Spec(_RL_INPUTS, ("weights",), {_CLIP_LOW: 0.8, _CLIP_HIGH: 1.2}),
    "cispo": _Spec(_RL_INPUTS, ("weights",), {_CLIP_LOW: 0.0, _CLIP_HIGH: 4.0}),
    "dro": _Spec(_RL_INPUTS, ("weights",), {"beta": 0.05}),
}

LOSSES: frozenset[str] = frozenset(_SPECS)
"""The built-in losses this engine computes (Tinker's names)."""


class LossInputError(Invalid):
    """A user's mistake in a ``forward_backward`` request (a 400 at the API, a failed future at the
    worker): the message names the datum (by index), the input or config key, and what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="forward_backward_input", code="invalid_loss_input")


def _spec(loss_fn: str) -> _Spec:
    """The loss's spec, or a ``LossInputError`` listing the known losses."""
    if loss_fn not in _SPECS:
        known = ", ".join(sorted(LOSSES))
        raise LossInputError(f"loss_fn {loss_fn!r} is not a built-in loss: use one of {known}")
    return _SPECS[loss_fn]


def resolved_config(loss_fn: str, config: Mapping[str, float | str]) -> dict[str, float]:
    """The loss's config: its defaults overridden by ``config``, every key known and in range."""
    defaults = _spec(loss_fn).defaults
    takes = ", ".join(sorted(defaults)) or "no keys"
    resolved = dict(defaults)
    for key, value in config.items():
        if key not in defaults:
            raise LossInputError(f"loss_fn_config key {key!r} is not one {loss_fn!r} takes ({takes}): remove it")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LossInputError(f"loss_fn_config[{key!r}] is {value!r}: {loss_fn!r} needs a finite number there")
        resolved[key] = float(value)
    if resolved.get("beta", 0.0) < 0:
        raise LossInputError(f"loss_fn_config['beta'] is {resolved['beta']}: the DRO penalty's weight must be >= 0")
    if _CLIP_LOW in resolved:
        low, high = resolved[_CLIP_LOW], resolved[_CLIP_HIGH]
        if not 0 <= low <= high:
            raise LossInputError(
                f"loss_fn_config clip thresholds are {_CLIP_LOW}={low}, {_CLIP_HIGH}={high} (defaults "
                f"{defaults[_CLIP_LOW]}, {defaults[_CLIP_HIGH]}): they bound the ratio p/q itself and need "
                f"0 <= {_CLIP_LOW} <= {_CLIP_HIGH}"
            )
    return resolved


def _check_tensor(i: int, loss_fn: str, key: str, value: np.ndarray, length: int) -> None:
    """One input of datum ``i``: a finite float tensor, one value per position of the model input."""
    name = f"datum {i}: loss_fn_inputs[{key!r}]"
    if tuple(value.shape) != (length,):
        raise LossInputError(
            f"{name} has shape {list(value.shape)}, but the datum's model_input has {length} tokens: "
            f"{loss_fn!r} needs shape [{length}], one value per model_input token"
        )
    if value.dtype.kind != "f":
        raise LossInputError(f"{name} holds {value.dtype} values: send floats (float32)")
    if not bool(np.isfinite(value).all()):
        raise LossInputError(f"{name} holds NaN or infinite values: send finite numbers")


def _check_datum(i: int, loss_fn: str, spec: _Spec, inputs: Mapping[str, np.ndarray], length: int) -> None:
    """Datum ``i``'s ``loss_fn_inputs``: the loss's inputs, no others, each ``length`` long."""
    missing = [key for key in spec.required if key not in inputs]
    if missing:
        raise LossInputError(
            f"datum {i}: loss_fn_inputs lacks {', '.join(map(repr, missing))}, which {loss_fn!r} needs "
            f"(it takes {', '.join(spec.required)}): add it"
        )
    extra = sorted(set(inputs) - set(spec.required) - set(spec.optional))
    if extra:
        raise LossInputError(
            f"datum {i}: loss_fn_inputs has {', '.join(map(repr, extra))}, which {loss_fn!r} does not take "
            f"(it takes {', '.join(spec.required + spec.optional)}): remove it"
        )
    targets = inputs["target_tokens"]
    if targets.ndim == 2 and loss_fn == "cross_entropy":
        raise LossInputError(
            f"datum {i}: loss_fn_inputs['target_tokens'] has shape {list(targets.shape)}: top-K "
            f"cross_entropy targets are not supported here; send one target token per position, shape [{length}]"
        )
    if tuple(targets.shape) != (length,):
        raise LossInputError(
            f"datum {i}: loss_fn_inputs['target_tokens'] has shape {list(targets.shape)}, but the datum's "
            f"model_input has {length} tokens: send one target token per model_input token, shape [{length}]"
        )
    if targets.dtype.kind not in "iu":
        raise LossInputError(f"datum {i}: loss_fn_inputs['target_tokens'] holds {targets.dtype}: send int64 token ids")
    for key in sorted(set(inputs) - {"target_tokens"}):
        _check_tensor(i, loss_fn, key, inputs[key], length)


def check_inputs(
    loss_fn: str, inputs: Sequence[Mapping[str, np.ndarray]], lengths: Sequence[int], config: Mapping[str, float | str]
) -> None:
    """Raise LossInputError for an unknown loss (listing the known ones), a missing/extra required input, a shape
    that is not the datum's target length, an unknown or out-of-range config key.

    ``inputs[i]`` is datum ``i``'s ``loss_fn_inputs`` as tensors; ``lengths[i]`` its model input's length,
    which every input must match. Also refused: no datum at all, target tokens that are not integers, other
    inputs that are not finite floats.
    """
    spec = _spec(loss_fn)
    resolved_config(loss_fn, config)
    if len(inputs) != len(lengths):
        raise ValueError(f"{len(inputs)} datums' inputs but {len(lengths)} lengths")
    if not inputs:
        raise LossInputError("no data: forward_backward needs at least one datum")
    for i, (datum, length) in enumerate(zip(inputs, lengths, strict=True)):
        _check_datum(i, loss_fn, spec, datum, length)

"""A Tinker step's row (``worker.sessions.requests.StepTally``): what the ``forward_backward`` calls
since the last ``optim_step`` add up to, and what the row keeps where a sum cannot be one (a
diverged loss, several loss functions, a surrogate's gradients sent as weights)."""

from __future__ import annotations

import math

import torch

from worker.engine.tinker.model import Datum
from worker.sessions.requests import StepTally


def _datum(n: int, **inputs: list[float]) -> Datum:
    return Datum(tokens=torch.arange(n), inputs={k: torch.tensor(v) for k, v in inputs.items()})


def test_cross_entropy_calls_add_their_losses_over_the_weights_sum() -> None:
    tally = StepTally()
    tally.add("cross_entropy", [_datum(3, weights=[0, 1, 1]), _datum(2, weights=[0.5, 1])], {"loss:sum": 3.0})
    tally.add("cross_entropy", [_datum(4, weights=[1, 1, 1, 1])], {"loss:sum": 2.0})
    row = tally.row(7, 5, {"grad_norm": 2.5, "learning_rate": math.nan})
    assert (row.model_seq, row.step, row.loss, row.counted) == (7, 5, 5.0, 7.5)
    assert (row.datums, row.tokens, row.loss_fn) == (3, 9, "cross_entropy")
    assert row.metrics == {"grad_norm": 2.5, "learning_rate": None}  # JSON keeps no NaN


def test_the_rl_losses_count_the_tokens_with_an_advantage() -> None:
    tally = StepTally()
    tally.add("ppo", [_datum(4, advantages=[0, 0, 1.5, -0.5]), _datum(2, advantages=[0, 0])], {"loss:sum": -1.0})
    row = tally.row(1, 1, {})
    assert (row.loss, row.counted, row.loss_fn) == (-1.0, 2.0, "ppo")


def test_several_loss_functions_make_a_mixed_step_with_nothing_counted() -> None:
    tally = StepTally()
    tally.add("cross_entropy", [_datum(2, weights=[1, 1])], {"loss:sum": 1.0})
    tally.add("importance_sampling", [_datum(2, advantages=[1, 1])], {"loss:sum": 4.0})
    row = tally.row(1, 1, {})
    assert (row.loss, row.counted, row.loss_fn) == (5.0, 0.0, "mixed")  # a sum of unlike means is no mean


def test_negative_weights_a_surrogate_s_gradients_count_nothing() -> None:
    tally = StepTally()  # forward_backward_custom: a linear loss whose weights are the gradients
    tally.add("cross_entropy", [_datum(3, weights=[0.2, -0.7, 0.1])], {"loss:sum": 0.4})
    assert tally.row(1, 1, {}).counted == 0.0


def test_a_diverged_loss_and_a_step_with_no_forward_backward_have_no_loss() -> None:
    diverged = StepTally()
    diverged.add("cross_entropy", [_datum(2, weights=[1, 1])], {"loss:sum": math.inf})
    assert diverged.row(1, 1, {}).loss is None and diverged.row(1, 1, {}).counted == 2.0
    empty = StepTally().row(1, 2, {"grad_norm": 0.0})
    assert (empty.loss, empty.counted, empty.datums, empty.loss_fn) == (None, 0.0, 0, "none")

"""A forward_backward that runs out of device memory: the SDK's future fails with a message that is the
user's to act on (send smaller pieces), and the gradients a cut-short backward may have added in part
are dropped with the rest since the last optim_step, so the next step never applies half a batch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.core.errors import DomainError
from worker.engine.tinker.model import Datum, LoraSettings, TrainingModel
from worker.sessions.requests import Failure, Holder

types = pytest.importorskip("tinker.types")


def _payload(n: int) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, n + 1))),
        loss_fn_inputs={"target_tokens": list(range(2, n + 2)), "weights": [1.0] * n},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=1
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def test_an_out_of_memory_batch_fails_as_the_user_s_and_drops_the_accumulated_gradients(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = TrainingModel(
        models_dir / "tiny-policy", lora=LoraSettings(rank=4), device=torch.device("cpu"), name="tiny-policy"
    )
    row = SimpleNamespace(
        id="s:train:0", seq=1, project_seq=1, base_model="tiny-policy", state_path=None, state_steps=0
    )
    holder = Holder(row, model)  # type: ignore[arg-type]
    holder.forward_backward(_payload(6), None)  # one batch's gradients wait for optim_step
    grads = [p.grad for p in model.model.parameters() if p.requires_grad]
    assert model.pending == 1 and all(g is not None for g in grads)

    real = model.logprobs

    def half_then_out_of_memory(data: list[Datum]) -> Any:
        out = real(data)
        sum(x.sum() for x in out).backward()  # part of a backward's gradients, added before the device fills
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(model, "logprobs", half_then_out_of_memory)
    with pytest.raises(DomainError) as caught:
        holder.forward_backward(_payload(6), None)
    assert model.pending == 0 and all(p.grad is None for p in model.model.parameters())
    failure = Failure.of(caught.value)
    assert failure.category == "user" and "smaller pieces" in failure.message and "dropped" in failure.message

    # Out of memory elsewhere (a host allocator's refusal too) is the user's, without that advice;
    # any other error stays the server's.
    other = Failure.of(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert other.category == "user" and "smaller pieces" not in other.message
    assert Failure.of(RuntimeError("something else")).category == "server"

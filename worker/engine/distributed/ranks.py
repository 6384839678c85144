"""A job's ranks: what the training loop asks of the processes that run one job together.

A job with ``resources.gpus: N > 1`` runs as N processes started by PyTorch's elastic launcher
(``worker.engine.distributed.launch``), one a device (on a CPU host, N gloo processes). Each runs the same loop on its
share of the batch; the differences live here, as operations that are no-ops for one process
(``SINGLE``), so the loop reads the same for one rank or many:

* ``share`` - the prompts of the step this rank samples, scores and trains on (whole prompts, so
  a prompt's k completions stay on one rank and leave-one-out needs no communication);
* ``whole`` / ``whole_objects`` / ``sum`` / ``max`` / ``agree`` - the collectives: a batch's rows,
  Python objects, sums, maxima and rank 0's word (a pause, a cancel) on every rank;
* ``shard`` - the policy and the reference under FSDP2 (``fully_shard``), a decoder layer a unit,
  gradients summed, not averaged (the loss is already divided by the whole batch's normaliser);
* ``generating`` - the policy's weights gathered for sampling, so that each rank decodes as many
  tokens as its own rows need with no collective per token (ranks stop at different tokens);
* ``full_state_dict`` / ``save_sharded`` / ``load_sharded`` - checkpoints through
  ``torch.distributed.checkpoint``: the optimizer's shards, and the consolidated weights rank 0
  writes as the Hugging Face directory users download.

Every collective has the process group's timeout (``RLOO_COLLECTIVE_TIMEOUT_SECONDS``): a rank that
dies never leaves the others waiting for ever, and the launcher ends them all when one ends.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SHARDED_STATE = "training_state.dcp"
"""The optimizer's shards in a checkpoint of a multi-rank run (``training_state*`` stays server-side)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's ranks. ``SINGLE`` is one process: every collective is
    the identity."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes to the database, the events and the checkpoint directory."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def share(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items, the ranks' shares in rank order and as even
        as ``n`` allows (a step's ``batch_size`` is a multiple of the ranks: job creation checks)."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def device(self, requested: str | None) -> torch.device | None:
        """The device of this rank when it has one of its own (``cuda:LOCAL_RANK``), else None."""
        if self.distributed and torch.cuda.is_available() and requested in (None, "cuda"):
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return None

    # Collectives ---------------------------------------------------------------------------------
    def whole(self, local: Tensor) -> Tensor:
        """Every rank's ``local`` rows (the same shape on each), concatenated in rank order."""
        if not self.distributed:
            return local
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    def whole_objects(self, local: Any) -> list[Any]:
        """Every rank's picklable ``local``, in rank order."""
        if not self.distributed:
            return [local]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, local)
        return out

    def sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the ranks (a new tensor; ``value`` is left alone)."""
        return self._reduce(value, "sum")

    def max(self, value: Tensor) -> Tensor:
        return self._reduce(value, "max")

    def _reduce(self, value: Tensor, op: str) -> Tensor:
        if not self.distributed:
            return value
        import torch.distributed as dist

        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what the database told it: go on, pause, cancel)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    # The model -----------------------------------------------------------------------------------
    def shard(self, model: Any, *, bf16: bool) -> None:
        """``model`` under FSDP2: each decoder layer (the classes its ``_no_split_modules`` names) a
        unit, the rest in the root's. Parameters become shards (DTensors): take ``parameters()``
        after this. With ``bf16`` the layers compute in bf16 and reduce gradients in fp32."""
        if not self.distributed:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        units = _layer_classes(model)
        for module in list(model.modules()):
            if type(module).__name__ in units:
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        # Each rank's loss is its rows' sum over the whole batch's normaliser: the gradient is the
        # sum over ranks, not their mean (a plain SUM: gloo has no pre-multiplied sum).
        for unit in _units(model):
            unit.set_gradient_divide_factor(1.0)
            if hasattr(unit, "set_force_sum_reduction_for_comms"):  # torch >= 2.8
                unit.set_force_sum_reduction_for_comms(True)

    @contextmanager
    def generating(self, model: Any) -> Iterator[None]:
        """The policy's full weights on this rank while it samples: gathered once on entry (a
        collective every rank makes), kept through every decode step (no collective a token, so
        ranks may stop at different lengths), let go on exit."""
        if not self.distributed or not _is_sharded(model):
            yield
            return
        units = _units(model)
        for unit in units:
            unit.unshard()
        model.set_reshard_after_forward(False)
        try:
            yield
        finally:
            model.set_reshard_after_forward(True)
            model.set_reshard_after_forward(False, recurse=False)  # FSDP2 keeps its root's weights after forward
            for unit in units:
                unit.reshard()

    # Checkpoints ---------------------------------------------------------------------------------
    def full_state_dict(self, model: Any) -> dict[str, Any] | None:
        """The weights a checkpoint saves, whole, on rank 0's CPU (None on the others; every rank
        must call it), for ``save_pretrained``: a LoRA model's adapter alone, else every weight.
        None for one process, whose model saves itself."""
        if not self.distributed:
            return None
        if hasattr(model, "peft_config"):  # the adapter, gathered tensor by tensor: never the whole base
            adapter = {
                name: whole_tensor(t).detach().cpu()
                for name, t in model.state_dict().items()
                if "lora_" in name or "modules_to_save" in name
            }
            return adapter if self.is_main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        # A head tied to the input embeddings is saved once, as save_pretrained saves it.
        return {name: t for name, t in state.items() if not (tied and name.endswith("lm_head.weight"))}

    def save_sharded(self, path: Path, model: Any, optimizer: torch.optim.Optimizer) -> None:
        """Each rank writes its shard of the optimizer's state under ``path`` (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))

    def load_sharded(self, path: Path, model: Any, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state back from ``path`` (written by ``save_sharded``), each rank its shard."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"])


SINGLE = Ranks()

_current = SINGLE


def current() -> Ranks:
    """This process's ranks: ``SINGLE`` unless ``join`` was called (by ``worker.jobs.rank``)."""
    return _current


def join(timeout_seconds: float) -> Ranks:
    """Join the job's process group from the launcher's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL on GPUs, gloo on CPUs, every collective
    bounded by ``timeout_seconds``."""
    global _current
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = Ranks(rank=int(os.environ.get("RANK", "0")), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        backend = os.environ.get("RLOO_RANKS_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(ranks.local_rank)
            backend = "cpu:gloo,cuda:nccl"  # device tensors over NCCL, the few host ones (sizes, timings) over gloo
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_seconds))
    _current = ranks
    return ranks


def leave() -> None:
    """Leave the process group (at the end of a rank's run)."""
    global _current
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _current = SINGLE


def whole_tensor(tensor: Tensor) -> Tensor:
    """``tensor`` whole: a rank's shard (a DTensor) gathered from every rank (a collective), any
    other tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _layer_classes(model: Any) -> set[str]:
    """The class names of a model's repeated blocks, as Hugging Face declares them for sharding."""
    from worker.engine.errors import JobError

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    if not names:
        raise JobError(
            "invalid_resources",
            f"{type(base).__name__} names no decoder layer class (_no_split_modules), so it cannot be "
            "sharded over ranks; set resources.gpus to 1",
        )
    return names


def _units(model: Any) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)

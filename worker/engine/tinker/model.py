"""A Tinker training model held in memory: a base model (with LoRA adapters, or all its weights
trainable), AdamW, and gradients that accumulate over ``forward_backward`` calls until
``optim_step`` applies them (Tinker's contract: the client decides when a step is taken).

Pure torch and transformers: the worker's session tier (``worker.sessions``) feeds it requests
and stores what it answers.

LoRA as Tinker sets it up: rank ``r``, alpha 32 whatever the rank (so the learning rate a user
tuned on Tinker carries over), no dropout, adapters on the attention projections (``train_attn``),
the MLP's (``train_mlp``) and the output head (``train_unembed``); B starts at zero, so a new
model computes exactly what its base does. Rank 0 asks for full fine-tuning (beyond Tinker).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from service.infra.artifacts import tree_bytes
from worker.engine.errors import JobError
from worker.engine.modeling import load_causal_lm, load_tokenizer, without_dropout
from worker.engine.tinker import losses

LORA_ALPHA = 32
STATE_INFO = "tinker_state.json"
OPTIMIZER_STATE = "optimizer.pt"
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "c_proj", "query", "key", "value", "dense")
_MLP = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc", "w1", "w2", "w3", "gate_up_proj")


@dataclass(frozen=True)
class LoraSettings:
    """Tinker's ``LoraConfig``; ``rank`` 0 is full fine-tuning."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamStep:
    """Tinker's ``AdamParams``, with its defaults."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class Datum:
    """One datum of a ``forward_backward``: the model input's tokens and the loss's inputs, each a
    tensor as long as the input (``target_tokens``, ``weights``, ``logprobs``, ``advantages``...)."""

    tokens: Tensor
    inputs: dict[str, Tensor]


def target_modules(linear_names: list[str], lora: LoraSettings) -> list[str]:
    """The module names (last dotted part) that get adapters, from the model's linear layers."""
    chosen = {
        part for part, on in (("unembed", lora.train_unembed), ("mlp", lora.train_mlp), ("attn", lora.train_attn)) if on
    }
    wanted: set[str] = set()
    for name in linear_names:
        last = name.rsplit(".", 1)[-1]
        if _part(name, last) in chosen:
            wanted.add(last)
    if not wanted:
        raise JobError("invalid_lora", "no layer of this model matches train_mlp/train_attn/train_unembed")
    return sorted(wanted)


def _part(name: str, last: str) -> str:
    """Which of Tinker's parts a linear layer belongs to: ``unembed``, ``mlp``, ``attn`` or none."""
    if last == "lm_head":
        return "unembed"
    if last in _MLP or ".mlp." in f".{name}.":
        return "mlp"
    if last in _ATTN or "attn" in name or "attention" in name:
        return "attn"
    return ""


class TrainingModel:
    """The model, its tokenizer and optimizer, and the gradients accumulated since the last step."""

    def __init__(self, model_dir: Path, *, lora: LoraSettings, device: torch.device, name: str) -> None:
        self.name, self.device, self.lora = name, device, lora
        self.tokenizer = load_tokenizer(model_dir, name=name)
        model = load_causal_lm(model_dir, device, name=name)
        without_dropout(model)
        self.model = self._with_adapters(model) if lora.rank > 0 else model
        self.model.train()
        self.steps = 0
        self.optimizer: torch.optim.AdamW | None = None
        self.pending = 0  # forward_backward calls whose gradients wait for a step

    def _with_adapters(self, model: Any) -> Any:
        from peft import LoraConfig, get_peft_model

        linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        config = LoraConfig(
            r=self.lora.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=target_modules(linear, self.lora),
            bias="none",
            task_type="CAUSAL_LM",
        )
        if self.lora.seed is not None:
            torch.manual_seed(self.lora.seed)
        return get_peft_model(model, config)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def logprobs(self, data: list[Datum]) -> list[Tensor]:
        """Each datum's log-probability of its ``target_tokens`` at every position (one padded
        batch), with the graph kept for a backward pass."""
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        targets = torch.zeros_like(ids)
        for row, datum in enumerate(data):
            n = len(datum.tokens)
            ids[row, :n] = datum.tokens.to(self.device)
            targets[row, :n] = datum.inputs["target_tokens"].to(self.device, torch.long)
            mask[row, :n] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return [picked[row, : len(d.tokens)] for row, d in enumerate(data)]

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, float | str], *, backward: bool
    ) -> losses.LossResult:
        """The loss and its per-datum outputs; with ``backward``, its gradients added to those
        waiting for the next ``optim_step``."""
        inputs = [{k: v.to(self.device) for k, v in d.inputs.items()} for d in data]
        losses.check_inputs(loss_fn, inputs, [len(d.tokens) for d in data], config)
        if backward:
            result = losses.compute(loss_fn, self.logprobs(data), inputs, config)
            result.loss.backward()
            self.pending += 1
        else:
            with torch.no_grad():
                result = losses.compute(loss_fn, self.logprobs(data), inputs, config)
        return result

    def drop_gradients(self) -> None:
        """Forget the gradients accumulated since the last ``optim_step``."""
        self.model.zero_grad(set_to_none=True)
        self.pending = 0

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step with the gradients accumulated so far (decoupled weight decay; the
        global gradient norm clipped to ``grad_clip_norm`` when it is positive), then zeroed."""
        params = self.trainable
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=step.learning_rate)
        for group in self.optimizer.param_groups:
            group.update(
                lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay
            )
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        if step.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, step.grad_clip_norm)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise JobError("nonfinite_gradient", f"the accumulated gradient's norm is {norm}: the step was skipped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.pending = 0
        return {"grad_norm": norm, "learning_rate": step.learning_rate}

    # Saving and loading ------------------------------------------------------------------------------
    def save(self, target: Path, *, optimizer: bool, base_model: str) -> int:
        """The weights (the adapter alone, with LoRA), the tokenizer and what is needed to rebuild
        this model (``tinker_state.json``), and with ``optimizer`` its moments, written under a
        temporary name and renamed into place. Returns the bytes written."""
        tmp = target.with_name(f".tmp-{target.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            if self.lora.rank > 0:
                self.model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
            else:
                self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            info = {"base_model": base_model, "lora": asdict(self.lora), "steps": self.steps}
            (tmp / STATE_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
            if optimizer and self.optimizer is not None:
                torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_STATE)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tree_bytes(target)

    def load(self, source: Path, *, optimizer: bool) -> None:
        """Weights (and with ``optimizer`` the optimizer's moments) saved by ``save``; gradients
        waiting for a step are dropped."""
        from safetensors.torch import load_file

        if self.lora.rank > 0:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(source / "adapter_model.safetensors"))
        else:
            self.model.load_state_dict(load_file(source / "model.safetensors"), strict=False)
        info = read_info(source)
        self.steps = int(info.get("steps", 0))
        self.model.zero_grad(set_to_none=True)
        self.pending = 0
        if optimizer:
            state_file = source / OPTIMIZER_STATE
            if not state_file.is_file():
                raise JobError("invalid_checkpoint", "this checkpoint holds no optimizer state: load it without one")
            self.optimizer = torch.optim.AdamW(self.trainable, lr=AdamStep().learning_rate)
            self.optimizer.load_state_dict(torch.load(state_file, map_location=self.device, weights_only=True))


def read_info(source: Path) -> dict[str, Any]:
    """What ``TrainingModel.save`` recorded of the model: its base model, LoRA settings, steps."""
    try:
        info: dict[str, Any] = json.loads((source / STATE_INFO).read_text())
    except (OSError, ValueError) as exc:
        raise JobError("invalid_checkpoint", f"not a saved state of a training model ({exc})") from None
    return info

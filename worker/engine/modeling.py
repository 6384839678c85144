"""The models of a run: the device and precision, loading a policy and its tokenizer, LoRA, and the
frozen reference. Shared parts: every training method builds its models from these."""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from service.jobs.hyperparameters import LoraSpec
from worker.engine.distributed.ranks import current
from worker.engine.errors import JobError
from worker.engine.rollout.base import Rollout, completion_logprobs


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """``auto``: bf16 autocast on CUDA, fp32 elsewhere; ``bf16`` autocasts on any device. Weights and
    optimizer state stay fp32 in every case (autocast is mixed precision, not a cast of the model)."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def model_path(name: str, models_dir: Path) -> Path | str:
    """A directory under the models root, or the name as given (a hub id, where a hub is reachable)."""
    from service.files.upload_sweep import confined

    try:
        local = confined(models_dir, name)
    except ValueError:
        raise JobError("invalid_model", f"model '{name}' is outside the models root") from None
    return local if local.is_dir() else name


def load_causal_lm(path: Path | str, device: torch.device, *, name: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as exc:
        raise JobError("model_load_failed", f"could not load model '{name}': {exc}") from None
    return model.to(device)  # type: ignore[arg-type]


def load_tokenizer(path: Path | str, *, name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise JobError("model_load_failed", f"could not load the tokenizer of '{name}': {exc}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def without_dropout(model: Any) -> None:
    """Switch the model's own dropout off, as TRL does: with it, the log-probs of the update would
    not be those of the policy that sampled (generation runs in eval mode), and the KL would carry
    dropout noise. A LoRA adapter's dropout, asked for explicitly, is added afterwards and stays."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # functional dropout (Llama, Qwen)
            module.attention_dropout = 0.0


def enable_gradient_checkpointing(model: Any) -> None:
    """Non-reentrant checkpointing: correct with frozen inputs (LoRA) and with no-grad passes."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def add_lora(model: Any, spec: LoraSpec, *, resume_from: Path | None) -> Any:
    """Wrap ``model`` with LoRA adapters (``peft``); from ``resume_from`` when continuing a run."""
    from peft import LoraConfig, PeftModel, get_peft_model

    try:
        if resume_from is not None:
            return PeftModel.from_pretrained(model, resume_from, is_trainable=True)
        config = LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft annotates int; a float scales the same
            lora_dropout=spec.dropout,
            target_modules=spec.target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)
    except ValueError as exc:
        raise JobError(
            "invalid_lora",
            f"LoRA could not be applied: {exc}. Set lora.target_modules to module names of this model "
            "(e.g. ['q_proj', 'v_proj']) or to 'all-linear'.",
        ) from None


class Reference:
    """Log-probs of the frozen reference: a copy of the starting weights (full fine-tuning) or the
    policy with its adapter disabled (LoRA: no second copy in memory)."""

    def __init__(self, policy: Any, *, lora: bool) -> None:
        self.policy, self.lora = policy, lora
        self.model = None if lora else copy.deepcopy(policy)
        if self.model is not None:
            self.model.eval().requires_grad_(False)

    def logprobs(self, rollout: Rollout, *, temperature: float) -> Tensor:
        # Inference mode (no autograd bookkeeping at all); the result leaves it as a normal tensor,
        # since a KL loss term may save it for backward. A sharded model's gathered weights must not
        # become inference tensors (the update gathers into the same buffers): no_grad there.
        with torch.no_grad() if current().distributed else torch.inference_mode():
            logp = self._logprobs(rollout, temperature)
        return logp.clone()

    def _logprobs(self, rollout: Rollout, temperature: float) -> Tensor:
        if self.model is not None:
            return completion_logprobs(self.model, rollout, temperature=temperature)[0]
        was_training = self.policy.training
        self.policy.eval()  # no adapter dropout; the base has none to switch off
        try:
            with self.policy.disable_adapter():
                return completion_logprobs(self.policy, rollout, temperature=temperature)[0]
        finally:
            self.policy.train(was_training)

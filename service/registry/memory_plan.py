"""A job's memory plan before it runs (``POST /v1/fine_tuning/jobs/estimate``, and the check at
creation against the operator's ``RLOO_ACCELERATORS``), from the model's files alone: no torch.

The model's shape comes from its ``config.json`` and its parameters from its safetensors headers
(every tensor's shape, read without loading a weight). The plan is per device, for one process on one
device (as jobs run today):

* ``weights``: every parameter in fp32 (the engine keeps fp32 weights; bf16 is autocast);
* ``gradients`` and ``optimizer`` (AdamW's two moments): of the trainable parameters only (LoRA's
  adapters, or every weight);
* ``reference``: a frozen fp32 copy for the KL (full fine-tuning with ``kl_coef`` > 0; LoRA switches
  its adapter off instead, and ``kl_coef`` 0 loads none);
* ``kv_cache``: sampling the step's ``batch_size`` × ``rloo_k`` rows to ``max_new_tokens``;
* ``activations``: one micro-batch's backward (``batch_size / gradient_accumulation_steps`` prompts
  of ``rloo_k`` rows), layer by layer (a prompt's tokens once for its k rows, as the update shares
  the prefix), or only each layer's input under gradient checkpointing (which shares no prefix), and
  the scored positions' logits with their log-softmax; generation and the update do not overlap, so
  the larger of the two counts.

Sequences are taken at the longest the settings allow: ``max_prompt_length`` + ``max_new_tokens``
(within the model's context). A file of short prompts uses less.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
RUNTIME = {"cpu": 200 * 2**20, "cuda": 2**30}
"""What a training process holds besides its tensors: measured on the CPU here (the tiny model's peak
above its pre-load baseline is ~210 MiB, whatever its settings); on CUDA, the context and the caching
allocator's slack, an allowance not yet measured on a GPU."""
HEADROOM = 0.9
"""The share of a device's memory a plan may fill: allocators, CUDA context and fragmentation
take the rest."""


class UnknownShape(ValueError):
    """The model's files do not say its shape (a hub id, a config without the usual fields)."""


@dataclass(frozen=True)
class Shape:
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key (or value) width of a token in one layer: kv heads times head dim
    vocab: int
    context: int | None
    linear: tuple[tuple[str, int, int], ...]  # (name, in features, out features) of each 2-D weight


def model_shape(model_dir: Path) -> Shape:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnknownShape(f"no readable config.json ({exc})") from None
    config = config.get("text_config", config)
    try:
        hidden, layers, vocab = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise UnknownShape("its config.json lacks hidden_size, num_hidden_layers or vocab_size") from None
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    tensors = _tensors(model_dir)
    parameters = sum(_numel(shape) for _, shape in tensors.values())
    linear = tuple(
        (name.removesuffix(".weight"), shape[1], shape[0])
        for name, (_, shape) in tensors.items()
        if len(shape) == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name
    )
    context = config.get("max_position_embeddings")
    return Shape(
        parameters=parameters,
        layers=layers,
        hidden=hidden,
        intermediate=int(config.get("intermediate_size") or 4 * hidden),
        kv_width=kv_heads * head_dim,
        vocab=vocab,
        context=context if isinstance(context, int) else None,
        linear=linear,
    )


def module_names(model_dir: Path) -> set[str]:
    """Every module that holds a tensor (``model.layers.0.self_attn.q_proj``), from the headers."""
    return {name.rsplit(".", 1)[0] for name in _tensors(model_dir)}


def linear_names(model_dir: Path) -> list[str]:
    """The linear layers LoRA can adapt (``model_shape``'s, by name)."""
    return [name for name, _, _ in model_shape(model_dir).linear]


def _tensors(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's dtype and shape from the safetensors headers (one file, or a sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        out: dict[str, tuple[str, list[int]]] = {}
        for name in files:
            with open(model_dir / Path(name).name, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 * 2**20:
                    raise UnknownShape("a safetensors header over 100 MiB")
                header = json.loads(f.read(length))
            out.update({k: (v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"})
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise UnknownShape(f"its weights are not readable safetensors ({exc})") from None
    if not out:
        raise UnknownShape("its safetensors files hold no tensor")
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _targeted(shape: Shape, targets: list[str] | str) -> list[tuple[str, int, int]]:
    """The linear layers a LoRA spec adapts: peft's "all-linear" (every one but the output head), or
    those whose name ends with a listed module name."""
    if targets == "all-linear":
        return list(shape.linear)
    names = [t for t in targets if isinstance(t, str)]
    return [layer for layer in shape.linear if any(re.search(rf"(^|\.){re.escape(t)}$", layer[0]) for t in names)]


def plan(shape: Shape, hp: Any, *, method: str, device: str = "cuda", devices: int = 1) -> dict[str, Any]:
    """The plan of a job of ``method`` with resolved hyperparameters ``hp``, in bytes per device, on
    ``devices`` ranks: weights, gradients, optimizer state and the reference sharded N ways (FSDP2),
    each rank holding its share of the batch's rows (and, while one layer computes, that layer's
    whole weights: the all-gathered layer is counted with the runtime's buffers, under ``weights``).
    While a sharded policy samples its rollouts each rank holds its whole weights
    (``sampling_weights``, beside the KV cache: the transformers backend gathers them once a rollout;
    vLLM's engine keeps its own share of the GPU, ``RLOO_VLLM_GPU_MEMORY_UTILIZATION``)."""
    lora = getattr(hp, "lora", None)
    if lora is not None:
        trainable = sum(lora.r * (i + o) for _, i, o in _targeted(shape, lora.target_modules))
    else:
        trainable = shape.parameters
    reinforcement = method in ("reinforcement", "rloo")
    rows = hp.batch_size * (hp.rloo_k if reinforcement else 2 if method == "dpo" else 1)  # DPO: both answers
    rank_rows = rows // devices  # each rank's share: whole prompts (spec.check_resources)
    micro_rows = rank_rows // max(1, hp.gradient_accumulation_steps)
    new_tokens = hp.max_new_tokens if reinforcement else 0
    prompt = hp.max_prompt_length if reinforcement else (getattr(hp, "max_length", None) or shape.context or 2048)
    seq = prompt + new_tokens
    if shape.context is not None:
        seq = min(seq, shape.context)
    half = hp.precision == "bf16" or (hp.precision == "auto" and device == "cuda")
    act = 2 if half else 4
    needs_reference = lora is None and ((reinforcement and hp.kl_coef > 0) or method == "dpo")
    # Saved for backward a token a layer: the norms' and projections' inputs and outputs, the
    # attention's q, k, v and output, the MLP's four intermediate tensors (~9h + 4kv + 4i values).
    per_layer = 9 * shape.hidden + 4 * shape.kv_width + 4 * shape.intermediate
    k = hp.rloo_k if reinforcement else 1
    if hp.gradient_checkpointing:
        # Each layer's input kept, one layer recomputed at a time; every row takes its whole sequence
        # (checkpointed layers keep no cache, so the k rows of a prompt cannot share its prefix).
        layer_bytes = act * micro_rows * seq * (shape.layers * shape.hidden + per_layer)
    else:
        # A prompt's tokens pass once for its k rows (the update shares the prefix), each row's own
        # completion after it.
        tokens = (micro_rows // k) * (seq - new_tokens) + micro_rows * new_tokens if reinforcement else micro_rows * seq
        layer_bytes = act * tokens * shape.layers * per_layer
    scored = new_tokens if reinforcement else seq  # the positions whose log-probs the loss reads
    logits = 4 * micro_rows * scored * shape.vocab * 3  # fp32 logits, their log-softmax, its gradient
    gathered = 4 * shape.parameters // shape.layers if devices > 1 else 0  # one layer all-gathered at a time
    shard = -(-4 * shape.parameters // devices)
    parts = {
        "weights": shard + gathered,
        "gradients": -(-4 * trainable // devices),
        "optimizer": -(-8 * trainable // devices),
        "reference": -(-4 * shape.parameters // devices) if needs_reference else 0,
        "kv_cache": act * 2 * shape.layers * shape.kv_width * seq * rank_rows if reinforcement else 0,
        "sampling_weights": 4 * shape.parameters - shard - gathered if reinforcement and devices > 1 else 0,
        "activations": layer_bytes + logits,
        "runtime": RUNTIME.get(device, RUNTIME["cuda"]),
    }
    # Sampling and the update never hold their working memory at once.
    phases = ("kv_cache", "sampling_weights", "activations")
    per_device = sum(v for k, v in parts.items() if k not in phases)
    per_device += max(parts["kv_cache"] + parts["sampling_weights"], parts["activations"])
    tokens = rows * seq
    flops = {
        "generate": 2 * shape.parameters * rows * new_tokens,
        "reference": 2 * shape.parameters * tokens if needs_reference else 0,
        "update": 6 * shape.parameters * tokens * (getattr(hp, "ppo_epochs", 1) if reinforcement else 1),
    }
    return {
        "parameters": shape.parameters,
        "trainable_parameters": trainable,
        "sequence_length": seq,
        "devices": devices,
        "rows_per_step": rows,
        "rows_per_micro_batch": micro_rows,
        "bytes": parts,
        "bytes_per_device": per_device,
        "step_flops": {**flops, "total": sum(flops.values())},
    }


def fits(total: int, accelerators: dict[str, float]) -> dict[str, bool]:
    """Which declared accelerator kinds (GiB a device) hold a plan of ``total`` bytes a device."""
    return {kind: total <= HEADROOM * gib * 2**30 for kind, gib in accelerators.items()}


def what_to_change(hp: Any, parts: dict[str, int]) -> str:
    """The advice of an ``insufficient_memory`` refusal: what would shrink the largest parts."""
    advice = []
    if getattr(hp, "lora", None) is None:
        advice.append("train a LoRA adapter (lora: {r: 16}) instead of every weight")
    if not hp.gradient_checkpointing and parts["activations"] >= parts["kv_cache"]:
        advice.append("set gradient_checkpointing: true")
    advice.append("shard it over more devices (resources.gpus)")
    advice.append("raise gradient_accumulation_steps or lower batch_size, rloo_k, max_new_tokens or max_prompt_length")
    return "; ".join(advice)


def training_model_state(shape: Shape, lora_rank: int, device: str = "cuda") -> dict[str, Any]:
    """What a Tinker training model holds on its device between requests, in bytes: its fp32 weights,
    the gradients ``forward_backward`` accumulates and AdamW's two moments, of every weight
    (``lora_rank`` 0) or of a LoRA of that rank on every linear layer and the output head (an upper
    bound: ``train_mlp``/``train_attn``/``train_unembed`` may adapt fewer), and the runtime's buffers.
    A request's activations come on top of it, in proportion to its tokens."""
    if lora_rank > 0:
        trainable = sum(lora_rank * (i + o) for _, i, o in shape.linear) + lora_rank * (shape.hidden + shape.vocab)
    else:
        trainable = shape.parameters
    parts = {
        "weights": 4 * shape.parameters,
        "gradients": 4 * trainable,
        "optimizer": 8 * trainable,
        "runtime": RUNTIME.get(device, RUNTIME["cuda"]),
    }
    return {"trainable_parameters": trainable, "bytes": parts, "bytes_per_device": sum(parts.values())}


def for_job(
    models_dir: Path,
    base_model: str,
    hp: Any,
    *,
    method: str,
    accelerators: dict[str, float],
    devices: int = 1,
    accelerator: str | None = None,
) -> dict[str, Any]:
    """The answer of ``POST /v1/fine_tuning/jobs/estimate``: the plan on ``devices`` ranks, and which
    declared kinds hold it (only ``accelerator``, when the job names one). Raises ``UnknownShape``
    when the base model's files do not say its shape."""
    from service.files.upload_sweep import confined

    try:
        directory = confined(models_dir, base_model)
    except ValueError:
        raise UnknownShape("it is not under the models root") from None
    out = plan(model_shape(directory), hp, method=method, devices=devices)
    kinds = {accelerator: accelerators[accelerator]} if accelerator in accelerators else accelerators
    return {
        "object": "fine_tuning.job.estimate",
        "model": base_model,
        "method": method,
        "device": "cuda",  # bf16 activations where precision is auto, as a GPU worker runs it
        **out,
        "fits": fits(out["bytes_per_device"], kinds),
    }

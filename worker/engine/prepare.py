"""Setting a run up: data, reward models, the policy and its reference, optimizer, schedule and
rollout backend, restored from a checkpoint when the run continues one. ``prepare`` returns a
``worker.engine.state.Run``, everything the loop in ``worker.engine.methods.rloo`` reads."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from service import graders
from service.jobs.hyperparameters import ResolvedReinforcementHyperparameters
from worker.engine.checkpoints import read_training_state
from worker.engine.config import TrainConfig
from worker.engine.data import load_items
from worker.engine.distributed.ranks import current
from worker.engine.errors import JobError
from worker.engine.modeling import (
    Reference,
    add_lora,
    autocast_for,
    enable_gradient_checkpointing,
    load_causal_lm,
    load_tokenizer,
    model_path,
    pick_device,
    without_dropout,
)
from worker.engine.recorders import Recorder
from worker.engine.resume import check_resumable, load_full_weights, restore, untie_output
from worker.engine.rewards.scoring import EMBEDDING_PACKAGE, RewardModels
from worker.engine.rollout.agent import Agent, trajectory_budget
from worker.engine.rollout.backends import make_backend
from worker.engine.rollout.base import RolloutBackend, Sampling
from worker.engine.state import Run


def prepare(cfg: TrainConfig, recorder: Recorder) -> Run:
    """Everything before the first step. The order is the seed's: what draws random numbers
    (initialising a LoRA adapter) draws them in the same order on every run of a seed."""
    t_setup = time.perf_counter()
    hp = cfg.hyperparameters
    ranks = current()
    device = ranks.device(cfg.device) or pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    items = load_items(cfg.training_file)
    valid_items = load_items(cfg.validation_file) if cfg.validation_file else []
    reward_models = None
    if cfg.grader is not None and graders.is_model_grader(cfg.grader):
        embedding_model = cfg.operator.embedding_model or EMBEDDING_PACKAGE
        reward_models = RewardModels(models_dir=cfg.models_dir, device=device, embedding_model=embedding_model)
    total_steps = hp.total_steps(len(items))
    resumed = None
    if cfg.resume_from is not None:
        resumed = read_training_state(cfg.resume_from)
        check_resumable(cfg, resumed[1], total_steps)

    # Ranks load on the CPU: sharding moves each rank's shards to its device, so no device ever
    # holds a whole copy (or two, with the reference).
    tokenizer, model, reference = _models(cfg, torch.device("cpu") if ranks.distributed else device)
    bf16 = hp.precision == "bf16" or (hp.precision == "auto" and device.type == "cuda")
    for module in (model, reference.model if reference is not None else None):
        if module is not None:
            ranks.shard(module, bf16=bf16)  # a no-op for one process
    params = [p for p in model.parameters() if p.requires_grad]  # (shards, once sharded)
    optimizer = torch.optim.AdamW(
        params,
        lr=hp.learning_rate * hp.learning_rate_multiplier,
        weight_decay=hp.weight_decay,
        fused=device.type in ("cpu", "cuda"),  # one pass over all parameters, not a Python loop of ops each
    )
    scheduler = make_scheduler(optimizer, hp.lr_scheduler, hp.warmup_ratio, total_steps)
    backend = _backend(cfg, model, tokenizer, device) if cfg.method == "reinforcement" else None
    agent = _agent(cfg, items, valid_items, model, tokenizer) if backend is not None and cfg.tools else None
    run = Run(
        cfg=cfg,
        device=device,
        autocast=autocast_for(hp.precision, device),
        items=items,
        valid_items=valid_items,
        reward_models=reward_models,
        total_steps=total_steps,
        tokenizer=tokenizer,
        model=model,
        reference=reference,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        backend=backend,
        agent=agent,
        ranks=ranks,
    )
    n_params = sum(p.numel() for p in model.parameters())
    named = f"'{cfg.started_from}' (base '{cfg.model}')" if cfg.started_from else f"'{cfg.model}'"
    recorder.event(
        f"Model {named} ready on {device.type} in {time.perf_counter() - t_setup:.1f} s: "
        f"{n_params / 1e6:.1f}M parameters, {sum(p.numel() for p in params) / 1e6:.2f}M trained"
    )
    if resumed is not None:
        restore(run, *resumed)
        recorder.event(f"Resumed from the checkpoint at step {run.start}; continuing at step {run.start + 1}")
    else:
        recorder.event(f"Training started: {total_steps} steps, {_what_a_step(run)}, on {_where(run)}")
    return run


def _where(run: Run) -> str:
    """``cpu``, ``cuda``, or ``2 ranks on cpu (FSDP2)``."""
    if run.ranks.distributed:
        return f"{run.ranks.world} ranks on {run.device.type} (FSDP2)"
    return run.device.type


def _what_a_step(run: Run) -> str:
    hp = run.hp
    how = f"LoRA r={hp.lora.r}" if hp.lora else "full fine-tuning"
    if run.backend is not None:
        return f"{hp.batch_size} prompts x {run.rl.rloo_k} completions a step, {how}, rollouts by {run.backend.name}"
    unit = "preference pairs" if run.cfg.method == "dpo" else "examples"
    return f"{hp.batch_size} {unit} a step, {how}"


def max_length(run: Run) -> int:
    """The longest example a supervised or DPO run trains on: ``max_length``, or the model's context."""
    given = getattr(run.hp, "max_length", None)
    return int(given or getattr(run.model.config, "max_position_embeddings", None) or 1024)


def needs_reference(cfg: TrainConfig) -> bool:
    """DPO always compares with the reference; RLOO when it has a KL penalty; supervised never."""
    if cfg.method == "dpo":
        return True
    return cfg.method == "reinforcement" and getattr(cfg.hyperparameters, "kl_coef", 0) > 0


def _models(cfg: TrainConfig, device: torch.device) -> tuple[Any, Any, Reference | None]:
    """The tokenizer, the policy (a LoRA-wrapped base, or the base itself) and the reference (None
    without a KL penalty); a resumed run's weights loaded."""
    hp = cfg.hyperparameters
    base_path = model_path(cfg.model, cfg.models_dir)
    tokenizer = load_tokenizer(cfg.init_from[-1] if cfg.init_from else base_path, name=cfg.model)
    base = start_from(load_causal_lm(base_path, device, name=cfg.model), cfg.init_from, device)
    without_dropout(base)
    if hp.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    reference_needed = needs_reference(cfg)
    if hp.lora:
        model = add_lora(base, hp.lora, resume_from=cfg.resume_from)
        return tokenizer, model, Reference(model, lora=True) if reference_needed else None
    # The reference is the starting weights: copied before a resumed run loads its own.
    reference = Reference(base, lora=False) if reference_needed else None
    if cfg.resume_from is not None:
        load_full_weights(base, cfg.resume_from, device)
    return tokenizer, base, reference


def start_from(base: Any, chain: tuple[Path, ...], device: torch.device) -> Any:
    """``base`` with a fine-tuned model's weights: its chain of checkpoints applied in order from
    the newest full model's (which holds every weight before it), each LoRA adapter after it merged
    (a new job trains on the merged weights)."""
    full = [i for i, checkpoint in enumerate(chain) if not (checkpoint / "adapter_config.json").is_file()]
    if full:
        load_full_weights(base, chain[full[-1]], device, code="model_load_failed")
    for checkpoint in chain[full[-1] + 1 if full else 0 :]:
        from peft import PeftModel

        untie_adapted_output(base, checkpoint)
        try:
            base = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
        except (OSError, ValueError) as exc:
            raise JobError("model_load_failed", f"could not apply the fine-tuned adapter: {exc}") from None
    return base


def untie_adapted_output(model: Any, adapter: Path) -> None:
    """Before an adapter that changes the output layer (``lm_head``) is merged into a model whose
    output layer shares its weight with the input embeddings (``tie_word_embeddings``): the output
    layer its own copy, and the config untied, so the merge changes the output layer alone, as the
    adapter, served unmerged, does (merged into the shared weight, it would change the input
    embeddings too, and every answer with them)."""
    import json

    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None or output.weight.data_ptr() != inputs.weight.data_ptr():
        return
    name = next((n for n, module in model.named_modules() if module is output), "lm_head").rsplit(".", 1)[-1]
    targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules") or []
    if isinstance(targets, str):
        import re

        adapted = re.fullmatch(targets, name) is not None
    else:
        adapted = name in targets
    if adapted:
        untie_output(model)


def _backend(cfg: TrainConfig, model: Any, tokenizer: Any, device: torch.device) -> RolloutBackend:
    hp = cfg.hyperparameters
    assert isinstance(hp, ResolvedReinforcementHyperparameters)
    context = getattr(model.config, "max_position_embeddings", None)
    # A prompt keeps its last tokens: as many as max_prompt_length, and no more than the context leaves.
    prompt_room = min(hp.max_prompt_length, context - hp.max_new_tokens) if context else hp.max_prompt_length
    sampling = Sampling(
        max_new_tokens=hp.max_new_tokens,
        temperature=hp.temperature,
        top_p=hp.top_p,
        max_prompt_length=max(prompt_room, 1),
        stop=tuple(hp.stop or ()),
        max_context=trajectory_budget(cfg.tools, context) if cfg.tools else None,
    )
    try:
        return make_backend(
            cfg.operator.rollout_backend,
            model,
            tokenizer,
            sampling,
            device=device,
            vllm_options=dict(cfg.operator.vllm_options) or None,
        )
    except ImportError as exc:
        raise JobError("rollout_backend_failed", f"the rollout backend could not be loaded: {exc}") from None


def _agent(
    cfg: TrainConfig, items: list[dict[str, Any]], valid_items: list[dict[str, Any]], model: Any, tokenizer: Any
) -> Agent:
    """A run's tools ready to call; every line offers only tools the job declares."""
    from service.tools import ToolRunner

    toolset = cfg.tools
    assert toolset is not None
    for which, lines in (("training", items), ("validation", valid_items)):
        for n, item in enumerate(lines, 1):
            unknown = toolset.unknown(item.get("tools"))
            if unknown:
                raise JobError(
                    "unknown_tool",
                    f"line {n} of the {which} file offers {', '.join(unknown)}, which the job does not declare; "
                    "declare each in method.reinforcement.tools, or take it off the line",
                )
    context = getattr(model.config, "max_position_embeddings", None)
    runner = ToolRunner(toolset, allowed_urls=cfg.operator.tool_urls)
    return Agent.of(toolset, runner, tokenizer, budget=trajectory_budget(toolset, context), job_id=cfg.job_name)


def make_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_ratio: float, total_steps: int) -> Any:
    """Hugging Face's schedules (the curves HF Trainer users know), stepped once per RLOO step."""
    from transformers import get_scheduler

    hf_name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[name]
    warmup = math.ceil(warmup_ratio * total_steps)
    return get_scheduler(hf_name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)

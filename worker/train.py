"""The RLOO training loop, top to bottom: rollout, score, KL, advantages, update, record, checkpoint.

One function, ``train``, runs a job for the Celery task and for ``rloo train`` alike; where the
numbers go (database or stdout) is the ``Recorder``'s business. The math lives in ``worker.rloo``.

A step, for ``B`` prompts and ``k`` completions each (``N = B * k``, prompt-major):

1. generate the N completions (one prompt encoding shared by its k samples);
2. score them (NaN where a completion cannot be scored);
3. reference log-probs (no grad), when ``kl_coef > 0``: a frozen copy for full fine-tuning, the
   same model with its adapter disabled for LoRA;
4. for each of ``gradient_accumulation_steps`` micro-batches (whole groups, so leave-one-out
   baselines never cross a micro-batch): policy log-probs with grad; on the first pass their
   detached values are the sampling policy's (no extra forward), which gives the KL and the
   advantages; loss, backward;
5. clip the gradient norm, optimizer step; repeat 4-5 ``ppo_epochs`` times; scheduler step;
6. record metrics, evaluate, checkpoint (with the training state, so a restart resumes exactly).
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from service import graders, jobspec
from worker import rloo
from worker.checkpoints import list_checkpoints, prune_checkpoints, read_training_state, save_checkpoint
from worker.config import TrainConfig
from worker.data import batch_indices, load_items, prompt_text
from worker.records import JobError, Recorder
from worker.rewards import EMBEDDING_PACKAGE, RewardModels, score_batch
from worker.rollout import Rollout, RolloutBackend, Sampling, completion_logprobs, make_backend

# Hyperparameters a resumed run may change (they do not alter what was learned so far).
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "n_epochs", "checkpoint_interval", "keep_checkpoints", "eval_interval", "eval_samples"}
)


@dataclass
class TrainResult:
    steps: int
    stopped: str | None
    final_checkpoint: Path | None
    first_reward: float | None
    last_reward: float | None
    trained_tokens: int
    resumed_from: int | None = None


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
    from service.storage import confined

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


def load_policy(name: str, models_dir: Path, device: torch.device) -> tuple[Any, Any]:
    path = model_path(name, models_dir)
    return load_causal_lm(path, device, name=name), load_tokenizer(path, name=name)


def add_lora(model: Any, spec: dict[str, Any], *, resume_from: Path | None) -> Any:
    """Wrap ``model`` with LoRA adapters (``peft``); from ``resume_from`` when continuing a run."""
    from peft import LoraConfig, PeftModel, get_peft_model

    try:
        if resume_from is not None:
            return PeftModel.from_pretrained(model, resume_from, is_trainable=True)
        targets = spec["target_modules"]
        config = LoraConfig(
            r=spec["r"],
            lora_alpha=spec["alpha"],
            lora_dropout=spec["dropout"],
            target_modules=targets,
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
        # since a KL loss term may save it for backward.
        with torch.inference_mode():
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


def make_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_ratio: float, total_steps: int) -> Any:
    """Hugging Face's schedules (the curves HF Trainer users know), stepped once per RLOO step."""
    from transformers import get_scheduler

    hf_name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[name]
    warmup = math.ceil(warmup_ratio * total_steps)
    return get_scheduler(hf_name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def rng_state(device: torch.device) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate((state["python_version"], tuple(state["python"]), None))


@contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def train(cfg: TrainConfig, recorder: Recorder) -> TrainResult:
    t_setup = time.perf_counter()
    hp = cfg.hp
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    autocast = autocast_for(hp("precision"), device)
    lora = hp("lora")

    # Setup: data, grader, models ----------------------------------------------------------------
    items = load_items(cfg.training_file)
    valid_items = load_items(cfg.validation_file) if cfg.validation_file else []
    grader = graders.parse_grader(cfg.grader, allow_python=bool(cfg.extra.get("allow_python_grader")))
    reward_models = (
        RewardModels(
            models_dir=cfg.models_dir,
            device=device,
            embedding_model=cfg.extra.get("embedding_model") or EMBEDDING_PACKAGE,
        )
        if graders.is_model_grader(grader)
        else None
    )
    total_steps = jobspec.total_steps(len(items), cfg.hyperparameters)

    resume_info: dict[str, Any] | None = None
    resume_state: dict[str, Any] = {}
    if cfg.resume_from is not None:
        resume_state, resume_info = read_training_state(cfg.resume_from)
        _check_resumable(cfg, resume_info, total_steps)

    base_path = model_path(cfg.model, cfg.models_dir)
    tokenizer = load_tokenizer(base_path, name=cfg.model)
    base = load_causal_lm(base_path, device, name=cfg.model)
    # The base model's own dropout is switched off, as TRL does: with it, the log-probs of the update
    # would not be those of the policy that sampled (generation runs in eval mode), and the KL would
    # carry dropout noise. A LoRA adapter's dropout, asked for explicitly, is added afterwards and stays.
    for module in base.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # functional dropout (Llama, Qwen)
            module.attention_dropout = 0.0
    if hp("gradient_checkpointing"):
        # Non-reentrant checkpointing: correct with frozen inputs (LoRA) and with no_grad passes.
        enable = getattr(base, "activation_checkpointing_enable", None)  # transformers >= 5.x
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = None
    if lora:
        model = add_lora(base, lora, resume_from=cfg.resume_from)
        if hp("kl_coef") > 0:
            ref = Reference(model, lora=True)
    else:
        model = base
        if hp("kl_coef") > 0:
            # The reference is the starting weights: copied before a resumed run loads its own.
            ref = Reference(model, lora=False)
        if cfg.resume_from is not None:
            _load_full_weights(model, cfg.resume_from, device)
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel (CPU and CUDA): one pass over all parameters instead of a Python loop of ops each.
    optimizer = torch.optim.AdamW(
        params,
        lr=hp("learning_rate") * hp("learning_rate_multiplier"),
        weight_decay=hp("weight_decay"),
        fused=device.type in ("cpu", "cuda"),
    )
    scheduler = make_scheduler(optimizer, hp("lr_scheduler"), hp("warmup_ratio"), total_steps)
    try:
        sampling = Sampling(
            max_new_tokens=hp("max_new_tokens"),
            temperature=hp("temperature"),
            top_p=hp("top_p"),
            max_prompt_length=hp("max_prompt_length"),
            stop=tuple(hp("stop") or ()),
        )
        backend = make_backend(
            cfg.extra.get("rollout_backend", "auto"),
            model,
            tokenizer,
            sampling,
            device=device,
            vllm_options=cfg.extra.get("vllm_options"),
        )
    except ImportError as exc:
        raise JobError("rollout_backend_failed", f"the rollout backend could not be loaded: {exc}") from None
    k, batch_size, temperature = hp("rloo_k"), hp("batch_size"), hp("temperature")
    n_micro = hp("gradient_accumulation_steps")

    start = 0
    counters: dict[str, Any] = {"trained_tokens": 0, "first_reward": None, "valid_reward_mean": None}
    n_params = sum(p.numel() for p in model.parameters())
    recorder.event(
        f"Model '{cfg.model}' ready on {device.type} in {time.perf_counter() - t_setup:.1f} s: "
        f"{n_params / 1e6:.1f}M parameters, {sum(p.numel() for p in params) / 1e6:.2f}M trained"
    )
    if resume_info is not None:
        optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        set_rng_state(resume_state["rng"], device)
        counters.update(resume_info["counters"])
        start = int(resume_info["step"])
        recorder.event(f"Resumed from the checkpoint at step {start}; continuing at step {start + 1}")
    else:
        what = f"LoRA r={lora['r']}" if lora else "full fine-tuning"
        recorder.event(
            f"Training started: {total_steps} steps, {batch_size} prompts x {k} completions a step, "
            f"{what}, on {device.type}, rollouts by {backend.name}"
        )

    def save(step: int, metrics: dict[str, Any], final: bool) -> Path:
        state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(device),
        }
        epoch, offset = divmod(step * batch_size, len(items))
        info = {
            "format_version": 1,
            "step": step,
            "total_steps": total_steps,
            "seed": cfg.seed,
            "model": cfg.model,
            "adapter": "lora" if lora else None,
            "data_position": {"epoch": epoch, "offset": offset, "n_items": len(items)},
            "hyperparameters": cfg.hyperparameters,
            "counters": counters,
        }
        path = save_checkpoint(
            model=model, tokenizer=tokenizer, output_dir=cfg.output_dir, step=step, training_state=state, info=info
        )
        recorder.checkpoint(step, path, _ckpt_metrics(metrics, counters), final)
        if hp("keep_checkpoints"):
            for removed in prune_checkpoints(cfg.output_dir, hp("keep_checkpoints")):
                recorder.checkpoint_removed(removed)
        return path

    last_reward = None
    stopped = None
    final_ckpt = None
    step = start
    metrics: dict[str, Any] = {}
    for step in range(start + 1, total_steps + 1):
        t_step = time.perf_counter()

        # 1. Rollout: k completions for each of B prompts, prompt-major ----------------------------
        batch = [
            items[i] for i in batch_indices(n_items=len(items), batch_size=batch_size, step=step - 1, seed=cfg.seed)
        ]
        prompts = [prompt_text(item, tokenizer) for item in batch]
        with autocast:
            ro = backend.generate(prompts, k=k, generator_seed=cfg.seed * 1_000_003 + step)
        mask = ro.completion_mask.to(torch.float32)
        loss_mask = mask * (~ro.truncated).unsqueeze(-1) if hp("mask_truncated_completions") else mask
        t_generate = time.perf_counter() - t_step

        # 2. Score: the grader gives r[b, i]; NaN where a completion could not be scored -----------
        t0 = time.perf_counter()
        try:
            graded = score_batch(
                grader,
                prompts=[p for p in prompts for _ in range(k)],
                texts=ro.texts,
                items=[item for item in batch for _ in range(k)],
                reward_models=reward_models,
            )
        except graders.GraderUnavailable as exc:
            raise JobError("grader_unavailable", f"step {step}: {exc}") from None
        rewards = torch.tensor(graded.rewards, dtype=torch.float32).view(batch_size, k)
        finite = torch.isfinite(rewards)
        if not finite.any():
            raise JobError(
                "reward_not_finite",
                f"step {step}: no completion could be scored (all rewards NaN); "
                "check the grader with POST /v1/fine_tuning/alpha/graders/run",
            )
        # On the device from here: advantages and KL never travel back to the host within the step.
        rewards, finite = rewards.to(device), finite.to(device)
        t_score = time.perf_counter() - t0

        # 3. Reference log-probs, in micro-batches of whole groups ------------------------------------
        t0 = time.perf_counter()
        rows_per_micro = batch_size // n_micro
        micro = [slice(m * rows_per_micro * k, (m + 1) * rows_per_micro * k) for m in range(n_micro)]
        ref_logp = None
        if ref is not None:
            with autocast:
                ref_logp = torch.cat([ref.logprobs(ro.rows(sl), temperature=temperature) for sl in micro])
        t_ref = time.perf_counter() - t0

        # 4-5. Advantages and the update ------------------------------------------------------------
        t0 = time.perf_counter()
        model.train()
        fold_kl = ref_logp is not None and hp("kl_in_reward")
        # Whitening a KL-shaped reward over several micro-batches needs every group's KL up front.
        prepass = fold_kl and n_micro > 1 and hp("normalize_advantages")
        kl_seq = torch.zeros(batch_size * k, device=device)
        advantages = torch.zeros(batch_size, k, device=device)
        old_logp: list[Tensor] = []
        if not fold_kl:
            # The advantages do not depend on the policy's log-probs: all of them now.
            advantages = _advantages(cfg, rewards, None, finite)
        elif prepass and ref_logp is not None:
            # Whitening needs every group's KL-shaped reward before the first micro-batch's backward:
            # one pass without grad gives the sampling policy's log-probs (the only case that costs one).
            with torch.no_grad(), autocast:
                for sl in micro:
                    old_logp.append(completion_logprobs(model, ro.rows(sl), temperature=temperature)[0])
            kl_seq = rloo.sequence_kl(torch.cat(old_logp), ref_logp, mask, hp("kl_estimator")).float()
            advantages = _advantages(cfg, rewards, kl_seq.view(batch_size, k), finite)
        norm = rloo.loss_normalizer(loss_mask, hp("loss_aggregation"))
        has_loss = bool(loss_mask.any())
        # Statistics stay on the device until the step is recorded: no host sync per micro-batch.
        entropy_sum = torch.zeros((), device=device)
        for epoch in range(hp("ppo_epochs")):
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            clip_sum = torch.zeros((), device=device)
            for m, sl in enumerate(micro):
                with autocast:
                    logp, entropy = completion_logprobs(
                        model, ro.rows(sl), temperature=temperature, with_entropy=epoch == 0
                    )
                if epoch == 0:
                    if not prepass:
                        old_logp.append(logp.detach())  # the sampling policy: no extra forward for it
                    if entropy is not None:
                        entropy_sum += (entropy.float() * mask[sl]).sum()
                    if ref_logp is not None:
                        kl_seq[sl] = rloo.sequence_kl(old_logp[m], ref_logp[sl], mask[sl], hp("kl_estimator"))
                    if fold_kl and not prepass:
                        # Whole groups: this micro-batch's leave-one-out advantages are the batch's.
                        rows = slice(m * rows_per_micro, (m + 1) * rows_per_micro)
                        advantages[rows] = _advantages(
                            cfg, rewards[rows], kl_seq[sl].view(rows_per_micro, k), finite[rows]
                        )
                adv = advantages.view(-1)[sl].to(device)
                loss, stats = rloo.policy_loss(
                    logp.float(),
                    old_logp[m].float(),
                    adv,
                    loss_mask[sl],
                    clip_epsilon=hp("clip_epsilon"),
                    clip_epsilon_high=hp("clip_epsilon_high"),
                    aggregation=hp("loss_aggregation"),
                    normalizer=norm,
                )
                if ref_logp is not None and not hp("kl_in_reward"):
                    loss = loss + hp("kl_coef") * rloo.kl_loss(
                        logp.float(),
                        ref_logp[sl].float(),
                        loss_mask[sl],
                        estimator=hp("kl_estimator"),
                        aggregation=hp("loss_aggregation"),
                        normalizer=norm,
                    )
                loss.backward()
                loss_sum += loss.detach()
                clip_sum += stats["clip_frac"]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, hp("max_grad_norm"))
            if has_loss:  # else the gradient is all zero: AdamW's momentum and decay must not move the weights
                optimizer.step()
        backend.sync()  # the next rollouts come from the updated weights
        learning_rate = scheduler.get_last_lr()[0]
        scheduler.step()
        t_update = time.perf_counter() - t0

        # 6. Record -----------------------------------------------------------------------------
        n = batch_size * k
        gen_tokens = int(mask.sum().item())
        counters["trained_tokens"] += gen_tokens + int(ro.prompt_mask.sum().item())
        finite_rewards = rewards[finite]
        reward_mean = float(finite_rewards.mean())  # at least one is finite (checked above)
        # A group gives no signal when its finite rewards are all equal (or fewer than two).
        group_max = torch.where(finite, rewards, -math.inf).amax(dim=1)
        group_min = torch.where(finite, rewards, math.inf).amin(dim=1)
        zero_std = (finite.sum(dim=1) < 2) | (group_max == group_min)
        time_step = time.perf_counter() - t_step
        metrics = {
            "step": step,
            "total_steps": total_steps,
            "train_reward_mean": reward_mean,
            "train_reward_std": float(finite_rewards.std(unbiased=False)) if finite_rewards.numel() > 1 else 0.0,
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "advantage_std": float(advantages[finite].std(unbiased=False)) if finite.sum() > 1 else 0.0,
            "kl": float(kl_seq.mean()),
            "loss": float(loss_sum),
            "entropy": float(entropy_sum / mask.sum().clamp(min=1.0)),
            "grad_norm": float(grad_norm),
            "learning_rate": learning_rate,
            "completion_length_mean": float(mask.sum(dim=1).mean()),
            "clipped_ratio": float(ro.truncated.float().mean()),
            "clip_frac": float(clip_sum),
            "nan_rewards": int((~finite).sum()),
            "time_generate": t_generate,
            "time_score": t_score,
            "time_reference": t_ref,
            "time_update": t_update,
            "time_step": time_step,
            "completions_per_s": n / time_step,
            "tokens_per_s": gen_tokens / time_step,
            "trained_tokens": counters["trained_tokens"],
        }
        for name, message in graded.messages.items():  # the first error of each grader, once a run
            if name not in counters.setdefault("reported_grader_errors", []):
                counters["reported_grader_errors"].append(name)
                recorder.event(
                    f"Grader '{name}' could not score a sample at step {step}: {message} (such samples "
                    f"score NaN; graders.{name}.errors counts them)",
                    level="warn",
                )
        for name, values in graded.sub_rewards.items():
            vals = [v for v in values if math.isfinite(v)]
            metrics[f"graders.{name}.mean"] = sum(vals) / len(vals) if vals else float("nan")
            metrics[f"graders.{name}.errors"] = graded.errors.get(name, 0)
        if valid_items and hp("eval_interval") and (step % hp("eval_interval") == 0 or step == total_steps):
            with autocast:
                valid = evaluate(cfg, backend, tokenizer, grader, valid_items, reward_models, device)
            metrics["valid_reward_mean"] = counters["valid_reward_mean"] = valid
        if counters["first_reward"] is None:
            counters["first_reward"] = reward_mean
        last_reward = reward_mean
        stopped = recorder.step(step, metrics)
        if stopped == "paused" and step == total_steps:
            stopped = None  # nothing is left to pause: finish

        # 7. Checkpoint: at the interval, and where a pause or cancel stops the run ------------------
        if stopped in ("paused", "cancelled"):
            final_ckpt = save(step, metrics, final=False)
            break
        if stopped is not None:  # "lost": the job is another worker's now; write nothing more
            break
        if hp("checkpoint_interval") and step % hp("checkpoint_interval") == 0 and step < total_steps:
            save(step, metrics, final=False)

    if stopped is None:
        if step > start:
            final_ckpt = save(step, metrics, final=True)
        else:
            recorder.event(f"Nothing to do: the run already reached its last step ({total_steps})")
    return TrainResult(
        step, stopped, final_ckpt, counters["first_reward"], last_reward, counters["trained_tokens"], start or None
    )


def _advantages(cfg: TrainConfig, rewards: Tensor, kl: Tensor | None, finite: Tensor) -> Tensor:
    """Leave-one-out advantages ``(B, k)`` of the (clipped, KL-shaped) rewards, whitened if asked."""
    shaped = rloo.shape_rewards(rewards, kl, kl_coef=cfg.hp("kl_coef"), reward_clip=cfg.hp("reward_clip"))
    advantages = rloo.rloo_advantages(shaped)
    if cfg.hp("normalize_advantages"):
        # Whiten only advantages that carry signal: groups with < 2 finite rewards stay at 0.
        advantages = rloo.whiten(advantages, finite & (finite.sum(dim=1, keepdim=True) >= 2))
    return advantages


def _check_resumable(cfg: TrainConfig, info: dict[str, Any], total_steps: int) -> None:
    where = cfg.resume_from
    if info.get("format_version") != 1:
        raise JobError("resume_failed", f"{where}: unknown checkpoint format {info.get('format_version')}")
    if info["model"] != cfg.model or info["seed"] != cfg.seed:
        raise JobError(
            "resume_failed",
            f"{where} was trained from model '{info['model']}' with seed {info['seed']}, "
            f"not '{cfg.model}' with seed {cfg.seed}",
        )
    changed = sorted(
        name
        for name in set(info["hyperparameters"]) | set(cfg.hyperparameters)
        if info["hyperparameters"].get(name) != cfg.hyperparameters.get(name) and name not in RESUMABLE_CHANGES
    )
    if changed:
        raise JobError(
            "resume_failed",
            f"{where} was trained with other values of {', '.join(changed)}; a resumed run may change "
            f"only {', '.join(sorted(RESUMABLE_CHANGES))}",
        )
    step = int(info["step"])
    if total_steps < step:
        raise JobError("resume_failed", f"{where} is at step {step}, past this run's last step ({total_steps})")
    schedule_moves = cfg.hp("lr_scheduler") != "constant" or cfg.hp("warmup_ratio") > 0
    if total_steps != info["total_steps"] and schedule_moves:
        raise JobError(
            "resume_failed",
            f"{where} was trained on a {cfg.hp('lr_scheduler')} schedule over {info['total_steps']} steps; "
            f"this run has {total_steps}, which would bend the learning-rate curve mid-run. Keep max_steps and "
            "n_epochs as they were (only a constant schedule without warmup can be extended)",
        )
    newer = [s for s, _ in list_checkpoints(cfg.output_dir) if s > step]
    if newer:
        raise JobError(
            "resume_failed",
            f"{cfg.output_dir} already holds checkpoints past step {step} (steps {newer}) from another run of "
            "it; resume from the newest, or write this run elsewhere (--output-dir)",
        )


def _load_full_weights(model: Any, path: Path, device: torch.device) -> None:
    """A full checkpoint's weights into ``model`` (loaded from the base, so tied weights stay tied)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise JobError("resume_failed", f"{path} holds no model weights")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f, device=str(device)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained leaves out an output head tied to the input embeddings; nothing else may be missing.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise JobError("resume_failed", f"{path} does not match the model: missing {missing}, unexpected {unexpected}")


def _ckpt_metrics(metrics: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    keys = ("step", "train_reward_mean", "kl", "loss", "entropy")
    out = {key: metrics[key] for key in keys if key in metrics}
    if counters.get("valid_reward_mean") is not None:
        out["valid_reward_mean"] = counters["valid_reward_mean"]
    return out


@torch.no_grad()
def evaluate(
    cfg: TrainConfig,
    backend: RolloutBackend,
    tokenizer: Any,
    grader: Any,
    items: list[dict[str, Any]],
    reward_models: RewardModels | None,
    device: torch.device,
) -> float:
    """Mean reward of one sample on each of the first ``eval_samples`` validation prompts.

    Sampling is seeded the same way at every pass, so passes differ only by the model, and the
    training run's random state is left as it was.
    """
    batch = items[: cfg.hp("eval_samples")]
    prompts = [prompt_text(item, tokenizer) for item in batch]
    rewards: list[float] = []
    with preserved_rng(device):
        for i in range(0, len(batch), 64):
            ro = backend.generate(prompts[i : i + 64], k=1, generator_seed=cfg.seed + 7919 + i)
            graded = score_batch(
                grader,
                prompts=prompts[i : i + 64],
                texts=ro.texts,
                items=batch[i : i + 64],
                reward_models=reward_models,
            )
            rewards.extend(r for r in graded.rewards if math.isfinite(r))
    return sum(rewards) / len(rewards) if rewards else float("nan")

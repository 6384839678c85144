"""The RLOO training loop, top to bottom: rollout, score, KL, advantages, update, record, checkpoint.

One function, ``train``, runs a job for the Celery task and for ``rloo train`` alike; where the
numbers go (database or stdout) is the ``Recorder``'s business. The math lives in ``worker.rloo``.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service import graders, jobspec
from worker import rloo
from worker.checkpoints import save_checkpoint
from worker.config import TrainConfig
from worker.data import batch_indices, load_items, prompt_text
from worker.records import JobError, Recorder
from worker.rewards import RewardModels, score_batch
from worker.rollout import TransformersBackend, completion_logprobs


@dataclass
class TrainResult:
    steps: int
    stopped: str | None
    final_checkpoint: Path | None
    first_reward: float | None
    last_reward: float | None
    trained_tokens: int


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_policy(name: str, models_dir: Path, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from service.storage import confined

    hf_logging.disable_progress_bar()

    path: Path | str = name
    try:
        local = confined(models_dir, name)
        if local.is_dir():
            path = local
    except ValueError:
        raise JobError("invalid_model", f"model '{name}' is outside the models root") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as exc:
        raise JobError("model_load_failed", f"could not load model '{name}': {exc}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer  # type: ignore[arg-type]


def train(cfg: TrainConfig, recorder: Recorder) -> TrainResult:
    hp = cfg.hp
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    # Setup: data, grader, models ----------------------------------------------------------------
    items = load_items(cfg.training_file)
    valid_items = load_items(cfg.validation_file) if cfg.validation_file else []
    grader = graders.parse_grader(cfg.grader, allow_python=bool(cfg.extra.get("allow_python_grader")))
    reward_models = RewardModels(models_dir=cfg.models_dir, device=device) if graders.is_model_grader(grader) else None
    model, tokenizer = load_policy(cfg.model, cfg.models_dir, device)
    # The frozen reference: a copy of the starting weights, and none at all when kl_coef is 0.
    ref_model = None
    if hp("kl_coef") > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=hp("learning_rate") * hp("learning_rate_multiplier"), weight_decay=hp("weight_decay")
    )
    backend = TransformersBackend(
        model,
        tokenizer,
        max_new_tokens=hp("max_new_tokens"),
        temperature=hp("temperature"),
        top_p=hp("top_p"),
        max_prompt_length=hp("max_prompt_length"),
    )
    k, batch_size, temperature = hp("rloo_k"), hp("batch_size"), hp("temperature")
    total_steps = jobspec.total_steps(len(items), cfg.hyperparameters)
    recorder.event(
        f"Training started: {total_steps} steps, {batch_size} prompts x {k} completions a step, on {device.type}"
    )

    first_reward = last_reward = None
    trained_tokens = 0
    stopped = None
    final_ckpt = None
    step = 0
    metrics: dict[str, Any] = {}
    for step in range(1, total_steps + 1):
        t_step = time.perf_counter()

        # 1. Rollout: k completions for each of B prompts, prompt-major ----------------------------
        batch = [
            items[i] for i in batch_indices(n_items=len(items), batch_size=batch_size, step=step - 1, seed=cfg.seed)
        ]
        prompts = [prompt_text(item, tokenizer) for item in batch]
        with autocast:
            ro = backend.generate(prompts, k=k, generator_seed=cfg.seed * 1_000_003 + step)
        mask = ro.completion_mask.to(torch.float32)
        t_generate = time.perf_counter() - t_step

        # 2. Score: the grader gives r[b, i]; NaN where a completion could not be scored -----------
        t0 = time.perf_counter()
        graded = score_batch(
            grader,
            prompts=[p for p in prompts for _ in range(k)],
            texts=ro.texts,
            items=[item for item in batch for _ in range(k)],
            reward_models=reward_models,
        )
        rewards = torch.tensor(graded.rewards, dtype=torch.float32).view(batch_size, k)
        finite = torch.isfinite(rewards)
        if not finite.any():
            raise JobError(
                "reward_not_finite",
                f"step {step}: no completion could be scored (all rewards NaN); "
                "check the grader with POST /v1/fine_tuning/alpha/graders/run",
            )
        t_score = time.perf_counter() - t0

        # 3. Policy log-probs (with grad) and the KL to the reference --------------------------------
        t0 = time.perf_counter()
        model.train()
        with autocast:
            logp, entropy = completion_logprobs(model, ro, temperature=temperature, with_entropy=True)
        old_logp = logp.detach()  # the sampling policy: one pass needs no extra forward for it
        ref_logp = None
        kl_seq = torch.zeros(batch_size * k)
        if ref_model is not None:
            with torch.no_grad(), autocast:
                ref_logp, _ = completion_logprobs(ref_model, ro, temperature=temperature)
            kl_seq = rloo.sequence_kl(old_logp, ref_logp, mask, hp("kl_estimator")).float().cpu()

        # 4. Leave-one-out advantages on the (B, k) rewards, KL folded in first -----------------------
        shaped = rewards - hp("kl_coef") * kl_seq.view(batch_size, k) if hp("kl_in_reward") else rewards
        advantages = rloo.rloo_advantages(shaped)
        if hp("normalize_advantages"):
            # Whiten only advantages that carry signal: groups with < 2 finite rewards stay at 0.
            advantages = rloo.whiten(advantages, finite & (finite.sum(dim=1, keepdim=True) >= 2))
        adv = advantages.view(-1).to(device)

        # 5. Update: clipped policy gradient over completion tokens, ppo_epochs passes ----------------
        for epoch in range(hp("ppo_epochs")):
            if epoch > 0:
                with autocast:
                    logp, _ = completion_logprobs(model, ro, temperature=temperature)
            loss, stats = rloo.policy_loss(
                logp,
                old_logp,
                adv,
                mask,
                clip_epsilon=hp("clip_epsilon"),
                clip_epsilon_high=hp("clip_epsilon_high"),
                aggregation=hp("loss_aggregation"),
            )
            if ref_logp is not None and not hp("kl_in_reward"):
                loss = loss + hp("kl_coef") * rloo.kl_loss(
                    logp, ref_logp, mask, estimator=hp("kl_estimator"), aggregation=hp("loss_aggregation")
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp("max_grad_norm"))
            optimizer.step()
        t_update = time.perf_counter() - t0

        # 6. Record -----------------------------------------------------------------------------
        n = batch_size * k
        gen_tokens = int(mask.sum().item())
        trained_tokens += gen_tokens + int(ro.prompt_mask.sum().item())
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
            "loss": float(loss.detach()),
            "entropy": float(rloo.masked_mean(entropy, mask)) if entropy is not None else None,
            "grad_norm": float(grad_norm),
            "learning_rate": optimizer.param_groups[0]["lr"],
            "completion_length_mean": float(mask.sum(dim=1).mean()),
            "clipped_ratio": float(ro.truncated.float().mean()),
            "clip_frac": float(stats["clip_frac"]),
            "nan_rewards": int((~finite).sum()),
            "time_generate": t_generate,
            "time_score": t_score,
            "time_update": t_update,
            "time_step": time_step,
            "completions_per_s": n / time_step,
            "tokens_per_s": gen_tokens / time_step,
            "trained_tokens": trained_tokens,
        }
        for name, values in graded.sub_rewards.items():
            vals = [v for v in values if math.isfinite(v)]
            metrics[f"graders.{name}.mean"] = sum(vals) / len(vals) if vals else float("nan")
            metrics[f"graders.{name}.errors"] = graded.errors.get(name, 0)
        if hp("eval_interval") and valid_items and step % hp("eval_interval") == 0:
            metrics["valid_reward_mean"] = evaluate(cfg, backend, tokenizer, grader, valid_items, reward_models)
        if first_reward is None:
            first_reward = reward_mean
        last_reward = reward_mean
        stopped = recorder.step(step, metrics)

        # 7. Checkpoint -------------------------------------------------------------------------
        if hp("checkpoint_interval") and step % hp("checkpoint_interval") == 0 and step < total_steps and not stopped:
            path = save_checkpoint(model=model, tokenizer=tokenizer, output_dir=cfg.output_dir, step=step)
            recorder.checkpoint(step, path, _ckpt_metrics(metrics), False)
        if stopped:
            break

    if stopped is None or stopped == "cancelled":
        final_ckpt = save_checkpoint(model=model, tokenizer=tokenizer, output_dir=cfg.output_dir, step=step)
        recorder.checkpoint(step, final_ckpt, _ckpt_metrics(metrics), stopped is None)
    return TrainResult(step, stopped, final_ckpt, first_reward, last_reward, trained_tokens)


def _ckpt_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    keys = ("train_reward_mean", "valid_reward_mean", "kl", "loss", "entropy")
    return {key: metrics[key] for key in keys if key in metrics}


@torch.no_grad()
def evaluate(
    cfg: TrainConfig,
    backend: TransformersBackend,
    tokenizer: Any,
    grader: Any,
    items: list[dict[str, Any]],
    reward_models: RewardModels | None,
) -> float:
    """Mean reward of one sample on each of the first ``eval_samples`` validation prompts.

    Sampling is seeded the same way at every pass, so passes differ only by the model.
    """
    batch = items[: cfg.hp("eval_samples")]
    prompts = [prompt_text(item, tokenizer) for item in batch]
    rewards: list[float] = []
    state = torch.get_rng_state()
    for i in range(0, len(batch), 64):
        ro = backend.generate(prompts[i : i + 64], k=1, generator_seed=cfg.seed + 7919 + i)
        graded = score_batch(
            grader, prompts=prompts[i : i + 64], texts=ro.texts, items=batch[i : i + 64], reward_models=reward_models
        )
        rewards.extend(r for r in graded.rewards if math.isfinite(r))
    torch.set_rng_state(state)
    return sum(rewards) / len(rewards) if rewards else float("nan")

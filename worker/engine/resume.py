"""Continuing a run: the state a checkpoint holds besides the weights (written by ``save``, read
back by ``restore``), and the checks before a run resumes from one.

A checkpoint's training state (``worker.engine.checkpoints``) holds the optimizer, the scheduler and the
RNG states; its JSON description holds the step, the data position, the hyperparameters and the
run's counters. A resumed run must be the same run: same model, seed and hyperparameters (but
``RESUMABLE_CHANGES``), the same learning-rate curve, and no newer checkpoints of another run ahead.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from worker.engine.checkpoints import (
    TRAINING_INFO,
    checkpoint_dir,
    list_checkpoints,
    prune_checkpoints,
    save_checkpoint,
    staging_dir,
)
from worker.engine.config import TrainConfig
from worker.engine.distributed.ranks import SHARDED_STATE, current
from worker.engine.errors import JobError
from worker.engine.metrics import checkpoint_metrics
from worker.engine.recorders import Recorder
from worker.engine.state import Run, RunCounters

RESUMABLE_CHANGES = frozenset(
    {
        "max_steps",
        "n_epochs",
        "checkpoint_interval",
        "keep_checkpoints",
        "eval_interval",
        "eval_samples",
        "sample_interval",
        "sample_groups",
    }
)
"""Hyperparameters a resumed run may change: they do not alter what was learned so far."""


def save(run: Run, step: int, metrics: dict[str, Any], recorder: Recorder, *, final: bool) -> Path:
    """The checkpoint at ``step``, with what a run needs to continue from it; older ones pruned."""
    cfg, hp, ranks = run.cfg, run.hp, run.ranks
    carried = checkpoint_metrics(metrics, run.counters)
    state = {
        "scheduler": run.scheduler.state_dict(),
        "rng": rng_state(run.device),
    }
    epoch, offset = divmod(step * hp.batch_size, len(run.items))
    info = {
        "format_version": 1,
        "step": step,
        "total_steps": run.total_steps,
        "seed": cfg.seed,
        "model": cfg.model,
        "method": cfg.method,
        "adapter": "lora" if hp.lora else None,
        "data_position": {"epoch": epoch, "offset": offset, "n_items": len(run.items)},
        "hyperparameters": hp.model_dump(),
        "counters": run.counters.saved(),
        "ranks": ranks.world,
        "metrics": carried,
    }
    weights = None
    if ranks.distributed:
        # Every rank writes its optimizer shard into the staging directory, then rank 0 the weights
        # (gathered from every rank's shards) and the rest, and renames it into place.
        if ranks.is_main:
            staging_dir(cfg.output_dir, step, fresh=True)
        ranks.barrier()
        ranks.save_sharded(staging_dir(cfg.output_dir, step) / SHARDED_STATE, run.model, run.optimizer)
        weights = ranks.full_state_dict(run.model)
    else:
        state["optimizer"] = run.optimizer.state_dict()
    path = checkpoint_dir(cfg.output_dir, step)
    if ranks.is_main:
        path = save_checkpoint(
            model=run.model,
            tokenizer=run.tokenizer,
            output_dir=cfg.output_dir,
            step=step,
            training_state=state,
            info=info,
            state_dict=weights,
            staged=ranks.distributed,
        )
        recorder.checkpoint(step, path, carried, final)
        _prune(run, recorder)
    ranks.barrier()  # the checkpoint is whole (and published) before any rank goes on
    return path


def _prune(run: Run, recorder: Recorder) -> None:
    """Only the newest ``keep_checkpoints`` kept (main rank)."""
    if run.hp.keep_checkpoints:
        for removed in prune_checkpoints(run.cfg.output_dir, run.hp.keep_checkpoints):
            recorder.checkpoint_removed(removed)


def record_final(run: Run, recorder: Recorder) -> Path | None:
    """A run resumed at its last step trains nothing: the checkpoint it resumed from is its final one,
    recorded as such (not written again). The worker that saved it may have died (or lost the
    database) before writing its row, naming the model or pruning the ones before it. (A run with no
    step to take and none taken has no checkpoint: None.)"""
    path = run.cfg.resume_from
    if run.ranks.is_main:
        recorder.event(f"Nothing to do: the run already reached its last step ({run.total_steps})")
        if path is not None:
            info = json.loads((path / TRAINING_INFO).read_text())
            recorder.checkpoint(run.start, path, info.get("metrics") or {"step": run.start}, True, written=False)
            _prune(run, recorder)
    run.ranks.barrier()
    return path


def restore(run: Run, state: dict[str, Any], info: dict[str, Any]) -> None:
    """Continue ``run`` after the checkpoint's step: its optimizer, schedule, RNG and counters."""
    if "optimizer" in state:
        run.optimizer.load_state_dict(state["optimizer"])
    else:  # written by several ranks: each reads its shard
        assert run.cfg.resume_from is not None
        run.ranks.load_sharded(run.cfg.resume_from / SHARDED_STATE, run.model, run.optimizer)
    run.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], run.device)
    run.counters = RunCounters.restored(info["counters"])
    run.start = int(info["step"])


def check_resumable(cfg: TrainConfig, info: dict[str, Any], total_steps: int) -> None:
    where = cfg.resume_from
    if info.get("format_version") != 1:
        raise JobError("resume_failed", f"{where}: unknown checkpoint format {info.get('format_version')}")
    if info["model"] != cfg.model or info["seed"] != cfg.seed:
        raise JobError(
            "resume_failed",
            f"{where} was trained from model '{info['model']}' with seed {info['seed']}, "
            f"not '{cfg.model}' with seed {cfg.seed}",
        )
    now, then = cfg.hyperparameters.model_dump(), info["hyperparameters"]
    # A setting newer than the checkpoint had its default then.
    defaults = {name: f.default for name, f in type(cfg.hyperparameters).model_fields.items()}
    changed = sorted(
        name
        for name in set(then) | set(now)
        if then.get(name, defaults.get(name)) != now.get(name) and name not in RESUMABLE_CHANGES
    )
    if changed:
        raise JobError(
            "resume_failed",
            f"{where} was trained with other values of {', '.join(changed)}; a resumed run may change "
            f"only {', '.join(sorted(RESUMABLE_CHANGES))}",
        )
    written_by, ranks = int(info.get("ranks", 1)), current().world
    if written_by != ranks:
        raise JobError(
            "resume_failed",
            f"{where} was written by {written_by} rank(s); it resumes on the same number, not {ranks} "
            "(keep resources.gpus as it was)",
        )
    step = int(info["step"])
    if total_steps < step:
        raise JobError("resume_failed", f"{where} is at step {step}, past this run's last step ({total_steps})")
    hp = cfg.hyperparameters
    schedule_moves = hp.lr_scheduler != "constant" or hp.warmup_ratio > 0
    if total_steps != info["total_steps"] and schedule_moves:
        raise JobError(
            "resume_failed",
            f"{where} was trained on a {hp.lr_scheduler} schedule over {info['total_steps']} steps; "
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


def load_full_weights(model: Any, path: Path, device: torch.device, *, code: str = "resume_failed") -> None:
    """A full checkpoint's weights into ``model`` (loaded from the base, so tied weights stay tied)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise JobError(code, f"{path} holds no model weights")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f, device=str(device)))
    if _saved_untied(path):  # an output head of its own (a merged lm_head adapter): not the embeddings'
        untie_output(model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained leaves out an output head tied to the input embeddings; nothing else may be missing.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise JobError(code, f"{path} does not match the model: missing {missing}, unexpected {unexpected}")


def _saved_untied(path: Path) -> bool:
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("tie_word_embeddings", text.get("tie_word_embeddings")) is False


def untie_output(model: Any) -> bool:
    """Give an output layer that shares its weight with the input embeddings a copy of its own (and
    untie the config, so it is saved and loaded on its own). False when it shares nothing."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None or output.weight.data_ptr() != inputs.weight.data_ptr():
        return False
    output.weight = torch.nn.Parameter(output.weight.detach().clone(), requires_grad=output.weight.requires_grad)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


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

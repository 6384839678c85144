"""Checkpoints: a Hugging Face directory (the full model, or a LoRA adapter) plus the training state.

Layout of ``<output_dir>/step-N/``:

* ``config.json`` + ``model.safetensors`` (full fine-tuning) or ``adapter_config.json`` +
  ``adapter_model.safetensors`` (LoRA), and the tokenizer files: what a user downloads and loads
  with ``from_pretrained``.
* ``training_state.pt``: optimizer, scheduler and RNG states, the step and the run's counters, so
  that a restarted job continues exactly where it stopped. ``training_state.json``: the same
  position in words (step, data epoch and offset, hyperparameters), for people and for resume
  checks. Files named ``training_state*`` stay server-side (the download leaves them out).

A checkpoint is written under a temporary name and renamed into place: a crash leaves either the
whole directory or none of it. With an object store (``service.infra.artifacts``), the worker then
publishes it there (``publish_checkpoint``: every file, the completion marker last) before its row is
written; only checkpoints with the marker count (``resumable_checkpoint``), and a job resumed on a
host whose disk holds nothing fetches its newest one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from service.infra.artifacts import S3Store, Store

TRAINING_STATE = "training_state.pt"
TRAINING_INFO = "training_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")


def job_checkpoints_dir(artifacts_dir: Path, job_id: str) -> Path:
    """Where a job's checkpoints live under the artifacts root."""
    return artifacts_dir / "checkpoints" / job_id


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"step-{step}"


def staging_dir(output_dir: Path, step: int, *, fresh: bool = False) -> Path:
    """Where the checkpoint of ``step`` is written before it is renamed into place; ``fresh``
    empties it first."""
    tmp = output_dir / f".tmp-step-{step}"
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(
    *,
    model: Any,
    tokenizer: Any,
    output_dir: Path,
    step: int,
    training_state: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
    state_dict: dict[str, Any] | None = None,
    staged: bool = False,
) -> Path:
    """Save ``model`` (or its adapter), ``tokenizer`` and the training state to ``output_dir/step-N``.
    ``state_dict`` is the model's weights when the model cannot give them itself (its ranks'
    shards, gathered); ``staged``: the staging directory already holds part of the checkpoint (the
    ranks' optimizer shards) and is kept, not emptied."""
    import torch

    final = checkpoint_dir(output_dir, step)
    tmp = staging_dir(output_dir, step, fresh=not staged)
    weights = {"state_dict": state_dict} if state_dict is not None else {}
    try:
        if hasattr(model, "peft_config"):
            # The adapter alone: adapting a (tied) output head must not copy the base's embeddings into it.
            model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False, **weights)
        else:
            model.save_pretrained(tmp, safe_serialization=True, **weights)
        tokenizer.save_pretrained(tmp)
        if training_state is not None:
            torch.save(training_state, tmp / TRAINING_STATE)
        if info is not None:
            (tmp / TRAINING_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
        if final.exists():  # a replayed step (after a crash) rewrites its checkpoint
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def has_training_state(path: Path) -> bool:
    return (path / TRAINING_STATE).is_file() and (path / TRAINING_INFO).is_file()


def read_training_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors (loaded with ``weights_only``: no pickled code runs) and the JSON description."""
    import torch

    state = torch.load(path / TRAINING_STATE, map_location="cpu", weights_only=True)
    info = json.loads((path / TRAINING_INFO).read_text())
    return state, info


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories under ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        m = _STEP_DIR.fullmatch(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_resumable(output_dir: Path) -> Path | None:
    """The newest checkpoint a run can continue from, or None."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if has_training_state(path):
            return path
    return None


def prune_checkpoints(output_dir: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` checkpoints; returns the steps removed, oldest first."""
    existing = list_checkpoints(output_dir)
    removed = []
    for step, path in existing[: max(len(existing) - keep, 0)]:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():  # a directory that would not go is kept, and stays listed
            removed.append(step)
    return removed


# The object store --------------------------------------------------------------------------------
def checkpoint_key(store: Store, path: Path) -> str:
    """A checkpoint directory's key: its path relative to the artifacts root (or the store's cache)."""
    return path.resolve().relative_to(store.root).as_posix()


def publish_checkpoint(store: Store, path: Path) -> str:
    """Make the saved checkpoint ``path`` visible in the store, whole (nothing to do for the
    artifacts directory alone); returns its key, the row's path."""
    key = checkpoint_key(store, path)
    store.publish_checkpoint(key, path)
    return key


def unpublish_checkpoint(store: Store, output_dir: Path, step: int) -> None:
    """A pruned checkpoint (``prune_checkpoints``) removed from the store as well: marker first."""
    store.remove_checkpoint(checkpoint_key(store, checkpoint_dir(output_dir, step)))


def resumable_checkpoint(store: Store, output_dir: Path) -> Path | None:
    """``latest_resumable``, counting only what the store holds complete: the newest complete
    checkpoint with a training state, fetched into ``output_dir`` if this host lacks it. Local
    directories the store does not hold complete (written, then the upload cut off) are deleted:
    they are no checkpoint, and a resumed run must not see them as newer ones."""
    if not isinstance(store, S3Store):
        return latest_resumable(output_dir)
    complete = {
        int(m.group(1)): key
        for key in store.complete_checkpoints(checkpoint_key(store, output_dir))
        if (m := _STEP_DIR.fullmatch(key.rsplit("/", 1)[-1]))
    }
    for step, path in list_checkpoints(output_dir):
        if step not in complete:
            shutil.rmtree(path, ignore_errors=True)
    for step in sorted(complete, reverse=True):
        files = store.manifest(complete[step]) or {}
        if TRAINING_STATE in files and TRAINING_INFO in files:
            return store.fetch_checkpoint(complete[step])
    return None

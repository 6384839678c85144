"""Checkpoints in Hugging Face format, written under a temporary name and renamed into place."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def job_checkpoints_dir(artifacts_dir: Path, job_id: str) -> Path:
    """Where a job's checkpoints live under the artifacts root."""
    return artifacts_dir / "checkpoints" / job_id


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"step-{step}"


def save_checkpoint(*, model: Any, tokenizer: Any, output_dir: Path, step: int) -> Path:
    """Save ``model`` and ``tokenizer`` to ``output_dir/step-N``; a crash leaves no half directory."""
    final = checkpoint_dir(output_dir, step)
    tmp = output_dir / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if final.exists():  # a replayed step (after a crash) rewrites its checkpoint
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final

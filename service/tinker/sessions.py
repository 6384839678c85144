"""Tinker sessions, training models and checkpoints in the database: created, found (only within
the caller's project: another project's is as unknown as one that never was), described.

Names as the SDK makes them: a training model is ``<session>:train:<n>``; a checkpoint is
``tinker://<model>/weights/<name>`` (a state to resume: weights and optimizer) or
``tinker://<model>/sampler_weights/<name>`` (weights an inference worker serves) or
``tinker://<model>/external_weights/<name>`` (one Hugging Face model directory, LoRA merged, to download).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.errors import Invalid, NotFound
from service.core.tables import TinkerCheckpoint, TinkerModel, TinkerSession, now
from service.registry import memory_plan
from service.registry.inspection import check_policy, context_length, inspect_model
from service.registry.model_root import list_models, resolve_model
from service.tenancy import quotas

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""A tinker path's segment -> the SDK's checkpoint_type."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MODELS_A_SESSION = 64


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # "weights" | "sampler_weights"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


def parse_path(path: str, param: str = "path") -> TinkerPath:
    """A ``tinker://<model>/<weights|sampler_weights>/<name>`` path, or a 400 saying its form."""
    parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not NAME.match(parts[2]):
        raise Invalid(
            f"'{path[:200]}' is not a checkpoint path: give tinker://<model id>/weights/<name> (a saved state), "
            "tinker://<model id>/sampler_weights/<name> or tinker://<model id>/external_weights/<name>, as "
            "save_state, save_weights_for_sampler and save_weights_external answer",
            param=param,
            code="invalid_path",
        )
    return TinkerPath(parts[0], parts[1], parts[2])


def checked_name(name: str | None, default: str, param: str = "path") -> str:
    if name is None:
        return default
    if not NAME.match(name):
        raise Invalid(
            f"'{name[:200]}' cannot name a checkpoint: 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit",
            param=param,
            code="invalid_path",
        )
    return name


# Sessions ---------------------------------------------------------------------------------------------------
def create_session(
    session: Session,
    *,
    project: int,
    tags: list[str],
    user_metadata: dict[str, Any],
    sdk_version: str,
    name: str | None,
) -> TinkerSession:
    row = TinkerSession(
        project_seq=project,
        tags=[str(t)[:200] for t in tags[:32]],
        user_metadata={str(k)[:200]: str(v)[:2000] for k, v in list(user_metadata.items())[:64]},
        sdk_version=sdk_version[:64],
        display_name=(name or None) and name[:200],
        heartbeat_at=time.time(),
    )
    session.add(row)
    session.flush()
    return row


def get_session(session: Session, *, project: int, session_id: str) -> TinkerSession:
    row = session.scalar(
        select(TinkerSession).where(TinkerSession.id == session_id, TinkerSession.project_seq == project)
    )
    if row is None:
        raise NotFound(f"No session '{session_id[:200]}'.", param="session_id", code="session_not_found")
    return row


def heartbeat(session: Session, *, project: int, session_id: str) -> None:
    row = get_session(session, project=project, session_id=session_id)
    row.heartbeat_at = time.time()


# Training models ------------------------------------------------------------------------------------------
def create_model(
    session: Session,
    *,
    project: int,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    lora: dict[str, Any] | None,
    optimizer: dict[str, Any],
    user_metadata: dict[str, Any],
    models_dir: Path,
    accelerators: dict[str, float],
) -> TinkerModel:
    """A training model of the session on ``base_model`` (a causal LM with a tokenizer under the
    models root) whose state fits a declared accelerator (``check_memory``); a model id the session
    used already is a 400."""
    owner = get_session(session, project=project, session_id=session_id)
    quotas.check_session_room(session, project)
    path = resolve_model(models_dir, base_model, hub_offline=True, param="base_model")
    check_policy(path, base_model, "base_model")
    if isinstance(path, Path):  # (hub_offline: always a directory)
        check_memory(path, base_model, int((lora or {}).get("rank") or 0), accelerators)
    model_id = f"{session_id}:train:{model_seq_id}"
    if session.scalar(select(TinkerModel.seq).where(TinkerModel.id == model_id)) is not None:
        # A 400, not a 409: the SDK retries a 409 as a transient conflict.
        raise Invalid(f"Model '{model_id}' exists already.", param="model_seq_id", code="model_exists")
    count = len(session.scalars(select(TinkerModel.seq).where(TinkerModel.session_seq == owner.seq)).all())
    if count >= MAX_MODELS_A_SESSION:
        raise Invalid(
            f"A session holds at most {MAX_MODELS_A_SESSION} training models: start another session",
            param="model_seq_id",
            code="too_many_models",
        )
    row = TinkerModel(
        id=model_id,
        project_seq=project,
        session_seq=owner.seq,
        base_model=base_model,
        lora=lora,
        optimizer=optimizer,
        user_metadata={str(k)[:200]: str(v)[:2000] for k, v in list(user_metadata.items())[:64]},
    )
    session.add(row)
    session.flush()
    return row


def check_memory(path: Path, base_model: str, lora_rank: int, accelerators: dict[str, float]) -> None:
    """A training model whose state (``memory_plan.training_model_state``) fits no accelerator kind
    the operator declared (``RLOO_ACCELERATORS``) is a 400 at creation, not a failed first request. No
    kind declared, or a model whose files do not say its shape: not checked, as for jobs."""
    if not accelerators:
        return
    try:
        state = memory_plan.training_model_state(memory_plan.model_shape(path), lora_rank)
    except memory_plan.UnknownShape:
        return
    need = state["bytes_per_device"]
    if any(memory_plan.fits(need, accelerators).values()):
        return
    kind, gib = max(accelerators.items(), key=lambda kv: kv[1])
    trains = f"with LoRA rank {lora_rank}" if lora_rank else "training every weight"
    change = "a LoRA (rank 8 to 64) instead of every weight" if lora_rank == 0 else "a smaller base model"
    raise Invalid(
        f"A training model of '{base_model}' {trains} holds about {need / 2**30:.1f} GiB (weights, gradients "
        f"and AdamW's moments) before any batch; the largest accelerator here is {kind} with {gib:g} GiB, "
        f"{memory_plan.HEADROOM:.0%} of it usable. Ask for {change}.",
        param="lora_config",
        code="insufficient_memory",
    )


def get_model(session: Session, *, project: int, model_id: str, param: str = "model_id") -> TinkerModel:
    row = session.scalar(select(TinkerModel).where(TinkerModel.id == model_id, TinkerModel.project_seq == project))
    if row is None:
        raise NotFound(f"No training model '{model_id[:200]}'.", param=param, code="model_not_found")
    return row


def model_info(row: TinkerModel, models_dir: Path) -> dict[str, Any]:
    """The SDK's ``GetInfoResponse``. ``tokenizer_id`` is the base model's directory on the server,
    which ``get_tokenizer`` loads where client and server share a disk; elsewhere, a client loads
    the same tokenizer from a copy of the model."""
    path = models_dir / row.base_model
    info = inspect_model(path)
    return {
        "type": "get_info",
        "model_id": row.id,
        "model_data": {
            "arch": info.architecture if info else None,
            "model_name": row.base_model,
            "tokenizer_id": str(path),
        },
        "is_lora": row.lora is not None,
        "lora_rank": (row.lora or {}).get("rank"),
        "model_name": row.base_model,
        "optimizer_config": row.optimizer or {"type": "adamw"},
    }


def capabilities(models_dir: Path) -> list[dict[str, Any]]:
    """The base models under the models root that a training model can start from."""
    found = []
    for name in list_models(models_dir, limit=200):
        info = inspect_model(models_dir / name)
        if info is None or "policy" not in info.uses:
            continue
        found.append(
            {
                "model_name": name,
                "max_context_length": context_length(models_dir / name),
                "trainable": True,
                "sampleable": True,
            }
        )
    return found


# Checkpoints ----------------------------------------------------------------------------------------------
def find_checkpoint(session: Session, *, project: int, path: TinkerPath, param: str = "path") -> TinkerCheckpoint:
    model = get_model(session, project=project, model_id=path.model_id, param=param)
    row = session.scalar(
        select(TinkerCheckpoint).where(
            TinkerCheckpoint.model_seq == model.seq,
            TinkerCheckpoint.kind == path.kind,
            TinkerCheckpoint.name == path.name,
        )
    )
    if row is None or (row.expires_at is not None and row.expires_at <= now()):
        raise NotFound(f"No checkpoint '{path}'.", param=param, code="checkpoint_not_found")
    return row


def describe_checkpoint(row: TinkerCheckpoint, model_id: str) -> dict[str, Any]:
    """The SDK's ``Checkpoint``."""
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": KINDS[row.kind],
        "time": row.created_at,
        "tinker_path": str(TinkerPath(model_id, row.kind, row.name)),
        "size_bytes": row.size_bytes,
        "public": False,
        "user_metadata": row.user_metadata or None,
        "expires_at": row.expires_at,
    }

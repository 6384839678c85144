"""A checkpoint as one full model (``GET …/checkpoints/{id}/content?merged=true``): every LoRA adapter
of its fine-tuned chain merged into the weights before it, saved in safetensors with its tokenizer, so
that ``from_pretrained`` and ``vllm serve`` load the directory as it is. The API loads no weights: an
inference worker merges (``worker.serving.chores.export``), once, into
``<artifacts>/exports/<job id>/step-<N>``; later downloads read that directory (with an object
store, that key: the worker publishes it there)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from service import finetuned, inference
from service.artifacts import S3Store
from service.errors import APIError, no_inference_worker
from service.models import Checkpoint
from service.settings import Settings


def merged(session: Session, settings: Settings, *, project_seq: int, checkpoint: Checkpoint) -> Path | None:
    """The merged model directory of ``checkpoint``, made now if it is not yet; None when the
    checkpoint is a full model whose chain holds no adapter (its own directory is the merged model)."""
    name = checkpoint.fine_tuned_model_checkpoint or ""
    source = finetuned.find(session=session, project_seq=project_seq, name=name, include_deleted=True)
    if source is None:
        raise APIError(410, f"The checkpoints that {name} was trained from are gone.", code="checkpoint_gone")
    chain = [settings.artifacts_dir / path for path in source.chain]
    if not any((path / "adapter_config.json").is_file() for path in chain):
        return None
    job_dir = Path(checkpoint.path).parent.name
    target = settings.artifacts_dir / "exports" / job_dir / f"step-{checkpoint.step_number}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    envelope = {
        "id": f"export-{secrets.token_hex(12)}",
        "kind": "export",
        "servable": {"base": str(settings.models_dir / source.base_model), "chain": [str(p) for p in chain]},
        "target": str(target),
    }
    _ask(session, settings, envelope)
    return target


def merged_in_store(
    session: Session, settings: Settings, store: S3Store, *, project_seq: int, checkpoint: Checkpoint
) -> str | None:
    """``merged`` with an object store: the key of the merged model, made now by an inference
    worker (which fetches the chain and publishes the export as a checkpoint, marker last) if the
    store holds none yet; None when the chain holds no adapter."""
    name = checkpoint.fine_tuned_model_checkpoint or ""
    source = finetuned.find(session=session, project_seq=project_seq, name=name, include_deleted=True)
    if source is None:
        raise APIError(410, f"The checkpoints that {name} was trained from are gone.", code="checkpoint_gone")
    manifests = [store.manifest(path) for path in source.chain]
    if any(m is None for m in manifests):
        raise APIError(410, f"The checkpoints that {name} was trained from are gone.", code="checkpoint_gone")
    if not any("adapter_config.json" in (m or {}) for m in manifests):
        return None
    target = f"exports/{Path(checkpoint.path).parent.name}/step-{checkpoint.step_number}"
    if store.manifest(target) is not None:
        return target
    envelope = {
        "id": f"export-{secrets.token_hex(12)}",
        "kind": "export",
        "servable": {"base": str(settings.models_dir / source.base_model), "chain": list(source.chain)},
        "target": target,  # relative: a key the worker publishes to
    }
    _ask(session, settings, envelope)
    return target


def _ask(session: Session, settings: Settings, envelope: dict[str, Any]) -> None:
    """An inference worker makes the export of ``envelope``; its error answers as the API's."""
    session.close()  # the merge may take minutes: hold no database connection meanwhile
    try:
        answer = inference.ask(envelope, timeout=settings.inference_timeout_seconds)
    except inference.NoWorker:
        raise no_inference_worker("Merging an adapter needs an inference worker") from None
    except (inference.WorkerLost, inference.TimedOut):
        raise APIError(
            503,
            "The merged model is not ready yet; ask again in a minute (the inference worker goes on merging).",
            code="export_in_progress",
            headers={"Retry-After": "30"},
        ) from None
    if answer["t"] == "error":
        raise APIError(int(answer["status"]), answer["message"], code=answer["code"])

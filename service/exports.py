"""A checkpoint as one full model (``GET …/checkpoints/{id}/content?merged=true``): every LoRA adapter
of its fine-tuned chain merged into the weights before it, saved in safetensors with its tokenizer, so
that ``from_pretrained`` and ``vllm serve`` load the directory as it is. The API loads no weights: an
inference worker merges (``worker.serving.chores.export``), once, into
``<artifacts>/exports/<job id>/step-<N>``; later downloads read that directory."""

from __future__ import annotations

import secrets
from pathlib import Path

from sqlalchemy.orm import Session

from service import finetuned, inference
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
    return target

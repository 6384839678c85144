"""What an inference request's ``model`` serves, as directories an inference worker loads: a base
model under the models root, or a fine-tuned model or checkpoint id of the caller's project (its
base model and its chain of checkpoints, ``service.finetuned``). Anything else is OpenAI's 404.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service import finetuned
from service.errors import model_not_found
from service.modelroot import list_models
from service.settings import Settings


def resolve(session: Session, settings: Settings, *, project_seq: int, name: str) -> dict[str, Any]:
    """``{"base": <directory>, "chain": [<checkpoint directories>, oldest first]}`` for ``name``."""
    if finetuned.is_fine_tuned(name):
        source = finetuned.find(session=session, project_seq=project_seq, name=name)
        if source is None:
            raise model_not_found(name)
        chain = [settings.artifacts_dir / path for path in source.chain]
        if not all(path.is_dir() for path in chain):  # a checkpoint pruned by keep_checkpoints
            raise model_not_found(name)
        return {"base": str(settings.models_dir / source.base_model), "chain": [str(p) for p in chain]}
    if name in base_models(settings):
        return {"base": str(settings.models_dir / name), "chain": []}
    raise model_not_found(name)


def base_models(settings: Settings) -> list[str]:
    from service.routes.models import MAX_BASE_MODELS

    return list_models(settings.models_dir, limit=MAX_BASE_MODELS)

"""What an inference request's ``model`` serves, as directories an inference worker loads (or, for
checkpoints in an object store, the keys it fetches): a base model under the models root, or a
fine-tuned model or checkpoint id of the caller's project (its base model and its chain of
checkpoints, ``service.registry.finetuned``). Anything else is OpenAI's 404.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from service.core.errors import model_not_found
from service.core.settings import Settings
from service.files.upload_sweep import confined
from service.infra.artifacts import S3Store, open_store, relative_key
from service.registry import finetuned, inspection, model_ids


def resolve(
    session: Session, settings: Settings, *, project_seq: int, name: str, include_deleted: bool = False
) -> dict[str, Any]:
    """``{"base": <directory or hub id>, "chain": [<checkpoint directories>, oldest first]}`` for
    ``name``. ``include_deleted``: a deleted fine-tuned model still resolves (an evaluation of a job
    that trained from it)."""
    if model_ids.is_fine_tuned(name):
        source = finetuned.find(session=session, project_seq=project_seq, name=name, include_deleted=include_deleted)
        if source is None:
            raise model_not_found(name)
        return {"base": _base(settings, source.base_model), "chain": chain_of(settings, source.chain, name)}
    if _is_base_model(settings, name):
        return {"base": str(settings.models_dir / name), "chain": []}
    raise model_not_found(name)


def check_servable(served: dict[str, Any], name: str) -> None:
    """What ``resolve`` answered can write text: its base a causal LM with a tokenizer (a base under
    the models root; a hub id is the worker's to load)."""
    base = Path(served["base"])
    if base.is_absolute():
        inspection.check_policy(base, name, "model")


def context_of(served: dict[str, Any]) -> int | None:
    """The context length of what ``resolve`` answered: its base model's (None where the base is a
    hub id or its config does not say), read from its files while they are unchanged."""
    base = Path(served["base"])
    return inspection.context_length(base) if base.is_absolute() else None


def chain_of(settings: Settings, chain: tuple[str, ...], name: str) -> list[str]:
    """A fine-tuned chain's checkpoints as a worker finds them: directories under the artifacts root,
    or, with an object store, their keys (relative: the worker fetches them into its cache,
    ``worker.serving.model_cache.Servable.from_wire``). A checkpoint that is gone (pruned by
    ``keep_checkpoints``) is OpenAI's 404 of ``name``."""
    store = open_store(settings)
    try:
        if isinstance(store, S3Store):
            keys = [relative_key(path) for path in chain]
            if any(store.manifest(key) is None for key in keys):
                raise model_not_found(name)
            return keys
        paths = [confined(settings.artifacts_dir, path) for path in chain]
    except ValueError:
        raise model_not_found(name) from None
    if not all(path.is_dir() for path in paths):
        raise model_not_found(name)
    return [str(p) for p in paths]


def _is_base_model(settings: Settings, name: str) -> bool:
    """A Hugging Face model directory under the models root (``name`` or ``org/name``)."""
    if not name or "\x00" in name or name.startswith(("/", "~")) or name.count("/") > 1:
        return False
    try:
        return (confined(settings.models_dir, name) / "config.json").is_file()
    except (ValueError, OSError):
        return False


def _base(settings: Settings, base_model: str) -> str:
    """A fine-tuned model's base: its directory under the models root, or its hub id (a job trained on
    one where a hub is reachable)."""
    local = settings.models_dir / base_model
    return str(local) if local.is_dir() else base_model

"""The models root (RLOO_MODELS_DIR): a job's ``model``, and a reward or judge model's, names a
Hugging Face directory in it; a name that leaves it, or that the file system refuses, is a 400."""

from __future__ import annotations

from pathlib import Path

from service.core.errors import bad_request
from service.files.upload_sweep import confined


def resolve_model(models_dir: Path, name: str, *, hub_offline: bool, param: str) -> Path | str:
    """A job's ``model`` as a directory under the models root (or a hub id where a hub is reachable)."""
    if not name or "\x00" in name:
        raise bad_request("Give the model as a directory name under the models root.", param)
    if Path(name).is_absolute() or name.startswith("~"):
        raise bad_request(
            f"Model '{name}' is an absolute path; name the model directory relative to the models root "
            "(RLOO_MODELS_DIR).",
            param,
        )
    if len(name.encode()) > 1024 or any(len(part.encode()) > 255 for part in name.split("/")):
        raise bad_request(
            "Model names a directory under the models root: at most 255 bytes a path segment, 1024 in all.", param
        )
    try:
        path = confined(models_dir, name)
        is_dir = path.is_dir()
    except ValueError:
        raise bad_request(
            f"Model '{name}' points outside the models root; name a directory inside it.", param
        ) from None
    except OSError as exc:  # a name the file system refuses (ELOOP, ENAMETOOLONG, …)
        raise bad_request(
            f"Model '{name}' is not a directory name this server can use ({exc.strerror}).", param
        ) from None
    if is_dir:
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise bad_request(f"Model directory '{name}' has no config.json; it is not a Hugging Face model.", param)
        return path
    if not hub_offline and name.count("/") == 1 and ".." not in name:
        return name  # a hub id, loaded by the worker
    available = list_models(models_dir)
    how = (
        f"Models available: {', '.join(available)}."
        if available
        else "No model is there yet: the server's operator puts Hugging Face model directories under "
        "RLOO_MODELS_DIR (`rloo up` prints where it is), and `python -m worker.tiny.models <that directory>` "
        "builds the tiny models the examples name (tiny-policy, tiny-reward)."
    )
    raise bad_request(f"No model directory '{name}' under the models root. {how}", param, "model_not_found")


def list_models(models_dir: Path, *, limit: int = 20) -> list[str]:
    """Model directories under the root (one or two levels deep: ``name`` or ``org/name``), at most ``limit``."""
    if not models_dir.is_dir():
        return []
    found = []
    for config in sorted(models_dir.glob("*/config.json")) + sorted(models_dir.glob("*/*/config.json")):
        found.append(str(config.parent.relative_to(models_dir)))
    return found[:limit]

"""What an inference worker loads when it starts (``RLOO_INFERENCE_PRELOAD``), so that the first chat
request does not wait for a model to load: a worker that has loaded them says so in its heartbeat
(``inference_bus``'s ``warm``), and ``rloo up`` waits for that before it says it is up.

Requests that arrive meanwhile wait in the queue, as they would behind a batch. A model that does
not load is logged and skipped: nothing here ends the worker."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from worker.serving.decode import Row
from worker.serving.model_cache import Servable

log = logging.getLogger("rloo.serve")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def preload_dirs(setting: str, models_dir: Path) -> list[Path]:
    """The model directories ``setting`` names: ``all`` (every model under the root that writes text,
    smallest first), or names under the root, comma-separated, in their order; a name that is not a
    model there is logged and left out."""
    from service.files.upload_sweep import confined
    from service.registry.inspection import inspect_model
    from service.registry.model_root import list_models

    setting = setting.strip()
    if not setting:
        return []
    if setting == "all":
        found = [models_dir / name for name in list_models(models_dir, limit=1000)]
        writers = [p for p in found if (info := inspect_model(p)) is not None and "policy" in info.uses]
        return sorted(writers, key=lambda p: (weight_bytes(p), str(p)))
    dirs = []
    for name in (n.strip() for n in setting.split(",")):
        try:
            path = confined(models_dir, name) if name else None
        except ValueError:
            path = None
        if path is None or not (path / "config.json").is_file():
            log.warning("RLOO_INFERENCE_PRELOAD names %r, which is no model directory under %s", name, models_dir)
            continue
        dirs.append(path)
    return dirs


def weight_bytes(path: Path) -> int:
    """The bytes of a model directory's weights: its safetensors files, else its ``.bin`` or ``.pt``
    ones (never both: a directory may hold the two formats)."""
    files = [f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    return sum(f.stat().st_size for f in safetensors or files)


def served_bytes(path: Path, element_size: int) -> int:
    """The bytes its weights take once loaded at ``element_size`` bytes a parameter (its parameter
    count from the safetensors headers; else its weight files' size)."""
    from service.registry.memory_plan import UnknownShape, model_shape

    try:
        return model_shape(path).parameters * element_size
    except UnknownShape:
        return weight_bytes(path)


def preload(cache: Any, dirs: list[Path]) -> list[Path]:
    """Each of ``dirs`` loaded into ``cache`` and one token decoded on it (the first forward's one-off
    costs paid here): one whose weights do not fit what is left of the cache's memory
    (``RLOO_INFERENCE_MEMORY_MB``) is skipped, and loading stops where one would unload a model
    loaded before, or at the bases a vLLM worker holds at once; the directories loaded."""
    loaded: list[Any] = []
    done: list[Path] = []
    most = getattr(cache, "bases_at_once", None)
    budget = getattr(cache, "budget", None)
    for path in dirs:
        if most is not None and len(done) >= most:
            break
        if budget is not None and not fits(cache, path, budget - sum(m.total_bytes for m in loaded)):
            continue
        started = time.monotonic()
        try:
            model, _ = cache.get(Servable(path))
            first = model.tokenizer.bos_token_id or model.tokenizer.eos_token_id or 0
            rows = [Row(request="preload", index=0, prompt_ids=[int(first)], max_tokens=1, temperature=0)]
            for _ in cache.decode(model, rows):
                pass
        except Exception as exc:  # a broken directory: its own requests will say so
            log.warning("could not preload %s: %s", path, exc)
            continue
        if not all(cache.holds(earlier) for earlier in loaded):
            log.info("preloading stopped at %s: the worker's memory holds no more (RLOO_INFERENCE_MEMORY_MB)", path)
            break
        loaded.append(model)
        done.append(path)
        log.info("preloaded %s in %.1f s", path.name, time.monotonic() - started)
    return done


def fits(cache: Any, path: Path, room: int) -> bool:
    """Whether ``path``'s weights, as the cache would serve them, fit in ``room`` bytes; a model that
    does not is left to its first request (a 7B model on a laptop is not loaded unasked)."""
    from worker.serving.model_cache import serving_dtype

    size = served_bytes(path, serving_dtype(cache.device).itemsize)
    if size <= room:
        return True
    log.info(
        "not preloading %s: its weights (%.1f GiB as served) do not fit the %.1f GiB left of RLOO_INFERENCE_MEMORY_MB",
        path.name,
        size / 2**30,
        max(0, room) / 2**30,
    )
    return False

"""The models an inference worker keeps loaded: base models (with the weights of a fine-tuned chain's
full checkpoints and earlier adapters merged in), and LoRA adapters loaded on them as adapters, not
as merged copies, so ten LoRA jobs of one base cost one base and ten adapters. Least recently used
ones are unloaded once their weights would pass the worker's memory budget.

A request names what to serve as the API resolved it (``service.registry.weights``): the base model's
directory, and the fine-tuned chain's checkpoint directories, oldest first. The last one, when it is
a LoRA adapter, is served as an adapter; everything before it makes the base.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.engine.errors import JobError
from worker.serving.decode import Batch, Delta, Row

log = logging.getLogger("rloo.serve")


def is_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def _checkpoint(entry: str) -> Path:
    if Path(entry).is_absolute():
        return Path(entry)
    from service.core.settings import get_settings
    from service.infra.artifacts import open_store

    return open_store(get_settings()).fetch_checkpoint(entry)


@dataclass(frozen=True)
class Servable:
    """What one model id serves: ``base`` (a model directory), ``chain`` (checkpoint directories
    applied to it, oldest first)."""

    base: Path
    chain: tuple[Path, ...] = ()

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Servable:
        """What the API sent (``service.registry.weights.resolve``): a relative chain entry is a key of the
        object store, fetched into this host's cache (once: ``S3Store.fetch_checkpoint``)."""
        return cls(Path(data["base"]), tuple(_checkpoint(p) for p in data.get("chain", ())))

    @property
    def adapter(self) -> Path | None:
        return self.chain[-1] if self.chain and is_adapter(self.chain[-1]) else None

    @property
    def base_key(self) -> tuple[Path, tuple[Path, ...]]:
        """The weights every adapter on this base shares: the chain but its last adapter."""
        return (self.base, self.chain[:-1] if self.adapter is not None else self.chain)

    @property
    def tokenizer_dir(self) -> Path:
        return self.chain[-1] if self.chain else self.base


@dataclass
class Loaded:
    """A base model in memory, with the adapters loaded on it."""

    model: Any
    tokenizer: Any
    context: int | None
    nbytes: int
    adapters: OrderedDict[Path, tuple[str, int]] = field(default_factory=OrderedDict)
    """adapter directory -> (its peft name, its bytes), least recently used first."""

    @property
    def total_bytes(self) -> int:
        return self.nbytes + sum(size for _, size in self.adapters.values())


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def serving_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device computes in it natively (CUDA with bf16), fp32 elsewhere."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


class ModelCache:
    def __init__(self, *, device: torch.device, budget_bytes: int) -> None:
        self.device, self.budget = device, budget_bytes
        self.bases: OrderedDict[tuple[Path, tuple[Path, ...]], Loaded] = OrderedDict()
        self.loads = 0  # bases and adapters loaded from disk (the figures and tests read it)

    def get(self, servable: Servable) -> tuple[Loaded, str | None]:
        """The loaded base of ``servable`` and the name of its adapter on it (None: the base itself)."""
        key = servable.base_key
        loaded = self.bases.get(key)
        if loaded is None:
            loaded = self._load_base(servable)
            self.bases[key] = loaded
        self.bases.move_to_end(key)
        name = None
        if servable.adapter is not None:
            name = self._adapter(loaded, servable.adapter)
        self._fit(keep=key)
        return loaded, name

    def holds(self, loaded: Loaded) -> bool:
        """Whether ``loaded`` is still one of the models kept (not unloaded past the budget since)."""
        return any(kept is loaded for kept in self.bases.values())

    def decode(
        self, loaded: Loaded, rows: list[Row], cancelled: Any = lambda: set(), joining: Any = lambda: []
    ) -> Iterator[list[Delta]]:
        """Decode ``rows`` on ``loaded`` in one batch (``worker.serving.decode``), a step at a time,
        rows that ``joining()`` gives joining it."""
        return Batch(loaded.model, loaded.tokenizer, rows, context=loaded.context).run(cancelled, joining)

    def _load_base(self, servable: Servable) -> Loaded:
        from worker.engine.modeling import load_causal_lm, load_tokenizer, without_dropout
        from worker.engine.prepare import start_from

        model = load_causal_lm(servable.base, self.device, name=servable.base.name)
        model = start_from(model, servable.base_key[1], self.device)
        model = model.to(serving_dtype(self.device)).eval()
        without_dropout(model)
        tokenizer = load_tokenizer(servable.tokenizer_dir, name=servable.tokenizer_dir.name)
        context = getattr(model.config, "max_position_embeddings", None)
        self.loads += 1
        log.info("loaded %s (%d checkpoints applied)", servable.base.name, len(servable.base_key[1]))
        return Loaded(model, tokenizer, context, _bytes(model.parameters()))

    def _adapter(self, loaded: Loaded, path: Path) -> str:
        if path in loaded.adapters:
            loaded.adapters.move_to_end(path)
            return loaded.adapters[path][0]
        from peft import PeftModel

        name = "a" + hashlib.sha1(str(path).encode()).hexdigest()[:16]
        before = _bytes(loaded.model.parameters())
        try:
            if hasattr(loaded.model, "peft_config"):
                loaded.model.load_adapter(path, adapter_name=name)
            else:
                loaded.model = PeftModel.from_pretrained(loaded.model, path, adapter_name=name)
        except (OSError, ValueError, KeyError) as exc:
            raise JobError("model_load_failed", f"could not load the fine-tuned adapter: {exc}") from None
        loaded.model.to(serving_dtype(self.device)).eval()
        self.loads += 1
        loaded.adapters[path] = (name, _bytes(loaded.model.parameters()) - before)
        return name

    def _fit(self, *, keep: tuple[Path, tuple[Path, ...]]) -> None:
        """Unload least recently used adapters and bases until the rest fit the budget (never the
        base ``keep``, which is about to be used)."""
        while sum(b.total_bytes for b in self.bases.values()) > self.budget:
            victim = next((k for k in self.bases if k != keep), None)
            if victim is not None:
                log.info("unloading %s (memory budget)", victim[0].name)
                del self.bases[victim]
                continue
            loaded = self.bases[keep]
            if len(loaded.adapters) <= 1:
                return  # one model and its adapter: served even over the budget
            path, (name, _) = next(iter(loaded.adapters.items()))
            loaded.model.delete_adapter(name)
            del loaded.adapters[path]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

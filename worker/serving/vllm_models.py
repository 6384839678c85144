"""The inference worker on vLLM (``RLOO_INFERENCE_BACKEND=vllm``, or ``auto`` on a CUDA host where
vLLM is installed): the same interface as ``ModelCache`` (``get`` a servable, ``decode`` rows), with
one vLLM engine per base model and LoRA checkpoints served through vLLM's LoRA support
(``LoRARequest``), so adapters of one base share its engine and batch together.

A base whose fine-tuned chain has checkpoints before its last adapter (a full checkpoint, earlier
adapters) is merged once into ``<artifacts>/exports/bases/<digest>`` for vLLM to load
(``worker.serving.between_batches.export``). vLLM decodes a batch whole: its rows' text arrives in one piece at
their end, not token by token (streams still stream, in one chunk a choice), and a client that leaves
is dropped before the batch starts, not during it. A base's engine takes
``RLOO_VLLM_GPU_MEMORY_UTILIZATION`` of the GPU; an engine for another base replaces it.

Not exercised on this project's CI (no GPU): its tests drive it with the stand-in ``vllm`` module
``tests/fakes/vllm``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker.engine.errors import JobError
from worker.serving.decode import Delta, Row, end_ids
from worker.serving.model_cache import Loaded, Servable

MAX_LORA_RANK = 64


class VLLMModels:
    bases_at_once = 1
    """One engine, for one base (its adapters on it): a second base replaces it."""

    def __init__(self, *, artifacts_dir: Path, gpu_memory_utilization: float, max_loras: int = 8) -> None:
        import torch

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.artifacts_dir, self.share, self.max_loras = artifacts_dir, gpu_memory_utilization, max_loras
        self.key: Any = None
        self.loaded: Loaded | None = None
        self.adapters: dict[Path, int] = {}  # adapter directory -> its LoRA id in the engine
        self.eos: list[int] = []
        self.loads = 0

    def get(self, servable: Servable) -> tuple[Loaded, str | None]:
        if self.key != servable.base_key or self.loaded is None:
            self._unload()
            self.loaded, self.key, self.adapters = self._engine(servable), servable.base_key, {}
        adapter = servable.adapter
        if adapter is None:
            return self.loaded, None
        self.adapters.setdefault(adapter, len(self.adapters) + 1)
        return self.loaded, str(adapter)

    def _unload(self) -> None:
        """The engine of the base before, out of GPU memory before the next one takes its share. (An
        engine in this process does not always give all of it back: a worker that serves several bases
        in turn is best given one base, or run with vLLM's multiprocessing.)"""
        if self.loaded is None:
            return
        import gc

        import torch

        self.loaded, self.key = None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _engine(self, servable: Servable) -> Loaded:
        from vllm import LLM

        from worker.engine.modeling import load_tokenizer

        base, prefix = servable.base_key
        path = base
        if prefix:  # full checkpoints or earlier adapters: one merged directory for vLLM to load
            from worker.serving.between_batches import export

            digest = hashlib.sha256("\0".join(map(str, (base, *prefix))).encode()).hexdigest()[:24]
            path = self.artifacts_dir / "exports" / "bases" / digest
            path.parent.mkdir(parents=True, exist_ok=True)
            export(Servable(base, prefix), path)
        tokenizer = load_tokenizer(servable.tokenizer_dir, name=servable.tokenizer_dir.name)
        try:
            llm = LLM(
                model=str(path),
                tokenizer=str(servable.tokenizer_dir),
                dtype="auto",
                gpu_memory_utilization=self.share,
                enable_lora=True,
                max_loras=self.max_loras,
                max_lora_rank=MAX_LORA_RANK,
                enable_prefix_caching=True,
                seed=0,
            )
        except Exception as exc:
            raise JobError("model_load_failed", f"vLLM could not load the model: {exc}") from None
        self.loads += 1
        self.eos = sorted(end_ids(_eos_ids(path, tokenizer), tokenizer))
        from transformers import AutoConfig

        length = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        return Loaded(model=llm, tokenizer=tokenizer, context=length, nbytes=0)

    def holds(self, loaded: Loaded) -> bool:
        """Always: vLLM decodes a batch whole, so no decoding is paused across another's batches."""
        return True

    def decode(
        self, loaded: Loaded, rows: list[Row], cancelled: Any = lambda: set(), joining: Any = None
    ) -> Iterator[list[Delta]]:
        """Every row at once through vLLM: one list of deltas, each row's whole text and its end
        (nothing joins a batch under way: requests that arrive meanwhile make the next one)."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        gone = cancelled()
        rows = [r for r in rows if r.request not in gone]
        if not rows:
            return
        params = [
            SamplingParams(
                n=1,
                temperature=r.temperature,
                top_p=r.top_p,
                max_tokens=r.max_tokens,
                stop=list(r.stop),
                stop_token_ids=self.eos,
                seed=r.seed,
            )
            for r in rows
        ]
        loras = [
            None
            if r.adapter is None
            else LoRARequest(f"a{self.adapters[Path(r.adapter)]}", self.adapters[Path(r.adapter)], r.adapter)
            for r in rows
        ]
        outputs = loaded.model.generate(
            [{"prompt_token_ids": r.prompt_ids} for r in rows], params, use_tqdm=False, lora_request=loras
        )
        deltas = []
        for row, output in zip(rows, outputs, strict=True):
            out = output.outputs[0]
            row.tokens = list(out.token_ids)
            # vLLM leaves a stopping EOS out of token_ids (its stop_reason: None, or the token id of a
            # stop_token_ids entry, one of end_ids); it was drawn, so the usage counts it. A stop
            # string is no token.
            ended_on_eos = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            row.sampled = len(row.tokens) + int(ended_on_eos)
            row.text, row.finish_reason = out.text, "stop" if out.finish_reason == "stop" else "length"
            deltas.append(Delta(row, out.text, row.finish_reason))
        yield deltas


def _eos_ids(path: Path, tokenizer: Any) -> list[int]:
    """The end-of-sequence ids: the generation config's and the tokenizer's."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} - {None}
    try:
        value = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        value = None
    ids |= set(value if isinstance(value, list) else [value]) - {None}
    return sorted(ids)


def choose(settings: Any, device: Any) -> bool:
    """Whether this inference worker serves with vLLM: asked for, or ``auto`` with vLLM and a GPU."""
    from worker.engine.rollout.backends import vllm_installed

    choice = settings.inference_backend
    return choice == "vllm" or (choice == "auto" and device.type == "cuda" and vllm_installed())

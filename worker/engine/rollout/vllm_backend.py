"""Rollouts with vLLM, beside the policy on the same GPU (``RLOO_ROLLOUT_BACKEND=vllm``, or ``auto``
on a CUDA host where vLLM is installed: ``pip install vllm``).

vLLM samples; the policy (transformers) still computes every log-prob the update uses, so the
importance ratio of the first pass is exactly 1. vLLM's own log-probs of what it sampled come back
too (``Rollout.sampler_logprobs``): its kernels round differently, and a sync that failed would
leave it sampling from old weights, so the update weighs each token by the trainer's probability
over the sampler's, truncated (``sampler_correction``: TIS), and reports the mismatch. After each
optimizer step the policy's weights are loaded into the engine before it samples again (LoRA
adapters merged for the copy). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
as TRL's colocated mode does, and takes ``gpu_memory_utilization`` of the GPU (0.3 unless set).

A job on several ranks runs one engine a rank (``external_launcher``: each on its rank's device, in
its process), and the weights pushed into it come from the sharded policy one tensor at a time,
gathered from the ranks' shards as they go in: no rank ever holds a second whole copy. Its engines
sleep between sampling phases (vLLM's sleep mode, level 2; ``vllm_options.sleep_mode`` turns it on
for one process too): weights and KV cache let go while the policy updates, which keeps a
colocated engine and an update from running the GPU out of memory; a phase wakes the weights,
loads the policy's, then wakes the KV cache.

Not exercised on this project's CI (no GPU): its tests drive it with a stand-in ``vllm`` module that
has the same surface (``tests/fakes/vllm``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from worker.engine.distributed.ranks import current, whole_tensor
from worker.engine.errors import JobError
from worker.engine.rollout.base import Rollout, Sampling, _eos_ids, group_seed, right_padded

# Where vLLM keeps the model it runs, by version (V1 in-process engine first).
_MODEL_PATHS = (
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.model_runner.model",
)


class VLLMBackend:
    name = "vllm"

    def __init__(
        self, model: Any, tokenizer: Any, sampling: Sampling, *, options: dict[str, Any] | None = None
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        from vllm import LLM

        options = dict(options or {})
        self.sleep_mode = bool(options.pop("sleep_mode", current().distributed))
        if current().distributed:
            options.setdefault("distributed_executor_backend", "external_launcher")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.max_prompt_length = sampling.max_new_tokens, sampling.max_prompt_length
        self.temperature, self.top_p, self.stop = sampling.temperature, sampling.top_p, list(sampling.stop)
        # The log-probs it reports must be of the distribution it samples from (temperature applied):
        # vLLM reports raw ones unless asked (logprobs_mode, vLLM 0.10.2 on); an older vLLM's are not
        # comparable at a temperature other than 1, and the update goes uncorrected.
        self.logprobs_comparable = (self.temperature, self.top_p) == (1.0, 1.0)
        if not self.logprobs_comparable and _takes_logprobs_mode():
            options.setdefault("logprobs_mode", "processed_logprobs")
            self.logprobs_comparable = True
        self.eos_ids = _eos_ids(model, tokenizer)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = str(options.pop("model_path", None) or base.config.name_or_path)
        try:
            self.llm = LLM(
                model=path,
                tokenizer=path,
                dtype=options.pop("dtype", "auto"),
                gpu_memory_utilization=float(options.pop("gpu_memory_utilization", 0.3)),
                max_model_len=sampling.max_context or self.max_prompt_length + self.max_new_tokens,
                enable_prefix_caching=True,  # a prompt's k samples share its prefill
                enable_sleep_mode=self.sleep_mode,
                seed=0,
                **options,
            )
        except Exception as exc:
            raise JobError(
                "rollout_backend_failed",
                f"vLLM could not start on '{path}': {type(exc).__name__}: {exc}. "
                "Set RLOO_ROLLOUT_BACKEND=transformers to sample with the policy itself.",
            ) from None
        self.stale = True  # the policy may already differ from the files (a resumed run)
        self.asleep = False

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """The engine awake, with the policy's newest weights, for one phase of sampling; asleep
        again after it. Every rank enters it together: pushing a sharded policy's weights gathers
        them; ``generate`` itself makes no collective."""
        self._wake()
        try:
            yield
        finally:
            self._sleep()

    def _wake(self) -> None:
        """Weights first (the policy's loaded into them), then the KV cache: the two never need
        memory at once with the update's."""
        if self.asleep:
            _wake_up(self.llm, "weights")
            self.stale = True  # a level-2 sleep let its weights go
        if self.stale:
            self._push_weights()
            self.stale = False
        if self.asleep:
            _wake_up(self.llm, "kv_cache")
            self.asleep = False

    def _sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def sync(self) -> None:
        self.stale = True  # pushed before the next generate: one copy per step, not per call

    def _push_weights(self) -> None:
        target = None
        for dotted in _MODEL_PATHS:
            obj: Any = self.llm
            for part in dotted.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if obj is not None and hasattr(obj, "load_weights"):
                target = obj
                break
        if target is None:
            raise JobError(
                "rollout_backend_failed",
                "this vLLM version does not expose its model for in-process weight updates; "
                "set RLOO_ROLLOUT_BACKEND=transformers",
            )
        with torch.no_grad():
            target.load_weights(_policy_weights(self.model))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached prefixes were computed with the old weights

    def generate(self, prompts: list[str], *, k: int, generator_seed: int, first: int = 0) -> Rollout:
        tok = self.tokenizer
        encoded = [
            tok(p, add_special_tokens=False, truncation=True, max_length=self.max_prompt_length)["input_ids"]
            for p in prompts
        ]
        return self._generate(encoded, k, [group_seed(generator_seed, first + i) for i in range(len(encoded))])

    def generate_ids(
        self, prompt_ids: list[list[int]], *, generator_seed: int, rows: list[int], max_new_tokens: int | None = None
    ) -> Rollout:
        """One completion of each prompt given as token ids (a multi-turn rollout's context),
        prompt ``b``'s seeded by ``group_seed(generator_seed, rows[b])``, at most ``max_new_tokens``."""
        seeds = [group_seed(generator_seed, r) for r in rows]
        return self._generate([list(p) for p in prompt_ids], 1, seeds, max_new_tokens)

    def _generate(
        self, encoded: list[list[int]], k: int, seeds: list[int], max_new_tokens: int | None = None
    ) -> Rollout:
        from vllm import SamplingParams

        if self.stale or self.asleep:  # called outside ``sampling`` (one process only)
            self._wake()
        tok = self.tokenizer
        params = [
            SamplingParams(
                n=k,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=min(self.max_new_tokens, max_new_tokens or self.max_new_tokens),
                stop=self.stop or None,
                stop_token_ids=self.eos_ids,
                seed=seeds[i] % 2**31,
                skip_special_tokens=True,
                logprobs=0,  # the sampled token's own: the trainer-sampler mismatch (``sampler_correction``)
            )
            for i in range(len(encoded))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False)
        rows: list[list[int]] = []
        logprobs: list[list[float]] = []
        texts: list[str] = []
        truncated: list[bool] = []
        for out in outputs:  # in prompt order; each with its k samples
            for sample in sorted(out.outputs, key=lambda o: o.index):
                ids = list(sample.token_ids)
                logprobs.append(_sampled_logprobs(sample, ids))
                ended_by_eos = sample.finish_reason == "stop" and sample.stop_reason is None
                if ended_by_eos and (not ids or ids[-1] not in self.eos_ids):
                    ids.append(self.eos_ids[0])  # the EOS carries loss, as in the transformers backend
                rows.append(ids)
                texts.append(sample.text)
                truncated.append(sample.finish_reason == "length")
        device = next(self.model.parameters()).device
        completion_ids, completion_mask = right_padded(rows, tok.pad_token_id)
        sampler = torch.full(completion_ids.shape, math.nan)
        for i, row in enumerate(logprobs):
            sampler[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        padded = tok.pad({"input_ids": encoded}, padding=True, return_tensors="pt")  # left: the tokenizer's side
        return Rollout(
            padded["input_ids"].repeat_interleave(k, dim=0).to(device),
            padded["attention_mask"].repeat_interleave(k, dim=0).to(device),
            completion_ids.to(device),
            completion_mask.to(device),
            torch.tensor(truncated, device=device),
            texts,
            k,
            sampler_logprobs=sampler.to(device) if self.logprobs_comparable else None,
        )


def _takes_logprobs_mode() -> bool:
    """Whether this vLLM's engine takes ``logprobs_mode``."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    return dataclasses.is_dataclass(EngineArgs) and any(
        f.name == "logprobs_mode" for f in dataclasses.fields(EngineArgs)
    )


def _sampled_logprobs(sample: Any, ids: list[int]) -> list[float]:
    """The log-probability vLLM gave each of ``ids`` (its ``logprobs``, one dict a token, the sampled
    token's among them); NaN where it gave none."""
    given = getattr(sample, "logprobs", None) or []
    out = []
    for position, token in enumerate(ids):
        entry = given[position].get(token) if position < len(given) and given[position] else None
        out.append(float(entry.logprob) if entry is not None else math.nan)
    return out


def _wake_up(llm: Any, tag: str) -> None:
    try:
        llm.wake_up(tags=[tag])
    except TypeError:  # a vLLM that wakes everything at once
        if tag == "weights":
            llm.wake_up()


def _policy_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the base model's names, one tensor at a time; LoRA adapters
    merged in for the copy (the policy's own weights are left as they were)."""
    if not hasattr(model, "peft_config"):
        for name, tensor in model.state_dict().items():
            yield name, whole_tensor(tensor)  # a shard gathered as it goes, in the same order on every rank
        return
    if not current().distributed:
        yield from _merged_in_place(model)
        return
    deltas = _lora_deltas(model)
    for name, tensor in model.state_dict().items():
        if "lora_" in name or "modules_to_save" in name:
            continue
        whole = whole_tensor(tensor).detach()
        delta = deltas.get(name)
        yield _base_name(name), whole + delta().to(whole.dtype) if delta is not None else whole


def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _merged_in_place(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One process: peft merges every adapter kind it knows into the weights, then takes it out."""
    model.merge_adapter()
    try:
        for name, tensor in model.state_dict().items():
            if "lora_" in name or "modules_to_save" in name:
                continue
            # A copy: the merged values must survive the unmerge, however the engine consumes these.
            yield _base_name(name), tensor.detach().clone()
    finally:
        model.unmerge_adapter()


def _lora_deltas(model: Any) -> dict[str, Any]:
    """For each adapted weight's state-dict name, a function giving its LoRA delta (scaling x B @ A,
    each factor gathered whole from the ranks' shards), evaluated when that weight goes to the
    engine. Linear and embedding adapters; any other kind (DoRA) is refused rather than pushed wrong."""
    from peft.tuners.lora import LoraLayer

    names = {id(t): n for n, t in model.named_parameters()}
    deltas: dict[str, Any] = {}
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.active_adapters:
            if getattr(module, "use_dora", {}).get(adapter):
                raise JobError("rollout_backend_failed", "DoRA adapters cannot be pushed to vLLM from sharded ranks")
            scale = module.scaling[adapter]
            if adapter in module.lora_A:
                a, b, transpose = module.lora_A[adapter].weight, module.lora_B[adapter].weight, False
            elif adapter in getattr(module, "lora_embedding_A", {}):
                a, b, transpose = module.lora_embedding_A[adapter], module.lora_embedding_B[adapter], True
            else:
                continue
            transpose ^= bool(getattr(module, "fan_in_fan_out", False))

            def delta(a: Any = a, b: Any = b, scale: float = scale, transpose: bool = transpose) -> torch.Tensor:
                product = (whole_tensor(b).detach() @ whole_tensor(a).detach()) * scale
                return product.T if transpose else product

            deltas[names[id(module.get_base_layer().weight)]] = delta
    return deltas

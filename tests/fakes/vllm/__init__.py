"""A stand-in for vLLM's offline API, only the surface ``worker.engine.rollout.vllm_backend`` uses (``LLM``,
``SamplingParams``, the engine's model ``load_weights``, ``reset_prefix_cache``), backed by a
transformers model on the CPU. vLLM itself needs a GPU, which the CI does not have.

Like vLLM, it stops at ``stop_token_ids`` without putting the EOS in ``token_ids`` (the backend
must add it back) and at ``stop`` strings, which it leaves out of ``text``; temperature 0 is greedy;
a prompt's ``LoRARequest`` (``vllm.lora.request``) runs it through that adapter on the base.
Its sleep mode keeps vLLM's rules: ``sleep(level=2)`` lets the weights and the KV cache go, so
loading weights before ``wake_up(tags=["weights"])`` or generating before the KV cache is awake
raises, as it would fail on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch


class SamplingParams:
    def __init__(
        self,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 16,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        skip_special_tokens: bool = True,
        logprobs: int | None = None,
    ) -> None:
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.stop, self.stop_token_ids, self.seed = stop or [], stop_token_ids or [], seed
        self.logprobs = logprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: Any = None
    logprobs: list[dict[int, Any]] | None = None
    """With ``SamplingParams(logprobs=0)``: a dict a token of ``token_ids``, the sampled token's
    ``Logprob`` (``.logprob``: of the raw distribution, or with ``LLM(logprobs_mode="processed_logprobs")``
    of the one it was sampled from, at the temperature)."""


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


class _Runner:
    """Where the engine keeps its model: ``load_weights`` takes (name, tensor) pairs."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.pushes: list[dict[str, Any]] = []
        self.asleep: set[str] = set()

    def load_weights(self, weights: Any) -> None:
        if "weights" in self.asleep:
            raise RuntimeError("load_weights on a sleeping engine: wake_up(tags=['weights']) first")
        state = {name: tensor.detach().clone() for name, tensor in weights}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        self.pushes.append(
            {
                "names": sorted(state),
                "missing": list(missing),
                "unexpected": list(unexpected),
                "checksum": float(sum(t.double().sum() for t in state.values())),
            }
        )


class LLM:
    instances: list[LLM] = []

    def __init__(self, model: str, tokenizer: str, **options: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.options = options
        self.hf = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tok = AutoTokenizer.from_pretrained(tokenizer)
        self.runner = _Runner(self.hf)
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.runner))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))
        self.prefix_cache_resets = 0
        self.sleeps = 0
        LLM.instances.append(self)

    def sleep(self, level: int = 1) -> None:
        if not self.options.get("enable_sleep_mode"):
            raise ValueError("sleep mode is not enabled (enable_sleep_mode=True)")
        self.runner.asleep = {"weights", "kv_cache"}
        if level == 2:  # the weights are discarded, not kept on the CPU
            self.hf.apply(lambda m: [p.data.zero_() for p in m.parameters(recurse=False)])
        self.sleeps += 1

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.runner.asleep -= set(tags or ("weights", "kv_cache"))

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    def _with(self, lora: Any) -> Any:
        """The model a LoRA request runs on: the base with that adapter (loaded once)."""
        if lora is None:
            return self.hf
        if not self.options.get("enable_lora"):
            raise ValueError("LoRA is not enabled (enable_lora=True)")
        adapted = self.__dict__.setdefault("adapted", {})
        if lora.lora_path not in adapted:
            import copy

            from peft import PeftModel

            adapted[lora.lora_path] = PeftModel.from_pretrained(copy.deepcopy(self.hf), lora.lora_path).eval()
        return adapted[lora.lora_path]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[dict[str, Any]],
        params: list[SamplingParams],
        use_tqdm: bool = True,
        lora_request: list[Any] | None = None,
    ) -> list[RequestOutput]:
        if self.runner.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.runner.asleep)} asleep)")
        outputs = []
        for n_prompt, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            model = self._with(lora_request[n_prompt] if lora_request else None)
            gen = torch.Generator().manual_seed(p.seed or 0)
            request = RequestOutput()
            for i in range(p.n):
                seq = torch.tensor([prompt["prompt_token_ids"]])
                ids: list[int] = []
                given: list[dict[int, Any]] = []
                finish, stop_reason, text = "length", None, ""
                for _ in range(p.max_tokens):
                    logits = model(input_ids=seq).logits[0, -1].float()
                    if p.temperature == 0:
                        token = int(logits.argmax())
                    else:
                        token = int(torch.multinomial(torch.softmax(logits / p.temperature, -1), 1, generator=gen))
                    if token in p.stop_token_ids:
                        finish = "stop"
                        break
                    ids.append(token)
                    # Raw log-probs (temperature 1), as vLLM's, unless processed ones were asked for.
                    processed = self.options.get("logprobs_mode") == "processed_logprobs"
                    logp = torch.log_softmax(logits / (p.temperature if processed and p.temperature else 1.0), -1)[
                        token
                    ]
                    given.append({token: SimpleNamespace(logprob=float(logp))})
                    seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
                    text = self.tok.decode(ids, skip_special_tokens=True)
                    hit = [s for s in p.stop if s in text]
                    if hit:
                        finish, stop_reason = "stop", hit[0]
                        text = text[: text.find(hit[0])]
                        break
                logprobs = given if p.logprobs is not None else None
                request.outputs.append(CompletionOutput(i, text, ids, finish, stop_reason, logprobs))
            outputs.append(request)
        return outputs
